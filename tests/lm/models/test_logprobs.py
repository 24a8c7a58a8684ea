"""token_logprobs: chunked log-probs and entropies equal the naive full log-softmax, values and grads;
head_logprobs: the LM head applied chunk by chunk, checkpointed, equals the head applied at once."""

import pytest
import torch

import ppoforge.lm.models.logprobs as logprobs_module
from ppoforge.lm.models.logprobs import head_logprobs, token_logprobs


def naive(logits, tokens, tau):
    logp_all = torch.log_softmax(logits.float() / tau, dim=-1)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [None, 3])  # 3 rows per chunk: several uneven chunks
def test_values_match_naive_log_softmax(tau, chunk_rows):
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 37) * 3
    tokens = torch.randint(0, 37, (4, 5))
    logp, entropy = token_logprobs(logits, tokens, tau, chunk_rows=chunk_rows)
    ref_logp, ref_entropy = naive(logits, tokens, tau)
    assert logp.dtype == torch.float32 and logp.shape == (4, 5)
    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-6)


def test_hand_computed_two_token_vocab():
    # logits (0, log 3): p = (1/4, 3/4); logp(1) = log 0.75; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    logp, entropy = token_logprobs(logits, torch.tensor([1]))
    assert logp.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-7)
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [None, 4])
@pytest.mark.parametrize("tau", [1.0, 0.8])
@pytest.mark.parametrize("terms", ["both", "logp", "entropy"])
def test_gradients_match_autograd_of_naive(chunk_rows, tau, terms):
    torch.manual_seed(1)
    logits = (torch.randn(3, 6, 29) * 2).requires_grad_()
    before = logits.detach().clone()
    tokens = torch.randint(0, 29, (3, 6))
    w_logp, w_ent = torch.randn(3, 6), torch.randn(3, 6)

    def loss(logp, entropy):  # a term left out of the graph reaches backward as a None grad
        parts = {"logp": (logp * w_logp).sum(), "entropy": (entropy * w_ent).sum()}
        return sum(v for k, v in parts.items() if terms in (k, "both"))

    (grad,) = torch.autograd.grad(loss(*token_logprobs(logits, tokens, tau, chunk_rows=chunk_rows)), logits)
    (ref_grad,) = torch.autograd.grad(loss(*naive(logits, tokens, tau)), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits.detach(), before)  # backward works on copies, never on the saved logits


def test_gradient_of_logp_alone_and_bf16_logits():
    torch.manual_seed(2)
    logits = (torch.randn(2, 4, 31) * 2).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 31, (2, 4))
    logp, _ = token_logprobs(logits, tokens, entropy=False)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logp, _ = naive(logits.detach(), tokens, 1.0)  # the naive path upcasts the same bf16 values
    torch.testing.assert_close(logp.detach(), ref_logp, atol=1e-6, rtol=1e-6)
    # d sum(logp) / d z = onehot - softmax
    ref_grad = torch.nn.functional.one_hot(tokens, 31) - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(logits.grad.float(), ref_grad, atol=1e-2, rtol=0)


def test_no_grad_path_skips_entropy():
    logp, entropy = token_logprobs(torch.randn(2, 3, 11), torch.zeros(2, 3, dtype=torch.long), entropy=False)
    assert entropy is None and logp.shape == (2, 3)


def _head_case(seed=3, vocab=23, hidden=8):
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab)
    return head, torch.randn(3, 7, hidden, requires_grad=True), torch.randint(0, vocab, (3, 7))


@pytest.mark.parametrize("tokens_per_chunk", [1, 4, 7, 11, 100])  # 1, uneven, even chunks; 2 chunks: whole
@pytest.mark.parametrize("terms", ["both", "logp"])
def test_head_logprobs_by_chunks_equal_the_whole_head_values_and_grads(monkeypatch, tokens_per_chunk, terms):
    head, hidden, tokens = _head_case()
    monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", 23 * tokens_per_chunk)
    w_logp, w_ent = torch.randn(3, 7), torch.randn(3, 7)

    def grads(logp, entropy):
        loss = (logp * w_logp).sum() + ((entropy * w_ent).sum() if terms == "both" else 0)
        return (logp.detach(), *torch.autograd.grad(loss, [hidden, head.weight, head.bias]))

    chunked = grads(*head_logprobs(head, hidden, tokens, 23, 0.7))
    whole = grads(*token_logprobs(head(hidden), tokens, 0.7))
    for got, want in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with torch.no_grad():  # what the scoring passes run: the training pass's numbers, bit for bit
        assert torch.equal(head_logprobs(head, hidden, tokens, 23, 0.7, entropy=False)[0], chunked[0])


def test_head_logprobs_keeps_hidden_states_for_backward_not_logits(monkeypatch):
    """What autograd saves during the forward: the whole (N, V) logits unchunked; chunked, each chunk's
    hidden states and per-token numbers, a small fraction of that."""
    head, hidden, tokens = _head_case(vocab=400, hidden=4)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    def saved_bytes(fn):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, entropy = fn()
        (logp.sum() + entropy.sum()).backward()
        return sum(saved)

    logits_bytes = 3 * 7 * 400 * 4
    whole = saved_bytes(lambda: token_logprobs(head(hidden), tokens))
    monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", 400 * 4)  # 4 tokens of logits a chunk
    chunked = saved_bytes(lambda: head_logprobs(head, hidden, tokens, 400))
    assert whole >= logits_bytes
    assert chunked < logits_bytes / 4, (chunked, whole)
