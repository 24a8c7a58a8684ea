"""Shared-prefix rows: the layout itself (positions, the tree mask, the picked positions) for a group's
prompt, a header that different prompts share and no common prefix at all, and parity with the padded
rows — hidden states, log-probs, values, the reference and every gradient — on each layout."""

import pytest
import torch

from ppoforge.lm.models.layouts import build_full, build_lora
from ppoforge.lm.models.loading import load_causal_lm
from ppoforge.lm.models.logprobs import token_logprobs
from ppoforge.lm.models.rows import RowPlan, attention_cost, padded, rows_work, shared_prefix, unit_order

PAD = 0


def _rollout(prompts: list[list[int]], completions: list[list[list[int]]]):
    """(ids, mask, T) of a rollout: each prompt left-padded, its completions right-padded after it."""
    p_width = max(map(len, prompts))
    t_width = max(len(c) for group in completions for c in group)
    ids, mask = [], []
    for prompt, group in zip(prompts, completions, strict=True):
        for c in group:
            pad_p, pad_t = p_width - len(prompt), t_width - len(c)
            ids.append([PAD] * pad_p + prompt + c + [PAD] * pad_t)
            mask.append([0] * pad_p + [1] * (len(prompt) + len(c)) + [0] * pad_t)
    return torch.tensor(ids), torch.tensor(mask).float(), t_width


def test_a_unit_is_one_row_of_real_tokens_with_a_tree_mask():
    ids, mask, t = _rollout([[5, 6, 7], [8, 9]], [[[10, 11], [12]], [[13, 14, 15], [16, 17]]])
    rows = shared_prefix(ids, mask, t, k=2)
    assert rows.ids.tolist() == [[5, 6, 7, 10, 11, 12, 0], [8, 9, 13, 14, 15, 16, 17]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 3, 0], [0, 1, 2, 3, 4, 2, 3]]
    allowed = rows.allowed[:, 0]
    # row 0: 12 (slot 5) sees the prompt and itself, not 10 or 11; 11 sees 10; padding sees itself alone
    assert allowed[0, 5].tolist() == [True, True, True, False, False, True, False]
    assert allowed[0, 4].tolist() == [True, True, True, True, True, False, False]
    assert allowed[0, 2].tolist() == [True, True, True, False, False, False, False]
    assert allowed[0, 6].tolist() == [False] * 6 + [True]
    # each response token is predicted by the position before it: the prompt's last for the first;
    # padding picks the last real one (masked out anyway)
    assert rows.picks.tolist() == [[2, 3, 4], [2, 5, 5], [7 + 1, 7 + 2, 7 + 3], [7 + 1, 7 + 5, 7 + 6]]


def test_runs_of_the_same_prompt_are_cut_into_units_of_at_most_k():
    ids, mask, t = _rollout([[5, 6]], [[[10], [11], [12]]])
    assert shared_prefix(ids, mask, t, k=2).ids.tolist() == [[5, 6, 10, 11], [5, 6, 12, 0]]
    assert shared_prefix(ids, mask, t, k=3).ids.tolist() == [[5, 6, 10, 11, 12]]


def test_different_prompts_share_their_common_header_and_keep_their_own_positions():
    """Prompts [1, 2, 3] and [1, 2, 4, 5] share [1, 2]: one row [1, 2 | 3, 10, 11 | 4, 5, 12]; each token's
    position is its place in its own sequence, each branch sees the header and itself."""
    ids, mask, t = _rollout([[1, 2, 3], [1, 2, 4, 5]], [[[10, 11]], [[12]]])
    rows = shared_prefix(ids, mask, t, k=2)
    assert rows.ids.tolist() == [[1, 2, 3, 10, 11, 4, 5, 12]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4]]
    allowed = rows.allowed[0, 0].int().tolist()
    assert allowed[5] == [1, 1, 0, 0, 0, 1, 0, 0]  # 4: the header and itself, not the other branch
    assert allowed[7] == [1, 1, 0, 0, 0, 1, 1, 1]
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0, 0]
    # 10 is predicted by 3 (slot 2), 11 by 10; 12 by 5 (slot 6); row 1's padding by its last token, 12
    assert rows.picks.tolist() == [[2, 3], [6, 7]]


