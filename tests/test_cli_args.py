"""The command line as users of other tools type it: sections in --help, a preset's defaults there, --print-config
of train, plan and demo and --config (round trip, `preset:` extension), underscores and TRL's names, no
abbreviations, one line for an unknown option, micro-batches that divide the batch, one precision default."""

import dataclasses

import pytest
import yaml

from ppoforge.cli import HANDLERS, main
from ppoforge.cli_args import FIELD_GROUPS, TRAINERS, build_parser
from ppoforge.config import build_config, default_micro_batch, read_preset
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig


def _help_of(out: str, option: str) -> str:
    """The help of `option` in --help's text, on one line."""
    return " ".join(out.split(f"  {option} ")[1].split("\n  --")[0].split())


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_field_of_every_trainer_is_in_exactly_one_help_section():
    names = {f.name for cls in TRAINERS.values() for f in dataclasses.fields(cls)}
    placed = [name for group in FIELD_GROUPS.values() for name in group]
    twice = sorted({n for n in placed if placed.count(n) > 1})
    assert not twice, f"in two sections: {twice}"
    assert not sorted(names - set(placed)), f"in no section of cli_args.FIELD_GROUPS: {sorted(names - set(placed))}"
    assert not sorted(set(placed) - names), f"no such field: {sorted(set(placed) - names)}"


def test_help_is_in_sections_and_a_presets_help_shows_its_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "rlhf", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    heads = [line for line in out.splitlines() if line.endswith(" options:") and not line.startswith(" ")]
    assert heads == [f"{g} options:" for g in FIELD_GROUPS]
    assert out.splitlines()[0] == "usage: ppoforge train rlhf [--preset NAME] [--config FILE] [--OPTION VALUE ...]"
    assert _help_of(out, "--learning-rate").endswith("(default: 0.0001)")
    with pytest.raises(SystemExit):
        main(["train", "rlhf", "--preset", "demo", "--help"])
    out = capsys.readouterr().out
    assert _help_of(out, "--learning-rate").endswith("(default: 0.0002 from preset demo)")
    assert _help_of(out, "--total-updates").endswith("(default: 24 from preset demo)")


@pytest.mark.parametrize("argv, preset, readers", [
    (["train", "rlhf", "--preset", "grpo"], ("grpo", "rlhf"), [["train", "rlhf"]]),
    (["plan", "rlhf", "--preset", "grpo", "--device", "cuda:24GB"], ("grpo", "rlhf"),
     [["plan", "rlhf"], ["train", "rlhf"]]),
    (["plan", "sft", "--preset", "tiny"], ("tiny", "sft"), [["plan", "sft"], ["train", "sft"]]),
    (["plan", "reward", "--preset", "tiny"], ("tiny", "reward"), [["plan", "reward"], ["train", "reward"]]),
    (["demo", "--task", "arithmetic"], ("arithmetic_demo", "rlhf"), [["train", "rlhf"]]),
    (["demo"], ("demo", "rlhf"), [["train", "rlhf"]]),
], ids=["train", "plan-rlhf", "plan-sft", "plan-reward", "demo-arithmetic", "demo"])
def test_print_config_round_trips_through_config(argv, preset, readers, capsys, tmp_path):
    """train, plan and demo print the config they would use (exit 0, nothing run); --config reads it back: the
    same YAML again, from the command itself and from `train` (the demo's: `train rlhf --config FILE`)."""
    code, first, err = _run(capsys, *argv, "--learning-rate", "3e-6", "--print-config")
    assert code == 0 and not err and not list(tmp_path.iterdir())
    values = yaml.safe_load(first)
    assert values["learning_rate"] == 3e-6
    assert {k: values[k] for k in read_preset(*preset) if k != "learning_rate"} == \
        {k: v for k, v in read_preset(*preset).items() if k != "learning_rate"}
    saved = tmp_path / "run.yaml"
    saved.write_text(first)
    for reader in readers:
        code, second, _ = _run(capsys, *reader, "--config", str(saved), "--print-config")
        assert code == 0 and second == first, reader


def test_a_config_file_extends_a_preset_and_flags_override_both(capsys, tmp_path):
    own = tmp_path / "mine.yaml"
    own.write_text("preset: grpo\nlearning_rate: 3.0e-6\ntotal_updates: 7\n")
    code, out, _ = _run(capsys, "train", "rlhf", "--config", str(own), "--total-updates", "9", "--print-config")
    values = yaml.safe_load(out)
    grpo = yaml.safe_load(_run(capsys, "train", "rlhf", "--preset", "grpo", "--print-config")[1])
    assert code == 0 and values["learning_rate"] == 3e-6 and values["total_updates"] == 9
    assert {k: v for k, v in values.items() if k not in ("learning_rate", "total_updates")} == \
        {k: v for k, v in grpo.items() if k not in ("learning_rate", "total_updates")}
    loop = tmp_path / "loop.yaml"
    loop.write_text("preset: loop.yaml\n")
    code, _, err = _run(capsys, "train", "rlhf", "--config", str(loop), "--print-config")
    assert code == 2 and err.count("\n") == 1 and "in a circle" in err


