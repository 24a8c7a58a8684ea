"""The shared fault mechanisms on their own: guard, run guard, timeouts, OOM halving, run dirs, trust."""

import errno
import json
import math
import os
import signal
import threading
import time

import pytest
import torch

from ppoforge.errors import EXIT_FAULT, EXIT_USER, Fault, UserError, classify
from ppoforge.runtime import allocator, rundir, trust
from ppoforge.runtime.oom import halve, is_oom
from ppoforge.runtime.resilience import NonFiniteGuard, Rollback, RunGuard, nbytes
from ppoforge.runtime.signals import StopFlag
from ppoforge.runtime.timeouts import CallTimeout, StopRequested, call_with_timeout

# ---- non-finite guard ---------------------------------------------------------------------------


def test_guard_skips_non_finite_steps_and_stops_after_patience():
    guard = NonFiniteGuard(patience=3, action="stop")
    assert guard.step_ok(torch.tensor(0.5), torch.tensor(2.0))
    assert not guard.step_ok(torch.tensor(math.nan), torch.tensor(1.0))
    assert not guard.step_ok(0.1, math.inf)
    assert guard.step_ok(0.1, 0.3)  # a good step resets the streak
    assert not guard.step_ok(math.nan, 0.0) and not guard.step_ok(math.nan, 0.0)
    with pytest.raises(Fault, match=r"^non-finite loss, 3 times in a row \(nonfinite_patience\): stopped"):
        guard.step_ok(math.nan, 0.0)
    assert guard.counts["guard/skipped_steps"] == 5


def test_guard_lets_a_grad_scaler_handle_infinite_gradients():
    guard = NonFiniteGuard(patience=1, action="stop")
    assert guard.step_ok(0.5, math.inf, scaled=True)  # fp16: the scaler skips the step and lowers its scale


def test_guard_rollback_and_rewards():
    guard = NonFiniteGuard(patience=2, action="rollback")
    ok, rewards = guard.rewards_ok(torch.tensor([1.0, 250.0, -300.0]), clip=100.0)
    assert ok and rewards.tolist() == [1.0, 100.0, -100.0] and guard.counts["guard/rewards_clipped"] == 2
    ok, _ = guard.rewards_ok(torch.tensor([1.0, math.nan]), clip=100.0)
    assert not ok and guard.counts["guard/nonfinite_rewards"] == 1 and guard.counts["guard/skipped_updates"] == 1
    with pytest.raises(Rollback, match=r"^non-finite rewards \(1 of 1\), 2 times in a row \(nonfinite_patience\)$"):
        guard.rewards_ok(torch.tensor([math.inf]), clip=None)
    assert guard.counts["guard/rollbacks"] == 0  # counted by train_loop when it rolls back


def test_train_loop_rolls_back_at_most_max_rollbacks_times_then_stops(tmp_path, capsys):
    """A guard that gives up at every update (a collapse that a lower learning rate does not cure): the
    loop rolls back max_rollbacks times, a line and a count each, then stops with the checkpoint it kept."""
    from types import SimpleNamespace

    from ppoforge.runtime.resilience import train_loop

    class Sick(_Trainer):
        cfg, lr_scale, rollbacks = SimpleNamespace(max_rollbacks=2), 1.0, 0
        guard = NonFiniteGuard(patience=1, action="rollback")

        def train_one_update(self):
            raise Rollback("the policy degenerated")

        def rollback(self):
            assert self.rollbacks < 10, "rolls back forever"
            self.rollbacks, self.lr_scale = self.rollbacks + 1, self.lr_scale * 0.5

    trainer = Sick()
    guard = RunGuard(trainer, tmp_path / "ckpt.pt", "ppoforge train x --resume RUN")
    guard.save()
    with pytest.raises(Fault) as e:
        train_loop(trainer, guard, total=10, checkpoint_every=1, after_update=print)
    assert trainer.rollbacks == 2 and trainer.guard.counts["guard/rollbacks"] == 2
    assert classify(e.value)[1] == (
        "the policy degenerated: stopped after 2 rollbacks (max_rollbacks: 2; the learning rate at x0.25); allowed: "
        "a smaller learning_rate, a finite reward, or a larger max_rollbacks; checkpoint at update 0: continue with "
        "ppoforge train x --resume RUN")
    assert capsys.readouterr().err.splitlines() == [
        "ppoforge: the policy degenerated: rollback 1 of 2 (max_rollbacks) to update 0, the learning rate now x0.5",
        "ppoforge: the policy degenerated: rollback 2 of 2 (max_rollbacks) to update 0, the learning rate now x0.25"]


