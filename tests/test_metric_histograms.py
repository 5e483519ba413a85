"""The counter-kept histograms against a brute-force count, and the generate metrics' flushing."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.generation.engine import StepRecord
from triton_sampling_mask.serving.metrics import (
    FLUSH_INTERVAL_S,
    GENERATE_E2E,
    GENERATE_KEPT_MASS,
    GENERATE_REQUESTS,
    KEPT_MASS_BUCKETS,
    CountedHistogram,
    GenerateMetrics,
    histogram_families,
)

from .metrics_stub import MetricStub

BOUNDS = [0.0, 0.25, 1.0, 5.0]
LABELS = {"model": "m"}


def brute_force(values: list[float], bounds) -> dict[str, float]:
    """Prometheus' cumulative buckets, sum and count, one value at a time."""
    counts = {}
    for bound in bounds:
        counts[str(int(bound)) if float(bound).is_integer() else repr(float(bound))] = sum(v <= bound for v in values)
    counts["+Inf"] = len(values)
    return counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 8, allow_nan=False, width=32), max_size=12), max_size=5), st.booleans())
def test_counted_histogram_matches_a_brute_force_count(batches, flush_each):
    stub = MetricStub.reset()
    histogram = CountedHistogram(histogram_families(stub, "h", "test"), "h", LABELS, BOUNDS)
    for batch in batches:
        histogram.observe(np.array(batch))
        if flush_each:
            histogram.flush()
    histogram.flush()
    values = [v for batch in batches for v in batch]
    for le, count in brute_force(values, BOUNDS).items():
        assert stub.value("h_bucket", **LABELS, le=le) == count, le
    assert stub.value("h_count", **LABELS) == len(values)
    assert abs(stub.value("h_sum", **LABELS) - float(np.sum(np.array(values, np.float64)))) < 1e-6
    # One update per series a flush touched, never one per value.
    assert all(m.updates <= len(batches) + 1 for f in stub.families.values() for m in f.metrics)


def step(e2e=(), kept=(), finished=None) -> StepRecord:
    empty = np.zeros(0)
    return StepRecord(empty, empty, np.array(e2e, float), finished or {}, np.array(kept, float))


def test_generate_histograms_are_sent_when_due_or_when_the_engine_idles():
    stub = MetricStub.reset()
    now = [100.0]
    metrics = GenerateMetrics(stub, "generate", clock=lambda: now[0])
    metrics.stepped(step(e2e=[0.4, 1.2], kept=[-0.05, -2.5, 1e-7], finished={"length": 2, "stop": 0}))
    metrics.occupancy(active=3, waiting=1, kv_tokens=40)  # busy, not due: nothing sent yet
    assert stub.value(f"{GENERATE_E2E}_count", model="generate") == 0
    now[0] += FLUSH_INTERVAL_S
    metrics.occupancy(active=3, waiting=1, kv_tokens=41)  # due
    assert stub.value(f"{GENERATE_E2E}_count", model="generate") == 2
    assert stub.value(f"{GENERATE_E2E}_bucket", model="generate", le="0.5") == 1
    metrics.stepped(step(kept=[-0.5]))
    metrics.occupancy(active=0, waiting=0, kv_tokens=0)  # idle: sent at once
    kept = brute_force([0.05, 2.5, 0.0, 0.5], KEPT_MASS_BUCKETS)  # negated log kept masses
    for le, count in kept.items():
        assert stub.value(f"{GENERATE_KEPT_MASS}_bucket", model="generate", le=le) == count, le
    assert stub.value("generate_request_success_total", model="generate", finished_reason="length") == 2
    assert "stop" not in {
        m.labels.get("finished_reason") for m in stub.families["generate_request_success_total"].metrics
    }
    assert stub.value("generate_num_requests_running", model="generate") == 0


def test_request_ends_are_sent_when_the_responses_idle_or_when_due():
    """Every end counted by kind and outcome, one update per series per send, none per request."""
    stub = MetricStub.reset()
    now = [100.0]
    metrics = GenerateMetrics(stub, "generate", clock=lambda: now[0])
    ends = [("generation", "ok")] * 5 + [("generation", "invalid_arg")] * 2 + [("control", "ok")]
    for kind, outcome in ends:
        metrics.ended(kind, outcome)
        metrics.send_outcomes(idle=False)  # busy, not due: nothing sent yet
    assert GENERATE_REQUESTS not in stub.families or not stub.families[GENERATE_REQUESTS].metrics
    metrics.send_outcomes(idle=True)
    assert stub.value(GENERATE_REQUESTS, model="generate", kind="generation", outcome="ok") == 5
    assert stub.value(GENERATE_REQUESTS, model="generate", kind="generation", outcome="invalid_arg") == 2
    assert stub.value(GENERATE_REQUESTS, model="generate", kind="control", outcome="ok") == 1
    metrics.ended("generation", "unavailable")
    now[0] += FLUSH_INTERVAL_S
    metrics.send_outcomes(idle=False)  # due
    assert stub.value(GENERATE_REQUESTS, model="generate", kind="generation", outcome="unavailable") == 1
    assert all(m.updates == 1 for m in stub.families[GENERATE_REQUESTS].metrics)
