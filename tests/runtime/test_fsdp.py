"""FSDP2 (runtime/fsdp.py) on 2 gloo ranks against one plain process.

One 2-rank run (the `ranks` fixture; this file is also its worker script, `python test_fsdp.py DIR`)
does every distributed phase and saves what it saw; the tests compare that with the same computation on
an unsharded model in the test process. Each rank pays the torch + transformers import once (~12 s of
CPU; the run took 60 s of wall time on a 2-core box at load 7), so the tests that read it are `slow`.
Where torch cannot run FSDP2 on CPU (2.6: `cpu_unsupported_reason`), the FSDP phases are left out and
their tests skip with that reason; the checkpoint phases still run on unsharded models, which
`save_sharded` / `load_sharded` also serve (replicated ranks, DDP style).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ppoforge.errors import UserError
from ppoforge.runtime.fsdp import (
    cpu_unsupported_reason,
    decoder_layers,
    full_weights,
    load_sharded,
    mp_policy,
    save_sharded,
    shard_model,
)

WORLD = 2
FSDP_SKIP = cpu_unsupported_reason()
needs_fsdp = pytest.mark.skipif(FSDP_SKIP is not None, reason=str(FSDP_SKIP))
N_NEW = 6  # decoded tokens per prompt


def tiny_qwen2(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()  # eval: generate's mode; Qwen2 has no dropout anyway


def prompts(rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(10 + rank))  # (B, P) per rank


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (2 * WORLD, 8), generator=torch.Generator().manual_seed(3))  # (B, T), split by rank


@torch.no_grad()
def greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (B, N_NEW) and their logits (B, N_NEW, V) through the lean decoder."""
    from ppoforge.lm.models.decoders import LlamaDecoder

    decoder = LlamaDecoder(model)
    logits, _ = decoder.prefill(ids, torch.ones_like(ids), N_NEW)
    tokens, all_logits = [], []
    for t in range(N_NEW):
        all_logits.append(logits)
        tokens.append(logits.argmax(-1))
        if t < N_NEW - 1:
            logits, _ = decoder.step(tokens[-1], t)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@torch.no_grad()
def hf_generate(model, ids: torch.Tensor) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                         min_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean NLL of `ids`, backward; returns the loss and the pre-clip global grad norm."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def full_state(model, opt) -> dict:
    """Full (unsharded) model and optimizer state, on rank 0 only where the model is sharded."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, [opt], options=options)
    return {"model": model_sd, "optim": optim_sd}


def plain_state(model, opt) -> dict:
    """An unsharded model's state on every rank (full_state's cpu_offload keeps rank 0's alone)."""
    model_sd, optim_sd = get_state_dict(model, [opt])
    return {"model": model_sd, "optim": optim_sd}


def trained(seed: int, ids: torch.Tensor):
    model = tiny_qwen2(seed)
    opt = optimizer(model)
    loss_and_grads(model, ids)
    opt.step()
    return model, opt


# ---- the worker: one rank of the 2-rank run -------------------------------------------------------------------


