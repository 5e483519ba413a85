"""ops.proxy_metrics reads HAProxy's exporter text into refusals by reason, per public frontend:
checked on a hand-written exporter answer whose counts are chosen so each reason has its own value."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from triton_sampling_mask.ops import proxy_metrics

# fe_http: 3 own 503s (9 5xx, of which 6 came back through its backends), 10 denied + 2 intercepted
# by rules; be_http_sampler: 4 queue timeouts, 2 waiting; fe_grpc: 5 trailers-only answers of its
# rules, and 7 more from the backend that answers full queues; fe_stats (the exporter's own frontend):
# 13 scrapes, each an "intercepted" request.
EXPORTER = (Path(__file__).parent / "fixtures" / "haproxy_exporter.txt").read_text()


def test_each_reason_is_read_from_its_counters():
    got = proxy_metrics.refusals(EXPORTER)
    assert got["http"] == {
        "queue_full": 3,  # 9 5xx at the frontend - 6 through its backends
        "queue_timeout": 4,
        "refused": 9,  # 10 denied + 2 intercepted - the 3 full-queue 503s
        "connection_cap": 8,
        "bad_request": 11,
        "received": 100,
        "waiting": {"be_http_sampler": 2, "be_http_other": 0},
    }
    assert got["grpc"]["queue_full"] == 7 and got["grpc"]["refused"] == 5 and got["grpc"]["queue_timeout"] == 3
    assert got["grpc"]["waiting"] == {"be_grpc_infer": 0, "be_grpc_stream": 0}  # the answering backend: nothing
    assert set(got) == {"http", "grpc"}  # the exporter's own frontend is not the door's: its scrapes are no refusals


def test_the_stream_gates_refusals_and_waiting_streams_are_added_to_its_route():
    gate = {"queue_full": 2, "queue_timeout": 6, "waiting": 4, "running": 64}
    got = proxy_metrics.refusals(EXPORTER, gate)
    assert got["grpc"]["queue_full"] == 7 + 2 and got["grpc"]["queue_timeout"] == 3 + 6
    assert got["grpc"]["waiting"]["be_grpc_stream"] == 4 and got["grpc"]["refused"] == 5
    assert got["http"] == proxy_metrics.refusals(EXPORTER)["http"]


def test_the_exposition_is_prometheus_text_with_every_reason_per_frontend():
    text = proxy_metrics.exposition(proxy_metrics.refusals(EXPORTER))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    refused = {labels: v for (name, labels), v in samples.items() if name == proxy_metrics.REFUSED}
    assert len(refused) == 2 * len(proxy_metrics.REASONS)
    assert refused[(("frontend", "http"), ("reason", "queue_full"))] == 3
    assert samples[(proxy_metrics.WAITING, (("backend", "be_http_sampler"), ("frontend", "http")))] == 2
    assert samples[(proxy_metrics.RECEIVED, (("frontend", "grpc"),))] == 45
