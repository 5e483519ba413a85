"""Independent float64 numpy brute force of the sampling semantics, for tests only.

It sorts the whole vocabulary with numpy (lexsort on (-logit, id)) and applies each rule to the
float64 probabilities, sharing no code with the torch sampler. `exact_support_len` decides the
rules exactly instead (Python decimals), for the boundary cases the float64 band cannot settle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, localcontext

import numpy as np


@dataclass
class ReferenceRow:
    order: np.ndarray  # every token id, most probable first, ties by lower id
    logprobs: np.ndarray  # float64 log-probabilities under softmax(logits / T), indexed by token id
    support_min: int  # support length when every boundary comparison is decided against the token
    support_max: int  # ... and for the token; equal unless a boundary lies within `tolerance`

    @property
    def support(self) -> np.ndarray:
        assert self.support_min == self.support_max, "ambiguous boundary"
        return self.order[: self.support_min]

    def renormalised_logprob(self, token: int, support_len: int) -> float:
        """log p(token) - log sum_{support} p."""
        support = self.order[:support_len]
        return float(self.logprobs[token] - np.logaddexp.reduce(self.logprobs[support]))


def reference_row(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, tolerance=1e-6) -> ReferenceRow:
    """The support of one row by the documented rules, computed in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    vocab = logits.size
    ids = np.arange(vocab)
    order = np.lexsort((ids, -logits))
    if temperature == 0:  # greedy: SGLang's top_k = 1 at temperature 1
        temperature, top_k = 1.0, 1
    scaled = logits / temperature
    finite = np.isfinite(scaled)
    shifted = np.where(finite, scaled - scaled[finite].max(), -np.inf)
    logprobs = shifted - np.log(np.exp(shifted).sum())
    sorted_p = np.exp(logprobs[order])
    k = vocab if top_k == -1 else min(top_k, vocab)
    rank = np.arange(vocab)

    def support_len(slack: float) -> int:
        keep = (rank < k) & np.isfinite(logits[order])
        if top_p < 1:
            keep &= (np.cumsum(sorted_p) - sorted_p) <= top_p + slack
        keep &= sorted_p >= min_p * sorted_p[0] - slack * sorted_p[0]
        # Every rule keeps a prefix; count the prefix, which also checks that property.
        return int(np.argmin(keep)) if not keep.all() else vocab

    return ReferenceRow(order, logprobs, support_len(-tolerance), support_len(tolerance))


def exact_support_len(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> int:
    """The support length by the documented rules, each boundary decided exactly: the float
    inputs are converted to decimals exactly and the rules evaluated at 80 digits, so a token
    whose mass before it equals top_p (logits tied at the max: p = 1/n exactly) is told apart
    from one a rounding ulp past it, and p / p_max = exp((x - max) / T) is compared with min_p
    far beyond any float's precision (it never equals min_p exactly: exp of a nonzero rational
    is irrational). Temperatures below 0 or NaN are not expected; 0 is greedy."""
    values = np.asarray(logits, dtype=np.float64)
    order = np.lexsort((np.arange(values.size), -values))
    if temperature == 0:  # greedy: SGLang's top_k = 1 at temperature 1
        temperature, top_k = 1.0, 1
    with localcontext() as context:
        context.prec = 80
        exact = [Decimal(float(v)) for v in values]
        finite = [v for v in exact if v.is_finite()]
        top = max(finite)
        t = Decimal(float(temperature))
        relative = [((v - top) / t).exp() if v.is_finite() else Decimal(0) for v in exact]  # p / p_max
        z = sum(relative)
        limit = values.size if top_k == -1 else min(top_k, values.size)
        before = Decimal(0)
        length = 0
        for rank, token in enumerate(order):
            if rank >= limit or not exact[token].is_finite():
                break
            if top_p < 1 and before / z > Decimal(float(top_p)):  # mass ranked strictly before <= top_p
                break
            if relative[token] < Decimal(float(min_p)):  # p >= min_p * p_max
                break
            before += relative[token]
            length += 1
        return length


# The seeded draw (docs/sampler.md, "Seeds"), in pure Python integers: SplitMix64's finaliser over
# (seed, token id) gives a 23-bit uniform u, the noise is g = -log(-log u), and the token is the
# argmax over the support of (x - max) / T + g; step s of a generation seeds with a second hash.
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_STEP_GAMMA = 0xD1B54A32D192ED03


def _splitmix_finaliser(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def reference_gumbel(noise_seed: int, token_id: int) -> float:
    """The noise of token `token_id` under `noise_seed` (a uint64), in float64."""
    state = _splitmix_finaliser(noise_seed ^ _GOLDEN_GAMMA)
    bits = _splitmix_finaliser((state + token_id * _GOLDEN_GAMMA) & _MASK64)
    u = ((bits >> 41) * 2 + 1) / 2**24
    return -math.log(-math.log(u))


def reference_noise_seed(seed: int, step: int | None) -> int:
    """The seed a token's noise uses: the request's for a sampler call (step None), else step s's."""
    if step is None:
        return seed
    state = _splitmix_finaliser(seed ^ _GOLDEN_GAMMA)
    return _splitmix_finaliser((state + (step + 1) * _STEP_GAMMA) & _MASK64)


def reference_draw(logits, temperature, top_k, top_p, min_p, noise_seed: int) -> int | None:
    """The token a row draws by the documented rules, in float64; None where a boundary of its
    support is too close to call (see `reference_row`)."""
    logits = np.asarray(logits, dtype=np.float64)
    ref = reference_row(logits, temperature, top_k, top_p, min_p)
    if ref.support_min != ref.support_max:
        return None
    scale = temperature or 1.0
    greedy = temperature == 0  # the argmax: no noise decides

    def score(token) -> float:
        return (logits[token] - logits.max()) / scale + (0.0 if greedy else reference_gumbel(noise_seed, int(token)))

    return int(max(ref.support, key=score))