# ---- run guard ------------------------------------------------------------------------------------


class _Trainer:
    """The surface RunGuard needs: a weight, an RNG-like counter, the update count and `optimizing`."""

    def __init__(self, weight_numel=4):
        self.w, self.draws, self.update, self.optimizing = torch.zeros(weight_numel), 0, 0, False

    def state_dict(self):
        return {"w": self.w.clone(), **self.step_state()}

    def step_state(self):
        return {"draws": self.draws, "update": self.update}

    def train_one_update(self, fail_at=None, phase="rollout"):
        self.draws += 1  # sampling moved the RNG
        if phase == "optimize":
            self.optimizing = True
            self.w += 1
        if self.update + 1 == fail_at:
            raise ValueError("boom")
        self.w += 1 if phase == "rollout" else 0
        self.update += 1


@pytest.mark.parametrize("phase", ["rollout", "optimize"])
@pytest.mark.parametrize("small", [True, False])
def test_a_failing_update_leaves_the_last_completed_one_on_disk(tmp_path, phase, small, monkeypatch):
    from ppoforge.runtime import resilience

    if not small:
        monkeypatch.setattr(resilience, "SNAPSHOT_LIMIT", 8)  # too big to copy: only the step state is kept
    trainer = _Trainer()
    guard = RunGuard(trainer, tmp_path / "ckpt.pt", "ppoforge train x --resume RUN")
    assert guard.full == small
    for _ in range(2):
        with guard.update():
            trainer.train_one_update(phase=phase)
    guard.save()
    with guard.update():
        trainer.train_one_update(phase=phase)  # update 3 completes but is not saved
    with pytest.raises(ValueError) as e, guard.update():
        trainer.train_one_update(fail_at=4, phase=phase)
    line = classify(e.value)[1]
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    if small or phase == "rollout":  # the state as update 4 started: update 3, its RNG position
        assert saved["update"] == 3 and saved["draws"] == 3 and saved["w"].tolist() == [3.0] * 4
        assert line.endswith("; checkpoint at update 3: continue with ppoforge train x --resume RUN")
    else:  # a large state the optimizer already moved: the periodic checkpoint of update 2 stays
        assert saved["update"] == 2
        assert line.endswith("; checkpoint at update 2: continue with ppoforge train x --resume RUN")
    assert line.startswith("internal error ValueError: boom")


def test_a_failure_in_the_first_update_says_nothing_was_saved_when_the_disk_fails(tmp_path, monkeypatch):
    from ppoforge.runtime import resilience

    trainer = _Trainer()
    guard = RunGuard(trainer, tmp_path / "ckpt.pt", "hint")

    def full_disk(path, state):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(resilience, "save_checkpoint", full_disk)
    with pytest.raises(ValueError) as e, guard.update():
        trainer.train_one_update(fail_at=1)
    assert classify(e.value)[1].endswith("; no checkpoint was written yet")


def test_user_errors_stay_user_errors_through_the_guard(tmp_path):
    trainer = _Trainer()
    with pytest.raises(UserError) as e, RunGuard(trainer, tmp_path / "c.pt", "hint").update():
        raise UserError("reward x raised ValueError: bad")
    assert classify(e.value) == (EXIT_USER, "reward x raised ValueError: bad; checkpoint at update 0: continue with "
                                            "hint")


