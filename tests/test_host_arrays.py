"""Host arrays in their documented dtypes: RowParams as the wire carries them, and the numpy hash
of rng.py bit for bit the pure-Python SplitMix64 of tests/reference.py whatever integers it is given."""

from __future__ import annotations

import numpy as np

from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.params import RowParams

from .reference import _splitmix_finaliser, reference_noise_seed

# The request inputs' wire dtypes (model_repository/sampler/config.pbtxt): FP32 and INT32 scalars,
# UINT64 seeds, BOOL flags.
WIRE_DTYPES = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.uint64,
    "has_seed": np.bool_,
    "return_sampling_mask": np.bool_,
}


def test_default_rows_are_the_documented_defaults_in_the_wire_dtypes():
    params = RowParams.defaults(3)
    expected = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": 0, "has_seed": False}
    expected["return_sampling_mask"] = False
    for name, dtype in WIRE_DTYPES.items():
        values = getattr(params, name)
        assert values.dtype == dtype and values.shape == (3,), name
        np.testing.assert_array_equal(values, np.full(3, expected[name], dtype), err_msg=name)
    seeded = params.with_seeds(np.array([5, 6, 7], np.uint64))
    assert seeded.has_seed.dtype == np.bool_ and seeded.has_seed.all()
    np.testing.assert_array_equal(seeded.seed, [5, 6, 7])


def test_mix64_numpy_hashes_python_ints_and_leaves_its_input_alone():
    values = [0, 1, 12345, 2**40 + 3]
    np.testing.assert_array_equal(
        rng.mix64_numpy(values), np.array([_splitmix_finaliser(v) for v in values], np.uint64)
    )
    array = np.array(values, np.uint64)
    rng.mix64_numpy(array)
    np.testing.assert_array_equal(array, np.array(values, np.uint64))


def test_step_seeds_numpy_reads_steps_of_any_integer_dtype():
    seeds = np.array([3, 2**63 + 11, 7], np.uint64)
    steps = [0, 1, 250]
    expected = np.array([reference_noise_seed(int(s), t) for s, t in zip(seeds, steps)], np.uint64)
    for dtype in (np.int32, np.int64, np.uint16):
        got = rng.step_seeds_numpy(seeds, np.array(steps, dtype)).view(np.uint64)
        np.testing.assert_array_equal(got, expected, err_msg=str(dtype))
