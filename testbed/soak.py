"""A soak of a running sampler: many concurrent HTTP and gRPC clients, mixed valid and invalid
requests (`make soak` runs it long through bench/load/soak.py, client_tests/test_soak.py short).

Every request's answer is classified against what its kind must get: valid requests an answer
whose mask is well formed, invalid ones a 4xx. The report counts requests sent, answered, lost (no
answer from the server at all), 5xx, wrong answers, p50/p99 latency and the RSS of the server
process tree before traffic, after warm-up and at the end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from triton_sampling_mask.client.wire import infer_input

from .process_memory import process_tree_rss

MODEL = "sampler"
# gRPC codes that mean the server never answered (transport trouble), not an error response.
GRPC_TRANSPORT_CODES = {"StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED"}
GRPC_TO_HTTP = {
    "StatusCode.INVALID_ARGUMENT": 400,
    "StatusCode.NOT_FOUND": 404,
    "StatusCode.FAILED_PRECONDITION": 400,
    "StatusCode.OUT_OF_RANGE": 400,
    "StatusCode.UNAUTHENTICATED": 401,
    "StatusCode.PERMISSION_DENIED": 403,
    "StatusCode.RESOURCE_EXHAUSTED": 429,
    "StatusCode.ALREADY_EXISTS": 409,
    "StatusCode.INTERNAL": 500,
    "StatusCode.UNKNOWN": 500,
    "StatusCode.DATA_LOSS": 500,
    "StatusCode.UNIMPLEMENTED": 501,
    "StatusCode.UNAVAILABLE": 503,
}
# Request kinds of the mix and the status each must get (200 or 400).
KINDS = {"plain": 200, "mask": 200, "bad_top_p": 400, "unbounded_mask": 400, "nan_logits": 400}


def http_status(exc) -> int | None:
    """The HTTP-equivalent status of a tritonclient InferenceServerException (None: no answer)."""
    status = exc.status()
    if status is None:
        return None
    if str(status).isdigit():
        return int(status)
    if status in GRPC_TRANSPORT_CODES:
        return None
    return GRPC_TO_HTTP.get(status, 500)


@dataclass
class SoakRequest:
    """One request of the mix: its inputs (as numpy) and the status it must get."""

    kind: str
    logits: np.ndarray
    params: dict[str, tuple[np.ndarray, str]]
    top_k: int
    want_mask: bool

    @property
    def expected_status(self) -> int:
        """The HTTP status this request must get."""
        return KINDS[self.kind]

    def inputs(self, module) -> list:
        """The request's InferInputs for `module` (tritonclient.http or .grpc)."""
        return [infer_input(module, "logits", self.logits, "FP32")] + [
            infer_input(module, name, array, datatype) for name, (array, datatype) in self.params.items()
        ]


def make_request(rng: np.random.Generator, vocab: int) -> SoakRequest:
    """A random request of a random kind: 1-4 rows over `vocab` logits."""
    kind = list(KINDS)[rng.integers(len(KINDS))]
    rows = int(rng.integers(1, 5))
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
    column = lambda value, dtype: np.full((rows, 1), value, dtype)  # noqa: E731
    top_k = int(rng.integers(1, 65))
    params = {
        "temperature": (column(rng.uniform(0.3, 1.5), np.float32), "FP32"),
        "top_k": (column(top_k, np.int32), "INT32"),
        "top_p": (column(rng.uniform(0.5, 1.0), np.float32), "FP32"),
        "seed": (rng.integers(0, 2**63, (rows, 1)).astype(np.uint64), "UINT64"),
    }
    want_mask = kind in ("mask", "unbounded_mask")
    params["return_sampling_mask"] = (column(want_mask, np.bool_), "BOOL")
    if kind == "bad_top_p":
        params["top_p"] = (column(0.0, np.float32), "FP32")
    elif kind == "unbounded_mask":
        params["top_k"] = (column(-1, np.int32), "INT32")
    elif kind == "nan_logits":
        logits[rng.integers(rows), rng.integers(vocab)] = np.nan
    return SoakRequest(kind, logits, params, top_k, want_mask)


