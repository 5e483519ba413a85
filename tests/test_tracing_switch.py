"""Tracing is off unless TRITON_TRACE_ENDPOINT is set: no tritonserver flags, and the models'
span recorder never reads a request's trace; on, the launcher passes the documented flags."""

from __future__ import annotations

from triton_sampling_mask.ops import settings
from triton_sampling_mask.ops.trace_flags import trace_args
from triton_sampling_mask.serving import tracing


class UntouchableRequest:
    def trace(self):  # what the recorder must never call while tracing is off
        raise AssertionError("a request's trace was read with tracing off")


def test_the_stubs_read_the_setting_the_launcher_declares():
    assert settings.TRITON_TRACE_ENDPOINT.name == tracing.ENDPOINT_ENV
    assert settings.TRITON_TRACE_ENDPOINT.value({}) == "" and settings.TRITON_TRACE_RATE.value({}) == 1000


def test_off_by_default_no_flags_and_no_trace_read(monkeypatch):
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert trace_args(settings.TRITON_TRACE_ENDPOINT.value(), settings.TRITON_TRACE_RATE.value()) == []
    tracer = tracing.ModelTracer("sampler")
    assert not tracer.enabled and not hasattr(tracer, "provider")
    spans = tracing.BatchSpans(tracer)
    spans.mark("parse")
    spans.emit([UntouchableRequest()], [{}], {})
    assert spans.marks == [] and tracing.RequestSpans.for_request(spans, UntouchableRequest(), {}) is None
    tracer.shutdown()


def test_on_the_launcher_passes_opentelemetry_flags_at_the_rate():
    url = "http://collector:4318/v1/traces"
    flags = trace_args(url, 7)
    assert "--trace-config=mode=opentelemetry" in flags and "--trace-config=level=TIMESTAMPS" in flags
    assert "--trace-config=rate=7" in flags and f"--trace-config=opentelemetry,url={url}" in flags
