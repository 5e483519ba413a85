"""The package's generate client against the session's real server: results checked against a
float64 replay of the LM, streaming, validation before sending, errors, a 2,000-request
submission, cancellation, asyncio, a dead replica, and the converters fed straight from results.

(Busy refusals from a server at its bounds are in test_generate_engine.py, whose server has a
variant tight enough to refuse.)
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from testbed.metrics import counter, wait_for_counter
from tests.lm_reference import step_logits
from triton_sampling_mask.client import (
    AsyncGenerateClient,
    GenerateClient,
    GenerateError,
    GenerateResult,
    concatenate_tokens,
)
from triton_sampling_mask.client.converters import from_prime_rl, to_dense, to_prime_rl, to_sglang, to_vllm_csr
from triton_sampling_mask.client.replay import replay_logprobs
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.server_process import free_port
from triton_sampling_mask.sampling.validation import UNBOUNDED_MASK_MESSAGE, SamplingRequestError

from .generate_client import assert_matches_reference, grpc_generate

RULES = dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.03)
SAMPLED = SamplingParams(**RULES, seed=11, return_sampling_mask=True)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [9]]
WIDTH = 128  # the shipped generate config's W (read from the server by the client itself)


def url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


@pytest.fixture(scope="module")
def client(triton_server):
    with GenerateClient(triton_server.grpc_url) as client:
        yield client


def seeded(count: int, first_seed: int = 100) -> list[SamplingParams]:
    return [SamplingParams(**RULES, seed=first_seed + i, return_sampling_mask=True) for i in range(count)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_each_result_matches_the_float64_reference(protocol, triton_server):
    params = seeded(len(PROMPTS))
    with GenerateClient(url(triton_server, protocol), protocol=protocol) as client:
        results = client.generate(PROMPTS, params, max_new_tokens=[8, 5, 0], ignore_eos=True)
    assert [r.index for r in results] == [0, 1, 2]
    for prompt, result, budget in zip(PROMPTS, results, [8, 5, 0]):
        assert isinstance(result, GenerateResult) and result.finish_reason == "length"
        assert result.output_ids.shape == (budget,) and result.sampling_mask.shape == (budget, WIDTH)
        assert result.sampling_mask_logprobs.shape == (budget, WIDTH)
        assert_matches_reference(result, step_logits(prompt, result.output_ids), **RULES)
    # The same seeded request through the hand-built tritonclient stream: the same tokens.
    raw = grpc_generate(
        triton_server.grpc_url, PROMPTS[0], 8, ignore_eos=True, **RULES, seed=100, return_sampling_mask=True
    )
    np.testing.assert_array_equal(results[0].output_ids, raw.output_ids)
    np.testing.assert_array_equal(results[0].sampling_mask, raw.sampling_mask)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_chunks_concatenate_to_the_whole_result(protocol, triton_server):
    params = seeded(2)
    with GenerateClient(url(triton_server, protocol), protocol=protocol) as client:
        whole = client.generate(PROMPTS[:2], params, 6, ignore_eos=True)
        with client.stream(PROMPTS[:2], params, 6, ignore_eos=True) as stream:
            chunks = list(stream)
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        # a token per chunk while the response thread keeps up; tokens that came while it was
        # sending go in one chunk: every chunk holds at least one, and only the last ends it
        assert all(len(c.output_ids) >= 1 for c in mine) and sum(len(c.output_ids) for c in mine) == 6
        assert [c.finish_reason for c in mine] == [""] * (len(mine) - 1) + ["length"]
        joined = concatenate_tokens(mine)
        for name in ("output_ids", "sampling_mask", "sampling_mask_len", "sampling_logprobs"):
            np.testing.assert_array_equal(getattr(joined, name), getattr(whole[index], name), err_msg=name)


def test_parameters_are_checked_before_anything_is_sent(client):
    with pytest.raises(SamplingRequestError) as over_width:  # W comes from the served config
        client.generate([[5]], SamplingParams(top_k=200, return_sampling_mask=True), 4)
    assert over_width.value.field == "top_k" and "128" in over_width.value.message
    with pytest.raises(SamplingRequestError) as unbounded:  # the server's own rule and message
        SamplingParams(temperature=1.0, top_p=0.9, return_sampling_mask=True)
    assert unbounded.value.message == UNBOUNDED_MASK_MESSAGE
    # Nothing listens there: a call that sent anything would fail to connect instead.
    with GenerateClient(f"127.0.0.1:{free_port()}", mask_width=WIDTH) as offline:
        for prompts, params, budget, field in (
            ([[5]], SamplingParams(top_k=200, return_sampling_mask=True), 4, "top_k"),
            ([[]], SAMPLED, 4, "input_ids"),
            ([[5, -1]], SAMPLED, 4, "input_ids"),
            ([[[5]]], SAMPLED, 4, "input_ids"),
            (PROMPTS, [SAMPLED], 4, "params"),
            (PROMPTS, SAMPLED, [4, 4], "max_new_tokens"),
            (PROMPTS, SAMPLED, -1, "max_new_tokens"),
        ):
            with pytest.raises(SamplingRequestError) as error:
                offline.generate(prompts, params, budget)
            assert error.value.field == field
        with pytest.raises(GenerateError) as unreachable:
            offline.generate([[5]], SAMPLED, 4)
    assert unreachable.value.status == "StatusCode.UNAVAILABLE"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_refused_request_raises_with_its_index_or_takes_its_place(protocol, triton_server):
    prompts = [[5, 6], [5, 2000], [7]]  # 2000 is outside the vocabulary: only the server knows it
    with GenerateClient(url(triton_server, protocol), protocol=protocol) as client:
        with pytest.raises(GenerateError) as refused:
            client.generate(prompts, SAMPLED, 4)
        results = client.generate(prompts, SAMPLED, 4, ignore_eos=True, return_exceptions=True)
    assert refused.value.index == 1 and "input_ids" in refused.value.message and not refused.value.busy
    assert refused.value.status == ("400" if protocol == "http" else "in-band")
    assert isinstance(results[1], GenerateError) and results[1].index == 1
    assert [len(results[i].output_ids) for i in (0, 2)] == [4, 4]


def test_only_the_outputs_asked_for_are_received(client):
    (result,) = client.generate(
        [[5, 6, 7]], SAMPLED, 4, ignore_eos=True, outputs=["sampling_mask", "sampling_mask_len"]
    )
    assert result.sampling_mask.shape == (4, WIDTH) and result.output_ids.shape == (4,)
    assert result.sampling_mask_logprobs is None and result.sampling_logprobs is None
    with pytest.raises(ValueError, match="unknown outputs"):
        client.generate([[5]], SAMPLED, 4, outputs=["logits"])


def test_two_thousand_requests_at_once_all_complete_and_seeded_ones_equal_a_sequential_run(client, triton_server):
    # 100 distinct seeded requests, each 16 times, and 400 unseeded ones, submitted in one call.
    rng = np.random.default_rng(0)
    distinct = [(rng.integers(3, 1000, size=rng.integers(1, 6)).tolist(), 1000 + i) for i in range(100)]
    prompts, params = [], []
    for i in range(2000):
        if i % 5 == 4:
            prompts.append([7 + i % 50, 8])
            params.append(SamplingParams(temperature=0.8, top_k=10, return_sampling_mask=True))
        else:
            prompt, seed = distinct[i % 100]
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.8, top_k=10, seed=seed, return_sampling_mask=True))
    results = client.generate(prompts, params, 4, ignore_eos=True)
    assert [r.index for r in results] == list(range(2000))
    assert all(len(r.output_ids) == 4 and r.finish_reason == "length" for r in results)
    alone = {
        seed: client.generate(
            [prompt],
            SamplingParams(temperature=0.8, top_k=10, seed=seed, return_sampling_mask=True),
            4,
            ignore_eos=True,
        )[0]
        for prompt, seed in distinct
    }
    for result, p in zip(results, params):
        if p.seed is None:
            assert (result.sampling_mask_len == 10).all()
            continue
        expected = alone[p.seed]
        np.testing.assert_array_equal(result.output_ids, expected.output_ids)
        np.testing.assert_array_equal(result.sampling_mask, expected.sampling_mask)
        np.testing.assert_allclose(result.sampling_logprobs, expected.sampling_logprobs, atol=1e-4)


def test_closing_a_stream_cancels_its_requests_on_the_server(client, triton_server):
    metrics = triton_server.metrics_url
    cancelled_before = counter(metrics, "generate_cancelled_total")
    tokens_before = counter(metrics, "generate_tokens_total")
    stream = client.stream([[5, 6, 7], [8, 9]], seeded(2), 400, ignore_eos=True)
    first = [next(stream) for _ in range(4)]
    stream.close()
    assert {c.index for c in first} <= {0, 1}
    wait_for_counter(metrics, "generate_cancelled_total", lambda v: v >= cancelled_before + 2, "no cancellation", 60)
    assert counter(metrics, "generate_tokens_total") - tokens_before < 800
    assert len(client.generate([[5]], SAMPLED, 2, ignore_eos=True)[0].output_ids) == 2  # the client goes on


def test_cancelling_a_submitted_call_cancels_its_request_on_the_server(client, triton_server):
    metrics = triton_server.metrics_url
    cancelled_before = counter(metrics, "generate_cancelled_total")
    tokens_before = counter(metrics, "generate_tokens_total")
    future = client.submit([[5, 6, 7]], SAMPLED, 450, ignore_eos=True)
    wait_for_counter(metrics, "generate_tokens_total", lambda v: v >= tokens_before + 3, "it never started", 60)
    assert future.cancel() or future.cancelled()
    wait_for_counter(metrics, "generate_cancelled_total", lambda v: v >= cancelled_before + 1, "no cancellation", 60)


def test_the_async_client_generates_streams_and_cancels(triton_server):
    async def main():
        async with AsyncGenerateClient(triton_server.grpc_url) as client:
            results = await client.generate(PROMPTS, SAMPLED, 5, ignore_eos=True)
            chunks = []
            async with client.stream(PROMPTS, SAMPLED, 5, ignore_eos=True) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
            task = asyncio.ensure_future(client.generate([[5, 6, 7]], SAMPLED, 450, ignore_eos=True))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return results, chunks

    cancelled_before = counter(triton_server.metrics_url, "generate_cancelled_total")
    results, chunks = asyncio.run(main())
    for result in results:
        streamed = concatenate_tokens([c for c in chunks if c.index == result.index])
        np.testing.assert_array_equal(streamed.output_ids, result.output_ids)
    wait_for_counter(
        triton_server.metrics_url, "generate_cancelled_total", lambda v: v > cancelled_before, "no cancellation", 60
    )


def test_an_unreachable_replica_is_ejected_and_the_other_answers_everything(triton_server):
    dead = f"127.0.0.1:{free_port()}"
    params = seeded(8)
    with GenerateClient([dead, triton_server.grpc_url], eject_backoff_s=60, max_eject_backoff_s=60) as client:
        results = client.generate([[5, 6, 7]] * 8, params, 3, ignore_eos=True)
        shares, healthy = client.replica_shares(), client.healthy_replicas()
    assert shares == {dead: 0, triton_server.grpc_url: 8} and healthy == [triton_server.grpc_url]
    with GenerateClient(triton_server.grpc_url) as client:
        alone = client.generate([[5, 6, 7]] * 8, params, 3, ignore_eos=True)
    for result, expected in zip(results, alone):
        np.testing.assert_array_equal(result.output_ids, expected.output_ids)


def test_results_feed_the_converters_and_replay_without_reshaping(client):
    results = client.generate(PROMPTS, seeded(3), 6, ignore_eos=True)
    tokens = concatenate_tokens(results)
    lengths = [len(r.output_ids) for r in results]
    assert tokens.output_ids.shape == (sum(lengths),)
    csr = to_vllm_csr(tokens.sampling_mask, tokens.sampling_mask_len, tokens.sampling_mask_logprobs)
    assert csr["offsets"][-1] == tokens.sampling_mask_len.sum() == csr["token_ids"].size
    prime = to_prime_rl(tokens.sampling_mask, tokens.sampling_mask_len)
    rebuilt = from_prime_rl(prime["ids"], prime["counts"], WIDTH)
    np.testing.assert_array_equal(rebuilt.mask, tokens.sampling_mask)
    first = results[0]
    sglang = to_sglang(first.sampling_mask, first.sampling_mask_len, first.sampling_logprobs)
    assert sglang["output_token_sampling_mask"] == [m.tolist() for m in first.masks()]
    assert to_dense(tokens.sampling_mask, tokens.sampling_mask_len, 1024).sum() == tokens.sampling_mask_len.sum()
    # Replayed over the float64 logits of the same LM, each token's log-prob is the server's.
    import torch

    logits = torch.from_numpy(np.concatenate([step_logits(p, r.output_ids) for p, r in zip(PROMPTS, results)]))
    replayed = replay_logprobs(logits, rebuilt.mask, rebuilt.lengths, RULES["temperature"], tokens.output_ids)
    np.testing.assert_allclose(replayed.numpy(), tokens.sampling_logprobs, atol=1e-4)
