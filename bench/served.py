"""Served benchmark: B=1 rows through a real tritonserver vs the same rows sampled in-process.

The load comes from perf_analyzer (Triton's C++ client, bench/perf_analyzer.py) where its binary
runs: `concurrency` synchronous streams for three windows of a third of the duration each, on the
`bench_sampler` model (the shipped config with every input required: perf_analyzer's shared-memory
mode refuses optional inputs), the rows and parameters given as real input data. Where it cannot
run, a small bounded Python load generator does: `concurrency` threads, each with its own client,
each sending one request at a time for a fixed duration, on the shipped `sampler`. Protocols:
HTTP, gRPC, and gRPC with the logits in system shared memory. The in-process reference runs the
model's own path (BatchSampler.run) on the same rows, one row per call and `concurrency` rows per
call. The same server then serves the one-call B=64 table (bench/served_call.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from testbed.process_memory import cpu_seconds
from testbed.server import TritonServer
from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams

from . import perf_analyzer as pa_module
from . import served_call
from .common import MODEL_REPOSITORY, server_breakdown

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


def served_load(
    server: TritonServer, protocol: str, concurrency: int, rows: np.ndarray, duration_s: float, warmup_s: float
) -> dict:
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
    return {
        "protocol": protocol,
        "concurrency": concurrency,
        "sent": sum(sent),
        **_summary(done, len(done), duration_s),
    }


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
    return {
        "protocol": "in_process",
        "rows_per_call": rows_per_call,
        **_summary(latencies, n, time.perf_counter() - start),
    }


def perf_analyzer_load(
    pa,
    server: TritonServer,
    protocol: str,
    concurrency: int,
    input_data: Path,
    vocab: int,
    width: int,
    duration_s: float,
    work_dir: Path,
) -> dict:
    """One point of the B=1 table through perf_analyzer: three windows of duration_s / 3 when that is
    at least a second (a shorter window may hold no completed request across a ~0.5 s stall), else
    (--tiny) three windows of 4 x concurrency requests."""
    window_ms = int(duration_s * 1000 / 3)
    windows = {"window_ms": window_ms} if window_ms >= 1000 else {"window_requests": 4 * concurrency}
    measured = pa_module.measure(
        pa,
        server.grpc_url if protocol.startswith("grpc") else server.http_url,
        protocol.split("_")[0],
        pa_module.BENCH_MODELS["FP32"],
        input_data,
        1,
        vocab,
        protocol.endswith("_shm"),
        output_bytes=4 * width,
        work_dir=work_dir,
        concurrency=concurrency,
        timeout_s=120 + 10 * duration_s,
        **windows,
    )
    return {"protocol": protocol, "concurrency": concurrency, "sent": measured["requests"], **measured}


def _pa_input_data(rows: np.ndarray, work_dir: Path) -> Path:
    """The B=1 rows as perf_analyzer input data: ROW_PARAMS, min_p 0 and a seed per row."""
    count = rows.shape[0]
    params = {
        "temperature": np.full(count, ROW_PARAMS["temperature"], np.float32),
        "top_k": np.full(count, ROW_PARAMS["top_k"], np.int32),
        "top_p": np.full(count, ROW_PARAMS["top_p"], np.float32),
        "min_p": np.zeros(count, np.float32),
        "seed": np.arange(count, dtype=np.uint64),
        "return_sampling_mask": np.full(count, ROW_PARAMS["return_sampling_mask"], np.bool_),
    }
    return pa_module.write_input_data(work_dir / "rows_b1.json", rows.reshape(count, -1), params)


def run_served_benchmark(
    width: int,
    vocab: int,
    concurrencies,
    duration_s: float,
    warmup_s: float,
    progress=print,
    *,
    call_tiny: bool | None = None,
    call_requests: int | None = None,
    use_perf_analyzer: bool = True,
    on_server=None,
) -> tuple[dict, dict | None, object]:
    """In-process first (server not yet up), then every protocol x concurrency on one server, then
    (unless `call_tiny` is None) the one-call B x V table of served_call on the same server, then
    `on_server(server)` (the step-latency points) there.
    Returns the B=1 results, the call table and what `on_server` returned (None when not run)."""
    rows = make_rows(32, vocab)
    in_process = [in_process_load(rows, c, width, duration_s) for c in sorted({1, *concurrencies})]
    for entry in in_process:
        progress(f"  in-process {entry['rows_per_call']} rows/call: {entry['rows_per_s']:.1f} rows/s")
    prepared = None if call_tiny is None else served_call.prepare(call_tiny, width, progress=progress)
    pa, pa_status = pa_module.locate() if use_perf_analyzer else (None, "disabled (--no-perf-analyzer)")
    progress(
        f"  load generator: {'perf_analyzer, ' + pa_status if pa else 'Python (perf_analyzer: ' + pa_status + ')'}"
    )
    served, call, extra = [], None, None
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        repository = Path(tmp) / "model_repository"
        shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
        models = [MODEL, *pa_module.bench_models(repository)]
        if prepared is not None:
            models += pa_module.noop_models(repository)
        input_data = _pa_input_data(rows, Path(tmp)) if pa else None
        with TritonServer(
            repository, extra_args=served_call.explicit_models(models), log_path=Path(tmp) / "tritonserver.log"
        ) as server:
            if pa is not None:  # the first call of a model grows its stub's pool: not in a timed point
                served_call.warm_up(server, pa_module.BENCH_MODELS["FP32"], rows[0], "FP32")
            for protocol in PROTOCOLS:
                for concurrency in concurrencies:
                    model = pa_module.BENCH_MODELS["FP32"] if pa else MODEL
                    before = served_call.model_statistics(server, model)
                    cpu_before = (cpu_seconds(server.process.pid), cpu_seconds(os.getpid(), descendants=False))
                    entry = None
                    if pa is not None:
                        try:
                            entry = perf_analyzer_load(
                                pa, server, protocol, concurrency, input_data, vocab, width, duration_s, Path(tmp)
                            )
                            entry["client"] = "perf_analyzer"
                        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                            progress(
                                f"  perf_analyzer failed at {protocol} c={concurrency}; Python load instead: "
                                f"{str(exc)[:300]}"
                            )
                            model = MODEL
                            before = served_call.model_statistics(server, model)
                            cpu_before = (cpu_seconds(server.process.pid), cpu_seconds(os.getpid(), descendants=False))
                    if entry is None:
                        entry = served_load(server, protocol, concurrency, rows, duration_s, warmup_s)
                        entry["client"] = "python"
                    entry["model"] = model
                    entry["server"] = server_breakdown(before, served_call.model_statistics(server, model))
                    # CPU milliseconds per row (warm-up included) on each side of the wire: client
                    # and server share the 2 cores, so this shows what the client costs. The
                    # perf_analyzer client's figure includes its start-up (reading the input data).
                    done = max(entry["sent"], 1)
                    client_cpu = (
                        entry["client_cpu_s"]
                        if entry["client"] == "perf_analyzer"
                        else cpu_seconds(os.getpid(), descendants=False) - cpu_before[1]
                    )
                    entry["cpu_ms_per_row"] = {
                        "server": (cpu_seconds(server.process.pid) - cpu_before[0]) * 1e3 / done,
                        "client": client_cpu * 1e3 / done,
                    }
                    served.append(entry)
                    progress(
                        f"  {protocol} c={concurrency} ({entry['client']}): {entry['rows_per_s']:.1f} rows/s, "
                        f"p50 {entry['p50_ms']:.2f} ms, p99 {entry['p99_ms']:.2f} ms, server {entry['server']}"
                    )
            if prepared is not None:
                call = served_call.run_on_server(
                    prepared,
                    server,
                    call_requests,
                    Path(tmp),
                    pa,
                    pa_status,
                    progress,
                    statistics=served_call.model_statistics,
                )
            if on_server is not None:
                extra = on_server(server)
    clients = sorted({e["client"] for e in served})
    return (
        {
            "vocab": vocab,
            "row_params": ROW_PARAMS,
            "duration_s": duration_s,
            "load_generator": ", ".join(clients),
            "perf_analyzer": pa_status,
            "in_process": in_process,
            "served": served,
        },
        call,
        extra,
    )
