"""The doctor's `memory` check: the memory plan's verdict for a named model on the device checked (only the
model's config.json is read: the test writes one)."""

import pytest
from transformers import Qwen2Config

from ppoforge.doctor.memory import check_memory


@pytest.fixture
def config_dir(tmp_path):
    Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=256, vocab_size=1000, max_position_embeddings=512).save_pretrained(tmp_path)
    return str(tmp_path)


def test_without_a_model_it_is_skipped():
    assert check_memory(None, "auto", 0).status == "skip"


def test_a_model_that_fits_is_ok_with_its_peak(config_dir):
    result = check_memory(config_dir, "cpu", 0)
    assert result.status == "ok" and "peak" in result.evidence and "cpu" in result.evidence


def test_a_model_that_does_not_fit_names_what_to_do(config_dir):
    result = check_memory(config_dir, "cuda:0.0001GB", 0)
    assert result.status in ("warn", "fail") and result.fix, result
