"""Things that must actually run: mixed-precision steps, a control PPO smoke run, an LM training step.

Every check here trains something for real on the selected device and precision and asserts the three
things that catch silent breakage: the loss is finite, the parameters changed, and (for control PPO)
the checkpoint resumes. The LM smoke run is the real `ppoforge train rlhf` trainer (LoRA layout) on a
tiny random-init Qwen2 with a tokenizer trained on the spot (`lm/models/tiny.py`): no download needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.config import build_config
from ppoforge.control import trainer as control_trainer
from ppoforge.control.config import ControlConfig
from ppoforge.doctor.report import CheckResult, fail, ok, skip, warn
from ppoforge.errors import UserError
from ppoforge.runtime.checkpoint import load_checkpoint
from ppoforge.runtime.device import native_bf16, resolve_device
from ppoforge.runtime.precision import Precision, make_precision


@dataclass
class StepOutcome:
    loss: float
    changed: bool          # did any parameter move
    compute_dtype: str     # dtype the autocast region produced
    steps: int             # optimizer steps taken (fp16 may skip the first on overflow)


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def changed(model: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def train_steps(model, optimizer, precision: Precision, loss_fn, max_steps: int = 3) -> StepOutcome:
    """Step until the parameters move (GradScaler skips a step whose scaled grads overflow)."""
    before = snapshot(model)
    step = 0
    while step < max_steps:
        step += 1
        with precision.autocast():
            out = loss_fn(model)
        loss = out["loss"]
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss)
        precision.step(optimizer, list(model.parameters()), 1.0)
        if not math.isfinite(loss.item()) or changed(model, before):
            break
    dtype = str(out["compute"].dtype).removeprefix("torch.")
    return StepOutcome(loss.item(), changed(model, before), dtype, step)


class PlainSGD:
    """`p -= lr * grad` with the optimizer surface GradScaler uses (param_groups, step, zero_grad).

    torch.optim's first optimizer pays a ~2 s import of torch._dynamo; the precision checks run in
    --quick, and what they test is autocast and the scaler, not the optimizer (the smoke runs use Adam).
    """

    def __init__(self, params, lr: float):
        self.param_groups = [{"params": list(params), "lr": lr}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


def precision_step(name: str, device: torch.device) -> StepOutcome:
    """A small MLP regression step under `name` autocast (fp16 with GradScaler) via make_precision."""
    precision = make_precision(name, device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    optimizer = PlainSGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16, device=device), torch.randn(32, 1, device=device)

    def loss_fn(m):
        pred = m(x)  # (B, 1) in the autocast dtype
        return {"loss": (pred.float() - y).pow(2).mean(), "compute": pred}

    return train_steps(model, optimizer, precision, loss_fn)


def _device(name: str) -> tuple[torch.device | None, str | None]:
    try:
        return resolve_device(name), None
    except UserError as e:
        return None, str(e)


def check_precision_step(name: str, device_name: str, capability: tuple[int, int] | None = None,
                         step: Callable[[str, torch.device], StepOutcome] = precision_step) -> CheckResult:
    """`bf16_step` / `fp16_step`; `capability` is the GPU's compute capability (None on CPU)."""
    check = f"{name}_step"
    device, error = _device(device_name)
    if device is None:
        return fail(check, error, "--device cpu, or see gpu_visibility")
    if name == "fp16" and device.type != "cuda":
        return skip(check, f"fp16 autocast + GradScaler needs CUDA; device is {device} (use bf16 on CPU)")
    fallback = "--precision fp32" + (" (or bf16 on compute capability >= 8.0)" if name == "fp16" else "")
    try:
        out = step(name, device)
    except Exception as e:  # noqa: BLE001 - any failure of the step is the finding
        return fail(check, f"{name} step on {device} raised {type(e).__name__}: {str(e)[:200]}", fallback)
    evidence = (f"{out.steps} {name} step(s) on {device}: compute dtype {out.compute_dtype}, "
                f"loss {out.loss:.4g}, params {'changed' if out.changed else 'UNCHANGED'}")
    expected = {"bf16": "bfloat16", "fp16": "float16"}[name]
    if not math.isfinite(out.loss) or not out.changed or out.compute_dtype != expected:
        return fail(check, evidence + (f" (expected {expected})" if out.compute_dtype != expected else ""),
                    fallback)
    if name == "bf16" and device.type == "cpu" and not native_bf16(device):
        return warn(check, evidence + "; this CPU has no amx_bf16 / avx512_bf16: bf16 works but is emulated, "
                    "far slower than fp32", "--precision fp32 (or auto) on this CPU")
    if name == "bf16" and capability is not None and capability < (8, 0):
        return warn(check, evidence + f"; compute capability {capability[0]}.{capability[1]} < 8.0: bf16 is "
                    "emulated here (is_bf16_supported() says yes anyway)", "--precision fp16 on this GPU")
    return ok(check, evidence)


