"""The actor-critic: rollout policies agree with the trainer's log-probs; actor and critic are separate."""

import numpy as np
import pytest
import torch

from ppoforge.control.agent import ActorCritic, NumpyPolicy, TorchPolicy


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("policy_cls", [NumpyPolicy, TorchPolicy])
def test_rollout_logp_and_value_match_the_training_forward(continuous, policy_cls):
    torch.manual_seed(0)
    agent = ActorCritic(obs_dim=5, act_dim=3, continuous=continuous)
    with torch.no_grad():  # move away from the near-uniform init so the check means something
        for p in agent.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    obs = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    action, logp, value = policy_cls(agent, np.random.default_rng(1)).act(obs)
    t_logp, _, t_value = agent.evaluate(torch.from_numpy(obs), torch.from_numpy(np.asarray(action)))
    np.testing.assert_allclose(logp, t_logp.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(value, t_value.detach().numpy(), atol=1e-5)


def test_numpy_policy_samples_the_categorical_distribution():
    agent = ActorCritic(obs_dim=2, act_dim=3, continuous=False)
    with torch.no_grad():
        agent.net.biases[2][0, 0] = torch.tensor([0.0, 1.0, 2.0])  # actor head bias sets the logits
        agent.net.weights[2].zero_()
    policy = NumpyPolicy(agent, np.random.default_rng(0))
    actions = np.concatenate([policy.act(np.zeros((1000, 2), np.float32))[0] for _ in range(20)])
    freq = np.bincount(actions, minlength=3) / actions.size
    np.testing.assert_allclose(freq, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0).numpy(), atol=0.01)


def test_actor_and_critic_share_no_parameters():
    agent = ActorCritic(obs_dim=4, act_dim=2, continuous=False)
    obs = torch.randn(16, 4)
    _, value = agent(obs)
    value.sum().backward()
    for w in agent.net.weights:
        assert w.grad[0].abs().sum() == 0  # actor slice untouched by the value loss
        assert w.grad[1].abs().sum() > 0


def test_orthogonal_init_gains():
    agent = ActorCritic(obs_dim=4, act_dim=2, continuous=False, hidden=64)
    w_hidden = agent.net.weights[1][0]  # (64, 64), orthogonal with gain sqrt(2)
    torch.testing.assert_close(w_hidden.T @ w_hidden, 2 * torch.eye(64), atol=1e-5, rtol=0)
    actor_head, critic_head = agent.net.weights[2][0], agent.net.weights[2][1]
    torch.testing.assert_close(torch.linalg.svdvals(actor_head), torch.full((2,), 0.01), atol=1e-6, rtol=0)
    assert critic_head[:, 0].norm().item() == pytest.approx(1.0, abs=1e-5)
    assert critic_head[:, 1].abs().sum() == 0  # padding column of the narrower head
    assert all(b.abs().sum() == 0 for b in agent.net.biases)


def test_from_state_dict_rebuilds_the_same_network():
    agent = ActorCritic(obs_dim=3, act_dim=2, continuous=True, hidden=16)
    clone = ActorCritic.from_state_dict(agent.state_dict())
    obs = torch.randn(5, 3)
    torch.testing.assert_close(clone(obs)[0], agent(obs)[0])
    assert clone.continuous and clone.act_dim == 2
