"""The GPU path's margin top-k (`selection._ranked_candidates_device`, run on CPU tensors) when a
run of equal logits starts exactly at the k-th place and reaches past the fetched candidates:
the boundary repair must give the run's places to its lowest ids (lexsort's order). The other
tie tests (tests/test_gpu_branches_on_cpu.py) start their runs above the k-th place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.sampler import SamplingBatch, sample
from triton_sampling_mask.sampling.selection import candidate_count, ranked_candidates

from .reference import exact_support_len


def run_at_k(k: int, vocab: int, seed: int) -> np.ndarray:
    """Three rows: k - 1 distinct logits above a run of equal ones (at scattered ids) far longer
    than the margin fetched past k, the rest below; the run's value differs per row."""
    rng = np.random.default_rng(seed)
    rows = np.empty((3, vocab), np.float32)
    for row, run_value in enumerate((0.0, -0.5, 2.0)):
        rows[row] = rng.standard_normal(vocab).astype(np.float32) - 20
        ids = rng.permutation(vocab)
        run = candidate_count(k, vocab) - k + 40  # longer than the fetched margin
        rows[row, ids[: k - 1]] = run_value + 1 + np.arange(k - 1, dtype=np.float32)  # distinct, above
        rows[row, ids[k - 1 : k - 1 + run]] = run_value
    return rows


def lexsort_ids(logits: np.ndarray, k: int) -> np.ndarray:
    return np.stack([np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k] for row in logits])


@pytest.mark.parametrize("k", [2, 3, 7, 50])
def test_a_run_starting_at_the_kth_place_gets_its_lowest_ids(k):
    logits = run_at_k(k, 600, k)
    values, ids = ranked_candidates(torch.from_numpy(logits), k, device_path="gpu")
    expected = lexsort_ids(logits, k)
    np.testing.assert_array_equal(ids.numpy(), expected)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(logits, expected, 1))


def test_the_sampled_mask_ends_with_the_lowest_id_of_the_run_at_the_kth_place():
    k = 5
    logits = run_at_k(k, 600, 1)
    rows = logits.shape[0]
    batch = SamplingBatch.from_arrays(
        torch.from_numpy(logits),
        np.full(rows, 1.0, np.float32),
        np.full(rows, k, np.int64),
        np.ones(rows, np.float32),
        np.zeros(rows, np.float32),
        np.arange(rows),
        np.ones(rows, bool),
    )
    host = sample(batch, mask_width=16, fused=False, device_path="gpu").host()
    for row in range(rows):
        assert exact_support_len(logits[row], 1.0, k) == k
        np.testing.assert_array_equal(host["sampling_mask"][row, :k], lexsort_ids(logits[row : row + 1], k)[0])
        assert host["sampling_mask_len"][row] == k