# ---- control PPO smoke run ------------------------------------------------------------------------
class SmokeFailure(Exception):
    """A smoke run finished but broke one of its promises (finite, changed, resumable)."""


def _expect(condition: bool, message: str) -> None:
    if not condition:  # not `assert`: python -O must not turn the doctor's checks off
        raise SmokeFailure(message)


def _finite_losses(metrics_path: Path, prefix: str = "losses/") -> tuple[bool, int]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    values = [v for row in rows for k, v in row.items() if k.startswith(prefix)]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    return finite and bool(values), len(rows)


def control_smoke_run(device: str, precision: str, run_dir: Path) -> str:
    """Train CartPole for 2 updates, resume from the checkpoint, train a 3rd. Returns the evidence."""
    threads = torch.get_num_threads()  # the trainer sets its own; the doctor's benchmarks want theirs back
    values = {"env_id": "CartPole-v1", "num_envs": 2, "num_steps": 16, "total_steps": 64,
              "num_minibatches": 2, "update_epochs": 2, "device": device, "precision": precision,
              "progress": False, "tensorboard": False, "checkpoint_every": 1, "seed": 1}
    try:
        trainer = control_trainer.ControlTrainer(build_config(ControlConfig, values), run_dir)
        before = snapshot(trainer.agent)
        first = trainer.run()
        finite, rows = _finite_losses(run_dir / "metrics.jsonl")
        ckpt = run_dir / control_trainer.CHECKPOINT
        _expect(finite, f"non-finite losses in {run_dir / 'metrics.jsonl'}")
        _expect(changed(trainer.agent, before), "parameters did not change")
        _expect(ckpt.is_file(), "no checkpoint written")
        resumed = control_trainer.ControlTrainer(build_config(ControlConfig, {**values, "total_steps": 96}), run_dir)
        resumed.load(load_checkpoint(ckpt))
        _expect(not changed(resumed.agent, snapshot(trainer.agent)), "resumed parameters differ from saved")
        second = resumed.run()
        _expect(second.updates == first.updates + 1, f"resume ran to update {second.updates}")
    finally:
        torch.set_num_threads(threads)
    return (f"CartPole-v1 on {trainer.device} / {precision}: {first.updates} updates "
            f"({first.global_step} steps), {rows} metric rows with finite losses, params changed, "
            f"checkpoint {ckpt.stat().st_size // 1024} KiB; "
            f"resumed at update {first.updates} with identical params and ran to update {second.updates}")


def _smoke_check(name: str, run: Callable[[str, str, Path], str], device: str, precision: str, run_dir: Path,
                 reproduce: str) -> CheckResult:
    """Run a smoke run and turn its outcome into a row: ok with its evidence, or fail with the fix."""
    try:
        return ok(name, run(device, precision, run_dir))
    except UserError as e:
        return fail(name, f"refused on {device} / {precision}: {e}",
                    "--device cpu / --precision fp32, or fix what gpu_visibility reports")
    except ImportError as e:
        return fail(name, f"cannot import what the run needs ({e})", "pip install 'ppoforge[lm]'")
    except Exception as e:  # noqa: BLE001 - any failure of the run is the finding
        return fail(name, f"{type(e).__name__}: {str(e)[:300]}",
                    f"see the traceback of: {reproduce} --device {device} --precision {precision}")


