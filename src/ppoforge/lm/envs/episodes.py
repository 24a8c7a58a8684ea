"""Multi-turn episodes, token in / token out: the policy talks with an environment (`lm/envs/protocol.py`).

An episode is ONE token sequence after the prompt: the policy's sampled tokens (with their log-probs,
action mask 1) and the environment's tokens (action mask 0). The policy's tokens are never decoded and
re-encoded (BPE is not a bijection: "a" + "b" can come back as "ab"); its reply is decoded only to
hand the environment a string. The environment's tokens come from the chat template, rendering only
the new messages (`ChatRenderer.env_ids`, a template diff), and at the episode's end the whole
sequence is compared with the template's rendering of the conversation (`end_check`).

The batch decodes turn-synchronously on one KV cache: every live row samples its turn; a row that
stopped (or whose episode ended) stops appending — its decode-step slots become holes no query attends
to (`Decoder.extend`); once no row is still generating, each environment answers and the rows' replies
go into the cache in one chunked prefill, right-aligned so each row's last slot is its own last token.
No row waits on another's environment call beyond the turn boundary, and no step needs a collective.

Budgets: `max_turns` policy turns, `max_new_tokens` per turn, `max_episode_tokens` (policy +
environment tokens after the prompt) and `max_env_tokens` per reply (longer ones are cut in the middle
or end the episode: `env_overflow`). An episode ends `done` (the environment terminated it: the return
has no bootstrap), `max_turns` or `budget` (both truncations); the trainer logs the shares.
Turn rewards sit on each turn's last policy token; the final `score()` (if the environment has one) on
the episode's last policy token, like a reward function's score in single-turn rollouts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ppoforge.lm.envs.protocol import EnvStep, as_messages
from ppoforge.lm.models.attention import left_pad
from ppoforge.lm.models.decoders import Decoder
from ppoforge.lm.models.sampler import Samples, SamplingParams, draw_tokens, prefill

END_REASONS = ("done", "max_turns", "budget")


@dataclass(frozen=True)
class Budgets:
    max_turns: int
    max_episode_tokens: int      # policy + environment tokens after the prompt
    max_env_tokens: int          # per environment reply
    env_overflow: str = "truncate"  # truncate (keep both ends) | drop (end the episode: a budget truncation)

    def capacity(self, max_new_tokens: int) -> int:
        """Cache slots an episode batch can take (holes included): every turn's decode steps and every
        reply but the last turn's."""
        return self.max_turns * max_new_tokens + (self.max_turns - 1) * (self.max_env_tokens + 1)


@dataclass
class Episodes(Samples):
    """`Samples` of whole episodes: response_* cover every token after the prompt, `response_mask` is the
    action mask (policy tokens), `token_mask` marks all real tokens (policy and environment)."""
    turn_rewards: torch.Tensor | None = None  # (B, T) each turn's reward on its last policy token
    scores: torch.Tensor | None = None        # (B,) the environments' final score() (0 without one)
    end: list[str] = field(default_factory=list)       # per row: one of END_REASONS
    turns: list[int] = field(default_factory=list)     # policy turns taken
    env_tokens: list[int] = field(default_factory=list)  # environment tokens in the sequence
    transcripts: list[str] = field(default_factory=list)  # the conversation after the first message(s)
    first_messages: list[str] = field(default_factory=list)
    mismatches: int = 0                       # episodes whose tokens differ from the template's rendering

    def returns(self) -> torch.Tensor:
        """(B,) each episode's reward: its turn rewards plus its final score."""
        return self.turn_rewards.sum(1) + self.scores


def _middle_cut(ids: list[int], keep: int) -> list[int]:
    """The first and last tokens of `ids`, `keep` in all."""
    head = (keep + 1) // 2
    return ids[:head] + (ids[len(ids) - (keep - head):] if keep > head else [])


class _Row:
    """One episode's bookkeeping: its environment, conversation and token sequence after the prompt."""

    def __init__(self, env, messages: list[dict]):
        self.env, self.messages = env, messages
        self.n_first = len(messages)
        self.tokens: list[int] = []
        self.policy: list[bool] = []
        self.logp: list[float] = []
        self.rewards: dict[int, float] = {}  # token index -> turn reward
        self.turn: list[int] = []            # this turn's sampled tokens
        self.turns, self.env_count, self.end = 0, 0, None

    def add_policy(self, tok: int, lp: float) -> None:
        self.tokens.append(tok)
        self.policy.append(True)
        self.logp.append(lp)
        self.turn.append(tok)

    def add_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.policy += [False] * len(ids)
        self.logp += [0.0] * len(ids)
        self.env_count += len(ids)


