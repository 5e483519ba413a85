"""The typed client against the real server: results vs the float64 reference, every transport,
server errors as SamplerError, and bad parameters refused before any network call."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from testbed.server import MODEL_REPOSITORY
from tests.reference import reference_row
from triton_sampling_mask.client import AsyncSamplerClient, SamplerClient, SamplerError
from triton_sampling_mask.client.replay import replay_logprobs, replay_support_logprobs
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.model_config import output_width, read_config_file
from triton_sampling_mask.ops.server_process import free_port
from triton_sampling_mask.sampling.validation import (
    SPECULATIVE_MASK_MESSAGE,
    SamplingRequestError,
    backend_mask_message,
)

VOCAB = 300
ROWS = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, return_sampling_mask=True),
    SamplingParams(temperature=1.3, top_k=50, min_p=0.05, seed=12, return_sampling_mask=True),
    SamplingParams(temperature=0.0, seed=13, return_sampling_mask=True),  # greedy: bounded without top_k
    SamplingParams(temperature=1.0, top_k=5, seed=14, return_sampling_mask=True),
    SamplingParams(temperature=0.7, top_p=0.8, seed=15),  # no mask
]


@pytest.fixture(scope="module")
def logits():
    return (np.random.default_rng(5).standard_normal((len(ROWS), VOCAB)) * 3).astype(np.float32)


@pytest.fixture(params=["http", "grpc"])
def client(request, triton_server):
    url = triton_server.http_url if request.param == "http" else triton_server.grpc_url
    with SamplerClient(url, protocol=request.param) as client:
        yield client


def url_for(server, protocol: str) -> str:
    return server.http_url if protocol == "http" else server.grpc_url


def test_results_match_the_reference_and_replay(client, logits):
    result = client.sample(logits, ROWS)
    for row, params in enumerate(ROWS):
        ref = reference_row(logits[row], params.temperature, params.top_k, params.top_p, params.min_p)
        token = int(result.output_ids[row])
        if params.return_sampling_mask:
            np.testing.assert_array_equal(result.masks()[row], ref.support)
            assert token in ref.support
            want = ref.renormalised_logprob(token, len(ref.support))
            assert result.sampling_logprobs[row] == pytest.approx(want, abs=1e-5)
        else:
            assert result.sampling_mask_len[row] == 0 and (result.sampling_mask[row] == -1).all()
            assert token in ref.support
    asked = np.array([p.return_sampling_mask for p in ROWS])
    temperature = np.array([p.temperature for p in ROWS], np.float32)[asked]
    replayed = replay_logprobs(
        torch.from_numpy(logits[asked]),
        result.sampling_mask[asked],
        result.sampling_mask_len[asked],
        temperature,
        result.output_ids[asked],
    )
    np.testing.assert_allclose(replayed.numpy(), result.sampling_logprobs[asked], rtol=0, atol=1e-5)
    # The client carries the per-support log-probs; the trainer's replay reproduces them to 1e-5.
    support = replay_support_logprobs(
        torch.from_numpy(logits[asked]), result.sampling_mask[asked], result.sampling_mask_len[asked], temperature
    )
    np.testing.assert_allclose(support.numpy(), result.sampling_mask_logprobs[asked], rtol=0, atol=1e-5)
    assert np.isneginf(result.sampling_mask_logprobs[~asked]).all()


def test_mask_width_comes_from_the_server_config(client):
    config = read_config_file(MODEL_REPOSITORY / "sampler" / "config.pbtxt")
    width = output_width(config, "sampling_mask")
    assert client.mask_policy().mask_width == width
    result = client.sample(np.zeros((1, VOCAB), np.float32), SamplingParams(top_k=VOCAB, return_sampling_mask=True))
    assert result.sampling_mask.shape == (1, width)


def test_every_transport_gives_the_same_seeded_draws(triton_server, logits):
    expected = None
    for protocol in ("http", "grpc"):
        with SamplerClient(url_for(triton_server, protocol), protocol=protocol) as client:
            for shm in (False, True):
                result = client.sample(logits, ROWS, use_shared_memory=shm)
                draws = (result.output_ids.tolist(), result.sampling_mask.tolist())
                expected = expected or draws
                assert draws == expected, (protocol, shm)

    async def run_async(protocol, shm):
        async with AsyncSamplerClient(url_for(triton_server, protocol), protocol=protocol) as client:
            result = await client.sample(logits, ROWS, use_shared_memory=shm)
            return result.output_ids.tolist(), result.sampling_mask.tolist()

    for protocol, shm in (("http", False), ("grpc", True)):
        assert asyncio.run(run_async(protocol, shm)) == expected, (protocol, shm)


def test_calls_beyond_max_batch_size_are_split_in_order(triton_server, client):
    max_batch_size = read_config_file(MODEL_REPOSITORY / "sampler" / "config.pbtxt")["max_batch_size"]
    assert client.server_limits().max_batch_size == max_batch_size
    rows = max_batch_size + 3
    logits = np.random.default_rng(9).standard_normal((rows, 50)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_k=8, seed=i, return_sampling_mask=True) for i in range(rows)]
    whole = client.sample(logits, params)
    assert whole.output_ids.shape == (rows,) and whole.sampling_mask.shape[0] == rows
    url = url_for(triton_server, client.protocol)
    with SamplerClient(url, protocol=client.protocol, max_batch_size=7) as small:
        pieces = small.sample(logits, params, use_shared_memory=True)

    async def run_async():
        async with AsyncSamplerClient(url, protocol=client.protocol, max_batch_size=50) as aclient:
            return await aclient.sample(logits, params)

    for result in (pieces, asyncio.run(run_async())):
        np.testing.assert_array_equal(result.output_ids, whole.output_ids)
        np.testing.assert_array_equal(result.sampling_mask, whole.sampling_mask)
    # Each row is its own seeded draw: the first row alone gives the same token.
    assert client.sample(logits[:1], params[0]).output_ids[0] == whole.output_ids[0]


def test_unseeded_rows_beside_seeded_ones_keep_the_seeded_draws(client, logits):
    seeded = client.sample(logits[:1], ROWS[0])
    mixed = client.sample(logits[:2], [ROWS[0], SamplingParams(temperature=1.0, top_k=30)])
    assert mixed.output_ids[0] == seeded.output_ids[0]


def test_server_refusals_surface_as_sampler_error(triton_server, client, logits):
    nosupport = SamplerClient(
        url_for(triton_server, client.protocol), protocol=client.protocol, model_name="sampler_nosupport"
    )
    with nosupport, pytest.raises(SamplerError) as info:
        nosupport.sample(logits[:1], ROWS[0])
    assert info.value.is_invalid_argument
    assert info.value.status == ("400" if client.protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    assert info.value.message == backend_mask_message("nosupport")

    missing = SamplerClient(
        url_for(triton_server, client.protocol), protocol=client.protocol, model_name="no_such_model"
    )
    with missing, pytest.raises(SamplerError) as info:
        missing.sample(logits[:1], SamplingParams())
    assert not info.value.is_invalid_argument and "no_such_model" in info.value.message


def test_speculative_deployments_refuse_masks_client_side(triton_server, client, logits):
    speculative = SamplerClient(
        url_for(triton_server, client.protocol), protocol=client.protocol, model_name="sampler_speculative"
    )
    with speculative, pytest.raises(SamplingRequestError, match=SPECULATIVE_MASK_MESSAGE):
        speculative.sample(logits[:1], ROWS[0])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    "logits, params, field",
    [
        (np.zeros((1, 600), np.float32), SamplingParams(top_k=600, return_sampling_mask=True), "top_k"),  # over W=8
        (np.array([[0.0, np.nan]], np.float32), SamplingParams(), "logits"),
        (np.array([[0.0, np.inf]], np.float32), SamplingParams(), "logits"),
        (np.full((1, 3), -np.inf, np.float32), SamplingParams(), "logits"),
        (np.zeros((1, 0), np.float32), SamplingParams(), "logits"),
        (np.zeros(4, np.float32), SamplingParams(), "logits"),
        (np.zeros((2, 4), np.float32), [SamplingParams()], "params"),
    ],
)
def test_bad_requests_raise_before_any_network_call(protocol, logits, params, field):
    # Nothing listens on this port: any network call would fail with a SamplerError instead.
    with SamplerClient(f"127.0.0.1:{free_port()}", protocol=protocol, mask_width=8) as client:
        with pytest.raises(SamplingRequestError) as info:
            client.sample(logits, params)
    assert info.value.field == field


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_unreachable_server_raises_sampler_error(protocol):
    with SamplerClient(f"127.0.0.1:{free_port()}", protocol=protocol) as client:
        with pytest.raises(SamplerError) as info:
            client.sample(np.zeros((1, 4), np.float32))
    assert not info.value.is_invalid_argument

    async def run():
        async with AsyncSamplerClient(f"127.0.0.1:{free_port()}", protocol=protocol) as client:
            await client.sample(np.zeros((1, 4), np.float32))

    with pytest.raises(SamplerError):
        asyncio.run(run())


# --- several replicas behind one client (client.replicas) ---------------------------------------


def test_replica_failures_are_told_from_final_answers():
    from triton_sampling_mask.client.replicas import is_replica_failure

    assert is_replica_failure(None, "could not reach the server: ConnectionRefusedError")
    assert not is_replica_failure("503", "Exceeds maximum queue size")  # busy: retried on the same replica
    assert is_replica_failure("StatusCode.UNAVAILABLE", "failed to connect to all addresses")
    assert is_replica_failure(
        "500",
        "Failed to process the request(s) for model instance 'sampler_0_0', "
        "message: Stub process 'sampler_0_0' is not healthy.",
    )
    assert not is_replica_failure("400", "top_k must be finite")
    assert not is_replica_failure("StatusCode.INVALID_ARGUMENT", "top_k must be finite")
    assert not is_replica_failure("500", "the backend raised")


def test_several_urls_skip_a_dead_replica_with_the_same_draws(client, triton_server, logits):
    expected = client.sample(logits, ROWS)
    dead = f"127.0.0.1:{free_port()}"
    live = url_for(triton_server, client.protocol)
    with SamplerClient([dead, live], protocol=client.protocol) as several:
        for shm in (False, True, False, True):
            result = several.sample(logits, ROWS, use_shared_memory=shm)
            np.testing.assert_array_equal(result.output_ids, expected.output_ids)
            np.testing.assert_array_equal(result.sampling_mask, expected.sampling_mask)
        assert several.healthy_replicas() == [live]
        assert several.replica_shares() == {dead: 0, live: 4}


def test_several_urls_never_retry_a_user_error(client, triton_server, logits):
    dead = f"127.0.0.1:{free_port()}"
    live = url_for(triton_server, client.protocol)
    # mask_width and max_batch_size given: no config read, so the first request goes to `live`.
    with SamplerClient(
        [live, dead],
        protocol=client.protocol,
        model_name="sampler_nosupport",
        mask_width=client.mask_policy().mask_width,
        max_batch_size=8,
    ) as several:
        with pytest.raises(SamplerError) as info:
            several.sample(logits[:1], ROWS[0])
        assert info.value.is_invalid_argument and info.value.message == backend_mask_message("nosupport")
        assert several.healthy_replicas() == [live, dead]  # the dead one was never tried


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_replica_down_raises_sampler_error_after_the_retries(protocol):
    urls = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with SamplerClient(urls, protocol=protocol, max_attempts=3, eject_backoff_s=0.05) as client:
        with pytest.raises(SamplerError) as info:
            client.sample(np.zeros((1, 4), np.float32))
        assert not info.value.is_invalid_argument and client.healthy_replicas() == []


def test_async_several_urls_with_shared_memory(triton_server, logits):
    expected = None
    for protocol in ("http", "grpc"):
        with SamplerClient(url_for(triton_server, protocol), protocol=protocol) as single:
            expected = expected or single.sample(logits, ROWS).output_ids.tolist()

    async def run(protocol, shm):
        dead = f"127.0.0.1:{free_port()}"
        async with AsyncSamplerClient(
            [dead, url_for(triton_server, protocol)], protocol=protocol, max_batch_size=2
        ) as several:
            results = [await several.sample(logits, ROWS, use_shared_memory=shm) for _ in range(3)]
            return [r.output_ids.tolist() for r in results], several.replica_shares()[dead]

    for protocol, shm in (("http", False), ("grpc", True), ("http", True)):
        draws, dead_share = asyncio.run(run(protocol, shm))
        assert draws == [expected] * 3 and dead_share == 0, (protocol, shm)


def test_one_url_keeps_failing_at_once():
    with SamplerClient(f"127.0.0.1:{free_port()}", protocol="grpc") as client:
        assert client.max_attempts == 1 and len(client.urls) == 1
    with pytest.raises(ValueError):
        SamplerClient([], protocol="grpc")
