"""OpenTelemetry tracing end to end: a real tritonserver with the launcher's trace flags
(ops.trace_flags, every request traced) exports its spans to an in-process OTLP/HTTP collector,
and the models' child spans (serving.tracing) arrive there too, under the same trace: each
model's span's parent is one of tritonserver's spans of that request, and its phases are its
children, carrying the batch size, the mask width and the outcome or finish reason; a generate
request's decoding holds one span per engine step."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from testbed.server import MODEL_REPOSITORY, ExternalTritonServer, TritonServer
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.model_config import output_width
from triton_sampling_mask.ops.trace_flags import SERVICE_NAME as TRITON_SERVICE
from triton_sampling_mask.ops.trace_flags import trace_args
from triton_sampling_mask.serving.tracing import ENDPOINT_ENV, SERVICE_NAME

from .generate_client import grpc_generate
from .otlp_collector import OtlpCollector

SAMPLER_PHASES = {"sampler.parse", "sampler.sample", "sampler.response"}
GENERATE_PHASES = {"generate.parse", "generate.queue", "generate.decode", "generate.response"}


def mask_width(server, model: str) -> int:
    """W: the dims of the model's `sampling_mask` output, as the server reads its config.pbtxt."""
    with httpclient.InferenceServerClient(server.http_url) as client:
        return output_width(client.get_model_config(model), "sampling_mask")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(collector, server): the shipped models, every request traced, spans flushed every 0.2 s."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver with tracing of its own")
    with OtlpCollector() as collector, pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENDPOINT_ENV, collector.url)  # the stubs inherit it, as from the launcher
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the models' exporter: flush often
        flags = [*trace_args(collector.url, 1), "--trace-config=opentelemetry,bsp_schedule_delay=200"]
        server = TritonServer(MODEL_REPOSITORY, extra_args=flags)
        server.start()
        try:
            yield collector, server
        finally:
            server.stop()


def tree_of(spans, root_name: str, phases: set[str]):
    """(Triton's parent span, the model's span, its children) of the one trace holding `root_name`."""
    roots = [s for s in spans if s.name == root_name]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    by_id = {s.span_id: s for s in spans}
    children = [s for s in spans if s.parent_span_id == root.span_id]
    if root.parent_span_id not in by_id or {c.name for c in children} != phases:
        return None
    return by_id[root.parent_span_id], root, children


def test_a_sampler_request_has_its_phases_under_tritons_span(traced):
    collector, server = traced
    logits = np.random.default_rng(0).standard_normal((1, 300)).astype(np.float32)
    with httpclient.InferenceServerClient(server.http_url) as client:
        client.infer("sampler", sampler_inputs(httpclient, logits, top_k=5, return_sampling_mask=True))
    spans = collector.wait_for(lambda got: any(s.name == "sampler.execute" for s in got) and tree_of_all(got))
    triton_span, execute, children = tree_of_all(spans)
    assert triton_span.service == TRITON_SERVICE and execute.service == SERVICE_NAME
    assert_every_span_lies_within_its_parent([s for s in spans if s.trace_id == execute.trace_id])
    assert {s.trace_id for s in (triton_span, execute, *children)} == {execute.trace_id}
    # every phase lies within the model's span, in order, and the model's span within Triton's request
    children.sort(key=lambda s: s.start_ns)
    assert [c.name for c in children] == ["sampler.parse", "sampler.sample", "sampler.response"]
    assert execute.start_ns <= children[0].start_ns and children[-1].end_ns <= execute.end_ns
    assert all(a.end_ns <= b.start_ns for a, b in zip(children, children[1:]))
    request_span = min((s for s in spans if s.trace_id == execute.trace_id), key=lambda s: s.start_ns)
    assert request_span.service == TRITON_SERVICE and request_span.parent_span_id == ""
    assert request_span.start_ns <= execute.start_ns <= execute.end_ns <= request_span.end_ns
    assert execute.attributes == {
        "batch_size": 1,
        "mask_width": mask_width(server, "sampler"),
        "outcome": "ok",
        "reason": "ok",
    }


