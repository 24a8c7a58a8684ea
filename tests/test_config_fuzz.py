"""Property: any text for any config field is either a valid config or one `UserError` line — never a
traceback, never a NaN that slips through. Both trainers' configs, the CLI's path (strings) and YAML's
(typed scalars: floats, ints, bools, None)."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppoforge.config import build_config
from ppoforge.control.config import ControlConfig
from ppoforge.errors import UserError
from ppoforge.lm.rl.config import RLHFConfig

CONFIGS = {"control": ControlConfig, "rlhf": RLHFConfig}
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["nan", "-inf", "1e400", "0", "-1", "1e-320", "true",
                                                        "none", "2**64", "0x10", "  3 ", "1_000", "", "∞"]))
YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                         TEXT, st.lists(st.integers(), max_size=2))


def _check(cls, name, value):
    try:
        cfg = build_config(cls, {name: value})
    except UserError as e:
        text = str(e)
        assert text and "\n" not in text and len(text) < 2000
        return
    for f in dataclasses.fields(cls):  # a config that was built holds only finite numbers in range
        v = getattr(cfg, f.name)
        if isinstance(v, float):
            assert math.isfinite(v), f.name


@pytest.mark.parametrize("domain", sorted(CONFIGS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_for_any_field_is_a_config_or_one_line(domain, data):
    cls = CONFIGS[domain]
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    _check(cls, name, data.draw(YAML_SCALARS))


def test_every_numeric_field_is_bounded_above():
    """Sizes and coefficients all have an upper bound, so a value no machine holds is refused up front."""
    import typing

    from ppoforge.config import base_type

    for cls in CONFIGS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, _ = base_type(hints[f.name])
            if kind in (int, float):
                assert f.metadata["hi"] is not None or f.metadata["choices"], f"{cls.__name__}.{f.name}"
