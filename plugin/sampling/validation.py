"""Request rules shared by every model and the client: parameter ranges and mask admission.

Every rule is checked vectorised over the rows of a batch; a failing row yields one message that
names the offending field. The model turns a message into a per-request INVALID_ARG (HTTP 400 /
gRPC INVALID_ARGUMENT); the other requests of the batch are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .params import TOP_K_ALL, RowParams, effective_top_k

UNBOUNDED_MASK_MESSAGE = (
    "return_sampling_mask requires finite top_k; top_p-only sampling is valid but can return "
    "huge masks in the tail, blowing up metadata, so we need a safety cap."
)
SPECULATIVE_MASK_MESSAGE = "return_sampling_mask is not supported with speculative decoding."


def backend_mask_message(backend_name: str) -> str:
    """The rejection for mask requests on a sampling backend that builds no support."""
    return f"return_sampling_mask is not supported with the {backend_name} sampling backend."


class SamplingRequestError(ValueError):
    """A user error in a request: the model answers it with INVALID_ARG, naming `field`."""

    def __init__(self, field: str, message: str, reason: str | None = None):
        super().__init__(message)
        self.field = field
        self.message = message
        self.reason = reason or f"invalid_{field}"  # the metrics label


class Rejection(NamedTuple):
    """Why a row is refused: a short `reason` label (for metrics), the field to fix, the message."""

    reason: str
    field: str
    message: str


NGRAM = "ngram"
# The speculative_algorithm values the generate engine drafts and verifies itself (its tokens and
# masks are plain decoding's), so the generate model and its client admit masks under them.
SPECULATIVE_ALGORITHMS = frozenset({NGRAM})


@dataclass(frozen=True)
class MaskPolicy:
    """What a deployment allows for mask requests (read from the model's config.pbtxt)."""

    mask_width: int
    width_source: str  # where the width is set, quoted in the over-width message
    speculative_algorithm: str = "none"
    backend_name: str = "torch"
    backend_builds_support: bool = True
    # Speculative algorithms this model verifies exactly (its tokens and masks are those of plain
    # decoding): only the generate engine's own drafters; the sampler model cannot know.
    exact_speculative: frozenset[str] = frozenset()

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm.strip().lower() not in ("", "none")

    @property
    def refuses_speculative_masks(self) -> bool:
        """Speculative decoding is on and not one this model verifies exactly: masks are refused."""
        return self.speculative and self.speculative_algorithm.strip().lower() not in self.exact_speculative


# top_k is INT32 on the wire, and Triton 2.51's HTTP JSON parser wraps larger integers before the model
# sees them (docs/upstream-issues.md, "JSON integers wrap"): 2**31 arrives as -2**31. A negative
# top_k below -1 says so, since the value sent cannot be recovered here.
_WRAPPED_TOP_K = (
    " (top_k is a 32-bit integer: over HTTP JSON, a value of 2**31 or more arrives wrapped to a negative one; "
    "the largest top_k is 2147483647)"
)


def check_scalar_ranges(params: RowParams) -> np.ndarray:
    """Per-row Rejection (or None) for parameters outside their documented ranges."""
    t, k, p, mp = params.temperature, params.top_k, params.top_p, params.min_p
    with np.errstate(invalid="ignore"):
        rules = [
            (
                "temperature",
                ~np.isfinite(t) | (t < 0),
                lambda i: f"temperature must be a finite number >= 0 (0 means greedy), got {t[i]}",
            ),
            (
                "top_k",
                (k == 0) | (k < TOP_K_ALL),
                lambda i: (
                    f"top_k must be -1 (whole vocabulary) or >= 1, got {k[i]}"
                    + (_WRAPPED_TOP_K if k[i] < TOP_K_ALL else "")
                ),
            ),
            ("top_p", ~(p > 0) | ~(p <= 1), lambda i: f"top_p must be in (0, 1], got {p[i]}"),
            ("min_p", ~(mp >= 0) | ~(mp < 1), lambda i: f"min_p must be in [0, 1), got {mp[i]}"),
        ]
    return _first_failure(params.rows, rules)


def check_mask_admission(params: RowParams, vocab_size: int, policy: MaskPolicy) -> np.ndarray:
    """Per-row Rejection (or None) for mask requests this deployment must refuse."""
    wants = params.return_sampling_mask.astype(bool)
    applied = params.greedy_applied()  # greedy rows sample with top_k 1: bounded whatever top_k says
    k_eff = effective_top_k(applied, vocab_size)
    rules = [
        ("mask_unbounded", wants & (applied.top_k == TOP_K_ALL), lambda i: UNBOUNDED_MASK_MESSAGE),
        (
            "mask_over_width",
            wants & (k_eff > policy.mask_width),
            lambda i: (
                f"return_sampling_mask with top_k={params.top_k[i]} can return up to {k_eff[i]} ids, "
                f"more than the sampling-mask width W={policy.mask_width}; lower top_k to at most "
                f"{policy.mask_width} or raise W ({policy.width_source})"
            ),
        ),
        ("mask_speculative", wants & policy.refuses_speculative_masks, lambda i: SPECULATIVE_MASK_MESSAGE),
        (
            "mask_backend",
            wants & (not policy.backend_builds_support),
            lambda i: backend_mask_message(policy.backend_name),
        ),
    ]
    return _first_failure(params.rows, rules)


def check_logit_rows(row_max: np.ndarray) -> np.ndarray:
    """Per-row Rejection (or None) from each row's maximum logit (NaN propagates through max)."""
    rules = [
        ("logits_nan", np.isnan(row_max), lambda i: "logits must not contain NaN"),
        ("logits_inf", row_max == np.inf, lambda i: "logits must not contain +inf"),
        (
            "logits_all_neg_inf",
            row_max == -np.inf,
            lambda i: "logits must have at least one finite value (every entry is -inf)",
        ),
    ]
    return _first_failure(len(row_max), rules)


def check_rows(params: RowParams, row_max: np.ndarray | None, vocab_size: int, policy: MaskPolicy) -> np.ndarray:
    """All row rules in order (ranges, mask admission, logits); per-row Rejection or None.

    `row_max` is each row's largest logit; None skips the logit rules (no logits known yet).
    """
    errors = check_scalar_ranges(params)
    ok = _is_none(errors)
    if ok.any():
        # Admission assumes sane ranges, so only rows that passed them are checked further.
        errors[ok] = check_mask_admission(params.take(ok), vocab_size, policy)
    ok = _is_none(errors)
    if row_max is not None and ok.any():
        errors[ok] = check_logit_rows(row_max[ok])
    return errors


def first_error(errors: np.ndarray) -> SamplingRequestError | None:
    """One request's per-row Rejections as the error it is answered with: its first refused row,
    named "(row N)" when the request has several rows; None when every row passed."""
    failed = np.flatnonzero(~_is_none(errors))
    if failed.size == 0:
        return None
    row = int(failed[0])
    rejection = errors[row]
    message = rejection.message if len(errors) == 1 else f"{rejection.message} (row {row})"
    return SamplingRequestError(rejection.field, message, reason=rejection.reason)


def check_vocab_size(vocab_size: int, max_vocab_size: int) -> None:
    """Raise for an empty vocabulary or one above the deployment's `max_vocab_size`."""
    if vocab_size < 1:
        raise SamplingRequestError("logits", "logits must have a non-empty vocabulary dimension, got 0 entries")
    if vocab_size > max_vocab_size:
        raise SamplingRequestError(
            "logits", f"logits vocabulary size {vocab_size} exceeds max_vocab_size={max_vocab_size}"
        )


def _first_failure(rows: int, rules) -> np.ndarray:
    """Apply (reason, bad_mask, message_fn) rules in order; a row keeps its first Rejection."""
    errors = np.full(rows, None, dtype=object)
    for reason, bad, message in rules:
        fresh = np.flatnonzero(np.broadcast_to(bad, (rows,)) & _is_none(errors))
        for i in fresh:  # error path only: valid rows never enter this loop
            errors[i] = Rejection(reason, _REASON_FIELDS.get(reason, reason), message(i))
    return errors


# The field each rule's user must change (rules named after their field map to themselves).
_REASON_FIELDS = {
    "mask_unbounded": "top_k",
    "mask_over_width": "top_k",
    "mask_speculative": "return_sampling_mask",
    "mask_backend": "return_sampling_mask",
    "logits_nan": "logits",
    "logits_inf": "logits",
    "logits_all_neg_inf": "logits",
}


def _is_none(errors: np.ndarray) -> np.ndarray:
    return np.equal(errors, None).astype(bool)
