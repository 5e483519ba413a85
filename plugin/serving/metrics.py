"""Prometheus custom metrics of both models (pb_utils.MetricFamily), a class per model.

Triton serves them on its metrics port beside its own `nv_*` metrics. A metric update is an IPC
round trip from the stub to the server, so every update is aggregated: the sampler records one
update per series an execute touched, the generate engine one per counter per step (a gauge
only when it changes, its histograms at most every `FLUSH_INTERVAL_S`), sent from a thread of
its own so that the engine's loop never waits for one; never one per request, row or token.

Every histogram is kept as Prometheus' histogram series (`_bucket{le=...}`, `_sum`, `_count`,
cumulative) built from counters (`CountedHistogram`): a native HISTOGRAM only takes one
observation per call. `histogram_quantile()` works on these series as on any histogram. The
sampler's series are labelled {model, version}, the generate model's {model}. docs/metrics.md
lists them beside vLLM's and Triton's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

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


def histogram_families(pb_utils, name: str, description: str) -> dict:
    """The three counter families (`_bucket`, `_sum`, `_count`) of a histogram kept as counters."""
    counter = pb_utils.MetricFamily.COUNTER
    return {
        f"{name}_bucket": pb_utils.MetricFamily(
            name=f"{name}_bucket", description=f"{description}: observations <= le (cumulative)", kind=counter
        ),
        f"{name}_sum": pb_utils.MetricFamily(name=f"{name}_sum", description=f"{description}: sum", kind=counter),
        f"{name}_count": pb_utils.MetricFamily(
            name=f"{name}_count", description=f"{description}: observations", kind=counter
        ),
    }


class CountedHistogram:
    """A Prometheus histogram kept as counters, fed whole arrays: `observe` bins them in one
    vectorised pass into local counts, `flush` sends what changed (one update per touched series).
    A native HISTOGRAM would cost an IPC round trip per observation. Observations must be >= 0:
    `_sum` is a counter (Triton refuses to decrease one, and `rate()` would read a decrease as a
    reset)."""

    def __init__(self, families: dict, name: str, labels: dict, bounds):
        self._bounds = np.asarray(bounds, dtype=np.float64)
        bucket = families[f"{name}_bucket"]
        self._buckets = [bucket.Metric(labels={**labels, "le": _bound_label(b)}) for b in bounds]
        self._buckets.append(bucket.Metric(labels={**labels, "le": "+Inf"}))
        self._sum = families[f"{name}_sum"].Metric(labels=labels)
        self._count = families[f"{name}_count"].Metric(labels=labels)
        self._pending = np.zeros(len(self._buckets), np.int64)  # cumulative, +Inf last
        self._pending_sum = 0.0

    def observe(self, values: np.ndarray) -> None:
        """Add every value of `values` (any shape) to the local counts."""
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.size:
            self._pending[:-1] += np.searchsorted(np.sort(values), self._bounds, side="right")
            self._pending[-1] += values.size
            self._pending_sum += float(values.sum())

    def flush(self) -> None:
        """Send the counts observed since the last flush (nothing when there were none)."""
        self.send(self.take())

    def take(self) -> tuple[list[int], float] | None:
        """The counts observed since the last call (None when there were none), cleared here:
        what `send` sends, taken without an IPC so that another thread may send it."""
        if not self._pending[-1]:
            return None
        counts, total = self._pending.tolist(), self._pending_sum
        self._pending[:] = 0
        self._pending_sum = 0.0
        return counts, total

    def send(self, taken: tuple[list[int], float] | None) -> None:
        """Send what `take` returned: one update per touched series."""
        if taken is None:
            return
        counts, total = taken
        for metric, count in zip(self._buckets, counts):
            if count:
                metric.increment(count)
        if total:
            self._sum.increment(total)
        self._count.increment(counts[-1])


def _bound_label(bound) -> str:
    """The `le` label of a bucket bound as Prometheus clients write it (1 -> "1", 0.5 -> "0.5")."""
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


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
                (SAMPLER_DURATION, "Microseconds spent in the batch sampler (row checks and sampling)"),
                (SAMPLER_BATCHES, "Batch-sampler calls (one per execute with parsed requests)"),
            )
        }
        self._families.update(histogram_families(pb_utils, MASK_LENGTH, "Sampling-mask lengths per row"))
        self._requests: dict[tuple[str, str], object] = {}  # created on first use of (outcome, reason)
        self._mask_rows = self._metric(MASK_ROWS)
        self._lengths = CountedHistogram(self._families, MASK_LENGTH, self._labels, mask_length_buckets(mask_width))
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
            self._lengths.observe(mask_lengths)
            self._lengths.flush()
        if sampler_seconds is not None:
            self._duration.increment(sampler_seconds * 1e6)
            self._batches.increment(1)


# The generate model's series: vLLM's names (`vllm:<name>`) under our prefix where the meaning is
# the same (docs/metrics.md has the table).
GENERATE_TOKENS = "generate_tokens_total"
GENERATE_PROMPT_TOKENS = "generate_prompt_tokens_total"
GENERATE_SUCCESS = "generate_request_success_total"  # {finished_reason}
GENERATE_CANCELLED = "generate_cancelled_total"
GENERATE_REJECTED = "generate_requests_rejected_total"  # {reason}: INVALID (400) or CAPACITY (shed, 503)
INVALID, CAPACITY = "invalid", "capacity"
# Every request's end, as its client saw it: {kind, outcome}. Triton's nv_inference_request_success
# counts the model's own error answers as successes (docs/metrics.md), so this is where they show.
GENERATE_REQUESTS = "generate_requests_total"
KIND_GENERATION, KIND_CONTROL = "generation", "control"  # kind: a prompt, or a control request (weights, pause)
OK, CANCELLED, NOT_SENT = "ok", "cancelled", "not_sent"  # outcomes besides an error code's name
GENERATE_RUNNING = "generate_num_requests_running"
GENERATE_WAITING = "generate_num_requests_waiting"
GENERATE_KV_TOKENS = "generate_kv_tokens"
GENERATE_E2E = "generate_e2e_request_latency_seconds"  # histograms: _bucket / _sum / _count
GENERATE_QUEUE = "generate_request_queue_time_seconds"
GENERATE_TTFT = "generate_time_to_first_token_seconds"
GENERATE_ITL = "generate_inter_token_latency_seconds"
GENERATE_KEPT_MASS = "generate_neg_log_kept_mass"
GENERATE_SPEC_DRAFTS = "generate_spec_drafts_total"
GENERATE_SPEC_DRAFTED = "generate_spec_drafted_tokens_total"
GENERATE_SPEC_ACCEPTED = "generate_spec_accepted_tokens_total"

# Histogram bounds: vLLM's, seconds (the request-latency ones serve end-to-end and queue time).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0]
# -log(probability mass a mask kept), per sampled token: 0 when nothing was cut off, 0.105 when
# 10% was. Negated so that the histogram's _sum only grows.
KEPT_MASS_BUCKETS = [0.0, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0]
# Histogram counts are sent at most this often while the engine is busy, and at once when it idles.
FLUSH_INTERVAL_S = 0.5


class GenerateMetrics:
    """The generate model's counters, gauges and histograms; it observes the engine (`generated`,
    `admitted`, `stepped`, `occupancy`, `speculated`) and counts cancellations and refusals.
    Everything the engine reports is kept locally: `occupancy`, called once after each step,
    hands one step's counts and changed gauges to `defer` (an update each), and what `admitted`
    and `stepped` observe (histograms as one array per engine step, prompt tokens, finishes)
    every `FLUSH_INTERVAL_S` and whenever the engine has nothing left to do. `defer(call, *args)`
    runs the updates on another thread, so the engine never waits for an IPC round trip; without
    it they run in the caller."""

    def __init__(self, pb_utils, model: str, clock=time.monotonic, defer: Callable[..., None] | None = None):
        kinds = pb_utils.MetricFamily
        counter, gauge = kinds.COUNTER, kinds.GAUGE
        # The families must outlive their metrics: the stub refuses updates once a family is gone.
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=description, kind=kind)
            for name, description, kind in (
                (GENERATE_TOKENS, "Tokens generated by the generate model", counter),
                (GENERATE_PROMPT_TOKENS, "Prompt tokens prefilled (requests admitted into the batch)", counter),
                (GENERATE_SUCCESS, "Generate requests finished, by finished_reason (stop, length)", counter),
                (GENERATE_CANCELLED, "Generate requests stopped by client cancellation", counter),
                (
                    GENERATE_REQUESTS,
                    "Generate requests by kind (generation, control) and outcome (ok, cancelled, not_sent, "
                    "or the error code: invalid_arg, unavailable, unsupported, internal)",
                    counter,
                ),
                (
                    GENERATE_REJECTED,
                    "Generate requests refused before generation, by reason (invalid, capacity)",
                    counter,
                ),
                (GENERATE_RUNNING, "Requests in the running decode batch", gauge),
                (GENERATE_WAITING, "Requests queued for admission", gauge),
                (GENERATE_KV_TOKENS, "KV-cache positions held by active requests (prompt + generated)", gauge),
                (GENERATE_SPEC_DRAFTS, "Sequence steps verified with drafted tokens (speculative decoding)", counter),
                (GENERATE_SPEC_DRAFTED, "Tokens drafted for verification (speculative decoding)", counter),
                (GENERATE_SPEC_ACCEPTED, "Drafted tokens accepted: those plain decoding sampled", counter),
            )
        }
        histograms = (
            (GENERATE_E2E, "Seconds from enqueue to a request's last token", REQUEST_LATENCY_BUCKETS),
            (GENERATE_QUEUE, "Seconds a request waited for admission into the batch", REQUEST_LATENCY_BUCKETS),
            (GENERATE_TTFT, "Seconds from enqueue to a request's first token", TTFT_BUCKETS),
            (GENERATE_ITL, "Seconds between a request's successive engine steps", ITL_BUCKETS),
            (GENERATE_KEPT_MASS, "-log(probability mass the mask kept), per masked token", KEPT_MASS_BUCKETS),
        )
        for name, description, _ in histograms:
            self._families.update(histogram_families(pb_utils, name, description))
        self._labels = labels = {"model": model}
        self._tokens = self._families[GENERATE_TOKENS].Metric(labels=labels)
        self._prompt_tokens = self._families[GENERATE_PROMPT_TOKENS].Metric(labels=labels)
        self._success: dict[str, object] = {}  # by finished_reason, created on first use
        self._cancelled = self._families[GENERATE_CANCELLED].Metric(labels=labels)
        self._rejected = {
            reason: self._families[GENERATE_REJECTED].Metric(labels={**labels, "reason": reason})
            for reason in (INVALID, CAPACITY)
        }
        self._gauges = [
            self._families[name].Metric(labels=labels)
            for name in (GENERATE_RUNNING, GENERATE_WAITING, GENERATE_KV_TOKENS)
        ]
        self._last = [None] * len(self._gauges)
        self._histograms = {
            name: CountedHistogram(self._families, name, labels, bounds) for name, _, bounds in histograms
        }
        self._speculation = [
            self._families[name].Metric(labels=labels)
            for name in (GENERATE_SPEC_DRAFTS, GENERATE_SPEC_DRAFTED, GENERATE_SPEC_ACCEPTED)
        ]
        self._defer = defer if defer is not None else _call
        self._pending_tokens = 0
        self._pending_speculation = [0, 0, 0]
        self._pending_prompt_tokens = 0
        self._pending_success: Counter = Counter()
        self._clock = clock
        self._flushed_at = clock()
        self._requests: dict[tuple[str, str], object] = {}  # by (kind, outcome), created on first use
        self._pending_outcomes: Counter = Counter()  # the response thread's own: counted and sent there
        self._outcomes_sent_at = clock()

    def generated(self, tokens: int) -> None:
        """Count the tokens of one engine step (sent by the next `occupancy`)."""
        self._pending_tokens += tokens

    def cancelled(self) -> None:
        """Count a request stopped by its client."""
        self._defer(self._cancelled.increment, 1)

    def ended(self, kind: str, outcome: str) -> None:
        """Count one request's end (kept locally; `send_outcomes` sends them). Called from the
        thread that sends the responses, and only from there."""
        self._pending_outcomes[kind, outcome] += 1

    def send_outcomes(self, idle: bool) -> None:
        """Send the ends counted since the last call, when the response thread has nothing left to
        send (`idle`) or every FLUSH_INTERVAL_S: one update per series, not one per request."""
        if not self._pending_outcomes:  # the common case: checked before reading the clock
            return
        now = self._clock()
        if not (idle or now - self._outcomes_sent_at >= FLUSH_INTERVAL_S):
            return
        for key, count in self._pending_outcomes.items():
            if key not in self._requests:
                kind, outcome = key
                labels = {**self._labels, "kind": kind, "outcome": outcome}
                self._requests[key] = self._families[GENERATE_REQUESTS].Metric(labels=labels)
            self._requests[key].increment(count)
        self._pending_outcomes.clear()
        self._outcomes_sent_at = now

    def rejected(self, invalid: int, capacity: int) -> None:
        """Count one execute's refusals: invalid requests (400) and those shed at capacity (503)."""
        for reason, count in ((INVALID, invalid), (CAPACITY, capacity)):
            if count:
                self._rejected[reason].increment(count)

    def admitted(self, queue_seconds: np.ndarray, prompt_tokens: int) -> None:
        """Observe the requests one step admitted: each one's wait, and their prompt tokens
        (kept locally, sent with the histograms: no IPC inside the engine's step)."""
        self._histograms[GENERATE_QUEUE].observe(queue_seconds)
        self._pending_prompt_tokens += prompt_tokens

    def stepped(self, step) -> None:
        """Observe one engine step's timings, finishes and kept masses (an engine `StepRecord`;
        kept locally, sent with the histograms)."""
        self._histograms[GENERATE_TTFT].observe(step.first_token_s)
        self._histograms[GENERATE_ITL].observe(step.inter_token_s)
        self._histograms[GENERATE_E2E].observe(step.e2e_s)
        # Rounding can leave a log kept mass a hair above 0: clipped, so the sum never decreases.
        self._histograms[GENERATE_KEPT_MASS].observe(np.maximum(-step.log_kept_mass, 0.0))
        self._pending_success.update(step.finished)

    def speculated(self, drafts: int, drafted: int, accepted: int) -> None:
        """Count one engine step's speculation: rows that drafted, tokens drafted, tokens accepted
        (accepted / drafted is the acceptance rate; 1 + accepted / drafts the tokens per draft);
        sent by the next `occupancy`, before that step's tokens."""
        for i, count in enumerate((drafts, drafted, accepted)):
            self._pending_speculation[i] += count

    def occupancy(self, active: int, waiting: int, kv_tokens: int) -> None:
        """Hand `defer` the step's counts and the gauges that changed since the last call, and
        the histograms' counts when due or when the engine has nothing left to do (so a scrape
        after a load sees all of it): one deferred call, the values taken now."""
        gauges = []
        for i, value in enumerate((active, waiting, kv_tokens)):
            if value != self._last[i]:
                gauges.append((self._gauges[i], value))
                self._last[i] = value
        speculation, tokens = self._pending_speculation, self._pending_tokens
        self._pending_speculation, self._pending_tokens = [0, 0, 0], 0
        now = self._clock()
        flushed = None
        if (active == 0 and waiting == 0) or now - self._flushed_at >= FLUSH_INTERVAL_S:
            flushed = self._take()
            self._flushed_at = now
        if tokens or any(speculation) or gauges or flushed is not None:
            self._defer(self._send, speculation, tokens, gauges, flushed)

    def _send(self, speculation: list[int], tokens: int, gauges: list, flushed: tuple | None) -> None:
        """The updates `occupancy` took (an update per series that changed): speculation first, so
        whoever sees a step's tokens counted sees its speculation too."""
        for metric, count in zip(self._speculation, speculation):
            if count:
                metric.increment(count)
        if tokens:
            self._tokens.increment(tokens)
        for gauge, value in gauges:
            gauge.set(value)
        if flushed is None:
            return
        histograms, prompt_tokens, success = flushed
        for histogram, taken in zip(self._histograms.values(), histograms):
            histogram.send(taken)
        if prompt_tokens:
            self._prompt_tokens.increment(prompt_tokens)
        for reason, count in success.items():
            if count:
                if reason not in self._success:
                    self._success[reason] = self._families[GENERATE_SUCCESS].Metric(
                        labels={**self._labels, "finished_reason": reason}
                    )
                self._success[reason].increment(count)

    def _take(self) -> tuple:
        """What the histograms, prompt tokens and finishes counted since the last take, cleared."""
        taken = ([h.take() for h in self._histograms.values()], self._pending_prompt_tokens, self._pending_success)
        self._pending_prompt_tokens, self._pending_success = 0, Counter()
        return taken


def _call(call, *args) -> None:
    call(*args)
