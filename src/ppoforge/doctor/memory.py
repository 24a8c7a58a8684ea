"""The doctor's `memory` check: will a named model train here? `ppoforge plan`'s verdict for GRPO with the
`grpo` preset (LoRA, bf16 where the device computes it) on the device the doctor checks: each visible GPU's
memory, else this machine's available memory. Skipped without `--model`."""

from __future__ import annotations

from ppoforge.doctor.report import CheckResult, fail, ok, skip, warn

GiB = 1 << 30


def check_memory(model: str | None, device: str, gpus: int) -> CheckResult:
    """ok: the plan fits; warn: it fits only with the change it names; fail: no change fits."""
    if not model:
        return skip("memory", "no --model named: `ppoforge doctor --model NAME` plans GRPO on it here")
    try:
        # optional extra: the plan builds the model from its config with transformers (ppoforge[lm])
        from ppoforge.config import build_config, read_preset
        from ppoforge.lm.models import memplan
        from ppoforge.lm.rl.config import RLHFConfig
    except ImportError as e:
        return skip("memory", f"needs the LM libraries ({e.name} is not installed): pip install 'ppoforge[lm]'")
    target = "cuda:0" if gpus and device in ("auto", "cuda", "cuda:0") else device if device != "auto" else "cpu"
    cfg = build_config(RLHFConfig, {**read_preset("grpo", "rlhf"), "model": model, "precision": "auto"})
    result = memplan.for_config(cfg, "rlhf", target)
    evidence = (f"GRPO ({cfg.layout}, preset grpo) on {model}: peak {result.peak / GiB:.1f} GiB of "
                f"{(result.capacity or 0) / GiB:.1f} GiB on {result.device}")
    if result.fits is not False:
        return ok("memory", evidence)
    if result.fix:
        return warn("memory", evidence + " — does not fit as is", f"train with {result.fix}; `ppoforge plan rlhf "
                    f"--preset grpo --model {model} --device {target}` shows where the memory goes")
    return fail("memory", evidence + " — no single change fits it on this device",
                "a smaller model, or more GPUs with fsdp (see `ppoforge plan`)")
