"""The token rows a forward over a rollout runs: padded rectangles, or shared-prefix units.

A rollout is B sequences `[prompt, response]` (left-padded prompts, right-padded responses). Every forward
over it — old log-probs, values, the reference, the training forward and backward — needs, for each
response token, the last hidden state of the position that predicts it. `TokenRows` says what to run
and where those positions are:

- `padded`: the rollout as it is, one row per sequence (TRL's layout): every copy of a prompt and every
  padding slot is computed.
- `shared_prefix`: k consecutive sequences become ONE row `[prefix, rest_1, c_1, ..., rest_k, c_k]` of
  real tokens. The prefix is the prompt tokens all k share: a GRPO group's whole prompt (rest_i empty),
  the system header a chat template puts before every prompt of a PPO batch, or nothing (the unit is
  then k sequences packed without padding). Every token keeps its position in its own sequence and the
  mask is tree-shaped (the prefix causal; a branch rest_i + c_i sees the prefix and its own earlier
  tokens, never another branch), so every token's hidden state is what it is in the sequence alone
  (fp32: to rounding). The prefix is computed once per unit instead of k times, no padding is computed
  but the rows' tails, and in backward the prefix's gradients are the sum over the k branches —
  autograd's own sum over the shared positions, exactly the gradient of the k sequences computed apart.

The price of one row per unit is attention over (prefix + k branches)^2 pairs, of which the tree mask
uses fewer; `RowPlan.choose` picks, per rollout, the k that minimises linear work + attention work
(`rows_work`, padding counted) among the sizes the caller allows (see `lm/rl/update.py`: a unit must never
straddle a micro-batch or a rank's rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppoforge.lm.models.attention import as_attention_bias, causal_mask, position_ids
from ppoforge.runtime import distributed


@dataclass(frozen=True)
class TokenRows:
    """ids (R, L), allowed (R, 1, L, L) bool, positions (R, L); `picks` (B, T): for each sequence's T
    response tokens, the flat index into (R * L) of the position predicting it — None: the padded layout,
    where that is position P + t - 1 of row b."""

    ids: torch.Tensor
    allowed: torch.Tensor
    positions: torch.Tensor
    n_resp: int
    picks: torch.Tensor | None = None

    def inputs(self, model) -> dict:
        """A Hugging Face forward's keyword arguments: the 4D mask (`model`'s attention decides its
        form), positions, no KV cache."""
        return {"input_ids": self.ids, "attention_mask": as_attention_bias(self.allowed, model),
                "position_ids": self.positions, "use_cache": False}

    def response(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, L, H) -> (B, T, H): the hidden states that predict the response tokens."""
        if self.picks is None:
            # contiguous: a strided 3D input makes matmul fall back to bmm over a (B, H, V) copy of the LM head
            return hidden[:, -self.n_resp - 1:-1].contiguous()
        return hidden.flatten(0, 1)[self.picks]


def padded(ids: torch.Tensor, mask: torch.Tensor, n_resp: int) -> TokenRows:
    """The rollout's rows as they are: (B, P + T) ids and their 0/1 mask, causal over real keys."""
    return TokenRows(ids, causal_mask(mask), position_ids(mask), n_resp)


def _sequences(ids: torch.Tensor, mask: torch.Tensor, n_resp: int):
    """Each row's real tokens left-aligned, prompt then response: (B, W) ids (-1 after them), and (B,) the
    real prompt and response lengths p and n. They are contiguous in the row (left-padded prompt, response
    padded on the right), from column P - p to P + n."""
    width = ids.shape[1]
    real = mask.bool()
    p, n = real[:, :width - n_resp].sum(1), real[:, width - n_resp:].sum(1)
    j = torch.arange(width, device=ids.device)
    col = (width - n_resp - p)[:, None] + j
    return torch.where(j < (p + n)[:, None], ids.gather(1, col.clamp(max=width - 1)), -1), p, n


def _prefixes(seq: torch.Tensor, p: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) the prompt tokens each row shares with every row of its unit (aligned blocks of k rows): the
    longest prefix of prompt tokens the unit's rows have in common."""
    row = torch.arange(seq.shape[0], device=seq.device)
    unit, first = row // k, row // k * k
    j = torch.arange(seq.shape[1], device=seq.device)
    same = (seq == seq[first]) & (j < torch.minimum(p, p[first])[:, None])
    common = same.long().cumprod(1).sum(1)  # (B,) with the unit's first row
    shared = torch.full((int(unit[-1]) + 1,), seq.shape[1], dtype=torch.long, device=seq.device)
    return shared.scatter_reduce(0, unit, common, "amin")[unit]


