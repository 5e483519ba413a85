"""Every request rule's Rejection as the model answers it and the metrics count it: the reason
label, the field the user must change and the exact message, written out here by hand."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import (
    MaskPolicy,
    Rejection,
    SamplingRequestError,
    check_logit_rows,
    check_rows,
    check_vocab_size,
)

UNBOUNDED = (
    "return_sampling_mask requires finite top_k; top_p-only sampling is valid but can return "
    "huge masks in the tail, blowing up metadata, so we need a safety cap."
)


def test_logit_rules_label_each_refusal_by_its_reason_and_the_logits_field():
    errors = check_logit_rows(np.array([np.nan, np.inf, -np.inf, 3.0, -1e30], np.float32))
    assert list(errors) == [
        Rejection("logits_nan", "logits", "logits must not contain NaN"),
        Rejection("logits_inf", "logits", "logits must not contain +inf"),
        Rejection("logits_all_neg_inf", "logits", "logits must have at least one finite value (every entry is -inf)"),
        None,
        None,
    ]


def mask_rows(top_k: list[int]) -> RowParams:
    params = RowParams.defaults(len(top_k))
    params.top_k = np.array(top_k, np.int32)
    params.return_sampling_mask = np.ones(len(top_k), np.bool_)
    return params


def test_mask_rules_label_each_refusal_by_its_reason_and_field():
    policy = MaskPolicy(mask_width=4, width_source="W's source")
    errors = check_rows(mask_rows([-1, 5, 4]), None, 100, policy)
    assert errors[0] == Rejection("mask_unbounded", "top_k", UNBOUNDED)
    assert errors[1] == Rejection(
        "mask_over_width",
        "top_k",
        "return_sampling_mask with top_k=5 can return up to 5 ids, more than the sampling-mask width W=4; "
        "lower top_k to at most 4 or raise W (W's source)",
    )
    assert errors[2] is None
    speculative = MaskPolicy(mask_width=4, width_source="", speculative_algorithm="eagle")
    (error,) = check_rows(mask_rows([2]), None, 100, speculative)
    assert error == Rejection(
        "mask_speculative", "return_sampling_mask", "return_sampling_mask is not supported with speculative decoding."
    )
    no_support = MaskPolicy(mask_width=4, width_source="", backend_name="flash", backend_builds_support=False)
    (error,) = check_rows(mask_rows([2]), None, 100, no_support)
    assert error == Rejection(
        "mask_backend", "return_sampling_mask", "return_sampling_mask is not supported with the flash sampling backend."
    )


def test_a_top_k_of_zero_is_refused_without_the_wrapped_json_note():
    params = RowParams.defaults(1)
    params.top_k = np.array([0], np.int32)
    (error,) = check_rows(params, None, 100, MaskPolicy(mask_width=4, width_source=""))
    assert error == Rejection("top_k", "top_k", "top_k must be -1 (whole vocabulary) or >= 1, got 0")


@pytest.mark.parametrize(
    ("vocab", "message"),
    [
        (0, "logits must have a non-empty vocabulary dimension, got 0 entries"),
        (11, "logits vocabulary size 11 exceeds max_vocab_size=10"),
    ],
)
def test_a_vocabulary_out_of_bounds_is_a_logits_error(vocab, message):
    with pytest.raises(SamplingRequestError) as refused:
        check_vocab_size(vocab, 10)
    assert (refused.value.field, refused.value.message, refused.value.reason) == ("logits", message, "invalid_logits")


@pytest.mark.parametrize("vocab", [1, 2, 10])
def test_every_vocabulary_from_one_entry_to_the_maximum_is_accepted(vocab):
    check_vocab_size(vocab, 10)
