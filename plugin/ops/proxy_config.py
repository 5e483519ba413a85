"""The front door's HAProxy configuration, generated from the settings and the model configs.

HAProxy owns the public ports; tritonserver, the stream gate and the supervisor's probe listen
on loopback behind it. What each part of the generated config defends (docs/operations.md, "The
front door"):

- connection caps (all ports together, and per client address per port) and timeouts on the
  request head, idle keep-alive connections and silent clients: idle-connection floods;
- an allow-list of routes: everything but health, metadata, statistics and inference needs the
  admin key, which the proxy checks against a 0600 file and replaces with tritonserver's
  internal key; no client can register the server's own stub regions as shared memory;
- no chunked or compressed bodies, one strict value per framing header (Content-Length,
  Inference-Header-Content-Length), a body cap per route (derived from each model's
  config.pbtxt), and the JSON of HTTP /infer and /generate bodies parsed strictly and checked
  against the request's shape before any byte reaches the server (json_checks.lua: malformed or
  wrongly typed JSON, declared shapes larger than what carries their values, deep nesting);
- every answer is JSON (RFC 8259) with its content type: HAProxy's own errors, tritonserver's
  plain-text 404 / 405, and the checks' messages (escaped); unknown paths are 404, a known path
  with the wrong method 405, an admin path without the key 403;
- per model route, at most PROXY_MAX_IN_FLIGHT requests in tritonserver: the next ones wait in
  the proxy, which sheds them with 503 / UNAVAILABLE beyond PROXY_MAX_QUEUE waiting or after
  PROXY_QUEUE_TIMEOUT_S, before their bodies reach the server;
- gRPC ModelStreamInfer goes through the stream gate (ops.stream_gate), which bounds the
  requests a stream has open; HTTP/2 streams per connection are capped;
- access logs sampled 1 in PROXY_LOG_SAMPLE, never blocking the proxy.

`render(plan)` is a pure function of a `ProxyPlan`; `ops.proxy` writes it and runs HAProxy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, make_dataclass, replace
from pathlib import Path

from ..model_config import dims, is_decoupled, read_config_file, string_parameters
from ..sampling.admin import ADMIN_HEADER, ADMIN_KEY_PARAMETER, GRPC_RESTRICTED_PREFIX, WRONG_KEYS_PER_MINUTE
from ..sampling.refusals import RETRY_MARKER
from . import settings
from .server_process import ADMIN_KEY_CHARACTERS, MIN_ADMIN_KEY_CHARS

LUA_CHECKS = Path(__file__).resolve().parent / "haproxy" / "json_checks.lua"
GRPC_SERVICE = "/inference.GRPCInferenceService/"
# Methods anyone may call; every other method needs the admin key.
GRPC_PUBLIC_METHODS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "ModelInfer",
    "ModelStreamInfer",
)
# The Python backend's stub regions: their names all start with this (shm_cleanup.DEFAULT_STUB_PREFIX).
STUB_REGION_PREFIX = "triton_python_backend_shm_region"
DTYPE_BYTES = {
    "TYPE_BOOL": 1,
    "TYPE_UINT8": 1,
    "TYPE_INT8": 1,
    "TYPE_UINT16": 2,
    "TYPE_INT16": 2,
    "TYPE_FP16": 2,
    "TYPE_BF16": 2,
    "TYPE_UINT32": 4,
    "TYPE_INT32": 4,
    "TYPE_FP32": 4,
    "TYPE_UINT64": 8,
    "TYPE_INT64": 8,
    "TYPE_FP64": 8,
}
# The config parameters that bound a variable (-1) input dimension, by preference.
VARIABLE_DIM_BOUNDS = ("max_vocab_size", "kv_budget_tokens")
# A model whose config bounds no variable dimension: its bodies may be this large.
UNBOUNDED_MODEL_BODY_BYTES = 64 * 2**20
# Bytes an integer may take as JSON text (sign, 10 digits, comma) against 4 as binary: decoupled
# models take JSON bodies on HTTP /generate.
JSON_TEXT_FACTOR = 3
BODY_SLACK_BYTES = 64 * 1024  # scalars, tensor names and the rest of a body beside its largest inputs
OTHER_BODY_BYTES = 64 * 1024  # any other route (admin JSON bodies)
# What a client without the key reads (the header's name follows).
RESTRICTED = "this API is restricted: it needs the header"
# What a shed client reads: refused at once (the queue is full) or after waiting out the queue.
QUEUE_FULL = f"server busy: the queue for this model is full, {RETRY_MARKER}"
QUEUE_TIMEOUT = (
    f"server unavailable: no slot freed within the queue timeout, or the server is restarting; {RETRY_MARKER}"
)


def over_share(requests_per_ip: int) -> str:
    """The refusal a client reads past its address's share of a model route."""
    return f"too many requests from this address: at most {requests_per_ip} at once per model route; {RETRY_MARKER}"


