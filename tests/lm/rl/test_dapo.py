"""DAPO's dynamic sampling, overlong shaping and truncated-completion masking through the RLHF trainer on a
tiny random model: dropped groups are counted and refilled from fresh prompts, a run out of tries is topped
up, resume stays exact, the overlong penalty reaches the estimator, masked completions get no loss, and
bad combinations are one line (core/dapo.py holds the math, lm/rl/dynamic.py the rounds)."""

import pytest
import torch

from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.core.dapo import informative_groups, overlong_penalty
from ppoforge.errors import UserError
from ppoforge.lm.models.sampler import Samples
from ppoforge.lm.rl.collect import Batch, take_rows
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.dynamic import fill_groups, rounds_for
from ppoforge.lm.rl.trainer import RLHFTrainer, train
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie", "tell me about your friend", "the weather today is"]
FLAT = set(PROMPTS[:3])  # every completion of these scores 0.5: their groups agree, no signal


def half_flat_reward(prompts, completions, **kwargs):
    """0.5 for the FLAT prompts, the row index (distinct within a group) for the others."""
    return [0.5 if p in FLAT else float(i) for i, p in enumerate(prompts)]


def flat_reward(prompts, completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture
def cfg_for(tiny_lm_dir, prompts_file):
    def make(**overrides):
        values = dict(model=str(tiny_lm_dir), prompts=str(prompts_file), heldout_prompts=None,
                      max_prompt_tokens=16, max_new_tokens=6, batch_size=2, num_generations=4, mini_batch_size=8,
                      micro_batch_size=4, ppo_epochs=1, total_updates=2, learning_rate=1e-2, device="cpu",
                      seed=0, torch_threads=1, progress=False, tensorboard=False, advantage="grpo",
                      kl_in="loss", kl_estimator="k3", dynamic_sampling=True, precision="fp32")
        return build_config(RLHFConfig, {**values, **overrides})
    return make


def _recording(trainer):
    """Record each draw's prompts and the scores the estimator receives."""
    seen = {"drawn": [], "scores": []}
    draw, passes = trainer.draw, trainer.logprobs_and_values

    def recorded_draw():
        d = draw()
        seen["drawn"].append(d.batch.prompts)
        return d

    def recorded_passes(batch, scores):
        seen["scores"].append(scores.clone())
        seen.setdefault("prompts", []).append(list(batch.prompts))
        return passes(batch, scores)

    trainer.draw, trainer.logprobs_and_values = recorded_draw, recorded_passes
    return seen


# ---- the rounds, by hand ---------------------------------------------------------------------------

def test_fill_groups_keeps_the_first_informative_groups_then_tops_up():
    # round 0: groups 0 and 2 agree; round 1: group 1 agrees. 2 wanted: (0, 1) and (1, 0)
    assert fill_groups([[False, True, False], [True, False, True]], 2) == [(0, 1), (1, 0)]
    # only one informative group in both rounds: topped up with the first agreeing one, (0, 0)
    assert fill_groups([[False, True], [False, False]], 2) == [(0, 0), (0, 1)]
    assert fill_groups([[False, False]], 2) == [(0, 0), (0, 1)]


def _batch(prompt_rows: list[list[int]], responses: list[list[int]], pad: int = 0) -> Batch:
    """A single-turn Batch of left-padded prompts and right-padded responses, for `take_rows`."""
    p, t = max(map(len, prompt_rows)), max(map(len, responses))
    ids = torch.tensor([[pad] * (p - len(r)) + r + s + [pad] * (t - len(s))
                        for r, s in zip(prompt_rows, responses, strict=True)])
    prompt_mask = torch.tensor([[0] * (p - len(r)) + [1] * len(r) for r in prompt_rows])
    resp_mask = torch.tensor([[1.0] * len(s) + [0.0] * (t - len(s)) for s in responses])
    samples = Samples(ids[:, p:], resp_mask, -resp_mask, torch.tensor([len(s) < 3 for s in responses]))
    names = [str(r) for r in prompt_rows]
    return Batch([{"prompt": n} for n in names], ids, prompt_mask, samples, [str(s) for s in responses], names)


def test_take_rows_repads_prompts_and_responses_of_different_widths():
    a = _batch([[5], [6, 7]], [[1], [2, 3, 4]])   # P 2, T 3
    b = _batch([[8, 9, 10]], [[11, 12]])          # P 3, T 2
    out = take_rows([(a, [1, 0]), (b, [0])], pad_id=0)
    # P 3 and T 3: prompts left-padded, responses right-padded, rows in the order asked
    assert out.ids.tolist() == [[0, 6, 7, 2, 3, 4], [0, 0, 5, 1, 0, 0], [8, 9, 10, 11, 12, 0]]
    assert out.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert out.samples.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out.samples.finished.tolist() == [False, True, True]
    assert out.prompts == ["[6, 7]", "[5]", "[8, 9, 10]"] and out.texts == ["[2, 3, 4]", "[1]", "[11, 12]"]


def test_dynamic_sampling_is_refused_under_torchrun(cfg_for):
    assert type(rounds_for(cfg_for(), 0, 1)).__name__ == "DynamicSampling"
    assert type(rounds_for(cfg_for(dynamic_sampling=False), 0, 2)).__name__ == "OneRound"
    with pytest.raises(UserError, match=r"^dynamic_sampling: .*allowed under torchrun \(world 2\): false$"):
        rounds_for(cfg_for(), 0, 2)


# ---- through the trainer ---------------------------------------------------------------------------

def test_dynamic_sampling_drops_agreeing_groups_and_trains_only_informative_ones(cfg_for, tmp_path):
    trainer = RLHFTrainer(cfg_for(dynamic_sampling_tries=3), tmp_path, reward_fn=half_flat_reward)
    seen = _recording(trainer)
    trainer.run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    rounds = [r["dynamic/generation_rounds"] for r in rows]
    assert trainer.cursor == 2 * sum(rounds) == 2 * len(seen["drawn"])  # every round's prompts consumed
    drawn_flat = sum(p in FLAT for batch in seen["drawn"] for p in batch[::4])  # groups of agreeing scores
    assert sum(r["dynamic/dropped_groups"] + r["dynamic/filled_groups"] for r in rows) == drawn_flat > 0
    # the order (seed 0's permutations) is movie, city | weather, friend for update 1: city dropped, friend
    # surplus; rain, coffee | coffee, friend | movie, rain for update 2: four flat groups dropped, movie surplus
    assert rounds == [2, 3] and [r["dynamic/dropped_groups"] for r in rows] == [1, 4]
    assert [r["dynamic/filled_groups"] for r in rows] == [0, 0]
    for row, scores, prompts in zip(rows, seen["scores"], seen["prompts"], strict=True):
        assert scores.shape == (8,) and row["perf/rank_rollout"] == 8  # the rollout keeps its size
        if row["dynamic/filled_groups"] == 0:
            assert informative_groups(scores, 4).all() and not FLAT & set(prompts)
            assert row["frac_reward_zero_std"] == 0.0


def test_when_the_tries_run_out_the_batch_is_topped_up_with_dropped_groups(cfg_for, tmp_path):
    trainer = RLHFTrainer(cfg_for(dynamic_sampling_tries=1, total_updates=1), tmp_path, reward_fn=flat_reward)
    seen = _recording(trainer)
    metrics, _ = trainer.train_one_update()
    # 2 rounds of 2 groups, none informative: the first round's 2 trained (filled), the second's 2 dropped
    assert metrics["dynamic/generation_rounds"] == 2 and trainer.cursor == 4
    assert metrics["dynamic/filled_groups"] == 2 and metrics["dynamic/dropped_groups"] == 2
    assert seen["prompts"][0] == seen["drawn"][0]


def test_a_non_finite_round_ends_the_rounds_and_the_guard_skips_the_update(cfg_for, tmp_path):
    calls = []

    def flat_then_nan(prompts, completions, **kwargs):
        calls.append(1)
        return [1.0 if len(calls) == 1 else float("nan")] * len(completions)

    trainer = RLHFTrainer(cfg_for(dynamic_sampling_tries=3, total_updates=1), tmp_path, reward_fn=flat_then_nan)
    before = {n: p.detach().clone() for n, p in trainer.layout.named_trainable()}
    metrics, _ = trainer.train_one_update()
    assert metrics["dynamic/generation_rounds"] == 2 and trainer.cursor == 4 and len(calls) == 2
    assert metrics["dynamic/dropped_groups"] == 2 and metrics["guard/skipped_updates"] == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.layout.named_trainable())