def shared_prefix(ids: torch.Tensor, mask: torch.Tensor, n_resp: int, k: int) -> TokenRows:
    """Each unit of k consecutive rows as one row `[prefix, rest_1, c1, ..., rest_k, ck]` of real tokens
    (module docstring): the prefix is the prompt tokens all k share (a GRPO group's whole prompt, a chat
    template's system header, or nothing: then the unit is k sequences packed without padding), rest_i the
    rest of row i's prompt. Every row as long as the longest (its tail padding attends to itself alone). A
    row's real response tokens must come first (right padding), as rollouts have them. Built with a fixed
    number of tensor ops, whatever the batch size (no loop over rows)."""
    device, batch = ids.device, ids.shape[0]
    seq, p, n = _sequences(ids, mask, n_resp)
    s = _prefixes(seq, p, k)  # (B,) the unit's shared prefix, per row
    row = torch.arange(batch, device=device)
    unit, first = row // k, row // k * k
    member = row - first  # (B,) j: the row's branch is the (j + 1)-th of its unit
    rest = p + n - s  # (B,) the branch: the prompt's rest, then the response
    before = rest.cumsum(0) - rest  # exclusive cumsum of the branches ...
    start = s + before - before[first]  # ... within the unit: where each branch begins in its row
    width = int((start + rest).max())
    n_units = int(unit[-1]) + 1
    flat_ids = torch.zeros(n_units * width, dtype=torch.long, device=device)
    branch = torch.full((n_units * width,), -1, dtype=torch.long, device=device)  # -1 pad, 0 prefix, j+1: branch j
    positions = torch.zeros(n_units * width, dtype=torch.long, device=device)
    # a token's position is its place in its own sequence: the prefix's from the unit's first row, every
    # row's later tokens in its branch
    j = torch.arange(seq.shape[1], device=device).expand(batch, -1)
    slot = torch.where(j < s[:, None], j, start[:, None] + j - s[:, None])  # (B, W) in the unit's row
    take = (j < (p + n)[:, None]) & ((j >= s[:, None]) | (member == 0)[:, None])
    dest = (unit[:, None] * width + slot)[take]
    flat_ids[dest], positions[dest] = seq[take], j[take]
    branch[dest] = torch.where(j < s[:, None], 0, member[:, None] + 1)[take]
    # response token t is predicted by the token before it in the sequence (the prompt's last for t = 0);
    # padding picks the last real one (any finite state: it is masked out)
    t = torch.arange(n_resp, device=device)
    before_t = p[:, None] + torch.minimum(t, n[:, None]) - 1
    picks = unit[:, None] * width + torch.where(before_t < s[:, None], before_t,
                                                start[:, None] + before_t - s[:, None])
    return TokenRows(flat_ids.view(n_units, width), tree_mask(branch.view(n_units, width)),
                     positions.view(n_units, width), n_resp, picks)


def tree_mask(branch: torch.Tensor) -> torch.Tensor:
    """(R, L) branch ids (-1 padding, 0 the prompt, j: completion j) -> (R, 1, L, L) bool: causal; the
    prompt sees itself, a completion the prompt and its own tokens; padding its own slot alone."""
    width = branch.shape[1]
    q, key = branch[:, :, None], branch[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=branch.device).tril()
    allowed = causal & (key >= 0) & (q >= 0) & ((key == 0) | (key == q))
    allowed |= torch.eye(width, dtype=torch.bool, device=branch.device)
    return allowed[:, None]


