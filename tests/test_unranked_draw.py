"""The unranked draw (`epilogues.unranked_outputs`: rows with top_k -1, top_p >= 1 and no mask,
Gumbel-max over the whole vocabulary in float64) on the exact min_p boundary, against the exact
support (`exact_support_len`) and the reference noise (`reference_gumbel`).

The float64 reference's tolerance band cannot decide a token whose x - max is exactly the min_p
bound, so tests/test_sampler.py's reference draws skip such rows; here the rule is inclusive: the
token is kept and wins the draw under some seeds.
"""

from __future__ import annotations

import numpy as np
import pytest

from .reference import exact_support_len, reference_gumbel, reference_row
from .sampling import run_sampler
from .test_boundaries import min_p_on_the_float64_bound

SEEDS = np.arange(64) * 7919 + 3


def expected_draws(logits: np.ndarray, temperature: float, min_p: float, seeds: np.ndarray) -> np.ndarray:
    """Each seed's token: Gumbel-max over the exact support (top_k -1, top_p 1), in float64."""
    length = exact_support_len(logits, temperature, -1, 1.0, min_p)
    support = np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))[:length]
    top = logits.astype(np.float64).max()

    def score(seed: int, token: int) -> float:
        return (float(logits[token]) - top) / temperature + reference_gumbel(int(seed), int(token))

    return np.array([max(support, key=lambda token: score(seed, token)) for seed in seeds])


@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
def test_an_unranked_row_keeps_and_draws_the_token_exactly_on_the_min_p_bound(device_path):
    pair, min_p = min_p_on_the_float64_bound()  # [max, x]: x - max is the float64 bound, T = 1
    logits = np.full(40, -np.inf, np.float32)
    top, on_bound = 29, 6  # the max not first: a draw that loses x picks the max, not id 0
    logits[[top, on_bound]] = pair
    assert exact_support_len(logits, 1.0, -1, 1.0, min_p) == 2
    rows = np.repeat(logits[None], SEEDS.size, axis=0)
    out = run_sampler(
        rows, top_k=-1, top_p=1.0, min_p=min_p, seed=SEEDS, want_mask=False, fused=False, device_path=device_path
    )
    expected = expected_draws(logits, 1.0, min_p, SEEDS)
    assert {int(t) for t in expected} == {top, on_bound}  # both tokens win under some seeds
    np.testing.assert_array_equal(out["ids"], expected)
    # The log-prob is over the whole vocabulary (min_p does not renormalise it); no mask was asked.
    ref = reference_row(logits.astype(np.float64))
    np.testing.assert_allclose(out["logprobs"], ref.logprobs[expected], rtol=0, atol=1e-6)
    assert (out["mask_len"] == 0).all() and (out["mask"] == -1).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_an_unranked_row_with_min_p_draws_only_from_the_rows_kept_by_the_rule(temperature):
    # Finite logits well clear of the bound (which sits at T ln 0.2 from the max), -inf ones between.
    logits = np.array([-np.inf, 0.5, -3.0, 2.0, -np.inf, 1.9, -0.2, 2.0, -np.inf, 1.0], np.float32)
    min_p = 0.2
    rows = np.repeat(logits[None], SEEDS.size, axis=0)
    out = run_sampler(
        rows, temperature=temperature, top_k=-1, min_p=min_p, seed=SEEDS, want_mask=False, device_path="cpu"
    )
    expected = expected_draws(logits, temperature, min_p, SEEDS)
    assert len(set(expected.tolist())) >= 2
    np.testing.assert_array_equal(out["ids"], expected)
