"""The front door's refusals as Prometheus metrics, read from HAProxy's own counters.
Why by hand: `http.client` has no unix-socket transport (`_UnixConnection`), and HAProxy's exporter
counts answers, not why the door gave them: the reasons come from its frontends' and backends' series.

HAProxy's built-in Prometheus exporter serves its counters on a 0600 unix socket in the front
door's private directory (`fe_stats`; a stats socket's `show acl` would print the admin key file);
the stream gate serves its own. The supervisor serves `render()` at GET :TRITON_PROBE_PORT/metrics:
`proxy_requests_refused_total{frontend, reason}`, `proxy_requests_total{frontend}` and
`proxy_queue_waiting{frontend, backend}`, per public frontend (http, grpc, api, metrics, probe);
what each reason counts: docs/metrics.md, "The front door (HAProxy)".
"""

from __future__ import annotations

import functools
import http.client
import json
import socket
import subprocess
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

EXPORTER_QUERY = "/metrics?scope=frontend&scope=backend"
# The public frontends (fe_<name>, docs/metrics.md): HAProxy's others (the exporter's own frontend,
# which counts every scrape as an answer of its own) are not exported.
FRONTENDS = ("http", "grpc", "api", "metrics", "probe")
# The route whose streams the stream gate queues (ops.stream_gate), by frontend and backend, and
# the backend of haproxy.cfg that answers a gRPC call refused for a full queue.
GATE_FRONTEND, GATE_BACKEND = "grpc", "be_grpc_stream"
GRPC_QUEUE_FULL_BACKEND = "be_grpc_queue_full"
# The public frontends whose rules answer 5xx only when a route's queue is full.
QUEUE_FULL_BY_5XX = ("http", "api")
REASONS = ("queue_full", "queue_timeout", "refused", "connection_cap", "bad_request")
REFUSED = "proxy_requests_refused_total"
RECEIVED = "proxy_requests_total"
WAITING = "proxy_queue_waiting"
# What each series means (its HELP line; docs/metrics.md has the table).
HELP = {
    REFUSED: "requests the front door answered itself, by reason (queue_full, queue_timeout, refused, "
    "connection_cap, bad_request)",
    RECEIVED: "requests (gRPC calls) the front door received, by frontend",
    WAITING: "requests waiting in the front door for a slot at tritonserver, by model route",
}


