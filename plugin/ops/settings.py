"""Every environment variable the server reads, declared once: name, type, default and meaning.

In the style of vLLM's `envs.py`: each setting is read when asked (`settings.TRITON_HTTP_PORT.value()`),
so a change to os.environ is seen at once, and an unset or empty variable gives the default. The
launcher, the supervisor, the allocator choice, docker/serve.sh (through `--shell`) and the Helm
chart's `server.env` read these names and no others; docs/settings.md is generated from here.

    python -m triton_sampling_mask.ops.settings --markdown > docs/settings.md
    python -m triton_sampling_mask.ops.settings --shell CUDA_POOL_BYTES GPU_COUNT   # NAME=value lines
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..sampling.refusals import DEFAULT_ROUTE_CAPACITY

T = TypeVar("T")
MIB = 2**20
SERVER, IMAGE = "server", "image"


@dataclass
class Setting(Generic[T]):
    """One environment variable: how its text is parsed, its default (a callable computes it when
    needed; None leaves it to the reader, described by `shown_default`) and what it means."""

    parse: Callable[[str], T]
    default: T | Callable[[], T] | None
    doc: str
    shown_default: str = ""
    scope: str = SERVER  # SERVER: the launcher and supervisor read it; IMAGE: docker/serve.sh does
    name: str = field(default="", init=False)  # the module attribute's name, set below

    def value(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The variable's value in `environ` (default: os.environ), parsed; the default when unset or empty."""
        text = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not text:
            return self.default() if callable(self.default) else self.default
        try:
            return self.parse(text)
        except ValueError as error:
            raise ValueError(f"{self.name}={text!r}: {error}") from None

    def default_text(self) -> str:
        """The default as docs/settings.md shows it."""
        if self.shown_default:
            return self.shown_default
        if isinstance(self.default, int) and self.default >= MIB and self.default % MIB == 0:
            return f"`{self.default}` ({self.default // MIB} MiB)"
        return f"`{self.default}`"


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError("a port is 0 to 65535")
    return port


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise ValueError("must be 1 or more")
    return number


