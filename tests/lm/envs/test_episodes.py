"""Multi-turn episodes: chunked appends with holes, per-turn credit over policy tokens, and whole episodes
played against real environments on a tiny LM (token in / token out, budgets, masks)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppoforge.core.advantages import gae, over_real_tokens, pack_left
from ppoforge.core.stats import whiten
from ppoforge.lm.envs.protocol import EnvStep
from ppoforge.lm.models.attention import causal_mask, position_ids
from ppoforge.lm.models.decoders import HFDecoder, LlamaDecoder
from ppoforge.lm.rl.estimators import advantages, gae_estimate
from ppoforge.lm.rl.rollout import Rollout, with_scores

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, **SMALL)).eval()


def _alone_logits(model, tokens: list[int]) -> torch.Tensor:
    """The next-token logits after `tokens`, from one plain forward of that row alone."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1]


@pytest.mark.parametrize("decoder_cls", [LlamaDecoder, HFDecoder])
def test_extend_with_holes_equals_each_row_alone(model, decoder_cls):
    """Rows append different numbers of tokens (decode steps where some rows wait, a reply chunk padded
    on the left): every row's logits equal those of its real tokens run alone, without holes."""
    prompts = [[5, 9, 13], [40, 41, 42, 43, 44]]
    ids = torch.tensor([[0, 0] + prompts[0], prompts[1]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    dec = decoder_cls(model)
    seqs = [list(p) for p in prompts]
    with torch.inference_mode():
        dec.prefill(ids, mask, 12)
        # decode steps: row 0 appends twice, row 1 once then waits (a hole)
        for tok, valid in (([3, 4], [True, True]), ([6, 7], [True, False])):
            logits, _ = dec.extend(torch.tensor(tok)[:, None], torch.tensor(valid)[:, None])
            for i in range(2):
                if valid[i]:
                    seqs[i].append(tok[i])
                    torch.testing.assert_close(logits[i], _alone_logits(model, seqs[i]), atol=1e-5, rtol=1e-5)
        # a reply chunk: row 0 gets 2 tokens, row 1 gets 4, right-aligned
        chunk = torch.tensor([[0, 0, 20, 21], [30, 31, 32, 33]])
        valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
        logits, _ = dec.extend(chunk, valid)
    seqs[0] += [20, 21]
    seqs[1] += [30, 31, 32, 33]
    for i in range(2):
        torch.testing.assert_close(logits[i], _alone_logits(model, seqs[i]), atol=1e-5, rtol=1e-5)


def test_pack_left_is_identity_on_prefix_masks_and_packs_holes():
    prefix = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    assert pack_left(prefix).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    holes = torch.tensor([[1.0, 0, 0, 1, 1, 0]])
    assert pack_left(holes).tolist() == [[0, 3, 4, 1, 2, 5]]
    x = torch.arange(6.0)[None]
    doubled = over_real_tokens(lambda v, m: v * 2 * m, holes, x)
    assert doubled.tolist() == [[0.0, 0, 0, 6, 8, 0]]


def test_two_turn_gae_skips_environment_tokens_by_hand():
    """Turn 1: policy tokens at 0, 1; environment tokens at 2, 3; turn 2: policy tokens at 4, 5.
    Turn rewards 0.5 (turn 1's last token, index 1) and score 2 (the last policy token, index 5).
    Over policy tokens only (p0 p1 p4 p5), gamma 0.9, lambda 0.8, values 1, 2, 3, 4:
      delta5 = 2 - 4 = -2                         A5 = -2
      delta4 = 0 + 0.9*4 - 3 = 0.6                A4 = 0.6 + 0.72*(-2) = -0.84
      delta1 = 0.5 + 0.9*3 - 2 = 1.2              A1 = 1.2 + 0.72*(-0.84) = 0.5952
      delta0 = 0 + 0.9*2 - 1 = 0.8                A0 = 0.8 + 0.72*0.5952 = 1.228544
    V at the environment tokens (99) must not matter."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    values = torch.tensor([[1.0, 2, 99, 99, 3, 4]])
    turn = torch.tensor([[0.0, 0.5, 0, 0, 0, 0]])
    rewards = with_scores(turn, torch.tensor([2.0]), mask)
    assert rewards.tolist() == [[0.0, 0.5, 0, 0, 0, 2.0]]
    expected = torch.tensor([[1.228544, 0.5952, 0, 0, -0.84, -2.0]])
    packed = over_real_tokens(lambda r, v, m: _raw_gae(r, v, m, 0.9, 0.8), mask, rewards, values)
    torch.testing.assert_close(packed[0], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(packed[1], (expected + values) * mask, atol=1e-6, rtol=0)  # returns
    # the estimator the trainer calls: the same GAE, then whitened over policy tokens
    b = Rollout(torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6), torch.zeros(1, 6, dtype=torch.long), mask,
                torch.zeros(1, 6), None, values * mask, torch.tensor([2.0]), turn_rewards=turn)

    class Cfg:
        gamma, lam, whiten_rewards = 0.9, 0.8, False

    adv, ret = gae_estimate(b, torch.zeros(1, 6), Cfg)
    torch.testing.assert_close(ret, (expected + values) * mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(adv, whiten(expected, mask), atol=1e-6, rtol=0)
    assert adv[0, 2] == 0 and adv[0, 3] == 0


def _raw_gae(rewards, values, mask, gamma, lam):
    values = values * mask
    next_mask = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    done = 1.0 - next_mask
    adv, ret = gae(rewards.T, values.T, next_values.T, done.T, done.T, gamma, lam)
    return adv.T * mask, ret.T * mask


def test_single_turn_gae_is_unchanged_by_packing():
    """A prefix mask packs to itself: advantages equal the unpacked computation bit for bit."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    rewards, values = torch.randn(3, 4) * mask, torch.randn(3, 4)
    adv, ret = advantages(rewards, values, mask, 1.0, 0.95)
    raw_adv, raw_ret = _raw_gae(rewards, values, mask, 1.0, 0.95)
    assert torch.equal(ret, raw_ret)
    assert torch.equal(adv, whiten(raw_adv, mask))


# ---- whole episodes on the tiny chat LM (tests/lm/conftest.py) against the built-in guess_number

class Scripted:
    """An environment with a fixed script: replies "r<k>" until turn `done_at` (reward k each turn)."""

    def __init__(self, done_at: int = 99, reply: str = "try again"):
        self.done_at, self.reply, self.k = done_at, reply, 0

    def reset(self, row, rng):
        return f"game {row['n']} seed {rng.randint(0, 9)}"

    def step(self, reply):
        self.k += 1
        return EnvStep(self.reply, reward=float(self.k), done=self.k >= self.done_at)

    def score(self):
        return 10.0


def _play(lm, envs, rows, budgets, n_new=5, seed=0, end_check="warn", seeds=None, share_prefill=False):
    from ppoforge.lm.envs.chat import ChatRenderer
    from ppoforge.lm.envs.episodes import run_episodes
    from ppoforge.lm.models.sampler import SamplingParams

    tokenizer, model = lm
    params = SamplingParams(n_new, temperature=1.0, stop_ids=(tokenizer.eos_token_id,),
                            pad_id=tokenizer.pad_token_id)
    uniforms = torch.rand(budgets.max_turns * n_new, len(rows), generator=torch.Generator().manual_seed(seed))
    renderer = ChatRenderer(tokenizer, end_check)
    out = run_episodes(LlamaDecoder(model), renderer, envs, rows, seeds or list(range(len(rows))), params, budgets,
                       uniforms, 64, "cpu", share_prefill=share_prefill)
    assert torch.is_inference(out[2].logp)  # decoding records no autograd graph
    return (*out, renderer)


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    from ppoforge.lm.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_lm_dir))
    return tokenizer, load_causal_lm(str(tiny_lm_dir), torch.float32, "cpu", tokenizer=tokenizer).eval()


