"""The front door's values: HAProxy runs haproxy/haproxy.cfg (the whole configuration, in its own
syntax) as it is, and this module decides only what the template reads: settings, ports and the key
file as environment variables, and each model's kind, body cap and inputs (from its config.pbtxt)
as map files; the template's header lists them. No rule is written here.

`FrontDoor.prepare` writes the key and map files into a private directory (0700, files 0600,
created exclusively) and checks the template with them (`haproxy -c`: a refused value stops the
start); `ops.door_commands` runs HAProxy on them, beside the stream gate and the HTTP API.
tritonserver gets a random internal key on its command line, which the proxy sets on the admin
requests it admits: the user's key is only in the key file.
"""

from __future__ import annotations

import re
import resource
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from ..sampling.admin import WRONG_KEYS_PER_MINUTE
from . import settings
from .door_commands import api_runs
from .model_limits import model_routes
from .proxy_metrics import exporter_available
from .secret_files import API_KEY_CLIENT, KEY_PATTERN, process_directory, write_secret_file
from .server_process import free_port

TEMPLATE = Path(__file__).resolve().with_name("haproxy") / "haproxy.cfg"
LUA_CHECKS = TEMPLATE.with_name("json_checks.lua")
# On loopback, in this order (stream_gate_keyed: the gate's listener for keyed clients' streams).
INTERNAL_PORTS = ("http", "grpc", "metrics", "stream_gate", "probe", "api", "stream_gate_keyed")
SIDE_PORT_CONNECTIONS = 64  # the metrics and probe ports' maxconn in the template
UNIX_PATH_MAX = 107  # the longest unix socket path: sun_path holds 108 bytes with its NUL
HAPROXY_UNIX_PATH_MAX = 97  # HAProxy's: it binds `<path>.<pid>.tmp` first (`haproxy -c`: "max 97")
# What clients read when shed or refused, as the template sets it (`setenv MSG_...`).
MESSAGES = dict(re.findall(r'^\s+setenv (MSG_\w+) "(.*)"$', TEMPLATE.read_text(), re.MULTILINE))
QUEUE_FULL, QUEUE_TIMEOUT, RESTRICTED = (MESSAGES[f"MSG_{n}"] for n in ("QUEUE_FULL", "QUEUE_TIMEOUT", "RESTRICTED"))


class ProxyError(RuntimeError):
    """The proxy cannot start: not installed, a descriptor limit too low, or values HAProxy refuses."""


# The proxy's numbers: one field per PROXY_* setting (PROXY_MAX_QUEUE is `max_queue`), defaulting
# as it does, passed to the template under the setting's name (seconds as `..._MS` milliseconds).
LIMIT_SETTINGS = {name[6:].lower(): value for name, value in vars(settings).items() if name.startswith("PROXY_")}
ProxyLimits = make_dataclass(
    "ProxyLimits",
    [(name, type(s.default), field(default=s.default)) for name, s in LIMIT_SETTINGS.items()],
    frozen=True,
)
ProxyLimits.__module__ = __name__
ProxyLimits.from_settings = classmethod(lambda cls: cls(**{name: s.value() for name, s in LIMIT_SETTINGS.items()}))


def limit_variables(limits: ProxyLimits) -> dict[str, str]:
    """The PROXY_* variables of `limits`, as the template reads them (seconds as `..._MS`)."""
    values = {f"PROXY_{name.upper()}": getattr(limits, name) for name in LIMIT_SETTINGS}
    times = {f"{name[:-2]}_MS": str(max(1, round(value * 1000))) for name, value in values.items() if name[-2:] == "_S"}
    return {name: str(value) for name, value in values.items() if name[-2:] != "_S"} | times


