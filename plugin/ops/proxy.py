"""The front door's processes: HAProxy on the public ports and the stream gate behind it.

`FrontDoor` plans the ports and keys, writes the generated config (`ops.proxy_config`) into a
private directory (0700, files 0600, created exclusively), validates it with `haproxy -c` (a bad
config fails the start loudly) and gives the command lines of its two children; the supervisor
runs them as `Child` processes and restarts one that dies. HAProxy runs in the foreground as the
invoking user, with its descriptor limit raised to the hard limit.

The user's admin key lives only in the key file the proxy reads; tritonserver gets a random
internal key on its command line, which the proxy sets on admin requests it has let through.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import proxy_config, settings
from .proxy_config import ProxyLimits, ProxyPlan
from .proxy_metrics import exporter_available
from .server_process import PORT_NAMES, LoopbackUrls, TritonServer, free_port, loopback_args

HAPROXY_PATHS = ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
GENERATE_MODEL = "generate"  # the model the HTTP API serves
# The supervisor's children behind the proxy, in the order of their loopback ports.
INTERNAL_PORTS = ("http", "grpc", "metrics", "stream_gate", "probe", "api")
PR_SET_PDEATHSIG = 1
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # since the last start, by quick deaths in a row
STABLE_RUN_S = 60.0


class ProxyError(RuntimeError):
    """The proxy cannot start: not installed, a descriptor limit too low, or a config HAProxy refuses."""


def find_haproxy() -> str | None:
    """The haproxy binary: on PATH, or where Debian installs it (/usr/sbin is not on every PATH)."""
    return shutil.which("haproxy") or next((path for path in HAPROXY_PATHS if os.access(path, os.X_OK)), None)


def internal_ports(base: int = 0) -> dict[str, int]:
    """Loopback ports for what runs behind the proxy: `base`, base+1, ... or free ones when 0."""
    if base:
        return {name: base + offset for offset, name in enumerate(INTERNAL_PORTS)}
    return {name: free_port() for name in INTERNAL_PORTS}


def write_private(path: Path, text: str) -> None:
    """Create `path` for this user only (0600), failing if anything is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# The longest path a unix socket may have, less one (sun_path holds 108 bytes with its NUL).
UNIX_PATH_MAX = 107


