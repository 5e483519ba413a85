"""The front door's refusals as metrics (ops.proxy_metrics): a burst through the real proxy in
front of a slowed sampler (test_load_shedding's server) is refused as the docs say, and the
exported counters move by exactly the refusals the clients saw, per reason and frontend."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from triton_sampling_mask.ops import proxy_metrics
from triton_sampling_mask.ops.proxy import QUEUE_FULL, QUEUE_TIMEOUT

from .test_load_shedding import BURST, burst, slow_server  # noqa: F401 (slow_server: a fixture)

# What a gRPC client reports when it reads the proxy's stream reset before its trailers.
RESET = "StatusCode.CANCELLED Stream removed (RST_STREAM"


def exported(server) -> dict[tuple[str, str], float]:
    """{(frontend, reason): count} as the supervisor's /metrics serves it, plus (frontend, "received")."""
    socket_path = server.front_door.stats_socket
    if socket_path is None:
        pytest.skip("this haproxy has no Prometheus exporter (haproxy -vv)")
    values = {}
    for family in text_string_to_metric_families(proxy_metrics.render(socket_path)):
        for sample in family.samples:
            if sample.name == proxy_metrics.REFUSED + "_total" or sample.name == proxy_metrics.REFUSED:
                values[sample.labels["frontend"], sample.labels["reason"]] = sample.value
            elif sample.name in (proxy_metrics.RECEIVED, proxy_metrics.RECEIVED + "_total"):
                values[sample.labels["frontend"], "received"] = sample.value
    return values


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_exported_refusals_equal_the_refusals_clients_saw(slow_server, protocol):  # noqa: F811
    before = exported(slow_server)
    outcomes = burst(slow_server, protocol, BURST)
    after = exported(slow_server)
    moved = {key: after[key] - before.get(key, 0.0) for key in after if key[0] == protocol}
    assert outcomes.count(QUEUE_FULL) >= 1 and outcomes.count(QUEUE_TIMEOUT) >= 1, outcomes
    # a full queue is counted as queue_full on both frontends; on gRPC it is answered
    # trailers-only, and under load a client may read the stream's reset (the proxy answers before the body is sent)
    # before those trailers, and sees CANCELLED for the same refusal
    reset = [o for o in outcomes if o.startswith(RESET)] if protocol == "grpc" else []
    assert set(outcomes) - {"ok", QUEUE_FULL, QUEUE_TIMEOUT} <= set(reset), outcomes
    full, timed_out = moved[protocol, "queue_full"], moved[protocol, "queue_timeout"]
    assert full >= outcomes.count(QUEUE_FULL) and timed_out >= outcomes.count(QUEUE_TIMEOUT), (moved, outcomes)
    refusals_seen = outcomes.count(QUEUE_FULL) + outcomes.count(QUEUE_TIMEOUT) + len(reset)
    assert full + timed_out == refusals_seen, (moved, outcomes)
    others = {"refused", "connection_cap", "bad_request"}
    assert all(moved[protocol, reason] == 0 for reason in others), moved
    assert moved[protocol, "received"] == BURST, moved
