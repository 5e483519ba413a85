"""A tritonserver behind a front door of its own (HAProxy and the stream gate, as `make serve`
runs them), without the supervisor, for tests and benchmarks."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from testbed.server import PORT_NAMES, LoopbackUrls, TritonServer
from testbed.startup_wait import CAP_S, wait_until_ready
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.door_commands import door_children
from triton_sampling_mask.ops.proxy import FrontDoor, ProxyLimits
from triton_sampling_mask.ops.server_process import free_port, loopback_args


class FrontedTritonServer(LoopbackUrls):
    """A `TritonServer` on loopback behind a front door of its own, all on free ports, without the
    supervisor (tests and benchmarks; a context manager). `ports` are the proxy's public ones,
    `server` is tritonserver itself (its `process`, its direct URLs for comparisons).

    With `admin_key` the admin APIs need that key at the proxy, and tritonserver gets an internal
    key of its own; None leaves them open."""

    def __init__(
        self,
        model_repository: Path,
        extra_args: list[str] = (),
        admin_key: str | None = None,
        limits: ProxyLimits | None = None,
        log_path: Path | None = None,
    ):
        internal_key = secrets.token_urlsafe(32)
        self.server = TritonServer(
            model_repository,
            extra_args=[*loopback_args(), *extra_args],
            log_path=log_path,
            admin_key=internal_key if admin_key is not None else None,
        )
        self.ports = {name: free_port() for name in PORT_NAMES}
        self.front_door = FrontDoor(
            Path(model_repository),
            public={**self.ports, "probe": 0},
            admin_key=admin_key,
            internal={**self.server.ports, "stream_gate": free_port(), "probe": 0},
            limits=limits or ProxyLimits.from_settings(),
            internal_key=internal_key,
        )
        self.helpers: list[Child] = []

    @property
    def process(self) -> subprocess.Popen | None:
        """tritonserver's process."""
        return self.server.process

    def start(self, timeout_s: float = CAP_S) -> FrontedTritonServer:
        """Start tritonserver, then the proxy and the gate; wait until ready through the proxy, for
        as long as they make progress (startup_wait; `timeout_s` is the last-resort cap)."""
        self.server.start(timeout_s)
        try:
            self.front_door.prepare()
            self.helpers = door_children(self.front_door, self.server.log_path.with_suffix(".proxy.log"))
            for helper in self.helpers:
                helper.start()
            wait_until_ready(
                f"the front door on port {self.ports['http']}",
                self.is_ready,
                [*self.helpers, self.server.child],
                cap_s=timeout_s,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int | None:
        """Stop the proxy and the gate, then tritonserver; returns tritonserver's exit code."""
        for helper in self.helpers:
            helper.stop()
        code = self.server.stop()
        self.front_door.clean_up()
        return code

    def log_tail(self, chars: int = 4000) -> str:
        """The end of tritonserver's log."""
        return self.server.log_tail(chars)

    def __enter__(self) -> FrontedTritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
