"""A short soak on the session server: concurrent HTTP and gRPC clients, mixed valid, invalid,
mask and non-mask requests; nothing lost, no 5xx, no wrong answer, no RSS growth (make soak runs
the long version)."""

from __future__ import annotations

from testbed.soak import KINDS, run_soak


def test_short_soak_loses_nothing(triton_server):
    report = run_soak(
        triton_server.http_url,
        triton_server.grpc_url,
        triton_server.process.pid,
        clients=8,
        duration_s=6,
        warmup_s=2,
        vocab=1024,
    )
    print(report.summary())
    assert report.sent > len(KINDS) * 8, report.summary()  # every client sent a mix
    assert set(report.by_protocol) == {"http", "grpc"}
    assert report.ok > 0 and report.rejected_4xx > 0
    assert report.failures == [], report.summary() + "\n" + "\n".join(report.examples)
