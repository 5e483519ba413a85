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
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import INPUT_DTYPES, infer_input, sampler_inputs
from triton_sampling_mask.ops.server_process import TritonServer
from triton_sampling_mask.sampling.outputs import OUTPUT_IDS, OUTPUT_LOGPROBS, SAMPLING_MASK, SAMPLING_MASK_LEN
from triton_sampling_mask.sampling.params import LOGITS

from . import report, served_call
from .common import MODEL_REPOSITORY, machine_facts, server_breakdown
from .load import generate as generate_load

MODEL = "sampler"
GENERATE_MODEL = "generate"
# A decode step's call: the sampler's defaults but top_k 50, with the mask.
STEP_PARAMS = {"top_k": 50, "return_sampling_mask": True}
# What a step reads back: the token, its log-prob and the support.
STEP_OUTPUTS = tuple(spec.name for spec in (OUTPUT_IDS, OUTPUT_LOGPROBS, SAMPLING_MASK, SAMPLING_MASK_LEN))
# A call (or a generate stream's gap between tokens) slower than this is an outlier; the targets
# allow none in a point.
SLOW_MS = 200.0
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


def make_step_logits(count: int, rows: int, vocab: int, seed: int = 1) -> np.ndarray:
    """A pool of `count` distinct [rows, V] FP32 logits arrays (N(0, 3^2)) the clients cycle through."""
    return (np.random.default_rng(seed).standard_normal((count, rows, vocab)) * 3.0).astype(np.float32)


class StepClient:
    """One client's gRPC connection to the sampler; `call(logits)` blocks until the answer is in.
    With `shared_memory` the logits go through a system shared-memory region of its own, written
    before each call (as an engine writes a step's logits), registered for the client's lifetime."""

    def __init__(self, url: str, rows: int, vocab: int, shared_memory: bool = False, model: str = MODEL):
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.outputs = [grpcclient.InferRequestedOutput(name) for name in STEP_OUTPUTS]
        self.params = sampler_inputs(grpcclient, np.zeros((rows, 1), np.float32), **STEP_PARAMS)[1:]
        self.region = self.handle = None
        if shared_memory:
            byte_size = rows * vocab * 4
            self.region = f"step_logits_{os.getpid()}_{id(self)}"
            self.handle = shm.create_shared_memory_region(self.region, "/" + self.region, byte_size)
            try:
                self.client.register_system_shared_memory(self.region, "/" + self.region, byte_size)
            except BaseException:
                shm.destroy_shared_memory_region(self.handle)
                self.client.close()
                raise
            self.logits = grpcclient.InferInput(LOGITS, [rows, vocab], INPUT_DTYPES[LOGITS])
            self.logits.set_shared_memory(self.region, byte_size)

    def call(self, logits: np.ndarray) -> None:
        """One step: `logits` [rows, V] in, the requested outputs back."""
        if self.region is None:
            tensor = infer_input(grpcclient, LOGITS, logits, INPUT_DTYPES[LOGITS])
        else:
            shm.set_shared_memory_region(self.handle, [logits])
            tensor = self.logits
        self.client.infer(self.model, [tensor, *self.params], outputs=self.outputs)

    def close(self) -> None:
        """Unregister and remove the region (if any), then close the connection."""
        try:
            if self.region is not None:
                unregister_shared_memory(self.client, self.region)
        finally:
            if self.handle is not None:
                shm.destroy_shared_memory_region(self.handle)
            self.client.close()


@dataclass
class StepRun:
    """What the clients of one closed-loop run saw."""

    latencies_ms: np.ndarray  # one per call
    elapsed_s: float  # from the clients' common start to the last answer


def closed_loop(
    url: str,
    logits: np.ndarray,
    calls: int,
    concurrency: int,
    shared_memory: bool = False,
    model: str = MODEL,
    warmup_calls: int = 2,
) -> StepRun:
    """`calls` step calls (`logits` [N, rows, V], cycled through) split evenly over `concurrency`
    closed-loop clients that start together after `warmup_calls` unrecorded calls each. Raises
    the first client error (a failed call must not look fast)."""
    per_client = calls // concurrency
    rows, vocab = logits.shape[1:]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    start_gate = threading.Barrier(concurrency + 1)

    def client(index: int) -> None:
        step = None
        try:
            step = StepClient(url, rows, vocab, shared_memory, model)
            for n in range(warmup_calls):
                step.call(logits[(index + n) % len(logits)])
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)
        start_gate.wait()
        try:
            if not errors:
                for n in range(per_client):
                    array = logits[(index * 7 + n) % len(logits)]
                    started = time.perf_counter()
                    step.call(array)
                    latencies[index].append(time.perf_counter() - started)
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)
        finally:
            if step is not None:
                step.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    start_gate.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"step calls failed ({len(errors)} clients): {errors[0]!r}") from errors[0]
    return StepRun(np.array([lat for mine in latencies for lat in mine]) * 1e3, elapsed)


def latency_summary(ms: np.ndarray) -> dict:
    """Count, p50 / p99 / p99.9 / max in ms, and how many are over SLOW_MS."""
    ms = np.asarray(ms, dtype=float)
    p50, p99, p999 = np.percentile(ms, [50, 99, 99.9])
    return {
        "calls": int(ms.size),
        "p50_ms": float(p50),
        "p99_ms": float(p99),
        "p999_ms": float(p999),
        "max_ms": float(ms.max()),
        "over_slow": int((ms > SLOW_MS).sum()),
    }


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