def check_control_smoke(device: str, precision: str, workdir: Path,
                        run: Callable[[str, str, Path], str] = control_smoke_run) -> CheckResult:
    return _smoke_check("control_smoke", run, device, precision, Path(workdir) / "control",
                        "ppoforge train control --preset cartpole --total-steps 64 --num-envs 2 --num-steps 16")


# ---- LM smoke run: the real RLHF trainer on a tiny random-init model --------------------------------
LM_SMOKE = {"layout": "lora", "prompts": "demo", "heldout_prompts": None, "reward": "length:6",
            "batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 2, "ppo_epochs": 1,
            "max_new_tokens": 6, "max_prompt_tokens": 32, "lora_r": 4, "learning_rate": 1e-2,
            "progress": False, "tensorboard": False, "checkpoint_every": 1, "seed": 1}


def lm_smoke_run(device: str, precision: str, run_dir: Path) -> str:
    """Two PPO updates of `ppoforge train rlhf` (LoRA layout) on a tiny Qwen2, then resume for a third."""
    # optional extra (ppoforge[lm]: transformers, peft): without it the ImportError is this check's finding
    from transformers.utils import logging as hf_logging

    # the LM stack, which needs that extra too
    from ppoforge.lm.models.tiny import save_tiny_lm
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import CHECKPOINT, RLHFTrainer, train

    hf_logging.disable_progress_bar()  # the doctor's table, not transformers' load/save bars
    threads = torch.get_num_threads()
    model_dir = save_tiny_lm(Path(run_dir) / "tiny-model")
    values = {**LM_SMOKE, "model": str(model_dir), "device": device, "precision": precision, "total_updates": 2}
    try:
        trainer = RLHFTrainer(build_config(RLHFConfig, values), run_dir)
        trained = dict(trainer.layout.named_trainable())
        frozen = [p for n, p in trainer.layout.peft.named_parameters() if "lora_" not in n]  # base = reference
        before = [p.detach().clone() for p in trained.values()]
        frozen_before = [p.detach().clone() for p in frozen]
        first = trainer.run()
        finite, rows = _finite_losses(run_dir / "metrics.jsonl", prefix="loss/")
        ckpt = run_dir / CHECKPOINT
        _expect(finite, f"non-finite losses in {run_dir / 'metrics.jsonl'}")
        _expect(any(not torch.equal(a, p) for a, p in zip(before, trained.values(), strict=True)),
                "trainable parameters did not change")
        _expect(all(torch.equal(a, p) for a, p in zip(frozen_before, frozen, strict=True)),
                "frozen (reference/base) parameters changed")
        _expect(ckpt.is_file(), "no checkpoint written")
        # the trainer's own resume (`ppoforge train rlhf --resume`), on the same device
        second = train(build_config(RLHFConfig, {**values, "total_updates": 3}), run_dir, resume=True)
        _expect(second.updates == first.updates + 1, f"resume ran to update {second.updates}")
    finally:
        torch.set_num_threads(threads)
    return (f"tiny Qwen2 (hidden 32, 2 layers) PPO on {trainer.inputs.device} / {precision}, LoRA layout: "
            f"{first.updates} updates, {rows} metric rows with finite losses, LoRA + value head changed, "
            f"base/reference unchanged, checkpoint {ckpt.stat().st_size // 1024} KiB; resumed at update "
            f"{first.updates} and ran to update {second.updates}")


def check_lm_smoke(device: str, precision: str, workdir: Path,
                   run: Callable[[str, str, Path], str] = lm_smoke_run) -> CheckResult:
    return _smoke_check("lm_smoke", run, device, precision, Path(workdir) / "lm",
                        "ppoforge train rlhf --preset tiny --model <a small model dir> --total-updates 2")
