"""Per-token rewards and GAE over responses, against a plain Python loop per response; the estimator records.

Three responses of width 5: EOS first (1 real token), EOS in the middle (3), never (5: cut by the
length limit). The naive loop walks each response's real tokens only, backwards:
    r_t = -beta * kl_t (+ score at the last real token)
    delta_t = r_t + gamma * V_{t+1} - V_t   (V after the last real token is 0: no bootstrap)
    A_t = delta_t + gamma * lam * A_{t+1}
"""

from types import SimpleNamespace

import pytest
import torch

from ppoforge.config import build_config
from ppoforge.core.stats import whiten
from ppoforge.errors import UserError
from ppoforge.lm.models.attention import left_pad
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.estimators import ESTIMATORS, advantages
from ppoforge.lm.rl.rollout import Rollout, non_score_rewards, with_scores

LENGTHS = [1, 3, 5]


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None] < torch.tensor(LENGTHS)[:, None]).float()  # (3, 5)
    kl = torch.randn(3, 5, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(3, 5, generator=gen, dtype=torch.float64) * mask
    scores = torch.tensor([0.7, -1.2, 2.5], dtype=torch.float64)
    return scores, kl, values, mask.double()


def token_rewards(scores, kl, mask, beta):
    """Ziegler et al.'s per-token rewards as the trainer builds them: (rewards, non-score rewards)."""
    non_score = non_score_rewards(kl, mask, beta)
    return with_scores(non_score, scores, mask), non_score


def _naive(scores, kl, values, beta, gamma, lam):
    rewards, adv = torch.zeros_like(kl), torch.zeros_like(kl)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            rewards[i, t] = -beta * kl[i, t] + (scores[i] if t == n - 1 else 0.0)
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[i, t + 1] if t + 1 < n else 0.0
            last = rewards[i, t] + gamma * next_value - values[i, t] + gamma * lam * last
            adv[i, t] = last
    return rewards, adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_token_rewards_and_gae_equal_a_loop_over_each_response(gamma, lam):
    scores, kl, values, mask = _batch()
    rewards, non_score = token_rewards(scores, kl, mask, beta=0.1)
    want_rewards, want_adv = _naive(scores, kl, values, 0.1, gamma, lam)
    torch.testing.assert_close(rewards, want_rewards)
    torch.testing.assert_close(non_score, -0.1 * kl * mask)
    adv, ret = advantages(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ret, (want_adv + values) * mask)
    torch.testing.assert_close(adv, whiten(want_adv, mask))
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_whatever_sits_on_padding_changes_nothing():
    scores, kl, values, mask = _batch()
    rewards, _ = token_rewards(scores, kl, mask, beta=0.1)
    clean = advantages(rewards, values, mask, 1.0, 0.95)
    junk = 1e6 * (1 - mask)
    rewards_j, _ = token_rewards(scores, kl + junk, mask, beta=0.1)
    dirty = advantages(rewards_j + junk, values + junk, mask, 1.0, 0.95)
    for a, b in zip(clean, dirty, strict=True):
        torch.testing.assert_close(a, b)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _multiturn_rollout(scores, turn_rewards):
    """Two groups of G = 2 two-turn episodes over width 4: policy tokens at 0-1 (turn 1) and 3 (turn 2),
    the environment's token at 2 (masked out)."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]]).repeat(4, 1)
    zeros = torch.zeros(4, 4)
    return Rollout(ids=torch.zeros(4, 6, dtype=torch.long), mask=torch.ones(4, 6),
                   resp=torch.zeros(4, 4, dtype=torch.long), resp_mask=mask,
                   logp=zeros, ref_logp=None, values=None, scores=scores, turn_rewards=turn_rewards)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_the_whole_return_is_centred_whether_it_comes_as_turn_rewards_or_as_scores(advantage):
    """Episode returns [1, 0 | 3, 3] given once as final scores, once as a reward on the last turn's last
    policy token (an environment without score(), like guess_number): the same per-token rewards, so the
    same advantages; each estimator's baseline must see the turn rewards."""
    returns = torch.tensor([1.0, 0.0, 3.0, 3.0])
    as_turns = torch.zeros(4, 4)
    as_turns[:, 3] = returns
    cfg = SimpleNamespace(num_generations=2, reward_scale="group" if advantage == "grpo" else "none", gamma=1.0)
    non_score = torch.zeros(4, 4)
    by_score, _ = ESTIMATORS[advantage].estimate(_multiturn_rollout(returns, None), non_score, cfg)
    by_turn, _ = ESTIMATORS[advantage].estimate(_multiturn_rollout(torch.zeros(4), as_turns), non_score, cfg)
    torch.testing.assert_close(by_turn, by_score)
    assert by_score[2:].abs().max() < 1e-6 < by_score[:2].abs().max()  # group 2's equal returns: no signal


def test_the_config_reads_the_estimator_records():
    """Choices, critic, groups and allowed scalings come from `ESTIMATORS`: PPO (gae) alone has a critic,
    the group estimators refuse G = 1, a scaling is refused where the record does not allow it."""
    assert RLHFConfig.__dataclass_fields__["advantage"].metadata["choices"] == tuple(ESTIMATORS)
    for name, est in ESTIMATORS.items():
        cfg = build_config(RLHFConfig, dict(advantage=name, num_generations=2, batch_size=8, mini_batch_size=16))
        assert cfg.estimator is est and cfg.has_critic == (name == "gae") == est.critic
        assert cfg.curve_title == f"{est.title} lora" and ("loss/value_avg" in cfg.stat_keys[0]) == est.critic
        if est.groups:
            with pytest.raises(UserError, match=f"num_generations: 1 with advantage {name}"):
                build_config(RLHFConfig, dict(advantage=name))
        for scale in ("group", "batch", "none"):
            values = dict(advantage=name, num_generations=2, batch_size=8, mini_batch_size=16, scale_rewards=scale,
                          kl_in="loss", kl_estimator="k3")
            if scale in est.scales:
                assert build_config(RLHFConfig, values).reward_scale == scale
            else:
                with pytest.raises(UserError, match=f"^scale_rewards: {scale} "):
                    build_config(RLHFConfig, values)
    assert [ESTIMATORS[n].title for n in ("gae", "grpo")] == ["PPO", "GRPO"]
    episodes = build_config(RLHFConfig, dict(env="guess_number", reward="env"))
    assert episodes.curve_title == "PPO lora, guess_number episodes"
