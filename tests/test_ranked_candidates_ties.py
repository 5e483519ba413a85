"""The top-k ranking under ties (the paths bench-driven optimisations touched), against numpy:
the first k ids of lexsort((id, -logit)) and the float64 reference support."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.sampler import SamplingBatch, ranked_candidates, sample
from tests.reference import reference_row


def _expected(logits: np.ndarray, k: int) -> np.ndarray:
    return np.stack([np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k] for row in logits])


def _tied_logits(kind: str, rows: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "bf16":  # real model outputs: many exact ties everywhere
        return torch.from_numpy(rng.standard_normal((rows, vocab)) * 3).bfloat16().float().numpy()
    if kind == "long_run":  # a run of equal logits far longer than the margin fetched past k
        logits = rng.standard_normal((rows, vocab)).astype(np.float32) - 10
        logits[:, rng.permutation(vocab)[:400]] = 0.0
        logits[:, :5] = 1.0
        return logits
    if kind == "all_equal":
        return np.zeros((rows, vocab), np.float32)
    logits = np.round(rng.standard_normal((rows, vocab)) * 2) / 2  # "coarse": few distinct values
    logits[:, rng.permutation(vocab)[: vocab // 3]] = -np.inf
    return logits.astype(np.float32)


@pytest.mark.parametrize("kind", ["bf16", "long_run", "all_equal", "coarse"])
@pytest.mark.parametrize("k", [1, 7, 50, 512])
def test_ranking_is_logit_desc_then_id_asc(kind, k):
    rng = np.random.default_rng(k)
    logits = _tied_logits(kind, 3, 3000, rng)
    values, ids = ranked_candidates(torch.from_numpy(logits), k)
    expected = _expected(logits, k)
    finite = np.take_along_axis(logits, expected, 1) > -np.inf  # order among -inf is irrelevant
    np.testing.assert_array_equal(ids.numpy()[finite], expected[finite])
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(logits, expected, 1))


@pytest.mark.parametrize("kind", ["bf16", "long_run", "coarse"])
def test_mask_is_the_reference_support_under_ties(kind):
    rng = np.random.default_rng(7)
    logits = _tied_logits(kind, 4, 3000, rng)
    top_k, top_p, temperature = np.array([1, 20, 100, 512]), np.float32(0.9), np.float32(0.8)
    batch = SamplingBatch(
        logits=torch.from_numpy(logits), temperature=torch.full((4,), float(temperature)),
        top_k=torch.from_numpy(top_k), top_p=torch.full((4,), float(top_p)), min_p=torch.zeros(4),
        seed=torch.arange(4, dtype=torch.int64), want_mask=torch.ones(4, dtype=torch.bool),
    )
    result = sample(batch, mask_width=512)
    checked = 0
    for row in range(4):
        ref = reference_row(logits[row], temperature, int(top_k[row]), top_p)
        if ref.support_min != ref.support_max:  # a top-p boundary within float tolerance
            continue
        checked += 1
        length = int(result.mask_len[row])
        np.testing.assert_array_equal(result.mask_ids[row, :length].numpy(), ref.support)
        assert int(result.token_ids[row]) in set(ref.support.tolist())
    assert checked >= 3, "too few rows with an unambiguous reference support to test anything"
