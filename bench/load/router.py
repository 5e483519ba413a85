"""Throughput of rollouts through the router against one replica.

    python -m bench.load.router [--replicas 2] [--clients 32] [--seconds 30] [--max-new-tokens 64]
        [--router smg] [--output bench/results/router.md]

Starts `--replicas` full `make serve` stacks (launcher, front door, HTTP API; testbed/stack.py)
with an API key, then drives SGLang `/generate` rollouts (slime's payload: ids in, log-probs and
sampling masks out, top_k 8, `--max-new-tokens` each with ignore_eos, seeded) from `--clients`
threads, each a closed loop on a keep-alive connection, for `--seconds` per row:

1. one replica's API directly (the baseline);
2. the same one replica behind the router (the router's own cost);
3. every replica behind the router (testbed/router.py: smg with docker/router/launch.py's flags).

It prints (and writes to `--output`) requests/s, tokens/s, p50 and p99 latency, errors and each
replica's share (the router's `x-smg-routed-worker-id`), with the machine's cores and load average.
Every replica, the router and the clients run on this host: on a small machine they share the same
cores, so read the table as what one host gives, not as replicas on machines of their own, and
run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from testbed.router import RouterProcess
from testbed.stack import launch, shipped_repository

KEY = "bench-router-api-key-0123456789abcdefghijkl"
MODEL = "generate"


def payload(client: int, turn: int, max_new_tokens: int) -> dict:
    return {
        "input_ids": [5, 6, 7 + client % 50, 8 + turn % 50],
        "sampling_params": {
            "temperature": 1.0,
            "top_k": 8,
            "max_new_tokens": max_new_tokens,
            "sampling_seed": client * 100_000 + turn,
            "ignore_eos": True,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "return_sampling_mask": True,
    }


@dataclass
class Row:
    name: str
    requests: int = 0
    tokens: int = 0
    errors: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    shares: dict = field(default_factory=dict)
    seconds: float = 0.0


def drive(name: str, base_url: str, clients: int, seconds: float, max_new_tokens: int) -> Row:
    """`clients` threads posting /generate to `base_url` in closed loops for `seconds`."""
    target = urlsplit(base_url)
    row, lock, stop = Row(name), threading.Lock(), threading.Event()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
        turn, mine = 0, []
        try:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    connection.request("POST", "/generate", json.dumps(payload(index, turn, max_new_tokens)), headers)
                    response = connection.getresponse()
                    body = response.read()
                    worker = response.getheader("x-smg-routed-worker-id") or base_url
                except (OSError, http.client.HTTPException) as error:
                    connection.close()
                    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
                    with lock:
                        row.errors.append(repr(error))
                    continue
                elapsed = time.perf_counter() - started
                turn += 1
                with lock:
                    if response.status != 200:
                        row.errors.append(f"{response.status}: {body[:120]!r}")
                        continue
                    row.requests += 1
                    row.tokens += len(json.loads(body)["output_ids"])
                    row.shares[worker] = row.shares.get(worker, 0) + 1
                mine.append(elapsed)
        finally:
            connection.close()
            with lock:
                row.latencies += mine

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    row.seconds = time.monotonic() - started
    return row


def table(rows: list[Row], urls: list[str]) -> list[str]:
    lines = [
        "| | requests/s | tokens/s | p50 s | p99 s | errors | share per replica |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        latencies = np.array(row.latencies) if row.latencies else np.array([np.nan])
        total = sum(row.shares.values()) or 1
        shares = " / ".join(f"{100 * row.shares.get(url, 0) / total:.0f}%" for url in urls if url in row.shares)
        lines.append(
            f"| {row.name} | {row.requests / row.seconds:.1f} | {row.tokens / row.seconds:.0f} | "
            f"{np.median(latencies):.2f} | {np.percentile(latencies, 99):.2f} | {len(row.errors)} | {shares} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--router", choices=("smg", "sglang-router"), default="smg")
    parser.add_argument("--output", type=Path, default=None, help="also write the report here (markdown)")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="router-bench-"))

    def start(index: int):
        repository = shipped_repository(root / f"models{index}")
        return launch(repository, root / f"replica{index}.log", stack_memory_bytes=None, env={"TRITON_API_KEY": KEY})

    load_before = os.getloadavg()
    with ThreadPoolExecutor(args.replicas) as pool:
        stacks = list(pool.map(start, range(args.replicas)))
    urls = [f"http://127.0.0.1:{stack.ports['api']}" for stack in stacks]
    rows = []
    try:
        drive("warm-up", urls[0], args.clients, min(5.0, args.seconds), args.max_new_tokens)
        rows.append(drive("1 replica, direct", urls[0], args.clients, args.seconds, args.max_new_tokens))
        with RouterProcess(args.router, urls[:1], api_key=KEY).start(MODEL) as router:
            rows.append(
                drive(f"1 replica behind {args.router}", router.url, args.clients, args.seconds, args.max_new_tokens)
            )
        with RouterProcess(args.router, urls, api_key=KEY).start(MODEL) as router:
            name = f"{args.replicas} replicas behind {args.router}"
            rows.append(drive(name, router.url, args.clients, args.seconds, args.max_new_tokens))
    finally:
        for stack in stacks:
            stack.stop()
    load_after = os.getloadavg()
    report = [
        "# Rollouts through the router against one replica (`bench/load/router.py`)",
        "",
        f"`python -m bench.load.router --replicas {args.replicas} --clients {args.clients} --seconds "
        f"{args.seconds:g} --max-new-tokens {args.max_new_tokens} --router {args.router}`, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {os.cpu_count()} CPU cores shared by every replica, "
        f"the router and the clients; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after. "
        f"SGLang /generate with masks (top_k 8), {args.max_new_tokens} tokens each, {args.clients} closed-loop "
        f"clients, {args.seconds:g} s per row.",
        "",
        *table(rows, urls),
    ]
    errors = [e for row in rows for e in row.errors[:3]]
    if errors:
        report += ["", "First errors: " + "; ".join(errors)]
    print("\n".join(report))
    if args.output is not None:
        args.output.write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