def answer_problem(request: SoakRequest, result) -> str | None:
    """Why an answer to a valid request is malformed (None when it is well formed)."""
    rows, vocab = request.logits.shape
    ids = result.as_numpy("output_ids")
    mask = result.as_numpy("sampling_mask")
    lengths = result.as_numpy("sampling_mask_len")
    if ids is None or mask is None or lengths is None:
        return "missing output"
    if ids.shape != (rows, 1) or lengths.shape != (rows, 1) or mask.shape[0] != rows:
        return f"wrong output shapes {ids.shape} {lengths.shape} {mask.shape}"
    if not ((ids >= 0) & (ids < vocab)).all():
        return "token id out of range"
    for row in range(rows):  # a soak-side check, not the server's hot path
        n = int(lengths[row, 0])
        if not request.want_mask:
            if n != 0:
                return "mask returned without being asked"
            continue
        support = mask[row, :n]
        if not 1 <= n <= request.top_k or (mask[row, n:] != -1).any() or (support < 0).any():
            return f"malformed mask (len {n}, top_k {request.top_k})"
        if len(np.unique(support)) != n or ids[row, 0] not in support:
            return "sampled token outside its mask or duplicate ids"
    return None


@dataclass
class SoakReport:
    """What a soak run measured; `failures` lists the checks that did not hold."""

    clients: int
    duration_s: float
    sent: int = 0
    answered: int = 0
    ok: int = 0
    rejected_4xx: int = 0
    server_errors_5xx: int = 0
    lost: int = 0
    wrong: int = 0
    by_protocol: dict = field(default_factory=dict)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    rss_before_mb: float = 0.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    examples: list = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        """RSS growth from after the warm-up to the end, as a fraction."""
        return self.rss_end_mb / self.rss_start_mb - 1 if self.rss_start_mb else 0.0

    @property
    def failures(self) -> list[str]:
        """The names of the checks that did not hold."""
        checks = {
            "requests lost": self.lost == 0 and self.answered == self.sent,
            "5xx answers": self.server_errors_5xx == 0,
            "wrong answers": self.wrong == 0,
            "RSS growth >= 10%": self.rss_growth < 0.10,
        }
        return [name for name, held in checks.items() if not held]

    def summary(self) -> str:
        """The report in one paragraph."""
        return (
            f"soak: {self.clients} clients, {self.duration_s:.0f} s: sent {self.sent}, answered {self.answered} "
            f"(ok {self.ok}, 4xx {self.rejected_4xx}, 5xx {self.server_errors_5xx}), lost {self.lost}, wrong {self.wrong}; "
            f"by protocol {self.by_protocol}; latency p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms; "
            f"server RSS {self.rss_before_mb:.0f} MB before traffic, {self.rss_start_mb:.0f} MB after warm-up, "
            f"{self.rss_end_mb:.0f} MB at end ({self.rss_growth:+.1%})"
        )


