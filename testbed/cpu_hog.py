"""A busy neighbour: processes that spin on the CPU at normal priority beside a server under test
(bench/step_latency.py's `--hog`), as another tenant's job on a shared host would: one job in a
session of its own (so, where the kernel groups tasks by session for fairness, `autogroup`, it is
one more group, like any other job started from a shell or a scheduler)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

# The job: the first process forks the others, and all spin until killed.
_SPIN = "import os, sys\nfor _ in range(int(sys.argv[1]) - 1):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"


class CpuHog:
    """`count` spinning processes, in one session, while the context is open (none for 0)."""

    def __init__(self, count: int):
        self.count = count
        self.process: subprocess.Popen | None = None

    @property
    def pids(self) -> list[int]:
        """The job's processes (the first one and those it forked)."""
        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.Error:
            return []

    def __enter__(self) -> CpuHog:
        if self.count > 0:
            command = [sys.executable, "-c", _SPIN, str(self.count)]
            self.process = subprocess.Popen(command, start_new_session=True)
            deadline = time.monotonic() + 10
            while len(self.pids) < self.count and time.monotonic() < deadline:
                time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            pids = self.pids
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
            self.process = None
            psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=5)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
