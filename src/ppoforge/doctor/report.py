"""Check results, capability verdicts, and their two renderings (a plain-text table and JSON).

A check is one small function returning a `CheckResult(name, status, evidence, fix)`. A capability
("control PPO", "multi-GPU") is a verdict over named checks: it holds when none of them failed and every
one it needs ran and passed (ok or warn). One function (`verdict`) decides for both modes: where a check
`--quick` skipped would decide, the quick verdict is "not checked (run the full doctor)" (holds None), never
"yes" — so quick never says yes where the full doctor says NO (tests/doctor/test_doctor_modes.py). The exit
code is 0 when no *required* capability is NO (a quick run's "not checked" does not fail it).
"""

from __future__ import annotations

import json
import shutil
import textwrap
from dataclasses import asdict, dataclass, field

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)


@dataclass
class CheckResult:
    name: str
    status: str          # ok | warn | fail | skip
    evidence: str        # what the check saw, in one or two sentences
    fix: str = ""        # for warn/fail: the command, flag or env var that fixes it
    seconds: float = 0.0


def ok(name: str, evidence: str) -> CheckResult:
    return CheckResult(name, OK, evidence)


def warn(name: str, evidence: str, fix: str) -> CheckResult:
    return CheckResult(name, WARN, evidence, fix)


def fail(name: str, evidence: str, fix: str) -> CheckResult:
    return CheckResult(name, FAIL, evidence, fix)


def skip(name: str, evidence: str) -> CheckResult:
    return CheckResult(name, SKIP, evidence)


@dataclass(frozen=True)
class Capability:
    key: str                      # the name `--require` takes
    label: str
    needs: tuple[str, ...]        # each must run and pass (ok / warn)
    any_of: tuple[str, ...] = ()  # at least one must pass; none may fail
    min_gpus: int = 0


CAPABILITIES = (
    Capability("control", "control PPO",
               ("python_torch", "libraries_core", "checkpoint_roundtrip", "control_smoke")),
    Capability("rlhf", "LM RLHF on this device ({device})",
               ("python_torch", "torch_wheel", "gpu_visibility", "libraries_lm", "lm_smoke")),
    Capability("precision", "mixed precision (bf16 / fp16)", (), any_of=("bf16_step", "fp16_step")),
    Capability("multigpu", "multi-GPU (DDP over NCCL)", ("dist_backends", "allreduce"), min_gpus=2),
    Capability("multinode", "multi-node (rendezvous at MASTER_ADDR / --rdzv-endpoint, then DDP)",
               ("dist_backends", "allreduce", "rendezvous")),
    Capability("fsdp", "FSDP2 sharding (fsdp: true)", ("dist_backends", "fsdp")),
    Capability("notebook", "notebook access", ("jupyter",)),
    Capability("checkpoints", "persistent checkpoints", ("runs_dir", "checkpoint_roundtrip")),
)
CAPABILITY_KEYS = tuple(c.key for c in CAPABILITIES)
DEFAULT_REQUIRE = ("control", "rlhf", "checkpoints")


NOT_CHECKED = "run the full doctor"  # the reason of a verdict not checked: "not checked (run the full doctor: …)"


@dataclass
class Verdict:
    key: str
    label: str
    holds: bool | None  # None: not checked (a check it needs was skipped by --quick)
    reason: str
    required: bool = False

    @property
    def answer(self) -> str:
        return {True: "yes", False: "NO", None: "not checked"}[self.holds]

    def sentence(self) -> str:
        """The verdict in words, as the table shows it: `yes (reason)`, `NO (reason)`, `not checked (reason)`."""
        return f"{self.answer} ({self.reason})"


def _short(result: CheckResult) -> str:
    text = result.evidence.split("; ")[0]
    return f"{result.name}: {text[:90]}"


