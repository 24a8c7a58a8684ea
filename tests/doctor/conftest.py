"""The doctor's tests never ask the network: hf_cache's hub request is switched off (HF_HUB_OFFLINE) unless a
test points HF_ENDPOINT at a local port itself."""

import pytest


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
