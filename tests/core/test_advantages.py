"""GAE against a naive per-step loop and against hand-computed values."""

import numpy as np
import torch

from ppoforge.core.advantages import _reverse_scan, gae


def naive_gae(rewards, values, next_values, terminated, ended, gamma, lam):
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            bootstrap = 0.0 if terminated[t, n] else next_values[t, n]
            delta = rewards[t, n] + gamma * bootstrap - values[t, n]
            running = delta + gamma * lam * (0.0 if ended[t, n] else running)
            adv[t, n] = running
    return adv, adv + values


def _random_rollout(T=37, N=5, seed=0):
    rng = np.random.default_rng(seed)
    rewards, values, next_values = (rng.normal(size=(T, N)).astype(np.float32) for _ in range(3))
    terminated = rng.random((T, N)) < 0.1
    truncated = (rng.random((T, N)) < 0.1) & ~terminated
    return rewards, values, next_values, terminated, terminated | truncated


def test_gae_matches_naive_loop_with_terminations_and_truncations():
    arrays = _random_rollout()
    expected_adv, expected_ret = naive_gae(*arrays, 0.97, 0.9)
    adv, ret = gae(*(torch.from_numpy(x) for x in arrays), gamma=0.97, lam=0.9)
    np.testing.assert_allclose(adv.numpy(), expected_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), expected_ret, rtol=1e-5, atol=1e-5)


def test_torch_scan_used_on_accelerators_matches_numpy_scan():
    rewards, values, next_values, terminated, ended = _random_rollout(seed=1)
    delta = rewards + 0.97 * next_values * ~terminated - values
    carry = (0.97 * 0.9 * ~ended).astype(np.float32)
    on_numpy = _reverse_scan(delta, carry, np.zeros_like(delta))
    on_torch = _reverse_scan(torch.from_numpy(delta), torch.from_numpy(carry), torch.zeros(delta.shape))
    np.testing.assert_allclose(on_torch.numpy(), on_numpy, rtol=1e-6, atol=1e-6)


def test_gae_hand_values_truncation_bootstraps_termination_does_not():
    # One env, 3 steps, gamma = 0.5, lambda = 1.
    # r = [1, 1, 1], V = [0, 0, 0]; step 1 truncates with V(final obs) = 4; step 2 terminates.
    # delta_2 = 1 + 0 (terminated)         - 0 = 1      -> A_2 = 1
    # delta_1 = 1 + 0.5 * 4 (bootstrapped)  - 0 = 3      -> A_1 = 3 (chain cut: episode ended)
    # delta_0 = 1 + 0.5 * V(s_1) = 1 + 0.5*0 - 0 = 1     -> A_0 = 1 + 0.5 * 3 = 2.5
    rewards = torch.ones(3, 1)
    values = torch.zeros(3, 1)
    next_values = torch.tensor([[0.0], [4.0], [7.0]])
    terminated = torch.tensor([[False], [False], [True]])
    ended = torch.tensor([[False], [True], [True]])
    adv, ret = gae(rewards, values, next_values, terminated, ended, gamma=0.5, lam=1.0)
    assert adv[:, 0].tolist() == [2.5, 3.0, 1.0]
    assert torch.equal(ret, adv)


def test_gae_lambda_zero_is_one_step_td():
    rewards, values = torch.tensor([[1.0], [2.0]]), torch.tensor([[0.5], [1.0]])
    next_values = torch.tensor([[1.0], [3.0]])
    flags = torch.zeros(2, 1, dtype=torch.bool)
    adv, _ = gae(rewards, values, next_values, flags, flags, gamma=0.9, lam=0.0)
    # A_t = r_t + 0.9 * V' - V: 1 + 0.9 - 0.5 = 1.4 ; 2 + 2.7 - 1 = 3.7
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.4, 3.7]))
