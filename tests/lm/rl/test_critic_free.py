"""Critic-free estimators (GRPO, RLOO, REINFORCE++) through the RLHF trainer on tiny random models: they
train end to end in lora and full layouts without any critic, `kl_coef: 0` runs no reference pass, group
statistics see whole groups before the mini-batch shuffle, every `loss_agg` is accumulation-invariant,
bad combinations are one line, and the presets run."""

import math

import pytest
import torch

import ppoforge.lm.rl.update as update_module
from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.core.critic_free import grpo_advantages, rloo_advantages
from ppoforge.core.policy_losses import POLICY_LOSSES
from ppoforge.lm.models.parts import ValueHead
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie", "tell me about your friend", "the weather today is"]
GRPO_METRICS = ["reward", "reward_std", "frac_reward_zero_std", "clip_ratio/region_mean", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "completions/clipped_ratio", "loss/policy_avg", "policy/approxkl_avg",
                "val/ratio", "objective/scores"]


def index_reward(prompts, completions, **kwargs):
    """Row i scores i: distinct within every group, so every group has a signal."""
    return [float(i) for i in range(len(completions))]


@pytest.fixture
def cfg_for(tiny_lm_dir, prompts_file):
    def make(**overrides):
        values = dict(model=str(tiny_lm_dir), prompts=str(prompts_file), heldout_prompts=None,
                      max_prompt_tokens=16, max_new_tokens=6, batch_size=2, num_generations=4, mini_batch_size=4,
                      micro_batch_size=2, ppo_epochs=1, total_updates=2, learning_rate=1e-2, device="cpu",
                      seed=0, torch_threads=1, progress=False, tensorboard=False, advantage="grpo",
                      precision="fp32")
        return build_config(RLHFConfig, {**values, **overrides})
    return make


def _snapshot(named):
    return {n: p.detach().clone() for n, p in named}


def _no_critic(layout) -> None:
    names = [n for n, _ in layout.named_trainable()]
    assert names and not any(n.startswith(("value_head", "critic")) for n in names), names
    assert layout.value_head is None and getattr(layout, "critic", None) is None


@pytest.mark.parametrize("overrides", [
    dict(layout="lora"),
    dict(layout="lora", kl_in="loss", kl_estimator="k3", loss_agg="seq_mean_token_mean", clip_high=0.28),
    dict(layout="full", learning_rate=1e-3, kl_in="loss", kl_estimator="k2"),
    dict(layout="lora", advantage="rloo", scale_rewards="batch"),
    dict(layout="full", learning_rate=1e-3, advantage="rloo", loss_agg="seq_sum_norm"),
    dict(layout="lora", advantage="reinforce_pp", num_generations=1, batch_size=4, kl_target=0.01, kl_horizon=10),
    dict(layout="lora", advantage="reinforce_pp_baseline", kl_coef=0.0),
    dict(layout="lora", policy_loss="gspo", kl_coef=0.0, loss_agg="seq_mean_token_mean"),
    dict(layout="lora", policy_loss="cispo", kl_in="loss", kl_estimator="k3", clip_high=4.0),
], ids=["grpo-lora", "grpo-lora-kl-loss-clip-high", "grpo-full-k2", "rloo-lora-batch-scale", "rloo-full-dr",
        "reinforce_pp-adaptive", "reinforce_pp_baseline-no-kl", "gspo", "cispo"])
