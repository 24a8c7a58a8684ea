"""PPO's minibatch loss and its gradients for the TwinMLP actor-critic, in numpy, derived by hand.

Why a second path next to autograd: at CartPole's size (128 rows, 64-unit layers) the update is all
per-op overhead. Autograd's forward + loss + backward takes ~800 us per minibatch on these CPUs;
this takes ~200 us, and the whole update ~3x less. It computes exactly the trainer's loss
(`core/losses.py` + `ActorCritic.evaluate`):

    loss = mean(max(-A r, -A clip(r, 1 - c, 1 + c))) - ent_coef * mean(H)
           + vf_coef * 0.5 * mean(max((V - R)^2, (V_clip - R)^2))

with A normalized per minibatch, r = exp(logp - old logp), V_clip = old V + clip(V - old V, -c, c)
(or the plain squared error without value clipping), for Categorical and diagonal-Gaussian heads.
Subgradients follow autograd's conventions (ties in max share the gradient, clip passes it at its
bounds), so tests/control/test_handgrad.py can hold the gradients to autograd's at 1e-5.

The gradients are written into the parameters' `.grad` tensors through numpy views, and the step
itself (grad-norm clip, Adam) stays torch's, so optimizer state and checkpoints are the same as on
the autograd path. Used for fp32 agents on CPU; other devices and precisions use autograd.
"""

from __future__ import annotations

import numpy as np
import torch

from ppoforge.control.agent import LOG_2PI, ActorCritic


