"""Stress a sampler past its capacity: does it shed load quickly and keep its memory bounded?

    python -m bench.load.stress [--clients 128] [--rows 16] [--vocab 151936]
                                             [--rounds 3] [--duration 30]     # starts its own server
    python -m bench.load.stress --http-url H:P --pid PID ...      # an existing one

The server started here runs behind its own front door, the HAProxy of `make serve` with its
settings (`--no-proxy`: tritonserver alone); `--http-url` names the proxy's port of a running
stack and `--pid` its tritonserver. Closed-loop HTTP clients (one keep-alive connection each)
send the same prebuilt binary request (rows x vocab float32 logits, top_k 50 with masks) for
`rounds` rounds of `duration` seconds. Each answer is 200 (admitted), 503 (shed by the proxy:
refused at once with its queue full, or after waiting out its queue timeout; without a proxy,
by the model's queue policy, if any) or a failure. A client answered 503
waits before its next request, as docs/operations.md asks of clients (`--backoff`: 0.5 s doubling to 5 s
while it keeps being shed, jittered, reset by a 200); `--backoff 0` resends at once (a retry
storm: every request, shed or not, then waits its turn behind all the others' uploads).

After every round the report records the server process tree's memory (tritonserver and its Python
stubs; RSS and PSS, per process and kind, and the stubs' /dev/shm pools), where admitted requests
spent their time (client upload; Triton's queue and compute from its metrics port) and the CPU
share of the clients and the server. It fails (exit 1) on any failure or lost request, on p99 of
admitted requests >= 5 s, or on RSS after the last round more than 15% above RSS after the first.
RSS counts the stubs' shared pools once per process and once per mapping (see
`testbed.process_memory.process_tree_rss`); PSS counts every page once, which is why both are shown.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import resource
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from testbed.fronted import FrontedTritonServer
from testbed.process_memory import ProcessMemory, cpu_seconds, mapped_shm_regions, process_tree_memory
from testbed.server import TritonServer
from testbed.soak import run_threads_for
from triton_sampling_mask.client.replicas import DEFAULT_EJECT_BACKOFF_S, DEFAULT_MAX_EJECT_BACKOFF_S
from triton_sampling_mask.ops import settings
from triton_sampling_mask.ops.proxy import QUEUE_TIMEOUT
from triton_sampling_mask.sampling.outputs import SAMPLING_MASK_LOGPROBS, TOKEN_OUTPUT_NAMES

MODEL = "sampler"
# Every output but the [rows, W] per-support log-probs.
OUTPUTS = tuple(name for name in TOKEN_OUTPUT_NAMES if name != SAMPLING_MASK_LOGPROBS.name)
P99_LIMIT_S = 5.0
RSS_GROWTH_LIMIT = 0.15
# After a 503 a client waits BACKOFF_S, doubling while it keeps being shed, up to MAX_BACKOFF_S:
# the pauses SamplerClient gives a replica it ejected.
BACKOFF_S = DEFAULT_EJECT_BACKOFF_S
MAX_BACKOFF_S = DEFAULT_MAX_EJECT_BACKOFF_S
# Triton's per-model counters (metrics port) that say where an admitted request's time went.
TRITON_DURATIONS = {
    "request": "nv_inference_request_duration_us",
    "queue": "nv_inference_queue_duration_us",
    "compute_input": "nv_inference_compute_input_duration_us",
    "compute_infer": "nv_inference_compute_infer_duration_us",
    "compute_output": "nv_inference_compute_output_duration_us",
}
TRITON_SUCCESS = "nv_inference_request_success"


def binary_request(rows: int, vocab: int, seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """One HTTP binary-tensor request body (KServe v2 JSON header + raw tensors) and its headers."""
    logits = np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32) * 3
    tensors = [
        ("logits", "FP32", logits),
        ("top_k", "INT32", np.full((rows, 1), 50, np.int32)),
        ("return_sampling_mask", "BOOL", np.ones((rows, 1), np.bool_)),
    ]
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": array.nbytes},
            }
            for name, datatype, array in tensors
        ],
        "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in OUTPUTS],
    }
    head = json.dumps(header).encode()
    body = head + b"".join(array.tobytes() for _, _, array in tensors)
    return body, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


@dataclass
class RoundReport:
    """One round: counts, latency of admitted requests and the server's RSS at its end."""

    round: int
    sent: int = 0
    admitted: int = 0
    shed: int = 0
    shed_waited: int = 0  # of the shed: after waiting out the proxy's queue timeout (the rest: at once)
    failed: int = 0
    p50_s: float = 0.0
    p99_s: float = 0.0
    shed_p99_s: float = 0.0
    mean_s: float = 0.0  # of admitted requests
    send_mean_s: float = 0.0  # of admitted requests: handing the body to the socket (the upload)
    send_p99_s: float = 0.0
    server_ms: dict = field(default_factory=dict)  # Triton's mean per admitted request, TRITON_DURATIONS
    client_cpu: float = 0.0  # share of this machine's cores used by the clients
    server_cpu: float = 0.0  # ... by tritonserver and its stubs
    rss_mb: float = 0.0
    pss_mb: float = 0.0
    processes: list[dict] = field(default_factory=list)  # per process: RSS by kind, PSS (MB)
    shm_regions_mb: dict = field(default_factory=dict)  # the stubs' /dev/shm pools
    failures: list[str] = field(default_factory=list)

    @property
    def shed_share(self) -> float:
        """The share of requests sent that were shed (503)."""
        return self.shed / self.sent if self.sent else 0.0


