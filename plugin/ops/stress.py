"""Stress a sampler past its capacity: does it shed load quickly and keep its memory bounded?

    python -m triton_sampling_mask.ops.stress [--clients 128] [--rows 16] [--vocab 151936]
                                             [--rounds 3] [--duration 30]     # starts its own server
    python -m triton_sampling_mask.ops.stress --http-url H:P --pid PID ...      # an existing one

Closed-loop HTTP clients (one keep-alive connection each) send the same prebuilt binary request
(rows x vocab float32 logits, top_k 50 with masks) for `rounds` rounds of `duration` seconds.
Each answer is 200 (admitted), 503 (shed by the queue policy) or a failure. After every round the
report records the RSS of the server process tree (tritonserver and its Python stubs). It fails
(exit 1) on any failure or lost request, on p99 of admitted requests >= 5 s, or on RSS after the
last round more than 15% above RSS after the first.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .soak import process_tree_rss

MODEL = "sampler"
OUTPUTS = ("output_ids", "output_logprobs", "sampling_mask", "sampling_mask_len", "sampling_logprobs")
P99_LIMIT_S = 5.0
RSS_GROWTH_LIMIT = 0.15


def binary_request(rows: int, vocab: int, seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """One HTTP binary-tensor request body (KServe v2 JSON header + raw tensors) and its headers."""
    logits = np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32) * 3
    tensors = [
        ("logits", "FP32", logits),
        ("top_k", "INT32", np.full((rows, 1), 50, np.int32)),
        ("return_sampling_mask", "BOOL", np.ones((rows, 1), np.bool_)),
    ]
    header = {
        "inputs": [{"name": name, "datatype": datatype, "shape": list(array.shape),
                    "parameters": {"binary_data_size": array.nbytes}} for name, datatype, array in tensors],
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
    failed: int = 0
    p50_s: float = 0.0
    p99_s: float = 0.0
    shed_p99_s: float = 0.0
    rss_mb: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def shed_share(self) -> float:
        return self.shed / self.sent if self.sent else 0.0


class _Client(threading.Thread):
    def __init__(self, host: str, port: int, body: bytes, headers: dict, stop: threading.Event, timeout_s: float):
        super().__init__(daemon=True)
        self.address, self.body, self.headers, self.stop, self.timeout_s = (host, port), body, headers, stop, timeout_s
        self.admitted: list[float] = []
        self.shed: list[float] = []
        self.failures: list[str] = []
        self.sent = 0

    def run(self) -> None:
        connection = http.client.HTTPConnection(*self.address, timeout=self.timeout_s)
        try:
            while not self.stop.is_set():
                started = time.perf_counter()
                self.sent += 1
                try:
                    connection.request("POST", f"/v2/models/{MODEL}/infer", body=self.body, headers=self.headers)
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
                elif response.status == 503:
                    self.shed.append(seconds)
                else:
                    self.failures.append(f"HTTP {response.status}: {payload[:200]!r}")
        finally:
            connection.close()  # an idle keep-alive connection would hold the server's shutdown


def run_round(number: int, http_url: str, pid: int, clients: int, duration_s: float, body: bytes, headers: dict,
              timeout_s: float = 60.0) -> RoundReport:
    """One round of `clients` closed-loop clients for `duration_s` seconds."""
    host, port = http_url.rsplit(":", 1)
    stop = threading.Event()
    threads = [_Client(host, int(port), body, headers, stop, timeout_s) for _ in range(clients)]
    for thread in threads:
        thread.start()
    stop.wait(duration_s)
    stop.set()
    for thread in threads:
        thread.join(timeout_s + 5)
    report = RoundReport(round=number)
    admitted = np.array([s for t in threads for s in t.admitted])
    shed = np.array([s for t in threads for s in t.shed])
    report.sent = sum(t.sent for t in threads)
    report.admitted, report.shed = admitted.size, shed.size
    report.failures = [f for t in threads for f in t.failures]
    report.failed = len(report.failures) + sum(t.is_alive() for t in threads)
    if admitted.size:
        report.p50_s, report.p99_s = (float(v) for v in np.percentile(admitted, [50, 99]))
    if shed.size:
        report.shed_p99_s = float(np.percentile(shed, 99))
    report.rss_mb = process_tree_rss(pid) / 2**20
    return report


def problems(rounds: list[RoundReport]) -> list[str]:
    """Why the stress run fails (empty when it passes)."""
    found = [f"round {r.round}: {r.failed} failed ({r.failures[:2]})" for r in rounds if r.failed]
    found += [f"round {r.round}: p99 of admitted {r.p99_s:.2f} s >= {P99_LIMIT_S} s" for r in rounds if r.p99_s >= P99_LIMIT_S]
    if len(rounds) > 1 and rounds[-1].rss_mb > rounds[0].rss_mb * (1 + RSS_GROWTH_LIMIT):
        found.append(f"RSS grew {rounds[-1].rss_mb / rounds[0].rss_mb - 1:+.1%} from round 1 to round {rounds[-1].round}")
    return found


def table(rounds: list[RoundReport], rss_idle_mb: float) -> str:
    """The report as a Markdown table."""
    lines = [f"server RSS before traffic: {rss_idle_mb:.0f} MB",
             "| round | sent | admitted | shed (503) | failed | p50 admitted | p99 admitted | p99 shed | RSS after round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        lines.append(f"| {r.round} | {r.sent} | {r.admitted} | {r.shed} ({r.shed_share:.0%}) | {r.failed} | "
                     f"{r.p50_s:.2f} s | {r.p99_s:.2f} s | {r.shed_p99_s * 1e3:.0f} ms | {r.rss_mb:.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the stress rounds (against a fresh server unless --http-url and --pid are given)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per round")
    parser.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY", "model_repository"))
    parser.add_argument("--http-url")
    parser.add_argument("--pid", type=int, help="tritonserver pid, for RSS (with --http-url)")
    parser.add_argument("--json", help="also write the report here as JSON")
    args = parser.parse_args(argv)
    body, headers = binary_request(args.rows, args.vocab)

    def stress(http_url: str, pid: int) -> tuple[list[RoundReport], float]:
        idle = process_tree_rss(pid) / 2**20
        rounds = []
        for number in range(1, args.rounds + 1):
            rounds.append(run_round(number, http_url, pid, args.clients, args.duration, body, headers))
            print(f"round {number}: {asdict(rounds[-1]) | {'failures': len(rounds[-1].failures)}}", flush=True)
        return rounds, idle

    if args.http_url:
        rounds, idle = stress(args.http_url, args.pid)
    else:
        from .launcher import TritonServer

        with TritonServer(Path(args.model_repository)) as server:
            rounds, idle = stress(server.http_url, server.process.pid)
    print(table(rounds, idle))
    found = problems(rounds)
    print("PASS" if not found else "FAIL:\n  " + "\n  ".join(found))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": [asdict(r) for r in rounds], "rss_idle_mb": idle,
                                               "problems": found}, indent=2))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