def test_underscores_and_trls_names_mean_the_same_options(capsys, tmp_path):
    parser = build_parser(HANDLERS)
    a = parser.parse_args(["train", "rlhf", "--learning_rate", "1e-5", "--num_generations", "4",
                           "--max_completion_length", "64", "--output_dir", str(tmp_path)])
    b = parser.parse_args(["train", "rlhf", "--learning-rate", "1e-5", "--num-generations", "4",
                           "--max-new-tokens", "64", "--run-dir", str(tmp_path)])
    assert vars(a) == vars(b)
    ppo = parser.parse_args(["train", "rlhf", "--cliprange", "0.1", "--cliprange_value", "0.3", "--num_ppo_epochs", "2",
                             "--response_length", "16", "--epsilon_high", "0.28"])
    assert {k: v for k, v in vars(ppo).items() if k.startswith("cfg.")} == {
        "cfg.clip": "0.1", "cfg.value_clip": "0.3", "cfg.ppo_epochs": "2", "cfg.max_new_tokens": "16",
        "cfg.clip_high": "0.28"}
    sft = parser.parse_args(["train", "sft", "--num_train_epochs=2", "--max_steps", "3"])
    assert sft.__dict__["cfg.epochs"] == "2" and sft.__dict__["cfg.max_steps"] == "3"


@pytest.mark.parametrize("argv, line", [
    (["train", "rlhf", "--num-gen", "4"], "unknown option --num-gen; did you mean --num-generations?"),
    (["train", "rlhf", "--lerning_rate", "1e-5"], "unknown option --lerning_rate; did you mean --learning-rate?"),
    (["train", "sft", "--per_device_train_batch_size", "4"], "--per_device_train_batch_size is part of TRL's batch "
     "(per_device_train_batch_size x gradient_accumulation_steps x GPUs examples per optimizer step); here "
     "--batch-size is that whole number; allowed: --batch-size"),
    (["train", "rlhf", "--max_steps", "10"], "allowed: --total-updates"),
    (["plan", "rlhf", "--lora-rank", "4"], "unknown option --lora-rank; did you mean --lora-r?"),
    (["doctor", "--quik"], "unknown option --quik; did you mean --quick?"),
])
def test_no_abbreviations_and_an_unknown_option_is_one_line_with_the_nearest(argv, line, capsys):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith("ppoforge: error: "), err
    assert line in err, err


def test_the_default_micro_batch_divides_the_batch():
    assert [default_micro_batch(b) for b in (1, 4, 6, 7, 12, 16, 24, 9)] == [1, 4, 6, 7, 6, 8, 8, 3]
    sft = build_config(SFTConfig, {"data": "x.jsonl", "batch_size": 4})
    assert sft.micro_batch_size == 4  # it was 8: "micro_batch_size: 8 does not divide batch_size 4"
    assert build_config(RewardConfig, {"data": "x.jsonl", "batch_size": 12}).micro_batch_size == 6
    assert build_config(RLHFConfig, {"batch_size": 4, "mini_batch_size": 4}).micro_batch_size == 4
    rlhf = build_config(RLHFConfig, {"batch_size": 4})  # it was "mini_batch_size: 16 does not divide batch_size 4"
    assert (rlhf.mini_batch_size, rlhf.micro_batch_size) == (4, 4)
    grpo = build_config(RLHFConfig, {"batch_size": 3, "num_generations": 4, "advantage": "grpo"})
    assert (grpo.mini_batch_size, grpo.micro_batch_size) == (12, 6)  # the whole rollout, one step per epoch
    assert build_config(SFTConfig, {"data": "x.jsonl", "batch_size": 4, "micro_batch_size": 2}).micro_batch_size == 2


def test_every_lm_trainer_defaults_to_precision_auto():
    assert {cls.__name__: build_config(cls, {"data": "x.jsonl"} if cls is not RLHFConfig else {}).precision
            for cls in (RLHFConfig, SFTConfig, RewardConfig)} == dict.fromkeys(
        ("RLHFConfig", "SFTConfig", "RewardConfig"), "auto")
