"""The typed clients' receipts and timings, built from responses without a server: each token's
step follows its place in the request (a retried seeded stream included), receipts join like the
tokens, and the timing values derive from the three outputs as docs/metrics.md states them."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.client.generate_client import RequestTimings, _Job, concatenate_tokens
from triton_sampling_mask.client.generate_transport import GenerateError
from triton_sampling_mask.client.receipts import SAMPLER_CALL, SamplingReceipts
from triton_sampling_mask.client.sampling_params import SamplingParams, rows_to_params
from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.outputs import FINISH_REASON, SAMPLED_OUTPUTS, TIMING_OUTPUTS

SEED = 2**64 - 3
PARAMS = rows_to_params([SamplingParams(temperature=0.7, top_k=9, seed=SEED)])


def response(ids: list[int], finish: str = "", timings=None) -> dict:
    """One response as the transport hands it over: filler outputs, the request's seed per token."""
    n = len(ids)
    outputs = {spec.name: np.zeros((n, 2) if spec.per == "mask" else (n,), spec.dtype) for spec in SAMPLED_OUTPUTS}
    outputs["output_ids"] = np.array(ids, np.int32)
    outputs["sampling_seed"] = np.full(n, SEED, np.uint64)
    outputs[FINISH_REASON.name] = finish
    for spec, value in zip(TIMING_OUTPUTS, timings or (None, None, None)):
        outputs[spec.name] = value
    return outputs


def test_a_streamed_requests_receipts_count_steps_across_a_retry():
    job = _Job(0, {}, stream=True, seeded=True, outputs=None, receipts=PARAMS, timings=True)
    first = [job.accept(response([t])) for t in (7, 8)]
    job.retry(GenerateError("StatusCode.UNAVAILABLE", "the server closed the stream"))
    again = [
        job.accept(response(ids, "length" if 10 in ids else "", (0.5, 1.0, 2.5) if 10 in ids else None))
        for ids in ([7], [8, 9], [10])
    ]
    chunks = [*first, *[c for c in again if c is not None]]
    assert [c.receipts.step.tolist() for c in chunks] == [[0], [1], [2], [3]]
    joined = concatenate_tokens(chunks)
    assert joined.output_ids.tolist() == [7, 8, 9, 10] and joined.receipts.step.tolist() == [0, 1, 2, 3]
    assert (joined.receipts.seed == SEED).all() and (joined.receipts.params.top_k == 9).all()
    # The receipt's noise seed is the engine's for each step.
    expected = rng.step_seeds_numpy(np.full(4, SEED, np.uint64), np.arange(4)).view(np.uint64)
    np.testing.assert_array_equal(joined.receipts.noise_seed, expected)
    assert [c.timings for c in chunks[:-1]] == [None] * 3
    assert chunks[-1].timings == RequestTimings(0.5, 1.0, 2.5, tokens=4)


def test_a_whole_result_without_the_flags_has_neither():
    job = _Job(1, {}, stream=False, seeded=True, outputs=None)
    job.accept(response([4, 5], "stop", (0.1, 0.2, 0.3)))
    result = job.result()
    assert result.receipts is None and result.timings is None
    assert result.sampling_seed.tolist() == [SEED, SEED]


def test_timings_derive_as_documented():
    """queue 0.5 s, first token 1.5 s after submission, last token 3.5 s after admission, 5 tokens."""
    timings = RequestTimings(queue_s=0.5, time_to_first_token_s=1.5, generation_s=3.5, tokens=5)
    assert timings.e2e_s == 4.0 and timings.decode_s == 2.5
    assert timings.mean_inter_token_s == pytest.approx(2.5 / 4)
    assert timings.tokens_per_s == pytest.approx(5 / 3.5)
    one = RequestTimings(0.0, 0.2, 0.2, tokens=1)
    assert one.mean_inter_token_s is None and one.tokens_per_s == pytest.approx(5.0)


def test_server_receipts_of_a_sampler_answer_and_their_shape_rules():
    params = rows_to_params([SamplingParams(seed=1), SamplingParams()])
    receipts = SamplingReceipts.served(np.array([[1], [99]], np.uint64), params)
    assert receipts.seed.tolist() == [1, 99] and (receipts.step == SAMPLER_CALL).all()
    np.testing.assert_array_equal(receipts.noise_seed, [1, 99])  # a sampler row's noise takes its seed as is
    with pytest.raises(ValueError, match="one seed, step and parameter row per token"):
        SamplingReceipts.served(np.array([1, 2, 3], np.uint64), params)
