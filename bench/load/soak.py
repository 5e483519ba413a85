"""Soak a running sampler: many concurrent HTTP and gRPC clients, mixed valid and invalid requests.

    python -m bench.load.soak [--clients 32] [--duration 60]      # starts its own server
    python -m bench.load.soak --http-url H:P --grpc-url H:P --pid PID   # an existing one

Every request's answer is classified against what its kind must get: valid requests an answer
whose mask is well formed, invalid ones a 4xx. The report counts requests sent, answered, lost (no
answer from the server at all), 5xx, wrong answers, p50/p99 latency and the RSS of the server
process tree before traffic, after warm-up and at the end (testbed/soak.py). Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from testbed.server import TritonServer
from testbed.soak import run_soak
from triton_sampling_mask.ops import settings


def main(argv: list[str] | None = None) -> int:
    """Run a soak (against a fresh server unless URLs and a pid are given) and print the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of measured traffic")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of traffic before the start RSS")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--model-repository", default=settings.MODEL_REPOSITORY.value())
    parser.add_argument("--http-url")
    parser.add_argument("--grpc-url")
    parser.add_argument("--pid", type=int, help="tritonserver pid, for RSS (with --http-url/--grpc-url)")
    parser.add_argument("--json", help="also write the report here as JSON")
    args = parser.parse_args(argv)

    def soak(http_url, grpc_url, pid):
        return run_soak(http_url, grpc_url, pid, args.clients, args.duration, args.warmup, args.vocab)

    if args.http_url:
        report = soak(args.http_url, args.grpc_url, args.pid)
    else:
        with TritonServer(Path(args.model_repository)) as server:
            report = soak(server.http_url, server.grpc_url, server.process.pid)
    print(report.summary())
    for example in report.examples[:10]:
        print("  e.g.", example)
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(report), "rss_growth": report.rss_growth}, indent=2))
    if report.failures:
        print("FAILED:", ", ".join(report.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
