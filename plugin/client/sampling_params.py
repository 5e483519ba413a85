"""Client-side sampling parameters, checked with the server's own rules before anything is sent.

`SamplingParams` holds one row's knobs. It is validated with plugin/sampling/validation.py (the same
functions the model runs), so a request the server would refuse for its parameters raises
`SamplingRequestError` here instead, with the server's message, before any network call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field, make_dataclass

import numpy as np

from ..sampling.params import PARAM_SPECS, ParamSpec, RowParams
from ..sampling.validation import MaskPolicy, SamplingRequestError, check_rows, first_error

# Admission rules that need no server knowledge: an "infinite" width leaves only mask_unbounded.
_UNKNOWN_WIDTH = np.iinfo(np.int64).max
_UNKNOWN_VOCAB = np.iinfo(np.int32).max
# The Python type a parameter of each numpy dtype kind takes.
_PYTHON_TYPES = {"b": bool, "i": int, "u": int, "f": float}


def _python_type(spec: ParamSpec) -> type:
    kind = _PYTHON_TYPES[np.dtype(spec.dtype).kind]
    return kind | None if spec.default is None else kind


def _check_integer(spec: ParamSpec, value) -> None:
    """An integer parameter must be a whole number its wire dtype holds (a cast would wrap it)."""
    limits = np.iinfo(spec.dtype)
    if not float(value).is_integer() or not limits.min <= int(value) <= limits.max:
        raise SamplingRequestError(
            spec.name,
            f"{spec.name} must be an integer in [{limits.min}, {limits.max}] ({np.dtype(spec.dtype).name}), got {value}",
        )


class _SamplingParamsChecks:
    """What SamplingParams does on construction; its fields are made below from PARAM_SPECS."""

    def __post_init__(self):
        for spec in PARAM_SPECS:
            value = getattr(self, spec.name)
            if value is not None and np.dtype(spec.dtype).kind in "iu":
                _check_integer(spec, value)
        check_rows_like_server(rows_to_params([self]))


SamplingParams = make_dataclass(
    "SamplingParams",
    [(spec.name, _python_type(spec), field(default=spec.default)) for spec in PARAM_SPECS],
    bases=(_SamplingParamsChecks,),
    frozen=True,
)
SamplingParams.__module__ = __name__
SamplingParams.__doc__ = """One row's sampling parameters: one keyword per `sampling.params.PARAM_SPECS` entry,
    with the server's default, typed by the entry's dtype.

    Raises SamplingRequestError on construction when the values break a server rule that needs
    no server knowledge (ranges; a mask request without a finite top_k)."""


def rows_to_params(rows: Sequence[SamplingParams]) -> RowParams:
    """The RowParams (one numpy array per field) of several rows, as the server would parse them."""
    arrays = {}
    for spec in PARAM_SPECS:
        values = [getattr(row, spec.name) for row in rows]
        if spec.presence:  # no default: 0 where absent, and the flag says which rows carried it
            arrays[spec.presence] = np.array([v is not None for v in values], dtype=np.bool_)
            values = [0 if v is None else v for v in values]
        arrays[spec.name] = np.array(values, dtype=spec.dtype)
    return RowParams(**arrays)


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