@dataclass
class FrontDoor:
    """HAProxy and the stream gate for one supervised tritonserver (see the module docstring)."""

    repository: Path
    public: dict[str, int]  # http, grpc, metrics, probe (0: none)
    admin_key: str | None  # None: the admin APIs are open to anyone (--open-admin-apis)
    internal: dict[str, int] = field(default_factory=internal_ports)
    limits: ProxyLimits = field(default_factory=ProxyLimits.from_settings)
    internal_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    directory: Path | None = None
    # The defences `ops.workarounds` may turn off for a server that does not need them.
    stream_gate: bool = True
    json_checks: bool = True

    def plan(self) -> ProxyPlan:
        """What the config is generated from."""
        routes = proxy_config.model_routes(self.repository, self.limits.json_header_bytes)
        return ProxyPlan(
            public={**self.public, "api": self.public.get("api", 0) if self.serves_api() else 0},
            internal=self.internal,
            admin_key_file=self.directory / "admin.key" if self.admin_key is not None else None,
            internal_key=self.internal_key,
            routes=routes,
            limits=self.limits,
            stream_gate=self.stream_gate,
            json_checks=self.json_checks,
            side_bind_address=settings.TRITON_SIDE_PORTS_ADDRESS.value(),
            stats_socket=self.stats_socket,
        )

    @property
    def stats_socket(self) -> Path | None:
        """HAProxy's exporter socket (ops.proxy_metrics), where this haproxy has the exporter."""
        binary = find_haproxy()
        if not (self.directory and binary and exporter_available(binary)):
            return None
        path = self.directory / "stats.sock"
        return path if len(str(path)) < UNIX_PATH_MAX else None  # a longer path cannot be bound

    @property
    def config_path(self) -> Path:
        """The generated haproxy.cfg (0600: it holds the internal key)."""
        return self.directory / "haproxy.cfg"

    def prepare(self) -> None:
        """Write the key file and the config into a fresh private directory and validate them;
        raises ProxyError when HAProxy is missing, the descriptor limit is too low, or the config
        does not pass `haproxy -c`."""
        binary = find_haproxy()
        if binary is None:
            raise ProxyError("haproxy is not installed")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        needed = self.limits.descriptors_needed()
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ProxyError(
                f"PROXY_MAX_CONNECTIONS={self.limits.max_connections} needs about {needed} file descriptors "
                f"but the hard limit (ulimit -Hn) is {hard}: lower PROXY_MAX_CONNECTIONS or raise the limit"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="triton-front-door-"))  # 0700
        if self.admin_key is not None:
            write_private(self.directory / "admin.key", self.admin_key + "\n")
        write_private(self.config_path, proxy_config.render(self.plan()))
        check = subprocess.run([binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True, timeout=60)
        if check.returncode != 0:
            raise ProxyError(f"haproxy refuses the generated config {self.config_path}:\n{check.stderr.strip()}")

    def proxy_command(self) -> list[str]:
        """HAProxy in the foreground (-db) on the generated config."""
        return [find_haproxy(), "-db", "-f", str(self.config_path)]

    def gate_command(self) -> list[str]:
        """The stream gate between the proxy and tritonserver's gRPC port."""
        largest = max((route.body_limit_bytes for route in self.plan().routes), default=2**31 - 1)
        return [
            sys.executable,
            "-m",
            "triton_sampling_mask.ops.stream_gate",
            f"--listen=127.0.0.1:{self.internal['stream_gate']}",
            f"--upstream=127.0.0.1:{self.internal['grpc']}",
            f"--max-open={self.limits.stream_max_open}",
            f"--max-message-bytes={min(largest, 2**31 - 1)}",
        ]

    def api_command(self) -> list[str]:
        """The HTTP API (plugin/api) on loopback, over tritonserver's own gRPC port, with the
        generate model's checkpoint for its tokenizer."""
        config = Path(self.repository) / GENERATE_MODEL / "config.pbtxt"
        model_path = proxy_config.config_parameters(config).get("model_path", "") if config.exists() else ""
        return [
            sys.executable,
            "-m",
            "triton_sampling_mask.api",
            f"--triton-url=127.0.0.1:{self.internal['grpc']}",
            "--host=127.0.0.1",
            f"--port={self.internal['api']}",
            *([f"--model-path={model_path}"] if model_path else []),
        ]

    def serves_api(self) -> bool:
        """Whether the HTTP API runs: a public port for it, a generate model, and its extra installed."""
        wanted = bool(self.public.get("api")) and (Path(self.repository) / GENERATE_MODEL / "config.pbtxt").exists()
        return wanted and importlib.util.find_spec("fastapi") is not None

    def children(self, log_path: Path | None = None) -> list[Child]:
        """The proxy, the gate and the HTTP API, ready to start (their output to `log_path`, or inherited)."""
        children = [Child("haproxy", self.proxy_command(), soft_stop=signal.SIGUSR1, log_path=log_path)]
        if self.stream_gate:
            children.append(Child("stream gate", self.gate_command(), log_path=log_path))
        if self.serves_api():
            children.append(Child("http api", self.api_command(), log_path=log_path))
        return children

    def clean_up(self) -> None:
        """Remove the private directory (keys and config)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _child_setup() -> None:
    """In a forked child before exec: die with the supervisor, and may hold as many descriptors as
    the hard limit allows (HAProxy needs about two per connection)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    raise_descriptor_limit()


@dataclass
class Child:
    """A helper process of the supervisor (the proxy, the gate): started in a session of its own,
    restarted by the supervisor when it dies; `soft_stop` asks it to stop taking new work."""

    name: str
    command: list[str]
    soft_stop: int = signal.SIGTERM
    log_path: Path | None = None  # where its output goes (default: the supervisor's own)
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each less than STABLE_RUN_S after its start

    def restart_due(self) -> bool:
        """Whether a dead process may start again: at once after a run of a minute or more, else
        after 1 s doubling to 30 s (a process that cannot start, e.g. its port taken, is not spun)."""
        if self.process is None:
            return True
        delay = RESTART_DELAYS_S[min(self.quick_deaths, len(RESTART_DELAYS_S) - 1)]
        return time.monotonic() >= self.started_at + delay

    def start(self) -> None:
        """Start (or restart) the process."""
        if self.process is not None:
            ran = time.monotonic() - self.started_at
            self.quick_deaths = 0 if ran >= STABLE_RUN_S else self.quick_deaths + 1
        self.started_at = time.monotonic()
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (the child keeps it)
        try:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
                preexec_fn=_child_setup,
            )
        finally:
            if log:
                log.close()

    def running(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send `signum` if the process runs."""
        if self.running():
            self.process.send_signal(signum)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM (HAProxy: stop at once), then SIGKILL for the whole group after `timeout_s`;
        the exit code. The supervisor sends `soft_stop` earlier, while tritonserver drains."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        return self.process.returncode

    def wait(self, deadline: float) -> None:
        """Wait for the process to exit until `deadline` (time.monotonic())."""
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)


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

    def start(self, timeout_s: float = 180.0) -> FrontedTritonServer:
        """Start tritonserver, then the proxy and the gate; wait until ready through the proxy."""
        self.server.start(timeout_s)
        try:
            self.front_door.prepare()
            self.helpers = self.front_door.children(self.server.log_path.with_suffix(".proxy.log"))
            for helper in self.helpers:
                helper.start()
            deadline = time.monotonic() + 30
            while not self.is_ready():
                if time.monotonic() > deadline or not all(helper.running() for helper in self.helpers):
                    raise RuntimeError("the front door did not come up")
                time.sleep(0.1)
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


def main(argv: list[str] | None = None) -> None:
    """Generate the config `make serve` would run for a repository and check it with `haproxy -c`
    (the image's build runs this); --print shows it, with a placeholder internal key."""
    import argparse

    from . import settings

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model-repository", type=Path, default=Path(settings.MODEL_REPOSITORY.value()))
    parser.add_argument("--print", action="store_true", help="print the generated config")
    args = parser.parse_args(argv)
    public = {
        "http": settings.TRITON_HTTP_PORT.value(),
        "grpc": settings.TRITON_GRPC_PORT.value(),
        "metrics": settings.TRITON_METRICS_PORT.value(),
        "probe": settings.TRITON_PROBE_PORT.value(),
    }
    door = FrontDoor(args.model_repository, public, secrets.token_urlsafe(32), internal_key="INTERNAL-KEY-PLACEHOLDER")
    try:
        door.prepare()
        if args.print:
            print(door.config_path.read_text(), end="")
        print(f"haproxy accepts the config generated for {args.model_repository}", file=sys.stderr)
    except ProxyError as error:
        raise SystemExit(str(error)) from None
    finally:
        door.clean_up()


if __name__ == "__main__":
    main()
