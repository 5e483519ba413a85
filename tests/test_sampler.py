"""The torch sampler against the independent float64 numpy reference (tests/reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from scipy import stats

from .reference import reference_row
from .sampling import DEVICES, DISTRIBUTION_DRAWS, REFERENCE_EXAMPLES, run_sampler, sampling_cases, use_device


@pytest.fixture(autouse=True, params=DEVICES)
def sampler_device(request):
    """Every test here runs on each device in DEVICES (CUDA cases skip where there is none)."""
    use_device(request.param)
    yield request.param
    use_device("cpu")


TOLERANCE = 1e-6


def _reference(case, row):
    return reference_row(
        case["logits"][row],
        float(case["temperature"][row]),
        int(case["top_k"][row]),
        float(case["top_p"][row]),
        float(case["min_p"][row]),
        tolerance=TOLERANCE,
    )


@settings(max_examples=REFERENCE_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases())
def test_sampler_matches_float64_reference(case):
    out = run_sampler(**case, mask_width=100)
    for row in range(len(case["logits"])):
        ref = _reference(case, row)
        token = int(out["ids"][row])
        assert token in ref.order[: ref.support_max], "sampled id outside the support"
        assert out["logprobs"][row] == pytest.approx(ref.logprobs[token], rel=1e-5, abs=1e-4)
        length = int(out["mask_len"][row])
        support_logprobs = out["support_logprobs"][row]
        if not case["want_mask"][row]:
            assert length == 0 and (out["mask"][row] == -1).all() and out["mask_logprobs"][row] == 0
            assert np.isneginf(support_logprobs).all()
            continue
        assert ref.support_min <= length <= ref.support_max
        np.testing.assert_array_equal(out["mask"][row, :length], ref.order[:length])
        assert (out["mask"][row, length:] == -1).all()
        assert token in out["mask"][row, :length]
        renormalised = ref.renormalised_logprob(token, length)
        assert out["mask_logprobs"][row] == pytest.approx(renormalised, rel=1e-5, abs=1e-5)
        # Each mask id's log-probability over the same support: logsumexp 0, -inf padding, and
        # the sampled token's entry is sampling_logprobs itself.
        expected = [ref.renormalised_logprob(int(i), length) for i in out["mask"][row, :length]]
        np.testing.assert_allclose(support_logprobs[:length], expected, rtol=1e-5, atol=1e-5)
        assert np.isneginf(support_logprobs[length:]).all()
        assert support_logprobs[list(out["mask"][row, :length]).index(token)] == out["mask_logprobs"][row]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases())
def test_rows_are_independent_of_their_batch_and_of_the_mask_flag(case):
    together = run_sampler(**case, mask_width=100)
    for row in range(len(case["logits"])):
        alone = {k: (v[row : row + 1] if isinstance(v, np.ndarray) else v) for k, v in case.items()}
        single = run_sampler(**alone, mask_width=100)
        assert single["ids"][0] == together["ids"][row]
        np.testing.assert_array_equal(single["mask"][0], together["mask"][row])
        flipped = run_sampler(**{**alone, "want_mask": ~alone["want_mask"]}, mask_width=100)
        assert flipped["ids"][0] == together["ids"][row], "asking for the mask changed the token"


def test_worked_examples():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 2))
    out = run_sampler(logits, top_k=[3, 2], top_p=[1.0, 0.55], min_p=[0.6, 0.0], seed=[1, 2])
    for row in range(2):
        assert out["mask_len"][row] == 2
        np.testing.assert_array_equal(out["mask"][row, :2], [0, 1])
    token = out["ids"][0]
    assert out["mask_logprobs"][0] == pytest.approx(math.log([0.4, 0.3][token] / 0.7), abs=1e-6)


def test_ties_are_ranked_by_lower_id():
    out = run_sampler(np.zeros((1, 10)), top_k=4)
    np.testing.assert_array_equal(out["mask"][0, :4], [0, 1, 2, 3])


def test_boundary_ties_keep_the_lowest_ids_when_topk_would_not():
    # Many rows, each with a different number of candidates strictly above a tied boundary value.
    rng = np.random.default_rng(3)
    logits = rng.integers(0, 4, size=(6, 3000)).astype(np.float32)
    logits[np.arange(6), rng.integers(0, 3000, 6)] = 9.0
    out = run_sampler(logits, top_k=[1, 5, 17, 40, 64, 7], seed=np.arange(6), mask_width=64)
    for row, k in enumerate([1, 5, 17, 40, 64, 7]):
        expected = reference_row(logits[row], top_k=k).support
        np.testing.assert_array_equal(out["mask"][row, :k], expected)


def test_greedy_takes_the_lowest_argmax_with_a_singleton_mask():
    logits = np.array([[1.0, 5.0, 5.0, 2.0]])
    out = run_sampler(logits, temperature=0.0, top_k=-1, top_p=0.3, seed=7)
    assert out["ids"][0] == 1 and out["mask_len"][0] == 1 and out["mask"][0, 0] == 1
    assert out["mask_logprobs"][0] == 0.0
    ref = reference_row(logits[0], temperature=1.0)
    assert out["logprobs"][0] == pytest.approx(ref.logprobs[1], abs=1e-6)


def test_banned_tokens_never_enter_the_support():
    logits = np.array([[0.0, -np.inf, -np.inf, 1.0, -np.inf]])
    out = run_sampler(logits, top_k=5)
    assert out["mask_len"][0] == 2
    np.testing.assert_array_equal(out["mask"][0, :2], [3, 0])


def test_top_p_one_keeps_the_whole_tail():
    # With top_p == 1 no float round-off may drop tokens whose cumulative mass reaches 1.
    logits = np.concatenate([[40.0], np.full(30, -40.0)])[None]
    out = run_sampler(logits, top_k=31, top_p=1.0)
    assert out["mask_len"][0] == 31


def test_same_seed_same_token_and_different_seeds_differ():
    logits = np.random.default_rng(0).standard_normal((1, 500))
    first = [run_sampler(logits, top_k=200, seed=42)["ids"][0] for _ in range(3)]
    assert len(set(first)) == 1
    many = run_sampler(np.repeat(logits, 64, axis=0), top_k=200, seed=np.arange(64))["ids"]
    assert len(set(many.tolist())) > 20


@pytest.mark.parametrize(
    "params",
    [
        dict(top_k=4, top_p=0.9, temperature=0.7),  # top-k selection path
        dict(top_k=-1, top_p=0.8, temperature=1.3),  # full-sort path
        dict(top_k=-1, top_p=1.0, min_p=0.05, temperature=1.0),  # no-ranking path
    ],
)
def test_draws_follow_the_renormalised_distribution(params):
    logits = np.array([[2.0, 1.5, 1.5, 0.3, -0.5, -1.0, -2.0, -np.inf]], np.float32)
    draws = DISTRIBUTION_DRAWS
    out = run_sampler(np.repeat(logits, draws, axis=0), seed=np.arange(draws) * 7919 + 11, want_mask=False, **params)
    ref = reference_row(logits[0], **params)
    support = ref.support
    probs = np.exp(ref.logprobs[support] - np.logaddexp.reduce(ref.logprobs[support]))
    counts = np.array([(out["ids"] == token).sum() for token in support])
    assert counts.sum() == draws, "a draw fell outside the support"
    _, p_value = stats.chisquare(counts, probs * draws)
    assert p_value > 1e-4, (counts, probs * draws)


@pytest.mark.parametrize("top_p, expected", [(0.3001, 4), (0.2999, 3), (0.1001, 2), (0.0999, 1)])
def test_top_p_counts_the_mass_strictly_before_each_token(top_p, expected):
    out = run_sampler(np.zeros((1, 10)), top_k=10, top_p=top_p)
    assert out["mask_len"][0] == expected


@pytest.mark.parametrize("min_p, expected", [(0.4999, 2), (0.5001, 1)])
def test_min_p_is_relative_to_the_top_probability(min_p, expected):
    logits = np.log(np.array([[0.4, 0.2, 0.1, 0.05]]))  # p / p_max = 1, 0.5, 0.25, 0.125
    out = run_sampler(logits, top_k=4, min_p=min_p)
    assert out["mask_len"][0] == expected


def test_large_top_k_rows_are_ranked_apart_in_row_blocks():
    # 25 rows of V=100000 exceed one full-vocabulary row block (2**21 entries), and the batch
    # mixes small-k rows with rows whose top_k is above the small-k bound or unbounded.
    rng = np.random.default_rng(5)
    rows, vocab = 25, 100_000
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    top_k = np.where(np.arange(rows) % 3 == 0, 20, np.where(np.arange(rows) % 3 == 1, 5000, -1))
    top_p = np.full(rows, 0.3)
    out = run_sampler(logits, top_k=top_k, top_p=top_p, seed=np.arange(rows), want_mask=top_k == 20, mask_width=20)
    for row in range(rows):
        ref = reference_row(logits[row], top_k=int(top_k[row]), top_p=0.3, tolerance=TOLERANCE)
        assert int(out["ids"][row]) in ref.order[: ref.support_max]
        assert out["logprobs"][row] == pytest.approx(ref.logprobs[out["ids"][row]], abs=1e-4)
        if top_k[row] == 20:
            length = int(out["mask_len"][row])
            assert ref.support_min <= length <= ref.support_max
            np.testing.assert_array_equal(out["mask"][row, :length], ref.order[:length])
        alone = run_sampler(
            logits[row : row + 1], top_k=int(top_k[row]), top_p=0.3, seed=row, want_mask=False, mask_width=20
        )
        assert alone["ids"][0] == out["ids"][row], "a row's token depends on its batch-mates"


def test_top_p_without_top_k_ranks_candidates_first_and_falls_back_exactly(monkeypatch):
    from triton_sampling_mask.sampling import sampler

    vocab, rows = 20000, 6
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)  # peaked: candidates suffice
    logits[3:] = rng.standard_normal((3, vocab)).astype(np.float32) * 0.1  # flat: the support needs > 4096
    top_p = np.array([0.9, 0.5, 0.99, 0.9, 0.5, 0.99], np.float32)
    calls = []
    for name in ("ranked_candidates", "ranked_candidates_cpu"):  # the GPU ops' selection, the CPU's
        ranked = getattr(sampler, name)
        monkeypatch.setattr(
            sampler, name, lambda lg, k, *a, ranked=ranked: calls.append((lg.shape[0], k)) or ranked(lg, k, *a)
        )
    out = run_sampler(logits, temperature=0.7, top_p=top_p, seed=np.arange(rows), want_mask=False)
    assert calls[0] == (rows, sampler._TOP_P_CANDIDATES) and calls[1] == (3, vocab)  # only the flat rows sort fully
    for row in range(rows):
        ref = reference_row(logits[row], 0.7, -1, float(top_p[row]), 0.0, tolerance=TOLERANCE)
        assert int(out["ids"][row]) in ref.order[: ref.support_max]
        assert out["logprobs"][row] == pytest.approx(ref.logprobs[out["ids"][row]], abs=1e-4)
    monkeypatch.setattr(sampler, "_TOP_P_CANDIDATES", vocab)  # no candidates-first: the full sort
    full = run_sampler(logits, temperature=0.7, top_p=top_p, seed=np.arange(rows), want_mask=False)
    np.testing.assert_array_equal(out["ids"], full["ids"])
