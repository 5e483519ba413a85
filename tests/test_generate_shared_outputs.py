"""The generate model's shared outputs (`sampling_seed`, `weight_version`): values a request's
tokens share, so a response carries one value per token, one value for all of its tokens, or
none when its tokens have the value its request's previous response ended with; the client
restores one per token. Checked against the per-token values the engine produced: the server's
responses (which tensors each one carries) and the client's results built from them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from triton_sampling_mask.client.generate_client import _Job
from triton_sampling_mask.client.generate_transport import _NOT_SENT
from triton_sampling_mask.generation.request import GenerationChunk
from triton_sampling_mask.sampling.outputs import (
    FINISH_REASON,
    GENERATION_TOKEN_OUTPUT_NAMES,
    MODEL_OUTPUTS,
    SAMPLING_SEED,
    TIMING_OUTPUTS,
    WEIGHT_VERSION,
    compact_shared,
    expand_shared,
)
from triton_sampling_mask.serving.generate_model import _RequestHandle

from .test_generate_response_path import _NullObserver, run_engine
from .test_generation import request

SHARED = (SAMPLING_SEED.name, WEIGHT_VERSION.name)


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.array(array)


class PbUtils:
    Tensor = Tensor
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error


class Request:
    """A Triton request as the stub hands it over: its sender records each response's tensors."""

    def __init__(self, requested=()):
        self.requested, self.responses = list(requested), []

    def get_response_sender(self):
        return self

    def send(self, response=None, flags=0):
        self.responses.append({t.name: t.array for t in response.output_tensors})

    def requested_output_names(self):  # Triton names every declared output when the client names none
        return self.requested or [spec.name for spec in MODEL_OUTPUTS["generate"]]


class Metrics:
    def ended(self, kind, outcome):
        pass


def sent(chunks, finals, requested=()) -> list[dict]:
    """The responses the model's request handle sends for `chunks` (no outbox thread)."""
    model = SimpleNamespace(
        pb_utils=PbUtils,
        declared_outputs={spec.name for spec in MODEL_OUTPUTS["generate"]},
        metrics=Metrics(),
    )
    triton_request = Request(requested)
    handle = _RequestHandle(model, triton_request, outbox=None)
    for chunk, final in zip(chunks, finals):
        handle._send_now(chunk, final)
    return triton_request.responses


def as_transport(response: dict) -> dict:
    """A response as the client's transports hand it over (batch dimension dropped, text as str)."""
    outputs = _NOT_SENT.copy()
    for name, array in response.items():
        if name == WEIGHT_VERSION.name:
            outputs[name] = np.array([v.decode() for v in array[0]], dtype=object)
        elif name == FINISH_REASON.name:
            outputs[name] = array.reshape(-1)[0].decode()
        elif name in {spec.name for spec in TIMING_OUTPUTS}:
            outputs[name] = float(array.reshape(-1)[0])
        else:
            outputs[name] = array[0]
    return outputs


def streamed_chunks(budget: int, update_at: int):
    """A streamed request's chunks from the engine, the weights 'updated' to v2 from token `update_at`."""
    [handle] = run_engine(_NullObserver(), [request([1, 2, 5], budget, stream=True, seed=7, ignore_eos=True)])
    for i, chunk in enumerate(handle.chunks):
        if i >= update_at:
            chunk.outputs[WEIGHT_VERSION.name] = np.array([b"v2"], dtype=object)
    return handle.chunks