def rows_work(ids: torch.Tensor, mask: torch.Tensor, n_resp: int, k: int, attention_cost: float) -> float:
    """The estimated work of a forward over a rollout laid out in units of k (1: padded rows), in linear
    work per token: rows x (width + `attention_cost` x width^2), every row as wide as the longest — the
    padding is computed too."""
    if k == 1:
        rows, width = ids.shape
    else:
        seq, p, n = _sequences(ids, mask, n_resp)
        s = _prefixes(seq, p, k)
        lengths = torch.zeros((ids.shape[0] + k - 1) // k, dtype=torch.long, device=ids.device)
        lengths.index_add_(0, torch.arange(ids.shape[0], device=ids.device) // k, p + n - s)
        lengths += s[::k]  # each unit: its prefix once, then every branch
        rows, width = lengths.numel(), int(lengths.max())
    return rows * (width + attention_cost * width * width)


SOFTMAX_COST = 150  # matmul FLOPs one score element's scale + mask + softmax costs (memory-bound; 90-180 measured)


def attention_cost(config) -> float:
    """A query-key pair's attention work over a token's linear-layer work, from a model config, in matmul
    FLOPs: per head 4 x head dim (q.k and the weighted sum of v) plus the score's elementwise ops
    (SOFTMAX_COST, measured on CPU against a matmul), against 2 x one decoder layer's weights (q, k, v, o
    projections and a gated MLP)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    weights = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inner
    return heads * (4 * head_dim + SOFTMAX_COST) / (2 * weights)


def unit_order(order: torch.Tensor, k: int) -> torch.Tensor:
    """A permutation of rollout rows -> one that keeps every unit (k consecutive rows) together, the
    units in the order their first member appears in `order` and each unit's rows in rollout order: the
    same draw, shuffled by units."""
    if k == 1:
        return order
    units = order // k
    first = torch.full((int(units.max()) + 1,), order.numel(), dtype=torch.long, device=order.device)
    first.scatter_reduce_(0, units, torch.arange(order.numel(), device=order.device), "amin")
    ranked = first.argsort()
    return (ranked[:, None] * k + torch.arange(k, device=order.device)).flatten()


class RowPlan:
    """How a run lays out its rollouts: in `shared_prefix` units of a size in `sizes` (sizes that tile the
    micro-batches and the ranks' rows: see RLHFConfig.prefix_sizes), or `padded` (k = 1) when no size is
    allowed or none pays. `choose` picks k once per rollout; every forward over it then runs `rows`."""

    def __init__(self, sizes: tuple[int, ...] = (), attention_cost: float = 0.0):
        self.sizes, self.attention_cost = list(sizes), attention_cost
        self.k = 1  # the current rollout's unit size

    def choose(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int) -> int:
        """The unit size of the rollout (B, P + T) whose rows cost least (`rows_work`), summed over every
        rank's rows under torchrun (a collective): every rank and every forward lays the rollout out alike."""
        if not self.sizes:
            return self.k
        sizes = [1, *self.sizes]
        work = torch.tensor([rows_work(ids, mask, n_resp, k, self.attention_cost) for k in sizes],
                            dtype=torch.float64, device=ids.device)
        if distributed.collectives():
            work = distributed.all_sum(work)
        self.k = sizes[int(work.argmin())]
        return self.k

    def rows(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int) -> TokenRows:
        """The rows of the rollout, or of rows taken from it in whole units, in its unit size."""
        return padded(ids, mask, n_resp) if self.k == 1 else shared_prefix(ids, mask, n_resp, self.k)


@dataclass(frozen=True)
class BranchRows:
    """Groups of token sequences that share a prefix, one row per group `[prefix, rest_1, ..., rest_k]`
    (ids, allowed, positions as in `TokenRows`); `last` (N,) the flat index into (R * L) of every
    sequence's last token, group by group."""

    ids: torch.Tensor
    allowed: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor

    def inputs(self, model) -> dict:
        return {"input_ids": self.ids, "attention_mask": as_attention_bias(self.allowed, model),
                "position_ids": self.positions, "use_cache": False}


def shared_length(seqs: list[list[int]]) -> int:
    """The longest prefix all of `seqs` share, short of each one's last token (every branch keeps one)."""
    limit = min(len(s) for s in seqs) - 1
    n = 0
    while n < limit and all(s[n] == seqs[0][n] for s in seqs[1:]):
        n += 1
    return n


def branch_work(groups: list[list[list[int]]], attention_cost: float) -> float:
    """`rows_work` of `branch_rows(groups)`: rows x (width + attention_cost x width^2), as wide as the longest."""
    width = max(len(seqs[0]) + sum(len(s) - shared_length(seqs) for s in seqs[1:]) for seqs in groups)
    return len(groups) * (width + attention_cost * width * width)


def branch_rows(groups: list[list[list[int]]], pad_id: int, device) -> BranchRows:
    """Each group (sequences with a common prefix, e.g. a preference pair's chosen and rejected) as ONE
    row: the shared prefix once, then each sequence's rest with positions continuing the prefix's and the
    tree mask of `tree_mask` — every token's hidden state is what it is in its sequence alone."""
    rows, branches, positions, last = [], [], [], []
    for g, seqs in enumerate(groups):
        n = shared_length(seqs)
        ids, branch, pos = list(seqs[0][:n]), [0] * n, list(range(n))
        for j, s in enumerate(seqs, 1):
            ids += s[n:]
            branch += [j] * (len(s) - n)
            pos += range(n, len(s))
            last.append((g, len(ids) - 1))
        rows.append(ids), branches.append(branch), positions.append(pos)
    width = max(len(r) for r in rows)

    def fill(lists: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in lists])  # cpu: built on the host, moved below

    branch = fill(branches, -1).to(device)
    flat_last = torch.tensor([g * width + i for g, i in last])  # cpu: host indices, moved below
    return BranchRows(fill(rows, pad_id).to(device), tree_mask(branch), fill(positions, 0).to(device),
                      flat_last.to(device))
