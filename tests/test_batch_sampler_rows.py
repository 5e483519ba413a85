"""BatchSampler.run beyond two answered requests: each request's rows go back to it alone, a
refused request names its own first bad row, and unseeded rows draw independent seeds."""

from __future__ import annotations

import numpy as np
import torch

from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import MaskPolicy

from .test_batching import WIDTH, batch_sampler, check_batch, request  # noqa: F401 (a fixture)


def test_four_answered_requests_each_get_their_own_rows(batch_sampler):  # noqa: F811
    sizes = [2, 1, 3, 2]
    requests = [request(rows, 64, seed) for seed, rows in enumerate(sizes)]
    requests.insert(2, request(2, 64, 99, bad="top_p"))
    check_batch(batch_sampler, requests, refused={2})


def test_a_refused_request_is_answered_with_its_own_first_bad_row(batch_sampler):  # noqa: F811
    # Row 1 of both requests breaks a parameter rule, so neither is sampled; row 0 of the first
    # also holds NaN, which the logits rule finds first in that request only.
    nan_first = request(2, 64, 1, bad="top_p", bad_row=1)
    nan_first[0][0, 5] = float("nan")
    clean_first = request(2, 64, 2, bad="top_p", bad_row=1)
    outcomes = batch_sampler.run([nan_first, clean_first])
    assert outcomes[0].error == "logits must not contain NaN (row 0)"
    assert outcomes[1].error == "top_p must be in (0, 1], got 0.0 (row 1)"
    assert (outcomes[0].reason, outcomes[1].reason) == ("logits_nan", "top_p")


def test_unseeded_rows_draw_independent_seeds():
    # 128 unseeded rows over 2**14 equally likely ids: independent draws repeat a token about once
    # (128**2 / 2**15 expected pairs); rows sharing seeds, or seeds from a small range, repeat far more.
    rows, vocab = 128, 1 << 14
    params = RowParams.defaults(rows)
    sampler = BatchSampler(TorchSamplingBackend(fused=False), MaskPolicy(WIDTH, "test"), torch.device("cpu"))
    (outcome,) = sampler.run([(torch.zeros(rows, vocab), params)])
    assert outcome.error is None
    assert np.unique(outcome.outputs["output_ids"]).size >= rows - 8


def test_a_request_of_nan_rows_last_in_a_large_vocabulary_batch_harms_no_neighbour(batch_sampler):  # noqa: F811
    # V = 4096 against top_k <= 16 ranks the rows by threshold selection on the CPU, where an
    # all-NaN row has no candidate at all.
    answered = request(2, 4096, 3)
    broken = request(1, 4096, 4)
    broken[0][:] = float("nan")
    outcomes = batch_sampler.run([answered, broken])
    assert outcomes[1].error == "logits must not contain NaN"
    assert outcomes[0].error is None
    alone = batch_sampler.run([answered])[0]
    for name, value in alone.outputs.items():
        np.testing.assert_array_equal(outcomes[0].outputs[name], value, err_msg=name)
