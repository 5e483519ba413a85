"""Step latency: what an engine that calls the sampler once per decode step waits, call by call.

    python -m bench.step_latency [--tiny] [--calls N] [--skip-itl] [--output PATH]

An engine's rollout is as slow as its slowest steps, so this times every call, not a mean:
`calls` closed-loop calls of `rows` rows of V FP32 logits each (top_k 50 with a mask, only the
outputs a step reads requested), split evenly over `concurrency` clients (one thread and one gRPC
connection each), each sending its next call when the previous one is answered. Per point:
p50 / p99 / p99.9 / max, the calls over SLOW_MS, rows/s, and the server's own mean queue and
compute times. `make bench` runs B=1 and B=8 rows per call, V=151936, over gRPC with and without
system shared memory, at concurrency 1, 8 and 16, 10,000 calls each, on the served benchmark's
server, then the `generate` model's inter-token gaps at 32 concurrent streams
(bench/load/generate.py's closed-loop clients, streaming, masks on). Alone, this module starts a
server of its own.

The client is Python's tritonclient at every point: perf_analyzer 2.51's only per-request record,
its profile export, writes each request's input tensors as JSON numbers (gigabytes of logits
without shared memory) and, with shared memory, reads them from unset buffers, whose garbage
(NaN among it) leaves the file empty on most runs of a few hundred requests; its CSV
has no p99.9, no max and no count of slow calls.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from testbed.step_calls import MODEL, SLOW_MS, STEP_OUTPUTS, STEP_PARAMS, closed_loop, latency_summary, make_step_logits
from triton_sampling_mask.ops.server_process import TritonServer

from . import report, served_call
from .common import MODEL_REPOSITORY, machine_facts, server_breakdown
from .load import generate as generate_load

GENERATE_MODEL = "generate"
PATHS = ("grpc", "grpc_shm")
# Points and sizes: full (`make bench`) and --tiny (a seconds-long check of the code path).
SIZES = {
    "full": {
        "vocab": 151936,
        "rows": (1, 8),
        "concurrency": (1, 8, 16),
        "calls": 10_000,
        "itl": {"streams": 32, "requests_per_stream": 2, "max_new_tokens": 128},
    },
    "tiny": {
        "vocab": 1000,
        "rows": (1, 8),
        "concurrency": (1, 2),
        "calls": 40,
        "itl": {"streams": 2, "requests_per_stream": 1, "max_new_tokens": 8},
    },
}
POOL = 32  # distinct logits arrays per point, cycled through


def step_points(server, size: dict, calls: int | None = None, progress=print) -> list[dict]:
    """Every rows x path x concurrency point of `size` (SIZES) on `server`, which serves the shipped
    sampler."""
    calls = calls or size["calls"]
    entries = []
    for rows in size["rows"]:
        logits = make_step_logits(POOL, rows, size["vocab"])
        for path in PATHS:
            for concurrency in size["concurrency"]:
                before = served_call.model_statistics(server, MODEL)
                run = closed_loop(server.grpc_url, logits, calls, concurrency, shared_memory=path == "grpc_shm")
                entry = {
                    "rows": rows,
                    "path": path,
                    "concurrency": concurrency,
                    "client": "python",
                    **latency_summary(run.latencies_ms),
                    "rows_per_s": run.latencies_ms.size * rows / run.elapsed_s,
                    "server": server_breakdown(before, served_call.model_statistics(server, MODEL)),
                }
                entries.append(entry)
                progress(
                    f"  step B={rows} {path} c={concurrency}: {entry['calls']} calls, p50 {entry['p50_ms']:.2f} ms, "
                    f"p99 {entry['p99_ms']:.2f} ms, p99.9 {entry['p999_ms']:.1f} ms, max {entry['max_ms']:.1f} ms, "
                    f"{entry['over_slow']} over {SLOW_MS:.0f} ms, {entry['rows_per_s']:.0f} rows/s, "
                    f"server queue {entry['server']['queue_ms']:.2f} ms"
                )
    return entries


def itl_point(server, streams: int, requests_per_stream: int, max_new_tokens: int, progress=print) -> dict:
    """The `generate` model's inter-token gaps: `streams` closed-loop gRPC streams, each sending
    `requests_per_stream` streaming requests of `max_new_tokens` tokens (ignore_eos), one after the
    other. Loads the model first where the server has not (explicit model control)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if not client.is_model_ready(GENERATE_MODEL):
            client.load_model(GENERATE_MODEL)
    finally:
        client.close()
    generate_load.closed_loop(server.grpc_url, GENERATE_MODEL, np.full((2, 1), 8), stream=False)  # warm-up
    budgets = np.full((streams, requests_per_stream), max_new_tokens)
    stats = generate_load.closed_loop(server.grpc_url, GENERATE_MODEL, budgets, stream=True)
    if stats.errors:
        raise RuntimeError(f"generate streams failed ({len(stats.errors)}): {stats.errors[0]}")
    entry = {
        "streams": streams,
        "requests_per_stream": requests_per_stream,
        "max_new_tokens": max_new_tokens,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / stats.seconds,
        "ttft_p50_ms": float(np.percentile(stats.ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(stats.ttft, 99) * 1e3),
        **latency_summary(np.asarray(stats.itl) * 1e3),
    }
    progress(
        f"  generate ITL, {streams} streams: {entry['calls']} gaps, p50 {entry['p50_ms']:.1f} ms, "
        f"p99 {entry['p99_ms']:.1f} ms, max {entry['max_ms']:.1f} ms, {entry['over_slow']} over {SLOW_MS:.0f} ms; "
        f"{entry['tokens_per_s']:.0f} tokens/s"
    )
    return entry


def run_on_server(server, size: dict, calls: int | None = None, itl: bool = True, progress=print) -> dict:
    """The step points, then (with `itl`) generate's inter-token gaps, on a running server that serves
    the shipped sampler (and loads `generate` when asked)."""
    out = {
        "vocab": size["vocab"],
        "params": STEP_PARAMS,
        "outputs": list(STEP_OUTPUTS),
        "calls_per_point": calls or size["calls"],
        "slow_ms": SLOW_MS,
        "client": "python",
        "points": step_points(server, size, calls, progress),
    }
    if itl:
        out["itl"] = itl_point(server, **size["itl"], progress=progress)
    return out


def main(argv: list[str] | None = None) -> dict:
    """This benchmark alone, on a server of its own (`make bench` runs it on the served one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="V=1000, concurrency 1 and 2, 40 calls per point")
    parser.add_argument("--calls", type=int, default=None, help="calls per point (default 10,000; tiny 40)")
    parser.add_argument("--skip-itl", action="store_true", help="no generate inter-token gaps")
    parser.add_argument("--output", type=Path, default=None, help="write the results' JSON here")
    args = parser.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "full"]
    load_before = machine_facts()["load_average_1m"]
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        tmp = Path(tmp)
        repository = tmp / "model_repository"
        shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
        with TritonServer(
            repository, extra_args=served_call.explicit_models([MODEL]), log_path=tmp / "tritonserver.log"
        ) as server:
            results = run_on_server(server, size, args.calls, not args.skip_itl)
    results["load_average_1m"] = {"before": load_before, "after": machine_facts()["load_average_1m"]}
    report.print_step_table(results)
    report.print_verdicts(report.step_verdicts(results))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
