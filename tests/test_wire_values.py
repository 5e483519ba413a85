"""The outputs as they travel: -inf padding sent as float32's lowest value and read back as -inf,
every other output untouched, and the padding of rows that asked for no mask in its wire dtype."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.sampling.batching import outputs_to_numpy
from triton_sampling_mask.sampling.outputs import from_wire_values, padding, to_wire, to_wire_values
from triton_sampling_mask.sampling.results import HostResult

LOWEST = np.float32(-3.4028235e38)  # float32's lowest finite value, written out


def test_neg_inf_padding_travels_as_the_lowest_float32_and_comes_back():
    sent = np.array([[-0.5, -2.0, -np.inf], [-np.inf, -np.inf, -np.inf]], np.float32)
    wire = to_wire_values("sampling_mask_logprobs", sent)
    assert wire.dtype == np.float32
    np.testing.assert_array_equal(wire, [[-0.5, -2.0, LOWEST], [LOWEST, LOWEST, LOWEST]])
    assert np.isneginf(sent[0, 2])  # the caller's array is left as it is
    readonly = wire.copy()
    readonly.flags.writeable = False  # tritonclient may hand read-only views
    back = from_wire_values("sampling_mask_logprobs", readonly)
    np.testing.assert_array_equal(back, sent)
    np.testing.assert_array_equal(readonly[1], [LOWEST] * 3)


@pytest.mark.parametrize("name", ["output_logprobs", "sampling_logprobs", "sampling_mask"])
def test_outputs_without_neg_inf_fill_travel_as_they_are(name):
    values = np.array([-np.inf, LOWEST, -1.0], np.float32)
    assert to_wire_values(name, values) is values
    assert from_wire_values(name, values) is values
    assert from_wire_values("sampling_mask_logprobs", None) is None


def test_padding_is_each_outputs_fill_in_its_wire_dtype():
    expected = {
        "output_ids": (np.int32, (3,), 0),
        "output_logprobs": (np.float32, (3,), 0.0),
        "sampling_mask": (np.int32, (3, 4), -1),
        "sampling_mask_len": (np.int32, (3,), 0),
        "sampling_logprobs": (np.float32, (3,), 0.0),
        "sampling_mask_logprobs": (np.float32, (3, 4), -np.inf),
    }
    for name, (dtype, shape, fill) in expected.items():
        padded = padding(name, 3, 4)
        assert (padded.dtype, padded.shape) == (dtype, shape), name
        np.testing.assert_array_equal(padded, np.full(shape, fill, dtype), err_msg=name)


def test_to_wire_casts_without_copying_what_is_already_in_its_wire_dtype():
    arrays = {name: np.zeros((2, 1), np.float32) for name in ("output_logprobs", "sampling_logprobs")}
    arrays |= {name: np.zeros((2, 1), np.int64) for name in ("output_ids", "sampling_mask_len")}
    arrays |= {"sampling_mask": np.zeros((2, 4), np.int64), "sampling_mask_logprobs": np.zeros((2, 4), np.float32)}
    wire = to_wire(arrays)
    assert wire["output_ids"].dtype == np.int32
    assert wire["sampling_logprobs"] is arrays["sampling_logprobs"]


def test_a_sampler_result_goes_to_numpy_in_the_wire_dtypes_without_row_max():
    arrays = {
        "output_ids": np.array([3, 1], np.int64),
        "output_logprobs": np.array([-0.5, -1.5]),
        "sampling_mask": np.array([[3, -1], [1, 2]], np.int64),
        "sampling_mask_len": np.array([1, 2], np.int64),
        "sampling_logprobs": np.array([0.0, -0.25]),
        "sampling_mask_logprobs": np.array([[0.0, -np.inf], [-0.25, -1.5]]),
        "row_max": np.array([2.0, 4.0], np.float32),
    }
    wire = outputs_to_numpy(HostResult(arrays))
    assert list(wire) == list(WIRE_DTYPES)
    for name, dtype in WIRE_DTYPES.items():
        assert wire[name].dtype == dtype, name
        np.testing.assert_array_equal(wire[name], arrays[name].astype(dtype), err_msg=name)


WIRE_DTYPES = {
    "output_ids": np.int32,
    "output_logprobs": np.float32,
    "sampling_mask": np.int32,
    "sampling_mask_len": np.int32,
    "sampling_logprobs": np.float32,
    "sampling_mask_logprobs": np.float32,
}
