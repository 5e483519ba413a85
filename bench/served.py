"""Served benchmark: B=1 rows through a real tritonserver vs the same rows sampled in-process.

perf_analyzer's PyPI wheel is only a placeholder on this platform, so a small bounded load
generator runs here: `concurrency` threads, each with its own client, each sending one request at
a time for a fixed duration. Protocols: HTTP, gRPC, and gRPC with the logits in system shared
memory (tritonclient.utils.shared_memory). The in-process reference runs the model's own path
(BatchSampler.run) on the same rows, one row per call and `concurrency` rows per call.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops.launcher import TritonServer
from triton_sampling_mask.sampling.params import RowParams

from .common import MODEL_REPOSITORY

MODEL = "sampler"
ROW_PARAMS = {"temperature": 0.8, "top_k": 512, "top_p": 0.95, "return_sampling_mask": True}
PROTOCOLS = ("http", "grpc", "grpc_shm")


def make_rows(count: int, vocab: int) -> np.ndarray:
    """A pool of distinct [1, V] logits rows the clients cycle through."""
    return (np.random.default_rng(1).standard_normal((count, 1, vocab)) * 3.0).astype(np.float32)


def _summary(latencies_s: list[float], rows: int, elapsed_s: float) -> dict:
    lat = np.asarray(latencies_s) * 1e3
    return {
        "requests": len(lat),
        "rows_per_s": rows / elapsed_s,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


class _Worker:
    """One client thread's connection; `send(row)` blocks until the response arrives."""

    def __init__(self, protocol: str, server: TritonServer, index: int, vocab: int):
        self.protocol = protocol
        if protocol == "http":
            self.module, self.client = httpclient, httpclient.InferenceServerClient(server.http_url)
        else:
            self.module, self.client = grpcclient, grpcclient.InferenceServerClient(server.grpc_url)
        self.region = None
        if protocol == "grpc_shm":
            self.byte_size = vocab * 4
            self.region = f"bench_logits_{os.getpid()}_{index}"
            self.handle = shm.create_shared_memory_region(self.region, "/" + self.region, self.byte_size)
            self.client.register_system_shared_memory(self.region, "/" + self.region, self.byte_size)
            # The scalar parameters are constant: build them once; only the logits change.
            self.param_inputs = sampler_inputs(grpcclient, np.zeros((1, 1), np.float32), **ROW_PARAMS)[1:]

    def send(self, row: np.ndarray) -> None:
        if self.region is None:
            self.client.infer(MODEL, sampler_inputs(self.module, row, **ROW_PARAMS))
            return
        shm.set_shared_memory_region(self.handle, [row])  # the producer writes logits into shm
        logits = grpcclient.InferInput("logits", list(row.shape), "FP32")
        logits.set_shared_memory(self.region, self.byte_size)
        self.client.infer(MODEL, [logits, *self.param_inputs])

    def close(self) -> None:
        try:
            if self.region is not None:
                unregister_shared_memory(self.client, self.region)
        finally:
            if self.region is not None:
                shm.destroy_shared_memory_region(self.handle)
            self.client.close()


def served_load(server: TritonServer, protocol: str, concurrency: int, rows: np.ndarray,
                duration_s: float, warmup_s: float) -> dict:
    """Closed-loop load: `concurrency` threads send B=1 requests back to back for `duration_s`."""
    workers = [_Worker(protocol, server, i, rows.shape[-1]) for i in range(concurrency)]
    latencies: list[list[float]] = [[] for _ in workers]
    sent = [0] * concurrency
    errors: list[BaseException] = []
    start_gate = threading.Barrier(concurrency + 1)
    phase = {"record_from": 0.0, "stop_at": 0.0}

    def loop(i: int) -> None:
        worker, n = workers[i], 0
        start_gate.wait()
        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= phase["stop_at"]:
                    return
                worker.send(rows[(i * 7 + n) % len(rows)])
                n += 1
                sent[i] = n
                if t0 >= phase["record_from"]:
                    latencies[i].append(time.perf_counter() - t0)
        except BaseException as exc:  # reported after the run; a failed run must not look fast
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    now = time.perf_counter()
    phase["record_from"], phase["stop_at"] = now + warmup_s, now + warmup_s + duration_s
    start_gate.wait()
    for thread in threads:
        thread.join()
    for worker in workers:
        worker.close()
    if errors:
        raise RuntimeError(f"{protocol} load failed: {errors[0]!r}")
    done = [lat for per_worker in latencies for lat in per_worker]
    return {"protocol": protocol, "concurrency": concurrency, "sent": sum(sent), **_summary(done, len(done), duration_s)}