def test_nbytes():
    assert nbytes({"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.float64), 7]}) == 12 + 16


# ---- timeouts and signals -------------------------------------------------------------------------


def test_a_call_past_its_limit_raises_and_a_quick_one_returns():
    assert call_with_timeout(lambda: 7, 5.0, "reward r") == 7
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"^reward r did not return within 0.3 s \(call_timeout\)"):
        call_with_timeout(lambda: time.sleep(30), 0.3, "reward r")
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timer is off again


def test_sigterm_inside_a_hung_call_unwinds_it_at_once():
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    with StopFlag() as stop, pytest.raises(StopRequested):
        call_with_timeout(lambda: time.sleep(60), 600.0, "reward r")
    assert stop.signal_name == "SIGTERM" and time.monotonic() - start < 5


def test_sigterm_outside_a_call_only_sets_the_flag():
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.signal_name == "SIGTERM"


# ---- OOM ----------------------------------------------------------------------------------------


def test_oom_is_recognised_and_halved():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
    assert halve(8, "micro-batch", RuntimeError("x")) == 4
    with pytest.raises(Fault, match=r"^out of memory with micro-batch 1") as fault:
        halve(1, "micro-batch", RuntimeError("x"))
    assert ("PPOFORGE_MALLOC_TUNING=0" in str(fault.value)) == allocator.tuned()


def test_at_the_last_size_the_oom_line_names_the_malloc_tuning_only_where_it_is_in_effect(monkeypatch):
    for tuned in (True, False):
        monkeypatch.setattr(allocator, "_applied", tuned)
        with pytest.raises(Fault) as fault:
            halve(1, "generation batch", RuntimeError("DefaultCPUAllocator: can't allocate memory"))
        assert ("PPOFORGE_MALLOC_TUNING=0" in str(fault.value)) == tuned


# ---- errors ----------------------------------------------------------------------------------------


def test_classify():
    assert classify(UserError("x")) == (EXIT_USER, "x")
    assert classify(Fault("y")) == (EXIT_FAULT, "y")
    code, line = classify(OSError(errno.ENOSPC, "No space left on device", "/runs/a/checkpoint.pt"))
    assert code == EXIT_FAULT and line.startswith("no space left writing /runs/a/checkpoint.pt")
    code, line = classify(PermissionError(errno.EACCES, "Permission denied", "/runs"))
    assert code == EXIT_USER and "allowed: a path this user can read and write" in line
    code, line = classify(OSError(errno.EROFS, "Read-only file system", "/runs/a/metrics.jsonl"))
    assert code == EXIT_USER and "/runs/a/metrics.jsonl" in line and "\n" not in line
    code, line = classify(KeyError("k"))
    assert code == EXIT_FAULT and line.startswith("internal error KeyError") and "--debug" in line


# ---- run dirs and trust ---------------------------------------------------------------------------


def test_a_used_run_dir_is_refused_unless_overwrite(tmp_path):
    rundir.prepare_new_run_dir(tmp_path / "fresh", overwrite=False)  # missing or empty: fine
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"x")
    (tmp_path / "run" / "tb").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"already holds a run \(checkpoint.pt, tb\); allowed: --resume"):
        rundir.prepare_new_run_dir(tmp_path / "run", overwrite=False)
    rundir.prepare_new_run_dir(tmp_path / "run", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]  # only what runs write


def test_atomic_write_cleans_temps_of_an_interrupted_write(tmp_path):
    target = tmp_path / "checkpoint.pt"
    stale = tmp_path / ".checkpoint.pt.abc123.tmp"
    stale.write_bytes(b"half of a checkpoint")
    rundir.atomic_write_text(target, "new")
    assert target.read_text() == "new" and not stale.exists()


def test_code_fingerprints_gate_a_resume(tmp_path, monkeypatch):
    from dataclasses import dataclass

    monkeypatch.chdir(tmp_path)
    (tmp_path / "myreward.py").write_text("def fn(p, c, **k):\n    return [0.0] * len(c)\n")

    @dataclass
    class Cfg:
        reward: str = "vader, py:myreward:fn"
        other: str = "plain"

    cfg = Cfg()
    assert trust.code_items(cfg) == ["myreward"]
    trust.record(tmp_path, cfg)
    recorded = json.loads((tmp_path / "code.json").read_text())
    assert recorded["myreward"]["file"].endswith("myreward.py") and len(recorded["myreward"]["sha256"]) == 64
    trust.check_resume(tmp_path, cfg, trusted=False)  # unchanged: fine
    (tmp_path / "myreward.py").write_text("import os\ndef fn(p, c, **k):\n    return [1.0] * len(c)\n")
    with pytest.raises(UserError, match=r"imports py:myreward .*when the run started: sha256 .*--trust-run-dir"):
        trust.check_resume(tmp_path, cfg, trusted=False)
    trust.check_resume(tmp_path, cfg, trusted=True)
    assert trust.code_items(Cfg(reward="vader")) == []
    assert trust.module_file("no.such.module") is None


