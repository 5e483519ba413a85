"""The models' child spans under tritonserver's OpenTelemetry trace of a request.

tritonserver traces one request in TRITON_TRACE_RATE when TRITON_TRACE_ENDPOINT is set
(ops.trace_flags) and hands the Python backend that request's span context as W3C trace-context
text (`request.trace().get_context()`: JSON of a `traceparent` header, None for a request it does
not trace). The models time their phases with `time.time_ns()` marks and, after answering, turn
them into spans under that context with the OpenTelemetry SDK (the `tracing` extra), exported over
OTLP/HTTP to the same endpoint as tritonserver's own.

Off, the cost is one small object per execute call and one attribute test per phase: no
request's trace is read, nothing is imported. The stubs read the endpoint from their environment, which the launcher's carries.

The context tritonserver hands over is that of its span for the model, which it ends when
`execute` returns. A decoupled request lives on after that (queue, decoding, its final response),
inside tritonserver's `InferRequest` span, whose id the model is never given. So what happens
after `execute` is not put under the model's span, where it would end after its parent: it is a
span of its own in the same trace, linked to the model's span (OpenTelemetry's way to say "follows
from"), and only what runs inside `execute` is a child of it (docs/tracing.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence

# The setting's name (ops.settings.TRITON_TRACE_ENDPOINT declares it with its doc).
ENDPOINT_ENV = "TRITON_TRACE_ENDPOINT"
SERVICE_NAME = "triton-sampling-mask"
# Span attributes, named in OpenTelemetry's dotted style under the model's name.
BATCH_SIZE = "batch_size"
MASK_WIDTH = "mask_width"
FINISH_REASON = "finish_reason"
OUTCOME = "outcome"
REASON = "reason"  # with OUTCOME: the refused field, as the sampler's metrics label it
# A generate request's engine steps, one `step` span each under its `decode` span, up to this many
# (the first ones); its decode span says how many steps there were in all.
MAX_STEP_SPANS = 256
STEPS = "steps"


class ModelTracer:
    """Builds spans for one model instance; `enabled` is False (and nothing is loaded) without an endpoint."""

    def __init__(self, model_name: str, endpoint: str | None = None, log_error: Callable[[str], None] = print):
        endpoint = (os.environ.get(ENDPOINT_ENV, "") if endpoint is None else endpoint).strip()
        self.model_name, self.enabled, self.log_error = model_name, False, log_error
        if not endpoint:
            return
        try:  # a missing extra must not cost the model its load: it serves, untraced, and says why
            from opentelemetry.context import Context
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
            from opentelemetry.trace import Link, get_current_span, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as error:
            log_error(f"{model_name}: {ENDPOINT_ENV} is set but OpenTelemetry is not installed ({error}); no spans")
            return

        class SameTraceIds(RandomIdGenerator):
            """Random ids, except the trace id of a span started by `follow`: the trace it follows."""

            def __init__(self):
                self.pending = threading.local()

            def generate_trace_id(self) -> int:
                trace_id = getattr(self.pending, "trace_id", None)
                return trace_id if trace_id is not None else super().generate_trace_id()

        self.ids = SameTraceIds()
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}), id_generator=self.ids)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("triton_sampling_mask.serving")
        self.propagator = TraceContextTextMapPropagator()
        self.context_of_span = set_span_in_context
        self.span_context_in = lambda context: get_current_span(context).get_span_context()
        self.link, self.empty_context = Link, Context
        self.enabled = True

    def parent_of(self, request):
        """The OpenTelemetry context of tritonserver's span for `request`, or None when it is not traced."""
        try:
            text = request.trace().get_context()
            return self.propagator.extract(json.loads(text)) if text else None
        except Exception as error:  # a malformed context costs the request its spans, nothing else
            self.log_error(f"{self.model_name}: trace context not read ({type(error).__name__}: {error})")
            return None

    def span(self, parent, name: str, start_ns: int, end_ns: int, attributes: dict, children=()) -> None:
        """Record a finished span `name` under `parent` with its `children`, each (name, start, end,
        attributes) or (name, start, end, attributes, its own children)."""
        span = self.tracer.start_span(
            f"{self.model_name}.{name}", context=parent, start_time=start_ns, attributes=attributes
        )
        self._end(span, end_ns, children)

    def follow(self, followed, name: str, start_ns: int, end_ns: int, attributes: dict, children=()) -> None:
        """Record a finished span `name` (with its `children`, as for `span`) that follows from the
        span of the context `followed` without lying inside it: no parent, the same trace id, and a
        link to that span."""
        followed_span = self.span_context_in(followed)
        self.ids.pending.trace_id = followed_span.trace_id
        try:
            span = self.tracer.start_span(
                f"{self.model_name}.{name}",
                context=self.empty_context(),  # no parent: not the current span's child either
                start_time=start_ns,
                attributes=attributes,
                links=[self.link(followed_span)],
            )
        finally:
            self.ids.pending.trace_id = None
        self._end(span, end_ns, children)

    def _end(self, span, end_ns: int, children) -> None:
        inner = self.context_of_span(span)
        for child in children:
            self.span(inner, *child)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export the spans still queued (model unload)."""
        if self.enabled:
            self.provider.shutdown()


class BatchSpans:
    """The phase marks of one execute call: `mark(phase)` at each phase's end, `emit` after answering.

    With tracing off every method returns at once."""

    def __init__(self, tracer: ModelTracer | None):
        self.tracer = tracer if tracer is not None and tracer.enabled else None
        self.marks: list[tuple[str, int]] = [("", time.time_ns())] if self.tracer else []

    def mark(self, phase: str) -> None:
        """End `phase` now (it began at the previous mark, or at the batch's start)."""
        if self.tracer:
            self.marks.append((phase, time.time_ns()))

    def emit(self, requests: Sequence, attributes: Sequence[dict], shared: dict) -> None:
        """One `execute` span per traced request, its phases as children; `attributes[i]` are
        request i's own, `shared` the batch's. Never raises."""
        if not self.tracer or len(self.marks) < 2:
            return
        try:
            phases = [(name, start, end, shared) for (_, start), (name, end) in zip(self.marks, self.marks[1:])]
            for request, own in zip(requests, attributes):
                parent = self.tracer.parent_of(request)
                if parent is not None:
                    self.tracer.span(parent, "execute", self.marks[0][1], self.marks[-1][1], {**shared, **own}, phases)
        except Exception as error:  # tracing never costs a request its answer
            self.tracer.log_error(f"{self.tracer.model_name}: spans not recorded ({type(error).__name__}: {error})")


class RequestSpans:
    """One decoupled request's spans, recorded when its final response is sent. Under
    tritonserver's span for the model, what ran inside `execute`: an `execute` span (the batch's
    start to the request's submission to the engine) holding `parse`. Following it (linked, same
    trace, no parent: tritonserver ends its span when `execute` returns), a `request` span from
    the execute call's start to the final response sent, holding queue (submission to admission),
    decode (admission to its last token, one `step` span per engine step it took part in, the
    first MAX_STEP_SPANS, from the engine's StepSpans) and response (sending the final); without
    step spans the engine's durations come from the request's timing outputs, placed after its
    submission."""

    def __init__(self, tracer: ModelTracer, parent, batch: BatchSpans, shared: dict):
        self.tracer, self.parent, self.shared = tracer, parent, shared
        self.marks = dict(batch.marks[1:])
        self.started_ns = batch.marks[0][1]
        self.submitted_ns = time.time_ns()

    @classmethod
    def for_request(cls, batch: BatchSpans, request, shared: dict) -> RequestSpans | None:
        """The request's spans when tracing is on and tritonserver traces it, else None."""
        if not batch.tracer:
            return None
        parent = batch.tracer.parent_of(request)
        return None if parent is None else cls(batch.tracer, parent, batch, shared)

    def finish(self, outputs: dict, finish_reason: str, send_start_ns: int, send_end_ns: int, steps=None) -> None:
        """Record the spans; `outputs` holds the final response's timing outputs (seconds), `steps`
        the engine's StepSpans of the request (a `step` span each under `decode`). Never raises."""
        try:
            queue_s = float(outputs["queue_time_s"][0]) if "queue_time_s" in outputs else 0.0
            generation_s = float(outputs["generation_time_s"][0]) if "generation_time_s" in outputs else 0.0
            admitted_ns = self.submitted_ns + int(queue_s * 1e9)
            last_token_ns = admitted_ns + int(generation_s * 1e9)
            parsed_ns = self.marks.get("parse", self.started_ns)
            decode = {**self.shared, FINISH_REASON: finish_reason}
            if "time_to_first_token_s" in outputs:
                decode["time_to_first_token_s"] = float(outputs["time_to_first_token_s"][0])
            steps = steps or []
            if steps:  # the engine's own clock: the decode span runs from its first step to its last
                admitted_ns, last_token_ns = steps[0].start_ns, steps[-1].end_ns
                decode[STEPS] = len(steps)
            step_spans = [
                (
                    "step",
                    step.start_ns,
                    step.end_ns,
                    {
                        "batch_rows": step.batch_rows,
                        "tokens": step.emitted,
                        "drafted": step.drafted,
                        "accepted": step.accepted,
                    },
                )
                for step in steps[:MAX_STEP_SPANS]
            ]
            in_execute = [("parse", self.started_ns, parsed_ns, self.shared)]
            self.tracer.span(self.parent, "execute", self.started_ns, self.submitted_ns, self.shared, in_execute)
            after_execute = [
                ("queue", self.submitted_ns, steps[0].start_ns if steps else admitted_ns, self.shared),
                ("decode", admitted_ns, last_token_ns, decode, step_spans),
                ("response", send_start_ns, send_end_ns, self.shared),
            ]
            attributes = {**self.shared, FINISH_REASON: finish_reason}
            self.tracer.follow(self.parent, "request", self.started_ns, send_end_ns, attributes, after_execute)
        except Exception as error:  # tracing never costs a request its answer
            self.tracer.log_error(f"{self.tracer.model_name}: spans not recorded ({type(error).__name__}: {error})")