def test_episode_tokens_masks_and_logprobs(lm):
    """Token in / token out: each row is prompt + policy turns + the renderer's reply tokens; the action
    mask is 1 exactly on the sampled tokens, whose sampler log-probs equal one forward of the whole
    episode; turn rewards sit on each turn's last policy token and the score on the last one."""
    from ppoforge.lm.envs.episodes import Budgets

    tokenizer, model = lm
    budgets = Budgets(max_turns=3, max_episode_tokens=200, max_env_tokens=32)
    envs = [Scripted(done_at=2), Scripted(), Scripted(done_at=1)]
    prompt_ids, prompt_mask, ep, renderer = _play(lm, envs, [{"n": i} for i in range(3)], budgets)
    assert ep.end == ["done", "max_turns", "done"] and ep.turns == [2, 3, 1]
    assert ep.scores.tolist() == [10.0, 10.0, 10.0]
    for i in range(len(envs)):
        n = int(ep.token_mask[i].sum())
        action = ep.response_mask[i, :n].bool()
        assert not ep.token_mask[i, n:].any() and ep.env_tokens[i] == int((~action).sum())
        # turn ends: the last policy token before each environment block (and the episode's last one)
        ends = [j for j in range(n) if action[j] and (j + 1 == n or not action[j + 1])]
        assert len(ends) == ep.turns[i] and int(action[-1]) == 1
        assert ep.turn_rewards[i, ends].tolist() == [float(k + 1) for k in range(len(ends))]
        assert ep.turn_rewards[i].sum() == sum(range(1, len(ends) + 1))
        assert ep.returns()[i] == 10.0 + sum(range(1, len(ends) + 1))
    # the sampler's log-probs of the policy tokens = a full forward of prompt + whole episode
    ids = torch.cat([prompt_ids, ep.response_ids], 1)
    mask = torch.cat([prompt_mask.float(), ep.token_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=causal_mask(mask), position_ids=position_ids(mask)).logits
    logp = torch.log_softmax(logits[:, prompt_ids.shape[1] - 1:-1], -1).gather(2, ep.response_ids[..., None])[..., 0]
    torch.testing.assert_close(ep.logp, logp * ep.response_mask, atol=1e-5, rtol=0)
    # the environment tokens are the renderer's: rebuilding the conversation gives the same sequence
    first = envs[1]
    assert first.k == 3 and ep.transcripts[1].count("user: try again") == 2


def test_a_groups_episodes_prefill_their_first_prompt_once_and_play_as_if_each_had_its_own(lm, monkeypatch):
    """`share_prefill`: G episodes of one game (the same row and seed: one first prompt) prefill it once and
    repeat its KV cache; with the same uniforms the episodes are those of every row prefilled."""
    from ppoforge.lm.envs.episodes import Budgets

    prefilled, prefill = [], LlamaDecoder.prefill
    monkeypatch.setattr(LlamaDecoder, "prefill", lambda self, i, m, n: prefilled.append(i.shape[0]) or
                        prefill(self, i, m, n))
    rows, seeds = [{"n": 0}] * 3 + [{"n": 1}] * 3, [5] * 3 + [6] * 3
    budgets = Budgets(max_turns=2, max_episode_tokens=200, max_env_tokens=32)
    shared = _play(lm, [Scripted() for _ in rows], rows, budgets, seeds=seeds, share_prefill=True)[2]
    plain = _play(lm, [Scripted() for _ in rows], rows, budgets, seeds=seeds)[2]
    assert prefilled == [2, 6]
    assert torch.equal(shared.response_ids, plain.response_ids) and shared.turns == plain.turns
    assert len(set(map(tuple, plain.response_ids.tolist()))) > 2  # the group's episodes differ
    torch.testing.assert_close(shared.logp, plain.logp, atol=1e-5, rtol=0)


def test_budgets_end_episodes_as_truncations(lm):
    from ppoforge.lm.envs.episodes import Budgets

    rows = [{"n": i} for i in range(2)]
    # the episode budget: at most 7 tokens after the prompt, whatever the turns
    _, _, ep, _ = _play(lm, [Scripted(), Scripted()], rows, Budgets(4, 7, 32))
    assert ep.end == ["budget", "budget"] and all(int(m.sum()) <= 7 for m in ep.token_mask)
    # a reply longer than max_env_tokens: drop ends the episode, truncate keeps both ends of the reply
    long = "word " * 40
    _, _, ep, _ = _play(lm, [Scripted(reply=long), Scripted(reply=long)], rows, Budgets(2, 500, 8, "drop"))
    assert ep.end == ["budget", "budget"] and ep.turns == [1, 1] and ep.env_tokens == [0, 0]
    _, _, ep, _ = _play(lm, [Scripted(reply=long), Scripted(reply=long)], rows, Budgets(2, 500, 8, "truncate"))
    assert ep.end == ["max_turns", "max_turns"] and ep.env_tokens == [8, 8]


def test_groups_share_the_environment_seed_and_draws_replay(lm):
    """Same uniforms and seeds: the same episodes, token for token (what held-out evaluation relies on)."""
    from ppoforge.lm.envs.episodes import Budgets
    from ppoforge.lm.envs.loading import load_env

    factory = load_env("guess_number?hi=4")
    rows = [{"prompt": "x"}] * 3
    a = _play(lm, [factory() for _ in rows], rows, Budgets(3, 100, 32))[2]
    b = _play(lm, [factory() for _ in rows], rows, Budgets(3, 100, 32))[2]
    assert torch.equal(a.response_ids, b.response_ids) and a.transcripts == b.transcripts
    assert set(a.end) <= {"done", "max_turns"}
    for i, end in enumerate(a.end):  # a solved episode's return is its last guess's reward, 1
        assert a.returns()[i] == (1.0 if end == "done" else 0.0)


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_trainer_plays_episodes_and_logs_their_ends(tiny_lm_dir, tmp_path, advantage):
    """`env` through the RLHF trainer: GRPO and PPO (its critic) train on guess_number episodes, held-out
    episodes are scored before and after, and env/ metrics are logged."""
    import json

    from ppoforge.config import build_config
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import train
    from ppoforge.runtime.metrics import read_metrics

    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "guess", "secret": s}) + "\n" for s in (1, 2, 3, 4)))
    cfg = build_config(RLHFConfig, dict(
        model=str(tiny_lm_dir), prompts=str(prompts), heldout_prompts=str(prompts), heldout_samples=2,
        env="guess_number?hi=4", reward="env", max_turns=3, max_new_tokens=4, max_env_tokens=24,
        batch_size=2, num_generations=2, mini_batch_size=4, micro_batch_size=2, ppo_epochs=1, total_updates=2,
        advantage=advantage, kl_coef=0.05 if advantage == "gae" else 0.0, learning_rate=1e-3, device="cpu",
        seed=0, torch_threads=1, progress=False, tensorboard=False, precision="fp32"))
    result = train(cfg, tmp_path / "run")
    assert result.updates == 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    trained = [r for r in rows if "env/turns" in r]
    assert len(trained) == 2
    for r in trained:
        ends = [r[f"env/episode_end/{k}"] for k in ("done", "max_turns", "budget")]
        assert abs(sum(ends) - 1) < 1e-9 and 1 <= r["env/turns"] <= 3
        # a GRPO rollout whose every group scored alike trains nothing and makes no step (skip_flat_rollouts)
        flat = advantage == "grpo" and r["frac_reward_zero_std"] == 1
        loss = r["loss/policy_avg"]  # NaN, written as null, where the update did not train
        assert r["guard/flat_rollout_skipped"] == flat and (loss is not None and math.isfinite(loss)) != flat
        assert math.isfinite(r["objective/scores"])
    assert len([r for r in rows if "eval/scores" in r]) == 2
    table = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert any("I am thinking of a whole number" in r["prompt"] for r in table)


@pytest.mark.parametrize(("values", "message"), [
    (dict(env="guess_number"), "reward: 'vader' with env 'guess_number', which scores its own episodes; allowed: env"),
    (dict(reward="env"), "reward: applies to multi-turn episodes"),
    (dict(max_turns=3), "max_turns: applies to multi-turn episodes"),
])
def test_env_settings_without_their_partner_are_one_line_errors(values, message):
    from ppoforge.config import build_config
    from ppoforge.errors import UserError
    from ppoforge.lm.rl.config import RLHFConfig

    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        build_config(RLHFConfig, values)
