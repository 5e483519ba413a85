"""The watchdog's readiness-only probe (a model whose inputs are neither a sampler's nor a
generator's) against the two answers Triton gives for a model whose Python stub died: 2.51 keeps
answering 200 to GET /v2/models/<m>/ready, 2.64 and later answer 400 "Model version not ready".
The local 2.51 server cannot give the newer answer, so a small HTTP server plays that endpoint."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from triton_sampling_mask.ops.probe import probe_model

CONFIG = {"name": "other", "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}]}


@pytest.fixture
def ready_endpoint():
    """A server whose /v2/models/other/ready answers the (status, body) in `answer[0]`."""
    answer = [(200, b"")]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            status, body = answer[0] if self.path == "/v2/models/other/ready" else (404, b"")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()


def test_a_model_ready_answer_is_ok(ready_endpoint):
    url, answer = ready_endpoint
    result = probe_model(url, "other", 5.0, CONFIG)
    assert (result.kind, result.ok, result.unhealthy) == ("ready", True, False)


def test_not_ready_after_a_stub_death_means_reload(ready_endpoint):
    url, answer = ready_endpoint
    answer[0] = (400, json.dumps({"error": "Model version not ready"}).encode())
    result = probe_model(url, "other", 5.0, CONFIG)
    assert (result.kind, result.ok, result.unhealthy) == ("ready", False, True)
    assert "Model version not ready" in result.detail


def test_other_failures_are_not_a_stub_death(ready_endpoint):
    url, answer = ready_endpoint
    answer[0] = (500, json.dumps({"error": "something else"}).encode())
    result = probe_model(url, "other", 5.0, CONFIG)
    assert (result.ok, result.unhealthy) == (False, False)