def test_the_collapse_guard_names_each_sign_against_the_first_update():
    from ppoforge.runtime.resilience import CollapseGuard

    guard = CollapseGuard(patience=3, action="stop")
    assert guard.signs(entropy=1.0, clipped=0.1, reward=0.5, low=0.0, high=1.0) == []  # update 1: the baseline
    assert guard.signs(2.0, 0.1, 0.5, 0.0, 1.0) == []  # 2x is the limit, not over it
    assert guard.signs(2.5, 0.95, 0.0, 0.0, 0.0, [0.0] * 10) == [
        "entropy 2.50 nats/token, 2.5x update 1's", "95% of completions hit max_new_tokens (update 1: 10%)",
        "every score 0 for 10 prompts in a row, below the run's best mean 0.5"]  # both earlier prompts scored 1
    # a policy that never learned EOS (update 1 already at the budget) and a constant reward are not collapse
    never = CollapseGuard(3, "stop")
    assert [never.signs(1.0, 1.0, 0.0, 0.0, 0.0) for _ in range(5)] == [[]] * 5
    # nor a sparse 0/1 reward whose best mean is a few successes: 0.2 < 25 % of the range 1
    sparse = CollapseGuard(3, "stop")
    assert [sparse.signs(1.0, 0.1, r, 0.0, 1.0 if r else 0.0) for r in (0.1, 0.2, 0.0, 0.0)] == [[]] * 4
    # nor a reward that pays for length, maximized: every completion at the budget while the mean score is
    # the run's best (issue 37: `--reward length` stopped as a collapse); below the best it is a sign again
    longer = CollapseGuard(3, "stop")
    assert [longer.signs(1.0, c, r, 0.0, r) for c, r in ((0.1, 0.2), (0.6, 0.6), (1.0, 1.0), (1.0, 1.0))] == [[]] * 4
    assert longer.signs(1.0, 1.0, 0.5, 0.0, 1.0) == ["100% of completions hit max_new_tokens (update 1: 10%)"]


def test_the_collapse_guards_flat_reward_needs_more_prompts_in_a_row_than_chance_gives():
    """A policy right on 35 % of the answers, 4 prompts a rollout, answering each prompt's completions
    alike: a rollout all wrong is 0.65 ** 4 = 18 % likely, so 4 in a row (16 prompts, 0.65 ** 16 =
    1.02e-3) are no sign yet, the 5th (20 prompts) is. A run that was right 90 % of the time and drops to
    a flat 0 is named at once."""
    from ppoforge.runtime.resilience import CollapseGuard

    def flat_signs(right, rollouts):
        guard = CollapseGuard(3, "stop")
        for i in range(20):  # healthy rollouts: `right` of every 20 prompts answered (best score 1)
            bests = [float((4 * i + j) % 20 < right) for j in range(4)]
            guard.signs(1.0, 0.0, right / 20, 0.0, 1.0, bests)
        return [guard.signs(1.0, 0.0, 0.0, 0.0, 0.0, [0.0] * 4) != [] for _ in range(rollouts)]

    assert flat_signs(7, 6) == [False] * 4 + [True] * 2  # 35 %
    assert flat_signs(18, 2) == [True, True]  # 90 %
    guard = CollapseGuard(3, "stop")
    guard.signs(1.0, 0.0, 0.9, 0.0, 1.0, [1.0, 1.0, 1.0, 0.0])
    guard.signs(1.0, 0.0, 0.0, 0.0, 0.0, [0.0] * 4)
    guard.signs(1.0, 0.0, 0.5, 0.0, 1.0, [1.0, 0.0, 1.0, 0.0])  # a rollout with a right answer ends the streak
    assert guard.flat_prompts == 0 and len(guard.bests) == 12  # the streak's flat prompts now in the record
    restored = CollapseGuard(3, "stop")
    restored.load_state_dict(guard.state_dict())
    assert vars(restored) == vars(guard)


def test_a_sparse_reward_whose_rollouts_are_often_flat_is_no_collapse():
    """Issue 37: the tiny preset's VADER reward on a tiny model's text is sparse — most completions score 0,
    1 prompt in 8 a small positive score, one rollout in 8 all 0. The chance test took the run's mean score
    scaled to its range as p (0.26 here, flat rollouts left out) and named 2 flat rollouts in a row (a 1-in-64
    event) as a collapse. p is the share of earlier prompts, flat ones included, that scored above the flat
    score (0.11): 3 flat rollouts in a row pass, 4 (a 1-in-4096 event at this run's rate) are named."""
    from ppoforge.runtime.resilience import CollapseGuard

    def run(flat_in_a_row):
        guard = CollapseGuard(3, "stop")
        guard.signs(1.0, 0.0, 0.3, -0.2, 0.8, [0.8, 0.6, 0.5, 0.5, 0.4, 0.3, 0.3, 0.2] + [0.0] * 7 + [-0.2])
        for i in range(40):  # 7 rollouts with 2 prompts of 16 above 0, then one all 0
            bests = [0.0] * 16 if i % 8 == 3 else [0.5, 0.3] + [0.0] * 14
            guard.signs(1.0, 0.0, sum(bests) / 16, min(bests), max(bests), bests)
        return [guard.signs(1.0, 0.0, 0.0, 0.0, 0.0, [0.0] * 16) != [] for _ in range(flat_in_a_row)]

    assert run(4) == [False, False, False, True]


