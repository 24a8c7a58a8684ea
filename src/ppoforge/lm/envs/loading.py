"""Environment specs -> factories of fresh, checked environments (the forms: lm/envs/protocol.py).

`py:` and `trl:` classes are imported through runtime/usercode.py (the user-code boundary, under
`call_timeout`); `textarena:` games and the built-ins come from lm/envs/adapters.py and lm/envs/builtin.py.
"""

from __future__ import annotations

from collections.abc import Callable

from ppoforge.errors import UserError
from ppoforge.lm.envs import adapters, builtin
from ppoforge.lm.envs.protocol import ALLOWED_SPECS, Checked
from ppoforge.runtime.usercode import call_user, load_python


def load_env(spec: str, timeout: float | None = None) -> Callable[[], Checked]:
    """A factory of fresh, checked environments for `spec` (see the module docstring for the forms); the
    import of a py:/trl: module and every call into an environment run under `timeout` seconds."""
    kind, sep, arg = spec.partition(":")
    if sep and kind in ("py", "trl") and arg:
        cls = load_python(arg, what="environment", noun="Class", prefix=kind, timeout=timeout)
        make = cls if kind == "py" else (lambda: adapters.TRLEnvironment(cls()))
    elif sep and kind == "textarena" and arg:
        adapters.textarena_check(arg)
        make = lambda: adapters.TextArenaEnvironment(arg)  # noqa: E731 - one line reads better
    elif spec and (not sep or "?" in kind):
        make = builtin.builtin(spec)
    else:
        raise UserError(f"environment: {spec!r} is not an environment spec; allowed: {ALLOWED_SPECS}")

    def fresh() -> Checked:
        return Checked(call_user(make, f"environment {spec}: creating it", timeout), spec, timeout)

    return fresh
