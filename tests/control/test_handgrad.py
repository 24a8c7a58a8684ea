"""The hand-derived numpy gradients equal autograd's on the trainer's own loss, and the updates agree."""

import numpy as np
import pytest
import torch

from ppoforge.control.agent import ActorCritic
from ppoforge.control.config import ControlConfig
from ppoforge.control.handgrad import HandGradStep
from ppoforge.control.update import UpdateStats, autograd_step, handgrad_step, make_step, ppo_update
from ppoforge.core.losses import policy_loss, value_loss
from ppoforge.runtime.precision import make_precision
from ppoforge.runtime.resilience import NonFiniteGuard


def _agent(continuous: bool, act_dim: int, seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    agent = ActorCritic(obs_dim=5, act_dim=act_dim, continuous=continuous, hidden=16)
    with torch.no_grad():  # away from the init: non-trivial probabilities, values and log-std
        for p in agent.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return agent


def _minibatch(agent: ActorCritic, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Old log-probs / values near the current ones, so some ratios and values clip and some don't."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 5, generator=g)
    with torch.no_grad():
        out, values = agent(obs)
        if agent.continuous:
            actions = out + agent.log_std.exp() * torch.randn(out.shape, generator=g)
        else:
            actions = torch.randint(0, agent.act_dim, (n,), generator=g).float()
        logp, _, _ = agent.evaluate(obs, actions)
    return {"obs": obs, "actions": actions, "logp": logp + 0.3 * torch.randn(n, generator=g),
            "values": values + 0.3 * torch.randn(n, generator=g), "adv": torch.randn(n, generator=g),
            "ret": values + torch.randn(n, generator=g)}


def _autograd(agent, mb, cfg: ControlConfig):
    """The autograd path's loss (as in update.autograd_step) and its gradients."""
    agent.zero_grad(set_to_none=True)
    logp, entropy, values = agent.evaluate(mb["obs"], mb["actions"])
    adv = (mb["adv"] - mb["adv"].mean()) / (mb["adv"].std() + 1e-8) if cfg.norm_adv else mb["adv"]
    pg, pg_stats = policy_loss(logp, mb["logp"], adv, cfg.clip_coef)
    vl, _ = value_loss(values, mb["values"], mb["ret"], cfg.clip_coef if cfg.clip_vloss else None)
    ent = entropy.mean()
    (pg - cfg.ent_coef * ent + cfg.vf_coef * vl).backward()
    stats = [pg.item(), vl.item(), ent.item(), pg_stats["approx_kl"].item(), pg_stats["clipfrac"].item(),
             (mb["logp"] - logp).mean().item()]
    return [p.grad.clone() for p in agent.parameters()], stats


@pytest.mark.parametrize("continuous,act_dim", [(False, 2), (False, 5), (True, 1), (True, 3)])
@pytest.mark.parametrize("clip_vloss,norm_adv", [(True, True), (False, False)])
def test_gradients_and_stats_equal_autograd(continuous, act_dim, clip_vloss, norm_adv):
    cfg = ControlConfig(clip_vloss=clip_vloss, norm_adv=norm_adv, ent_coef=0.05, vf_coef=0.7, clip_coef=0.2)
    agent = _agent(continuous, act_dim)
    step = HandGradStep(agent, cfg.clip_coef, cfg.clip_vloss, cfg.ent_coef, cfg.vf_coef, cfg.norm_adv)
    for seed in range(3):
        mb = _minibatch(agent, 64, seed)
        expected, expected_stats = _autograd(agent, mb, cfg)
        stats = step(*(mb[k].numpy() for k in ("obs", "actions", "logp", "values", "adv", "ret")), with_stats=True)
        for name_p, grad, want in zip(agent.state_dict(), (p.grad for p in agent.parameters()), expected,
                                      strict=True):
            assert want.abs().sum() > 0 or name_p == "net.weights.2", name_p  # the loss reaches every parameter
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=name_p)
        assert list(stats) == list(UpdateStats._fields)
        np.testing.assert_allclose(list(UpdateStats(**stats)), expected_stats, rtol=1e-5, atol=1e-6)


def test_some_ratios_and_values_clip_in_the_parity_batches():
    """The parity test above is only as good as its batches: both clipped branches must occur."""
    agent = _agent(False, 2)
    mb = _minibatch(agent, 64, 0)
    with torch.no_grad():
        logp, _, values = agent.evaluate(mb["obs"], mb["actions"])
    ratio = (logp - mb["logp"]).exp()
    assert 0 < ((ratio - 1).abs() > 0.2).float().mean() < 1
    assert 0 < ((values - mb["values"]).abs() > 0.2).float().mean() < 1


def test_clip_grad_norm_matches_torch():
    agent = _agent(True, 2)
    step = HandGradStep(agent, 0.2, True, 0.0, 0.5, True)
    mb = _minibatch(agent, 32, 1)
    step(*(mb[k].numpy() for k in ("obs", "actions", "logp", "values", "adv", "ret")), with_stats=False)
    copies = [torch.zeros_like(p) for p in agent.parameters()]
    for c, p in zip(copies, agent.parameters(), strict=True):
        c.grad = p.grad.clone()
    norm = step.clip_grad_norm(0.01)
    want = torch.nn.utils.clip_grad_norm_(copies, 0.01)  # clips the copies' grads in place
    assert norm == pytest.approx(want.item(), rel=1e-5) and norm > 0.01
    for p, c in zip(agent.parameters(), copies, strict=True):
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("continuous", [False, True])
def test_a_whole_update_follows_the_autograd_update(continuous):
    cfg = ControlConfig(update_epochs=2, num_minibatches=4)
    agents = [_agent(continuous, 2, seed=3) for _ in range(2)]
    batch = _minibatch(agents[0], 256, 7)
    results = []
    fp32 = make_precision("fp32", torch.device("cpu"))
    for agent, hand in zip(agents, (False, True), strict=True):
        opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
        guard = NonFiniteGuard(3, "stop")
        step = handgrad_step(agent, opt, cfg, guard) if hand else autograd_step(agent, opt, fp32, cfg, guard)
        torch.manual_seed(11)  # the minibatch shuffles
        results.append((ppo_update(step, batch, cfg), [p.detach().clone() for p in agent.parameters()]))
    (stats_a, params_a), (stats_h, params_h) = results
    assert isinstance(stats_a, UpdateStats) and isinstance(stats_h, UpdateStats)
    np.testing.assert_allclose(list(stats_h), list(stats_a), rtol=1e-4, atol=1e-6)
    for a, h in zip(params_a, params_h, strict=True):
        torch.testing.assert_close(h, a, rtol=1e-4, atol=1e-6)


def test_make_step_picks_hand_gradients_only_for_fp32_on_cpu():
    agent = _agent(False, 2)
    opt = torch.optim.Adam(agent.parameters())
    cpu = torch.device("cpu")
    guard = NonFiniteGuard(3, "stop")
    name = lambda step: step.__qualname__.split(".")[0]  # noqa: E731
    assert name(make_step(agent, opt, make_precision("fp32", cpu), ControlConfig(), guard)) == "handgrad_step"
    assert name(make_step(agent, opt, make_precision("bf16", cpu), ControlConfig(), guard)) == "autograd_step"
    assert name(make_step(agent, opt, make_precision("fp32", cpu), ControlConfig(hand_gradients=False), guard)) \
        == "autograd_step"
