"""A token's log-prob is computed in float64 and rounded once to float32, on every path.

With n logits tied at the max and the rest -inf, every normaliser sums exact ones (z = n exactly),
so the log-prob of any drawn token is -ln n, and the answer is float32(-ln n): a log taken in
float32 instead misses it by an ulp for such n (numpy's and torch's float32 logs are not
correctly rounded there), which a tolerance-based reference comparison cannot see.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from .reference import reference_row
from .sampling import run_sampler

# n whose float32 ln is not float32(ln n) in numpy: the log must be taken in float64.
TIES = [7, 37, 47, 217]
# (top_k, want_mask): a small top-k, a full sort (top_k -1 with a mask), the unranked draw.
GROUPS = [
    pytest.param(300, True, id="small-k"),
    pytest.param(-1, True, id="full-sort"),
    pytest.param(-1, False, id="unranked"),
]


def tied_rows(vocab: int = 400) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = np.full((len(TIES), vocab), -np.inf, np.float32)
    for row, n in enumerate(TIES):
        rows[row, rng.permutation(vocab)[:n]] = 1.25
    return rows


def test_numpys_float32_log_misses_these_ties():
    # The premise: otherwise the test below could not tell a float32 log from a float64 one.
    n = np.array(TIES)
    assert (np.log(n.astype(np.float32)) != np.log(n.astype(np.float64)).astype(np.float32)).all()


@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
@pytest.mark.parametrize(("top_k", "want_mask"), GROUPS)
def test_the_log_prob_of_a_token_among_n_ties_is_float32_of_minus_ln_n(device_path, top_k, want_mask):
    logits = tied_rows()
    out = run_sampler(
        logits,
        top_k=top_k,
        seed=np.arange(len(TIES)),
        want_mask=want_mask,
        mask_width=256,
        fused=False,
        device_path=device_path,
    )
    for row, n in enumerate(TIES):
        token = int(out["ids"][row])
        assert logits[row, token] == 1.25
        assert reference_row(logits[row]).logprobs[token] == pytest.approx(-math.log(n), abs=1e-12)
        assert out["logprobs"][row] == np.float32(-math.log(n)), (row, n)
        if want_mask:  # the support is every tie: the renormalised log-prob is -ln n as well
            assert out["mask_len"][row] == n
            assert out["mask_logprobs"][row] == np.float32(-math.log(n)), (row, n)
