"""Things that must actually run: mixed-precision steps, a control PPO smoke run, an LM training step.

Every check here trains something for real on the selected device and precision and asserts the three
things that catch silent breakage: the loss is finite, the parameters changed, and (for control PPO)
the checkpoint resumes to the identical state. `lm_smoke_step` is a stand-in until the LM trainer
exists: one policy-gradient step of a tiny random Qwen2 with log-probs in fp32; swap it for the real
trainer's smoke run, keeping the check name `lm_smoke` (the *LM RLHF* verdict depends on it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.doctor.report import CheckResult, fail, ok, skip, warn
from ppoforge.errors import UserError
from ppoforge.runtime.device import resolve_device
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


def _finite_losses(metrics_path: Path) -> tuple[bool, int]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    values = [v for row in rows for k, v in row.items() if k.startswith("losses/")]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)
    return finite and bool(values), len(rows)


def control_smoke_run(device: str, precision: str, run_dir: Path) -> str:
    """Train CartPole for 2 updates, resume from the checkpoint, train a 3rd. Returns the evidence."""
    from ppoforge.config import build_config
    from ppoforge.control.config import ControlConfig
    from ppoforge.control.trainer import CHECKPOINT, ControlTrainer
    from ppoforge.runtime.checkpoint import load_checkpoint

    threads = torch.get_num_threads()  # the trainer sets its own; the doctor's benchmarks want theirs back
    values = {"env_id": "CartPole-v1", "num_envs": 2, "num_steps": 16, "total_steps": 64,
              "num_minibatches": 2, "update_epochs": 2, "device": device, "precision": precision,
              "progress": False, "tensorboard": False, "checkpoint_every": 1, "seed": 1}
    try:
        trainer = ControlTrainer(build_config(ControlConfig, values), run_dir)
        before = snapshot(trainer.agent)
        first = trainer.run()
        finite, rows = _finite_losses(run_dir / "metrics.jsonl")
        ckpt = run_dir / CHECKPOINT
        _expect(finite, f"non-finite losses in {run_dir / 'metrics.jsonl'}")
        _expect(changed(trainer.agent, before), "parameters did not change")
        _expect(ckpt.is_file(), "no checkpoint written")
        resumed = ControlTrainer(build_config(ControlConfig, {**values, "total_steps": 96}), run_dir)
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


def check_control_smoke(device: str, precision: str, workdir: Path,
                        run: Callable[[str, str, Path], str] = control_smoke_run) -> CheckResult:
    name = "control_smoke"
    try:
        return ok(name, run(device, precision, Path(workdir) / "control"))
    except UserError as e:
        return fail(name, f"config refused on {device} / {precision}: {e}",
                    "--device cpu / --precision fp32, or fix what gpu_visibility reports")
    except Exception as e:  # noqa: BLE001 - any failure of the run is the finding
        return fail(name, f"{type(e).__name__}: {str(e)[:300]}",
                    f"see the traceback of: ppoforge train control --preset cartpole --total-steps 64 "
                    f"--num-envs 2 --num-steps 16 --device {device} --precision {precision}")


# ---- LM smoke step (stand-in for the LM trainer's smoke run) --------------------------------------
def lm_smoke_step(device: torch.device, precision_name: str) -> StepOutcome:
    """One policy-gradient step of a tiny random-init Qwen2 (hidden 32, 2 layers, vocab 128)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12), device=device)  # (B, T)
    adv = torch.randn(2, 11, device=device)                # (B, T-1)

    def loss_fn(m):
        logits = m(input_ids=ids).logits  # (B, T, V) in the autocast dtype
        # log-probs in fp32: a bf16 log_softmax over the vocab is off by ~1e-2, enough to bias the ratio
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return {"loss": -(logp * adv).mean(), "compute": logits}

    return train_steps(model, optimizer, make_precision(precision_name, device), loss_fn)


def check_lm_smoke(device_name: str, precision: str,
                   step: Callable[[torch.device, str], StepOutcome] = lm_smoke_step) -> CheckResult:
    name = "lm_smoke"
    device, error = _device(device_name)
    if device is None:
        return fail(name, error, "--device cpu, or see gpu_visibility")
    try:
        out = step(device, precision)
    except UserError as e:
        return fail(name, str(e), "--precision fp32 or bf16 on CPU")
    except ImportError as e:
        return fail(name, f"cannot import transformers ({e})", "pip install 'ppoforge[lm]'")
    except Exception as e:  # noqa: BLE001 - any failure of the step is the finding
        return fail(name, f"{type(e).__name__}: {str(e)[:300]}", "--precision fp32; see libraries_lm")
    evidence = (f"tiny Qwen2 (hidden 32, 2 layers, vocab 128) on {device} / {precision}: "
                f"{out.steps} step(s), logits {out.compute_dtype}, fp32 log-probs, loss {out.loss:.4g}, "
                f"params {'changed' if out.changed else 'UNCHANGED'}")
    if not math.isfinite(out.loss) or not out.changed:
        return fail(name, evidence, "--precision fp32; if that fails too, see libraries_lm")
    return ok(name, evidence)
