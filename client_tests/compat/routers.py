"""A router from the compat venv (sglang-router 0.3.2 or smg 1.13, what slime and Miles put in front of
their engines) in front of N API endpoints. Both wheels install a console script named `smg`, so each is
run as its module."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.startup_wait import StartupFailed, wait_until_ready
from triton_sampling_mask.ops.child import Child

from . import venv
from .weights import free_port
from .wire import get, post

MODULES = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}
NO_WORKER_RETRY_S = 30


@dataclass
class Router:
    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def post(self, path: str, body, headers: dict | None = None):
        """POST through the router, retried while it says no worker is ready yet (it registers them
        after it starts)."""
        deadline = time.monotonic() + NO_WORKER_RETRY_S
        while True:
            status, answer = post(self.url + path, body, headers)
            if status != 503 or time.monotonic() > deadline:
                return status, answer
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def launch_router(kind: str, worker_urls: list[str], log_path: Path, policy: str = "round_robin") -> Router:
    """Start `kind` on a free loopback port in front of `worker_urls`; wait until it answers /health."""
    port = free_port()
    command = [str(venv.PYTHON), "-m", MODULES[kind], "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *worker_urls, "--policy", policy]
    # each router's Prometheus exporter defaults to port 29000: two on one host would collide
    command += ["--prometheus-port", str(free_port())]
    child = Child(kind, command, log_path=log_path, append_log=False).start()  # a session of its own
    router = Router(kind, f"http://127.0.0.1:{port}", child.process, log_path)
    try:  # on readiness, for as long as it makes progress (testbed.startup_wait)
        wait_until_ready(kind, lambda: get(router.url + "/health", timeout_s=2)[0] == 200, [child], poll_s=0.5)
    except StartupFailed as failed:
        router.stop()
        raise StartupFailed(f"{failed}:\n{router.log_tail()}") from None
    return router
