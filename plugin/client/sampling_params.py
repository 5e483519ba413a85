"""Client-side sampling parameters, checked with the server's own rules before anything is sent.

`SamplingParams` holds one row's knobs. It is validated with plugin/sampling/validation.py (the same
functions the model runs), so a request the server would refuse for its parameters raises
`SamplingRequestError` here instead, with the server's message, before any network call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..sampling.params import MIN_P, RETURN_SAMPLING_MASK, SEED, TEMPERATURE, TOP_K, TOP_P, RowParams
from ..sampling.validation import MaskPolicy, SamplingRequestError, check_rows, first_error

# Admission rules that need no server knowledge: an "infinite" width leaves only mask_unbounded.
_UNKNOWN_WIDTH = np.iinfo(np.int64).max
_UNKNOWN_VOCAB = np.iinfo(np.int32).max


@dataclass(frozen=True)
class SamplingParams:
    """One row's sampling parameters (defaults are the server's; see params.py).

    Raises SamplingRequestError on construction when the values break a server rule that needs
    no server knowledge (ranges; a mask request without a finite top_k).
    """

    temperature: float = TEMPERATURE.default
    top_k: int = TOP_K.default
    top_p: float = TOP_P.default
    min_p: float = MIN_P.default
    seed: int | None = SEED.default
    return_sampling_mask: bool = RETURN_SAMPLING_MASK.default

    def __post_init__(self):
        if self.seed is not None and not 0 <= int(self.seed) < 2**64:
            raise SamplingRequestError("seed", f"seed must be an unsigned 64-bit integer, got {self.seed}")
        if not float(self.top_k).is_integer() or not -(2**31) <= int(self.top_k) < 2**31:
            raise SamplingRequestError("top_k", f"top_k must be a 32-bit integer, got {self.top_k}")
        check_rows_like_server(rows_to_params([self]))


def rows_to_params(rows: Sequence[SamplingParams]) -> RowParams:
    """The RowParams (one numpy array per field) of several rows, as the server would parse them."""
    params = RowParams.defaults(len(rows))
    for spec in (TEMPERATURE, TOP_K, TOP_P, MIN_P, RETURN_SAMPLING_MASK):
        setattr(params, spec.name, np.array([getattr(r, spec.name) for r in rows], dtype=spec.dtype))
    params.has_seed = np.array([r.seed is not None for r in rows], dtype=np.bool_)
    params.seed = np.array([r.seed or 0 for r in rows], dtype=SEED.dtype)
    return params


def check_rows_like_server(
    params: RowParams,
    vocab_size: int | None = None,
    policy: MaskPolicy | None = None,
    row_max: np.ndarray | None = None,
) -> None:
    """Raise SamplingRequestError for the first row the server would refuse, in the server's order.

    Without `policy` (the server's mask width and switches) only the rules that need no server
    knowledge run; with it and `vocab_size`, the over-width and deployment rules run too; with
    `row_max` (each row's largest logit) the logit rules as well.
    """
    policy = policy or MaskPolicy(mask_width=_UNKNOWN_WIDTH, width_source="the server's config.pbtxt")
    error = first_error(check_rows(params, row_max, vocab_size or _UNKNOWN_VOCAB, policy))
    if error is not None:
        raise error