def tree_of_all(spans):
    found = [s for s in spans if s.name == "sampler.execute"]
    return tree_of(spans, "sampler.execute", SAMPLER_PHASES) if found else None


def assert_every_span_lies_within_its_parent(spans) -> None:
    """An honest tree: no span starts before its parent or ends after it."""
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        parent = by_id.get(span.parent_span_id)
        if parent is not None:
            assert parent.start_ns <= span.start_ns and span.end_ns <= parent.end_ns, (span.name, parent.name)


def test_a_generate_request_follows_tritons_span_for_the_model_in_the_same_trace(traced):
    """tritonserver ends its span for the model when `execute` returns: what runs inside execute is
    its child; the request's life after it (queue, decoding, the final response) is a span of the
    same trace that links to it (follows from it) instead of outliving it as a child."""
    collector, server = traced
    grpc_generate(server.grpc_url, np.array([1, 2, 3], np.int64), 4, ignore_eos=True, top_k=5)

    def arrived(names):
        def holds(got):
            requests = [s for s in got if s.name == "generate.request"]
            return len(requests) == 1 and names <= {s.name for s in got if s.trace_id == requests[0].trace_id}

        return holds

    spans = collector.wait_for(arrived({"InferRequest", "generate", *GENERATE_PHASES}))
    (request,) = [s for s in spans if s.name == "generate.request"]
    assert_every_span_lies_within_its_parent([s for s in spans if s.trace_id == request.trace_id])
    spans = collector.wait_for(arrived({"generate.execute"}))
    trace = [s for s in spans if s.trace_id == request.trace_id]
    by_name = {s.name: s for s in trace if s.name != "generate.step"}
    model_span, execute = by_name["generate"], by_name["generate.execute"]
    assert model_span.service == TRITON_SERVICE and request.service == execute.service == SERVICE_NAME
    assert_every_span_lies_within_its_parent(trace)
    # inside execute: a child of tritonserver's span for the model, holding the parse
    assert execute.parent_span_id == model_span.span_id
    assert by_name["generate.parse"].parent_span_id == execute.span_id
    # after it: no parent, a link to the model's span, and the request's phases as its children
    assert request.parent_span_id == "" and request.links == ((model_span.trace_id, model_span.span_id),)
    assert request.end_ns > model_span.end_ns  # why it cannot be the model span's child
    assert request.end_ns <= by_name["InferRequest"].end_ns  # tritonserver's request span outlives it
    children = [s for s in trace if s.parent_span_id == request.span_id]
    assert {c.name for c in children} == GENERATE_PHASES - {"generate.parse"}
    decode = by_name["generate.decode"]
    assert decode.attributes["finish_reason"] == "length"
    assert request.attributes == {
        "batch_size": 1,
        "mask_width": mask_width(server, "generate"),
        "finish_reason": "length",
    }
    # parse, then the queue, then decoding, then the final response, all within the request's span
    order = [by_name[f"generate.{phase}"] for phase in ("parse", "queue", "decode", "response")]
    assert all(a.end_ns <= b.start_ns + 1000 for a, b in zip(order, order[1:])), order
    assert request.start_ns <= order[0].start_ns and order[-1].end_ns <= request.end_ns
    # decoding is the engine's steps, one span each: 4 tokens without drafts take 4 steps, the
    # first at the start of decoding and the last at its end, carrying the step's batch and tokens
    steps = sorted((s for s in trace if s.parent_span_id == decode.span_id), key=lambda s: s.start_ns)
    assert [s.name for s in steps] == ["generate.step"] * 4 and decode.attributes["steps"] == 4
    assert steps[0].start_ns == decode.start_ns and steps[-1].end_ns == decode.end_ns
    assert all(a.end_ns <= b.start_ns for a, b in zip(steps, steps[1:]))
    assert [s.attributes for s in steps] == [{"batch_rows": 1, "tokens": 1, "drafted": 0, "accepted": 0}] * 4