def test_critic_free_estimators_train_without_a_critic(cfg_for, tmp_path, overrides):
    trainer = RLHFTrainer(cfg_for(**overrides), tmp_path, reward_fn=index_reward)
    assert trainer.ppo.policy_loss is POLICY_LOSSES[overrides.get("policy_loss", "ppo")]
    _no_critic(trainer.layout)
    before = _snapshot(trainer.layout.named_trainable())
    result = trainer.run()
    assert result.updates == 2 and result.episodes == 2 * trainer.cfg.rollout_size
    for name, p in trainer.layout.named_trainable():
        assert not torch.equal(p, before[name]), f"{name} did not train"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    grouped = trainer.cfg.num_generations > 1
    for key in GRPO_METRICS:
        if key.startswith(("reward_std", "frac_")) and not grouped:
            assert key not in rows[0]
            continue
        assert all(isinstance(r[key], float | int) and math.isfinite(r[key]) for r in rows), key
    assert not any(k in rows[0] for k in ("loss/value_avg", "val/clipfrac_avg"))  # no critic, no value stats
    assert ("kl" in rows[0]) == (trainer.cfg.kl_in == "loss" and trainer.cfg.kl_coef > 0)
    assert ("objective/kl" in rows[0]) == (trainer.cfg.kl_coef > 0)
    if trainer.cfg.kl_target:
        assert rows[1]["objective/kl_coef"] != rows[0]["objective/kl_coef"]
    assert (tmp_path / "model" / ("config.json" if trainer.cfg.layout == "full" else "adapter_config.json")).is_file()


@pytest.mark.parametrize("layout", ["lora", "full"])
@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_no_value_head_call_and_no_value_loss_without_a_critic(cfg_for, tmp_path, monkeypatch, layout, advantage):
    calls = {"head": 0, "loss": 0}
    head_forward, loss = ValueHead.forward, update_module.value_loss

    def counted_head(self, hidden):
        calls["head"] += 1
        return head_forward(self, hidden)

    def counted_loss(*args, **kwargs):
        calls["loss"] += 1
        return loss(*args, **kwargs)

    monkeypatch.setattr(ValueHead, "forward", counted_head)
    monkeypatch.setattr(update_module, "value_loss", counted_loss)
    trainer = RLHFTrainer(cfg_for(layout=layout, advantage=advantage, learning_rate=1e-3), tmp_path,
                          reward_fn=index_reward)
    metrics, _ = trainer.train_one_update()
    if advantage == "gae":  # the control: the same counters do see a critic
        assert calls["head"] > 0 and calls["loss"] > 0 and "loss/value_avg" in metrics
    else:
        assert calls == {"head": 0, "loss": 0}
        _no_critic(trainer.layout)


