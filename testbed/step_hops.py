"""Where a step call's time went, hop by hop (bench/step_latency.py's `--hops`).

Three records, joined per call:
- the client's: each call's request id and its start and end on the monotonic clock;
- tritonserver's own trace of every request (`--trace-config` mode triton, level TIMESTAMPS,
  rate 1): when its gRPC frontend had read the request, its queue, the instance's compute (the
  Python backend's input copy, the stub's execute, the output copy) and the response sent, on
  the same monotonic clock (std::chrono::steady_clock), keyed by the request id;
- through the front door, HAProxy's log line of each call (its timers TR/Tw/Tc/Tr/Ta, in ms),
  joined to the calls in the order they ended (exact at concurrency 1).

Beside them, per point and per process, the time its threads spent runnable but waiting for a CPU
(/proc/<pid>/task/*/schedstat, the scheduler's run-queue delay): what a busy host takes from each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from .process_memory import process_tree

# The hops of a call, in order: (name, from, to), on tritonserver's timestamps and the client's
# ("client_start" / "client_end"). "to_server": the client's send, the proxy when there is one and
# tritonserver reading the request; "from_server": the way back.
HOPS = (
    ("to_server", "client_start", "GRPC_WAITREAD_END"),
    ("server_parse", "GRPC_WAITREAD_END", "QUEUE_START"),
    ("queue", "QUEUE_START", "COMPUTE_START"),
    ("input_copy", "COMPUTE_START", "COMPUTE_INPUT_END"),
    ("stub_execute", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
    ("response", "COMPUTE_OUTPUT_START", "GRPC_SEND_END"),
    ("from_server", "GRPC_SEND_END", "client_end"),
)
HAPROXY_TIMERS = ("TR", "Tw", "Tc", "Tr", "Ta")
_HAPROXY_LINE = re.compile(
    r"\] (?P<frontend>\S+) (?P<backend>\S+) (?P<TR>-?\d+)/(?P<Tw>-?\d+)/(?P<Tc>-?\d+)/(?P<Tr>-?\d+)/(?P<Ta>-?\d+) "
    r'.*"(?P<request>[^"]*)"\s*$'
)


def trace_args(path: Path) -> list[str]:
    """tritonserver flags that trace every request's timestamps into files `path`.N."""
    return [
        "--trace-config=mode=triton",
        f"--trace-config=triton,file={path}",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=1",
        "--trace-config=count=-1",
        "--trace-config=triton,log-frequency=1000",
    ]


def read_trace(path: Path) -> dict[str, dict[str, int]]:
    """Every traced request's timestamps (name: ns) by its request id, from the files `path`.N
    tritonserver wrote (the last one once it has stopped)."""
    by_trace: dict[int, dict] = {}
    for part in sorted(path.parent.glob(path.name + ".*")):
        try:
            records = json.loads(part.read_text())
        except (OSError, ValueError):
            continue
        for record in records:
            entry = by_trace.setdefault(record["id"], {"timestamps": {}})
            if "request_id" in record:
                entry["request_id"] = record["request_id"]
            for stamp in record.get("timestamps", ()):
                entry["timestamps"][stamp["name"]] = stamp["ns"]
    return {e["request_id"]: e["timestamps"] for e in by_trace.values() if e.get("request_id")}


def read_haproxy_log(text: str, backend: str) -> list[dict[str, int]]:
    """The timers of each line of HAProxy's log for `backend`, in the order logged (a request's
    line is written when it ends)."""
    lines = []
    for line in text.splitlines():
        match = _HAPROXY_LINE.search(line)
        if match and match["backend"] == backend:
            lines.append({name: int(match[name]) for name in HAPROXY_TIMERS})
    return lines


def run_delay_s(pids: list[int], descendants: bool = True) -> float:
    """Seconds the threads of these processes (and their descendants unless told not to) have spent
    runnable, waiting for a CPU. Threads that ended are not counted."""
    total = 0
    for pid in pids:
        for process in process_tree(pid) if descendants else process_tree(pid)[:1]:
            for schedstat in Path(f"/proc/{process.pid}/task").glob("*/schedstat"):
                try:
                    total += int(schedstat.read_text().split()[1])
                except (OSError, IndexError, ValueError):
                    continue
    return total / 1e9


def call_hops(calls: list[tuple[str, int, int]], traces: dict[str, dict[str, int]]) -> list[dict[str, float]]:
    """Per call (request id, start ns, end ns): its total and each hop in ms, where tritonserver
    traced it."""
    out = []
    for request_id, start, end in calls:
        stamps = traces.get(request_id)
        if stamps is None:
            continue
        stamps = {**stamps, "client_start": start, "client_end": end}
        row = {"id": request_id, "total": (end - start) / 1e6}
        for name, first, last in HOPS:
            if first in stamps and last in stamps:
                row[name] = (stamps[last] - stamps[first]) / 1e6
        out.append(row)
    return out


def join_haproxy(calls: list[tuple[str, int, int]], rows: list[dict], lines: list[dict]) -> None:
    """Add HAProxy's timers to each call's row: its log lines taken as the last len(calls) of the
    point, matched to the calls in the order they ended."""
    lines = lines[-len(calls) :] if calls else []
    if len(lines) != len(calls):
        return
    by_id = {row["id"]: row for row in rows}
    for (request_id, _, _), timers in zip(sorted(calls, key=lambda call: call[2]), lines):
        if request_id in by_id:
            by_id[request_id].update({f"haproxy_{name}": float(value) for name, value in timers.items()})


def summarize(rows: list[dict], slow_ms: float, worst: int = 10) -> dict:
    """Each hop's p50 / p99 / max over the calls, and the slowest calls (at most `worst`, all of
    those over `slow_ms` first) with their hops and the hop that took most of them."""
    names = [name for name in ("total", *(hop[0] for hop in HOPS)) if any(name in row for row in rows)]
    names += [f"haproxy_{t}" for t in HAPROXY_TIMERS if any(f"haproxy_{t}" in row for row in rows)]
    hops = {}
    for name in names:
        values = np.array([row[name] for row in rows if name in row])
        hops[name] = {
            "p50_ms": float(np.percentile(values, 50)),
            "p99_ms": float(np.percentile(values, 99)),
            "max_ms": float(values.max()),
        }
    slowest = sorted(rows, key=lambda row: row["total"], reverse=True)[:worst]
    for row in slowest:
        row["largest_hop"] = max((hop[0] for hop in HOPS if hop[0] in row), key=lambda name: row[name], default="")
    over = [row for row in rows if row["total"] > slow_ms]
    largest: dict[str, int] = {}
    for row in over:
        hop = max((h[0] for h in HOPS if h[0] in row), key=lambda name: row[name], default="")
        largest[hop] = largest.get(hop, 0) + 1
    return {"calls_traced": len(rows), "hops": hops, "slowest": slowest, "over_slow_by_largest_hop": largest}
