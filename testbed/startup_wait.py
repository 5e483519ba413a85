"""Waiting for started processes to be ready: on their readiness, not on a fixed budget.

A busy machine (a developer's, CI on it) slows a start without stopping it, so a start is given
as long as it makes progress: one of its processes (or their descendants, e.g. tritonserver's
stubs) uses CPU time or writes to its log. It fails, naming what it waited for and why, when a
process exits, when `failed()` names a reason (e.g. a supervisor restarting a server that cannot
start), when all of them stay silent for `stall_s` (a hung start), or, as a last resort
against one that keeps busy without ever being ready, after `cap_s` in all. Used by the test and
benchmark servers here (`server.TritonServer`, the front door, the HTTP API and the launched stack).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import psutil

from triton_sampling_mask.ops.child import Child, describe_exit

STALL_S = 120.0  # no CPU time and no log output from any of the processes for this long: hung
CAP_S = 900.0  # the longest a start may take, however busy: the last resort only
PROGRESS_EVERY_S = 1.0  # how often progress is measured (it walks the processes' descendants)


class StartupFailed(RuntimeError):
    """A start that will not become ready; the message names what was awaited and why."""


def work_done(child: Child) -> tuple[float, int]:
    """(CPU seconds of the child and its descendants, bytes in its log): what grows while it works."""
    seconds = 0.0
    try:
        process = psutil.Process(child.pid)
        for member in (process, *process.children(recursive=True)):
            try:
                times = member.cpu_times()
                seconds += times.user + times.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
        pass
    try:
        logged = os.stat(child.log_path).st_size if child.log_path else 0
    except OSError:
        logged = 0
    return seconds, logged


def wait_until_ready(
    what: str,
    ready: Callable[[], bool],
    children: Sequence[Child],
    *,
    stall_s: float = STALL_S,
    cap_s: float = CAP_S,
    poll_s: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    failed: Callable[[], str | None] = lambda: None,
) -> float:
    """Return the seconds waited once `ready()` holds. Raise StartupFailed naming `what` when one of
    `children` exits, when `failed()` (asked once a progress period) gives a reason, when none of them
    makes progress (work_done) for `stall_s`, or after `cap_s`."""
    started = last_progress = measured_at = clock()
    done = [work_done(child) for child in children]
    while True:
        for child in children:
            if not child.running():
                code = child.process.returncode if child.process is not None else None
                how = "never started" if code is None else f"exited ({describe_exit(code)})"
                raise StartupFailed(f"{what} did not become ready: {child.name} {how}")
        if ready():
            return clock() - started
        now = clock()
        if now - measured_at >= PROGRESS_EVERY_S:
            measured_at = now
            reason = failed()
            if reason:
                raise StartupFailed(f"{what} did not become ready: {reason}")
            latest = [work_done(child) for child in children]
            if latest != done:
                done, last_progress = latest, now
            elif now - last_progress >= stall_s:
                names = ", ".join(child.name for child in children)
                raise StartupFailed(
                    f"{what} did not become ready: no progress for {stall_s:.0f} s ({names}: no CPU time used, "
                    "nothing logged)"
                )
        if now - started >= cap_s:
            raise StartupFailed(f"{what} did not become ready within {cap_s:.0f} s, although still working")
        sleep(poll_s)