def _fsdp_phases(out_dir: Path, rank: int) -> dict:
    out = {}
    # 1 -> 2: a fresh, differently seeded sharded model takes the one-process checkpoint
    model = shard_model(tiny_qwen2(seed=1))
    opt = optimizer(model)
    out["loaded_extra"] = load_sharded(out_dir / "ckpt_1rank", model, opt)
    out["loaded"] = full_state(model, opt)
    # decode before any forward: full_weights must not depend on FSDP's lazy init in the root forward
    model = shard_model(tiny_qwen2(seed=0))
    with full_weights(model):
        out["weight_type"] = type(model.model.layers[0].self_attn.q_proj.weight).__name__
        out["tokens"], out["logits"] = greedy(model, prompts(rank))
        with torch.no_grad():
            model(input_ids=prompts(rank))  # a forward inside the context: its post-forward hook reshards
        out["after_inner_forward"] = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    out["resharded_type"] = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    out["generated"] = hf_generate(model, prompts(rank))  # the model's forward: FSDP's hooks gather
    out["root_after_forward"] = type(model.lm_head.weight).__name__  # resharded: safe to build the optimizer
    out["bf16_tokens"], out["bf16_logits"] = _bf16_decode(rank)
    # forward + backward on this rank's half of the batch: FSDP averages the two halves' gradients
    opt = optimizer(model)
    loss, norm = loss_and_grads(model, batch().chunk(WORLD)[rank])
    dist.all_reduce(loss)
    out["loss"], out["norm"] = loss / WORLD, norm.full_tensor()
    out["grads"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    opt.step()
    save_sharded(out_dir / "ckpt_fsdp", model, opt, extra={"update": 7, "world": WORLD})
    out["saved"] = full_state(model, opt)
    return out


def _bf16_decode(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Under a bf16 MixedPrecisionPolicy the gathered weights are bf16, so the lean decoder runs in bf16."""
    model = shard_model(tiny_qwen2(seed=0), "bf16")
    with full_weights(model):
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        return greedy(model, prompts(rank))


def _replicated_phases(out_dir: Path) -> dict:
    model = tiny_qwen2(seed=1)
    opt = optimizer(model)
    out = {"plain_loaded_extra": load_sharded(out_dir / "ckpt_1rank", model, opt),
           "plain_loaded": plain_state(model, opt)}
    model, opt = trained(0, batch())  # every rank the same batch: replicas stay equal, as under DDP
    save_sharded(out_dir / "ckpt_plain", model, opt, extra={"update": 5})
    out["plain_saved"] = plain_state(model, opt)
    return out


def worker(out_dir: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=WORLD)
    out = {} if FSDP_SKIP else _fsdp_phases(out_dir, rank)
    out.update(_replicated_phases(out_dir))
    torch.save(out, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


# ---- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread():
    """The workers compute on one thread each; a matmul's summation order depends on the thread count
    (2 threads moved a logit by 6e-8), so the reference runs on one thread too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """Save a one-process checkpoint, run the 2-rank worker on it, return both sides' results."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    model, opt = trained(0, batch())
    save_sharded(out_dir / "ckpt_1rank", model, opt, extra={"update": 3, "note": "one rank"})
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(out_dir)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return {"dir": out_dir, "one_rank": full_state(model, opt), "ranks": results}


def assert_same(a, b, path="state"):
    """Nested dicts / lists of tensors and plain values, equal exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a.keys() ^ b.keys())} differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path}: max diff {(a.double() - b.double()).abs().max().item()}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_mp_policy_names():
    assert mp_policy("fp32").param_dtype is None
    bf16 = mp_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    for name in ("fp16", "auto"):
        with pytest.raises(UserError, match="allowed: fp32, bf16"):
            mp_policy(name)


