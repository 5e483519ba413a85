"""Prometheus custom metrics of both models (pb_utils.MetricFamily), a class per model.

Triton serves them on its metrics port beside its own `nv_*` metrics. A metric update is an IPC
round trip from the stub to the server, so every update is aggregated: the sampler records one
update per series an execute touched, the generate engine one per step (a gauge only when it
changes); never one per request or per row.

The sampler's series are labelled {model, version}. Its mask-length histogram is kept as
Prometheus' histogram series (`_bucket{le=...}`, `_sum`, `_count`, cumulative) built from
counters: a native HISTOGRAM only takes one observation per call. `histogram_quantile()` works on
these series as on any histogram. The generate model's series are labelled {model}; its
time-to-first-token histogram is native (one observation per request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

PREFIX = "sampler"
REQUESTS = f"{PREFIX}_requests_total"
MASK_ROWS = f"{PREFIX}_mask_rows_total"
MASK_LENGTH = f"{PREFIX}_mask_length"  # _bucket / _sum / _count
SAMPLER_DURATION = f"{PREFIX}_compute_duration_us"
SAMPLER_BATCHES = f"{PREFIX}_batches_total"

OK = "ok"
REJECTED = "rejected"
INTERNAL = "internal"


def mask_length_buckets(mask_width: int) -> list[int]:
    """Upper bounds of the mask-length buckets: powers of two below the width W, then W itself."""
    bounds, bound = [], 1
    while bound < mask_width:
        bounds.append(bound)
        bound *= 2
    return bounds + [mask_width]


class SamplerMetrics:
    """The sampler's counters for one model version; `record` takes one execute's aggregates."""

    def __init__(self, pb_utils, model: str, version: str, mask_width: int):
        kind = pb_utils.MetricFamily.COUNTER
        self._labels = {"model": model, "version": str(version)}
        # The families must outlive their metrics: the stub refuses updates once a family is gone.
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=description, kind=kind)
            for name, description in (
                (REQUESTS, "Sampler requests by outcome (ok, rejected, internal) and reason"),
                (MASK_ROWS, "Rows answered with a sampling mask"),
                (f"{MASK_LENGTH}_bucket", "Sampling-mask lengths per row: rows with length <= le (cumulative)"),
                (f"{MASK_LENGTH}_sum", "Sampling-mask lengths per row: sum of lengths"),
                (f"{MASK_LENGTH}_count", "Sampling-mask lengths per row: number of rows"),
                (SAMPLER_DURATION, "Microseconds spent in the batch sampler (row checks and sampling)"),
                (SAMPLER_BATCHES, "Batch-sampler calls (one per execute with parsed requests)"),
            )
        }
        self._requests: dict[tuple[str, str], object] = {}  # created on first use of (outcome, reason)
        self._mask_rows = self._metric(MASK_ROWS)
        self._bounds = np.array(mask_length_buckets(mask_width))
        self._buckets = [self._metric(f"{MASK_LENGTH}_bucket", le=str(b)) for b in self._bounds]
        self._buckets.append(self._metric(f"{MASK_LENGTH}_bucket", le="+Inf"))
        self._length_sum = self._metric(f"{MASK_LENGTH}_sum")
        self._length_count = self._metric(f"{MASK_LENGTH}_count")
        self._duration = self._metric(SAMPLER_DURATION)
        self._batches = self._metric(SAMPLER_BATCHES)

    def _metric(self, family: str, **labels):
        return self._families[family].Metric(labels={**self._labels, **labels})

    def record(
        self, outcomes: Iterable[tuple[str, str]], mask_lengths: np.ndarray, sampler_seconds: float | None
    ) -> None:
        """Count one execute: (outcome, reason) per request, the mask length of every mask row,
        and the sampler call's duration (None when nothing was sampled)."""
        for key, count in Counter(outcomes).items():
            if key not in self._requests:
                outcome, reason = key
                self._requests[key] = self._metric(REQUESTS, outcome=outcome, reason=reason)
            self._requests[key].increment(count)
        if mask_lengths.size:
            self._mask_rows.increment(mask_lengths.size)
            # Cumulative bucket counts, one vectorised pass; untouched buckets cost no IPC.
            below = np.searchsorted(np.sort(mask_lengths), self._bounds, side="right")
            for metric, count in zip(self._buckets, [*below.tolist(), mask_lengths.size]):
                if count:
                    metric.increment(count)
            self._length_sum.increment(float(mask_lengths.sum()))
            self._length_count.increment(mask_lengths.size)
        if sampler_seconds is not None:
            self._duration.increment(sampler_seconds * 1e6)
            self._batches.increment(1)


