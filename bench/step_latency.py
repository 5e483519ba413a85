"""Step latency: what an engine that calls the sampler once per decode step waits, call by call.

    python -m bench.step_latency [--tiny] [--calls N] [--skip-itl] [--output PATH]
        [--rows B ...] [--concurrency C ...] [--paths grpc grpc_shm] [--front-door] [--hog N] [--hops]

An engine's rollout is as slow as its slowest steps, so this times every call, not a mean:
`calls` closed-loop calls of `rows` rows of V FP32 logits each (top_k 50 with a mask, only the
outputs a step reads requested), split evenly over `concurrency` clients (one thread and one gRPC
connection each), each sending its next call when the previous one is answered. Per point:
p50 / p99 / p99.9 / max, the calls over SLOW_MS, rows/s, and the server's own mean queue and
compute times. `make bench` runs B=1 and B=8 rows per call, V=151936, over gRPC with and without
system shared memory, at concurrency 1, 8 and 16, 10,000 calls each, on the served benchmark's
server, then the `generate` model's inter-token gaps at 32 concurrent streams
(bench/load/generate.py's closed-loop clients, streaming, masks on). Alone, this module starts a
server of its own.

The client is Python's tritonclient at every point: perf_analyzer 2.51's only per-request record,
its profile export, writes each request's input tensors as JSON numbers (gigabytes of logits
without shared memory) and, with shared memory, reads them from unset buffers, whose garbage
(NaN among it) leaves the file empty on most runs of a few hundred requests; its CSV
has no p99.9, no max and no count of slow calls.

Alone, three options make the busy-host case: `--front-door` sends the calls through a front door
of the server's own (HAProxy, as `make serve` runs it), `--hog N` runs N processes spinning at
normal priority beside the server during the step points (a busy neighbour), and `--hops` times
each call hop by hop (testbed/step_hops.py: tritonserver traces every request, the proxy logs
every call) and reports, per point, each hop's p50 / p99 / max, the slowest calls' hops, and the
time each process spent waiting for a CPU per call. The issue's case:

    python -m bench.step_latency --rows 1 --concurrency 1 --paths grpc --calls 2000 --skip-itl \
        --front-door --hog 2 --hops
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from testbed import step_hops
from testbed.cpu_hog import CpuHog
from testbed.fronted import FrontedTritonServer
from testbed.process_memory import cpu_seconds
from testbed.server import TritonServer
from testbed.step_calls import MODEL, SLOW_MS, STEP_OUTPUTS, STEP_PARAMS, closed_loop, latency_summary, make_step_logits

from . import report, served_call
from .common import MODEL_REPOSITORY, machine_facts, server_breakdown
from .load import generate as generate_load

GENERATE_MODEL = "generate"
PATHS = ("grpc", "grpc_shm")
# Points and sizes: full (`make bench`) and --tiny (a seconds-long check of the code path).
SIZES = {
    "full": {
        "vocab": 151936,
        "rows": (1, 8),
        "concurrency": (1, 8, 16),
        "calls": 10_000,
        "itl": {"streams": 32, "requests_per_stream": 2, "max_new_tokens": 128},
    },
    "tiny": {
        "vocab": 1000,
        "rows": (1, 8),
        "concurrency": (1, 2),
        "calls": 40,
        "itl": {"streams": 2, "requests_per_stream": 1, "max_new_tokens": 8},
    },
}
POOL = 32  # distinct logits arrays per point, cycled through


class HopRecorder:
    """`--hops`: per point, what each process spent waiting for a CPU and its CPU time, the calls'
    ids and times, and the proxy's log lines; joined with tritonserver's trace once it has stopped
    (its last trace file is written then)."""

    def __init__(self, processes: dict[str, list[int]], trace_path: Path, proxy_log: Path | None):
        self.processes, self.trace_path, self.proxy_log = processes, trace_path, proxy_log
        self.points: list[tuple[dict, list, list]] = []  # (entry, calls, proxy log lines)

    def _snapshot(self) -> dict:
        out = {}
        for name, pids in self.processes.items():
            whole = name != "client"  # the client's children are the hog's processes
            out[name] = (
                step_hops.run_delay_s(pids, descendants=whole),
                sum(cpu_seconds(pid, descendants=whole) for pid in pids),
            )
        return out

    def before(self) -> None:
        self._offset = self.proxy_log.stat().st_size if self.proxy_log and self.proxy_log.exists() else 0
        self._start = self._snapshot()

    def after(self, entry: dict, run) -> None:
        end, calls = self._snapshot(), max(1, len(run.calls))
        entry["per_call_ms"] = {
            name: {
                "waiting_for_cpu": 1e3 * (end[name][0] - self._start[name][0]) / calls,
                "cpu": 1e3 * (end[name][1] - self._start[name][1]) / calls,
            }
            for name in end
        }
        lines = []
        if self.proxy_log and self.proxy_log.exists():
            with self.proxy_log.open("rb") as log:
                log.seek(self._offset)
                lines = step_hops.read_haproxy_log(log.read().decode(errors="replace"), "be_grpc_infer")
        self.points.append((entry, run.calls, lines))

    def finish(self) -> None:
        traces = step_hops.read_trace(self.trace_path)
        for entry, calls, lines in self.points:
            rows = step_hops.call_hops(calls, traces)
            step_hops.join_haproxy(calls, rows, lines)
            entry["hops"] = step_hops.summarize(rows, SLOW_MS) if rows else {"calls_traced": 0}


def step_points(
    server, size: dict, calls: int | None = None, progress=print, hops: HopRecorder | None = None
) -> list[dict]:
    """Every rows x path x concurrency point of `size` (SIZES, or `paths` there) on `server`, which
    serves the shipped sampler (a FrontedTritonServer's calls go through its front door; its
    statistics are read from tritonserver itself)."""
    calls = calls or size["calls"]
    stats_server = getattr(server, "server", server)
    entries = []
    for rows in size["rows"]:
        logits = make_step_logits(POOL, rows, size["vocab"])
        for path in size.get("paths", PATHS):
            for concurrency in size["concurrency"]:
                before = served_call.model_statistics(stats_server, MODEL)
                if hops:
                    hops.before()
                run = closed_loop(
                    server.grpc_url,
                    logits,
                    calls,
                    concurrency,
                    shared_memory=path == "grpc_shm",
                    id_prefix=f"B{rows}-{path}-c{concurrency}",
                )
                entry = {
                    "rows": rows,
                    "path": path,
                    "concurrency": concurrency,
                    "client": "python",
                    **latency_summary(run.latencies_ms),
                    "rows_per_s": run.latencies_ms.size * rows / run.elapsed_s,
                    "server": server_breakdown(before, served_call.model_statistics(stats_server, MODEL)),
                }
                if hops:
                    hops.after(entry, run)
                entries.append(entry)
                progress(
                    f"  step B={rows} {path} c={concurrency}: {entry['calls']} calls, p50 {entry['p50_ms']:.2f} ms, "
                    f"p99 {entry['p99_ms']:.2f} ms, p99.9 {entry['p999_ms']:.1f} ms, max {entry['max_ms']:.1f} ms, "
                    f"{entry['over_slow']} over {SLOW_MS:.0f} ms, {entry['rows_per_s']:.0f} rows/s, "
                    f"server queue {entry['server']['queue_ms']:.2f} ms"
                )
    return entries


def itl_point(server, streams: int, requests_per_stream: int, max_new_tokens: int, progress=print) -> dict:
    """The `generate` model's inter-token gaps: `streams` closed-loop gRPC streams, each sending
    `requests_per_stream` streaming requests of `max_new_tokens` tokens (ignore_eos), one after the
    other. Loads the model first where the server has not (explicit model control)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if not client.is_model_ready(GENERATE_MODEL):
            client.load_model(GENERATE_MODEL)
    finally:
        client.close()
    generate_load.closed_loop(server.grpc_url, GENERATE_MODEL, np.full((2, 1), 8), stream=False)  # warm-up
    budgets = np.full((streams, requests_per_stream), max_new_tokens)
    stats = generate_load.closed_loop(server.grpc_url, GENERATE_MODEL, budgets, stream=True)
    if stats.errors:
        raise RuntimeError(f"generate streams failed ({len(stats.errors)}): {stats.errors[0]}")
    entry = {
        "streams": streams,
        "requests_per_stream": requests_per_stream,
        "max_new_tokens": max_new_tokens,
        "tokens": stats.tokens,
        "tokens_per_s": stats.tokens / stats.seconds,
        "ttft_p50_ms": float(np.percentile(stats.ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(stats.ttft, 99) * 1e3),
        **latency_summary(np.asarray(stats.itl) * 1e3),
    }
    progress(
        f"  generate ITL, {streams} streams: {entry['calls']} gaps, p50 {entry['p50_ms']:.1f} ms, "
        f"p99 {entry['p99_ms']:.1f} ms, max {entry['max_ms']:.1f} ms, {entry['over_slow']} over {SLOW_MS:.0f} ms; "
        f"{entry['tokens_per_s']:.0f} tokens/s"
    )
    return entry


def run_on_server(
    server, size: dict, calls: int | None = None, itl: bool = True, progress=print, hops: HopRecorder | None = None
) -> dict:
    """The step points, then (with `itl`) generate's inter-token gaps, on a running server that serves
    the shipped sampler (and loads `generate` when asked)."""
    out = {
        "vocab": size["vocab"],
        "params": STEP_PARAMS,
        "outputs": list(STEP_OUTPUTS),
        "calls_per_point": calls or size["calls"],
        "slow_ms": SLOW_MS,
        "client": "python",
        "points": step_points(server, size, calls, progress, hops),
    }
    if itl:
        out["itl"] = itl_point(server, **size["itl"], progress=progress)
    return out


def main(argv: list[str] | None = None) -> dict:
    """This benchmark alone, on a server of its own (`make bench` runs it on the served one)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="V=1000, concurrency 1 and 2, 40 calls per point")
    parser.add_argument("--calls", type=int, default=None, help="calls per point (default 10,000; tiny 40)")
    parser.add_argument("--skip-itl", action="store_true", help="no generate inter-token gaps")
    parser.add_argument("--rows", type=int, nargs="+", help="rows per call (default 1 8)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrent clients (default 1 8 16; tiny 1 2)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, help="paths (default both)")
    parser.add_argument("--front-door", action="store_true", help="call through a front door (HAProxy) of its own")
    parser.add_argument("--hog", type=int, default=0, metavar="N", help="N spinning processes beside the server")
    parser.add_argument("--hops", action="store_true", help="time each call hop by hop (tritonserver traces all)")
    parser.add_argument("--output", type=Path, default=None, help="write the results' JSON here")
    args = parser.parse_args(argv)
    size = dict(SIZES["tiny" if args.tiny else "full"])
    size.update({k: tuple(v) for k, v in (("rows", args.rows), ("concurrency", args.concurrency)) if v})
    size["paths"] = tuple(args.paths or PATHS)
    load_before = machine_facts()["load_average_1m"]
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        tmp = Path(tmp)
        repository = tmp / "model_repository"
        shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
        trace = tmp / "trace.json"
        extra_args = served_call.explicit_models([MODEL]) + (step_hops.trace_args(trace) if args.hops else [])
        if args.front_door:
            if args.hops:
                os.environ["PROXY_LOG_SAMPLE"] = "1"  # the proxy logs every call
            serving = FrontedTritonServer(repository, extra_args=extra_args, log_path=tmp / "tritonserver.log")
        else:
            serving = TritonServer(repository, extra_args=extra_args, log_path=tmp / "tritonserver.log")
        hops = None
        with serving as server, CpuHog(args.hog) as hog:
            if args.hops:
                tritonserver = getattr(server, "server", server)
                helpers = {helper.name: [helper.pid] for helper in getattr(server, "helpers", ())}
                processes = {
                    "client": [os.getpid()],
                    "tritonserver": [tritonserver.process.pid],
                    **{name: pids for name, pids in helpers.items() if name == "haproxy"},
                    **({"hog": hog.pids} if hog.pids else {}),
                }
                proxy_log = tritonserver.log_path.with_suffix(".proxy.log") if args.front_door else None
                hops = HopRecorder(processes, trace, proxy_log)
            results = run_on_server(server, size, args.calls, not args.skip_itl, hops=hops)
        if hops:
            hops.finish()
    results.update(front_door=args.front_door, hog_processes=args.hog)
    results["load_average_1m"] = {"before": load_before, "after": machine_facts()["load_average_1m"]}
    report.print_step_table(results)
    if hops:
        print_hops(results)
    report.print_verdicts(report.step_verdicts(results))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return results


def print_hops(results: dict) -> None:
    """Per point: each hop's p50 / p99 / max, the slowest calls hop by hop, and per process the CPU
    time and the time spent waiting for a CPU, per call."""
    for point in results["points"]:
        hops = point.get("hops", {})
        print(
            f"\nB={point['rows']} {point['path']} c={point['concurrency']}: {hops.get('calls_traced', 0)} calls traced"
            + (" through the front door" if results.get("front_door") else "")
            + (f", {results['hog_processes']} spinning processes beside" if results.get("hog_processes") else "")
        )
        for name, q in hops.get("hops", {}).items():
            print(f"  {name:>16}: p50 {q['p50_ms']:8.2f}  p99 {q['p99_ms']:8.2f}  max {q['max_ms']:8.2f} ms")
        for name, per_call in point.get("per_call_ms", {}).items():
            print(
                f"  {name:>16}: CPU {per_call['cpu']:6.2f} ms, waiting for a CPU {per_call['waiting_for_cpu']:6.2f} ms per call"
            )
        over = hops.get("over_slow_by_largest_hop")
        if over:
            print(f"  calls over {results['slow_ms']:.0f} ms by their largest hop: {over}")
        for row in hops.get("slowest", [])[:5]:
            cells = ", ".join(f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float) and k != "total")
            print(f"  slow call {row['id']}: {row['total']:.1f} ms ({cells})")


if __name__ == "__main__":
    main()
