"""The GPU path's torch branches, run on CPU tensors (`device_path="gpu"`): the margin top-k and
its boundary tie repair, the top-p candidates-first ranking and the torch epilogue, on tie-heavy
rows (integer-valued logits, signed zeros, runs of equal logits across the top-k boundary,
bf16-rounded values) against lexsort and the exact reference. tests/test_sampler.py runs the
same branches through its reference tests too (its `gpu-ops-on-cpu` cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triton_sampling_mask.sampling import sampler, selection
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample
from triton_sampling_mask.sampling.selection import candidate_count, ranked_candidates

from .reference import exact_support_len, reference_row

KINDS = ["long_run", "all_equal", "integer", "signed_zeros", "bf16"]


def tied_logits(kind: str, rows: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of one tie-heavy kind, float32."""
    if kind == "long_run":  # a run of equal logits far longer than the margin past k
        logits = rng.standard_normal((rows, vocab)).astype(np.float32) - 10
        logits[:, rng.permutation(vocab)[: vocab // 2]] = 0.0
        logits[:, rng.permutation(vocab)[:5]] = 1.0
        return logits
    if kind == "all_equal":
        return np.full((rows, vocab), 2.0, np.float32)
    if kind == "integer":
        return rng.integers(-2, 2, (rows, vocab)).astype(np.float32)
    if kind == "signed_zeros":  # -0.0 and 0.0 are one value; a few ones above them
        logits = np.where(rng.random((rows, vocab)) < 0.5, -0.0, 0.0).astype(np.float32)
        logits[:, rng.permutation(vocab)[:3]] = 1.0
        return logits
    return torch.from_numpy(rng.standard_normal((rows, vocab)) * 3).bfloat16().float().numpy()


def lexsort_ids(logits: np.ndarray, k: int) -> np.ndarray:
    return np.stack([np.lexsort((np.arange(row.size), -row.astype(np.float64)))[:k] for row in logits])


@pytest.fixture
def repairs(monkeypatch):
    """The row counts `_repair_boundary_ties` is called with, call by call."""
    calls = []
    repair = selection._repair_boundary_ties
    monkeypatch.setattr(
        selection,
        "_repair_boundary_ties",
        lambda lg, v, i, over: calls.append(int(over.sum())) or repair(lg, v, i, over),
    )
    return calls


@st.composite
def tie_heavy_rows(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(2, 400))
    values = draw(st.sampled_from([[0.0, -0.0, 1.0], [-1.0, 0.0, 1.0, 2.0], [3.0], [0.0, -np.inf, 1.0]]))
    weights = draw(st.lists(st.integers(1, 20), min_size=len(values), max_size=len(values)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = rng.choice(np.array(values, np.float32), size=(rows, vocab), p=np.array(weights) / sum(weights))
    if draw(st.booleans()):  # bf16-rounded noise on some entries
        noise = torch.from_numpy(rng.standard_normal((rows, vocab))).bfloat16().float().numpy()
        logits = np.where(rng.random((rows, vocab)) < 0.3, noise, logits).astype(np.float32)
    return logits, draw(st.integers(1, vocab - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tie_heavy_rows())
def test_margin_top_k_ranks_like_lexsort(case):
    logits, k = case
    values, ids = ranked_candidates(torch.from_numpy(logits), k, device_path="gpu")
    expected = lexsort_ids(logits, k)
    finite = np.take_along_axis(logits, expected, 1) > -np.inf  # order among -inf is irrelevant
    np.testing.assert_array_equal(ids.numpy()[finite], expected[finite])
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(logits, expected, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_boundary_repair_runs_and_ranks_like_lexsort(repairs, kind):
    vocab, top_k = 3000, np.array([1, 7, 50, 512])
    logits = tied_logits(kind, 4, vocab, np.random.default_rng(11))
    for k in top_k:
        _, ids = ranked_candidates(torch.from_numpy(logits), int(k), device_path="gpu")
        np.testing.assert_array_equal(ids.numpy(), lexsort_ids(logits, int(k)))
    if kind != "bf16":  # bf16 rows hold runs too short to pass the margin: nothing to repair
        assert sum(repairs) >= 4, f"the repair ran on {repairs} rows: these rows do not test it"


def batch_of(logits, temperature, top_k, top_p, want_mask=True, min_p=0.0) -> SamplingBatch:
    rows = logits.shape[0]
    column = lambda value, dtype: np.broadcast_to(np.asarray(value), (rows,)).astype(dtype)  # noqa: E731
    return SamplingBatch.from_arrays(
        torch.from_numpy(logits),
        column(temperature, np.float32),
        column(top_k, np.int64),
        column(top_p, np.float32),
        column(min_p, np.float32),
        np.arange(rows),
        column(want_mask, bool),
    )


def check_against_exact(result, logits, temperature, top_k, top_p, mask_width):
    """Every row's mask is the exact support (cut at W), its token in it, its log-prob the reference's."""
    host = result.host()
    for row in range(logits.shape[0]):
        length = exact_support_len(logits[row], temperature, int(top_k[row]), float(top_p[row]))
        order = np.lexsort((np.arange(logits.shape[1]), -logits[row].astype(np.float64)))
        assert host["sampling_mask_len"][row] == min(length, mask_width), row
        np.testing.assert_array_equal(
            host["sampling_mask"][row, : min(length, mask_width)], order[:mask_width][:length]
        )
        token = int(host["output_ids"][row])
        assert token in order[:length]
        ref = reference_row(logits[row], temperature, int(top_k[row]), float(top_p[row]))
        assert host["output_logprobs"][row] == pytest.approx(ref.logprobs[token], abs=1e-5)
        assert host["sampling_logprobs"][row] == pytest.approx(ref.renormalised_logprob(token, length), abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_epilogue_after_the_repair_gives_the_exact_support(repairs, kind):
    vocab = 3000
    logits = tied_logits(kind, 6, vocab, np.random.default_rng(5))
    top_k = np.array([1, 7, 50, 512, 2000, 40])  # 2000: above the small-k bound, the full sort
    top_p = np.array([1.0, 0.5, 0.9, 0.25, 0.5, 1.0], np.float32)
    result = sample(batch_of(logits, 0.8, top_k, top_p), mask_width=512, fused=False, device_path="gpu")
    check_against_exact(result, logits, 0.8, top_k, top_p, 512)
    if kind != "bf16":
        assert repairs, "the repair did not run: these rows do not test it"


@pytest.mark.parametrize("kind", KINDS)
def test_top_p_rows_rank_candidates_first_and_fall_back_on_the_gpu_path(monkeypatch, repairs, kind):
    # top_k -1 with top_p < 1: the candidates first (64 here, and a small-k bound below them, so
    # the vocabulary can stay small), then a full sort for the rows whose support fills them.
    monkeypatch.setattr(sampler, "_TOP_P_CANDIDATES", 64)
    monkeypatch.setattr(sampler, "_SMALL_TOP_K", 32)
    ranked_calls = []
    ranked = sampler.ranked_candidates
    monkeypatch.setattr(
        sampler, "ranked_candidates", lambda lg, k, *a: ranked_calls.append((lg.shape[0], k)) or ranked(lg, k, *a)
    )
    vocab = 600
    logits = tied_logits(kind, 4, vocab, np.random.default_rng(9))
    logits[0, :] = np.where(np.arange(vocab) < 2, 5.0, logits[0])  # peaked: the candidates suffice
    top_p = np.array([0.5, 0.75, 0.9, 0.2], np.float32)
    top_k = np.full(4, -1)
    result = sample(batch_of(logits, 1.0, top_k, top_p, want_mask=False), mask_width=8, fused=False, device_path="gpu")
    host = result.host()
    assert ranked_calls[0] == (4, 64)
    fell_back = [rows for rows, k in ranked_calls[1:] if k == vocab]
    for row in range(4):
        length = exact_support_len(logits[row], 1.0, -1, float(top_p[row]))
        order = np.lexsort((np.arange(vocab), -logits[row].astype(np.float64)))
        assert int(host["output_ids"][row]) in order[:length]
    if kind in ("long_run", "all_equal", "signed_zeros"):  # flat rows: the support passes 64 candidates
        assert fell_back, ranked_calls
        assert repairs, "the repair did not run on the candidates"
    assert candidate_count(64, vocab) < vocab