def in_process_load(rows: np.ndarray, rows_per_call: int, width: int, duration_s: float) -> dict:
    """The same rows through BatchSampler.run (validation + sampling), `rows_per_call` B=1 requests
    per call, as the model's execute gets them from the dynamic batcher."""
    from triton_sampling_mask.sampling.validation import MaskPolicy

    sampler = BatchSampler(TorchSamplingBackend(), MaskPolicy(width, "config.pbtxt"), torch.device("cpu"))
    params = RowParams.defaults(1)
    params.temperature[:] = ROW_PARAMS["temperature"]
    params.top_k[:] = ROW_PARAMS["top_k"]
    params.top_p[:] = ROW_PARAMS["top_p"]
    params.return_sampling_mask[:] = ROW_PARAMS["return_sampling_mask"]
    tensors = [torch.from_numpy(row) for row in rows]
    latencies, n = [], 0
    sampler.run([(tensors[0], params)])  # warm-up
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        requests = [(tensors[(n + j) % len(tensors)], params) for j in range(rows_per_call)]
        t0 = time.perf_counter()
        outcomes = sampler.run(requests)
        latencies.append(time.perf_counter() - t0)
        assert all(o.error is None for o in outcomes), outcomes[0].error
        n += rows_per_call
    return {"protocol": "in_process", "rows_per_call": rows_per_call, **_summary(latencies, n, time.perf_counter() - start)}


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU seconds of a process, with its descendants unless told not to (/proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (OSError, IndexError):
            continue
        stack.extend(int(c) for c in children if descendants)
    return total


def model_statistics(server: TritonServer) -> dict:
    """The sampler's cumulative server-side statistics (counts and nanoseconds per phase)."""
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.get_inference_statistics(MODEL)["model_stats"][0]
    finally:
        client.close()


def server_breakdown(before: dict, after: dict) -> dict:
    """Where a point's time went inside the server: mean rows per execute and mean ms per
    request spent queued, copying inputs in, inside execute, and copying outputs out."""
    executions = int(after["execution_count"]) - int(before["execution_count"])
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    out = {"mean_rows_per_execute": inferences / executions if executions else 0.0}
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        count = int(after["inference_stats"][phase]["count"]) - int(before["inference_stats"][phase]["count"])
        ns = int(after["inference_stats"][phase]["ns"]) - int(before["inference_stats"][phase]["ns"])
        out[f"{phase}_ms"] = ns / count / 1e6 if count else 0.0
    return out


def run_served_benchmark(width: int, vocab: int, concurrencies, duration_s: float, warmup_s: float,
                         progress=print) -> dict:
    """In-process first (server not yet up), then every protocol x concurrency on one server."""
    rows = make_rows(32, vocab)
    in_process = [in_process_load(rows, c, width, duration_s) for c in sorted({1, *concurrencies})]
    for entry in in_process:
        progress(f"  in-process {entry['rows_per_call']} rows/call: {entry['rows_per_s']:.1f} rows/s")
    served = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        repository = Path(tmp) / "model_repository"
        shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
        with TritonServer(repository, log_path=Path(tmp) / "tritonserver.log") as server:
            for protocol in PROTOCOLS:
                for concurrency in concurrencies:
                    before = model_statistics(server)
                    cpu_before = (cpu_seconds(server.process.pid), cpu_seconds(os.getpid(), descendants=False))
                    entry = served_load(server, protocol, concurrency, rows, duration_s, warmup_s)
                    entry["server"] = server_breakdown(before, model_statistics(server))
                    # CPU milliseconds per row (warm-up included) on each side of the wire:
                    # client and server share the 2 cores, so this shows what the client costs.
                    done = max(entry["sent"], 1)
                    entry["cpu_ms_per_row"] = {
                        "server": (cpu_seconds(server.process.pid) - cpu_before[0]) * 1e3 / done,
                        "client": (cpu_seconds(os.getpid(), descendants=False) - cpu_before[1]) * 1e3 / done,
                    }
                    served.append(entry)
                    progress(f"  {protocol} c={concurrency}: {entry['rows_per_s']:.1f} rows/s, "
                             f"p50 {entry['p50_ms']:.2f} ms, p99 {entry['p99_ms']:.2f} ms, server {entry['server']}")
    return {"vocab": vocab, "row_params": ROW_PARAMS, "duration_s": duration_s, "in_process": in_process, "served": served}
