"""Per-request timings through the typed generate client, against the session's real server: the
engine's queue, TTFT and generation times (`queue_time_s`, `time_to_first_token_s`,
`generation_time_s`) on each result when asked for, consistent with each other and with the
times the client itself measures around the same requests (the server's intervals lie inside the
client's, both read from the host's monotonic clock)."""

from __future__ import annotations

import asyncio
import time

import pytest

from triton_sampling_mask.client import AsyncGenerateClient, GenerateClient
from triton_sampling_mask.client.generate_client import RequestTimings
from triton_sampling_mask.client.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.8, top_k=20, seed=3)
PROMPTS = [[5, 6, 7], [40, 41], [9]]
BUDGETS = [12, 6, 1]
SLACK_S = 2e-3  # float32 seconds, and the client's own clock readings around the call


def assert_consistent(timings: RequestTimings, tokens: int, client_e2e_s: float) -> None:
    """The timings agree with each other and fit inside what the client measured."""
    assert timings.tokens == tokens
    assert 0 <= timings.queue_s <= timings.time_to_first_token_s + SLACK_S
    assert timings.time_to_first_token_s <= timings.e2e_s + SLACK_S
    assert timings.e2e_s <= client_e2e_s + SLACK_S, (timings, client_e2e_s)
    assert timings.decode_s >= -SLACK_S
    if tokens > 1:
        assert timings.mean_inter_token_s == pytest.approx(timings.decode_s / (tokens - 1))
    else:
        assert timings.mean_inter_token_s is None
    assert timings.tokens_per_s == pytest.approx(tokens / timings.generation_s)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_whole_results_carry_timings_within_the_clients_measurement(triton_server, protocol):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    with GenerateClient(url, protocol=protocol) as client:
        assert client.generate(PROMPTS[:1], PARAMS, 2)[0].timings is None  # only on request
        start = time.monotonic()
        results = client.generate(PROMPTS, PARAMS, BUDGETS, ignore_eos=True, return_timings=True)
        elapsed = time.monotonic() - start
    for result, budget in zip(results, BUDGETS):
        assert_consistent(result.timings, budget, elapsed)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_stream_carries_timings_on_its_last_chunk_within_the_clients_clock(triton_server, protocol):
    """Each request's time to first token is at most the time its first chunk took to arrive, and
    its whole time at most the time its last chunk took."""
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    first_seen, last_seen, final = {}, {}, {}
    with GenerateClient(url, protocol=protocol) as client:
        start = time.monotonic()
        with client.stream(PROMPTS, PARAMS, BUDGETS, ignore_eos=True, return_timings=True) as chunks:
            for chunk in chunks:
                now = time.monotonic() - start
                first_seen.setdefault(chunk.index, now)
                last_seen[chunk.index] = now
                if chunk.finish_reason:
                    final[chunk.index] = chunk.timings
                else:
                    assert chunk.timings is None  # on a request's last response only
    for index, budget in enumerate(BUDGETS):
        timings = final[index]
        assert_consistent(timings, budget, last_seen[index])
        assert timings.time_to_first_token_s <= first_seen[index] + SLACK_S


def test_the_async_client_and_named_outputs(triton_server):
    """`return_timings` adds the timing outputs to a call that names its outputs."""

    async def run():
        async with AsyncGenerateClient(triton_server.grpc_url) as client:
            start = time.monotonic()
            results = await client.generate(
                PROMPTS[:2], PARAMS, 5, ignore_eos=True, outputs=["output_ids"], return_timings=True
            )
            return results, time.monotonic() - start

    results, elapsed = asyncio.run(run())
    for result in results:
        assert result.sampling_mask is None
        assert_consistent(result.timings, 5, elapsed)