def find_haproxy() -> str | None:
    """The haproxy binary: on PATH, or where Debian installs it (/usr/sbin is not on every PATH)."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def internal_ports(base: int = 0) -> dict[str, int]:
    """Loopback ports for what runs behind the proxy: `base`, base+1, ... or free ones when 0."""
    return {name: base + offset if base else free_port() for offset, name in enumerate(INTERNAL_PORTS)}


@dataclass
class FrontDoor:
    """HAProxy, the stream gate and the HTTP API for one tritonserver (the module docstring).
    `public` maps http, grpc, metrics, probe and api to ports (0: none); `admin_key` None opens the
    admin APIs; `stream_gate` and `json_checks` are the defences `ops.workarounds` may turn off."""

    repository: Path
    public: dict[str, int]
    admin_key: str | None
    internal: dict[str, int] = field(default_factory=internal_ports)
    limits: ProxyLimits = field(default_factory=ProxyLimits.from_settings)
    internal_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    directory: Path | None = None
    stream_gate: bool = True
    json_checks: bool = True
    client_keys: dict[str, str] = field(default_factory=dict)  # name -> key (secret_files.read_client_keys)
    side_bind_address: str = field(default_factory=settings.TRITON_SIDE_PORTS_ADDRESS.value)
    haproxy: list[str] = field(default_factory=lambda: [find_haproxy()])  # its command (tests: other lines')

    def __post_init__(self) -> None:
        self.internal = {"stream_gate_keyed": free_port(), **self.internal}  # where a caller names none

    @property
    def stats_socket(self) -> Path | None:
        """HAProxy's exporter socket (ops.proxy_metrics), where this haproxy has the exporter."""
        path = self.socket("stats.sock", HAPROXY_UNIX_PATH_MAX)
        return path if path and self.haproxy[0] and exporter_available(*self.haproxy) else None

    def socket(self, name: str, longest: int = UNIX_PATH_MAX) -> Path | None:
        """`name` in the private directory, where a unix socket path fits (`longest` bytes)."""
        path = self.directory / name if self.directory else None
        return path if path and len(str(path)) <= longest else None

    @property
    def gate_socket(self) -> Path | None:
        """The unix socket the stream gate serves its refusal counters on (ops.proxy_metrics)."""
        return self.socket("stream_gate.sock") if self.stream_gate else None

    def environment(self) -> dict[str, str]:
        """Every value the template reads (its header says what each is)."""
        public = {**self.public, "api": self.public.get("api", 0) if self.serves_api() else 0}
        api_key = self.client_keys.get(API_KEY_CLIENT)
        total, per_port = self.connection_caps()
        switches = {
            "DOOR_ADMIN_KEY_FILE": self.directory / "admin.key" if self.admin_key is not None else None,
            "DOOR_JSON_CHECKS": LUA_CHECKS if self.json_checks else None,
            "DOOR_STREAM_GATE": "on" if self.stream_gate else None,
            "DOOR_STATS_SOCKET": self.stats_socket,
            "DOOR_CLIENT_KEYS": "on" if self.client_keys else None,
            "DOOR_API_AUTHORIZATION": f"Bearer {api_key}" if api_key else None,
            **{f"TRITON_{name.upper()}_PORT": port for name, port in public.items()},
        }
        return {
            **limit_variables(self.limits),
            **{name: str(value) for name, value in switches.items() if value},
            **{f"DOOR_{name.upper()}_SERVER_PORT": str(port) for name, port in self.internal.items()},
            "DOOR_BIND_ADDRESS": "0.0.0.0",
            "DOOR_SIDE_BIND_ADDRESS": self.side_bind_address,
            "DOOR_MAXCONN": str(total),
            "DOOR_PORT_MAXCONN": str(per_port),
            "DOOR_INTERNAL_KEY": self.internal_key,
            "DOOR_ADMIN_KEY_PATTERN": f"^{KEY_PATTERN.pattern}$",
            "DOOR_WRONG_KEYS_PER_MINUTE": str(WRONG_KEYS_PER_MINUTE),
            "DOOR_MAPS": str(self.directory),
        }

    def connection_caps(self) -> tuple[int, int]:
        """(HAProxy's cap, each of the HTTP, gRPC and API ports'): half PROXY_MAX_CONNECTIONS a port,
        with client keys room for a keyed client on each HTTP port, and the side ports' own."""
        keyed = self.limits.keyed_connections_per_ip if self.client_keys else 0
        total = self.limits.max_connections + 2 * keyed + 2 * SIDE_PORT_CONNECTIONS
        return total, max(1, self.limits.max_connections // 2) + keyed

    def write_files(self) -> None:
        """The admin key file and the model maps, into `directory`."""
        if self.admin_key is not None:
            write_secret_file(self.directory / "admin.key", self.admin_key + "\n")
        routes = model_routes(self.repository, self.limits.json_header_bytes)
        for name, value in (
            ("model_kinds", lambda r: "generator" if r.decoupled else "sampler"),
            ("body_limits", lambda r: r.body_limit_bytes),
            ("input_specs", lambda r: r.input_spec),
        ):
            write_secret_file(self.directory / f"{name}.map", "".join(f"{r.name} {value(r)}\n" for r in routes))
        if self.client_keys:
            keys = "".join(f"{key} {name}\n" for name, key in self.client_keys.items())
            write_secret_file(self.directory / "client_keys.map", keys)

    def check(self) -> subprocess.CompletedProcess:
        """`haproxy -c` of the template with this door's values."""
        command = self.haproxy_command("-c")
        return subprocess.run(command, env=self.environment(), capture_output=True, text=True, timeout=60)

    def haproxy_command(self, *flags: str) -> list[str]:
        """HAProxy with `flags` on the template (its values are in `environment()`)."""
        return [*self.haproxy, *flags, "-f", str(TEMPLATE)]

    def prepare(self) -> None:
        """Write the files into a fresh private directory and check the template with them; raises
        ProxyError when HAProxy is missing, the descriptor limit too low or a value refused."""
        if self.haproxy[0] is None:
            raise ProxyError("haproxy is not installed")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        needed = 2 * self.connection_caps()[0] + 200  # a client and a server side each
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ProxyError(
                f"PROXY_MAX_CONNECTIONS={self.limits.max_connections} needs about {needed} file descriptors "
                f"but the hard limit (ulimit -Hn) is {hard}: lower PROXY_MAX_CONNECTIONS or raise the limit"
            )
        self.directory = process_directory("front-door")  # 0700
        self.write_files()
        if (check := self.check()).returncode != 0:
            raise ProxyError(f"haproxy refuses the front door's values ({TEMPLATE}):\n{check.stderr.strip()}")

    def serves_api(self) -> bool:
        return api_runs(self.repository, self.public.get("api", 0))

    def clean_up(self) -> None:
        """Remove the private directory (key and maps)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