def test_sequences_with_nothing_in_common_are_packed_without_padding():
    ids, mask, t = _rollout([[7, 8], [9]], [[[10, 11, 12]], [[13]]])
    rows = shared_prefix(ids, mask, t, k=2)
    assert rows.ids.tolist() == [[7, 8, 10, 11, 12, 9, 13]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert rows.allowed[0, 0, 6].int().tolist() == [0, 0, 0, 0, 0, 1, 1]  # a block-diagonal causal mask
    assert rows.picks.tolist() == [[1, 2, 3], [5, 6, 6]]


def test_rows_work_trades_the_shared_prompt_against_attention_and_counts_padding():
    ids, mask, t = _rollout([[1] * 80], [[[2] * 10] * 8])  # a long prompt, short answers: share them all
    assert rows_work(ids, mask, t, 1, 1e-4) == pytest.approx(8 * (90 + 1e-4 * 90 ** 2))
    assert rows_work(ids, mask, t, 8, 1e-4) == pytest.approx(160 + 1e-4 * 160 ** 2)
    plan = RowPlan((2, 4, 8), attention_cost=1e-4)
    assert plan.choose(ids, mask, t) == 8
    assert RowPlan((), attention_cost=1e-4).choose(ids, mask, t) == 1  # nothing allowed: padded
    ids, mask, t = _rollout([[1] * 4], [[[2] * 200] * 8])  # a short prompt, long answers: attention dominates
    assert RowPlan((2, 4, 8), attention_cost=1e-2).choose(ids, mask, t) == 1
    # two prompts of one shared header and one long answer among short ones: padding costs the padded rows
    ids, mask, t = _rollout([[1, 2, 3], [1, 2, 4]], [[[5] * 40], [[6] * 2]])
    assert rows_work(ids, mask, t, 1, 0.0) == 2 * 43 and rows_work(ids, mask, t, 2, 0.0) == 2 + 41 + 3


def test_unit_order_keeps_units_together_in_the_order_the_draw_gives():
    order = torch.tensor([5, 0, 3, 7, 1, 2, 6, 4])
    assert unit_order(order, 2).tolist() == [4, 5, 0, 1, 2, 3, 6, 7]
    assert unit_order(order, 1).tolist() == order.tolist()


def test_attention_cost_of_smollm2_135m():
    """SmolLM2-135M: 9 heads x 64, 3 kv heads, 576 hidden, 1536 MLP: 9 x (256 + 150) / 2 * 3.54M FLOPs."""
    cfg = type("Config", (), {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                              "head_dim": 64, "intermediate_size": 1536})
    weights = 576 * 64 * (18 + 6) + 3 * 576 * 1536
    assert attention_cost(cfg) == pytest.approx(9 * (4 * 64 + 150) / (2 * weights))


def _layout(tiny_lm_dir, kind: str, attn: str):
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_lm_dir), attn_implementation=attn)
    if kind == "full":
        layout = build_full(model, load_causal_lm(str(tiny_lm_dir), attn_implementation=attn))
    else:
        layout = build_lora(model, 4, 8.0, "all-linear", critic_adapter=kind == "lora-critic")
    with torch.no_grad():  # real adapters, a real value head, a policy that left the reference
        for name, p in layout.named_trainable():
            if "lora_B" in name or "value_head" in name or kind == "full":
                p.add_(torch.randn_like(p) * (0.02 if kind == "full" else 0.2))
    return layout


def _pass(layout, rows, resp, m, weights):
    """Log-probs, values, reference hidden states, a loss over all three, and every trained gradient."""
    for _, p in layout.named_trainable():
        p.grad = None
    hidden, values = layout.forward(rows)
    logp, _ = token_logprobs(layout.logits(hidden), resp)
    loss = ((logp * weights[0]).sum() + (values * weights[1]).sum()) / m.sum()
    loss.backward()
    with torch.no_grad():
        ref = layout.ref_forward(rows)
        fast_ref = layout.fast_ref_forward(rows) if layout.fast_ref_forward is not None else ref
    grads = {n: p.grad.clone() for n, p in layout.named_trainable() if p.grad is not None}
    return logp.detach() * m, values.detach() * m, ref * m[..., None], fast_ref * m[..., None], loss.detach(), grads


