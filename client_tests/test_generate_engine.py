"""The continuous-batching engine of `generate` through a real tritonserver of its own.

The server holds three variants of the shipped `generate` model: `generate` (shipped bounds),
`generate_tight` (one active sequence, one waiting: the refusal beyond the bounds) and
`generate_queue` (one active sequence, 64 waiting prompt tokens, a 256-token KV budget). Joins,
cancellation, refusals, queue bounds, the client's retries of busy refusals, one final each.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from testbed.metrics import counter, wait_for_counter
from testbed.server import ExternalTritonServer, TritonServer, copy_model
from triton_sampling_mask.client import GenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams

from .generate_client import GenerateStream, collect, grpc_generate, http_generate

SAMPLED = dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.03, return_sampling_mask=True, ignore_eos=True)
VARIANTS = {
    "generate": {},
    "generate_tight": {"max_active_sequences": "1", "max_waiting": "1"},
    "generate_queue": {"max_active_sequences": "1", "max_waiting_tokens": "64", "kv_budget_tokens": "256"},
}
QUEUE = "generate_queue"


def build_engine_repository(dest, variants: dict[str, dict[str, str]]):
    """A repository with one copy of the shipped generate model per variant (config overrides)."""
    for name, overrides in variants.items():
        copy_model(dest, "generate", name, overrides)
    return dest


def wait_until_no_request_runs(server, model: str) -> None:
    """Wait until `model` runs no request: cancelled ones have left its slot."""
    wait_for_counter(
        server.metrics_url,
        "generate_num_requests_running",
        lambda v: v == 0,
        "the cancelled requests kept the slot",
        timeout_s=60,
        model=model,
    )


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver with generate variants of its own")
    repository = build_engine_repository(tmp_path_factory.mktemp("engine_models"), VARIANTS)
    # Explicit model control: the last test unloads a variant while it generates.
    control = ["--model-control-mode=explicit", *(f"--load-model={name}" for name in VARIANTS)]
    with TritonServer(
        repository, extra_args=control, log_path=tmp_path_factory.mktemp("engine_logs") / "tritonserver.log"
    ) as server:
        yield server


def read_to_final(stream: GenerateStream, expected: int) -> dict[str, dict]:
    """Responses of `expected` requests on one stream by request id: outputs, finals, errors."""
    results: dict[str, dict] = {}
    finished = 0
    while finished < expected:
        request_id, outputs, final, error = stream.next()
        entry = results.setdefault(request_id or "?", {"outputs": [], "finals": 0, "errors": []})
        if error is not None:
            entry["errors"].append(error)
        if outputs is not None:
            entry["outputs"].append(outputs)
        entry["finals"] += final
        finished += final
    return results


def fill_the_tight_variant(server, stream: GenerateStream, running_tokens: int, waiting_tokens: int) -> None:
    """On `stream` (to generate_tight), "running" takes the only slot, then "waiting" the one
    waiting place. The first token of "running" says it holds the slot: sent at once, "waiting"
    could find "running" still in the waiting place and be refused (max_waiting 1)."""
    stream.send([5, 6, 7], running_tokens, request_id="running", stream=True, **dict(SAMPLED, seed=1))
    assert stream.next()[3] is None  # generating
    stream.send([5, 6, 7], waiting_tokens, request_id="waiting", **dict(SAMPLED, seed=2))
    wait_for_counter(
        server.metrics_url,
        "generate_num_requests_waiting",
        lambda v: v == 1,
        "the second request never queued",
        model=stream.model,
    )


def test_a_request_joining_a_running_batch_equals_it_run_alone(engine_server):
    long_stream, short_stream = GenerateStream(engine_server.grpc_url), GenerateStream(engine_server.grpc_url)
    try:
        long_stream.send([5, 6, 7], 480, request_id="long", stream=True, **dict(SAMPLED, seed=3))
        for _ in range(5):  # the long request is generating
            _, outputs, final, error = long_stream.next()
            assert error is None and not final
        short_stream.send([40, 41, 42, 43], 12, request_id="short", **dict(SAMPLED, seed=11))
        short = read_to_final(short_stream, 1)["short"]
        assert short["finals"] == 1 and not short["errors"]
        # It finished while the long one still runs: it joined the batch instead of waiting for it.
        assert counter(engine_server.metrics_url, "generate_num_requests_running") >= 1
        long_rest = read_to_final(long_stream, 1)["long"]
        assert long_rest["finals"] == 1 and not long_rest["errors"]
    finally:
        long_stream.close()
        short_stream.close()
    joined = collect(short["outputs"])
    alone = grpc_generate(engine_server.grpc_url, [40, 41, 42, 43], 12, **dict(SAMPLED, seed=11))
    np.testing.assert_array_equal(joined.output_ids, alone.output_ids)
    np.testing.assert_array_equal(joined.sampling_mask, alone.sampling_mask)
    # Batch-mates change the logits within float noise only: same tokens and masks, logprobs close.
    np.testing.assert_allclose(joined.sampling_mask_logprobs, alone.sampling_mask_logprobs, atol=1e-4)
    np.testing.assert_allclose(joined.output_logprobs, alone.output_logprobs, atol=1e-4)
    streamed_alone = grpc_generate(engine_server.grpc_url, [40, 41, 42, 43], 12, stream=True, **dict(SAMPLED, seed=11))
    np.testing.assert_array_equal(streamed_alone.output_ids, alone.output_ids)


def test_cancellation_frees_its_slot_while_others_continue(engine_server):
    cancelled_before = counter(engine_server.metrics_url, "generate_cancelled_total")
    doomed, other = GenerateStream(engine_server.grpc_url), GenerateStream(engine_server.grpc_url)
    try:
        doomed.send([5, 6, 7], 480, request_id="doomed", stream=True, **dict(SAMPLED, seed=1))
        other.send([8, 9], 120, request_id="other", stream=True, **dict(SAMPLED, seed=2))
        for _ in range(3):
            assert doomed.next()[3] is None
        doomed.close(cancel=True)
        wait_for_counter(
            engine_server.metrics_url,
            "generate_cancelled_total",
            lambda v: v != cancelled_before,
            "the server never saw the cancellation",
            timeout_s=60,
        )
        survivor = read_to_final(other, 1)["other"]
    finally:
        other.close()
    assert survivor["finals"] == 1 and not survivor["errors"]
    alone = grpc_generate(engine_server.grpc_url, [8, 9], 120, **dict(SAMPLED, seed=2))
    np.testing.assert_array_equal(collect(survivor["outputs"]).output_ids, alone.output_ids)
    # The slot is free: the tight variant (one slot) shows it best, below; here the batch empties.
    wait_for_counter(
        engine_server.metrics_url,
        "generate_num_requests_running",
        lambda v: v == 0,
        "a cancelled or finished sequence kept its slot",
    )
    assert counter(engine_server.metrics_url, "generate_kv_tokens") == 0


def test_beyond_the_bounds_requests_are_refused_unavailable_and_each_ends_once(engine_server):
    model = "generate_tight"  # one active sequence, one waiting request
    stream = GenerateStream(engine_server.grpc_url, model)
    try:
        fill_the_tight_variant(engine_server, stream, running_tokens=480, waiting_tokens=4)
        stream.send([5, 6, 7], 4, request_id="refused", **dict(SAMPLED, seed=3))
        with pytest.raises(InferenceServerException) as refused:
            grpc_generate(engine_server.grpc_url, [5], 4, model=model)
        assert "max_waiting" in refused.value.message()
        status, body = http_generate(engine_server.http_url, [5], 4, 128, model=model)
        assert status == 503 and "max_waiting" in body["error"]
        # The refused request ends at once; the waiting one gets the slot only after a cancel.
        first = read_to_final(stream, 1)
        refused_entry = first.get("?") or first.get("refused")
        assert refused_entry is not None and refused_entry["errors"] and refused_entry["finals"] == 1
    finally:
        stream.close(cancel=True)
    # A fresh request is served once the cancelled ones have left (waiting one cancelled too).
    wait_until_no_request_runs(engine_server, model)
    assert len(grpc_generate(engine_server.grpc_url, [5], 3, model=model, ignore_eos=True).output_ids) == 3


def test_exactly_one_final_per_request_in_a_mixed_stream(engine_server):
    requests = {
        "stream": ([5, 6], 9, dict(SAMPLED, seed=1, stream=True)),
        "whole": ([7, 8, 9, 10, 11, 12], 7, dict(SAMPLED, seed=2)),
        "zero": ([5], 0, dict(SAMPLED, seed=3)),
        "bad": ([5, 2000], 4, {}),
        "greedy": ([9], 5, dict(temperature=0.0, ignore_eos=True)),
    }
    ttft_before = counter(engine_server.metrics_url, "generate_time_to_first_token_seconds_count")
    with GenerateStream(engine_server.grpc_url) as stream:
        for name, (prompt, budget, params) in requests.items():
            stream.send(prompt, budget, request_id=name, **params)
        results = read_to_final(stream, len(requests))
        time.sleep(0.2)  # nothing more may arrive on the stream after every final
        assert stream.responses.empty()
    errors = {name: entry["errors"] for name, entry in results.items() if entry["errors"]}
    assert len(errors) == 1 and "input_ids" in next(iter(errors.values()))[0].message()
    assert sum(entry["finals"] for entry in results.values()) == len(requests)
    for name in ("stream", "whole", "zero", "greedy"):
        assert results[name]["finals"] == 1
    assert len(collect(results["stream"]["outputs"]).output_ids) == 9
    # Streamed: a response per token, or one for every token made while the previous was sent.
    assert all(len(outputs["output_ids"]) >= 1 for outputs in results["stream"]["outputs"])
    assert len(results["whole"]["outputs"]) == 1 and len(results["whole"]["outputs"][0]["output_ids"]) == 7
    assert counter(engine_server.metrics_url, "generate_time_to_first_token_seconds_count") == ttft_before + 3


def test_many_short_prompts_wait_for_the_one_slot_and_all_complete(engine_server):
    # 40 one-token prompts hold 40 of the 64 waiting prompt tokens: none is refused.
    with GenerateStream(engine_server.grpc_url, QUEUE) as stream:
        for i in range(40):
            stream.send([10 + i], 3, request_id=f"r{i}", **dict(SAMPLED, seed=i))
        results = read_to_final(stream, 40)
    assert sorted(results) == sorted(f"r{i}" for i in range(40))
    assert all(entry["finals"] == 1 and not entry["errors"] for entry in results.values())
    for i in (0, 39):  # first and last in the queue, each as it would run alone
        alone = grpc_generate(engine_server.grpc_url, [10 + i], 3, model=QUEUE, **dict(SAMPLED, seed=i))
        np.testing.assert_array_equal(collect(results[f"r{i}"]["outputs"]).output_ids, alone.output_ids)


def test_huge_prompts_beyond_the_waiting_token_budget_are_refused_naming_it(engine_server):
    # Larger than the whole KV budget: never admissible, so a 400 (no retry would help).
    with pytest.raises(InferenceServerException) as never:
        grpc_generate(engine_server.grpc_url, [5] * 10, 300, model=QUEUE)
    assert "kv_budget_tokens" in never.value.message() and "retry with backoff" not in never.value.message()
    status, body = http_generate(engine_server.http_url, [5] * 10, 300, 128, model=QUEUE)
    assert status == 400 and "kv_budget_tokens" in body["error"]
    stream = GenerateStream(engine_server.grpc_url, QUEUE)
    try:
        stream.send([5, 6, 7], 240, request_id="running", stream=True, **dict(SAMPLED, seed=1))
        assert stream.next()[3] is None  # it holds the slot (and 243 of the 256 KV positions)
        stream.send([9] * 40, 4, request_id="waiting", **dict(SAMPLED, seed=2))  # 40 of 64 tokens
        wait_for_counter(
            engine_server.metrics_url, "generate_num_requests_waiting", lambda v: v == 1, "it never queued", model=QUEUE
        )
        with pytest.raises(InferenceServerException) as refused:  # 40 + 40 > 64
            grpc_generate(engine_server.grpc_url, [9] * 40, 4, model=QUEUE)
        assert "max_waiting_tokens 64" in refused.value.message() and "retry with backoff" in refused.value.message()
        status, body = http_generate(engine_server.http_url, [9] * 40, 4, 128, model=QUEUE)
        assert status == 503 and "max_waiting_tokens" in body["error"]
        stream.send([9] * 24, 4, request_id="fits", **dict(SAMPLED, seed=3))  # 40 + 24 = 64: waits
        wait_for_counter(
            engine_server.metrics_url, "generate_num_requests_waiting", lambda v: v == 2, "it never queued", model=QUEUE
        )
    finally:
        stream.close(cancel=True)
    wait_until_no_request_runs(engine_server, QUEUE)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_client_retries_busy_refusals_until_every_request_completes(protocol, engine_server):
    model = "generate_tight"  # one slot, one waiting place: most of 8 requests sent at once are refused
    url = engine_server.grpc_url if protocol == "grpc" else engine_server.http_url
    params = [SamplingParams(temperature=0.7, top_k=10, seed=i, return_sampling_mask=True) for i in range(8)]
    with GenerateClient(url, protocol, model, backoff_s=0.01, max_backoff_s=0.2) as client:
        results = client.generate([[5, 6, 7]] * 8, params, 6, ignore_eos=True)
        refusals = client.busy_refusals
        alone = [client.generate([[5, 6, 7]], [p], 6, ignore_eos=True)[0] for p in params]
    assert refusals > 0, "no request was refused: the test did not exercise the retries"
    for result, expected in zip(results, alone):
        assert result.finish_reason == "length"
        np.testing.assert_array_equal(result.output_ids, expected.output_ids)
        np.testing.assert_array_equal(result.sampling_mask, expected.sampling_mask)


def test_unloading_ends_every_in_flight_request_with_one_final(engine_server):
    import tritonclient.http as httpclient

    model = "generate_tight"
    stream = GenerateStream(engine_server.grpc_url, model)
    admin = httpclient.InferenceServerClient(engine_server.http_url)
    try:
        fill_the_tight_variant(engine_server, stream, running_tokens=200, waiting_tokens=200)
        admin.unload_model(model)
        results = read_to_final(stream, 2)
        time.sleep(0.2)
        assert stream.responses.empty(), "a response after a request's final"
    finally:
        stream.close()
        admin.close()
    # Each ended once. Triton 2.51 lets in-flight requests finish before it calls finalize, so
    # here both complete; finalize's UNAVAILABLE final for leftovers is tested in-process.
    assert sum(entry["finals"] for entry in results.values()) == 2
    for entry in results.values():
        for error in entry["errors"]:
            assert "unloaded" in error.message(), error.message()
    deadline = time.monotonic() + 60  # the unload completes in the background
    while "generate finalized" not in engine_server.log_tail(200_000):
        assert time.monotonic() < deadline, "the model never finalized"
        time.sleep(0.1)