@functools.cache
def exporter_available(*haproxy: str) -> bool:
    """Whether this haproxy (its command) has the Prometheus exporter built in (`-vv` lists it)."""
    try:
        done = subprocess.run([*haproxy, "-vv"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "prometheus-exporter" in done.stdout


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout_s: float):
        super().__init__("localhost", timeout=timeout_s)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def scrape(socket_path: Path, timeout_s: float = 2.0) -> str:
    """HAProxy's exporter text (frontends and backends); raises OSError when it does not answer."""
    connection = _UnixConnection(socket_path, timeout_s)
    try:
        connection.request("GET", EXPORTER_QUERY)
        response = connection.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise OSError(f"HAProxy's exporter answered {response.status}")
        return body
    except http.client.HTTPException as error:
        raise OSError(f"HAProxy's exporter: {error}") from None
    finally:
        connection.close()


def gate_counters(socket_path: Path, timeout_s: float = 2.0) -> dict[str, int]:
    """The stream gate's refusals by reason and its waiting streams (JSON on its unix socket);
    raises OSError when it does not answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(socket_path))
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return json.loads(answer)


def _samples(text: str):
    """(name, labels, value) of every sample in Prometheus text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def _frontend_of(backend: str, frontends: set[str]) -> str | None:
    """The public frontend a backend serves: `be_http_sampler` -> http (by name, as haproxy.cfg names them)."""
    name = backend.removeprefix("be_")
    return next((f for f in sorted(frontends, key=len, reverse=True) if name == f or name.startswith(f + "_")), None)


def refusals(exporter_text: str, gate: dict[str, int] | None = None) -> dict[str, dict]:
    """Per public frontend (fe_<name>): {reason: count}, "received" and "waiting" {backend: n};
    `gate`: the stream gate's counters, added to its route's."""
    fe, be = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(float))
    for name, labels, value in _samples(exporter_text):
        proxy = labels.get("proxy", "")
        key = name + (f":{labels['code']}" if "code" in labels else "")
        if name.startswith("haproxy_frontend_") and proxy.removeprefix("fe_") in FRONTENDS:
            fe[proxy.removeprefix("fe_")][key] += value
        elif name.startswith("haproxy_backend_") and proxy.startswith("be_"):
            be[proxy][key] += value
    out = {}
    answering = be.pop(GRPC_QUEUE_FULL_BACKEND, {})  # no server behind it: nothing waits there
    for frontend, counters in fe.items():
        backends = {b: c for b, c in be.items() if _frontend_of(b, set(fe)) == frontend}
        own_5xx = counters["haproxy_frontend_http_responses_total:5xx"] - sum(
            c["haproxy_backend_http_responses_total:5xx"] for c in backends.values()
        )
        answered = (
            counters["haproxy_frontend_requests_denied_total"] + counters["haproxy_frontend_intercepted_requests_total"]
        )
        queue_full = max(0.0, own_5xx) if frontend in QUEUE_FULL_BY_5XX else 0.0
        refused = max(0.0, answered - queue_full)  # a backend's answer is not the frontend's interception
        if _frontend_of(GRPC_QUEUE_FULL_BACKEND, set(fe)) == frontend:
            queue_full = answering.get("haproxy_backend_http_requests_total", 0.0)
        out[frontend] = {
            "queue_full": queue_full,
            "queue_timeout": sum(c["haproxy_backend_connection_errors_total"] for c in backends.values()),
            "refused": refused,
            "connection_cap": counters["haproxy_frontend_denied_connections_total"]
            + counters["haproxy_frontend_denied_sessions_total"],
            "bad_request": counters["haproxy_frontend_request_errors_total"],
            "received": counters["haproxy_frontend_http_requests_total"],
            "waiting": {b: c["haproxy_backend_current_queue"] for b, c in backends.items()},
        }
    if gate and GATE_FRONTEND in out:
        route = out[GATE_FRONTEND]
        route["queue_full"] += gate["queue_full"]
        route["queue_timeout"] += gate["queue_timeout"]
        route["waiting"][GATE_BACKEND] = route["waiting"].get(GATE_BACKEND, 0.0) + gate["waiting"]
        keyed = f"{GATE_BACKEND}_keyed"
        route["waiting"][keyed] = route["waiting"].get(keyed, 0.0) + gate.get("keyed_waiting", 0)
    return out


def counts(stats_socket: Path, gate_socket: Path | None = None) -> dict[str, dict]:
    """`refusals` read now from HAProxy's exporter and the stream gate (when it runs)."""
    return refusals(scrape(stats_socket), gate_counters(gate_socket) if gate_socket else None)


def exposition(by_frontend: dict[str, dict]) -> str:
    """The series of the module docstring (docs/metrics.md) as Prometheus text, written by prometheus_client."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import generate_latest

    refused = CounterMetricFamily(REFUSED, HELP[REFUSED], labels=["frontend", "reason"])
    received = CounterMetricFamily(RECEIVED, HELP[RECEIVED], labels=["frontend"])
    waiting = GaugeMetricFamily(WAITING, HELP[WAITING], labels=["frontend", "backend"])
    for frontend, counts in sorted(by_frontend.items()):
        for reason in REASONS:
            refused.add_metric([frontend, reason], counts[reason])
        received.add_metric([frontend], counts["received"])
        for backend, now in sorted(counts["waiting"].items()):
            waiting.add_metric([frontend, backend], now)
    return generate_latest(SimpleNamespace(collect=lambda: [refused, received, waiting])).decode()


def render(stats_socket: Path, gate_socket: Path | None = None) -> str:
    """What GET /metrics on the probe port answers: the front door's refusals, read now."""
    return exposition(counts(stats_socket, gate_socket))