class _Client(threading.Thread):
    """One closed-loop client: send, wait for the answer, classify it, repeat until the deadline."""

    def __init__(self, protocol: str, url: str, seed: int, vocab: int, stop: threading.Event, timeout_s: float):
        super().__init__(daemon=True)
        self.protocol, self.url, self.vocab, self.stop, self.timeout_s = protocol, url, vocab, stop, timeout_s
        self.rng = np.random.default_rng(seed)
        self.counts = dict.fromkeys(("sent", "answered", "ok", "rejected_4xx", "server_errors_5xx", "lost", "wrong"), 0)
        self.latencies: list[float] = []
        self.examples: list[str] = []

    def run(self) -> None:
        if self.protocol == "http":
            import tritonclient.http as module

            client = module.InferenceServerClient(
                self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s
            )
            send = lambda inputs: client.infer(MODEL, inputs)  # noqa: E731
        else:
            import tritonclient.grpc as module

            client = module.InferenceServerClient(self.url)
            send = lambda inputs: client.infer(MODEL, inputs, client_timeout=self.timeout_s)  # noqa: E731
        from tritonclient.utils import InferenceServerException

        try:
            while not self.stop.is_set():
                request = make_request(self.rng, self.vocab)
                inputs = request.inputs(module)
                self.counts["sent"] += 1
                start = time.perf_counter()
                result, status, problem = None, None, None
                try:
                    result, status = send(inputs), 200
                except InferenceServerException as exc:
                    status = http_status(exc)
                    problem = str(exc)
                except Exception as exc:  # the transport failed: no answer
                    problem = f"{type(exc).__name__}: {exc}"
                self._classify(request, status, result, problem, time.perf_counter() - start)
        finally:
            client.close()

    def _classify(self, request, status, result, problem, seconds) -> None:
        if status is None:
            self.counts["lost"] += 1
            self._example(f"lost {request.kind}: {problem}")
            return
        self.counts["answered"] += 1
        self.latencies.append(seconds)
        if status >= 500:
            self.counts["server_errors_5xx"] += 1
        elif status >= 400:
            self.counts["rejected_4xx"] += 1
        else:
            self.counts["ok"] += 1
        if status != request.expected_status:
            self.counts["wrong"] += 1
            self._example(f"{request.kind} got {status}: {problem}")
        elif status == 200 and (issue := answer_problem(request, result)):
            self.counts["wrong"] += 1
            self._example(f"{request.kind}: {issue}")

    def _example(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(f"[{self.protocol}] {text[:300]}")


def _run_clients(http_url, grpc_url, clients, duration_s, vocab, seed, timeout_s) -> list[_Client]:
    stop = threading.Event()
    threads = [
        _Client(
            "http" if i % 2 == 0 else "grpc", http_url if i % 2 == 0 else grpc_url, seed + i, vocab, stop, timeout_s
        )
        for i in range(clients)
    ]
    run_threads_for(threads, stop, duration_s, timeout_s + 5)
    return threads


def run_threads_for(threads: list[threading.Thread], stop: threading.Event, duration_s: float, join_s: float) -> None:
    """Start `threads`, let them run `duration_s`, then set `stop` and join each (up to `join_s`)."""
    for thread in threads:
        thread.start()
    stop.wait(duration_s)
    stop.set()
    for thread in threads:
        thread.join(join_s)


def run_soak(
    http_url: str,
    grpc_url: str,
    server_pid: int,
    clients: int = 32,
    duration_s: float = 60.0,
    warmup_s: float = 5.0,
    vocab: int = 4096,
    seed: int = 0,
    timeout_s: float = 60.0,
) -> SoakReport:
    """Warm up, then run `clients` closed-loop clients (half HTTP, half gRPC) for `duration_s`."""
    report = SoakReport(clients=clients, duration_s=duration_s)
    report.rss_before_mb = process_tree_rss(server_pid) / 2**20
    if warmup_s > 0:  # first-use allocations (torch kernels, Triton's pools) are not growth
        _run_clients(http_url, grpc_url, clients, warmup_s, vocab, seed + 10_000, timeout_s)
    report.rss_start_mb = process_tree_rss(server_pid) / 2**20
    threads = _run_clients(http_url, grpc_url, clients, duration_s, vocab, seed, timeout_s)
    report.rss_end_mb = process_tree_rss(server_pid) / 2**20
    for thread in threads:
        for name, value in thread.counts.items():
            setattr(report, name, getattr(report, name) + value)
        report.by_protocol[thread.protocol] = report.by_protocol.get(thread.protocol, 0) + thread.counts["sent"]
        report.examples.extend(thread.examples)
    latencies = np.concatenate([t.latencies for t in threads]) if report.answered else np.zeros(1)
    report.p50_ms, report.p99_ms = (float(v) * 1e3 for v in np.percentile(latencies, [50, 99]))
    return report
