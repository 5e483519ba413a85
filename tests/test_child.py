"""The one way children are run (plugin/ops/child.py): pre-exec settings, a stop that leaves
nothing of the child's process group, and the restart backoff."""

from __future__ import annotations

import os
import resource
import signal
import sys
import time

import pytest

from triton_sampling_mask.ops import child as child_module
from triton_sampling_mask.ops.child import (
    HARD_LIMIT,
    RESTART_BACKOFF_S,
    STABLE_RUN_S,
    Child,
    describe_exit,
    group_members,
)

REPORT = "import os, resource; print(oct(os.umask(0)), resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.getpgid(0))"


def test_pre_exec_settings_reach_the_child(tmp_path):
    log = tmp_path / "child.log"
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    child = Child("report", [sys.executable, "-c", REPORT], umask=0o027, nofile=256, log_path=log).start()
    assert child.process.wait(30) == 0
    umask, nofile, pgid = log.read_text().split()
    assert (umask, int(nofile), int(pgid)) == ("0o27", min(256, hard), child.pid)  # a session of its own
    raised = Child("report", [sys.executable, "-c", REPORT], nofile=HARD_LIMIT, log_path=log, append_log=False)
    assert raised.start().process.wait(30) == 0
    assert int(log.read_text().split()[1]) == hard


def test_stop_ends_the_whole_group_even_when_the_child_ignores_sigterm():
    # The child ignores SIGTERM and forks a grandchild that does too: both must be gone.
    script = "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nos.fork()\ntime.sleep(60)\n"
    killed = []
    child = Child("stubborn", [sys.executable, "-c", script]).start()
    deadline = time.monotonic() + 10
    while len(group_members(child.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(child.pid)) == 2
    started = time.monotonic()
    assert child.stop(0.5, on_kill=lambda: killed.append(True)) == -signal.SIGKILL
    assert killed == [True] and time.monotonic() - started < 5
    assert group_members(child.pid) == []


def test_a_clean_exit_on_sigterm_is_its_exit_code():
    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"]).start()
    assert child.running()
    assert child.stop(10) == -signal.SIGTERM and not child.running()
    assert describe_exit(-signal.SIGTERM) == "signal SIGTERM" and describe_exit(3) == "exit code 3"


def test_never_started_is_none_and_due():
    child = Child("idle", ["true"])
    assert child.stop() is None and child.restart_due()


def test_restart_backoff_doubles_for_quick_deaths_and_starts_over_after_a_stable_run(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(child_module.time, "monotonic", lambda: now[0])
    child = Child("dying", ["true"])
    delays = []
    for _ in range(len(RESTART_BACKOFF_S) + 2):  # quick deaths: the table, then its last entry
        child.started_at, child._restart_at = now[0], None
        now[0] += 1.0
        delays.append(child.restart_delay())
        assert child.restart_delay() == delays[-1]  # fixed once per death
    assert delays == [*RESTART_BACKOFF_S, RESTART_BACKOFF_S[-1], RESTART_BACKOFF_S[-1]]
    child.started_at, child._restart_at = now[0], None
    now[0] += STABLE_RUN_S
    assert child.restart_delay() == RESTART_BACKOFF_S[0]  # a stable run: the shortest again
    child.started_at, child._restart_at = now[0], None
    now[0] += 1.0
    assert child.restart_delay() == RESTART_BACKOFF_S[1]
    child.started_at, child._restart_at = now[0], None
    now[0] += 1.0
    assert child.restart_delay(served=True) == RESTART_BACKOFF_S[0]  # it served: not escalated


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_dies_with_its_parent_does(tmp_path):
    # A parent starts a child with die_with_parent and is SIGKILLed: the child follows it.
    pid_file = tmp_path / "pid"
    parent = (
        "import sys, time\n"
        "from triton_sampling_mask.ops.child import Child\n"
        "c = Child('orphan', [sys.executable, '-c', 'import time; time.sleep(60)'], die_with_parent=True).start()\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    outer = Child("parent", [sys.executable, "-c", parent]).start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphan = int(pid_file.read_text())
    os.kill(outer.pid, signal.SIGKILL)
    outer.process.wait(10)
    deadline = time.monotonic() + 10
    while group_members(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members(orphan) == []


def test_a_nice_child_and_its_session_run_at_that_priority(tmp_path):
    """Nice 7 (no privilege needed to lower one's priority) reaches the child and, where the kernel
    groups tasks by session (autogroup), the child's own session; the parent's stays as it was."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    child = Child("nice", [sys.executable, "-c", "import time; time.sleep(30)"], nice=7).start()
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 7
        autogroup = f"/proc/{child.pid}/autogroup"
        if os.path.exists(autogroup):
            with open(autogroup) as group:
                assert group.read().split()[-1] == "7"
        assert os.getpriority(os.PRIO_PROCESS, 0) == ours
    finally:
        child.stop(timeout_s=2)