@pytest.mark.parametrize("layout", ["lora", "full"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_kl_coef_0_makes_no_reference_pass(cfg_for, tmp_path, layout, kl_coef):
    trainer = RLHFTrainer(cfg_for(layout=layout, kl_coef=kl_coef, kl_in="loss", kl_estimator="k3",
                                  learning_rate=1e-3), tmp_path, reward_fn=index_reward)
    calls = []
    layout_obj = trainer.layout
    for name in ("ref_forward", "fast_ref_forward", "ref_logits"):
        original = getattr(layout_obj, name)
        if original is not None:
            setattr(layout_obj, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    metrics, _ = trainer.train_one_update()
    trainer.train_one_update()
    if kl_coef:
        assert "ref_logits" in calls and metrics["objective/kl"] == 0  # the untrained policy: exactly 0
        assert math.isfinite(metrics["kl"]) and metrics["kl"] >= 0  # k3 in the loss
    else:
        assert calls == [] and "objective/kl" not in metrics and "kl" not in metrics
        assert layout == "lora" or trainer.layout.reference is None  # full: no reference copy loaded
        assert metrics["objective/non_score_reward"] == 0


@pytest.mark.parametrize(("advantage", "expected"), [("grpo", grpo_advantages), ("rloo", rloo_advantages)])
def test_group_statistics_see_the_whole_rollout_before_the_shuffle(cfg_for, tmp_path, monkeypatch, advantage,
                                                                   expected):
    """Rows 0-3 are prompt 0's group, 4-7 prompt 1's; scores are the row indices. The advantage that
    reaches the loss for each row must be its whole group's, although PPO's shuffled mini-batches of 4
    mix the groups (shared_prefix off: its mini-batches would hold whole groups): statistics computed per
    mini-batch would give other numbers."""
    cfg = cfg_for(advantage=advantage, kl_coef=0.0, batch_size=2, num_generations=4, mini_batch_size=4,
                  micro_batch_size=4, shared_prefix="off")
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=index_reward)
    seen, rollouts = [], []
    loss, update = trainer.ppo.policy_loss, trainer.ppo_update

    def spy_loss(logp, old_logp, adv, *args, **kwargs):
        seen.append((old_logp.detach().clone(), adv.detach().clone()))
        return loss(logp, old_logp, adv, *args, **kwargs)

    monkeypatch.setattr(trainer.ppo, "policy_loss", spy_loss)
    trainer.ppo_update = lambda b: (rollouts.append(b), update(b))[1]
    _, table = trainer.train_one_update()
    assert [r["prompt"] for r in table[:4]] == [table[0]["prompt"]] * 4 != [r["prompt"] for r in table[4:]]
    b = rollouts[0]
    want = expected(torch.arange(8.0), 4, cfg.reward_scale)
    if advantage == "grpo":  # row 0: (0 - 1.5) / (std(0, 1, 2, 3) = sqrt(5 / 3) + 1e-4)
        assert want[0] == pytest.approx(-1.5 / (math.sqrt(5 / 3) + 1e-4))
    else:  # row 0: 0 - (1 + 2 + 3) / 3
        assert want[0] == pytest.approx(-2.0)
    mixed = False
    for old_logp, adv in seen:  # one micro-batch = one mini-batch of 4 rows
        rows = [int(((b.logp == row).all(1)).nonzero()) for row in old_logp]
        mixed |= len({r // 4 for r in rows}) > 1
        torch.testing.assert_close(adv, want[rows][:, None] * b.resp_mask[rows])
    assert len(seen) == 2 and mixed


def _grads_after_one_update(cfg, run_dir):
    """One update's mini-batch gradients with plain SGD; every trainable given a gradient path first."""
    trainer = RLHFTrainer(cfg, run_dir, reward_fn=index_reward)
    trainer.optimizer = torch.optim.SGD(trainer.params, lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B (and a value head) start at 0; nonzero B also moves the policy off the reference
        for name, p in trainer.layout.named_trainable():
            if "lora_B" in name or name.startswith("value_head"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    captured = {}
    clip = trainer.precision.clip

    def capture(optimizer, params, max_grad_norm):
        captured.update({n: p.grad.clone() for n, p in trainer.layout.named_trainable() if p.grad is not None})
        return clip(optimizer, params, max_grad_norm)

    trainer.precision.clip = capture
    rollouts, update = [], trainer.ppo_update
    trainer.ppo_update = lambda b: (rollouts.append(b), update(b))[1]
    metrics, _ = trainer.train_one_update()
    return captured, metrics, rollouts[0].resp_mask.sum(1)


@pytest.mark.parametrize(("advantage", "loss_agg", "extra"), [
    ("grpo", "token_mean", {}), ("grpo", "seq_mean_token_mean", {}), ("grpo", "seq_sum_norm", {}),
    ("gae", "seq_sum_norm", {}), ("grpo", "seq_mean_token_mean", dict(policy_loss="gspo", ppo_epochs=2)),
    ("grpo", "token_mean", dict(policy_loss="cispo", ppo_epochs=2))])
def test_every_loss_agg_is_accumulation_invariant_through_the_trainer(cfg_for, tmp_path, advantage, loss_agg, extra):
    """micro-batch 8 x accumulation 1 == micro-batch 1 x accumulation 8, the KL loss term included. Ragged
    responses (90 of the ~630 tokens stop a response) so that a token and a sequence weigh differently:
    with equal lengths a per-micro-batch normalizer would pass too. The gspo and cispo cases compare the
    second epoch's step, off policy (ratios ~1e-3 off 1, inside the clip: the clipping is tests/core's)."""
    base = dict(advantage=advantage, loss_agg=loss_agg, kl_in="loss", kl_estimator="k3", batch_size=4,
                num_generations=2, mini_batch_size=8, max_grad_norm=1e6, max_new_tokens=12,
                stop_tokens=",".join(map(str, range(10, 100))), **extra)
    g_big, m_big, lengths = _grads_after_one_update(cfg_for(micro_batch_size=8, **base), tmp_path / "a")
    g_small, m_small, _ = _grads_after_one_update(cfg_for(micro_batch_size=1, **base), tmp_path / "b")
    assert len(set(lengths.tolist())) > 2, lengths
    assert g_big.keys() == g_small.keys() and len(g_big) > 0
    assert all(g.abs().max() > 0 for g in g_big.values())
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], atol=1e-6, rtol=1e-4, msg=name)
    for key in ("loss/policy_avg", "kl", "policy/clipfrac_avg"):
        assert m_small[key] == pytest.approx(m_big[key], rel=1e-5, abs=1e-7), key


def _cli(capsys, *args):
    code = main(["train", "rlhf", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args, message", [
    (["--advantage", "grpo"], "num_generations: 1 with advantage grpo"),
    (["--advantage", "rloo", "--num-generations", "2", "--layout", "lora-critic"],
     "layout: lora-critic trains a critic adapter, which advantage rloo does not use; allowed: lora or full"),
    (["--advantage", "grpo", "--num-generations", "2", "--layout", "full", "--critic-model", "/x"],
     "critic_model: advantage grpo has no critic"),
    (["--scale-rewards", "batch"], "scale_rewards: batch applies to grpo and rloo; allowed with advantage gae: auto"),
    (["--kl-in", "loss"], "kl_estimator: k1 as a loss term has zero expected gradient"),
    (["--advantage", "rloo", "--num-generations", "2", "--scale-rewards", "group"],
     "scale_rewards: group does not apply to rloo, which normalizes its advantages over the batch"),
    (["--advantage", "grpo", "--num-generations", "2", "--scale-rewards", "group"],
     "scale_rewards: group with kl_in reward (kl_coef 0.05) divides each group's KL noise by its own tiny std"),
    (["--advantage", "reinforce_pp", "--whiten-rewards", "true"],
     "whiten_rewards: whitens GAE's per-token rewards; allowed with advantage reinforce_pp: false"),
    (["--kl-coef", "0", "--kl-target", "6"], "kl_target: the adaptive controller scales kl_coef, which is 0"),
    (["--num-generations", "3", "--mini-batch-size", "32"],
     "mini_batch_size: 32 does not divide batch_size x num_generations = 48"),
    (["--loss-agg", "sum"], "loss_agg: 'sum' is not allowed; allowed: auto, token_mean, seq_mean_token_mean, "
                                "seq_sum_norm"),
    (["--clip-high", "0"], "clip_high: 0.0 is out of range"),
    (["--policy-loss", "bogus"], "policy_loss: 'bogus' is not allowed; allowed: ppo, gspo, cispo"),
])
def test_bad_combinations_are_one_line_exit_2(capsys, tmp_path, args, message):
    code, err = _cli(capsys, "--run-dir", str(tmp_path / "r"), *args)
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(("overrides", "scale"), [
    (dict(), "batch"),  # the KL in the reward: a group's std would be KL noise
    (dict(kl_coef=0.0), "group"), (dict(kl_in="loss", kl_estimator="k3"), "group"),
    (dict(advantage="rloo"), "none"), (dict(advantage="rloo", scale_rewards="batch"), "batch")])
def test_auto_scaling_never_divides_by_a_std_of_kl_noise(cfg_for, overrides, scale):
    assert cfg_for(**overrides).reward_scale == scale


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo"])
def test_presets_train_with_a_model_path(capsys, tmp_path, tiny_lm_dir, prompts_file, preset):
    run = tmp_path / "run"
    code, err = _cli(capsys, "--preset", preset, "--model", str(tiny_lm_dir), "--prompts", str(prompts_file),
                     "--reward", "length:4", "--heldout-prompts", "none", "--max-new-tokens", "4",
                     "--total-updates", "1", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run))
    assert code == 0, err
    (row,) = read_metrics(run / "metrics.jsonl")
    assert math.isfinite(row["loss/policy_avg"]) and "loss/value_avg" not in row
    assert row["episode"] == 4 * (8 if preset != "rloo" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_each_estimator_moves_the_reward_the_way_its_sign_says(cfg_for, tmp_path, advantage):
    """The letter e counted in each completion, rewarded (+1) or penalized (-1): 30 updates of the full
    layout raise the count or lower it. A sign error in an estimator would move it the other way."""
    counts = {}
    for sign in (1.0, -1.0):
        def reward(prompts, completions, _sign=sign, **kwargs):
            return [_sign * c.count("e") for c in completions]

        group = 1 if advantage == "reinforce_pp" else 4  # 16 responses per rollout either way
        cfg = cfg_for(advantage=advantage, layout="full", learning_rate=3e-3, batch_size=16 // group,
                      num_generations=group, mini_batch_size=16, micro_batch_size=8, ppo_epochs=4, total_updates=30,
                      max_new_tokens=8, temperature=1.0)
        trainer = RLHFTrainer(cfg, tmp_path / f"{sign}", reward_fn=reward)
        rows = [trainer.train_one_update()[0]["reward"] * sign for _ in range(cfg.total_updates)]
        counts[sign] = (sum(rows[:10]) / 10, sum(rows[-10:]) / 10)  # mean count of e: first vs last 10
    assert counts[1.0][1] > counts[1.0][0] + 0.3, counts
    assert counts[-1.0][1] < counts[-1.0][0] - 0.3, counts


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_one_step_rollouts_take_old_logprobs_from_the_update_itself(cfg_for, tmp_path, layout):
    """One optimizer step per rollout, no critic, KL in the loss: no rollout pass of the policy runs, the
    ratio is exactly 1, and the step equals the one with recomputed old log-probs."""
    shape = dict(layout=layout, mini_batch_size=8, kl_in="loss", kl_estimator="k3", learning_rate=1e-3)
    fast = RLHFTrainer(cfg_for(**shape), tmp_path / "fast", reward_fn=index_reward)
    slow = RLHFTrainer(cfg_for(**shape, old_logprobs="recompute"), tmp_path / "slow", reward_fn=index_reward)
    assert fast.cfg.on_policy and not slow.cfg.on_policy
    calls = []
    original = fast.layout.forward
    fast.layout.forward = lambda *a: (calls.append(torch.is_grad_enabled()), original(*a))[1]
    metrics, _ = fast.train_one_update()
    slow.train_one_update()
    assert calls and all(calls)  # only the update's own (grad-enabled) forwards ran
    assert metrics["val/ratio"] == 1.0 and metrics["clip_ratio/region_mean"] == 0
    for (name, a), (_, b) in zip(fast.layout.named_trainable(), slow.layout.named_trainable(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_k3_kl_in_the_loss_ignores_what_sits_on_padding(cfg_for, tmp_path, monkeypatch):
    """Padding's log-probs are unrelated numbers (the reference's is masked to 0): a policy log-prob of
    -200 there made k3's expm1 overflow to inf, and inf * 0 turned the whole micro-batch's loss into NaN
    (the step skipped). Frequent stop tokens make sure responses end early, so padding exists."""
    cfg = cfg_for(kl_in="loss", kl_estimator="k3", kl_coef=0.04, stop_tokens=",".join(str(i) for i in range(40, 400)),
                  total_updates=1)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=index_reward)
    pad, logprobs, padded = trainer.tokenizer.pad_token_id, update_module.head_logprobs, []

    def unlikely_padding(head, hidden, targets, vocab, temperature):
        logp, entropy = logprobs(head, hidden, targets, vocab, temperature)
        padded.append(int((targets == pad).sum()))
        return logp - 200.0 * (targets == pad), entropy

    monkeypatch.setattr(update_module, "head_logprobs", unlikely_padding)
    metrics, _ = trainer.train_one_update()
    assert sum(padded) > 0  # the case exists
    assert metrics["guard/skipped_steps"] == 0
    assert math.isfinite(metrics["loss/policy_avg"]) and math.isfinite(metrics["kl"])


@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "token_mean"])
def test_a_grpo_step_has_the_textbook_gradient_of_a_plain_forward(cfg_for, tmp_path, loss_agg):
    """The gradient one GRPO step applies (shared-prefix rows, accumulated micro-batches, the custom
    log-prob backward) equals autograd's on the loss written out from its definition over a plain peft
    forward of the padded rows: A_i = (r_i - mean_g r) / (std_g r + eps) (unbiased std, TRL's), per-token
    log-probs of softmax(logits / temperature), -A_i log p averaged per sequence then over sequences
    (seq_mean_token_mean, TRL's loss_type="grpo") or over all tokens (token_mean, DAPO's)."""
    cfg = cfg_for(layout="lora", mini_batch_size=8, micro_batch_size=2, temperature=0.7, loss_agg=loss_agg,
                  kl_coef=0.0, learning_rate=1e-3)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=index_reward)
    trainer.train_one_update()  # B leaves 0: the second step's gradient reaches A and B
    named = dict(trainer.layout.named_trainable())
    seen, clip, update = {}, trainer.precision.clip, trainer.ppo_update

    def recorded_clip(optimizer, params, max_norm):
        seen["grads"] = {n: p.grad.clone() for n, p in named.items()}
        seen["weights"] = {n: p.detach().clone() for n, p in named.items()}
        return clip(optimizer, params, max_norm)

    trainer.precision.clip = recorded_clip
    trainer.ppo_update = lambda b: (seen.setdefault("rollout", b), update(b))[1]
    trainer.train_one_update()
    b = seen["rollout"]
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(seen["weights"][n])
    trainer.layout.peft.zero_grad(set_to_none=True)
    scores = b.scores.view(-1, cfg.num_generations)
    adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-4)).flatten()
    n_prompt, n_resp = b.ids.shape[1] - b.resp.shape[1], b.resp.shape[1]
    positions = (b.mask.cumsum(1) - 1).clamp(min=0).long()
    logits = trainer.layout.peft(input_ids=b.ids, attention_mask=b.mask.long(), position_ids=positions).logits
    logits = logits[:, n_prompt - 1:n_prompt + n_resp - 1].float() / cfg.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, b.resp[..., None]).squeeze(-1)
    m = b.resp_mask
    per_token = -adv[:, None] * logp * m
    loss = ((per_token.sum(1) / m.sum(1)).mean() if loss_agg == "seq_mean_token_mean"
            else per_token.sum() / m.sum())
    loss.backward()
    assert any(g.abs().sum() > 0 for n, g in seen["grads"].items() if "lora_A" in n)
    for n, p in named.items():
        torch.testing.assert_close(seen["grads"][n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def _signal_then_flat():
    """A reward with a signal in the first rollout only; every later one scores all alike (a flat rollout)."""
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append(1)
        return index_reward(prompts, completions) if len(calls) == 1 else [0.0] * len(completions)
    return reward


@pytest.mark.parametrize("skip,other_term,steps", [(True, {}, False), (False, {}, True),
                                                   (True, {"ent_coef": 0.1}, True),
                                                   (True, {"kl_coef": 0.05, "kl_estimator": "k3"}, True)])
def test_a_flat_rollout_makes_no_optimizer_step_unless_the_loss_has_another_term(cfg_for, tmp_path, skip,
                                                                                 other_term, steps):
    """After a rollout with a signal, Adam's momentum alone moves the weights on a rollout whose advantages are
    all 0; `skip_flat_rollouts` keeps them where they are. An entropy bonus or GRPO's KL loss (terms that
    still have a gradient) is stepped on as before."""
    cfg = cfg_for(skip_flat_rollouts=skip, mini_batch_size=8, micro_batch_size=4,
                  **{"kl_coef": 0.0, "kl_in": "loss", **other_term})
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=_signal_then_flat())
    first, _ = trainer.train_one_update()
    assert first["guard/flat_rollout_skipped"] == 0 and math.isfinite(first["loss/policy_avg"])
    before = _snapshot(trainer.layout.named_trainable())
    second, _ = trainer.train_one_update()
    assert second["objective/scores"] == 0 and second["reward_std"] == 0
    moved = any(not torch.equal(p, before[n]) for n, p in trainer.layout.named_trainable())
    assert moved == steps
    assert second["guard/flat_rollout_skipped"] == float(not steps)
    assert math.isnan(second["loss/policy_avg"]) == (not steps)


def constant_reward(prompts, completions, **kwargs):
    """Every completion scores 0.3: not a dyadic number, so an fp32 group mean of it is one ulp off."""
    return [0.3] * len(completions)


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_a_reward_that_always_returns_the_same_non_dyadic_number_trains_nothing(cfg_for, tmp_path, advantage):
    # before: each advantage was +2.98e-4 (GRPO: rounding / 1e-4), and Adam stepped that at the full rate
    cfg = cfg_for(advantage=advantage, total_updates=3, num_generations=8, mini_batch_size=16, micro_batch_size=8)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=constant_reward)
    before = _snapshot(trainer.layout.named_trainable())
    for _ in range(3):
        metrics, _ = trainer.train_one_update()
        assert metrics["guard/flat_rollout_skipped"] == 1 and metrics["frac_reward_zero_std"] == 1
    assert all(torch.equal(p, before[n]) for n, p in trainer.layout.named_trainable())


