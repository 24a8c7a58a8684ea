"""ppoforge's policy losses against TRL's own `GRPOTrainer._compute_loss` (the real method, not a copy of its
lines), on the same log-probs, old log-probs, advantages and mask: loss and gradient equal within 1e-6.

The trainer is a stand-in holding only the attributes `_compute_loss` reads, its model forward replaced by
our log-probs; the method is called unbound on it. TRL is not a dependency: without it the test skips. To
run it against a TRL that is not installed here, put a folder holding only the `trl` package on PYTHONPATH
(its transformers and accelerate come from this environment). Checked with TRL 1.12 and 1.16.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from ppoforge.core.accumulation import loss_aggregation
from ppoforge.core.policy_losses import POLICY_LOSSES

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed: the parity with "
                               "GRPOTrainer._compute_loss is checked where it is (see this file's docstring)")

B, T, HORIZON, CLIP = 16, 6, 8, 0.2
# (ppoforge policy_loss, loss_agg) -> (TRL loss_type, importance_sampling_level)
CASES = [("ppo", "seq_mean_token_mean", "grpo", "token"), ("ppo", "token_mean", "bnpo", "token"),
         ("ppo", "token_mean", "dapo", "token"), ("ppo", "seq_sum_norm", "dr_grpo", "token"),
         ("gspo", "seq_mean_token_mean", "grpo", "sequence"), ("gspo", "token_mean", "bnpo", "sequence"),
         ("gspo", "token_mean", "dapo", "sequence"), ("gspo", "seq_sum_norm", "dr_grpo", "sequence"),
         ("cispo", "token_mean", "cispo", "token")]


def _batch():
    """Ratios spread well past the clip on both sides, ragged lengths (1 to T real tokens), both signs of A."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=gen) * 3
    old = logp + 0.5 * torch.randn(B, T, generator=gen)
    lengths = torch.arange(B) % T + 1
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(B, generator=gen)
    return logp, old, mask, adv


def _stand_in(logp, loss_type, level, eps_high):
    """Only what `_compute_loss` reads: one process, no accumulation, no KL (beta 0), no vLLM, no entropy
    bonus or mask; `_get_per_token_logps_and_entropies` returns our log-probs."""
    args = SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False)
    accelerator = SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=CLIP, epsilon_high=eps_high,
        args=args, use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=HORIZON, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)})


def trl_loss(logp, old, mask, adv, loss_type, level, eps_high):
    """TRL's loss, its gradient with respect to logp and its logged metrics."""
    logp = logp.clone().requires_grad_()
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    trainer = _stand_in(logp, loss_type, level, eps_high)
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), logp.grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def our_loss(logp, old, mask, adv, name, agg, clip_high):
    logp = logp.clone().requires_grad_()
    reduce = loss_aggregation(agg, HORIZON).reduce
    loss, stats = POLICY_LOSSES[name](logp, old, adv[:, None] * mask, CLIP, mask, clip_high, reduce)
    loss.backward()
    return loss.detach(), logp.grad, stats


@pytest.mark.parametrize("clip_high", [None, 0.28])
@pytest.mark.parametrize(("name", "agg", "loss_type", "level"), CASES)
def test_policy_losses_equal_trls(name, agg, loss_type, level, clip_high):
    logp, old, mask, adv = _batch()
    high = CLIP if clip_high is None else clip_high
    eps_high = 1 + high if name == "cispo" else high  # TRL's cispo epsilon_high is the cap itself
    want, want_grad, metrics = trl_loss(logp, old, mask, adv, loss_type, level, eps_high)
    got, got_grad, stats = our_loss(logp, old, mask, adv, name, agg, clip_high)
    assert float(stats["low"]) > 0 or name == "cispo", "the batch should clip below"
    assert float(stats["high"]) > 0, "the batch should clip above"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=0)
    if name == "cispo":  # TRL's share of capped weights with A > 0
        assert float(stats["high"]) == pytest.approx(metrics["cispo_clip_ratio"], abs=1e-6)
    elif level == "token":  # at the sequence level TRL counts sequences, we count their tokens
        for k in ("low", "high", "region"):
            assert float(stats[k]) == pytest.approx(metrics[f"clip_ratio/{k}_mean"], abs=1e-6), k