# The statuses HAProxy may answer itself (parse errors, timeouts, no server): each as JSON.
PROXY_ERROR_STATUSES = {
    400: "bad request",
    403: "forbidden",
    404: "not found",
    405: "method not allowed",
    408: "the request did not arrive in time",
    410: "gone",
    413: "request too large",
    425: "too early",
    429: "too many requests",
    500: "internal proxy error",
    501: "not implemented",
    502: "bad gateway: the server did not answer",
    503: "service unavailable",
    504: "gateway timeout: the server did not answer in time",
}
# Triton's HTTP routes (its v2 protocol and extensions) that anyone may use, by method.
PUBLIC_READ_PATHS = ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/stats")
PUBLIC_READ_MODEL = r"^/v2/models/[^/]+(/versions/[0-9]+)?(/ready|/config|/stats)?$"
PUBLIC_POST_MODEL = r"^/v2/models/[^/]+(/versions/[0-9]+)?/(infer|generate|generate_stream)$"
# Triton's routes that need the admin key (repository, shared memory, tracing, logging).
ADMIN_PATHS = (
    r"^/v2/(repository|systemsharedmemory|cudasharedmemory|trace|logging)(/.*)?$",
    r"^/v2/models/[^/]+(/versions/[0-9]+)?/trace/setting$",
)
# The HTTP API's port (plugin/api): the body cap (the API's own default), and its errors in
# OpenAI's shape.
API_BODY_BYTES = 32 * 2**20
# The request head tritonserver accepts (longer ones it drops without an answer).
HEADER_BYTES = 16384
# Content-Length and Inference-Header-Content-Length: digits only, one value, well under 2^63.
LENGTH_PATTERN = "^[0-9]{1,12}$"
# A /generate body is parsed whole: it must fit the proxy's buffer beside the request's head.
GENERATE_JSON_BYTES = 262144 - 16384
SIDE_PORT_CONNECTIONS = 64  # the metrics and probe ports each: scrapers and kubelets
# One address's share of a side port, and the time it has to send a request's head there: a
# kubelet or a scraper sends one short request at a time.
SIDE_PORT_CONNECTIONS_PER_IP = 8
SIDE_PORT_REQUEST_TIMEOUT_S = 2.0
# What an admin key may look like (the characters tritonserver's flags carry, at least the
# shortest key the launcher accepts): anything else, a NUL included, never matches. Wrong keys
# from one address: at most sampling.admin.WRONG_KEYS_PER_MINUTE a minute.
ADMIN_KEY_PATTERN = rf"^{ADMIN_KEY_CHARACTERS}{{{MIN_ADMIN_KEY_CHARS},512}}$"
# HAProxy's buffer per direction of a connection, taken only while data passes, and the HTTP/2
# window it grants each stream: with 2.6's defaults (16 KiB, 64 KiB) a large gRPC call spends most
# of its extra time through the proxy waiting on window updates and buffer turns. Memory stays
# bounded (2 x 256 KiB per connection moving data, under maxconn): a stream whose buffer is full
# stops its connection's reads. Larger buffers gained little more; larger HTTP/2 frames cost the
# small step calls (a frame is forwarded only once whole).
BUFFER_BYTES = 262144
H2_WINDOW_BYTES = 2**20


@dataclass(frozen=True)
class ModelRoute:
    """What the proxy needs of one model: its name, whether it is decoupled (generate-like, long
    requests on their own route) and the largest body a request to it may carry."""

    name: str
    decoupled: bool
    body_limit_bytes: int
    input_spec: str = ""  # "name:DATATYPE ..." of its inputs (the /generate checks read it)


def config_parameters(config_path: Path) -> dict[str, str]:
    """A model's `parameters` (key -> string value) from its config.pbtxt."""
    return string_parameters(read_config_file(config_path))


def model_route(config_path: Path, json_header_bytes: int) -> ModelRoute:
    """A model's route from its config.pbtxt: max_batch_size rows of every input at its largest
    (a -1 dimension bounded by `max_vocab_size` or `kv_budget_tokens`), times the JSON text factor
    for decoupled models, plus slack for the JSON header and scalars."""
    config = read_config_file(config_path)
    name = Path(config_path).parent.name  # Triton requires the folder's name
    rows = max(1, int(config.get("max_batch_size", 0)))
    decoupled = is_decoupled(config)
    parameters = string_parameters(config)
    bound = next((int(parameters[key]) for key in VARIABLE_DIM_BOUNDS if parameters.get(key, "").isdigit()), None)
    spec = input_spec(config)
    row_bytes = 0
    for entry in config.get("input", []):
        if "data_type" not in entry or not dims(entry):
            continue
        elements = 1
        for dim in dims(entry):
            if dim < 0 and bound is None:
                return ModelRoute(name, decoupled, UNBOUNDED_MODEL_BODY_BYTES, spec)
            elements *= bound if dim < 0 else dim
        row_bytes += elements * DTYPE_BYTES.get(entry["data_type"], 8)
    factor = JSON_TEXT_FACTOR if decoupled else 1
    body_limit = rows * row_bytes * factor + json_header_bytes + BODY_SLACK_BYTES
    return ModelRoute(name, decoupled, body_limit, spec)


