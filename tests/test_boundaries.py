"""Exact top_p / min_p boundaries and subnormal temperatures: one answer on every path.

The rules are inclusive: a token is kept while the mass ranked strictly before it is <= top_p,
and while p >= min_p * p_max. The float64 reference's tolerance band cannot tell `<` from `<=`,
so these cases are decided by `exact_support_len` (decimals) and every path must give exactly
its length: the CPU path (numpy epilogue), the GPU path's torch ops on CPU tensors, and the fused
kernels (under Triton's interpreter here, natively on a GPU).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling import fused
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import check_scalar_ranges

from .reference import exact_support_len, reference_row
from .sampling import FUSED_DEVICE, run_sampler

# The three implementations, as run_sampler selects them on CPU tensors.
PATHS = [
    pytest.param(dict(device_path="cpu", fused=False), id="cpu"),
    pytest.param(dict(device_path="gpu", fused=False), id="gpu-ops-on-cpu"),
    pytest.param(
        dict(device_path="gpu", fused=True, device=FUSED_DEVICE),
        id="fused",
        marks=pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed"),
    ),
]


def check_lengths(path, logits, expected, mask_width=64, dtype=torch.float32, **params):
    """Run rows of `logits` on `path` and compare every row's mask length (and mask, token) with
    `expected`; parameters may be per row."""
    logits = np.asarray(logits, np.float32)
    out = run_sampler(logits, mask_width=mask_width, seed=np.arange(len(logits)), dtype=dtype, **params, **path)
    np.testing.assert_array_equal(out["mask_len"], expected)
    for row, length in enumerate(expected):
        order = np.lexsort((np.arange(logits.shape[1]), -logits[row].astype(np.float64)))
        np.testing.assert_array_equal(out["mask"][row, :length], order[:length])
        assert int(out["ids"][row]) in order[:length]
    return out


def tied_rows(ties: list[int], vocab: int, value: float = 0.0) -> np.ndarray:
    """One row per entry of `ties`: that many logits tied at `value` (at scattered ids), -inf elsewhere."""
    rng = np.random.default_rng(len(ties) * vocab)
    rows = np.full((len(ties), vocab), -np.inf, np.float32)
    for row, count in enumerate(ties):
        rows[row, rng.permutation(vocab)[:count]] = value
    return rows


# n logits tied at the max: p = 1/n each, the mass before the j-th is j/n, equal to top_p for some j.
TIED_CASES = [(2, 0.5), (4, 0.25), (4, 0.5), (4, 0.75), (6, 0.5), (8, 0.375), (10, 0.5), (12, 0.75), (64, 0.5)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_top_p_keeps_the_token_whose_mass_before_equals_top_p(path, dtype):
    ties = [n for n, _ in TIED_CASES]
    top_p = np.array([p for _, p in TIED_CASES], np.float32)
    logits = tied_rows(ties, 100, value=3.0)
    logits[1::2][logits[1::2] == 3.0] = -2.5  # another tied value, representable in every dtype
    expected = [exact_support_len(row, 0.7, 64, float(p)) for row, p in zip(logits, top_p)]
    # j/n == top_p is kept: one more than the tokens strictly inside top_p.
    assert expected == [int(n * p) + 1 for n, p in TIED_CASES]
    check_lengths(path, logits, expected, dtype=dtype, temperature=0.7, top_k=64, top_p=top_p)


@pytest.mark.parametrize("path", PATHS)
def test_top_p_boundary_with_signed_zeros_and_a_lower_tail(path):
    # -0.0 and 0.0 are one tied value; the tail below adds less than float32 can see to z.
    logits = np.full((3, 40), -60.0, np.float32)
    logits[:, :8] = np.where(np.arange(8) % 2, -0.0, 0.0)
    logits[2, 20:] = -np.inf
    top_p = np.array([0.5, 0.25, 0.75], np.float32)
    expected = [exact_support_len(row, 1.0, 40, float(p)) for row, p in zip(logits, top_p)]
    assert expected == [5, 3, 7]
    check_lengths(path, logits, expected, top_k=40, top_p=top_p)


@pytest.mark.parametrize("path", PATHS[:2])
def test_top_p_boundary_without_top_k(path):
    # top_k -1: the full sort (V <= 4096) on the CPU and GPU paths, the fused kernels take no such row.
    logits = tied_rows([4, 6, 10], 300)
    top_p = np.array([0.5, 0.5, 0.5], np.float32)
    check_lengths(path, logits, [3, 4, 6], top_k=-1, top_p=top_p)


def ln2_multiples() -> list[tuple[float, float]]:
    """(logit gap, min_p) pairs around p / p_max = 2**-m: the float32 nearest m ln 2 and its two
    neighbours, each against min_p = 2**-m. float32 rounds exp(-gap) to exactly 2**-m for all three,
    while the exact ratio lies above it for some and below it for others."""
    cases = []
    for m in (1, 2, 3):
        nearest = np.float32(m * math.log(2))
        for gap in (np.nextafter(nearest, np.float32(0)), nearest, np.nextafter(nearest, np.float32(9))):
            cases.append((float(gap), 2.0**-m))
    return cases


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_min_p_next_to_a_power_of_two_ratio(path, temperature):
    cases = ln2_multiples()
    logits = np.full((len(cases), 6), -30.0, np.float32)
    logits[:, 0] = 1.5
    logits[:, 1] = [1.5 - np.float32(gap * temperature) for gap, _ in cases]
    min_p = np.array([mp for _, mp in cases], np.float32)
    expected = [exact_support_len(row, temperature, 6, 1.0, float(mp)) for row, mp in zip(logits, min_p)]
    assert 1 in expected and 2 in expected  # both sides of the boundary occur
    check_lengths(path, logits, expected, temperature=temperature, top_k=6, min_p=min_p)


def min_p_on_the_float64_bound() -> tuple[np.ndarray, float]:
    """Logits [max, x] and a min_p for which x - max is exactly the float64 bound T ln(min_p)
    (T = 1) that every path compares with, and the exact rule keeps x: only `>=` keeps it."""
    from decimal import Decimal, localcontext

    for min_p in np.float32(0.3) + np.arange(2000, dtype=np.float32) * np.float32(2**-24):
        bound = float(np.log(np.float64(min_p)))
        head = np.float32(bound)
        rest = bound - float(head)
        if float(np.float32(rest)) != rest:
            continue  # x = rest must be a float32
        with localcontext() as context:
            context.prec = 80
            if Decimal(bound) < Decimal(float(min_p)).ln():
                continue  # the rounded bound sits below the real one: the rule drops x
        logits = np.array([-head, rest], np.float32)  # x - max = rest + head = bound, exactly
        assert np.float64(logits[1]) - np.float64(logits[0]) == bound
        return logits, float(min_p)
    raise AssertionError("no min_p found")


@pytest.mark.parametrize("path", PATHS)
def test_min_p_keeps_a_token_exactly_on_the_bound(path):
    logits, min_p = min_p_on_the_float64_bound()
    assert exact_support_len(logits, 1.0, 2, 1.0, min_p) == 2
    check_lengths(path, logits[None], [2], top_k=2, min_p=min_p)


# As float32 holds them (1e-45 is 2**-149, the smallest subnormal).
SUBNORMAL_TEMPERATURES = [
    float(np.float32(1e-39)),
    float(np.float32(1e-45)),
    float(np.nextafter(np.finfo(np.float32).tiny, np.float32(0))),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature", SUBNORMAL_TEMPERATURES, ids=["1e-39", "1e-45", "largest"])
def test_subnormal_temperatures_are_applied_as_given(path, temperature):
    # log2(e) / T overflows float32 for such T: no path may turn the max's 0 into 0 * inf = NaN.
    params = RowParams.defaults(1)
    params.temperature[:] = temperature
    assert check_scalar_ranges(params)[0] is None, "a subnormal temperature is a valid one"
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0, -np.inf, 1.9999999]] * 3, np.float32)
    top_p = np.array([1.0, 0.5, 0.3], np.float32)
    expected = [exact_support_len(row, temperature, 8, float(p)) for row, p in zip(logits, top_p)]
    assert expected == [7, 2, 1]  # the three tied at the max share all the mass; top_p 1 keeps every finite logit
    out = check_lengths(path, logits, expected, temperature=temperature, top_k=8, top_p=top_p)
    for row, length in enumerate(expected):
        ref = reference_row(logits[row], temperature, 8, float(top_p[row]))
        token = int(out["ids"][row])
        assert out["logprobs"][row] == pytest.approx(ref.logprobs[token], abs=1e-6)  # -log 3
        assert out["mask_logprobs"][row] == pytest.approx(ref.renormalised_logprob(token, length), abs=1e-6)
        support = [ref.renormalised_logprob(int(i), length) for i in out["mask"][row, :length]]
        # The tokens below the max are ~-1e32 or less: float32 holds some, -inf the rest.
        with np.errstate(over="ignore"):
            support = np.float32(support)
        np.testing.assert_allclose(out["support_logprobs"][row, :length], support, rtol=1e-6, atol=1e-6)
