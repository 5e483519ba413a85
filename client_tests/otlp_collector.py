"""An in-process OpenTelemetry collector for the tests: an OTLP/HTTP endpoint on a free port that
accepts `ExportTraceServiceRequest`s at /v1/traces, as protobuf (the Python SDK's exporter) or as
OTLP/JSON (tritonserver's opentelemetry-cpp exporter), and keeps every span, decoded with
`opentelemetry-proto`."""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector received it (ids as hex, attributes as Python values)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(hash=False)
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each span it links to


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


CONTENT_TYPES = ("application/x-protobuf", "application/json")
# OTLP/JSON writes these ids as hex, where protobuf's JSON mapping expects base64.
HEX_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids_to_base64(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in HEX_ID_FIELDS and isinstance(value, str):
                node[key] = base64.b64encode(bytes.fromhex(value)).decode()
            else:
                _hex_ids_to_base64(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids_to_base64(item)
    return node


def decode(body: bytes, content_type: str = CONTENT_TYPES[0]) -> list[ReceivedSpan]:
    """The spans of one OTLP/HTTP export body (protobuf, or OTLP/JSON)."""
    request = ExportTraceServiceRequest()
    if content_type == "application/json":
        json_format.ParseDict(_hex_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
    else:
        request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                    )
                )
    return spans


class OtlpCollector:
    """A context manager serving /v1/traces on 127.0.0.1; `spans` holds what arrived."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.refused: list[tuple] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                content_type = (self.headers.get("content-type") or "").split(";")[0].strip()
                if self.path != TRACES_PATH or content_type not in CONTENT_TYPES:
                    collector.refused.append((self.path, content_type, body[:200]))
                    self.send_error(404 if self.path != TRACES_PATH else 415)
                    return
                received = decode(body, content_type)
                with collector.lock:
                    collector.spans.extend(received)
                answer = ExportTraceServiceResponse().SerializeToString()
                if content_type == "application/json":
                    answer = b"{}"
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-collector", daemon=True)

    @property
    def url(self) -> str:
        """The OTLP/HTTP traces URL to export to."""
        return f"http://127.0.0.1:{self.server.server_address[1]}{TRACES_PATH}"

    def __enter__(self) -> OtlpCollector:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once `predicate(spans)` holds; raises with what arrived after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(
                    f"spans not complete within {timeout_s}s; received {len(spans)}: {names}; refused: {self.refused[:3]}"
                )
            time.sleep(0.1)