def model_routes(repository: Path, json_header_bytes: int) -> list[ModelRoute]:
    """Every model of a repository (each folder with a config.pbtxt), by name."""
    return [model_route(path, json_header_bytes) for path in sorted(Path(repository).glob("*/config.pbtxt"))]


class _LimitsMethods:
    """What ProxyLimits derives from its fields."""

    @classmethod
    def from_settings(cls) -> ProxyLimits:
        """The limits the environment sets."""
        return cls(**{name: setting.value() for name, setting in LIMIT_SETTINGS.items()})

    @property
    def total_connections(self) -> int:
        """The global cap: the HTTP and gRPC ports' shares plus the metrics and probe ports'."""
        return self.max_connections + 2 * SIDE_PORT_CONNECTIONS

    def descriptors_needed(self) -> int:
        """File descriptors HAProxy needs for all its connections (a client and a server side each)."""
        return 2 * self.total_connections + 200


# The proxy's numbers are the PROXY_* settings (docs/settings.md), each a field named after its
# variable: PROXY_MAX_QUEUE is `max_queue`.
LIMIT_SETTINGS = {
    name.removeprefix("PROXY_").lower(): setting
    for name, setting in vars(settings).items()
    if name.startswith("PROXY_") and isinstance(setting, settings.Setting)
}
ProxyLimits = make_dataclass(
    "ProxyLimits",
    [(name, type(setting.default), field(default=setting.default)) for name, setting in LIMIT_SETTINGS.items()],
    bases=(_LimitsMethods,),
    frozen=True,
)
ProxyLimits.__module__ = __name__
ProxyLimits.__doc__ = "The proxy's numbers: one field per PROXY_* setting, defaulting as the setting does."


@dataclass(frozen=True)
class ProxyPlan:
    """Everything the generated config names: ports, key files, model routes and limits.

    `public` and `internal` map "http", "grpc", "metrics" and "probe" (0: none) to ports; internal
    also has "stream_gate". The admin key file holds the user's key (one line, 0600; None: the
    admin APIs are open to anyone); the internal key is what tritonserver's restricted APIs expect,
    so the config file holding it is 0600 too."""

    public: dict[str, int]
    internal: dict[str, int]
    admin_key_file: Path | None
    internal_key: str
    routes: list[ModelRoute]
    limits: ProxyLimits = field(default_factory=ProxyLimits)
    admin_header: str = ADMIN_HEADER
    bind_address: str = "0.0.0.0"
    stream_gate: bool = True  # ModelStreamInfer through the stream gate, else straight to tritonserver
    json_checks: bool = True  # the JSON of /infer and /generate bodies checked by json_checks.lua
    side_bind_address: str = "0.0.0.0"  # the metrics and probe ports'
    stats_socket: Path | None = None  # HAProxy's Prometheus exporter on a 0600 unix socket (ops.proxy_metrics)

    @property
    def grpc_admin_header(self) -> str:
        """The header gRPC clients send the key in (Triton's restricted-protocol form)."""
        return GRPC_RESTRICTED_PREFIX + self.admin_header


def _seconds(value: float) -> str:
    return f"{max(1, round(value * 1000))}ms"


def _json_error(message: str) -> str:
    """A `content-type ... string ...` clause answering Triton's JSON error shape."""
    return f'content-type application/json string "{{\\"error\\":\\"{_json_escape(message)}\\"}}"'