def verdict(cap: Capability, by_name: dict[str, CheckResult], gpus: int, quick_skipped: set[str]) -> Verdict:
    """Does `cap` hold, given the results by check name and the number of visible GPUs?"""
    listed = [by_name[n] for n in cap.needs + cap.any_of if n in by_name]
    failed = [r for r in listed if r.status == FAIL]
    if failed:
        return Verdict(cap.key, cap.label, False, _short(failed[0]))
    if gpus < cap.min_gpus:
        return Verdict(cap.key, cap.label, False, f"{gpus} GPU(s) visible; needs >= {cap.min_gpus}")
    missing = [n for n in cap.needs if n not in by_name]
    unrun = [by_name[n] for n in cap.needs if n in by_name and by_name[n].status == SKIP
             and n not in quick_skipped]
    if missing or unrun:
        return Verdict(cap.key, cap.label, False, f"{missing[0]}: not run" if missing else _short(unrun[0]))
    passed = [r.name for r in listed if r.status in (OK, WARN)]
    if cap.any_of and not any(n in passed for n in cap.any_of):
        if all(n in quick_skipped for n in cap.any_of):
            return Verdict(cap.key, cap.label, None, f"{NOT_CHECKED}: {', '.join(cap.any_of)} skipped by --quick")
        return Verdict(cap.key, cap.label, False, "; ".join(_short(by_name[n]) for n in cap.any_of
                                                             if n in by_name))
    deferred = [n for n in cap.needs if n in quick_skipped]
    if deferred:
        return Verdict(cap.key, cap.label, None, f"{NOT_CHECKED}: {', '.join(deferred)} skipped by --quick")
    warned = [r.name for r in listed if r.status == WARN]
    reason = f"{', '.join(passed)} passed" + (f" (with warnings: {', '.join(warned)})" if warned else "")
    return Verdict(cap.key, cap.label, True, reason)


def verdicts(results: list[CheckResult], gpus: int, quick_skipped: set[str],
             required: tuple[str, ...], device: str = "cpu") -> list[Verdict]:
    """One verdict per capability; `device` is the device type the runs use (it names the RLHF one)."""
    by_name = {r.name: r for r in results}
    out = [verdict(cap, by_name, gpus, quick_skipped) for cap in CAPABILITIES]
    for v in out:
        v.required = v.key in required
        v.label = v.label.format(device=device)
    return out


def exit_code(vs: list[Verdict]) -> int:
    return 0 if all(v.holds is not False for v in vs if v.required) else 1


@dataclass
class Report:
    device: str
    precision: str
    quick: bool
    results: list[CheckResult]
    verdicts: list[Verdict]
    seconds: float = 0.0
    required: tuple[str, ...] = field(default=DEFAULT_REQUIRE)

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdicts)


def to_json(report: Report) -> str:
    data = {"device": report.device, "precision": report.precision, "quick": report.quick,
            "seconds": round(report.seconds, 2), "required": list(report.required),
            "exit_code": report.exit_code,
            "checks": [{**asdict(r), "seconds": round(r.seconds, 3)} for r in report.results],
            "verdicts": [asdict(v) for v in report.verdicts]}
    return json.dumps(data, indent=2)


def _wrap(text: str, width: int, indent: int) -> list[str]:
    lines = textwrap.wrap(text, width=max(width - indent, 30), break_on_hyphens=False) or [""]
    return [lines[0]] + [" " * indent + line for line in lines[1:]]


def render_text(report: Report, width: int | None = None) -> str:
    """The table: check, status, evidence (wrapped), a fix line under each warn/fail; then verdicts."""
    width = width or max(shutil.get_terminal_size((110, 24)).columns, 80)
    name_w = max([len(r.name) for r in report.results] + [5])
    indent = name_w + 2 + 7  # '<name>  ok     <evidence>'
    mode = "quick" if report.quick else "full"
    out = [f"ppoforge doctor ({mode}): device {report.device}, precision {report.precision}, "
           f"{report.seconds:.1f} s", "", f"{'check':<{name_w}}  status evidence"]
    for r in report.results:
        body = _wrap(r.evidence, width, indent)
        out.append(f"{r.name:<{name_w}}  {r.status:<4}   {body[0]}")
        out.extend(body[1:])
        if r.fix and r.status in (WARN, FAIL):
            fix = _wrap(f"fix: {r.fix}", width, indent)
            out.append(" " * indent + fix[0])
            out.extend(fix[1:])
    label_w = max(len(v.label) for v in report.verdicts) + 2
    out += ["", "verdicts (* = required for exit code 0):"]
    for v in report.verdicts:
        mark = "*" if v.required else " "
        reason = _wrap(v.reason, width, label_w + 16)
        out.append(f"{mark} {v.label + ' ':.<{label_w}} {v.answer:<11}  {reason[0]}")
        out.extend(reason[1:])
    out.append(f"exit code {report.exit_code}")
    return "\n".join(out)
