"""KL estimators and controllers."""

import math

import pytest
import torch

from ppoforge.core.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from ppoforge.core.stats import masked_mean


def test_k1_k2_k3_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k1 = log(0.5 / 0.25) = log 2; k2 = 0.5 (log 2)^2; k3 with r = ref / p = 0.5: (0.5 - 1) - log 0.5
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2)]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * math.log(2) ** 2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([-0.5 + math.log(2)]))


def test_k3_nonnegative_and_both_unbiased_on_samples():
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = (p * (p / q).log()).sum()
    idx = torch.multinomial(p, 200_000, replacement=True)
    logp, ref = p.log()[idx], q.log()[idx]
    k1, k3 = kl_penalty(logp, ref, "k1"), kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()
    torch.testing.assert_close(k1.mean(), exact, atol=5e-3, rtol=0)
    torch.testing.assert_close(k3.mean(), exact, atol=5e-3, rtol=0)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_expected_gradients_as_a_loss_term():
    """On tokens the policy samples, E_pi[grad k] (the sampling not differentiated, as in a loss):
    k1 -> sum pi grad log pi = 0; k2 -> sum pi (log pi - log q) grad log pi = grad KL(pi || q);
    k3 -> sum (pi - q) grad log pi = -sum q grad log pi = grad KL(q || pi)."""
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)

    def grad(f):
        (g,) = torch.autograd.grad(f(torch.log_softmax(theta, 0)), theta)
        return g

    def expected(estimator):  # exact expectation: every action weighted by its (detached) probability
        return lambda logp: (logp.exp().detach() * kl_penalty(logp, q.log(), estimator)).sum()

    forward_kl = grad(lambda logp: (logp.exp() * (logp - q.log())).sum())
    reverse_kl = grad(lambda logp: (q * (q.log() - logp)).sum())
    torch.testing.assert_close(grad(expected("k1")), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(grad(expected("k2")), forward_kl)
    torch.testing.assert_close(grad(expected("k3")), reverse_kl)
    assert not torch.allclose(forward_kl, reverse_kl)


def test_adaptive_controller_moves_toward_target_and_clips():
    ctl = AdaptiveKLController(beta=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=12.0, n_steps=1000)  # error clipped to +0.2: beta *= 1 + 0.2 * 0.1
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=3.0, n_steps=1000)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    restored = AdaptiveKLController(1.0, 6.0, 10_000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_a_masked_position_cannot_poison_the_sum(estimator):
    # k3 at log ratio -100: expm1(100) overflows fp32 to inf; 0 * inf = NaN would poison the masked sum
    assert torch.isinf(kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()
    assert masked_mean(kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3"), torch.tensor([0.0])) == 0
    # with the mask the estimate is 0 there and so is its gradient: no NaN reaches the logits
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    mask = torch.tensor([0.0, 1.0])
    kl = kl_penalty(logp, torch.tensor([0.0, -1.5]), estimator, mask)
    assert kl[0] == 0
    masked_mean(kl, mask).backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0] == 0
    torch.testing.assert_close(kl[1], kl_penalty(torch.tensor(-1.0), torch.tensor(-1.5), estimator))
