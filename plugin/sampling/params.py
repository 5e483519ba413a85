"""Per-row sampling parameters: their wire names, dtypes and defaults, and the conventions that
turn them into what the sampler applies (one source of truth for each)."""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass, replace

import numpy as np

TOP_K_ALL = -1  # top_k value meaning "the whole vocabulary"


@dataclass(frozen=True)
class ParamSpec:
    """One optional per-row scalar input of both models: name, numpy dtype and default.

    Everything per parameter is built from `PARAM_SPECS`: the fields of `RowParams` and their
    defaults, the client's `SamplingParams`, the server's parsing and both clients' wire arrays.
    """

    name: str
    dtype: type
    default: object  # None: no default; the row carries `has_<name>` saying whether it was given

    @property
    def presence(self) -> str | None:
        """The RowParams field saying which rows carried this parameter (None: it has a default)."""
        return f"has_{self.name}" if self.default is None else None

    def filled(self, rows: int) -> np.ndarray:
        """`rows` values of this parameter as rows that did not carry it read it (0 without a default)."""
        return np.full(rows, 0 if self.default is None else self.default, self.dtype)


TEMPERATURE = ParamSpec("temperature", np.float32, 1.0)
TOP_K = ParamSpec("top_k", np.int32, TOP_K_ALL)
TOP_P = ParamSpec("top_p", np.float32, 1.0)
MIN_P = ParamSpec("min_p", np.float32, 0.0)
SEED = ParamSpec("seed", np.uint64, None)
RETURN_SAMPLING_MASK = ParamSpec("return_sampling_mask", np.bool_, False)

PARAM_SPECS = (TEMPERATURE, TOP_K, TOP_P, MIN_P, SEED, RETURN_SAMPLING_MASK)
# RowParams' fields: one per parameter, then a presence flag for each one without a default.
ROW_FIELDS = (*(spec.name for spec in PARAM_SPECS), *(spec.presence for spec in PARAM_SPECS if spec.presence))

LOGITS = "logits"


class _RowParamsMethods:
    """What RowParams does; its fields (one array per ROW_FIELDS entry) are made below."""

    @classmethod
    def defaults(cls, rows: int) -> RowParams:
        """Parameters of `rows` rows that carried no optional input."""
        presence = {spec.presence: np.zeros(rows, np.bool_) for spec in PARAM_SPECS if spec.presence}
        return cls(**{spec.name: spec.filled(rows) for spec in PARAM_SPECS}, **presence)

    @property
    def rows(self) -> int:
        return len(self.temperature)

    @classmethod
    def concatenate(cls, parts: list[RowParams]) -> RowParams:
        """Stack the rows of several requests, in order."""
        return cls(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in ROW_FIELDS})

    def take(self, rows: np.ndarray) -> RowParams:
        """The subset of rows selected by an index or boolean array."""
        return type(self)(**{f: getattr(self, f)[rows] for f in ROW_FIELDS})

    def with_seeds(self, fresh: np.ndarray) -> RowParams:
        """These rows, every one seeded: its own seed where it carried one, else `fresh` (uint64 [rows])."""
        return replace(self, seed=np.where(self.has_seed, self.seed, fresh), has_seed=np.ones(self.rows, np.bool_))

    def greedy_applied(self) -> RowParams:
        """These rows as the sampler reads them: a greedy row (temperature 0) samples with top_k 1 at
        temperature 1, so its log-probabilities are those of temperature 1 (SGLang's convention)."""
        if self.temperature.size and self.temperature.min() > 0:  # no greedy row (the common case: one call)
            return self
        greedy = self.temperature == 0
        if not greedy.any():
            return self
        return replace(
            self, temperature=np.where(greedy, np.float32(1), self.temperature), top_k=np.where(greedy, 1, self.top_k)
        )


RowParams = make_dataclass("RowParams", [(name, np.ndarray) for name in ROW_FIELDS], bases=(_RowParamsMethods,))
RowParams.__module__ = __name__
RowParams.__doc__ = """Sampling parameters for a batch of rows, one numpy array of shape [rows] per field:
    one per `PARAM_SPECS` entry, named as it (`params.temperature`, ...), in its dtype, and for a
    parameter without a default its presence flag (`has_seed[i]`: whether row i carried a seed;
    `seed[i]` is meaningless where it did not)."""


def effective_top_k(params: RowParams, vocab_size: int) -> np.ndarray:
    """The most ids each row's support can hold (int64): its top_k once greedy is applied (1 for a
    greedy row), at most V, and V for top_k -1."""
    return applied_top_k(params.greedy_applied().top_k, vocab_size)


def applied_top_k(top_k: np.ndarray, vocab_size: int) -> np.ndarray:
    """`effective_top_k` of rows whose greedy is already applied (`top_k` of
    `RowParams.greedy_applied`): at most V, and V for top_k -1 (int64)."""
    limited = np.minimum(top_k, vocab_size, dtype=np.int64)
    if limited.size and limited.min() <= TOP_K_ALL:  # a row may have top_k -1 (the whole vocabulary)
        limited[top_k == TOP_K_ALL] = vocab_size
    return limited


def min_p_bound(params: RowParams) -> np.ndarray:
    """The min_p rule as a bound on the logit (float64 [rows]): p >= min_p * p_max is
    exp((x - max) / T) >= min_p, that is x - max >= T * ln(min_p) (-inf for min_p 0).

    `params` are greedy applied (T > 0). Every path computes the bound here, on the host, and
    compares the exact float64 difference x - max with it, so the paths decide the rule alike,
    bit for bit; the bound is the real one to within float64 rounding (~1e-16 relative).
    """
    with np.errstate(divide="ignore"):  # ln 0 = -inf: min_p 0 keeps every token
        return params.temperature.astype(np.float64) * np.log(params.min_p.astype(np.float64))