def test_a_policy_that_answers_each_prompt_one_way_is_named_after_more_groups_than_chance_gives():
    """Issue 36's true/false task: after a few updates every prompt's 8 completions agree — right on some
    prompts, wrong on others (the scores differ, no group's do), so no group has a signal and the run learns
    nothing more. Where 3 of 4 earlier groups split, 4 one-way groups in a row are 1 in 256 (no sign), 8 are
    named. A run whose groups split less often (a confident policy, 1 group in 4) needs more; a policy right
    on every prompt (every score at the best) is done, not stuck; without groups (PPO, G = 1) no sign."""
    from ppoforge.runtime.resilience import CollapseGuard

    def one_way(split, rollouts, bests=(1.0, 0.0, 1.0, 0.0)):
        guard = CollapseGuard(3, "stop")
        for i in range(8):  # healthy rollouts: 4 prompts, the groups `split(k)` says split (scores 0 and 1)
            worsts = [0.0 if split(4 * i + j) else 1.0 for j in range(4)]
            guard.signs(0.2, 0.0, 0.5, 0.0, 1.0, [1.0] * 4, worsts)
        return [guard.signs(0.01, 0.0, sum(bests) / 4, min(bests), max(bests), list(bests), list(bests))
                for _ in range(rollouts)], guard

    signs, guard = one_way(lambda k: k % 4 != 0, 3)  # q = 3/4: (1/4) ** 4 = 3.9e-3, (1/4) ** 8 = 1.5e-5
    assert signs == [[]] + [[f"every prompt's completions scored alike for {n} prompts in a row (earlier in the "
                             "run: 25% of prompts'), right on some and wrong on others: no group has a learning "
                             "signal"] for n in (8, 12)]
    assert guard.one_way_groups == 12
    restored = CollapseGuard(3, "stop")
    restored.load_state_dict(guard.state_dict())
    assert vars(restored) == vars(guard)
    guard.signs(0.2, 0.0, 0.5, 0.0, 1.0, [1.0] * 4, [0.0, 1.0, 1.0, 1.0])  # a group split: the streak ends
    assert guard.one_way_groups == 0 and guard.splits[-16:-4] == [False] * 12
    rare, _ = one_way(lambda k: k % 4 == 0, 7)  # q = 1/4: (3/4) ** 24 = 1.004e-3, (3/4) ** 28 = 3.2e-4
    assert [s != [] for s in rare] == [False] * 6 + [True]
    solved, _ = one_way(lambda k: k % 4 != 0, 5, bests=(1.0,) * 4)
    assert solved == [[]] * 5
    no_groups = CollapseGuard(3, "stop")
    assert [no_groups.signs(0.2, 0.0, 0.5, 0.0, 1.0, [1.0, 0.0]) for _ in range(20)] == [[]] * 20


def test_the_collapse_guard_acts_after_patience_updates_in_a_row_and_resets_on_a_good_one():
    from ppoforge.errors import Fault
    from ppoforge.runtime.resilience import CollapseGuard

    guard = CollapseGuard(patience=2, action="stop")
    guard.check(1, 1.0, 0.0, 1.0, 0.0, 2.0)
    guard.check(2, 3.0, 0.0, 1.0, 0.0, 2.0)  # a sign: streak 1
    guard.check(3, 1.0, 0.0, 1.0, 0.0, 2.0)  # none: streak 0
    assert guard.streak == 0
    state = guard.state_dict()
    guard.check(4, 3.0, 0.0, 1.0, 0.0, 2.0)
    with pytest.raises(Fault, match=r"^the policy degenerated for 2 updates in a row \(update 5: entropy 3.00"):
        guard.check(5, 3.0, 0.0, 1.0, 0.0, 2.0)
    back = CollapseGuard(2, "rollback")
    back.load_state_dict(state)
    back.check(4, 3.0, 0.0, 1.0, 0.0, 2.0)
    with pytest.raises(Rollback):
        back.check(5, 3.0, 0.0, 1.0, 0.0, 2.0)
    off = CollapseGuard(0, "stop")
    for update in range(1, 6):
        off.check(update, 1.0 if update == 1 else 9.0, 0.0, 1.0, 0.0, 2.0)
    assert off.streak == 4  # counted, never acted on
