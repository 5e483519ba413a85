"""Every documented client call, through the front door as users reach it.

The session's server is tritonserver behind HAProxy and the stream gate (conftest.py). Each
documented way of calling the two models — the typed clients sync and async over HTTP and gRPC,
in-band and through system shared memory, streamed and not, one request and many, and the raw
tritonclient / JSON calls the README and docs/generate.md show — must give the same seeded
answer, which the sampler's is checked against the float64 reference. A path the front door
broke (a check that misreads a shared-memory tensor, a shed request the client gives up on, an
answer a strict JSON parser refuses) fails here.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.fronted import FrontedTritonServer
from tests.reference import reference_row
from triton_sampling_mask.client import AsyncGenerateClient, AsyncSamplerClient, GenerateClient, SamplerClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops.proxy import find_haproxy
from triton_sampling_mask.sampling.outputs import WIRE_NEG_INF

VOCAB = 257
SAMPLER_ROWS = [
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, seed=31, return_sampling_mask=True),
    SamplingParams(temperature=1.2, top_k=40, min_p=0.02, seed=32, return_sampling_mask=True),
    SamplingParams(temperature=0.7, top_p=0.8, seed=33),
]
# top_k alone: a batch's rows may share an LM step or not, which may move logits by an ulp, enough
# to move a top_p boundary; a top-k support moves only on a near-tie.
GENERATE_RULES = dict(temperature=0.9, top_k=8)
PROMPTS = [[5, 9, 17, 3], [2, 4]]
NEW_TOKENS = 5


def strict_json(text: str):
    """JSON as any language's parser reads it: NaN and Infinity are not JSON (RFC 8259)."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module", autouse=True)
def fronted(triton_server):
    if find_haproxy() is None or not isinstance(triton_server, FrontedTritonServer):
        pytest.skip("no front door here (haproxy missing, or an external server): these paths are its own")


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(8).standard_normal((len(SAMPLER_ROWS), VOCAB)) * 2.5).astype(np.float32)