GENERATE_TOKENS = "generate_tokens_total"
GENERATE_CANCELLED = "generate_cancelled_total"
GENERATE_ACTIVE = "generate_active_sequences"
GENERATE_WAITING = "generate_waiting_requests"
GENERATE_KV_TOKENS = "generate_kv_tokens"
GENERATE_TTFT = "generate_time_to_first_token_seconds"
GENERATE_SPEC_DRAFTS = "generate_spec_drafts_total"
GENERATE_SPEC_DRAFTED = "generate_spec_drafted_tokens_total"
GENERATE_SPEC_ACCEPTED = "generate_spec_accepted_tokens_total"
# Time-to-first-token histogram bounds, seconds (from enqueue to the first sampled token).
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class GenerateMetrics:
    """The generate model's counters, gauges and time-to-first-token histogram; it observes the
    engine (`generated`, `first_token`, `occupancy`, `speculated`) and counts cancellations."""

    def __init__(self, pb_utils, model: str):
        kinds = pb_utils.MetricFamily
        counter, gauge, histogram = kinds.COUNTER, kinds.GAUGE, kinds.HISTOGRAM
        # The families must outlive their metrics: the stub refuses updates once a family is gone.
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=description, kind=kind)
            for name, description, kind in (
                (GENERATE_TOKENS, "Tokens generated by the generate model", counter),
                (GENERATE_CANCELLED, "Generate requests stopped by client cancellation", counter),
                (GENERATE_ACTIVE, "Requests in the running decode batch", gauge),
                (GENERATE_WAITING, "Requests queued for admission", gauge),
                (GENERATE_KV_TOKENS, "KV-cache positions held by active requests (prompt + generated)", gauge),
                (GENERATE_TTFT, "Seconds from enqueue to a request's first token", histogram),
                (GENERATE_SPEC_DRAFTS, "Sequence steps verified with drafted tokens (speculative decoding)", counter),
                (GENERATE_SPEC_DRAFTED, "Tokens drafted for verification (speculative decoding)", counter),
                (GENERATE_SPEC_ACCEPTED, "Drafted tokens accepted: those plain decoding sampled", counter),
            )
        }
        labels = {"model": model}
        self._tokens = self._families[GENERATE_TOKENS].Metric(labels=labels)
        self._cancelled = self._families[GENERATE_CANCELLED].Metric(labels=labels)
        self._gauges = [
            self._families[name].Metric(labels=labels)
            for name in (GENERATE_ACTIVE, GENERATE_WAITING, GENERATE_KV_TOKENS)
        ]
        self._last = [None] * len(self._gauges)
        self._ttft = self._families[GENERATE_TTFT].Metric(labels=labels, buckets=TTFT_BUCKETS)
        self._speculation = [
            self._families[name].Metric(labels=labels)
            for name in (GENERATE_SPEC_DRAFTS, GENERATE_SPEC_DRAFTED, GENERATE_SPEC_ACCEPTED)
        ]

    def generated(self, tokens: int) -> None:
        """Count the tokens of one engine step."""
        self._tokens.increment(tokens)

    def cancelled(self) -> None:
        """Count a request stopped by its client."""
        self._cancelled.increment(1)

    def first_token(self, seconds: float) -> None:
        """Observe a request's time from enqueue to its first token."""
        self._ttft.observe(seconds)

    def speculated(self, drafts: int, drafted: int, accepted: int) -> None:
        """Count one engine step's speculation: rows that drafted, tokens drafted, tokens accepted
        (accepted / drafted is the acceptance rate; 1 + accepted / drafts the tokens per draft)."""
        for metric, count in zip(self._speculation, (drafts, drafted, accepted)):
            if count:
                metric.increment(count)

    def occupancy(self, active: int, waiting: int, kv_tokens: int) -> None:
        """Set the gauges that changed since the last call."""
        for i, value in enumerate((active, waiting, kv_tokens)):
            if value != self._last[i]:
                self._gauges[i].set(value)
                self._last[i] = value
