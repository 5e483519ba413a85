"""The front door's processes, which the supervisor runs and restarts: HAProxy on the values
`ops.proxy` decides, the stream gate (ops.stream_gate) and the HTTP API (plugin/api), with their
command lines, and whether the API runs.

The API runs behind the proxy only, when the proxy has a public port for it, the repository has a
`generate` model and the `api` extra is installed; it listens on loopback, talks to tritonserver's
own gRPC port, and loads the generate model's `model_path` for its tokenizer.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

from ..model_config import read_config_file, string_parameters
from . import settings
from .child import HARD_LIMIT, Child
from .model_limits import model_routes

GENERATE_MODEL = "generate"  # the model the HTTP API serves
# HAProxy's environment beside the template's values: its 256 KiB buffers (tune.bufsize) come and go
# with each relayed chunk, more than its per-thread pool cache (512 KiB) keeps, and glibc's malloc
# would give each back to the kernel and fault it in again (a brk and a page fault per streamed
# token); with these thresholds freed memory stays for reuse, up to 32 MiB.
HAPROXY_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=33554432"}
# The API's flags an operator sets through the environment (docs/settings.md), by flag name; a
# switch is passed bare when on, a setting left to the API (None) not at all.
API_LIMITS = {
    "max-choices": settings.TRITON_API_MAX_CHOICES,
    "max-stop-strings": settings.TRITON_API_MAX_STOP_STRINGS,
    "max-model-len": settings.TRITON_API_MAX_MODEL_LEN,
    "max-prompt-chars": settings.TRITON_API_MAX_PROMPT_CHARS,
    "busy-timeout-s": settings.TRITON_API_BUSY_TIMEOUT_S,
    "tokenizer-threads": settings.TRITON_API_TOKENIZER_THREADS,
    "trust-request-chat-template": settings.TRITON_API_TRUST_REQUEST_CHAT_TEMPLATE,
}


def api_runs(repository: Path, public_port: int) -> bool:
    """Whether the HTTP API runs: a public port for it, a generate model, and its extra installed."""
    wanted = bool(public_port) and (Path(repository) / GENERATE_MODEL / "config.pbtxt").exists()
    return wanted and importlib.util.find_spec("fastapi") is not None


def api_command(door) -> list[str]:
    """The API on loopback behind `door` (an ops.proxy.FrontDoor), over tritonserver's gRPC port,
    with the generate model's checkpoint for its tokenizer, and the door's admin key file where
    trusted networks' keyless weight calls need it (TRITON_API_TRUSTED_NETWORKS)."""
    config = Path(door.repository) / GENERATE_MODEL / "config.pbtxt"
    model_path = string_parameters(read_config_file(config)).get("model_path", "") if config.exists() else ""
    trusted = door.admin_key is not None and settings.TRITON_API_TRUSTED_NETWORKS.value()
    limits = {flag: setting.value() for flag, setting in API_LIMITS.items()}
    return [
        *(sys.executable, "-m", "triton_sampling_mask.api", f"--triton-url=127.0.0.1:{door.internal['grpc']}"),
        *("--host=127.0.0.1", f"--port={door.internal['api']}"),
        # the API ends a body its client stopped sending as the proxy would (PROXY_CLIENT_TIMEOUT_S),
        # and caps bodies where the proxy does
        f"--client-timeout-s={door.limits.client_timeout_s}",
        f"--max-body-bytes={door.limits.api_max_body_bytes}",
        *(f"--{flag}={value}" for flag, value in limits.items() if value is not None and not isinstance(value, bool)),
        *(f"--{flag}" for flag, value in limits.items() if value is True),
        # what routers read of this replica: /health follows the supervisor's readiness, /v1/loads the engine's gauges
        f"--readiness-url=http://127.0.0.1:{door.internal['probe']}/ready",
        f"--metrics-url=http://127.0.0.1:{door.internal['metrics']}/metrics",
        *([f"--model-path={model_path}"] if model_path else []),
        *([f"--admin-key-file={door.directory / 'admin.key'}"] if trusted else []),
    ]


def gate_command(door) -> list[str]:
    """The gate's command line behind `door` (an ops.proxy.FrontDoor): the stream route's queue from
    its limits, keyed clients' on a port of their own, the largest body cap as the message cap, and
    the decoupled models as cancellable (they stop a cancelled request at their next step)."""
    limits, internal = door.limits, door.internal
    routes = model_routes(door.repository, limits.json_header_bytes)
    largest = min(max((route.body_limit_bytes for route in routes), default=2**31 - 1), 2**31 - 1)
    return [
        *(sys.executable, "-m", "triton_sampling_mask.ops.stream_gate", f"--max-message-bytes={largest}"),
        *(f"--listen=127.0.0.1:{internal['stream_gate']}", f"--upstream=127.0.0.1:{internal['grpc']}"),
        f"--max-open={limits.stream_max_open}",
        *(f"--max-streams={limits.max_in_flight}", f"--max-queue={limits.max_queue}"),
        f"--queue-timeout={limits.queue_timeout_s}",
        *([f"--counters-socket={door.gate_socket}"] if door.gate_socket else []),
        *(
            f"--keyed-listen=127.0.0.1:{internal['stream_gate_keyed']}",
            f"--keyed-max-streams={limits.keyed_max_in_flight}",
        ),
        *(f"--keyed-max-queue={limits.keyed_max_queue}", f"--keyed-queue-timeout={limits.keyed_queue_timeout_s}"),
        *(f"--cancellable={route.name}" for route in routes if route.decoupled),
    ]


def door_children(door, log_path: Path | None = None) -> list[Child]:
    """HAProxy behind `door` (an ops.proxy.FrontDoor; its values in its environment, and SIGUSR1
    stops it accepting while what is in flight finishes), the gate and the API: each dies with its
    parent and may hold as many descriptors as the hard limit allows (HAProxy: about two a connection)."""
    commands = [("haproxy", door.haproxy_command("-db"), {**door.environment(), **HAPROXY_MALLOC}, signal.SIGUSR1)]
    commands += [("stream gate", gate_command(door), None, signal.SIGTERM)] if door.stream_gate else []
    commands += [("http api", api_command(door), None, signal.SIGTERM)] if door.serves_api() else []
    common = {"log_path": log_path, "die_with_parent": True, "nofile": HARD_LIMIT, "nice": settings.TRITON_NICE.value()}
    return [Child(name, command, env=env, soft_stop=stop, **common) for name, command, env, stop in commands]
