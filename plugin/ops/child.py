"""One way to run a child process: its command, environment, umask and pre-exec settings, a
bounded graceful stop, and the backoff between restarts of one that keeps dying. Why by hand:
`subprocess` gives no parent-death signal, process-group stop or restart backoff.

Every child runs in a session (process group) of its own, so a terminal's Ctrl-C reaches only
its parent, and a stop can end whatever the child forked. Used for tritonserver (the supervisor's
and the tests'), the front door's helpers, and the launchers the hostile suite and the survival
tests start.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Seconds before restarting a child that died, by how many quick deaths came right before it.
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_RUN_S = 60.0  # a child that ran this long died of something new: the backoff starts over
HARD_LIMIT = -1  # `nofile`: the soft descriptor limit raised to the hard one
PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the forked child must not load libraries
except (OSError, AttributeError):  # not Linux
    _prctl = None


def describe_exit(code: int) -> str:
    """A child's return code in words: "exit code N" or "signal NAME"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                members.append(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def end_process_group(pgid: int, timeout_s: float = 2.0) -> None:
    """SIGKILL what is left of process group `pgid` (e.g. stubs outliving a crashed tritonserver)
    and wait, up to `timeout_s`, until none of it runs."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def set_priority(nice: int) -> None:
    """This process's nice value, and its session's where the kernel shares CPU between sessions
    first (autogroup: a child in a session of its own is a group of its own, and a process's nice
    then weighs only against its group's other tasks). Best effort: the caller reads it back."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        return
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(nice))
    except OSError:  # no autogroup (a kernel without it, or a cgroup of its own: nice is what counts)
        pass


def priority_of(pid: int) -> int | None:
    """A process's nice value (None once it is gone)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


@dataclass
class Child:
    """A child process in a session of its own (see the module docstring).

    Before exec it may get a parent-death signal (`die_with_parent`: SIGKILL when its parent
    dies, so it cannot outlive a killed supervisor), a soft descriptor limit (`nofile`, capped at
    the hard limit; HARD_LIMIT for the hard limit itself), a scheduling priority (`nice`, see
    `set_priority`) and a `setup` of the caller's (e.g. entering a memory cgroup), in that order.
    Its output goes to `log_path` (appended, or truncated first with `append_log=False`), else to
    the parent's."""

    name: str
    command: list[str]
    env: dict[str, str] | None = None
    cwd: Path | None = None
    umask: int = -1  # -1: the parent's
    log_path: Path | None = None
    append_log: bool = True
    die_with_parent: bool = False
    nofile: int | None = None
    setup: Callable[[], None] | None = None
    nice: int = 0  # 0: the parent's priority
    soft_stop: int = signal.SIGTERM  # asks it to stop taking new work (HAProxy: SIGUSR1)
    process: subprocess.Popen | None = None
    restarts: int = 0  # counted by the caller that restarts it
    started_at: float = 0.0
    deaths_in_a_row: int = 0  # deaths since the last one after a stable run (that one included)
    _restart_at: float | None = field(default=None, repr=False)
    _delay: float = field(default=0.0, repr=False)

    @property
    def pid(self) -> int:
        """The process id (and its group's): the child must have been started."""
        return self.process.pid

    def _pre_exec(self) -> None:
        if self.die_with_parent and _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if self.nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            capped = hard != resource.RLIM_INFINITY and self.nofile > hard
            soft = hard if self.nofile == HARD_LIMIT or capped else self.nofile
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if self.nice:
            set_priority(self.nice)
        if self.setup is not None:
            self.setup()

    def start(self) -> Child:
        """Start (or restart) the process."""
        log = open(self.log_path, "ab" if self.append_log else "wb") if self.log_path else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
                umask=self.umask,
                preexec_fn=self._pre_exec if self.die_with_parent or self.nofile or self.setup or self.nice else None,
            )
        finally:
            if log:
                log.close()  # the child holds its own copy
        self.started_at = time.monotonic()
        self._restart_at = None
        if self.nice and priority_of(self.process.pid) not in (self.nice, None):
            print(
                f"{self.name}: nice {self.nice} not applied (below 0 needs CAP_SYS_NICE); it runs at "
                f"{priority_of(self.process.pid)}",
                file=sys.stderr,
            )
        return self

    def running(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send `signum` to the process if it runs."""
        if self.running():
            self.process.send_signal(signum)

    def stop(
        self,
        timeout_s: float = 5.0,
        group: bool = False,
        on_kill: Callable[[], None] | None = None,
    ) -> int | None:
        """SIGTERM (to its whole process group with `group`), then, if it still runs `timeout_s`
        later, `on_kill()` and SIGKILL for the group; in any case SIGKILL for what is left of the
        group (bounded). Returns the exit code (None if it never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM) if group else self.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=max(0.0, timeout_s))
            except subprocess.TimeoutExpired:
                if on_kill is not None:
                    on_kill()
                end_process_group(self.process.pid)
                self.process.wait()
        end_process_group(self.process.pid)
        return self.process.returncode

    def restart_delay(self, served: bool = False) -> float:
        """Seconds from its death until the restart, fixed at the first call after a death: the
        shortest after a run of STABLE_RUN_S or one that `served`, longer with each quick death
        in a row (a child that cannot start, e.g. its port taken, is not spun)."""
        if self._restart_at is None:
            ran = time.monotonic() - self.started_at
            self.deaths_in_a_row = 1 if ran >= STABLE_RUN_S or served else self.deaths_in_a_row + 1
            self._delay = RESTART_BACKOFF_S[min(self.deaths_in_a_row, len(RESTART_BACKOFF_S)) - 1]
            self._restart_at = time.monotonic() + self._delay
        return self._delay

    def restart_due(self) -> bool:
        """Whether the process may start (again): never started, or dead and its delay over."""
        if self.process is None:
            return True
        if self.running():
            return False
        self.restart_delay()
        return time.monotonic() >= self._restart_at