def _quoted(text: str) -> str:
    """`text` escaped for a double-quoted HAProxy argument."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _json_escape(message: str) -> str:
    """`message` as the inside of a JSON string, written into a quoted HAProxy argument."""
    return _quoted(json.dumps(message)[1:-1])


def input_spec(config: dict) -> str:
    """ "name:DATATYPE ..." for each input of a model config (the /generate checks' argument)."""
    pairs = [
        (entry["name"], entry.get("data_type", "TYPE_INVALID").removeprefix("TYPE_"))
        for entry in config.get("input", [])
    ]
    # the request parameter a control request carries its admin key in: a string beside the inputs
    pairs.append((ADMIN_KEY_PARAMETER, "STRING"))
    return " ".join(f"{name}:{'BYTES' if data_type == 'STRING' else data_type}" for name, data_type in pairs)


def _openai_error(message: str, kind: str) -> str:
    """A `content-type ... string ...` clause answering OpenAI's JSON error shape."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})
    return f'content-type application/json string "{_quoted(body)}"'


def _grpc_error(code: int, message: str) -> str:
    """An `http-request return` answering a gRPC call with status `code` (trailers-only)."""
    return f'http-request return status 200 hdr grpc-status {code} hdr grpc-message "{message}"'


def _model_path(names: list[str], suffix: str) -> str:
    escaped = "|".join(re.escape(name) for name in names)
    return f"^/v2/models/({escaped})(/versions/[0-9]+)?{suffix}$"


def _frontend_head(
    name: str, address: str, port: int, table: str, maxconn: int, per_ip: int, h2: bool = False
) -> list[str]:
    return [
        f"frontend {name}",
        f"    bind {address}:{port}" + (" proto h2" if h2 else ""),
        f"    maxconn {maxconn}",
        f"    tcp-request connection track-sc0 src table {table}",
        f"    tcp-request connection reject if {{ sc0_conn_cur({table}) gt {per_ip} }}",
    ]


def _table(name: str) -> list[str]:
    return [f"backend {name}", "    stick-table type ip size 100k expire 60s store conn_cur", ""]


# The backend that answers a gRPC call refused because its route's queue is full (trailers-only, so
# HAProxy's frontend counters cannot tell it from the other refusals; its own request count can).
GRPC_QUEUE_FULL_BACKEND = "be_grpc_queue_full"
# The model routes' backends, each with a table counting every address's requests there (its share).
SHARED_BACKENDS = ("be_http_sampler", "be_http_generate", "be_grpc_infer", "be_grpc_stream", "be_api")


def _share_rules(backend_acls: dict[str, str], refuse: str, limit: int, unless: str = "") -> list[str]:
    """An address's requests at each model route are counted (sc2, while each lasts: waiting in the
    proxy or in tritonserver); past `limit` at one route the next is refused (`refuse`, an action),
    unless the condition `unless` holds (another answer was chosen for it)."""
    lines = ["    # one address's share of each model route"]
    lines += [
        f"    http-request track-sc2 src table st_share_{backend} if {acl}" for backend, acl in backend_acls.items()
    ]
    lines.append(f"    {refuse} if {{ sc2_trackers gt {limit} }}" + (f" !{unless}" if unless else ""))
    return lines


def _admin_key_rules(header: str, key_file: Path | None, refuse: str) -> list[str]:
    """The key check of a frontend: `admin_ok` when `header` holds exactly the key; a wrong key
    counts against its address, which is refused (`refuse`, a rule's action) past
    WRONG_KEYS_PER_MINUTE."""
    if not key_file:
        return ["    acl admin_ok always_true"]
    return [
        f"    acl has_key req.fhdr({header}) -m found",
        f"    acl key_wellformed req.fhdr({header}) -m reg {ADMIN_KEY_PATTERN}",
        f"    acl key_matches req.fhdr({header}) -m str -f {key_file}",
        "    acl admin_ok var(txn.key_ok) -m bool",
        "    http-request set-var(txn.key_ok) bool(true) if key_wellformed key_matches",
        "    # wrong keys are counted per address, and past the limit refused before they are checked",
        "    http-request track-sc1 src table st_keys if has_key",
        f"    {refuse} if has_key {{ sc1_gpc0_rate(st_keys) gt {WRONG_KEYS_PER_MINUTE} }}",
        "    http-request sc-inc-gpc0(1) if has_key !admin_ok",
    ]


def _shed_backend(
    name: str, port: int, limits: ProxyLimits, queue_timeout_s: float, h2: bool = False, extra: tuple = ()
) -> list[str]:
    """A model route's backend: at most max_in_flight requests at tritonserver, the rest queued."""
    return [
        f"backend {name}",
        f"    timeout queue {_seconds(queue_timeout_s)}",
        *extra,
        f"    server triton 127.0.0.1:{port}" + (" proto h2" if h2 else "") + f" maxconn {limits.max_in_flight}",
        "",
    ]


def render(plan: ProxyPlan) -> str:
    """The haproxy.cfg text for `plan` (HAProxy 2.6; `haproxy -c` validates it)."""
    limits, public, internal = plan.limits, plan.public, plan.internal
    routes = plan.routes
    samplers = [route.name for route in routes if not route.decoupled]
    generators = [route.name for route in routes if route.decoupled]
    key_file = plan.admin_key_file
    lines = [
        "# Generated by triton_sampling_mask.ops.proxy_config: edit the settings, not this file.",
        "global",
        f"    maxconn {limits.total_connections}",
        f"    log stdout format raw sample 1:{max(1, limits.log_sample)} local0 info",
        f"    tune.bufsize {BUFFER_BYTES}",
        f"    tune.h2.initial-window-size {H2_WINDOW_BYTES}",
        f"    tune.h2.max-concurrent-streams {limits.streams_per_connection}",
        *(["    tune.lua.maxmem 64", f"    lua-load-per-thread {LUA_CHECKS}"] if plan.json_checks else []),
        "    hard-stop-after 10s",
        "    # no stats socket: its 'show acl' would print the admin key",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option dontlognull",
        '    log-format "%ci [%tr] %ft %b %TR/%Tw/%Tc/%Tr/%Ta %ST %U/%B %tsc %ac/%fc/%bc/%sc %{+Q}r"',
        "    timeout connect 5s",
        f"    timeout http-request {_seconds(limits.request_timeout_s)}",
        f"    timeout http-keep-alive {_seconds(limits.idle_timeout_s)}",
        f"    timeout client {_seconds(limits.client_timeout_s)}",
        f"    timeout server {_seconds(limits.server_timeout_s)}",
        f"    timeout queue {_seconds(limits.queue_timeout_s)}",
        "    timeout client-fin 5s",
        "    timeout server-fin 5s",
        *(f"    http-error status {status} " + _json_error(text) for status, text in PROXY_ERROR_STATUSES.items()),
        "",
        *_table("st_http"),
        *_table("st_grpc"),
        *_table("st_side"),
        "backend st_keys",
        "    stick-table type ip size 100k expire 60s store gpc0,gpc0_rate(60s)",
        "",
        *(line for backend in SHARED_BACKENDS for line in _table(f"st_share_{backend}")),
    ]

    # ---- HTTP ----
    half = max(1, limits.max_connections // 2)
    lines += _frontend_head("fe_http", plan.bind_address, public["http"], "st_http", half, limits.connections_per_ip)
    lines += [
        *_admin_key_rules(
            plan.admin_header,
            key_file,
            "http-request deny deny_status 429 " + _json_error("too many wrong admin keys from this address"),
        ),
        "    acl is_read method GET HEAD",
        "    acl is_post method POST",
        "    acl has_ihcl req.fhdr(inference-header-content-length) -m found",
        f"    acl r_read path {' '.join(PUBLIC_READ_PATHS)}",
        f"    acl r_read path_reg {PUBLIC_READ_MODEL}",
        f"    acl r_post path_reg {PUBLIC_POST_MODEL}",
        *(f"    acl r_admin path_reg {pattern}" for pattern in ADMIN_PATHS),
    ]
    if samplers:
        lines.append(f"    acl r_sampler path_reg {_model_path(samplers, '/infer')}")
    if generators:
        lines.append(f"    acl r_generate path_reg {_model_path(generators, '/(infer|generate|generate_stream)')}")
    lines += [
        r"    acl r_infer path_reg ^/v2/models/[^/]+(/versions/[0-9]+)?/infer$",
        r"    acl r_register path_reg ^/v2/(system|cuda)sharedmemory/region/[^/]+/register$",
        "    # one strict value per framing header: two copies, or a value HAProxy and tritonserver",
        "    # could read apart (signs, fractions, overflow), would let a body past its cap or its check",
        "    http-request deny deny_status 400 "
        + _json_error("send one Content-Length, of digits only")
        + " if { req.fhdr_cnt(content-length) gt 1 } or { req.fhdr(content-length) -m found }"
        + f" !{{ req.fhdr(content-length) -m reg {LENGTH_PATTERN} }}",
        "    http-request deny deny_status 400 "
        + _json_error("send one Inference-Header-Content-Length, of digits only")
        + " if { req.fhdr_cnt(inference-header-content-length) gt 1 }"
        + f" or has_ihcl !{{ req.fhdr(inference-header-content-length) -m reg {LENGTH_PATTERN} }}",
        "    # tritonserver drops a request whose headers pass its own limit (the client saw a 502)",
        "    http-request deny deny_status 431 "
        + _json_error(f"request headers over {HEADER_BYTES} bytes")
        + f" if {{ req.hdrs,length gt {HEADER_BYTES} }}",
        "    # framing no cap can see: chunked bodies, and compressed ones (Triton would inflate them)",
        "    http-request deny deny_status 400 "
        + _json_error("chunked request bodies are not accepted: send Content-Length")
        + " if { req.hdr(transfer-encoding) -m found }",
        "    http-request deny deny_status 400 "
        + _json_error("compressed request bodies are not accepted")
        + " if { req.hdr(content-encoding) -m found }",
        "    http-request deny deny_status 400 "
        + _json_error(f"send one '{plan.admin_header}' header")
        + f" if {{ req.fhdr_cnt({plan.admin_header}) gt 1 }}",
        "    # the routes: unknown paths 404, a known one with another method 405, admin ones need the key",
        "    http-request deny deny_status 404 "
        + _json_error("not found: no such route")
        + " unless r_read or r_post or r_admin",
        "    http-request return status 405 "
        + _json_error("method not allowed: use GET or HEAD")
        + ' hdr allow "GET, HEAD" if r_read !is_read',
        "    http-request return status 405 "
        + _json_error("method not allowed: use POST")
        + ' hdr allow "POST" if r_post !is_post',
        "    http-request deny deny_status 403 "
        + _json_error(f"{RESTRICTED} '{plan.admin_header}'")
        + " if r_admin !admin_ok",
        "    # the server's own stub regions are never a client's shared memory",
        "    http-request wait-for-body time " + _seconds(limits.request_timeout_s) + " if r_register",
        "    http-request deny deny_status 403 "
        + _json_error("the server's own shared-memory regions cannot be registered")
        + f" if r_register {{ req.body -m sub {STUB_REGION_PREFIX} }} or r_register {{ path -m sub {STUB_REGION_PREFIX} }}",
        "    http-request deny deny_status 400 "
        + _json_error("\\u escapes are not accepted when registering shared memory")
        + ' if r_register { req.body -m sub "\\\\u" }',
        "    # body caps, checked on Content-Length before any byte is read",
    ]
    for index, route in enumerate(routes):
        suffix = "/(infer|generate|generate_stream)" if route.decoupled else "/infer"
        lines += [
            f"    acl r_model_{index} path_reg {_model_path([route.name], suffix)}",
            "    http-request deny deny_status 413 "
            + _json_error(f"request body over {route.body_limit_bytes} bytes for model '{route.name}'")
            + f" if r_model_{index} {{ req.body_size gt {route.body_limit_bytes} }}",
        ]
    model_acls = " ".join(f"!r_model_{index}" for index in range(len(routes)))
    lines += [
        "    http-request deny deny_status 413 "
        + _json_error(f"request body over {OTHER_BODY_BYTES} bytes")
        + f" if {model_acls} {{ req.body_size gt {OTHER_BODY_BYTES} }}",
    ]
    if routes:
        header_cap = limits.json_header_bytes
        lines += [
            "    # the JSON part of an /infer body is read and checked first; tensors beyond it go binary",
            f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)} if r_infer",
            "    http-request set-var(txn.json_bytes) req.fhdr(inference-header-content-length) if r_infer has_ihcl",
            "    http-request set-var(txn.json_bytes) req.body_size if r_infer !has_ihcl",
            "    http-request deny deny_status 413 "
            + _json_error(
                f"the JSON part of an /infer body may be {header_cap} bytes at most: send tensors as binary data"
            )
            + f" if r_infer {{ var(txn.json_bytes) -m int gt {header_cap} }}",
            "    http-request deny deny_status 408 "
            + _json_error("the JSON part of the body did not arrive in time")
            + " if r_infer { req.body_len,sub(txn.json_bytes) lt 0 }",
            *(["    http-request lua.check_infer_json if r_infer"] if plan.json_checks else []),
        ]
    decoupled = [route.name for route in routes if route.decoupled]
    if decoupled:  # tritonserver answers them 501: a client error, said as one
        lines.append(
            "    http-request deny deny_status 400 "
            + _json_error("this model is decoupled: HTTP clients call its generate or generate_stream route")
            + f" if {{ path_reg {_model_path(decoupled, '/infer')} }}"
        )
    for index, route in enumerate(routes):  # every model takes the generate extension's JSON
        lines += [
            f"    acl r_json_{index} path_reg {_model_path([route.name], '/(generate|generate_stream)')}",
            "    http-request deny deny_status 413 "
            + _json_error(
                f"a generate body may be {GENERATE_JSON_BYTES} bytes at most (the proxy checks it whole): "
                "send longer requests to /infer with binary tensors, or over gRPC"
            )
            + f" if r_json_{index} {{ req.body_size gt {GENERATE_JSON_BYTES} }}",
            f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)} if r_json_{index}",
        ]
        if plan.json_checks:
            lines += [
                f'    http-request lua.check_generate_json "{route.input_spec}" generate_stream'
                f" if r_json_{index} {{ path -m end /generate_stream }}",
                f'    http-request lua.check_generate_json "{route.input_spec}" generate'
                f" if r_json_{index} !{{ path -m end /generate_stream }}",
            ]
    lines += [
        "    http-request deny deny_status 400 content-type application/json "
        + 'lf-string "{\\"error\\":\\"%[var(txn.json_error),json(utf8s)]\\"}" if { var(txn.json_error) -m found }',
        "    # shedding: beyond max_queue waiting a request is refused at once, before its body is read",
    ]
    if samplers:
        lines.append(
            "    http-request deny deny_status 503 "
            + _json_error(QUEUE_FULL)
            + f" if r_sampler {{ queue(be_http_sampler) ge {limits.max_queue} }}"
        )
    if generators:
        lines.append(
            "    http-request deny deny_status 503 "
            + _json_error(QUEUE_FULL)
            + f" if r_generate {{ queue(be_http_generate) ge {limits.max_queue} }}"
        )
    lines += [
        # decided once: the set-header below changes what admin_ok reads
        "    http-request set-var(txn.admin) bool(true) if admin_ok",
        f"    http-request set-header {plan.admin_header} {plan.internal_key} if {{ var(txn.admin) -m bool }}",
        f"    http-request del-header {plan.admin_header} unless {{ var(txn.admin) -m bool }}",
    ]
    http_routes = {"be_http_sampler": "r_sampler"} if samplers else {}
    http_routes |= {"be_http_generate": "r_generate"} if generators else {}
    lines += _share_rules(
        http_routes,
        "http-request deny deny_status 429 " + _json_error(over_share(limits.requests_per_ip)) + " hdr retry-after 1",
        limits.requests_per_ip,
    )
    lines += [
        "    # a request reaches a server slot only once its body (up to a buffer) is here, after every",
        "    # check: a client trickling bodies holds connections at the proxy, never the route's slots",
        f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)}",
    ]
    if samplers:
        lines.append("    use_backend be_http_sampler if r_sampler")
    if generators:
        lines.append("    use_backend be_http_generate if r_generate")
    lines += [
        "    default_backend be_http_other",
        "    # tritonserver's own 404 / 405 carry a JSON body under text/plain (a generate_stream",
        "    # refusal stays an event stream: its one event's data is the JSON error)",
        "    http-response set-header content-type application/json"
        + " if { status ge 400 } { res.hdr(content-type) -m beg text/plain }",
        "",
    ]
    shed_503 = "    http-error status 503 " + _json_error(QUEUE_TIMEOUT)
    lines += _shed_backend("be_http_sampler", internal["http"], limits, limits.queue_timeout_s, extra=(shed_503,))
    lines += _shed_backend("be_http_generate", internal["http"], limits, limits.server_timeout_s, extra=(shed_503,))
    lines += _shed_backend("be_http_other", internal["http"], limits, limits.queue_timeout_s, extra=(shed_503,))

    # ---- gRPC ----
    public_methods = " ".join(GRPC_SERVICE + method for method in GRPC_PUBLIC_METHODS)
    lines += _frontend_head(
        "fe_grpc", plan.bind_address, public["grpc"], "st_grpc", half, limits.grpc_connections_per_ip, h2=True
    )
    lines += [
        f"    timeout client {_seconds(limits.server_timeout_s)}",
        *_admin_key_rules(
            plan.grpc_admin_header, key_file, _grpc_error(8, "too many wrong admin keys from this address")
        ),
        f"    acl g_public path {public_methods}",
        f"    acl g_infer path {GRPC_SERVICE}ModelInfer",
        f"    acl g_stream path {GRPC_SERVICE}ModelStreamInfer",
        f"    acl g_register path {GRPC_SERVICE}SystemSharedMemoryRegister {GRPC_SERVICE}CudaSharedMemoryRegister",
        "    # a compressed message would hide its body from the checks below: one grpc-encoding at most,",
        "    # and it says identity (two copies could be read apart by the proxy and the server)",
        "    "
        + _grpc_error(3, "compressed gRPC messages are not accepted: send one grpc-encoding, identity")
        + " if { req.fhdr_cnt(grpc-encoding) gt 1 }"
        + " or { req.fhdr(grpc-encoding) -m found } !{ req.fhdr(grpc-encoding) -m str identity }",
        "    "
        + _grpc_error(3, f"send one '{plan.grpc_admin_header}' header")
        + f" if {{ req.fhdr_cnt({plan.grpc_admin_header}) gt 1 }}",
        "    " + _grpc_error(7, f"{RESTRICTED} '{plan.grpc_admin_header}'") + " unless g_public or admin_ok",
        f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)} if g_register",
        "    "
        + _grpc_error(7, "the server's own shared-memory regions cannot be registered")
        # hex: the body is a binary gRPC frame, and as a string it would end at its first zero byte
        + f" if g_register {{ req.body,hex -m sub {STUB_REGION_PREFIX.encode().hex().upper()} }}",
        # decided once: the set-header below changes what admin_ok reads
        "    http-request set-var(txn.admin) bool(true) if admin_ok",
        f"    http-request set-header {plan.grpc_admin_header} {plan.internal_key} if {{ var(txn.admin) -m bool }}",
        f"    http-request del-header {plan.grpc_admin_header} unless {{ var(txn.admin) -m bool }}",
        "    # a call reaches a server slot only once its first message is here: a stream that sent",
        "    # only headers waits at the proxy and is cut after the request timeout",
        f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)} if !g_stream",
        f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)} at-least 5 if g_stream",
        "    # refusals come once the call's message is in: answered before it, a client still sending",
        "    # may read the proxy's reset of its stream (CANCELLED) instead of the refusal; a full queue",
        f"    # is answered by {GRPC_QUEUE_FULL_BACKEND}, whose request count tells it from the other refusals",
        "    http-request set-var(txn.queue_full) bool(true)"
        f" if g_infer {{ queue(be_grpc_infer) ge {limits.max_queue} }}"
        f" or g_stream {{ queue(be_grpc_stream) ge {limits.max_queue} }}",
        *_share_rules(
            {"be_grpc_infer": "g_infer", "be_grpc_stream": "g_stream"},
            _grpc_error(8, over_share(limits.requests_per_ip)),
            limits.requests_per_ip,
            unless="{ var(txn.queue_full) -m bool }",
        ),
        f"    use_backend {GRPC_QUEUE_FULL_BACKEND} if {{ var(txn.queue_full) -m bool }}",
        "    use_backend be_grpc_infer if g_infer",
        "    use_backend be_grpc_stream if g_stream",
        "    default_backend be_grpc_other",
        "",
    ]
    # One client's stalled stream blocks the whole HTTP/2 connection it rides on toward the server:
    # no backend connection is ever shared between two clients.
    grpc_503 = f'    http-error status 503 hdr grpc-status 14 hdr grpc-message "{QUEUE_TIMEOUT}"'
    reuse = "    http-reuse never"
    lines += _shed_backend(
        "be_grpc_infer", internal["grpc"], limits, limits.queue_timeout_s, h2=True, extra=(reuse, grpc_503)
    )
    lines += _shed_backend(
        "be_grpc_stream",
        internal["stream_gate"] if plan.stream_gate else internal["grpc"],
        replace(limits, max_in_flight=0) if plan.stream_gate else limits,  # the gate queues streams (maxconn 0: none)
        limits.queue_timeout_s,
        h2=True,
        extra=(reuse, grpc_503, f"    timeout server {_seconds(limits.server_timeout_s)}"),
    )
    lines += _shed_backend(
        "be_grpc_other", internal["grpc"], limits, limits.queue_timeout_s, h2=True, extra=(reuse, grpc_503)
    )
    lines += [f"backend {GRPC_QUEUE_FULL_BACKEND}", "    " + _grpc_error(14, QUEUE_FULL), ""]

    # ---- the HTTP API (OpenAI and SGLang dialects): its own route, the same kinds of limits ----
    if public.get("api"):
        lines += _frontend_head("fe_api", plan.bind_address, public["api"], "st_http", half, limits.connections_per_ip)
        lines += [
            f"    timeout client {_seconds(limits.server_timeout_s)}",  # streamed completions are long
            "    http-request deny deny_status 400 "
            + _openai_error("send one Content-Length, of digits only", "invalid_request_error")
            + " if { req.fhdr_cnt(content-length) gt 1 } or { req.fhdr(content-length) -m found }"
            + f" !{{ req.fhdr(content-length) -m reg {LENGTH_PATTERN} }}",
            "    http-request deny deny_status 400 "
            + _openai_error("chunked or compressed request bodies are not accepted", "invalid_request_error")
            + " if { req.hdr(transfer-encoding) -m found } or { req.hdr(content-encoding) -m found }",
            "    http-request deny deny_status 413 "
            + _openai_error(f"request body over {API_BODY_BYTES} bytes", "invalid_request_error")
            + f" if {{ req.body_size gt {API_BODY_BYTES} }}",
            "    http-request return status 503 "
            + _openai_error(QUEUE_FULL, "overloaded")
            + f" hdr retry-after 1 if {{ queue(be_api) ge {limits.max_queue} }}",
            *_share_rules(
                {"be_api": "TRUE"},
                "http-request return status 429 "
                + _openai_error(over_share(limits.requests_per_ip), "rate_limit_exceeded")
                + " hdr retry-after 1",
                limits.requests_per_ip,
            ),
            f"    http-request wait-for-body time {_seconds(limits.request_timeout_s)}",
            "    default_backend be_api",
            "",
            "backend be_api",
            f"    timeout queue {_seconds(limits.queue_timeout_s)}",
            f"    timeout server {_seconds(limits.server_timeout_s)}",
            "    http-error status 503 " + _openai_error(QUEUE_TIMEOUT, "overloaded") + " hdr retry-after 1",
            f"    server api 127.0.0.1:{internal['api']} maxconn {limits.max_in_flight}",
            "",
        ]

    # ---- metrics and probe: GET only ----
    for name, paths in (("metrics", "/metrics"), ("probe", "/ready /live /status /metrics")):
        if not public.get(name):
            continue
        lines += _frontend_head(
            f"fe_{name}",
            plan.side_bind_address,
            public[name],
            "st_side",
            SIDE_PORT_CONNECTIONS,
            SIDE_PORT_CONNECTIONS_PER_IP,
        )
        lines += [
            f"    timeout http-request {_seconds(SIDE_PORT_REQUEST_TIMEOUT_S)}",
            "    http-request deny deny_status 404 "
            + _json_error("not found: no such route")
            + f" unless {{ path {paths} }}",
            "    http-request return status 405 "
            + _json_error("method not allowed: use GET or HEAD")
            + ' hdr allow "GET, HEAD" unless { method GET HEAD }',
            f"    default_backend be_{name}",
            "",
            f"backend be_{name}",
            f"    server local 127.0.0.1:{internal[name]} maxconn 16",
            "",
        ]
    if plan.stats_socket:  # the proxy's own counters: only this user can connect (ops.proxy_metrics)
        lines += [
            "frontend fe_stats",
            f"    bind unix@{plan.stats_socket} mode 600",
            "    http-request use-service prometheus-exporter",
            "",
        ]
    return "\n".join(lines) + "\n"