class HandGradStep:
    """Computes one minibatch's gradients into the agent's .grad; shares memory with the parameters."""

    def __init__(self, agent: ActorCritic, clip: float, clip_vloss: bool, ent_coef: float, vf_coef: float,
                 norm_adv: bool):
        self.agent, self.continuous, self.act_dim = agent, agent.continuous, agent.act_dim
        self.clip, self.clip_vloss, self.ent_coef, self.vf_coef, self.norm_adv = (
            clip, clip_vloss, ent_coef, vf_coef, norm_adv)
        net = agent.net
        self.params = [*net.weights, *net.biases] + ([agent.log_std] if self.continuous else [])
        assert len(self.params) == len(list(agent.parameters())), "every parameter needs its gradient"
        self.grads = [torch.zeros_like(p) for p in self.params]
        # zero-copy views: the optimizer updates the parameters in place, so these stay current
        self.w = [w.detach().numpy() for w in net.weights]
        self.b = [b.detach().numpy() for b in net.biases]
        n_layers = len(self.w)
        self.gw = [g.numpy() for g in self.grads[:n_layers]]
        self.gb = [g.numpy() for g in self.grads[n_layers:2 * n_layers]]
        self.log_std = agent.log_std.detach().numpy() if self.continuous else None
        self.g_log_std = self.grads[2 * n_layers].numpy() if self.continuous else None

    def __call__(self, obs: np.ndarray, actions: np.ndarray, old_logp: np.ndarray, old_values: np.ndarray,
                 adv: np.ndarray, returns: np.ndarray, with_stats: bool) -> dict[str, float] | None:
        """Set every parameter's .grad to d loss / d param for this minibatch; the diagnostics of
        `update.UpdateStats`, by name, if asked."""
        n = obs.shape[0]
        # forward: (2, n, width) per layer, index 0 the actor, 1 the critic
        a1 = np.tanh(obs @ self.w[0] + self.b[0])
        a2 = np.tanh(a1 @ self.w[1] + self.b[1])
        out = a2 @ self.w[2] + self.b[2]
        if self.norm_adv and n > 1:
            adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
        head = _Continuous(self, out, actions) if self.continuous else _Categorical(self, out, actions)

        # d loss / d logp: the clipped surrogate's subgradient
        ratio = np.exp(head.logp - old_logp)
        clipped_ratio = np.clip(ratio, 1.0 - self.clip, 1.0 + self.clip)
        surrogate, surrogate_clipped = -adv * ratio, -adv * clipped_ratio
        d_logp = -adv * ratio / n
        d_logp = np.where(surrogate >= surrogate_clipped, d_logp, d_logp * (clipped_ratio == ratio))
        d_values, v_terms = self._value_grad(out[1, :, 0], old_values, returns)

        d_out = np.zeros_like(out)
        d_out[0, :, :self.act_dim] = head.backward(d_logp)
        d_out[1, :, 0] = d_values
        self._backward(obs, a1, a2, d_out)
        if not with_stats:
            return None
        log_ratio = head.logp - old_logp
        return {"policy_loss": np.maximum(surrogate, surrogate_clipped).mean(), "value_loss": 0.5 * v_terms.mean(),
                "entropy": head.entropy.mean(), "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
                "clipfrac": (np.abs(ratio - 1.0) > self.clip).mean(), "old_approx_kl": (-log_ratio).mean()}

    def _value_grad(self, values: np.ndarray, old_values: np.ndarray, returns: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(d loss / d V, the per-row squared errors the value loss averages)."""
        err = values - returns
        scale = self.vf_coef / values.shape[0]  # d/dV of vf_coef * 0.5 * mean(e^2) is vf_coef * e / n
        if not self.clip_vloss:
            return scale * err, err * err
        delta = values - old_values
        clipped_err = old_values + np.clip(delta, -self.clip, self.clip) - returns
        inside = np.abs(delta) <= self.clip
        d_values = scale * np.where(err * err >= clipped_err * clipped_err, err, clipped_err * inside)
        return d_values, np.maximum(err * err, clipped_err * clipped_err)

    def _backward(self, obs: np.ndarray, a1: np.ndarray, a2: np.ndarray, d_out: np.ndarray) -> None:
        """Through the three layers of both networks at once, into the .grad views."""
        self.gw[2][:] = a2.transpose(0, 2, 1) @ d_out
        self.gb[2][:] = d_out.sum(1, keepdims=True)
        d_z2 = (d_out @ self.w[2].transpose(0, 2, 1)) * (1.0 - a2 * a2)
        self.gw[1][:] = a1.transpose(0, 2, 1) @ d_z2
        self.gb[1][:] = d_z2.sum(1, keepdims=True)
        d_z1 = (d_z2 @ self.w[1].transpose(0, 2, 1)) * (1.0 - a1 * a1)
        self.gw[0][:] = obs.T @ d_z1  # (n_in, n) @ (2, n, hidden) broadcasts to (2, n_in, hidden)
        self.gb[0][:] = d_z1.sum(1, keepdims=True)
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g

    def clip_grad_norm(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s rule on the .grad views: scale by min(1, max / (norm + 1e-6))."""
        flat = [g.reshape(-1) for g in self.gw + self.gb + ([self.g_log_std] if self.continuous else [])]
        norm = float(np.sqrt(sum(float(np.dot(g, g)) for g in flat)))
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in flat:
                g *= coef
        return norm


class _Categorical:
    """log-probs and entropy of a softmax head; `backward` maps d loss / d logp to d loss / d logits."""

    def __init__(self, step: HandGradStep, out: np.ndarray, actions: np.ndarray):
        logits = out[0, :, :step.act_dim]
        shifted = logits - logits.max(-1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(-1, keepdims=True)
        self.probs, self.logp_all = exp / total, shifted - np.log(total)
        self.rows, self.acts = np.arange(logits.shape[0]), actions.astype(np.int64)
        self.logp = self.logp_all[self.rows, self.acts]
        self.entropy = -(self.probs * self.logp_all).sum(-1)
        self.ent_coef = step.ent_coef

    def backward(self, d_logp: np.ndarray) -> np.ndarray:
        d_logits = -self.probs * d_logp[:, None]
        d_logits[self.rows, self.acts] += d_logp
        # d H / d z = -p (log p + H); the loss has -ent_coef * mean(H)
        d_logits += (self.ent_coef / d_logp.shape[0]) * self.probs * (self.logp_all + self.entropy[:, None])
        return d_logits


class _Continuous:
    """log-probs and entropy of a diagonal Gaussian head; `backward` also writes the log-std gradient."""

    def __init__(self, step: HandGradStep, out: np.ndarray, actions: np.ndarray):
        self.step = step
        self.inv_std = np.exp(-step.log_std)
        self.z = (actions - out[0, :, :step.act_dim]) * self.inv_std
        self.logp = (-0.5 * self.z * self.z - step.log_std - 0.5 * LOG_2PI).sum(-1)
        self.entropy = np.full(out.shape[1], (0.5 + 0.5 * LOG_2PI + step.log_std).sum(), dtype=np.float32)

    def backward(self, d_logp: np.ndarray) -> np.ndarray:
        # d logp / d log_std = z^2 - 1 per dim; the entropy term's is 1 per dim (mean over rows)
        self.step.g_log_std[:] = (d_logp[:, None] * (self.z * self.z - 1.0)).sum(0) - self.step.ent_coef
        return d_logp[:, None] * self.z * self.inv_std
