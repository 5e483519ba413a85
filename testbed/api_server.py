"""The HTTP API process (`python -m triton_sampling_mask.api`) on a free port, in front of a
running tritonserver, for tests and benchmarks: started, waited for until /health answers 200,
stopped with SIGTERM (its exit code is what a supervisor would see)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from testbed.server import log_tail
from testbed.startup_wait import CAP_S, StartupFailed, wait_until_ready
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.server_process import free_port


class ApiProcess:
    """One API process (a context manager); `url` is its base URL, http://127.0.0.1:PORT."""

    def __init__(self, triton_grpc_url: str, extra_args: list[str] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "triton_sampling_mask.api",
            "--triton-url",
            triton_grpc_url,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.gettempdir()) / f"api-{self.port}.log"
        self.child = Child("http api", self.command, env=self.env, log_path=self.log_path, append_log=False)

    @property
    def process(self) -> subprocess.Popen | None:
        """The API's process (None before `start`)."""
        return self.child.process

    def start(self, timeout_s: float = CAP_S) -> ApiProcess:
        """Start the API and wait until /health answers 200, for as long as it makes progress
        (startup_wait; `timeout_s` is the last-resort cap); raises with the log tail if not."""
        self.child.start()
        try:
            wait_until_ready(
                f"the HTTP API on port {self.port}",
                lambda: self.get("/health")[0] == 200,
                [self.child],
                cap_s=timeout_s,
            )
        except StartupFailed as failed:
            self.stop()
            raise StartupFailed(f"{failed}:\n{self.log_tail()}") from None
        return self

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict | None]:
        """(status, JSON body) of a GET; (0, None) when nothing answers."""
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL if it lingers; the exit code."""
        return self.child.stop(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the API's log."""
        return log_tail(self.log_path, chars)

    def __enter__(self) -> ApiProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