@torch.inference_mode()
def run_episodes(decoder: Decoder, renderer, envs: list, rows: list[dict], seeds: list[int],
                 params: SamplingParams, budgets: Budgets, uniforms: torch.Tensor, max_prompt_tokens: int,
                 device, share_prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor, Episodes]:
    """Play one episode per row: `envs[i]` (fresh, its replies checked: `lm/envs/protocol.py`) reset with rows[i]
    and random.Random(seeds[i]).

    `uniforms` (max_turns * max_new_tokens, B) are the pre-drawn sampling uniforms (turn k's step t uses
    row k * max_new_tokens + t), so a batch played in parts makes the same draws. `share_prefill`: rows
    whose first prompts come in runs of equal ones (a GRPO group's G episodes of one game) prefill it once.
    Returns the left-padded prompts (B, P), their mask, and the episodes.
    """
    states, prompts = [], []
    for env, row, seed in zip(envs, rows, seeds, strict=True):
        messages = as_messages(env.reset(row, random.Random(seed)))
        states.append(_Row(env, messages))
        prompts.append(renderer.prompt_ids(messages)[-max_prompt_tokens:])
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_id, device)
    logits, _ = prefill(decoder, prompt_ids, prompt_mask, budgets.capacity(params.max_new_tokens), share_prefill)
    live = list(range(len(rows)))
    for turn in range(budgets.max_turns):
        fed = _policy_turn(decoder, logits, states, live, params, budgets, uniforms[turn * params.max_new_tokens:])
        chunks = {i: _env_turn(states[i], renderer, params, budgets, turn + 1 == budgets.max_turns, fed[i])
                  for i in live}
        live = [i for i in live if states[i].end is None]
        if not live:
            break
        logits = _append(decoder, {i: chunks[i] for i in live}, len(rows), params.pad_id, device)
    return prompt_ids, prompt_mask, _assemble(states, renderer, prompt_ids, prompt_mask, params, device)


@torch.inference_mode()
def run_episodes_by_turns(engine, renderer, envs: list, rows: list[dict], seeds: list[int], params: SamplingParams,
                          budgets: Budgets, uniforms: torch.Tensor, max_prompt_tokens: int, device
                          ) -> tuple[torch.Tensor, torch.Tensor, Episodes]:
    """`run_episodes` through a `RolloutEngine` that takes whole sequences (vLLM, `lm/models/engines.py`): each
    turn, every live row's sequence so far — its prompt, the policy's own sampled tokens and the
    environment's rendered tokens, never re-encoded — goes to the engine, which continues it once (its prefix
    cache keeps the earlier turns' KV). A turn that runs past `max_episode_tokens` is cut there (`budget`), as
    the decode loop stops there. Turn k's draws come from uniforms row k * max_new_tokens (the engine derives
    each row's seed from it)."""
    states, prompts = [], []
    for env, row, seed in zip(envs, rows, seeds, strict=True):
        messages = as_messages(env.reset(row, random.Random(seed)))
        states.append(_Row(env, messages))
        prompts.append(renderer.prompt_ids(messages)[-max_prompt_tokens:])
    live = list(range(len(rows)))
    for turn in range(budgets.max_turns):
        ids, mask = left_pad([prompts[i] + states[i].tokens for i in live], params.pad_id, device)
        u = uniforms[turn * params.max_new_tokens:][:, live]
        out = engine.generate(ids, mask, params, u)
        for j, i in enumerate(live):
            n = int(out.response_mask[j].sum())
            for tok, lp in zip(out.response_ids[j, :n].tolist(), out.logp[j, :n].tolist(), strict=True):
                states[i].add_policy(tok, lp)
                if len(states[i].tokens) >= budgets.max_episode_tokens:
                    states[i].end = "budget"
                    break
        for i in live:
            _env_turn(states[i], renderer, params, budgets, turn + 1 == budgets.max_turns, True)
        live = [i for i in live if states[i].end is None]
        if not live:
            break
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_id, device)
    return prompt_ids, prompt_mask, _assemble(states, renderer, prompt_ids, prompt_mask, params, device)


def _policy_turn(decoder: Decoder, logits: torch.Tensor, states: list[_Row], live: list[int],
                 params: SamplingParams, budgets: Budgets, uniforms: torch.Tensor) -> list[bool]:
    """Every live row samples its turn (until a stop token, max_new_tokens or the episode budget); rows
    that stopped append holes while the others go on. Returns, per row, whether its last sampled token is
    already in the cache (else it leads the row's next chunk)."""
    batch, device = len(states), logits.device
    stop = torch.tensor(params.stop_ids, dtype=torch.long, device=device)
    generating = torch.zeros(batch, dtype=torch.bool, device=device)
    generating[live] = True
    for t in range(params.max_new_tokens):
        tok, logp = draw_tokens(logits, params, uniforms[t].to(device))
        recorded = generating.clone()
        for i in recorded.nonzero()[:, 0].tolist():
            states[i].add_policy(int(tok[i]), float(logp[i]))
            if len(states[i].tokens) >= budgets.max_episode_tokens:
                states[i].end = "budget"
        ended = torch.tensor([s.end is not None for s in states], device=device)
        generating &= ~torch.isin(tok, stop) & ~ended
        if not generating.any() or t + 1 == params.max_new_tokens:
            return (~recorded).tolist()  # this step's tokens wait for the replies' chunk
        logits, _ = decoder.extend(tok[:, None], recorded[:, None])
    return [True] * batch


