"""Generalized Advantage Estimation (Schulman et al. 2016), time-major, for control and LM alike.

One function serves both domains: control rollouts are (T, N) with episodes ending anywhere; LM
responses are (T, B) after a transpose, ending at EOS. Two flags per step keep the two meanings of
"done" apart, which is what lets time-limit truncation bootstrap correctly:

- `terminated[t]`: the MDP ended, so the next state's value is 0 (no bootstrap);
- `ended[t]`: the episode stops here for any reason (terminated or truncated), so the λ-chain is cut.

For a truncated step, `next_values[t]` is V(final observation) and gets bootstrapped.
"""

from __future__ import annotations

import numpy as np
import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, terminated: torch.Tensor,
        ended: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns; every input is (T, ...) and the flags are bool or 0/1.

    delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
    A_t     = delta_t + gamma * lam * (1 - ended_t) * A_{t+1}
    returns = A + V
    """
    dtype = values.dtype
    delta = rewards + gamma * next_values * (1 - terminated.to(dtype)) - values
    carry = (gamma * lam) * (1 - ended.to(dtype))
    if delta.device.type == "cpu":
        # The reverse scan is latency bound: numpy's per-op cost is ~10x below torch's on CPU.
        adv = torch.from_numpy(_reverse_scan(delta.numpy(), carry.numpy(), np.zeros_like(delta.numpy())))
    else:
        adv = _reverse_scan(delta, carry, torch.zeros_like(delta))
    return adv, adv + values


def _reverse_scan(delta, carry, out):
    """out[t] = delta[t] + carry[t] * out[t + 1], written for numpy arrays and torch tensors alike."""
    last = 0.0
    for t in range(delta.shape[0] - 1, -1, -1):
        last = delta[t] + carry[t] * last
        out[t] = last
    return out


def pack_left(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) int64 per-row permutation that moves the real entries to the front, in
    order: `x.gather(1, order)` packs a row, `packed_out.scatter(1, order, ...)` unpacks. For a mask that
    is already a prefix (a single-turn response) it is the identity.

    Multi-turn sequences interleave policy and environment tokens; GAE's lambda-chain and value
    bootstrap, and a reward-to-go's discount, must run over the policy's tokens only (verl does the
    same), so the estimators see packed rows.
    """
    return torch.sort((mask == 0).to(torch.uint8), dim=1, stable=True).indices


def over_real_tokens(fn, mask: torch.Tensor, *xs: torch.Tensor):
    """fn(*packed xs, packed mask) on rows packed by `pack_left(mask)`; its outputs (a tensor or a tuple
    of them, (B, T) each) unpacked to the original positions. 0 where mask is 0 if fn zeroes padding."""
    order = pack_left(mask)
    out = fn(*(x.gather(1, order) for x in xs), mask.gather(1, order))
    unpack = lambda y: torch.empty_like(y).scatter_(1, order, y)  # noqa: E731
    return tuple(unpack(y) for y in out) if isinstance(out, tuple) else unpack(out)