def _switch(text: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if text.lower() not in words:
        raise ValueError("must be one of 1, true, yes, on, 0, false, no, off")
    return words[text.lower()]


def _non_negative(text: str) -> float:
    number = float(text)
    if not number >= 0:
        raise ValueError("must be a number, 0 or more")
    return number


def _visible_gpus() -> int:
    import torch  # only the image's sizing needs it, and only when GPU_COUNT is unset

    return torch.cuda.device_count()


# The largest request the sampler's config.pbtxt admits: max_batch_size 256 rows of max_vocab_size
# 262144 FP32 logits (tests/test_container_image.py checks these numbers against the config).
LARGEST_REQUEST_BYTES = 256 * 262144 * 4

MODEL_REPOSITORY = Setting(
    str, "model_repository", "the model repository to serve (the image's is /models, set by docker/serve.sh)"
)
TRITON_HTTP_PORT = Setting(_port, 8000, "the public HTTP port (the proxy's; tritonserver's own with `--no-proxy`)")
TRITON_GRPC_PORT = Setting(_port, 8001, "the public gRPC port (the proxy's; tritonserver's own with `--no-proxy`)")
TRITON_METRICS_PORT = Setting(
    _port, 8002, "the public metrics port, GET /metrics only (the proxy's; tritonserver's own with `--no-proxy`)"
)
TRITON_PROBE_PORT = Setting(_port, 8003, "the supervisor's /ready, /live and /status (through the proxy); 0: none")
# Kubelet httpGet probes and a Prometheus in another pod reach the pod's address; exec probes and
# a scraping sidecar need only loopback, and then nobody else can flood or read those ports.
TRITON_SIDE_PORTS_ADDRESS = Setting(
    str,
    "0.0.0.0",
    "the address the proxy binds the metrics and probe ports to: 127.0.0.1 keeps them on the pod or host",
)
TRITON_API_PORT = Setting(
    _port, 9000, "the HTTP API's public port (OpenAI and SGLang dialects over `generate`, behind the proxy); 0: none"
)
TRITON_API_KEY = Setting(
    str, "", "a key the HTTP API requires as `Authorization: Bearer` (read by its process; empty: none)"
)
# Clients that prove who they are (a trainer submitting its rollout batch from one host) get the
# PROXY_KEYED_* capacity instead of one address's share (docs/api.md, "Sizing for a trainer").
TRITON_CLIENT_KEYS_FILE = Setting(
    str,
    "",
    "a file of client keys, one `<name> <key>` a line (keys 32 to 512 letters, digits and ._~+/-; the file this "
    "user's or root's, readable by its owner only): a request sending one as `Authorization: Bearer <key>` on any "
    "public port gets its client's capacity (`PROXY_KEYED_*`) instead of its address's share, and waits where others "
    "are refused. "
    "`TRITON_API_KEY`, when set, is one more (named `api-key`); empty: no file",
    shown_default="none",
)
TRITON_API_TRUSTED_NETWORKS = Setting(
    str,
    "",
    "source networks (CIDRs, comma-separated) whose weight calls to the HTTP API need no admin key, for trainers "
    "that cannot send a header (AReaL, SkyRL); the API sends its copy of the admin key for them; empty: none",
    shown_default="none",
)
TRITON_API_FORWARDED_ALLOW_IPS = Setting(
    str,
    "127.0.0.1",
    "the proxies whose X-Forwarded-For the HTTP API takes as the client address (uvicorn's forwarded_allow_ips): "
    "the front door on loopback",
)
# The HTTP API's limits (docs/api.md, "Settings"): the launcher passes each to the API's flag of
# the same name (ops.door_commands); these defaults are the API's own (tests/test_door_commands.py).
TRITON_API_MAX_CHOICES = Setting(_positive, 256, "sequences one HTTP API request may ask for (prompts × `n`)")
TRITON_API_MAX_STOP_STRINGS = Setting(_positive, 64, "stop strings one HTTP API request may carry")
TRITON_API_MAX_MODEL_LEN = Setting(
    _positive, None, "the HTTP API's context length (prompt and new tokens)", shown_default="the checkpoint's"
)
TRITON_API_MAX_PROMPT_CHARS = Setting(
    _positive,
    None,
    "the longest prompt text (and chat content) the HTTP API takes, in characters, refused before tokenizing",
    shown_default="the context × the vocabulary's longest token × 2",
)
TRITON_API_BUSY_TIMEOUT_S = Setting(
    _non_negative, 5.0, "seconds the HTTP API retries a request the model refuses as busy before it answers 503"
)
TRITON_API_TOKENIZER_THREADS = Setting(
    _positive,
    2,
    "threads of the HTTP API that parse bodies, tokenize prompts and render chat templates, off its event loop "
    "(256 MiB of bodies or 4,096 requests wait for them; 503 beyond)",
)
TRITON_API_TRUST_REQUEST_CHAT_TEMPLATE = Setting(
    _switch,
    False,
    "whether the HTTP API renders a chat template a request brings (`chat_template_kwargs.chat_template`, vLLM's "
    "flag); off: a 400",
)
TRITON_PROXY = Setting(
    str.lower,
    "haproxy",
    "the front door: `haproxy` owns the public ports and tritonserver listens on loopback; `none` (or `--no-proxy`) "
    "exposes tritonserver itself",
)
TRITON_INTERNAL_PORT_BASE = Setting(
    _port,
    0,
    "behind the proxy: the first of seven loopback ports for tritonserver's HTTP, gRPC and metrics, the stream gate, "
    "the probe, the HTTP API and the stream gate's keyed listener; 0: free ports chosen at start",
)
TRITON_ADMIN_KEY = Setting(
    str,
    "",
    "the key that unlocks the shared-memory, model-repository, logging and trace APIs (32 to 512 letters, digits and ._~+/-); "
    "empty: a random key, written to `TRITON_ADMIN_KEY_FILE`",
    shown_default="a random key",
)
TRITON_ADMIN_KEY_FILE = Setting(
    str,
    None,
    "where a generated admin key is written: a new file (mode 0600), refused if the path exists or its "
    "directory is writable by other users; the supervisor removes it at exit (the next start, if the launcher was killed)",
    shown_default="`admin-key` in a new private directory `<tmp>/triton-admin-key-<HTTP port>-pid<launcher pid>-<random>`",
)
# The proxy's limits (docs/operations.md, "The front door"). Each model route has its own budget of
# requests in flight to tritonserver; beyond it requests wait in the proxy, which sheds them (503 /
# UNAVAILABLE) at once past PROXY_MAX_QUEUE waiting or after PROXY_QUEUE_TIMEOUT_S in the queue.
PROXY_MAX_CONNECTIONS = Setting(int, 2000, "connections the proxy holds at once, half on each of HTTP and gRPC")
PROXY_CONNECTIONS_PER_IP = Setting(
    int,
    256,
    "HTTP connections one client address may hold at once (with client keys: may hold for requests without one)",
)
# gRPC clients multiplex their calls over a connection or two; a silent connection that never
# sends the HTTP/2 preface lasts PROXY_SERVER_TIMEOUT_S on HAProxy 2.6, hence a lower cap.
PROXY_GRPC_CONNECTIONS_PER_IP = Setting(int, 32, "gRPC connections one client address may hold at once")
PROXY_STREAMS_PER_CONNECTION = Setting(int, 64, "concurrent HTTP/2 (gRPC) streams per connection")
PROXY_MAX_IN_FLIGHT = Setting(
    int, DEFAULT_ROUTE_CAPACITY, "requests (or gRPC streams) per model route in flight to tritonserver at once"
)
PROXY_MAX_QUEUE = Setting(int, 32, "requests per model route waiting in the proxy; beyond it a request is shed at once")
# One address's share of a model route (in tritonserver and waiting together): past it, 429 /
# RESOURCE_EXHAUSTED, so that one client cannot hold the slots everyone else needs. Behind a load
# balancer every request comes from its address unless it forwards the client's (docs/operations.md).
PROXY_REQUESTS_PER_IP = Setting(
    int,
    (DEFAULT_ROUTE_CAPACITY + PROXY_MAX_QUEUE.default) // 2,  # half the slots and half the queue
    "requests one client address may have at one model route at once, in tritonserver or waiting in the proxy",
)
PROXY_QUEUE_TIMEOUT_S = Setting(float, 2.0, "seconds a sampler request may wait in the proxy before it is shed")
# Keyed clients (TRITON_CLIENT_KEYS_FILE) have routes of their own beside those: their requests to a
# generator go on into the engine, whose own queue (max_waiting) is the real backpressure, and the
# rest wait in the proxy, keys taking turns, for up to PROXY_KEYED_QUEUE_TIMEOUT_S. Their sampler
# requests keep PROXY_MAX_IN_FLIGHT slots of their own (tritonserver holds their tensors).
PROXY_KEYED_MAX_IN_FLIGHT = Setting(
    int,
    1024,
    "keyed clients' requests (or gRPC streams) per generator route in tritonserver at once, beside the others' "
    "`PROXY_MAX_IN_FLIGHT`: keep it within the engine's max_active_sequences + max_waiting",
)
PROXY_KEYED_MAX_QUEUE = Setting(
    int, 1024, "keyed clients' requests per model route waiting in the proxy; beyond it a request is shed at once"
)
PROXY_KEYED_QUEUE_TIMEOUT_S = Setting(
    float, 300.0, "seconds a keyed client's request may wait in the proxy before it is shed (at most 500)"
)
PROXY_KEYED_CONNECTIONS_PER_IP = Setting(
    int,
    2048,
    "HTTP connections an address that sent a client key may hold at once (an OpenAI SDK opens up to 1,000); "
    "another address may open twice `PROXY_CONNECTIONS_PER_IP`, the second half for keyed requests only",
)
# Open: sent, not finally answered; beyond it the stream gate stops reading the stream.
PROXY_STREAM_MAX_OPEN = Setting(int, 64, "requests one gRPC stream may have open at once")
PROXY_REQUEST_TIMEOUT_S = Setting(float, 10.0, "seconds a client has to send a request's head (and an inspected body)")
PROXY_IDLE_TIMEOUT_S = Setting(float, 10.0, "seconds an idle keep-alive HTTP connection stays open")
PROXY_CLIENT_TIMEOUT_S = Setting(
    float, 60.0, "seconds of client silence, mid-request, before the proxy closes the connection"
)
PROXY_SERVER_TIMEOUT_S = Setting(
    float, 600.0, "seconds of silence from tritonserver (or on a gRPC stream) before the proxy gives up on a request"
)
PROXY_API_MAX_BODY_BYTES = Setting(
    _positive, 32 * MIB, "the largest request body on the HTTP API's port: the proxy and the API refuse larger (413)"
)
PROXY_JSON_HEADER_BYTES = Setting(
    int,
    12288,
    "largest JSON part of an HTTP /infer body (the whole body without the binary tensor extension); the proxy reads it",
)
PROXY_LOG_SAMPLE = Setting(int, 20, "the proxy logs one request in this many (never blocking on its log)")
# Off unless an endpoint is given: tritonserver's OpenTelemetry tracing and the models' child spans
# (serving.tracing), both exported over OTLP/HTTP to the same collector (docs/tracing.md).
TRITON_TRACE_ENDPOINT = Setting(
    str,
    "",
    "an OTLP/HTTP traces URL (e.g. `http://localhost:4318/v1/traces`): tritonserver traces requests and the models "
    "add child spans, both sent there (docs/tracing.md); empty: no tracing",
)
TRITON_TRACE_RATE = Setting(
    _positive, 1000, "with `TRITON_TRACE_ENDPOINT`: tritonserver traces one request in this many (1: every one)"
)
# A cgroup memory limit for tritonserver and its stubs (ops.memory_limit), so that a request that
# blows up the server's memory kills the server, not a random process of the host.
TRITON_MEMORY_LIMIT_BYTES = Setting(
    int,
    None,
    "memory limit of tritonserver and its stubs (a cgroup where one can be made, else the address-space fallback); "
    "0: none",
    shown_default="three quarters of the host's memory",
)

# Triton's own default is 30 s; in 2.51 it also waits that long for idle keep-alive HTTP clients
# and open gRPC streams to a decoupled model, so a short bound keeps SIGTERM prompt.
TRITON_EXIT_TIMEOUT_S = Setting(
    int, 5, "seconds tritonserver waits on SIGTERM for requests in flight before it exits anyway"
)
TRITON_WATCHDOG_INTERVAL_S = Setting(
    float, 2.0, "seconds between the supervisor's watchdog rounds (a tiny real inference per model)"
)
# Triton's default is 8; those threads parse every body, shed ones included, and take the cores the
# stubs need to sample. Never 1: one pathological body would then stall every HTTP request.
TRITON_HTTP_THREAD_COUNT = Setting(
    int, None, "threads of tritonserver's HTTP frontend", shown_default="half the usable cores, 2 to 8"
)
TRITON_MALLOC = Setting(
    str.lower,
    "",
    "tritonserver's allocator: jemalloc, tcmalloc or system (glibc's malloc fragments under load)",
    shown_default="jemalloc, else tcmalloc, where installed",
)
# libgomp's default spin (about 3 ms after each parallel region) starves Triton's threads, and its
# dynamic batcher then misses wake-ups (a request waits out the 500 ms idle timeout); passive waits
# pay a futex wake-up per parallel region instead. libgomp counts about 100,000 spins a millisecond.
GOMP_SPINCOUNT = Setting(
    str,
    "10000",
    "OpenMP spins of the stubs' threads before they sleep; not set when `OMP_WAIT_POLICY` is",
)
# A busy neighbour on the host takes CPU from every hop of a call (the proxy, tritonserver's threads,
# the stub); a lower nice gives the serving processes a larger share (docs/operations.md, "A busy host").
TRITON_NICE = Setting(
    int,
    0,
    "nice value (-20 to 19) of tritonserver with its stubs, HAProxy, the stream gate and the HTTP API; "
    "below 0 needs CAP_SYS_NICE (root); 0 leaves the launcher's",
)
MALLOC_CONF = Setting(
    str,
    "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:1000",
    "jemalloc's options, when it is the allocator: freed pages go back to the OS within about a second",
)
# The Python backend's /dev/shm pool per stub never shrinks, and every growth maps the whole region
# again in tritonserver and the stub, keeping the old mappings: few large steps, not many small ones.
SHM_DEFAULT_BYTES = Setting(
    int,
    64 * MIB,
    "initial size of each Python stub's /dev/shm pool: a 64-row batch at the largest vocabulary",
)
SHM_GROWTH_BYTES = Setting(
    int, 64 * MIB, "step by which a stub's /dev/shm pool grows: the largest request takes at most 4 steps"
)
# tritonserver never unmaps the region of a stub that died once a request reached it; only its exit
# returns that memory. Eight default-sized regions, or two that grew to the largest request.
TRITON_SHM_LEAK_LIMIT_BYTES = Setting(
    int,
    512 * MIB,
    "dead stubs' /dev/shm regions tritonserver may keep mapped; beyond it the supervisor drains and restarts it",
)
# Room for two largest requests a GPU: one being sampled while the next is handed over.
CUDA_POOL_BYTES = Setting(
    int,
    2 * LARGEST_REQUEST_BYTES,
    "Triton's CUDA memory pool per GPU, through which GPU-resident inputs reach the models",
    scope=IMAGE,
)
PINNED_POOL_BYTES = Setting(
    int, 2 * LARGEST_REQUEST_BYTES, "Triton's pinned host memory pool, which stages inputs to the GPUs", scope=IMAGE
)
GPU_COUNT = Setting(
    int, _visible_gpus, "GPUs to give a CUDA pool (numbered from 0)", shown_default="the GPUs torch sees", scope=IMAGE
)

SETTINGS: dict[str, Setting] = {name: value for name, value in globals().items() if isinstance(value, Setting)}
for _name, _setting in SETTINGS.items():
    _setting.name = _name
del _name, _setting

SCOPES = {
    SERVER: "Read by the launcher and the supervisor (`make serve`, the image):",
    IMAGE: "Read by the image's command, docker/serve.sh, on top of those:",
}


def markdown() -> str:
    """docs/settings.md: every setting as a table row (variable, default, meaning), by reader."""
    lines = [
        "# Settings",
        "",
        "Every environment variable the server reads. An unset or empty variable takes its default.",
        "Generated from `plugin/ops/settings.py` by",
        "`python -m triton_sampling_mask.ops.settings --markdown > docs/settings.md`; a test keeps them equal.",
    ]
    for scope, heading in SCOPES.items():
        lines += ["", heading, "", "| Variable | Default | Meaning |", "|---|---|---|"]
        lines += [f"| `{s.name}` | {s.default_text()} | {s.doc} |" for s in SETTINGS.values() if s.scope == scope]
    return "\n".join(lines) + "\n"


def shell(names: list[str]) -> str:
    """`NAME=value` lines, shell-quoted, for a script to eval: each named setting's current value."""
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s): {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    lines = []
    for name in names:
        value = SETTINGS[name].value()
        lines.append(f"{name}={shlex.quote('' if value is None else str(value))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print the settings as docs/settings.md (--markdown) or as shell assignments (--shell NAME...)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--markdown", action="store_true", help="the table of docs/settings.md")
    mode.add_argument("--shell", nargs="+", metavar="NAME", help="NAME=value lines for these settings")
    args = parser.parse_args(argv)
    try:
        print(markdown() if args.markdown else shell(args.shell), end="")
    except ValueError as error:  # a variable set to what its type cannot parse
        raise SystemExit(f"settings: {error}") from None


if __name__ == "__main__":
    main()
