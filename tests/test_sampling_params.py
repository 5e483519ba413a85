"""SamplingParams: the client refuses exactly what the server's rules refuse, with its messages."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.client.sampling_params import SamplingParams, check_rows_like_server, rows_to_params
from triton_sampling_mask.sampling.validation import UNBOUNDED_MASK_MESSAGE, MaskPolicy, SamplingRequestError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.5), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_out_of_range_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(SamplingRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in info.value.message


def test_mask_without_finite_top_k_raises_the_server_message():
    with pytest.raises(SamplingRequestError) as info:
        SamplingParams(top_p=0.9, return_sampling_mask=True)
    assert info.value.message == UNBOUNDED_MASK_MESSAGE


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(top_p=0.5),  # top-p alone is valid without a mask
        dict(temperature=0.0, return_sampling_mask=True),  # greedy masks are bounded whatever top_k says
        dict(top_k=50, top_p=0.95, min_p=0.1, seed=2**64 - 1, return_sampling_mask=True),
    ],
)
def test_valid_values_pass(kwargs):
    SamplingParams(**kwargs)


def test_width_rule_needs_the_server_policy_and_names_the_row():
    rows = rows_to_params(
        [SamplingParams(top_k=4, return_sampling_mask=True), SamplingParams(top_k=9, return_sampling_mask=True)]
    )
    policy = MaskPolicy(mask_width=8, width_source="the server")
    check_rows_like_server(rows)  # without W, nothing to refuse
    check_rows_like_server(rows, vocab_size=8, policy=policy)  # min(top_k, V) = 8 fits
    with pytest.raises(SamplingRequestError, match=r"W=8.*\(row 1\)") as info:
        check_rows_like_server(rows, vocab_size=100, policy=policy)
    assert info.value.field == "top_k"


def test_rows_to_params_matches_the_wire_layout():
    params = rows_to_params([SamplingParams(seed=3), SamplingParams(temperature=0.5)])
    assert params.has_seed.tolist() == [True, False]
    assert params.seed.dtype == np.uint64 and params.seed[0] == 3
    assert params.temperature.dtype == np.float32 and params.temperature.tolist() == [1.0, 0.5]
