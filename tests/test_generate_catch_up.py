"""A streamed request's responses when the response thread falls behind: each send is a round trip
to tritonserver, so the tokens a request gets while its previous response is still waiting go out
together in one response (the backlog is one response per request, not one per token). The
client must read the very tokens, values and timings the engine produced, in order, and a stream
that keeps up still gets one response per token."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from triton_sampling_mask.client.generate_client import _Job
from triton_sampling_mask.generation.request import GenerationChunk
from triton_sampling_mask.sampling.outputs import (
    GENERATION_TOKEN_OUTPUT_NAMES,
    MODEL_OUTPUTS,
    SAMPLING_SEED,
    TIMING_OUTPUTS,
    WEIGHT_VERSION,
)
from triton_sampling_mask.serving.generate_model import _Outbox, _RequestHandle

from .test_generate_shared_outputs import Metrics, PbUtils, Request, as_transport, streamed_chunks


class Logger:
    def log_error(self, message):
        raise AssertionError(message)


class FlaggedRequest(Request):
    """Request whose sender also records each response's flags."""

    def __init__(self):
        super().__init__()
        self.flags = []

    def send(self, response=None, flags=0):
        super().send(response, flags)
        self.flags.append(flags)


def handle_on(outbox: _Outbox) -> tuple[_RequestHandle, FlaggedRequest]:
    model = SimpleNamespace(
        pb_utils=PbUtils, declared_outputs={spec.name for spec in MODEL_OUTPUTS["generate"]}, metrics=Metrics()
    )
    triton_request = FlaggedRequest()
    return _RequestHandle(model, triton_request, outbox), triton_request


def _rows(values) -> list:
    return [row.tolist() if isinstance(row, np.ndarray | np.generic) else row for row in values]


def client_tokens(responses: list[dict]) -> dict[str, list]:
    """Every token's outputs as GenerateClient restores them from `responses`, in order."""
    job = _Job(0, {}, stream=True, seeded=True, outputs=None)
    results = [job.accept(as_transport(r)) for r in responses]
    return {
        name: [row for result in results for row in _rows(getattr(result, name))]
        for name in ("output_ids", "output_logprobs", "sampling_mask", "sampling_seed", "weight_version")
    }


def engine_tokens(chunks: list[GenerationChunk]) -> dict[str, list]:
    """The same, straight from the engine's chunks (the reference)."""
    tokens = {
        name: [row for chunk in chunks for row in _rows(chunk[name])]
        for name in ("output_ids", "output_logprobs", "sampling_mask", SAMPLING_SEED.name)
    }
    tokens[WEIGHT_VERSION.name] = [v.decode() for chunk in chunks for v in chunk[WEIGHT_VERSION.name]]
    return tokens


def test_tokens_queued_behind_a_slow_send_go_out_in_one_response_read_as_the_engine_made_them():
    chunks = streamed_chunks(7, update_at=5)
    outbox = _Outbox(Logger())
    try:
        gate = threading.Event()
        outbox.put(gate.wait)  # the outbox busy with another request's send
        handle, triton_request = handle_on(outbox)
        handle.send(chunks[0], False)
        handle.send(chunks[1], False)
        handle.send(chunks[2], False)
        gate.set()
        outbox.put(lambda: None)
        _drain(outbox)
        for chunk in chunks[3:6]:  # one at a time: the outbox keeps up
            handle.send(chunk, False)
            _drain(outbox)
        gate.clear()
        outbox.put(gate.wait)
        handle.send(chunks[6], True)
        gate.set()
        _drain(outbox)
    finally:
        outbox.stop()
    responses = triton_request.responses
    assert [r["output_ids"].shape[1] for r in responses] == [3, 1, 1, 1, 1]
    assert triton_request.flags == [0, 0, 0, 0, PbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert client_tokens(responses) == engine_tokens(chunks)
    timing = {spec.name for spec in TIMING_OUTPUTS}
    assert [sorted(timing & set(r)) for r in responses] == [[]] * 4 + [sorted(timing)]
    for name in timing:
        np.testing.assert_array_equal(responses[-1][name][0], chunks[-1][name])


def test_a_request_that_ends_while_its_tokens_wait_sends_them_and_its_end_in_one_final_response():
    chunks = streamed_chunks(4, update_at=4)
    outbox = _Outbox(Logger())
    try:
        gate = threading.Event()
        outbox.put(gate.wait)
        handle, triton_request = handle_on(outbox)
        for i, chunk in enumerate(chunks):
            handle.send(chunk, i == len(chunks) - 1)
        assert handle.done
        gate.set()
        _drain(outbox)
    finally:
        outbox.stop()
    [response] = triton_request.responses
    assert triton_request.flags == [PbUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert response["finish_reason"].tolist() == [[b"length"]]
    for name in GENERATION_TOKEN_OUTPUT_NAMES:
        if name in (SAMPLING_SEED.name, WEIGHT_VERSION.name):
            continue  # sent once for the request (its tokens share it)
        np.testing.assert_array_equal(response[name][0], np.concatenate([c[name] for c in chunks]), err_msg=name)
    assert client_tokens([response]) == engine_tokens(chunks)


def test_joined_chunks_hold_each_chunks_tokens_in_order_and_the_last_ones_request_outputs():
    chunks = streamed_chunks(5, update_at=2)
    joined = GenerationChunk.joined(chunks)
    assert joined.finish_reason == chunks[-1].finish_reason == "length"
    for name in GENERATION_TOKEN_OUTPUT_NAMES:
        expected = [row for c in chunks for row in _rows(c[name])]
        assert _rows(joined[name]) == expected, name
    for spec in TIMING_OUTPUTS:
        assert joined[spec.name] is chunks[-1][spec.name]
    assert GenerationChunk.joined(chunks[:1]) is chunks[0]


def _drain(outbox: _Outbox) -> None:
    """Wait until the outbox has run everything queued so far."""
    done = threading.Event()
    outbox.put(done.set)
    assert done.wait(10)
