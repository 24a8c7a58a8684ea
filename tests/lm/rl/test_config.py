"""RLHFConfig's `auto` defaults: loss_agg (the policy loss's own aggregation: GSPO's eq. 5 for gspo) and
heldout_prompts (the demo's held-out set with the demo prompts, a split of any other), every preset as before."""

import pytest
import torch

from ppoforge.config import build_config, list_presets, read_preset
from ppoforge.core.accumulation import loss_aggregation
from ppoforge.core.policy_losses import POLICY_LOSSES
from ppoforge.lm.rl.config import RLHFConfig

EPS_LOW, EPS_HIGH = 0.2, 0.28


def trl_sequence_level_grpo_loss(logp, old, adv, mask):
    """TRL's GRPOTrainer._compute_loss with importance_sampling_level="sequence", loss_type="grpo", beta 0
    (trl/trainer/grpo_trainer.py, 1.12 to 1.16), written out: each sequence's loss counted once."""
    log_ratio = logp - old
    log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])  # (B, T)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_gspo_with_its_default_loss_agg_is_gspos_objective_as_trl_computes_it():
    """GSPO's eq. 5: the mean over sequences of min(s_i A_i, clip(s_i) A_i); token_mean (the default before)
    weighed each sequence by its length and differs here by far more than 1e-6."""
    cfg = build_config(RLHFConfig, {"policy_loss": "gspo", "clip": EPS_LOW, "clip_high": EPS_HIGH})
    assert cfg.loss_agg == "auto" and cfg.aggregation == "seq_mean_token_mean"
    gen = torch.Generator().manual_seed(3)
    B, T = 12, 9
    logp = -torch.rand(B, T, generator=gen) * 3
    old = logp + 0.7 * torch.randn(B, T, generator=gen)
    lengths = torch.tensor([1, 9, 2, 7, 3, 5, 9, 4, 6, 8, 1, 2])  # ragged: the aggregations differ
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(B, generator=gen)

    def grad_of(loss_fn):
        x = logp.clone().requires_grad_()
        loss = loss_fn(x)
        loss.backward()
        return loss.detach(), x.grad

    reduce = loss_aggregation(cfg.aggregation, cfg.max_new_tokens).reduce
    ours = grad_of(lambda x: POLICY_LOSSES[cfg.policy_loss](x, old, adv[:, None] * mask, cfg.clip, mask,
                                                            cfg.clip_high, reduce)[0])
    want = grad_of(lambda x: trl_sequence_level_grpo_loss(x, old, adv, mask))
    ratio = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert bool((ratio < 1 - EPS_LOW).any()) and bool((ratio > 1 + EPS_HIGH).any()), "clipped on both sides"
    torch.testing.assert_close(ours[0], want[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[1], want[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("preset", list_presets("rlhf"))
def test_every_preset_keeps_its_loss_agg_and_heldout_set(preset):
    """auto resolves to what the field's old default gave each preset: loss_agg token_mean (no preset uses
    gspo), heldout_prompts demo-heldout (every preset without its own trains on the demo prompts)."""
    values = read_preset(preset, "rlhf")
    cfg = build_config(RLHFConfig, values)
    assert cfg.aggregation == values.get("loss_agg", "token_mean")
    assert cfg.heldout_source == values.get("heldout_prompts", "demo-heldout")
    assert not cfg.heldout_split


@pytest.mark.parametrize(("values", "agg"), [
    ({}, "token_mean"), ({"policy_loss": "cispo"}, "token_mean"), ({"policy_loss": "gspo"}, "seq_mean_token_mean"),
    ({"policy_loss": "gspo", "loss_agg": "seq_sum_norm"}, "seq_sum_norm"),
    ({"loss_agg": "seq_mean_token_mean"}, "seq_mean_token_mean")])
def test_loss_agg_auto_is_the_policy_loss_own_and_an_explicit_one_is_kept(values, agg):
    assert build_config(RLHFConfig, values).aggregation == agg


@pytest.mark.parametrize(("values", "warned"), [
    ({"policy_loss": "gspo"}, False), ({"policy_loss": "gspo", "loss_agg": "seq_mean_token_mean"}, False),
    ({"policy_loss": "gspo", "loss_agg": "token_mean"}, True), ({"policy_loss": "gspo", "loss_agg": "seq_sum_norm"},
                                                                True),
    ({"loss_agg": "seq_sum_norm"}, False)])
def test_gspo_with_another_loss_agg_is_allowed_with_one_line(values, warned):
    notes = build_config(RLHFConfig, values).notes()
    assert len(notes) == warned
    if warned:
        assert notes[0].startswith(f"loss_agg: {values['loss_agg']} with policy_loss gspo is not GSPO's objective")
        assert "\n" not in notes[0]


@pytest.mark.parametrize(("values", "source", "split"), [
    ({}, "demo-heldout", False), ({"prompts": "p.jsonl"}, "p.jsonl", True),
    ({"prompts": "p.jsonl", "heldout_prompts": "demo-heldout"}, "demo-heldout", False),
    ({"prompts": "p.jsonl", "heldout_prompts": "none"}, None, False),
    ({"heldout_prompts": "h.jsonl"}, "h.jsonl", False)])
def test_heldout_auto_is_the_demos_set_for_the_demo_prompts_else_a_split(values, source, split):
    cfg = build_config(RLHFConfig, values)
    assert (cfg.heldout_source, cfg.heldout_split) == (source, split)
