"""What a router reads of a replica besides its answers (plugin/api/worker_state.py): `/health`'s
readiness, from the supervisor's probe, and `/v1/loads`, SGLang's load report computed from the
generate model's Prometheus series. The probe and tritonserver's metrics are stand-ins here whose
answers the test sets; client_tests/test_router.py reads both from a real `make serve` stack."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from triton_sampling_mask.api import worker_state
from triton_sampling_mask.api.config import ApiConfig
from triton_sampling_mask.ops.server_process import free_port
from triton_sampling_mask.serving import metrics

# Two generate instances and another model's series, which the report must leave out.
METRICS = """\
# TYPE generate_num_requests_running gauge
generate_num_requests_running{model="generate",instance="0"} 3
generate_num_requests_running{model="generate",instance="1"} 2
generate_num_requests_running{model="other",instance="0"} 30
# TYPE generate_num_requests_waiting gauge
generate_num_requests_waiting{model="generate",instance="0"} 4
generate_num_requests_waiting{model="generate",instance="1"} 0
# TYPE generate_kv_tokens gauge
generate_kv_tokens{model="generate",instance="0"} 1000
generate_kv_tokens{model="generate",instance="1"} 600
generate_kv_tokens{model="other",instance="0"} 9999
# TYPE generate_tokens_total counter
generate_tokens_total{model="generate",instance="0"} 5000
generate_tokens_total{model="generate",instance="1"} 3000
"""


class _Peer:
    """A loopback HTTP server answering every GET with `status` and `body` (settable)."""

    def __init__(self):
        peer = self
        self.status, self.body = 200, b""

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(peer.status)
                self.send_header("Content-Length", str(len(peer.body)))
                self.end_headers()
                self.wfile.write(peer.body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peer():
    running = _Peer()
    yield running
    running.close()


def test_the_series_read_are_the_ones_the_generate_model_exports():
    # the API may not import serving: the names are kept equal here
    assert worker_state.GENERATE_RUNNING == metrics.GENERATE_RUNNING
    assert worker_state.GENERATE_WAITING == metrics.GENERATE_WAITING
    assert worker_state.GENERATE_KV_TOKENS == metrics.GENERATE_KV_TOKENS
    assert worker_state.GENERATE_TOKENS == metrics.GENERATE_TOKENS


def test_health_follows_the_readiness_probe(peer):
    config = ApiConfig(triton_url="unused", readiness_url=peer.url)
    peer.status = 503
    assert asyncio.run(worker_state.server_ready(config)) == (False, "its readiness probe answers 503")
    peer.status = 200
    assert asyncio.run(worker_state.server_ready(config))[0] is True
    silent = ApiConfig(triton_url="unused", readiness_url=f"http://127.0.0.1:{free_port()}/ready")
    assert asyncio.run(worker_state.server_ready(silent)) == (False, "its readiness probe does not answer")
    assert asyncio.run(worker_state.server_ready(ApiConfig(triton_url="unused"))) == (True, "")


def test_the_load_report_sums_the_generate_models_instances(peer, monkeypatch):
    peer.body = METRICS.encode()
    load = worker_state.EngineLoad(ApiConfig(triton_url="unused", metrics_url=peer.url))
    load._limits = (32, 16384)  # max_active_sequences, kv_budget_tokens of one instance (read over gRPC otherwise)
    clock = iter([100.0, 104.0])
    monkeypatch.setattr(worker_state, "time", SimpleNamespace(monotonic=lambda: next(clock)))  # the module's clock only

    report = asyncio.run(load.report())
    (first,) = report["loads"]
    assert report["dp_rank_count"] == 1 and first["dp_rank"] == 0
    assert (first["num_running_reqs"], first["num_waiting_reqs"], first["num_total_reqs"]) == (5, 4, 9)
    assert (first["num_used_tokens"], first["max_total_num_tokens"]) == (1600, 2 * 16384)
    assert first["token_usage"] == 1600 / 32768
    assert (first["max_running_requests"], first["utilization"]) == (64, 5 / 64)
    assert first["gen_throughput"] == 0.0  # one read: no rate yet
    assert first["cache_hit_rate"] == 0.0

    peer.body = METRICS.replace(" 5000\n", " 5400\n").encode()  # 400 more tokens, 4 s later
    (second,) = asyncio.run(load.report())["loads"]
    assert second["gen_throughput"] == 100.0


def test_no_report_without_readable_metrics(peer):
    load = worker_state.EngineLoad(ApiConfig(triton_url="unused", metrics_url=peer.url))
    load._limits = (32, 16384)
    peer.status = 500
    assert asyncio.run(load.report()) is None
    peer.status, peer.body = 200, b"this is { not prometheus text"
    assert asyncio.run(load.report()) is None
