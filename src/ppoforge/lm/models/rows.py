"""The token rows a forward over a rollout runs: padded rectangles, or shared-prefix units.

A rollout is B sequences `[prompt, response]` (left-padded prompts, right-padded responses). Every forward
over it — old log-probs, values, the reference, the training forward and backward — needs, for each
response token, the last hidden state of the position that predicts it. `TokenRows` says what to run
and where those positions are:

- `padded`: the rollout as it is, one row per sequence (TRL's layout): every copy of a prompt and every
  padding slot is computed.
- `shared_prefix`: k completions of one prompt become ONE row `[prompt, c1, ..., ck]` with their real
  tokens only. Each c_i's positions continue from the prompt's last one and its mask is tree-shaped (the
  prompt causal; c_i sees the prompt and its own earlier tokens, never c_j), so every token's hidden
  state is what it is in the sequence alone (fp32: to rounding). The prompt is computed once per unit
  instead of k times, no padding is computed but the rows' tails, and in backward the prompt's
  gradients are the sum over its k completions — autograd's own sum over the shared positions, exactly
  the gradient of the k sequences computed apart. The position that predicts c_i's first token is the
  prompt's last, which the k completions share.

The price of one row per unit is attention over (prompt + k completions)^2 pairs, of which the tree
mask uses fewer; `unit_size` picks the k that minimises linear work + attention work, among the sizes
the caller allows (see `lm/rl/update.py`: a unit must never straddle a micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppoforge.lm.models.attention import as_attention_bias, causal_mask, position_ids


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


def shared_prefix(ids: torch.Tensor, mask: torch.Tensor, n_resp: int, k: int) -> TokenRows:
    """Runs of up to k consecutive rows with the same prompt, each run one row `[prompt, c1, ..., ck]`
    of real tokens (module docstring), every row as long as the longest (its tail padding attends to
    itself alone). A row's real response tokens must come first (right padding), as rollouts have them.
    Built with a fixed number of tensor ops, whatever the batch size (no loop over rows)."""
    device, (batch, width_in) = ids.device, ids.shape
    n_prompt = width_in - n_resp
    real = mask.bool()
    row = torch.arange(batch, device=device)
    # units: a new one where the prompt changes or a run reaches k rows
    prompt = torch.where(real[:, :n_prompt], ids[:, :n_prompt], -1)
    new_run = torch.ones(batch, dtype=torch.bool, device=device)
    new_run[1:] = (prompt[1:] != prompt[:-1]).any(1)
    run_start = torch.where(new_run, row, 0).cummax(0).values
    starts = new_run | ((row - run_start) % k == 0)
    unit = starts.long().cumsum(0) - 1  # (B,) each row's unit
    first = torch.where(starts, row, 0).cummax(0).values  # (B,) the unit's first row
    member = row - first  # (B,) j: the row is c_{j+1} of its unit
    p = real[:, :n_prompt].sum(1)  # (B,) real prompt tokens
    n = real[:, n_prompt:].sum(1)  # (B,) real response tokens, first in the response
    before = n.cumsum(0) - n  # exclusive cumsum of the lengths ...
    start = p + before - before[first]  # ... within the unit: where each completion begins in its row
    length = start + n  # (B,) the unit's row up to this completion's end
    width = int(length.max())
    n_units = int(unit[-1]) + 1
    flat_ids = torch.zeros(n_units * width, dtype=torch.long, device=device)
    branch = torch.full((n_units * width,), -1, dtype=torch.long, device=device)  # -1 pad, 0 prompt, j+1: c_j
    positions = torch.zeros(n_units * width, dtype=torch.long, device=device)
    # the prompt's real tokens (left-padded: the last p of the P columns), from each unit's first row
    col = torch.arange(n_prompt, device=device)
    slot = col - (n_prompt - p)[:, None]  # (B, P) its slot in the row (< 0 for padding)
    take = real[:, :n_prompt] & starts[:, None]
    dest = (unit[:, None] * width + slot)[take]
    flat_ids[dest], branch[dest], positions[dest] = ids[:, :n_prompt][take], 0, slot[take]
    # each completion's real tokens after the ones before it in its unit, positions continuing the prompt's
    t = torch.arange(n_resp, device=device)
    take = t < n[:, None]  # (B, T)
    dest = (unit[:, None] * width + start[:, None] + t)[take]
    flat_ids[dest] = ids[:, n_prompt:][take]
    branch[dest] = (member[:, None] + 1).expand(-1, n_resp)[take]
    positions[dest] = (p[:, None] + t).expand(batch, -1)[take]
    # token t is predicted by the position before it: the prompt's last for t = 0; padding picks the
    # last real one (any finite state: it is masked out)
    before_t = torch.where(t == 0, p[:, None] - 1, start[:, None] + torch.minimum(t, n[:, None]) - 1)
    picks = unit[:, None] * width + before_t
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


def unit_size(mask: torch.Tensor, n_resp: int, allowed: list[int], attention_cost: float) -> int:
    """The k of `allowed` (sizes that tile the rollout's groups) that minimises the forward's estimated
    work, per sequence: (prompt + k * completion) tokens of linear work plus `attention_cost` per query-key
    pair of one (prompt + k * completion)^2 row, from the rollout's mean real prompt and completion lengths;
    1 (no sharing) when nothing is allowed."""
    if not allowed:
        return 1
    n_prompt = mask.shape[1] - n_resp
    p, t = float(mask[:, :n_prompt].sum(1).float().mean()), float(mask[:, n_prompt:].sum(1).float().mean())

    def work(k: int) -> float:
        length = p + k * t
        return (length + attention_cost * length * length) / k

    return min([1, *allowed], key=work)


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
    """How a run lays out its rollouts: `shared_prefix` units of a size in `sizes` (sizes that tile the
    micro-batches: see RLHFConfig.prefix_units), the one `unit_size` picks for each rollout, or `padded`
    when no size is allowed or none pays."""

    def __init__(self, sizes: tuple[int, ...] = (), attention_cost: float = 0.0):
        self.sizes, self.attention_cost = list(sizes), attention_cost

    def unit(self, mask: torch.Tensor, n_resp: int) -> int:
        """The unit size for a rollout with this (B, P + T) mask: 1 is the padded layout."""
        return unit_size(mask, n_resp, self.sizes, self.attention_cost)

    def rows(self, ids: torch.Tensor, mask: torch.Tensor, n_resp: int, k: int | None = None) -> TokenRows:
        """The rows of a rollout (k None: its own unit size) or of rows taken from one (that rollout's k)."""
        k = self.unit(mask, n_resp) if k is None else k
        return padded(ids, mask, n_resp) if k == 1 else shared_prefix(ids, mask, n_resp, k)


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
