"""The user-code boundary (runtime/usercode.py): what user code raises is its failure, signals are not."""

import os
import signal
import sys
import threading

import pytest

from ppoforge.errors import Fault, UserError
from ppoforge.runtime.signals import Interrupted, StopFlag
from ppoforge.runtime.timeouts import CallTimeout, StopRequested
from ppoforge.runtime.usercode import call_user


def _raise(e):
    def fn():
        raise e
    return fn


@pytest.mark.parametrize(("raised", "line"), [
    (ValueError("boom\nmore"), "reward r raised ValueError: boom"),
    (SystemExit(0), "reward r raised SystemExit: 0; allowed: return a result, or raise an Exception to fail"),
    (SystemExit(), "reward r raised SystemExit; allowed: return a result"),
    (SystemExit("bye"), "reward r raised SystemExit: bye; allowed"),
])
def test_what_user_code_raises_is_one_line_naming_it(raised, line):
    with pytest.raises(UserError) as e:
        call_user(_raise(raised), "reward r")
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_our_errors_and_signals_pass_unchanged():
    for ours in (UserError("nested"), Fault("disk"), CallTimeout("late"), StopRequested("SIGTERM"), Interrupted()):
        with pytest.raises(type(ours)) as e:
            call_user(_raise(ours), "reward r")
        assert e.value is ours


def test_a_keyboard_interrupt_is_the_codes_failure_only_while_a_stop_flag_handles_sigint():
    # Python's default SIGINT handler: it may be the user's Ctrl-C, so it stays an interrupt. Installed
    # here: a process started in the background by a non-interactive shell inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            call_user(_raise(KeyboardInterrupt()), "reward r")
        assert type(e.value) is KeyboardInterrupt
        with StopFlag(), pytest.raises(UserError, match="^reward r raised KeyboardInterrupt; allowed: return a"):
            call_user(_raise(KeyboardInterrupt()), "reward r")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_real_ctrl_c_inside_a_user_call_still_stops_gracefully():
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with StopFlag() as stop, pytest.raises(StopRequested):
        call_user(lambda: threading.Event().wait(30), "environment e: step", 60)
    timer.join()
    assert stop.signal_name == "SIGINT"


def test_the_second_signal_interrupts_at_once():
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # outside a user call: only the flag
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            sys.stdout.flush()  # the handler runs at the next bytecode
    assert stop.signal_name == "SIGTERM"
