"""Shared-prefix rows through the RLHF trainer: GRPO's forwards run each prompt once per unit of its
completions, PPO's the instruction its prompts share once per unit, and the update is the padded one —
the same completions, the old log-probs exactly the training forward's at update 1 (ratio 1, KL 0), the
same loss to rounding — on the lora and full layouts."""

import pytest

import ppoforge.lm.models.rows as rows_module
from ppoforge.config import build_config
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer

HEADER = "you are a good assistant . you write one very nice sentence about this and that . "
PROMPTS = [HEADER + p for p in ("tell a story about the rain", "write one sentence about coffee",
                                "describe the city at night", "a review of a good movie")]


def index_reward(prompts, completions, **kwargs):
    return [float(i) for i in range(len(completions))]


def _config(tiny_lm_dir, prompts_file, **overrides):
    values = dict(model=str(tiny_lm_dir), prompts=str(prompts_file), heldout_prompts=None, max_prompt_tokens=16,
                  max_new_tokens=6, batch_size=2, num_generations=4, mini_batch_size=8, micro_batch_size=4,
                  ppo_epochs=1, total_updates=1, learning_rate=1e-2, device="cpu", seed=0, torch_threads=1,
                  progress=False, tensorboard=False, advantage="grpo", kl_coef=0.05, kl_in="loss",
                  kl_estimator="k3", old_logprobs="recompute", precision="fp32")
    return build_config(RLHFConfig, {**values, **overrides})


GRPO = dict(advantage="grpo", num_generations=4, batch_size=2, kl_in="loss")
# one optimizer step: a unit shuffle makes other mini-batches than a row shuffle, so only then are the two equal
PPO = dict(advantage="gae", num_generations=1, batch_size=8, kl_in="reward", max_prompt_tokens=40)


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
@pytest.mark.parametrize("layout", ["lora", "full"])
def test_a_shared_prefix_update_is_the_padded_update(tiny_lm_dir, prompts_file, tmp_path, monkeypatch, layout,
                                                     estimator):
    units, shared = [], rows_module.shared_prefix
    monkeypatch.setattr(rows_module, "shared_prefix", lambda ids, mask, n, k: units.append(k) or shared(ids, mask,
                                                                                                       n, k))
    out = {}
    for mode in ("auto", "off"):
        cfg = _config(tiny_lm_dir, prompts_file, layout=layout, shared_prefix=mode,
                      learning_rate=1e-3 if layout == "full" else 1e-2, **(GRPO if estimator == "grpo" else PPO))
        trainer = RLHFTrainer(cfg, tmp_path / mode, reward_fn=index_reward)
        out[mode] = trainer.train_one_update()
        if mode == "auto":  # the scoring passes and every micro-batch ran units of the tile's 4
            assert units and set(units) == {4}, units
            # one step: the whole update runs on the policy of the old log-probs, the reference's at first
            assert out[mode][0]["val/ratio"] == 1 and out[mode][0]["policy/approxkl_avg"] == 0
            assert out[mode][0]["kl" if estimator == "grpo" else "objective/kl"] == 0
            units.clear()
    assert not units  # off: padded rows only
    (auto, auto_table), (off, off_table) = out["auto"], out["off"]
    assert [r["completion"] for r in auto_table] == [r["completion"] for r in off_table]
    keys = ["loss/policy_avg", "policy/entropy_avg", "objective/scores"]
    for key in keys + (["reward_std"] if estimator == "grpo" else ["loss/value_avg", "objective/kl"]):
        assert auto[key] == pytest.approx(off[key], abs=1e-5), key


def test_shared_prefix_off_and_sizes_that_do_not_tile_the_micro_batches(tiny_lm_dir, prompts_file):
    cfg = lambda **kw: _config(tiny_lm_dir, prompts_file, **{**GRPO, **kw})  # noqa: E731
    assert cfg().prefix_sizes() == (2, 4)
    assert cfg(micro_batch_size=2).prefix_sizes() == (2,)
    assert cfg(num_generations=3, batch_size=2, mini_batch_size=6, micro_batch_size=3).prefix_sizes() == (3,)
    assert cfg(shared_prefix="off").prefix_sizes() == ()
    assert cfg(num_generations=1, advantage="gae", batch_size=8).prefix_sizes() == (2, 4)  # PPO: headers, packing
    assert cfg().prefix_sizes(world=4, sharded=True) == (2,)  # FSDP over 4 ranks: each takes 2 rows of a mini-batch
    assert cfg().prefix_sizes(world=4) == (2,)  # 4 ranks collect 2 rows each
    assert cfg(batch_size=4, mini_batch_size=16).prefix_sizes(world=2) == (2, 4)
