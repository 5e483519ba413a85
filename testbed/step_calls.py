"""Decode-step calls of the sampler, timed call by call: what an engine that calls it once per step
waits (bench/step_latency.py measures it, client_tests/test_step_latency.py bounds its outliers)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import INPUT_DTYPES, infer_input, sampler_inputs
from triton_sampling_mask.sampling.outputs import OUTPUT_IDS, OUTPUT_LOGPROBS, SAMPLING_MASK, SAMPLING_MASK_LEN
from triton_sampling_mask.sampling.params import LOGITS

MODEL = "sampler"
# A decode step's call: the sampler's defaults but top_k 50, with the mask.
STEP_PARAMS = {"top_k": 50, "return_sampling_mask": True}
# What a step reads back: the token, its log-prob and the support.
STEP_OUTPUTS = tuple(spec.name for spec in (OUTPUT_IDS, OUTPUT_LOGPROBS, SAMPLING_MASK, SAMPLING_MASK_LEN))
# A call (or a generate stream's gap between tokens) slower than this is an outlier; the targets
# allow none in a point.
SLOW_MS = 200.0


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

    def call(self, logits: np.ndarray, request_id: str = "") -> None:
        """One step: `logits` [rows, V] in, the requested outputs back (`request_id` names it in
        tritonserver's traces)."""
        if self.region is None:
            tensor = infer_input(grpcclient, LOGITS, logits, INPUT_DTYPES[LOGITS])
        else:
            shm.set_shared_memory_region(self.handle, [logits])
            tensor = self.logits
        self.client.infer(self.model, [tensor, *self.params], outputs=self.outputs, request_id=request_id)

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
    calls: list  # (request id, start ns, end ns) per call, on the monotonic clock tritonserver's traces use


def closed_loop(
    url: str,
    logits: np.ndarray,
    calls: int,
    concurrency: int,
    shared_memory: bool = False,
    model: str = MODEL,
    warmup_calls: int = 2,
    id_prefix: str = "step",
) -> StepRun:
    """`calls` step calls (`logits` [N, rows, V], cycled through) split evenly over `concurrency`
    closed-loop clients that start together after `warmup_calls` unrecorded calls each (call n of
    client i has the request id `id_prefix`-i-n). Raises
    the first client error (a failed call must not look fast)."""
    per_client = calls // concurrency
    rows, vocab = logits.shape[1:]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    calls: list[list[tuple[str, int, int]]] = [[] for _ in range(concurrency)]
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
                    request_id = f"{id_prefix}-{index}-{n}"
                    started = time.monotonic_ns()
                    step.call(array, request_id)
                    ended = time.monotonic_ns()
                    latencies[index].append((ended - started) / 1e9)
                    calls[index].append((request_id, started, ended))
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
    return StepRun(
        np.array([lat for mine in latencies for lat in mine]) * 1e3, elapsed, [call for mine in calls for call in mine]
    )


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
