"""A run's inputs (lm/rl/build.py): the held-out rows of a run with its own prompts are a split of those
prompts (heldout_prompts auto), never the demo's, and never trained on; a set too small to split says so."""

import json

import pytest

from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.lm.data.prompts import load_prompts, split_heldout
from ppoforge.lm.rl.build import build_inputs
from ppoforge.lm.rl.config import RLHFConfig

WORDS = ["rain", "coffee", "city", "friend", "movie", "book", "morning", "night", "weather", "food", "sun", "train"]


def _prompts(path, n):
    """n distinct short prompts as a .jsonl file."""
    texts = [f"write about the {WORDS[i % len(WORDS)]} {i}" for i in range(n)]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return texts


def _cli(capsys, *args):
    code = main(["train", "rlhf", *args])
    return code, capsys.readouterr().err


def test_a_run_on_its_own_prompts_evaluates_a_split_of_them_and_never_trains_on_it(tiny_lm_dir, tmp_path, capsys):
    texts = _prompts(tmp_path / "prompts.jsonl", 60)  # 5 %: 3 held out
    run = tmp_path / "run"
    common = ["--model", str(tiny_lm_dir), "--prompts", str(tmp_path / "prompts.jsonl"), "--reward", "length:4",
              "--batch-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "2", "--max-new-tokens", "3",
              "--max-prompt-tokens", "64", "--heldout-samples", "1", "--progress", "false", "--tensorboard", "false",
              "--ppo-epochs", "1", "--torch-threads", "1", "--device", "cpu"]
    code, err = _cli(capsys, "--total-updates", "8", "--run-dir", str(run), *common)  # 32 prompts: most of them
    assert code == 0, err
    line = [x for x in err.splitlines() if x.startswith("ppoforge: heldout_prompts: auto:")]
    assert len(line) == 1 and "3 of 60 prompts are held out of training and evaluated" in line[0], err
    report = json.loads((run / "data_report.json").read_text())
    held_index = report["heldout_split"]["heldout_rows"]
    held = {texts[i] for i in held_index}
    assert len(held) == 3 and report["heldout_prompts"] == 3
    assert report["prompts"] == 57 and report["left_out_as_heldout"] == 3
    rows = list(map(json.loads, (run / "completions.jsonl").read_text().splitlines()))
    evaluated = {r["prompt"] for r in rows if r["split"] == "heldout"}
    trained = {r["prompt"] for r in rows if r["split"] == "train"}
    assert evaluated == held  # the file's own rows, not the demo's
    assert not evaluated & {r["prompt"] for r in load_prompts("demo-heldout")}
    assert len(trained) > 20 and trained <= set(texts) - held
    code, err = _cli(capsys, "--resume", str(run), "--total-updates", "9")  # the same split: resume accepts it
    assert code == 0, err
    assert json.loads((run / "data_report.json").read_text())["heldout_split"]["heldout_rows"] == held_index


def test_a_prompt_set_too_small_to_split_has_no_heldout_evaluation_and_says_so(tiny_lm_dir, tmp_path, capfd):
    texts = _prompts(tmp_path / "prompts.jsonl", 12)
    cfg = build_config(RLHFConfig, dict(model=str(tiny_lm_dir), prompts=str(tmp_path / "prompts.jsonl"),
                                        device="cpu", max_prompt_tokens=64))
    inputs = build_inputs(cfg, reward_fn=lambda prompts, completions, **kw: [0.0] * len(prompts))
    err = capfd.readouterr().err
    line = [x for x in err.splitlines() if "heldout_prompts" in x]
    assert line == ["ppoforge: heldout_prompts: auto: the 12 prompts are too few to hold some out (fewer than 20): "
                    "no held-out evaluation; another held-out set: heldout_prompts PATH"]
    assert inputs.heldout_prompt_rows == [] and [r["prompt"] for r in inputs.prompt_rows] == texts
    assert inputs.data_report()["heldout_split"]["heldout_rows"] == []


def test_the_demo_prompts_keep_the_demos_heldout_set(tiny_lm_dir, capfd):
    cfg = build_config(RLHFConfig, dict(model=str(tiny_lm_dir), device="cpu"))
    inputs = build_inputs(cfg, reward_fn=lambda prompts, completions, **kw: [0.0] * len(prompts))
    assert inputs.heldout_prompt_rows == load_prompts("demo-heldout")
    assert inputs.prompt_rows == load_prompts("demo") and inputs.data_report()["heldout_split"] is None
    assert "heldout_prompts" not in capfd.readouterr().err


@pytest.mark.parametrize(("n", "count"), [(19, 0), (20, 1), (100, 5), (1000, 32)])
def test_split_heldout_sizes_and_the_same_rows_every_time(n, count):
    rows = [{"prompt": str(i)} for i in range(n)]
    train, held, index = split_heldout(rows, 0.05)
    assert len(held) == len(index) == count and len(train) == n - count
    assert [rows[i] for i in index] == held and not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert split_heldout(rows, 0.05) == (train, held, index)


def test_gspo_with_another_loss_agg_says_so_in_one_line(tiny_lm_dir, capfd):
    cfg = build_config(RLHFConfig, dict(model=str(tiny_lm_dir), device="cpu", policy_loss="gspo",
                                        loss_agg="token_mean", heldout_prompts=None))
    build_inputs(cfg, reward_fn=lambda prompts, completions, **kw: [0.0] * len(prompts))
    line = [x for x in capfd.readouterr().err.splitlines() if "loss_agg" in x]
    assert len(line) == 1 and line[0].startswith("ppoforge: loss_agg: token_mean with policy_loss gspo")


def test_a_huge_prompt_row_is_tokenized_from_its_tail_with_the_same_tokens_kept(tiny_lm_dir):
    """Issue 37: one 50 MB row became millions of Python ints before the cut. A text past max_tokens x CHARS_PER_TOKEN
    characters is tokenized from its tail: the same last tokens as the whole text's, its length estimated, and
    the Python memory of tokenizing it bounded by the tail (a 4 MB row: under 2 MB traced, not tens)."""
    import tracemalloc

    from ppoforge.lm.data.files import CHARS_PER_TOKEN
    from ppoforge.lm.models.loading import load_tokenizer
    from ppoforge.lm.rl.build import tokenize_prompts

    tok = load_tokenizer(str(tiny_lm_dir))
    words = "tell a story about the rain and the city at night "
    long = words * (20 * CHARS_PER_TOKEN // len(words) + 1)  # > 16 x CHARS_PER_TOKEN characters: from its tail
    whole = tok(long, add_special_tokens=True)["input_ids"]
    cuts = {}
    kept = tokenize_prompts(tok, [{"prompt": long}], "prompt", False, 16, cuts=cuts)
    assert kept == [whole[-16:]]
    report = cuts["prompts"]
    assert report["estimated_rows"] == 1 and abs(report["longest"] - len(whole)) <= 0.05 * len(whole)
    huge = words * (4_000_000 // len(words))
    tracemalloc.start()
    tokenize_prompts(tok, [{"prompt": huge}], "prompt", False, 16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * 2**20 + 2 * len(huge), peak  # the text's own slices, not its millions of token ids