def _groups(tokens):
    """GRPO's rollout: two prompts of different lengths, four completions each that end at different lengths."""
    return _rollout([tokens(7), tokens(4)], [[tokens(n) for n in (5, 2, 6, 1)], [tokens(n) for n in (3, 6, 4, 6)]])


def _headers(tokens):
    """PPO's rollout: eight prompts, most behind one 3-token header (one is the header alone), two with
    nothing in common; one completion each."""
    header = tokens(3)
    prompts = [header + tokens(2), header + tokens(4), header, header + tokens(1), tokens(5), tokens(2),
               header + tokens(3), header + tokens(2)]
    return _rollout(prompts, [[tokens(n)] for n in (5, 2, 6, 1, 3, 6, 4, 6)])


@pytest.mark.parametrize("rollout", [_groups, _headers])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["lora", "lora-critic", "full"])
def test_shared_prefix_rows_equal_padded_rows_and_their_gradients(tiny_lm_dir, kind, attn, rollout):
    """A GRPO rollout (prompts shared by their groups) and a PPO one (a header shared by most prompts):
    log-probs, values, the reference (peft's and the lean decoder's), the loss and every gradient of units
    of 4 and of 2 equal the padded rows' to fp32 rounding (<= 1e-6)."""
    layout = _layout(tiny_lm_dir, kind, attn)
    gen = torch.Generator().manual_seed(1)
    ids, mask, t = rollout(lambda n: torch.randint(3, 60, (n,), generator=gen).tolist())
    resp, m = ids[:, -t:], mask[:, -t:]
    weights = torch.randn((2, *m.shape), generator=gen) * m  # real tokens only, as every loss is
    want = _pass(layout, padded(ids, mask, t), resp, m, weights)
    for k in (4, 2):
        rows = shared_prefix(ids, mask, t, k)
        assert rows.ids.shape[0] == 8 // k
        assert rows.ids.numel() < ids.numel()  # fewer tokens computed than padded
        got = _pass(layout, rows, resp, m, weights)
        for name, g, w in zip(("logp", "values", "ref", "fast ref", "loss"), got[:5], want[:5], strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0, msg=lambda s, name=name: f"{name}: {s}")
        assert got[5].keys() == want[5].keys() and len(want[5]) > 2
        for name, g in got[5].items():
            scale = float(want[5][name].abs().max())
            assert scale > 0, name
            assert float((g - want[5][name]).abs().max()) <= 1e-6 * max(1.0, scale), name


def test_row_plan_is_padded_without_sizes_and_shared_where_it_pays():
    ids, mask, t = _rollout([[1] * 30], [[[2] * 3] * 4])
    assert RowPlan().rows(ids, mask, t).picks is None
    plan = RowPlan((2, 4), attention_cost=1e-4)
    assert plan.rows(ids, mask, t).picks is None  # nothing chosen yet: padded
    assert plan.choose(ids, mask, t) == 4 and plan.rows(ids, mask, t).ids.shape == (1, 30 + 12)


def test_branch_rows_put_the_shared_prefix_once_and_each_rest_behind_it():
    from ppoforge.lm.models.rows import branch_rows, shared_length

    assert shared_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shared_length([[1, 2], [1, 2, 3]]) == 1  # every sequence keeps its last token
    rows = branch_rows([[[1, 2, 3, 4], [1, 2, 5]], [[7, 8], [7, 9]]], pad_id=0, device="cpu")
    assert rows.ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 0, 0]]
    assert rows.last.tolist() == [3, 4, 6, 7]  # flat (row * 5 + column) of 4, 5, 8, 9
    allowed = rows.allowed[0, 0].int().tolist()
    assert allowed[4] == [1, 1, 0, 0, 1]  # the rejected token sees the prefix and itself, not chosen's rest
    assert allowed[3] == [1, 1, 1, 1, 0]
    assert rows.allowed[1, 0, 3].int().tolist() == [0, 0, 0, 1, 0]  # padding: its own slot only
