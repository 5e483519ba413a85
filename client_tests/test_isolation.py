"""Isolation: requests that Triton coalesced into one dynamic batch, some of them invalid; every
valid one gets its normal answer and every invalid one its own 400.

The model's batch statistics prove the mixing: valid requests carry 1 row and invalid ones
INVALID_ROWS rows, and a burst holds fewer than INVALID_ROWS valid requests, so an execution's
batch size b (its total rows) decodes as b // INVALID_ROWS invalid plus b % INVALID_ROWS valid
requests. An execution with both counts above zero mixed valid and invalid requests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.server import infer

from .reliability import INVALID_ARGUMENT, check_against_reference, expect_error, model_stats

VALID_PER_BURST = 16  # 1-row requests
INVALID_ROWS = 32  # rows of each invalid request: more than VALID_PER_BURST
VOCAB = 2048
TEMPERATURE, TOP_K = 0.8, 20
# Invalid requests of a burst: (parameter overrides, logits poison, field named in the 400); the
# last row alone is bad, so the whole request fails and the message names the field and row.
INVALID = [
    ({"top_p": 0.0}, None, "top_p"),
    ({"top_k": -1}, None, "top_k"),  # an unbounded mask request
    ({"temperature": -1.0}, None, "temperature"),
    ({"min_p": 1.0}, None, "min_p"),
    ({}, np.nan, "logits"),
]
BURST = VALID_PER_BURST + len(INVALID)  # 16 + 5 * 32 = 176 rows <= max_batch_size 256
MAX_BURSTS = 5  # bounded: the first burst normally mixes already


def execution_mix(before: dict, after: dict) -> tuple[int, int, list[tuple[int, int]]]:
    """(requests, executions, [(valid, invalid) requests of each new mixed execution])."""
    requests = sum(
        after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"] for k in ("success", "fail")
    )
    executions = after["execution_count"] - before["execution_count"]
    counts_before = {b["batch_size"]: b["compute_infer"]["count"] for b in before.get("batch_stats", [])}
    mixed = []
    for entry in after.get("batch_stats", []):
        size = entry["batch_size"]
        invalid, valid = divmod(size, INVALID_ROWS)
        if valid and invalid:
            mixed += [(valid, invalid)] * (entry["compute_infer"]["count"] - counts_before.get(size, 0))
    return requests, executions, mixed


def settled_stats(http_url: str, before: dict, expected_requests: int) -> dict:
    """Stats once they count every request sent: Triton records them just after the responses
    go out, so a snapshot taken right after the last answer can lag (bounded polling)."""
    for _ in range(400):
        after = model_stats(http_url)
        if execution_mix(before, after)[0] >= expected_requests:
            break
        time.sleep(0.05)
    return after


def run_burst(triton_server, burst: int) -> None:
    """Send one burst, released together, over both protocols, and check every answer."""
    rng = np.random.default_rng(burst)
    release = threading.Barrier(BURST)
    # Every request carries the same inputs: Triton batches only requests with the same input set.
    params = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, min_p=0.0, seed=burst, return_sampling_mask=True)

    def send(i: int) -> None:
        module = httpclient if i % 2 else grpcclient
        client = module.InferenceServerClient(triton_server.http_url if i % 2 else triton_server.grpc_url)
        try:
            if i < VALID_PER_BURST:
                logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
                release.wait(timeout=60)
                outputs = infer(client, module, "sampler", logits, **params)
                check_against_reference(outputs, logits, TEMPERATURE, TOP_K, want_mask=True)
            else:
                overrides, poison, field = INVALID[i - VALID_PER_BURST]
                logits = rng.standard_normal((INVALID_ROWS, VOCAB)).astype(np.float32)
                row_params = {**params, **{k: [params[k]] * (INVALID_ROWS - 1) + [v] for k, v in overrides.items()}}
                if poison is not None:
                    logits[-1, 7] = poison
                release.wait(timeout=60)
                message = expect_error(lambda: infer(client, module, "sampler", logits, **row_params), INVALID_ARGUMENT)
                assert field in message and f"(row {INVALID_ROWS - 1})" in message, message
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
        requests, executions, mixed = execution_mix(before, after)
        if mixed:
            break
    print(f"{burst + 1} burst(s): {requests} requests in {executions} executions; mixed (valid, invalid): {mixed}")
    assert requests == BURST * (burst + 1)
    assert mixed, f"no execution mixed valid and invalid requests ({executions} executions)"