def truncated_index_reward(prompts, completions, *, finished, **kwargs):
    """Distinct scores, every row truncated (asserted by the test): the signal sits in truncated rows only."""
    return [float(i) for i in range(len(completions))]


def test_a_rollout_whose_only_signal_sits_in_truncated_rows_is_flat_under_mask_truncated(cfg_for, tmp_path):
    trainer = RLHFTrainer(cfg_for(mask_truncated=True, max_new_tokens=1, stop_tokens=None), tmp_path,
                          reward_fn=truncated_index_reward)
    metrics, _ = trainer.train_one_update()
    assert metrics["completions/clipped_ratio"] == 1  # every row ran out of tokens: the loss masks them all
    assert metrics["guard/flat_rollout_skipped"] == 1  # the check reads the advantages the loss sees


def half_flat_reward(prompts, completions, **kwargs):
    """Group 0 (rows 0-3) scores 0, 1, 2, 3; group 1 (rows 4-7) scores 0.3 each: flat."""
    return [float(i) if i < 4 else 0.3 for i in range(len(completions))]


@pytest.mark.parametrize("skip", [True, False])
def test_a_mini_batch_whose_every_advantage_is_zero_makes_no_optimizer_step(cfg_for, tmp_path, monkeypatch, skip):
    # mini-batches in rollout order (the shuffle replaced by the identity): rows 0-3 (a signal), rows 4-7 (flat)
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: torch.arange(n, device=kw.get("device")))
    trainer = RLHFTrainer(cfg_for(skip_flat_rollouts=skip, mini_batch_size=4), tmp_path, reward_fn=half_flat_reward)
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *a: steps.append(1))
    metrics, _ = trainer.train_one_update()
    monkeypatch.setattr(torch, "randperm", real)
    assert metrics["guard/flat_rollout_skipped"] == 0
    assert len(steps) == (1 if skip else 2) and metrics["guard/flat_steps_skipped"] == (1 if skip else 0)