def _env_turn(s: _Row, renderer, params: SamplingParams, budgets: Budgets, last_turn: bool, fed: bool) -> list[int]:
    """The environment answers row `s`'s turn: the turn reward on its last policy token, the episode's end
    if any, else the tokens the row appends next (its unfed last token, then the reply's tokens)."""
    finished = bool(s.turn) and s.turn[-1] in params.stop_ids
    reply = renderer.tokenizer.decode(s.turn, skip_special_tokens=True)
    s.messages.append({"role": "assistant", "content": reply})
    s.turns += 1
    turn, s.turn = s.turn, []
    out: EnvStep = s.env.step(reply)
    if out.reward is not None:
        s.rewards[len(s.tokens) - 1] = s.rewards.get(len(s.tokens) - 1, 0.0) + float(out.reward)
    if out.done:
        s.end = "done"
    elif s.end is None and last_turn:
        s.end = "max_turns"
    if s.end is not None:
        return []
    new = as_messages(out.messages)
    ids = renderer.env_ids(s.messages, turn, finished, new)
    if len(ids) > budgets.max_env_tokens:
        if budgets.env_overflow == "drop":
            s.end = "budget"
            return []
        ids = _middle_cut(ids, budgets.max_env_tokens)
    if len(s.tokens) + len(ids) >= budgets.max_episode_tokens:
        s.end = "budget"  # no room left for a reply
        return []
    s.messages.extend(new)
    s.add_env(ids)
    return ([] if fed else [turn[-1]]) + ids


def _append(decoder: Decoder, chunks: dict[int, list[int]], batch: int, pad_id: int, device) -> torch.Tensor:
    """One chunked prefill of every live row's tokens, right-aligned (the chunk's last slot is each row's
    last token); the other rows' slots are holes. Returns the next-token logits."""
    width = max(len(c) for c in chunks.values())
    ids = torch.full((batch, width), pad_id, dtype=torch.long)  # cpu: filled on the host, one copy to device
    valid = torch.zeros(batch, width, dtype=torch.bool)  # cpu: filled on the host, moved below
    for i, c in chunks.items():
        ids[i, width - len(c):] = torch.tensor(c)  # cpu: into a host tensor
        valid[i, width - len(c):] = True
    return decoder.extend(ids.to(device), valid.to(device))[0]


def _assemble(states: list[_Row], renderer, prompt_ids, prompt_mask, params: SamplingParams, device) -> Episodes:
    width = max(len(s.tokens) for s in states)
    batch = len(states)
    ids = torch.full((batch, width), params.pad_id, dtype=torch.long)  # cpu: host-built, moved in Episodes()
    tokens, action = torch.zeros(batch, width), torch.zeros(batch, width)  # cpu: moved below
    logp, rewards = torch.zeros(batch, width), torch.zeros(batch, width)  # cpu: moved below
    scores, mismatches = torch.zeros(batch), 0  # cpu: moved below
    for i, s in enumerate(states):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)  # cpu: into a host tensor
        tokens[i, :n] = 1.0
        action[i, :n] = torch.tensor(s.policy, dtype=torch.float32)  # cpu: into a host tensor
        logp[i, :n] = torch.tensor(s.logp)  # cpu: into a host tensor
        for j, r in s.rewards.items():
            rewards[i, j] = r
        score = getattr(s.env, "score", None)
        value = score() if callable(score) else None
        scores[i] = 0.0 if value is None else float(value)
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        if renderer.check_episode(s.messages, prompt + s.tokens) is not None:
            mismatches += 1
    out = Episodes(ids.to(device), action.to(device), logp.to(device),
                   torch.tensor([s.end == "done" for s in states], device=device), None,
                   token_mask=tokens.to(device), turn_rewards=rewards.to(device), scores=scores.to(device),
                   end=[s.end for s in states], turns=[s.turns for s in states],
                   env_tokens=[s.env_count for s in states],
                   transcripts=[_transcript(s.messages[s.n_first:]) for s in states],
                   first_messages=[_transcript(s.messages[:s.n_first]) for s in states], mismatches=mismatches)
    return out


def _transcript(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def episode_metrics(ep: Episodes) -> dict[str, float]:
    """env/episode_end/{done,max_turns,budget}: shares of the episodes' ends; turns and reply tokens."""
    n = len(ep.end)
    out = {f"env/episode_end/{reason}": sum(e == reason for e in ep.end) / n for reason in END_REASONS}
    out |= {"env/turns": sum(ep.turns) / n, "env/env_tokens": sum(ep.env_tokens) / n,
            "env/template_mismatch": ep.mismatches / n}
    return out
