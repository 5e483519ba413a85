"""Throughput of the sampler with 1, 2, ... replicas behind one multi-endpoint client.

    python -m bench.load.replicas [--replicas 3] [--threads 16] [--seconds 10]
        [--rows 8] [--vocab 32000] [--protocol grpc]

Starts the replicas (each a tritonserver serving only the shipped sampler, on free ports) once,
then for n = 1..replicas drives the first n of them from `--threads` threads sharing one
SamplerClient for `--seconds`, and prints a table: calls/s, rows/s, median and p99 latency, and
each replica's share. Every replica and the client run on this host, so on a small machine they
contend for the same cores: read the table as what one host gives, not as the scaling of
replicas on machines of their own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from testbed.server import TritonServer, copy_model
from triton_sampling_mask.client.sampler_client import SamplerClient
from triton_sampling_mask.client.sampling_params import SamplingParams


def drive(urls: list[str], protocol: str, threads: int, seconds: float, rows: int, vocab: int) -> dict:
    """`threads` threads calling sample() for `seconds` through one client over `urls`."""
    logits = (np.random.default_rng(0).standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, return_sampling_mask=True)
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    with SamplerClient(urls, protocol=protocol) as client:
        client.sample(logits, params)  # config read and connections made before timing

        def worker() -> None:
            mine = []
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    client.sample(logits, params)
                    mine.append(time.perf_counter() - started)
                except Exception as error:  # reported, never hidden
                    errors.append(repr(error))
            with lock:
                latencies.extend(mine)

        before = client.replica_shares()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        started = time.perf_counter()
        for thread in pool:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in pool:
            thread.join()
        elapsed = time.perf_counter() - started
        shares = {url: count - before[url] for url, count in client.replica_shares().items()}
    calls = len(latencies)
    return {
        "replicas": len(urls),
        "calls_per_s": calls / elapsed,
        "rows_per_s": calls * rows / elapsed,
        "p50_ms": 1000 * float(np.median(latencies)) if calls else float("nan"),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)) if calls else float("nan"),
        "errors": len(errors),
        "shares": shares,
    }


def main(argv: list[str] | None = None) -> None:
    """Start the replicas and print the throughput table for 1..n of them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=8, help="rows per call (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args(argv)

    repository = Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    copy_model(repository, "sampler")
    servers = [TritonServer(repository) for _ in range(args.replicas)]
    try:
        with ThreadPoolExecutor(args.replicas) as pool:
            list(pool.map(lambda server: server.start(), servers))
        urls = [server.grpc_url if args.protocol == "grpc" else server.http_url for server in servers]
        print(
            f"# {os.cpu_count()} CPU cores for the client and every replica; {args.threads} threads, "
            f"{args.rows} x {args.vocab} logits per call, top_k=50 masks, {args.protocol}, {args.seconds:.0f} s each"
        )
        print("| replicas | calls/s | rows/s | p50 ms | p99 ms | errors | share per replica |")
        print("|---:|---:|---:|---:|---:|---:|---|")
        for count in range(1, args.replicas + 1):
            row = drive(urls[:count], args.protocol, args.threads, args.seconds, args.rows, args.vocab)
            total = sum(row["shares"].values()) or 1
            shares = " / ".join(f"{100 * n / total:.0f}%" for n in row["shares"].values())
            print(
                f"| {count} | {row['calls_per_s']:.0f} | {row['rows_per_s']:.0f} | {row['p50_ms']:.1f} | "
                f"{row['p99_ms']:.1f} | {row['errors']} | {shares} |",
                flush=True,
            )
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(repository, ignore_errors=True)


if __name__ == "__main__":
    main()
