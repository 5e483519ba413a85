"""The step-latency benchmark's busy-host tools without a server: tritonserver's trace files and
HAProxy's log lines read, joined to the client's calls hop by hop (references: the timestamps
written into them), and the spinning neighbour's processes."""

from __future__ import annotations

import json
import os
import time

import psutil

from testbed import step_hops
from testbed.cpu_hog import CpuHog

# tritonserver's order of a traced request's timestamps (mode triton, level TIMESTAMPS)
STAMPS = (
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
    "GRPC_WAITREAD_START",
    "GRPC_WAITREAD_END",
    "GRPC_SEND_START",
    "GRPC_SEND_END",
)


def _trace_records(trace_id: int, request_id: str, stamps: dict[str, int]) -> list[dict]:
    records = [{"id": trace_id, "model_name": "sampler", "model_version": 1, "request_id": request_id}]
    return records + [{"id": trace_id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in stamps.items()]


def _stamps(start: int, queue_ms: float, execute_ms: float) -> dict[str, int]:
    """A request read 1 ms after `start`, queued `queue_ms`, its stub `execute_ms`."""
    ms = 1_000_000
    read = start + ms
    compute = read + 100_000 + int(queue_ms * ms)
    output = compute + 200_000 + int(execute_ms * ms)
    return {
        "GRPC_WAITREAD_START": start - 50 * ms,
        "GRPC_WAITREAD_END": read,
        "REQUEST_START": read + 50_000,
        "QUEUE_START": read + 100_000,
        "COMPUTE_START": compute,
        "COMPUTE_INPUT_END": compute + 200_000,
        "COMPUTE_OUTPUT_START": output,
        "COMPUTE_END": output + 100_000,
        "REQUEST_END": output + 150_000,
        "GRPC_SEND_START": output + 160_000,
        "GRPC_SEND_END": output + 300_000,
    }


def test_each_calls_hops_come_from_tritonservers_trace_files_and_the_clients_times(tmp_path):
    ms = 1_000_000
    calls, parts = [], [[], []]
    for n, (queue, execute) in enumerate([(0.0, 4.0), (250.0, 4.0), (0.0, 300.0)]):
        start = (n + 1) * 1000 * ms
        stamps = _stamps(start, queue, execute)
        calls.append((f"step-0-{n}", start, stamps["GRPC_SEND_END"] + 2 * ms))
        parts[n % 2] += _trace_records(n + 1, f"step-0-{n}", stamps)
    for index, records in enumerate(parts):  # tritonserver writes a file every log-frequency traces
        (tmp_path / f"trace.json.{index}").write_text(json.dumps(records))
    traces = step_hops.read_trace(tmp_path / "trace.json")
    assert set(traces) == {"step-0-0", "step-0-1", "step-0-2"} and set(traces["step-0-1"]) >= set(STAMPS)
    rows = step_hops.call_hops(calls, traces)
    first = rows[0]
    assert first["to_server"] == 1.0 and first["from_server"] == 2.0 and first["queue"] == 0.0
    assert first["stub_execute"] == 4.0 and first["total"] == (calls[0][2] - calls[0][1]) / ms
    assert abs(sum(first[name] for name, *_ in step_hops.HOPS) - first["total"]) < 1e-9  # the hops tile the call
    summary = step_hops.summarize(rows, slow_ms=200.0)
    assert summary["over_slow_by_largest_hop"] == {"queue": 1, "stub_execute": 1}
    assert [row["id"] for row in summary["slowest"]][:2] == ["step-0-2", "step-0-1"]
    assert summary["hops"]["queue"]["max_ms"] == rows[1]["queue"]


def test_haproxys_timers_are_read_for_one_backend_and_joined_in_the_order_the_calls_ended():
    line = (
        "127.0.0.1 - [05/Dec/2026:14:17:21.{n:03d}] fe_grpc {backend} 0/0/0/{tr}/{ta} 200 512/384 ---- 1/1/0/0 "
        '"POST /inference.GRPCInferenceService/ModelInfer HTTP/2.0"'
    )
    text = "\n".join(
        [
            line.format(n=1, backend="be_grpc_infer", tr=5, ta=6),
            line.format(n=2, backend="be_grpc_stream", tr=900, ta=900),
            line.format(n=3, backend="be_grpc_infer", tr=250, ta=251),
            "haproxy started",
        ]
    )
    lines = step_hops.read_haproxy_log(text, "be_grpc_infer")
    assert lines == [{"TR": 0, "Tw": 0, "Tc": 0, "Tr": 5, "Ta": 6}, {"TR": 0, "Tw": 0, "Tc": 0, "Tr": 250, "Ta": 251}]
    calls = [("late", 0, 300), ("early", 10, 100)]  # "early" ended first: its line was logged first
    rows = [{"id": "late", "total": 300.0}, {"id": "early", "total": 90.0}]
    step_hops.join_haproxy(calls, rows, lines)
    assert rows[1]["haproxy_Ta"] == 6.0 and rows[0]["haproxy_Ta"] == 251.0


def test_the_busy_neighbour_spins_in_a_session_of_its_own_and_is_gone_after():
    with CpuHog(2) as hog:
        pids = hog.pids
        assert len(pids) == 2
        assert {os.getsid(pid) for pid in pids} == {pids[0]} != {os.getsid(0)}
        time.sleep(0.3)
        assert all(psutil.Process(pid).cpu_times().user > 0 for pid in pids)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert step_hops.run_delay_s([os.getpid()], descendants=False) >= 0
