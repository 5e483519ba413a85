"""Starts wait on readiness while the process makes progress (testbed.startup_wait): a slow start on a
busy machine is waited for past any fixed budget, a hung one (alive, silent) fails once it has been
silent for the stall limit, a dead one at once, and every failure names what was awaited and why."""

from __future__ import annotations

import sys

import pytest

from testbed import startup_wait
from testbed.startup_wait import StartupFailed, wait_until_ready
from triton_sampling_mask.ops.child import Child


class Clock:
    """A clock that each sleep advances: a machine as slow as the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeChild:
    def __init__(self, name: str = "server", exits_at: float | None = None, clock: Clock | None = None):
        self.name, self.exits_at, self.clock = name, exits_at, clock
        self.process = type("Process", (), {"returncode": None})()

    def running(self) -> bool:
        if self.exits_at is not None and self.clock() >= self.exits_at:
            self.process.returncode = 1
            return False
        return True


def waiting(monkeypatch, clock: Clock, progress_until: float, ready_at: float, children, **limits):
    """wait_until_ready on the fake clock: the children's work grows until `progress_until`."""
    monkeypatch.setattr(startup_wait, "work_done", lambda child: (min(clock(), progress_until), 0))
    return wait_until_ready(
        "the server", lambda: clock() >= ready_at, children, clock=clock, sleep=clock.sleep, **limits
    )


def test_a_start_that_keeps_working_is_waited_for_past_any_fixed_budget(monkeypatch):
    clock = Clock()
    waited = waiting(monkeypatch, clock, progress_until=10_000, ready_at=600, children=[FakeChild()], poll_s=1)
    assert waited >= 600  # three times the former fixed 180 s


def test_a_start_that_stops_working_fails_after_the_stall_limit_naming_it(monkeypatch):
    clock = Clock()
    with pytest.raises(StartupFailed) as failed:
        waiting(monkeypatch, clock, progress_until=50, ready_at=10_000, children=[FakeChild("tritonserver")], poll_s=1)
    assert str(failed.value) == (
        "the server did not become ready: no progress for 120 s (tritonserver: no CPU time used, nothing logged)"
    )
    assert 50 + 120 <= clock() <= 50 + 120 + 2


def test_a_start_whose_process_exits_fails_at_once(monkeypatch):
    clock = Clock()
    child = FakeChild("haproxy", exits_at=5, clock=clock)
    with pytest.raises(StartupFailed, match=r"^the server did not become ready: haproxy exited \(exit code 1\)$"):
        waiting(monkeypatch, clock, progress_until=10_000, ready_at=10_000, children=[FakeChild(), child], poll_s=1)
    assert clock() <= 6


def test_a_start_that_its_own_check_calls_failed_fails_then_naming_the_reason(monkeypatch):
    """A busy start (a supervisor restarting a server that cannot bind) fails when `failed` says so."""
    clock = Clock()
    failed = lambda: "restarted 3 times" if clock() >= 30 else None  # noqa: E731
    with pytest.raises(StartupFailed, match=r"^the server did not become ready: restarted 3 times$"):
        waiting(
            monkeypatch, clock, progress_until=10**9, ready_at=10**9, children=[FakeChild()], poll_s=1, failed=failed
        )
    assert 30 <= clock() <= 32


def test_a_start_busy_forever_fails_at_the_cap(monkeypatch):
    clock = Clock()
    with pytest.raises(StartupFailed, match=r"did not become ready within 900 s, although still working$"):
        waiting(monkeypatch, clock, progress_until=10**9, ready_at=10**9, children=[FakeChild()], poll_s=1)


WORKER = "import subprocess, sys, time\nprint('started', flush=True)\n" + (
    "worker = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\ntime.sleep(60)"
)


def test_work_is_read_from_the_process_tree_and_the_log(tmp_path):
    """A real child that forks a busy worker: the worker's CPU time counts, and so do log bytes."""
    child = Child("parent", [sys.executable, "-c", WORKER], log_path=tmp_path / "log").start()
    try:
        first = startup_wait.work_done(child)
        wait_until_ready(
            "the worker", lambda: startup_wait.work_done(child)[0] > first[0] + 0.2, [child], stall_s=60, cap_s=60
        )
        assert startup_wait.work_done(child)[1] == len("started\n")
    finally:
        child.stop(5, group=True)


def test_a_real_hung_child_fails_once_silent_for_the_stall_limit(tmp_path):
    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], log_path=tmp_path / "log").start()
    try:
        with pytest.raises(StartupFailed, match="no progress for 2 s"):
            wait_until_ready("the sleeper", lambda: False, [child], stall_s=2, cap_s=120)
    finally:
        child.stop(5)
