"""The request rules: which rows fail, in which order, with which message."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import (
    SPECULATIVE_MASK_MESSAGE,
    UNBOUNDED_MASK_MESSAGE,
    MaskPolicy,
    SamplingRequestError,
    backend_mask_message,
    check_rows,
    check_vocab_size,
)

POLICY = MaskPolicy(mask_width=8, width_source="the dims of output 'sampling_mask' in x/config.pbtxt")


def rows(**fields) -> RowParams:
    """RowParams for len(any field) rows, other fields at their defaults."""
    count = len(next(iter(fields.values())))
    params = RowParams.defaults(count)
    for name, values in fields.items():
        setattr(params, name, np.asarray(values, dtype=getattr(params, name).dtype))
    return params


def messages(params, policy=POLICY, vocab=100, row_max=None):
    row_max = np.zeros(params.rows, np.float32) if row_max is None else np.asarray(row_max, np.float32)
    return [None if e is None else e.message for e in check_rows(params, row_max, vocab, policy)]


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("temperature", -0.5, "temperature must be a finite number >= 0"),
        ("temperature", np.inf, "temperature must be a finite number >= 0"),
        ("temperature", np.nan, "temperature must be a finite number >= 0"),
        ("top_k", 0, "top_k must be -1 (whole vocabulary) or >= 1, got 0"),
        ("top_k", -2, "top_k must be -1 (whole vocabulary) or >= 1, got -2"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("top_p", np.nan, "top_p must be in (0, 1]"),
        ("min_p", -0.1, "min_p must be in [0, 1)"),
        ("min_p", 1.0, "min_p must be in [0, 1)"),
        ("min_p", np.nan, "min_p must be in [0, 1)"),
    ],
)
def test_out_of_range_parameters_name_the_field(field, value, fragment):
    params = rows(**{field: [value, RowParams.defaults(1).__dict__[field][0]]})
    found = messages(params)
    assert found[0] is not None and fragment in found[0]
    assert found[1] is None


def test_mask_admission_rules_in_order():
    params = rows(
        top_k=[-1, -1, 9, 8, 5, -1],
        top_p=[0.9, 1.0, 1.0, 1.0, 1.0, 1.0],
        temperature=[1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        return_sampling_mask=[True, True, True, True, False, True],
    )
    found = messages(params)
    assert found[0] == UNBOUNDED_MASK_MESSAGE and found[1] == UNBOUNDED_MASK_MESSAGE
    assert "top_k=9" in found[2] and "W=8" in found[2] and "x/config.pbtxt" in found[2]
    assert found[3] is None and found[4] is None
    assert found[5] is None, "greedy has a one-token support, so it is bounded"


def test_width_rule_uses_the_vocabulary_bound():
    params = rows(top_k=[50], return_sampling_mask=[True])
    assert messages(params, vocab=8) == [None]
    assert "top_k=50" in messages(params, vocab=9)[0]


def test_speculative_and_backend_rules():
    params = rows(top_k=[4, 4], return_sampling_mask=[True, False])
    speculative = MaskPolicy(mask_width=8, width_source="w", speculative_algorithm="EAGLE")
    assert messages(params, speculative) == [SPECULATIVE_MASK_MESSAGE, None]
    # A model that verifies its drafts exactly admits masks under those algorithms only.
    for algorithm, refused in (("ngram", None), (" NGram ", None), ("eagle", SPECULATIVE_MASK_MESSAGE)):
        exact = MaskPolicy(8, "w", speculative_algorithm=algorithm, exact_speculative=frozenset({"ngram"}))
        assert messages(params, exact) == [refused, None], algorithm
    assert messages(params, MaskPolicy(8, "w", speculative_algorithm="ngram")) == [SPECULATIVE_MASK_MESSAGE, None]
    no_support = MaskPolicy(mask_width=8, width_source="w", backend_name="ascend", backend_builds_support=False)
    assert messages(params, no_support) == [backend_mask_message("ascend"), None]
    assert backend_mask_message("ascend") == "return_sampling_mask is not supported with the ascend sampling backend."


def test_logit_rows():
    params = rows(top_k=[4, 4, 4, 4])
    found = messages(params, row_max=[np.nan, np.inf, -np.inf, 3.0])
    assert "NaN" in found[0] and "+inf" in found[1] and "-inf" in found[2] and found[3] is None


def test_vocab_size_limits():
    with pytest.raises(SamplingRequestError, match="non-empty vocabulary"):
        check_vocab_size(0, 10)
    with pytest.raises(SamplingRequestError, match="exceeds max_vocab_size=10"):
        check_vocab_size(11, 10)
    check_vocab_size(10, 10)


@pytest.mark.parametrize("wrapped", [-(2**31), -(2**31) + 5, -2])
def test_a_top_k_below_minus_one_names_the_value_and_the_wrap_of_json_integers(wrapped):
    params = RowParams.defaults(1)
    params.top_k = np.array([wrapped], np.int32)
    (message,) = messages(params)
    assert message.startswith(f"top_k must be -1 (whole vocabulary) or >= 1, got {wrapped}")
    assert "over HTTP JSON, a value of 2**31 or more arrives wrapped" in message


@pytest.mark.parametrize(
    "field, value", [("top_k", 2**31), ("top_k", 2**32 + 5), ("top_k", -(2**31) - 1), ("seed", -1), ("seed", 2**64)]
)
def test_the_wire_builder_refuses_integers_its_dtype_cannot_hold_with_their_true_value(field, value):
    import tritonclient.http as httpclient

    from triton_sampling_mask.client.wire import sampler_inputs

    with pytest.raises(
        SamplingRequestError, match=rf"{field} must be an integer in \[.*\] \(\w+\), got {value}$"
    ) as caught:
        sampler_inputs(httpclient, np.zeros((1, 4), np.float32), **{field: value})
    assert caught.value.field == field
    inputs = sampler_inputs(httpclient, np.zeros((2, 4), np.float32), top_k=[2**31 - 1, 1], seed=2**64 - 1)
    assert [i.name() for i in inputs] == ["logits", "top_k", "seed"]