class _Client(threading.Thread):
    def __init__(
        self,
        host: str,
        port: int,
        body: bytes,
        headers: dict,
        stop: threading.Event,
        timeout_s: float,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        seed: int = 0,
    ):
        super().__init__(daemon=True)
        self.address, self.body, self.headers, self.stop, self.timeout_s = (host, port), body, headers, stop, timeout_s
        self.backoff_s, self.max_backoff_s, self.random = backoff_s, max(max_backoff_s, backoff_s), random.Random(seed)
        self.admitted: list[float] = []
        self.admitted_send: list[float] = []  # seconds to hand each admitted body to the socket
        self.shed: list[float] = []
        self.shed_waited = 0
        self.failures: list[str] = []
        self.sent = 0

    def backoff(self, consecutive_shed: int) -> float:
        """Seconds to wait after the `consecutive_shed`-th 503 in a row (jittered, 0 without backoff)."""
        if self.backoff_s <= 0:
            return 0.0
        return self.random.uniform(0.5, 1.0) * min(self.max_backoff_s, self.backoff_s * 2 ** (consecutive_shed - 1))

    def run(self) -> None:
        connection = http.client.HTTPConnection(*self.address, timeout=self.timeout_s)
        consecutive_shed = 0
        try:
            while not self.stop.is_set():
                started = time.perf_counter()
                self.sent += 1
                try:
                    try:
                        connection.request("POST", f"/v2/models/{MODEL}/infer", body=self.body, headers=self.headers)
                    except OSError:
                        # The proxy answers a shed request before its body is read and closes: the answer
                        # may be waiting on the socket even though the upload broke off.
                        pass
                    sent = time.perf_counter() - started
                    response = connection.getresponse()
                    payload = response.read()
                except (OSError, http.client.HTTPException) as exc:
                    self.failures.append(f"no answer: {exc!r}")
                    connection.close()
                    connection = http.client.HTTPConnection(*self.address, timeout=self.timeout_s)
                    continue
                seconds = time.perf_counter() - started
                if response.status == 200:
                    self.admitted.append(seconds)
                    self.admitted_send.append(sent)
                    consecutive_shed = 0
                elif response.status == 503:
                    self.shed.append(seconds)
                    self.shed_waited += QUEUE_TIMEOUT.encode() in payload
                    consecutive_shed += 1
                    self.stop.wait(self.backoff(consecutive_shed))
                else:
                    self.failures.append(f"HTTP {response.status}: {payload[:200]!r}")
        finally:
            connection.close()  # an idle keep-alive connection would hold the server's shutdown