def test_decoder_layers_from_no_split_modules():
    model = tiny_qwen2(0)
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(UserError, match="no decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.skipif(FSDP_SKIP is None, reason="this torch runs FSDP2 on CPU")
def test_shard_model_on_cpu_says_why_not():
    with pytest.raises(UserError, match="record_event"):
        shard_model(tiny_qwen2(0))


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_full_weights_lean_decode_equals_one_process(ranks):
    model = tiny_qwen2(0)
    for rank, out in enumerate(ranks["ranks"]):
        # gathered inside; sharded after it, after a forward inside it (so call none there), after a forward
        assert (out["weight_type"], out["resharded_type"], out["after_inner_forward"],
                out["root_after_forward"]) == ("Parameter", "DTensor", "DTensor", "DTensor")
        tokens, logits = greedy(model, prompts(rank))
        assert torch.equal(out["tokens"], tokens)
        assert torch.equal(out["logits"], logits)  # the same fp32 weights, the same ops: bit for bit


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_full_weights_bf16_policy_decodes_as_bf16_weights(ranks):
    """FSDP casts each fp32 shard to bf16 before the all-gather: the same weights as rounding the full
    model's parameters (buffers, such as RoPE's inv_freq, stay fp32 in both)."""
    model = tiny_qwen2(0)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    for rank, out in enumerate(ranks["ranks"]):
        tokens, logits = greedy(model, prompts(rank))
        assert logits.dtype == torch.bfloat16
        assert torch.equal(out["bf16_tokens"], tokens)
        assert torch.equal(out["bf16_logits"], logits)


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_generate_under_fsdp_hooks_equals_one_process(ranks):
    model = tiny_qwen2(0)
    for rank, out in enumerate(ranks["ranks"]):
        assert torch.equal(out["generated"], hf_generate(model, prompts(rank)))


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_forward_backward_equals_one_process(ranks):
    """Half a batch per rank, gradients averaged by FSDP = the whole batch on one process (each half has
    the same token count, so the mean of the halves' token means is the batch's), within fp32 rounding."""
    model = tiny_qwen2(0)
    loss, norm = loss_and_grads(model, batch())
    out = ranks["ranks"][0]
    torch.testing.assert_close(out["loss"], loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["norm"], norm, rtol=1e-6, atol=1e-6)
    assert out["grads"].keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(out["grads"][name], p.grad, rtol=0, atol=1e-6, msg=name)


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_resume_2_to_1_fsdp(ranks):
    model = tiny_qwen2(seed=1)
    opt = optimizer(model)
    assert load_sharded(ranks["dir"] / "ckpt_fsdp", model, opt) == {"update": 7, "world": WORLD}
    assert_same(full_state(model, opt), ranks["ranks"][0]["saved"])


@needs_fsdp
@pytest.mark.slow
@pytest.mark.torchrun
def test_resume_1_to_2_fsdp(ranks):
    out = ranks["ranks"][0]
    assert out["loaded_extra"] == {"update": 3, "note": "one rank"}
    assert_same(out["loaded"], ranks["one_rank"])


@pytest.mark.slow
@pytest.mark.torchrun
def test_resume_2_to_1_replicated(ranks):
    model = tiny_qwen2(seed=1)
    opt = optimizer(model)
    assert load_sharded(ranks["dir"] / "ckpt_plain", model, opt) == {"update": 5}
    assert_same(full_state(model, opt), ranks["ranks"][0]["plain_saved"])


@pytest.mark.slow
@pytest.mark.torchrun
def test_resume_1_to_2_replicated(ranks):
    for out in ranks["ranks"]:
        assert out["plain_loaded_extra"] == {"update": 3, "note": "one rank"}
        assert_same(out["plain_loaded"], ranks["one_rank"])


def test_save_replaces_atomically_and_recovers_a_cut_swap(tmp_path):
    """A stale temp dir is cleared; a crash between the two renames (old moved aside, new not in place)
    still loads the old checkpoint, and the next save completes."""
    path = tmp_path / "ckpt"
    model, opt = trained(0, batch())
    save_sharded(path, model, opt, extra={"update": 1})
    (tmp_path / ".ckpt.tmp").mkdir()
    (tmp_path / ".ckpt.tmp" / "junk").write_text("half-written")
    save_sharded(path, model, opt, extra={"update": 2})
    assert not (tmp_path / ".ckpt.tmp").exists() and not (tmp_path / ".ckpt.old").exists()
    os.replace(path, tmp_path / ".ckpt.old")  # the cut swap
    fresh = tiny_qwen2(seed=1)
    fresh_opt = optimizer(fresh)
    assert load_sharded(path, fresh, fresh_opt) == {"update": 2}
    assert_same(full_state(fresh, fresh_opt), full_state(model, opt))
    assert path.is_dir() and not (tmp_path / ".ckpt.old").exists()
    with pytest.raises(UserError, match="no sharded checkpoint"):
        load_sharded(tmp_path / "missing", fresh, fresh_opt)


def test_save_and_load_without_optimizer(tmp_path):
    model = tiny_qwen2(0)
    save_sharded(tmp_path / "ckpt", model)
    fresh = tiny_qwen2(seed=1)
    assert load_sharded(tmp_path / "ckpt", fresh) == {}
    assert_same(fresh.state_dict(), model.state_dict())


def test_another_models_checkpoint_is_one_line(tmp_path):
    model = tiny_qwen2(0)
    save_sharded(tmp_path / "ckpt", model)
    wider = type(model)(type(model.config)(**{**model.config.to_dict(), "hidden_size": 48}))
    with pytest.raises(UserError, match=r"does not fit this model \(ValueError: Size mismatch"):
        load_sharded(tmp_path / "ckpt", wider)


def test_full_weights_without_fsdp_is_a_no_op():
    model = tiny_qwen2(0)
    weight = model.model.layers[0].mlp.up_proj.weight
    with full_weights(model):
        assert model.model.layers[0].mlp.up_proj.weight is weight


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
