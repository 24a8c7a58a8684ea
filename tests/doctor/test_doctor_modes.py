"""The quick and the full doctor agree (issue 39): one verdict function for both, so for every capability the
quick verdict is the full one or "not checked (run the full doctor)" — never "yes" where the full one says NO —
and every check both modes run gives the same status. hf_cache calls the hub online only after a real request
answered (a local HTTP server, and a closed local port: no network)."""

import http.server
import socket
import threading

import pytest

from ppoforge.doctor import runner, storage
from ppoforge.doctor.report import CAPABILITY_KEYS, NOT_CHECKED, fail, ok
from ppoforge.doctor.runner import SLOW, Options, run_doctor


@pytest.fixture
def slow_checks_stubbed(monkeypatch):
    """The slow checks (process groups, training runs) replaced by fixed answers, some failing, so the full
    doctor runs in seconds and its verdicts include NO where the quick one skipped the deciding check."""
    monkeypatch.setattr(runner.distributed, "check_allreduce", lambda *a, **k: ok("allreduce", "2 ranks agreed"))
    monkeypatch.setattr(runner.distributed, "check_fsdp", lambda *a, **k: fail("fsdp", "sharded step hung", "fix"))
    monkeypatch.setattr(runner.smoke, "check_control_smoke", lambda *a, **k: fail("control_smoke", "NaN", "fix"))
    monkeypatch.setattr(runner.smoke, "check_lm_smoke", lambda *a, **k: ok("lm_smoke", "2 updates"))
    monkeypatch.setattr(runner.templates, "check_chat_template", lambda *a, **k: ok("chat_template", "rendered"))


def test_quick_never_says_yes_where_the_full_doctor_says_no(slow_checks_stubbed, monkeypatch, tmp_path):
    monkeypatch.setattr(runner.system, "gather_cpu", lambda measure: runner.system.gather_cpu(False))  # no matmul
    opts = dict(device="cpu", require=CAPABILITY_KEYS, runs_root=str(tmp_path / "runs"))
    quick, full = run_doctor(Options(quick=True, **opts)), run_doctor(Options(quick=False, **opts))
    quick_v, full_v = ({v.key: v for v in r.verdicts} for r in (quick, full))
    assert quick_v.keys() == full_v.keys() == set(CAPABILITY_KEYS)
    for key in CAPABILITY_KEYS:
        q, f = quick_v[key], full_v[key]
        assert q.holds is f.holds or (q.holds is None and q.reason.startswith(NOT_CHECKED)), (key, q, f)
        assert f.holds is not None, (key, f)  # the full doctor decides every capability
    # the cases issue 39 saw: multi-node and FSDP2 said "yes (not exercised)" in quick, NO in full
    assert full_v["multinode"].holds is False and quick_v["multinode"].holds is None
    assert full_v["fsdp"].holds is False and quick_v["fsdp"].holds is None
    assert full_v["control"].holds is False and quick_v["control"].holds is None
    line = next(line for line in runner.render_text(quick, width=400).splitlines() if "multi-node" in line)
    assert line.endswith(" not checked  run the full doctor: allreduce, rendezvous skipped by --quick"), line
    # every check both modes run: one function, one status
    q_rows, f_rows = ({r.name: r for r in rep.results} for rep in (quick, full))
    for name in q_rows.keys() - set(SLOW):
        assert q_rows[name].status == f_rows[name].status, (name, q_rows[name], f_rows[name])
    assert all(q_rows[name].status == "skip" for name in SLOW)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: a connection there is refused


def test_hf_cache_is_offline_when_the_hub_endpoint_does_not_answer(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    reachable, seen = storage.hub_reachability(env, timeout=2.0)
    assert not reachable and env["HF_ENDPOINT"] in seen and "did not answer" in seen
    result = storage.check_hf_cache(storage.gather_dir("/tmp", None), True, env, (reachable, seen))
    assert "offline (" in result.evidence and "online" not in result.evidence
    assert storage.hub_reachability({"HF_HUB_OFFLINE": "1"}) == (False, "HF_HUB_OFFLINE=1, not asked")


def test_hf_cache_is_online_only_after_the_endpoint_answered():
    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        assert storage.hub_reachability({"HF_ENDPOINT": endpoint}) == (True, f"{endpoint} answered HTTP 200")
    finally:
        server.shutdown()
        server.server_close()
