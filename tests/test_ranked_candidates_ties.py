"""The top-k ranking under ties (the paths bench-driven optimisations touched), against numpy:
the first k ids of lexsort((id, -logit)) and the float64 reference support."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reference import reference_row
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample
from triton_sampling_mask.sampling.selection import ranked_candidates


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
    batch = SamplingBatch.from_arrays(
        logits=torch.from_numpy(logits),
        temperature=torch.full((4,), float(temperature)),
        top_k=torch.from_numpy(top_k),
        top_p=torch.full((4,), float(top_p)),
        min_p=torch.zeros(4),
        seed=torch.arange(4, dtype=torch.int64),
        want_mask=torch.ones(4, dtype=torch.bool),
    )
    result = sample(batch, mask_width=512)
    checked = 0
    for row in range(4):
        ref = reference_row(logits[row], temperature, int(top_k[row]), top_p)
        if ref.support_min != ref.support_max:  # a top-p boundary within float tolerance
            continue
        checked += 1
        length = int(result.sampling_mask_len[row])
        np.testing.assert_array_equal(result.sampling_mask[row, :length].numpy(), ref.support)
        assert int(result.output_ids[row]) in set(ref.support.tolist())
    assert checked >= 3, "too few rows with an unambiguous reference support to test anything"


def _selection_rows(vocab: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Rows for the CPU's threshold selection (V large next to k): three it settles (continuous,
    bf16 ties at the k-th place, -0.0 / 0.0 ties at the k-th place) and three it must hand to the
    top-k fallback: a run of equal logits at the k-th place far longer than the candidates, a row
    whose strided sample sees only its largest logits (too few reach the threshold), and a row of
    mostly banned tokens (the threshold is -inf, so every id reaches it)."""
    rows = np.empty((6, vocab), np.float32)
    rows[0] = rng.standard_normal(vocab) * 3
    rows[1] = torch.from_numpy(rng.standard_normal(vocab) * 3).bfloat16().float().numpy()
    rows[2] = rng.standard_normal(vocab) - 20
    rows[2, rng.permutation(vocab)[: k + 20]] = rng.choice([0.0, -0.0], k + 20)
    rows[2, rng.permutation(vocab)[: k // 2]] = 1.0
    rows[3] = rng.standard_normal(vocab) - 10
    rows[3, rng.permutation(vocab)[: k // 2]] = 0.0
    rows[3, rng.permutation(vocab)[:3000]] = -1.0  # the boundary run: the top-k fallback repairs it
    rows[4] = rng.standard_normal(vocab)
    rows[4, :: vocab // 2048] = 10 + rng.standard_normal(rows[4, :: vocab // 2048].size)
    rows[5] = -np.inf
    rows[5, rng.permutation(vocab)[: 4 * k]] = rng.integers(0, 3, 4 * k)
    return rows


def test_threshold_selection_is_exact_and_hands_the_rows_it_cannot_settle_to_top_k(monkeypatch):
    from triton_sampling_mask.sampling import selection

    vocab, k = 40000, 50
    logits = _selection_rows(vocab, k, np.random.default_rng(11))
    fallback_rows = []
    by_topk = selection._ranked_by_topk_cpu
    monkeypatch.setattr(
        selection, "_ranked_by_topk_cpu", lambda lg, kk: fallback_rows.append(lg.shape[0]) or by_topk(lg, kk)
    )
    values, ids = ranked_candidates(torch.from_numpy(logits), k)
    assert fallback_rows == [3], "rows 3, 4 and 5 (only they) go to the top-k fallback, as one group"
    expected = _expected(logits, k)
    finite = np.take_along_axis(logits, expected, 1) > -np.inf
    np.testing.assert_array_equal(ids.numpy()[finite], expected[finite])
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(logits, expected, 1))
    for row in range(logits.shape[0]):  # one row at a time: the B=1 form of the selection
        _, alone = ranked_candidates(torch.from_numpy(logits[row : row + 1]), k)
        np.testing.assert_array_equal(alone.numpy()[0][finite[row]], expected[row][finite[row]])
    assert fallback_rows == [3, 1, 1, 1]


@pytest.mark.parametrize("kind", ["bf16", "long_run", "coarse"])
def test_top_k_fetches_one_past_k_and_repairs_boundary_ties(monkeypatch, kind):
    # The top-k path alone (threshold selection off): k + 1 candidates, so a tie at the k-th place
    # must go through the repair, whose result the reference order checks.
    from triton_sampling_mask.sampling import selection

    monkeypatch.setattr(selection, "_THRESHOLD_MIN_RATIO", 10**9)
    repaired = []
    repair = selection._repair_boundary_ties_cpu
    monkeypatch.setattr(selection, "_repair_boundary_ties_cpu", lambda *a: repaired.append(a[3].size) or repair(*a))
    logits = _tied_logits(kind, 4, 3000, np.random.default_rng(3))
    k = 100
    _, ids = ranked_candidates(torch.from_numpy(logits), k)
    assert repaired and repaired[0] >= 1
    expected = _expected(logits, k)
    finite = np.take_along_axis(logits, expected, 1) > -np.inf
    np.testing.assert_array_equal(ids.numpy()[finite], expected[finite])


def _batch(logits: torch.Tensor, k: int, temperature: float = 0.8, top_p: float = 0.9) -> SamplingBatch:
    """Every row of `logits` with the same top_k, temperature and top_p, masks on, seeded by row."""
    rows = logits.shape[0]
    return SamplingBatch.from_arrays(
        logits=logits,
        temperature=np.full(rows, temperature, np.float32),
        top_k=np.full(rows, k),
        top_p=np.full(rows, top_p, np.float32),
        min_p=np.zeros(rows, np.float32),
        seed=np.arange(rows),
        want_mask=np.ones(rows, bool),
    )


def test_mask_is_the_reference_support_on_both_cpu_selection_paths():
    vocab, k = 40000, 50
    logits = _selection_rows(vocab, k, np.random.default_rng(12))
    rows = logits.shape[0]
    top_p, temperature = np.float32(0.9), np.float32(0.7)
    result = sample(_batch(torch.from_numpy(logits), k, temperature, top_p), mask_width=k)
    for row in range(rows):
        ref = reference_row(logits[row], temperature, k, top_p)
        assert ref.support_min == ref.support_max
        length = int(result.sampling_mask_len[row])
        np.testing.assert_array_equal(result.sampling_mask[row, :length].numpy(), ref.support)
        assert int(result.output_ids[row]) in set(ref.support.tolist())
        assert float(result.row_max[row]) == logits[row].max()


def test_row_max_of_broken_rows_is_their_amax():
    # Threshold selection never picks a NaN: the row max must still say NaN (the logits checks
    # refuse the row from it), and +inf / all -inf as `amax` gives them.
    logits = np.random.default_rng(1).standard_normal((6, 20000)).astype(np.float32)
    logits[0, 123] = np.nan
    logits[1, 7] = np.inf
    logits[2] = -np.inf
    logits[3, [5, 9]] = [np.nan, np.inf]
    logits[4, :100] = np.nan
    row_max = sample(_batch(torch.from_numpy(logits), 50), 64).host()["row_max"]
    np.testing.assert_array_equal(row_max, torch.from_numpy(logits).amax(dim=-1).numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_match_the_reference_as_the_conversion_buffer_is_reused(dtype):
    # bf16 / fp16 rows are converted to float32 into one reused per-thread buffer: shapes that
    # change from call to call (several row blocks, then a smaller vocabulary with ties, then the
    # first again) must each see only their own values.
    rng = np.random.default_rng(3)
    shapes = [(20, 151936, 64), (3, 3000, 512), (20, 151936, 64)]  # 20 rows of 151936: two row blocks
    for rows, vocab, k in shapes:
        logits = torch.from_numpy(rng.standard_normal((rows, vocab)) * 3).to(dtype)
        result = sample(_batch(logits, k), mask_width=512)
        exact = logits.double().numpy()
        for row in range(rows):
            ref = reference_row(exact[row], np.float32(0.8), k, np.float32(0.9))
            if ref.support_min != ref.support_max:  # a top-p boundary within float tolerance
                continue
            length = int(result.sampling_mask_len[row])
            np.testing.assert_array_equal(result.sampling_mask[row, :length].numpy(), ref.support)
            assert float(result.row_max[row]) == exact[row].max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_on_every_path_give_the_outputs_of_their_float32_values(dtype):
    # One row per path: a small top_k, top-p candidates first, a full sort (top_k above the
    # small-k bound) and the unranked whole-vocabulary draw; each reads the values as float32.
    logits = torch.from_numpy(np.random.default_rng(9).standard_normal((4, 6000)) * 3).to(dtype)
    arrays = dict(
        temperature=np.full(4, 0.8, np.float32),
        top_k=np.array([20, -1, 2000, -1]),
        top_p=np.array([0.9, 0.9, 0.9, 1.0], np.float32),
        min_p=np.zeros(4, np.float32),
        seed=np.arange(4),
        want_mask=np.array([True, False, True, False]),
    )
    half = sample(SamplingBatch.from_arrays(logits, **arrays), 64).host()
    single = sample(SamplingBatch.from_arrays(logits.float(), **arrays), 64).host()
    assert half.keys() == single.keys()
    for name, value in half.items():
        np.testing.assert_array_equal(value, single[name], err_msg=name)


class _LargeFloat32Allocations(TorchDispatchMode):
    """Names the ops that return a new float32 tensor of `min_elements` or more (not a view, not in
    place, no out=)."""

    def __init__(self, min_elements: int):
        super().__init__()
        self.min_elements, self.seen = min_elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A return without alias annotation is new memory (views, in-place and out= ops alias).
        fresh = all(r.alias_info is None for r in func._schema.returns)
        if fresh and isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= self.min_elements:
            self.seen.append(str(func))
        return out


def test_half_precision_path_allocates_no_float32_row_block_per_call():
    # A fresh float32 copy of each bf16 row block is 8 MiB, which allocators return to the OS at
    # once, so every call would pay its page faults. After the first call the conversions reuse one buffer.
    logits = torch.from_numpy(np.random.default_rng(5).standard_normal((40, 151936)) * 3).bfloat16()
    sample(_batch(logits, 512), mask_width=512)
    with _LargeFloat32Allocations(min_elements=151936 * 4) as counted:
        sample(_batch(logits, 512), mask_width=512)
    assert counted.seen == []