def _url(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


def _sampler_draws(result) -> tuple:
    return result.output_ids.tolist(), result.sampling_mask.tolist(), result.sampling_logprobs.tolist()


@pytest.fixture(scope="module")
def sampler_expected(logits):
    """The float64 reference's supports; the draws every path must share are taken from the first."""
    return [
        reference_row(logits[row], params.temperature, params.top_k, params.top_p, params.min_p).support
        for row, params in enumerate(SAMPLER_ROWS)
    ]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_sampler_call_gives_the_same_seeded_answer(triton_server, logits, sampler_expected, protocol):
    url = _url(triton_server, protocol)
    answers = {}
    with SamplerClient(url, protocol=protocol) as client:
        for shm in (False, True):
            whole = client.sample(logits, SAMPLER_ROWS, use_shared_memory=shm)
            answers[("sync", shm, "batch")] = _sampler_draws(whole)
            one = client.sample(logits[:1], SAMPLER_ROWS[:1], use_shared_memory=shm)
            assert _sampler_draws(one) == tuple(values[:1] for values in _sampler_draws(whole))
            for row, support in enumerate(sampler_expected):
                if SAMPLER_ROWS[row].return_sampling_mask:
                    np.testing.assert_array_equal(whole.masks()[row], support)
            assert np.isneginf(whole.sampling_mask_logprobs[2]).all()  # the client restores -inf padding

    async def run_async(shm: bool):
        async with AsyncSamplerClient(url, protocol=protocol) as client:
            return _sampler_draws(await client.sample(logits, SAMPLER_ROWS, use_shared_memory=shm))

    for shm in (False, True):
        answers[("async", shm, "batch")] = asyncio.run(run_async(shm))
    first = next(iter(answers.values()))
    assert all(answer == first for answer in answers.values()), answers.keys()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_readme_tritonclient_call(triton_server, logits, protocol):
    """The README's hand-built call: tensors by name, results read with as_numpy."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(_url(triton_server, protocol))
    try:
        params = SAMPLER_ROWS[0]
        result = client.infer(
            "sampler",
            sampler_inputs(
                module,
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=params.seed,
                return_sampling_mask=True,
            ),
        )
        lengths = result.as_numpy("sampling_mask_len")[:, 0]
        support = result.as_numpy("sampling_mask_logprobs")
        assert np.isfinite(support).all(), "the wire carries no -inf"
        assert (support[0, lengths[0] :] == np.float32(WIRE_NEG_INF)).all()
    finally:
        client.close()


def test_raw_json_answers_are_strict_json(triton_server, logits):
    """A client that parses with a strict parser (JavaScript, Go, Rust, Java) reads every answer."""
    body = {
        "inputs": [
            {"name": "logits", "shape": [1, VOCAB], "datatype": "FP32", "data": logits[0].tolist()},
            {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [4]},
            {"name": "return_sampling_mask", "shape": [1, 1], "datatype": "BOOL", "data": [True]},
        ]
    }
    request = urllib.request.Request(
        f"http://{triton_server.http_url}/v2/models/sampler/infer", json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request) as response:
        answer = strict_json(response.read().decode())
    outputs = {output["name"]: output["data"] for output in answer["outputs"]}
    assert outputs["sampling_mask_len"] == [4] and len(outputs["sampling_mask_logprobs"]) > 4
    for path, extra in (("generate", {}), ("generate_stream", {"stream": True})):
        body = {"input_ids": PROMPTS[0], "max_new_tokens": 3, "top_k": 4, "return_sampling_mask": True, **extra}
        request = urllib.request.Request(
            f"http://{triton_server.http_url}/v2/models/generate/{path}", json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request) as response:
            text = response.read().decode()
        events = [strict_json(line[len("data:") :]) for line in text.splitlines() if line.startswith("data:")]
        replies = events or [strict_json(text)]
        assert sum(np.size(reply["output_ids"]) for reply in replies) == 3, path


def _generate_draws(results) -> list:
    return [(r.output_ids.tolist(), r.sampling_mask.tolist(), r.finish_reason) for r in results]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_generate_call_gives_the_same_seeded_answer(triton_server, protocol):
    url = _url(triton_server, protocol)
    params = [SamplingParams(**GENERATE_RULES, seed=70 + i, return_sampling_mask=True) for i in range(len(PROMPTS))]
    answers = {}
    with GenerateClient(url, protocol=protocol) as client:
        answers["sync batch"] = _generate_draws(client.generate(PROMPTS, params, NEW_TOKENS, ignore_eos=True))
        # One prompt alone: another batch, whose float32 LM logits may differ by an ulp from the
        # batch's (a seeded draw follows its logits), so it is checked for shape only.
        single = client.generate(PROMPTS[:1], params[:1], NEW_TOKENS, ignore_eos=True)
        assert single[0].output_ids.shape == (NEW_TOKENS,) and single[0].finish_reason == "length"
        answers["sync submit"] = _generate_draws(
            client.submit(PROMPTS, params, NEW_TOKENS, ignore_eos=True).result(timeout=120)
        )
        with client.stream(PROMPTS, params, NEW_TOKENS, ignore_eos=True) as stream:
            chunks = list(stream)
        streamed = []
        for index in range(len(PROMPTS)):
            mine = [chunk for chunk in chunks if chunk.index == index]
            streamed.append(
                (
                    [int(token) for chunk in mine for token in chunk.output_ids],
                    [row.tolist() for chunk in mine for row in chunk.sampling_mask],
                    mine[-1].finish_reason,
                )
            )
        answers["sync stream"] = streamed

    async def run_async():
        async with AsyncGenerateClient(url, protocol=protocol) as client:
            return _generate_draws(await client.generate(PROMPTS, params, NEW_TOKENS, ignore_eos=True))

    answers["async batch"] = asyncio.run(run_async())
    first = answers["sync batch"]
    assert all(len(ids) == NEW_TOKENS for ids, _, _ in first)
    for name, answer in answers.items():
        for index, ((ids, masks, finish), (want_ids, want_masks, want_finish)) in enumerate(zip(answer, first)):
            assert (ids, finish) == (want_ids, want_finish), (name, index, ids, want_ids)
            for step, (mask, want) in enumerate(zip(masks, want_masks)):
                assert mask == want, (name, index, step, [m for m in mask if m >= 0], [m for m in want if m >= 0])
