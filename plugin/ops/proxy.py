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
from dataclasses import dataclass, field
from pathlib import Path

from . import proxy_config, settings
from .child import HARD_LIMIT, Child
from .proxy_config import ProxyLimits, ProxyPlan
from .proxy_metrics import exporter_available
from .server_process import free_port

HAPROXY_PATHS = ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
GENERATE_MODEL = "generate"  # the model the HTTP API serves
# The supervisor's children behind the proxy, in the order of their loopback ports.
INTERNAL_PORTS = ("http", "grpc", "metrics", "stream_gate", "probe", "api")


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
    def gate_socket(self) -> Path | None:
        """The unix socket the stream gate serves its refusal counters on (ops.proxy_metrics)."""
        if not (self.directory and self.stream_gate):
            return None
        path = self.directory / "stream_gate.sock"
        return path if len(str(path)) < UNIX_PATH_MAX else None

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
            # the stream route's queue (HAProxy's cannot answer a stream: ops.stream_gate)
            f"--max-streams={self.limits.max_in_flight}",
            f"--max-queue={self.limits.max_queue}",
            f"--queue-timeout={self.limits.queue_timeout_s}",
            *([f"--counters-socket={self.gate_socket}"] if self.gate_socket else []),
            # decoupled models stop a cancelled request at their next step (the generate engine)
            *(f"--cancellable={route.name}" for route in self.plan().routes if route.decoupled),
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
            # what routers read of this replica: /health follows the supervisor's readiness, /v1/loads the engine's gauges
            f"--readiness-url=http://127.0.0.1:{self.internal['probe']}/ready",
            f"--metrics-url=http://127.0.0.1:{self.internal['metrics']}/metrics",
            *([f"--model-path={model_path}"] if model_path else []),
            # the admin key only where it is sent for trusted networks' keyless weight calls
            *(
                [f"--admin-key-file={self.directory / 'admin.key'}"]
                if self.admin_key is not None and settings.TRITON_API_TRUSTED_NETWORKS.value()
                else []
            ),
        ]

    def serves_api(self) -> bool:
        """Whether the HTTP API runs: a public port for it, a generate model, and its extra installed."""
        wanted = bool(self.public.get("api")) and (Path(self.repository) / GENERATE_MODEL / "config.pbtxt").exists()
        return wanted and importlib.util.find_spec("fastapi") is not None

    def children(self, log_path: Path | None = None) -> list[Child]:
        """The proxy, the gate and the HTTP API, ready to start (their output to `log_path`, or
        inherited): each dies with its parent and may hold as many descriptors as the hard limit
        allows (HAProxy needs about two per connection)."""
        commands = [("haproxy", self.proxy_command())]
        if self.stream_gate:
            commands.append(("stream gate", self.gate_command()))
        if self.serves_api():
            commands.append(("http api", self.api_command()))
        return [
            Child(
                name,
                command,
                log_path=log_path,
                die_with_parent=True,
                nofile=HARD_LIMIT,
                soft_stop=signal.SIGUSR1 if name == "haproxy" else signal.SIGTERM,
            )
            for name, command in commands
        ]

    def clean_up(self) -> None:
        """Remove the private directory (keys and config)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


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
