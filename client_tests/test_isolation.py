"""Isolation: requests that Triton coalesced into one dynamic batch, some of them invalid; every
valid one gets its normal answer and every invalid one its own 400. The model's statistics
prove that executions of more than one request happened."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .reliability import INVALID_ARGUMENT, check_against_reference, expect_error, model_stats
from .server import infer

BURST = 24  # single-row requests released together
VOCAB = 4096
TEMPERATURE, TOP_K = 0.8, 20
# Invalid requests of the burst: (parameter overrides, logits poison, field named in the 400).
INVALID = [
    ({"top_p": 0.0}, None, "top_p"),
    ({"top_k": -1}, None, "top_k"),  # an unbounded mask request
    ({"temperature": -1.0}, None, "temperature"),
    ({"min_p": 1.0}, None, "min_p"),
    ({}, np.nan, "logits"),
]
MAX_BURSTS = 5  # bounded: the first burst normally batches already


def batched_executions(before: dict, after: dict) -> tuple[int, int, int]:
    """(requests, executions, executions of more than one request) between two stats snapshots.
    Every request of the burst has one row, so a batch_size above 1 means several requests."""
    requests = sum(after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"] for k in ("success", "fail"))
    executions = after["execution_count"] - before["execution_count"]
    sizes_before = {b["batch_size"]: b["compute_infer"]["count"] for b in before.get("batch_stats", [])}
    multi = sum(
        b["compute_infer"]["count"] - sizes_before.get(b["batch_size"], 0)
        for b in after.get("batch_stats", [])
        if b["batch_size"] > 1
    )
    return requests, executions, multi


def settled_stats(http_url: str, before: dict, expected_requests: int) -> dict:
    """Stats once they count every request sent: Triton records them just after the responses
    go out, so a snapshot taken right after the last answer can lag (bounded polling)."""
    for _ in range(400):
        after = model_stats(http_url)
        if batched_executions(before, after)[0] >= expected_requests:
            break
        time.sleep(0.05)
    return after


def run_burst(triton_server, burst: int) -> None:
    """Send one burst (half HTTP, half gRPC) and check every answer."""
    rng = np.random.default_rng(burst)
    logits = rng.standard_normal((BURST, 1, VOCAB)).astype(np.float32)
    release = threading.Barrier(BURST)

    def send(i: int) -> None:
        module = httpclient if i % 2 else grpcclient
        url = triton_server.http_url if i % 2 else triton_server.grpc_url
        client = module.InferenceServerClient(url)
        params = dict(temperature=TEMPERATURE, top_k=TOP_K, return_sampling_mask=True, seed=i)
        try:
            release.wait(timeout=60)
            if i % 3:
                outputs = infer(client, module, "sampler", logits[i], **params)
                check_against_reference(outputs, logits[i], TEMPERATURE, TOP_K, want_mask=True)
            else:
                overrides, poison, field = INVALID[(i // 3) % len(INVALID)]
                row = logits[i].copy()
                if poison is not None:
                    row[0, 7] = poison
                message = expect_error(lambda: infer(client, module, "sampler", row, **{**params, **overrides}), INVALID_ARGUMENT)
                assert field in message
        finally:
            client.close()

    with ThreadPoolExecutor(BURST) as pool:
        for future in [pool.submit(send, i) for i in range(BURST)]:
            future.result()  # re-raises any failed check


def test_invalid_requests_in_a_batch_cost_the_valid_ones_nothing(triton_server):
    before = model_stats(triton_server.http_url)
    for burst in range(MAX_BURSTS):
        run_burst(triton_server, burst)
        after = settled_stats(triton_server.http_url, before, BURST * (burst + 1))
        requests, executions, multi = batched_executions(before, after)
        if multi:
            break
    print(f"bursts {burst + 1}: {requests} requests in {executions} executions, {multi} of several requests")
    assert requests == BURST * (burst + 1)
    assert executions < requests and multi > 0, f"no execution held more than one request ({executions} executions)"
