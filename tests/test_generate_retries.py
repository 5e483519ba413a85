"""The clients' retry rules without a server: the one busy contract (which refusals are busy, for
the proxy, the engine and both clients), the backoff's bounds, and a retried stream resuming
after the tokens it already yielded."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from triton_sampling_mask.client.generate_client import AsyncGenerateClient, _Job
from triton_sampling_mask.client.generate_transport import GenerateError
from triton_sampling_mask.client.replicas import Attempts, BusyPolicy, ReplicaSet, is_replica_failure
from triton_sampling_mask.client.sampler_client import SamplerClient, SamplerError
from triton_sampling_mask.ops import proxy, settings
from triton_sampling_mask.sampling.outputs import FINISH_REASON, TOKEN_OUTPUTS
from triton_sampling_mask.sampling.refusals import DEFAULT_ROUTE_CAPACITY, RETRY_MARKER

ENGINE_FULL = f"generate is at capacity: 3 requests already wait; {RETRY_MARKER}"


def test_one_busy_marker_for_the_proxy_the_engine_and_both_clients():
    for shed in (proxy.QUEUE_FULL, proxy.QUEUE_TIMEOUT, ENGINE_FULL):
        assert RETRY_MARKER in shed
        assert GenerateError("in-band", shed).busy
        assert not is_replica_failure("503", shed)  # busy is not broken: the replica stays in
    assert GenerateError("503", "Exceeds maximum queue size").busy  # Triton's own queue limit
    assert not GenerateError("in-band", "input_ids must be token ids in [0, 1024), got 2000").busy
    assert not GenerateError("400", "prompt length 10 + max_new_tokens 600 exceeds ... (kv_budget_tokens)").busy
    assert is_replica_failure("503", "the server is shutting down")


def test_the_clients_default_load_fits_a_front_door_route():
    assert settings.PROXY_MAX_IN_FLIGHT.default == DEFAULT_ROUTE_CAPACITY
    assert AsyncGenerateClient("127.0.0.1:1").max_in_flight <= settings.PROXY_MAX_IN_FLIGHT.default
    assert AsyncGenerateClient(["127.0.0.1:1", "127.0.0.1:2"]).max_in_flight == 2 * DEFAULT_ROUTE_CAPACITY


def test_the_backoff_doubles_up_to_its_cap_with_jitter():
    policy, rng = BusyPolicy(backoff_s=0.1, max_backoff_s=0.4), random.Random(0)
    for tries, step in ((0, 0.1), (1, 0.2), (2, 0.4), (5, 0.4)):
        pauses = [policy.pause_s(tries, rng) for _ in range(200)]
        assert step / 2 <= min(pauses) and max(pauses) <= step
        assert len(set(pauses)) > 1  # jittered: clients refused together do not come back together


def test_a_busy_refusal_is_retried_until_the_busy_timeout_then_raised():
    """The sampler client's calls: busy answers neither eject the replica nor use up the one try."""
    answers = iter([SamplerError("503", proxy.QUEUE_FULL)] * 3 + ["served"])
    replicas = ReplicaSet(["a:1"], lambda url: object(), 0.5, 5.0)
    attempts = Attempts(replicas, 1, lambda: None, lambda exc: exc, BusyPolicy(backoff_s=0.001, max_backoff_s=0.002))

    async def work(_client):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert asyncio.run(attempts.acall(work)) == "served" and attempts.busy_counter.count == 3
    assert replicas.healthy_urls() == ["a:1"]
    stubborn = Attempts(replicas, 1, lambda: None, lambda exc: exc, BusyPolicy(0.001, 0.002, timeout_s=0.05))

    async def always_busy(_client):
        raise SamplerError("503", proxy.QUEUE_TIMEOUT)

    with pytest.raises(SamplerError, match=RETRY_MARKER):
        asyncio.run(stubborn.acall(always_busy))
    with SamplerClient("127.0.0.1:1", mask_width=8, max_batch_size=4) as client:
        assert client.busy_policy.timeout_s == 30.0


def token_outputs(ids: list[int], finish: str = "") -> dict:
    """A streamed response of `ids` with filler outputs (width 2)."""
    n = len(ids)
    outputs = {spec.name: np.zeros((n, 2) if spec.per == "mask" else (n,), spec.dtype) for spec in TOKEN_OUTPUTS}
    outputs["output_ids"] = np.array(ids, np.int32)
    outputs[FINISH_REASON.name] = finish
    return outputs


def test_a_retried_seeded_stream_resumes_after_what_it_yielded():
    job = _Job(3, {}, stream=True, seeded=True, outputs=None)
    yielded = [job.accept(token_outputs([t])) for t in (7, 8)]
    job.retry(GenerateError("StatusCode.UNAVAILABLE", "the server closed the stream"))
    again = [job.accept(token_outputs([t], "length" if t == 10 else "")) for t in (7, 8, 9, 10)]
    assert [c.output_ids.tolist() for c in yielded] == [[7], [8]]
    assert again[:2] == [None, None]  # replayed: already yielded
    assert [c.output_ids.tolist() for c in again[2:]] == [[9], [10]] and again[3].finish_reason == "length"
    assert all(c.index == 3 for c in yielded + again[2:])


def test_a_retried_stream_that_diverges_or_is_unseeded_fails():
    job = _Job(0, {}, stream=True, seeded=True, outputs=None)
    job.accept(token_outputs([7]))
    job.retry(GenerateError(None, "reset"))
    with pytest.raises(GenerateError, match="diverged") as diverged:
        job.accept(token_outputs([6]))
    assert not is_replica_failure(diverged.value.status, diverged.value.message)  # final, not retried
    unseeded = _Job(1, {}, stream=True, seeded=False, outputs=None)
    unseeded.accept(token_outputs([7]))
    with pytest.raises(GenerateError, match="unseeded") as error:
        unseeded.retry(GenerateError(None, "reset"))
    assert error.value.index == 1
    fresh = _Job(2, {}, stream=True, seeded=False, outputs=None)
    fresh.retry(GenerateError("in-band", ENGINE_FULL))  # nothing yielded yet: a busy refusal retries freely
    assert fresh.accept(token_outputs([5], "length")).output_ids.tolist() == [5]