def test_a_stream_carries_its_seed_and_version_once_and_again_when_the_version_changes():
    chunks = streamed_chunks(6, update_at=4)
    responses = sent(chunks, [False] * 5 + [True])
    carrying = [[name for name in SHARED if name in r] for r in responses]
    assert carrying == [list(SHARED), [], [], [], [WEIGHT_VERSION.name], []]
    assert responses[0][SAMPLING_SEED.name].tolist() == [[7]]
    assert responses[0][WEIGHT_VERSION.name].tolist() == [[b"default"]]
    assert responses[4][WEIGHT_VERSION.name].tolist() == [[b"v2"]]
    # After the first, a token's response carries the 6 token outputs and its finish reason, as
    # before the receipts and versions were added; the last one its timings too.
    for response in responses[1:4]:
        assert len(response) == 7
    assert set(responses[-1]) - set(responses[1]) == {spec.name for spec in TIMING_OUTPUTS}
    # Every other output is sent as the engine produced it.
    for chunk, response in zip(chunks, responses):
        for name in set(GENERATION_TOKEN_OUTPUT_NAMES) - set(SHARED):
            np.testing.assert_array_equal(response[name], chunk[name][np.newaxis], err_msg=name)


def test_the_client_restores_every_tokens_seed_and_version():
    chunks = streamed_chunks(6, update_at=4)
    job = _Job(0, {}, stream=True, seeded=True, outputs=None)
    results = [job.accept(as_transport(r)) for r in sent(chunks, [False] * 5 + [True])]
    for chunk, result in zip(chunks, results):
        assert result.sampling_seed.tolist() == chunk[SAMPLING_SEED.name].tolist() == [7]
        assert result.weight_version.tolist() == [v.decode() for v in chunk[WEIGHT_VERSION.name]]
    assert [r.weight_version[0] for r in results] == ["default"] * 4 + ["v2"] * 2
    assert all(r.weight_version.dtype == object and r.sampling_seed.dtype == np.uint64 for r in results)


def test_a_whole_response_carries_one_value_when_its_tokens_share_it():
    [handle] = run_engine(_NullObserver(), [request([1, 2, 5], 5, seed=3, ignore_eos=True)])
    [chunk] = handle.chunks
    [response] = sent([chunk], [True])
    assert response[SAMPLING_SEED.name].tolist() == [[3]]
    assert response[WEIGHT_VERSION.name].tolist() == [[b"default"]]
    assert response["output_ids"].shape == (1, 5)
    result = _whole_result(response)
    assert result.sampling_seed.tolist() == [3] * 5 and result.weight_version.tolist() == ["default"] * 5
    # An update mid-request: every token's version is sent.
    versions = np.array([b"default"] * 2 + [b"v2"] * 3, dtype=object)
    [response] = sent([GenerationChunk({**chunk.outputs, WEIGHT_VERSION.name: versions}, "length")], [True])
    assert response[WEIGHT_VERSION.name].tolist() == [versions.tolist()]
    assert _whole_result(response).weight_version.tolist() == ["default"] * 2 + ["v2"] * 3


def _whole_result(response: dict):
    job = _Job(0, {}, stream=False, seeded=True, outputs=None)
    job.accept(as_transport(response))
    return job.result()


def test_a_request_naming_its_outputs_gets_those_only():
    chunks = streamed_chunks(3, update_at=3)
    for response in sent(chunks, [False, False, True], requested=["output_ids"]):
        assert list(response) == ["output_ids"]
    responses = sent(chunks, [False, False, True], requested=["output_ids", WEIGHT_VERSION.name])
    assert [sorted(r) for r in responses] == [
        sorted(["output_ids", WEIGHT_VERSION.name]),
        ["output_ids"],
        ["output_ids"],
    ]


@given(
    values=st.lists(st.sampled_from([b"a", b"b", b"c"]), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_compact_then_expand_gives_back_every_tokens_value(values, cuts):
    # A request's tokens split into responses anywhere (empty ones included), each sent compactly
    # against what the previous ones left the client with, then restored per token.
    bounds = [0, *sorted(min(c, len(values)) for c in cuts), len(values)]
    server_held = client_held = None
    restored = []
    for start, end in zip(bounds, bounds[1:]):
        part = np.array(values[start:end], dtype=object)
        sent_value, server_held = compact_shared(part, server_held)
        assert sent_value is None or len(sent_value) in (1, len(part))
        tokens, client_held = expand_shared(sent_value, len(part), client_held)
        assert len(tokens) == len(part)
        restored.extend(tokens.tolist())
    assert restored == values