def triton_counters(metrics_url: str | None, model: str = MODEL) -> dict[str, float]:
    """Triton's nv_inference_* counters of `model` (empty without a metrics URL or on error)."""
    if not metrics_url:
        return {}
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    counters = {}
    for name, labels, value in re.findall(r"^(nv_inference_\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        if f'model="{model}"' in labels:
            counters[name] = counters.get(name, 0.0) + float(value)
    return counters


def tree_memory_mb(pid: int) -> tuple[list[ProcessMemory], float, float]:
    """The server tree's processes (`process_tree_memory`, one read of each) with their RSS and PSS
    totals in MB."""
    memories = process_tree_memory(pid)
    return memories, sum(m.rss for m in memories) / 2**20, sum(m.pss for m in memories) / 2**20


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_round(
    number: int,
    http_url: str,
    pid: int,
    clients: int,
    duration_s: float,
    body: bytes,
    headers: dict,
    timeout_s: float = 60.0,
    metrics_url: str | None = None,
    backoff_s: float = BACKOFF_S,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> RoundReport:
    """One round of `clients` closed-loop clients for `duration_s` seconds."""
    host, port = http_url.rsplit(":", 1)
    stop = threading.Event()
    threads = [
        _Client(host, int(port), body, headers, stop, timeout_s, backoff_s, max_backoff_s, seed=number * 100_003 + i)
        for i in range(clients)
    ]
    counters_before, started = triton_counters(metrics_url), time.perf_counter()
    client_cpu_before, server_cpu_before = _client_cpu_s(), cpu_seconds(pid)
    run_threads_for(threads, stop, duration_s, timeout_s + 5)
    wall_s, cores = time.perf_counter() - started, len(os.sched_getaffinity(0))
    report = RoundReport(round=number)
    report.client_cpu = (_client_cpu_s() - client_cpu_before) / (wall_s * cores)
    report.server_cpu = (cpu_seconds(pid) - server_cpu_before) / (wall_s * cores)
    counters = triton_counters(metrics_url)
    admitted = np.array([s for t in threads for s in t.admitted])
    admitted_send = np.array([s for t in threads for s in t.admitted_send])
    shed = np.array([s for t in threads for s in t.shed])
    report.sent = sum(t.sent for t in threads)
    report.admitted, report.shed = admitted.size, shed.size
    report.shed_waited = sum(t.shed_waited for t in threads)
    report.failures = [f for t in threads for f in t.failures]
    report.failed = len(report.failures) + sum(t.is_alive() for t in threads)
    if admitted.size:
        report.p50_s, report.p99_s = (float(v) for v in np.percentile(admitted, [50, 99]))
        report.mean_s, report.send_mean_s = float(admitted.mean()), float(admitted_send.mean())
        report.send_p99_s = float(np.percentile(admitted_send, 99))
    if shed.size:
        report.shed_p99_s = float(np.percentile(shed, 99))
    successes = counters.get(TRITON_SUCCESS, 0.0) - counters_before.get(TRITON_SUCCESS, 0.0)
    if successes > 0:
        report.server_ms = {
            key: (counters.get(name, 0.0) - counters_before.get(name, 0.0)) / successes / 1e3
            for key, name in TRITON_DURATIONS.items()
        }
    memories, report.rss_mb, report.pss_mb = tree_memory_mb(pid)
    report.processes = [
        {
            "pid": m.pid,
            "name": m.name,
            "rss_mb": m.rss / 2**20,
            "anon_mb": m.anon / 2**20,
            "file_mb": m.file / 2**20,
            "shmem_mb": m.shmem / 2**20,
            "pss_mb": m.pss / 2**20,
            "shm_mappings": m.shm_mappings,
        }
        for m in memories
    ]
    report.shm_regions_mb = {name: size / 2**20 for name, size in mapped_shm_regions([m.pid for m in memories]).items()}
    return report


def problems(rounds: list[RoundReport]) -> list[str]:
    """Why the stress run fails (empty when it passes)."""
    found = [f"round {r.round}: {r.failed} failed ({r.failures[:2]})" for r in rounds if r.failed]
    found += [
        f"round {r.round}: p99 of admitted {r.p99_s:.2f} s >= {P99_LIMIT_S} s" for r in rounds if r.p99_s >= P99_LIMIT_S
    ]
    if len(rounds) > 1 and rounds[-1].rss_mb > rounds[0].rss_mb * (1 + RSS_GROWTH_LIMIT):
        found.append(
            f"RSS grew {rounds[-1].rss_mb / rounds[0].rss_mb - 1:+.1%} from round 1 to round {rounds[-1].round}"
        )
    return found


def table(rounds: list[RoundReport], rss_idle_mb: float, pss_idle_mb: float | None = None) -> str:
    """The report as Markdown tables: outcomes, where admitted requests spent their time, memory."""
    idle = f"server RSS before traffic: {rss_idle_mb:.0f} MB" + (f" (PSS {pss_idle_mb:.0f} MB)" if pss_idle_mb else "")
    lines = [
        idle,
        "| round | sent | admitted | shed (503; after the queue timeout) | failed | p50 admitted | p99 admitted "
        "| p99 shed | RSS after round | PSS after round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r.round} | {r.sent} | {r.admitted} | {r.shed} ({r.shed_share:.0%}; {r.shed_waited}) | {r.failed} | "
            f"{r.p50_s:.2f} s | {r.p99_s:.2f} s | {r.shed_p99_s:.2f} s | {r.rss_mb:.0f} MB | {r.pss_mb:.0f} MB |"
        )
    lines += [
        "",
        "Admitted requests, mean ms (upload: the client handing its body to the socket; Triton's from its metrics):",
        "| round | client latency | upload (p99) | Triton request | queue | compute input | infer | output | CPU clients / server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        server = r.server_ms
        triton = " | ".join(
            f"{server[k]:.0f}" if k in server else "-"
            for k in ("request", "queue", "compute_input", "compute_infer", "compute_output")
        )
        lines.append(
            f"| {r.round} | {r.mean_s * 1e3:.0f} | {r.send_mean_s * 1e3:.0f} ({r.send_p99_s * 1e3:.0f}) | {triton} | "
            f"{r.client_cpu:.0%} / {r.server_cpu:.0%} |"
        )
    lines += [
        "",
        "Memory after each round, MB (RSS = anon + file + shmem; shmem counts each mapping of a /dev/shm pool):",
        "| round | process | RSS | anon | file | shmem | PSS | /dev/shm mappings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        for p in r.processes:
            lines.append(
                f"| {r.round} | {p['name']} | {p['rss_mb']:.0f} | {p['anon_mb']:.0f} | {p['file_mb']:.0f} | "
                f"{p['shmem_mb']:.0f} | {p['pss_mb']:.0f} | {p['shm_mappings']} |"
            )
        pools = ", ".join(f"{size:.0f}" for size in sorted(r.shm_regions_mb.values(), reverse=True))
        lines.append(f"| {r.round} | /dev/shm pools (file sizes) | {pools} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the stress rounds (against a fresh server unless --http-url and --pid are given)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per round")
    parser.add_argument("--model-repository", default=settings.MODEL_REPOSITORY.value())
    parser.add_argument(
        "--backoff",
        type=float,
        default=BACKOFF_S,
        help="seconds a client waits after a 503, doubling while shed (0: resend at once; default %(default)s)",
    )
    parser.add_argument(
        "--max-backoff", type=float, default=MAX_BACKOFF_S, help="longest wait after a 503 (default %(default)s)"
    )
    parser.add_argument("--no-proxy", action="store_true", help="the server started here without its front door")
    parser.add_argument("--http-url")
    parser.add_argument("--metrics-url", help="Triton's metrics URL, http://H:P/metrics (with --http-url)")
    parser.add_argument("--pid", type=int, help="tritonserver pid, for RSS (with --http-url)")
    parser.add_argument("--json", help="also write the report here as JSON")
    parser.add_argument("extra", nargs="*", help="tritonserver flags for the server started here (after --)")
    args = parser.parse_args(argv)
    body, headers = binary_request(args.rows, args.vocab)

    def stress(http_url: str, pid: int, metrics_url: str | None) -> tuple[list[RoundReport], float, float]:
        _, idle, idle_pss = tree_memory_mb(pid)
        rounds = []
        for number in range(1, args.rounds + 1):
            rounds.append(
                run_round(
                    number,
                    http_url,
                    pid,
                    args.clients,
                    args.duration,
                    body,
                    headers,
                    metrics_url=metrics_url,
                    backoff_s=args.backoff,
                    max_backoff_s=args.max_backoff,
                )
            )
            summary = {
                k: v for k, v in asdict(rounds[-1]).items() if k not in ("processes", "shm_regions_mb", "failures")
            }
            print(f"round {number}: {summary | {'failures': len(rounds[-1].failures)}}", flush=True)
        return rounds, idle, idle_pss

    clients = (
        f"{args.clients} clients x {args.rows} x {args.vocab} rows, {args.rounds} rounds of {args.duration:g} s, "
        + (
            f"{args.backoff:g} s backoff after a 503 (doubling up to {args.max_backoff:g} s)"
            if args.backoff > 0
            else "no backoff after a 503 (retry storm)"
        )
    )
    print(clients, flush=True)
    if args.http_url:
        rounds, idle, idle_pss = stress(args.http_url, args.pid, args.metrics_url)
    else:
        kind = TritonServer if args.no_proxy else FrontedTritonServer
        with kind(Path(args.model_repository), extra_args=args.extra) as server:
            direct = server if args.no_proxy else server.server
            print("+ tritonserver " + " ".join(direct.command()[1:]), flush=True)
            if not args.no_proxy:
                print(f"behind HAProxy on {server.http_url} ({server.front_door.config_path})", flush=True)
            rounds, idle, idle_pss = stress(server.http_url, server.process.pid, direct.metrics_url)
    print(
        f"load average after the run (this machine's {len(os.sched_getaffinity(0))} cores): "
        + " ".join(f"{v:.2f}" for v in os.getloadavg())
    )
    print(clients)
    print(table(rounds, idle, idle_pss))
    found = problems(rounds)
    print("PASS" if not found else "FAIL:\n  " + "\n  ".join(found))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rounds": [asdict(r) for r in rounds],
                    "rss_idle_mb": idle,
                    "pss_idle_mb": idle_pss,
                    "backoff_s": args.backoff,
                    "problems": found,
                },
                indent=2,
            )
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
