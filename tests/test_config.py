"""Config building: coercion, ranges, choices, unknown keys, presets — all one-line UserErrors."""

import dataclasses
import typing

import pytest

from ppoforge.config import build_config, read_preset
from ppoforge.control.config import ControlConfig
from ppoforge.errors import UserError
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig


def test_strings_from_the_cli_are_coerced():
    cfg = build_config(ControlConfig, {"total_steps": "2e5", "anneal_lr": "false", "target_kl": "0.02",
                                       "learning_rate": "1e-3"})
    assert cfg.total_steps == 200_000 and cfg.anneal_lr is False and cfg.target_kl == 0.02
    assert build_config(ControlConfig, {"target_kl": "none"}).target_kl is None


@pytest.mark.parametrize("values, message", [
    ({"totl_steps": 5}, "unknown config key 'totl_steps'"),
    ({"total_steps": "lots"}, "total_steps: 'lots' is not an integer"),
    ({"total_steps": 1.5}, "total_steps: 1.5 is not an integer"),
    ({"gamma": 1.5}, "gamma: 1.5 is out of range; allowed: <= 1.0"),
    ({"learning_rate": 0}, "learning_rate: 0.0 is out of range; allowed: > 0"),
    ({"precision": "fp8"}, "precision: 'fp8' is not allowed; allowed: auto, fp32, bf16, fp16"),
    ({"anneal_lr": "maybe"}, "anneal_lr: 'maybe' is not a boolean"),
    ({"num_minibatches": 1000, "num_envs": 1, "num_steps": 8, "total_steps": 8}, "num_minibatches: 1000 exceeds"),
    ({"device": "tpu"}, "device: 'tpu' is not allowed"),
])
def test_bad_values_name_the_field_and_what_is_allowed(values, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(ControlConfig, values)


@pytest.mark.parametrize("cls", [ControlConfig, RLHFConfig, SFTConfig, RewardConfig], ids=lambda c: c.__name__)
def test_every_value_of_the_wrong_type_is_one_line_with_what_the_field_allows(cls):
    """`--clip-high abc` said "is not a number" and stopped there: every coercion error now ends in what the
    field takes (its type, bounds, choices, and none where it is optional)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        with pytest.raises(UserError) as e:
            build_config(cls, {f.name: ["a", "list"] if hints[f.name] in (str, str | None) else "abc"})
        text = str(e.value)
        assert text.startswith(f"{f.name}: ") and "; allowed: " in text and "\n" not in text, text
    if cls is RLHFConfig:
        with pytest.raises(UserError, match=r"^clip_high: 'abc' is not a number; allowed: a finite number > 0 and "
                                            r"<= 100\.0, or none$"):
            build_config(cls, {"clip_high": "abc"})


def test_integers_of_hundreds_of_digits_are_one_short_line(tmp_path):
    """A 400-digit total_steps was printed whole (from the CLI, as 'is not an integer': float() made it inf); one of
    5000 digits in YAML was an internal error (PyYAML's int() refuses more than 4300 digits)."""
    for value in (10**400, "9" * 400):
        with pytest.raises(UserError, match=r"^total_steps: an integer of (401|400) digits is out of range; allowed: "
                                            r"an integer >= 1 and <= "):
            build_config(ControlConfig, {"total_steps": value})
    preset = tmp_path / "p.yaml"
    preset.write_text("total_steps: " + "9" * 5000 + "\n")
    with pytest.raises(UserError, match=r"^preset: .*p\.yaml is not valid YAML \(Exceeds the limit \(4300 digits\)"):
        read_preset(str(preset), "control")


def test_derived_values_are_computed_once():
    cfg = build_config(ControlConfig, {"num_envs": 8, "num_steps": 16, "total_steps": 1000})
    assert cfg.batch_size == 128 and cfg.num_updates == 7


def test_presets_builtin_and_file(tmp_path):
    assert read_preset("cartpole", "control")["env_id"] == "CartPole-v1"
    with pytest.raises(UserError, match="no built-in preset 'cartpol'; allowed: acrobot, cartpole"):
        read_preset("cartpol", "control")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env_id: [unclosed")
    with pytest.raises(UserError, match="not valid YAML"):
        read_preset(str(bad), "control")
    with pytest.raises(UserError, match="cannot read"):
        read_preset(str(tmp_path / "missing.yaml"), "control")
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must be a mapping"):
        read_preset(str(listy), "control")