def test_resume_with_dynamic_sampling_matches_the_uninterrupted_run(cfg_for, tmp_path):
    cfg = cfg_for(total_updates=3, anneal_lr=False, checkpoint_every=10)
    train(cfg, tmp_path / "full", reward_fn=half_flat_reward)
    train(cfg_for(total_updates=1, anneal_lr=False, checkpoint_every=10), tmp_path / "split",
          reward_fn=half_flat_reward)
    train(cfg, tmp_path / "split", resume=True, reward_fn=half_flat_reward)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert any(r["dynamic/generation_rounds"] > 1 for r in full)  # the cursor moved by more than a batch
    assert strip(read_metrics(tmp_path / "split" / "metrics.jsonl")) == strip(full)


def test_overlong_penalty_reaches_the_estimator_after_the_guard(cfg_for, tmp_path):
    # ragged lengths (most token ids stop a response); reward 1, clipped to 0.5 by the guard, then shaped
    cfg = cfg_for(dynamic_sampling=False, overlong_buffer=3, overlong_penalty=0.5, reward_clip=0.5,
                  stop_tokens=",".join(map(str, range(10, 100))), total_updates=1)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=flat_reward)
    seen, batches = _recording(trainer), []
    draw = trainer.draw
    trainer.draw = lambda: batches.append(draw()) or batches[-1]
    metrics, _ = trainer.train_one_update()
    lengths = batches[0].batch.samples.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1, lengths
    expected = 0.5 + overlong_penalty(lengths, 6, 3, 0.5)  # 0 up to 3 tokens, then -1/6 per token to -0.5
    torch.testing.assert_close(seen["scores"][0], expected, rtol=0, atol=0)
    assert metrics["objective/overlong_penalty"] == pytest.approx(float(expected.mean() - 0.5))
    assert metrics["objective/scores"] == pytest.approx(float(expected.mean()))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_gives_truncated_completions_no_loss(cfg_for, tmp_path, mask_truncated):
    """Every completion marked truncated: masked, the update has no gradient and the weights stay bit-equal
    (AdamW with a zero gradient and no weight decay moves nothing); unmasked they train. The rollout's
    metrics still see every token."""
    cfg = cfg_for(dynamic_sampling=False, mask_truncated=mask_truncated, total_updates=1)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=lambda prompts, completions, **kw: [float(i) for i in
                                                                                       range(len(completions))])
    draw, trained = trainer.draw, []

    def truncated():
        d = draw()
        d.batch.samples.finished = torch.zeros_like(d.batch.samples.finished)
        return d

    update = trainer.ppo_update
    trainer.draw = truncated
    trainer.ppo_update = lambda b: trained.append(b) or update(b)
    before = {n: p.detach().clone() for n, p in trainer.layout.named_trainable()}
    metrics, _ = trainer.train_one_update()
    assert (trained[0].resp_mask.sum() == 0) == mask_truncated  # the loss mask, and so its token count
    assert metrics["objective/response_length"] > 0 and metrics["completions/clipped_ratio"] == 1.0
    same = [torch.equal(p, before[n]) for n, p in trainer.layout.named_trainable()]
    assert all(same) == mask_truncated  # (unmasked, LoRA's B moves at once; A, behind B = 0, a step later)


def _cli(capsys, *args):
    code = main(["train", "rlhf", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args, message", [
    (["--dynamic-sampling", "true"],
     "dynamic_sampling: drops groups whose scores agree, which advantage gae still learns from; allowed: false, "
     "or advantage grpo, rloo, reinforce_pp_baseline"),
    (["--advantage", "grpo", "--num-generations", "2", "--kl-in", "loss", "--kl-estimator", "k3",
      "--dynamic-sampling", "true", "--env", "guess_number", "--reward", "env"],
     "dynamic_sampling: applies to single-turn responses; allowed with env: false"),
    (["--overlong-buffer", "4", "--env", "guess_number", "--reward", "env"],
     "overlong_buffer: applies to single-turn responses; allowed with env: 0"),
    (["--overlong-buffer", "32", "--max-new-tokens", "32"],
     "overlong_buffer: 32 is not below max_new_tokens 32; allowed: 0 (off) to 31"),
    (["--dynamic-sampling-tries", "0"], "dynamic_sampling_tries: 0 is out of range"),
])
def test_bad_dapo_settings_are_one_line_exit_2(capsys, tmp_path, args, message):
    code, err = _cli(capsys, "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err
