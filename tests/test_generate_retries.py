"""The generate client's retry rules without a server: which refusals are busy, the backoff's
bounds, and a retried stream resuming after the tokens it already yielded."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.client.generate_client import AsyncGenerateClient, _Job
from triton_sampling_mask.client.generate_transport import BUSY_MESSAGES, GenerateError
from triton_sampling_mask.client.replicas import is_replica_failure
from triton_sampling_mask.generation.engine import RETRY_LATER
from triton_sampling_mask.sampling.outputs import FINISH_REASON, TOKEN_OUTPUTS


def test_the_engines_retry_later_refusals_are_busy_and_user_errors_are_not():
    assert RETRY_LATER in BUSY_MESSAGES  # the engine's marker and the client's are one phrase
    assert GenerateError("in-band", f"generate is at capacity: 3 requests already wait; {RETRY_LATER}").busy
    assert GenerateError("503", "Exceeds maximum queue size").busy  # Triton's own queue limit
    assert not GenerateError("in-band", "input_ids must be token ids in [0, 1024), got 2000").busy
    assert not GenerateError("400", "prompt length 10 + max_new_tokens 600 exceeds ... (kv_budget_tokens)").busy


def test_the_backoff_doubles_up_to_its_cap_with_jitter():
    client = AsyncGenerateClient("127.0.0.1:1", backoff_s=0.1, max_backoff_s=0.4)
    for tries, step in ((0, 0.1), (1, 0.2), (2, 0.4), (5, 0.4)):
        pauses = [client._backoff_s(tries) for _ in range(200)]
        assert step / 2 <= min(pauses) and max(pauses) <= step
        assert len(set(pauses)) > 1  # jittered: clients refused together do not come back together


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
    fresh.retry(GenerateError("in-band", RETRY_LATER))  # nothing yielded yet: a busy refusal retries freely
    assert fresh.accept(token_outputs([5], "length")).output_ids.tolist() == [5]
