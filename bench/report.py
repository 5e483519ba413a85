"""Turn benchmark results into the target verdicts, a terminal table, JSON and PNG plots (bench/plots.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import plots
from .common import paired_median_ratio

TARGETS = {
    "a": "ours >= 15x faster than the full-sort baseline at the headline case (masks on)",
    "b1": "B=1, V=151936, top_k=512: ours <= 1.5x the floor (topk + logsumexp)",
    "b2": "B=1, V=32000, top_k=512: ours <= 2x the floor (topk + logsumexp)",
    "b3": "B=64, V=151936, top_k=512: ours <= 1.0x the floor (topk + logsumexp)",
    # The decode step's usual top_k, where a call's fixed cost shows most (a fresh batch per call).
    "b1_k50": "B=1, V=151936, top_k=50: ours <= 1.5x the floor (topk + logsumexp)",
    "b2_k50": "B=1, V=32000, top_k=50: ours <= 2x the floor (topk + logsumexp)",
    "c": "masks on <= 1.15x masks off",
    "d": "served via gRPC + system shared memory >= 50% of in-process rows/s at concurrency 16",
    # Issue 13, on the one-call table (bench/served_call.py).
    "e": "BF16 over gRPC <= 0.6x the FP32 gRPC time (one call, p50)",
    "f": "gRPC + system shared memory <= 1.5x in-process (one call, FP32, p50 over the in-process median)",
    "f_bf16": "the same with BF16 logits, the engines' own dtype (the Python backend copies every FP32 input once "
    "more before execute; BF16 arrives through DLPack without that copy)",
    "g": "masks on with per-support log-probs requested <= 1.10x without, in-process (the sampler computes "
    "them either way: the ratio is what asking for them costs)",
    # On the step-latency table (bench/step_latency.py).
    "h": "step latency: no call over 200 ms in any point (B=1 and B=8 rows per call, gRPC with and without "
    "system shared memory, each concurrency)",
    "i": "step latency: p99 <= 3x p50 in every point",
}
# p99 / p50 of a step-latency point may be at most this (target i).
STEP_TAIL_RATIO = 3.0
# The floor targets: (B, V, top_k) of the case, and the largest ours/floor (masks on) that meets it.
FLOOR_TARGETS = {
    "b1": ((1, 151936, 512), 1.5),
    "b2": ((1, 32000, 512), 2.0),
    "b3": ((64, 151936, 512), 1.0),
    "b1_k50": ((1, 151936, 50), 1.5),
    "b2_k50": ((1, 32000, 50), 2.0),
}
# Where a grid lacks a floor target's case (--tiny), the stand-in takes, per dimension, the grid's
# smallest value if the target's is the smallest of this reference grid, else the grid's largest.
_REFERENCE_GRID = {"rows": (1, 8, 64), "vocab": (32000, 151936), "top_k": (50, 512)}


def headline_case(kernel: list[dict]) -> dict:
    """The largest fp32 case (B=64, V=151936, top_k=512 on the full grid)."""
    fp32 = [c for c in kernel if c["logits"] == "fp32"]
    return max(fp32, key=lambda c: (c["rows"] * c["vocab"], c["top_k"]))


def floor_target_case(kernel: list[dict], rows: int, vocab: int, top_k: int) -> tuple[dict, bool]:
    """The fp32 case a floor target reads, and whether it is a stand-in (the grid lacks the case)."""
    fp32 = [c for c in kernel if c["logits"] == "fp32"]
    for c in fp32:
        if (c["rows"], c["vocab"], c["top_k"]) == (rows, vocab, top_k):
            return c, False
    want = {}
    for dim, value in (("rows", rows), ("vocab", vocab), ("top_k", top_k)):
        values = sorted({c[dim] for c in fp32})
        want[dim] = values[0] if value <= min(_REFERENCE_GRID[dim]) else values[-1]
    return next(c for c in fp32 if all(c[dim] == v for dim, v in want.items())), True


def call_verdicts(call: dict) -> dict:
    """Targets (e), (f), (g) on the one-call table, each on its ratio (p50 per call; in-process medians)."""
    served = {(e["path"], e["logits"]): e for e in call["served"] if not e.get("noop")}
    ip = call["in_process"]
    case = f"B={call['rows']} V={call['vocab']}"
    bf16 = served["grpc", "bf16"]["p50_ms"] / served["grpc", "fp32"]["p50_ms"]
    shm = served["grpc_shm", "fp32"]["p50_ms"] / ip["ms"]["fp32"]
    shm_bf16 = served["grpc_shm", "bf16"]["p50_ms"] / ip["ms"]["bf16"]
    # The no-op model's time is the Python backend's own cost for these bytes: 1 + noop / in-process
    # is the lowest ratio any sampler could reach through this backend.
    noop = {e["logits"]: e["p50_ms"] for e in call["served"] if e.get("noop")}
    lowest = {d: 1 + noop[d] / ip["ms"][d] if d in noop else None for d in ("fp32", "bf16")}

    def shm_case(dtype: str) -> str:
        reach = f"; no-op model alone: 1 + {lowest[dtype] - 1:.2f}" if lowest[dtype] is not None else ""
        return f"{case} ({dtype}{reach})"

    return {
        "e": {
            "target": TARGETS["e"],
            "case": case + " over gRPC",
            "value": bf16,
            "threshold": 0.6,
            "met": bf16 <= 0.6,
            "of_means": served["grpc", "bf16"]["mean_ms"] / served["grpc", "fp32"]["mean_ms"],
            "paired_median": _paired_rounds(served["grpc", "bf16"], served["grpc", "fp32"]),
            "http": served["http", "bf16"]["p50_ms"] / served["http", "fp32"]["p50_ms"],
        },
        "f": {
            "target": TARGETS["f"],
            "case": shm_case("fp32"),
            "value": shm,
            "threshold": 1.5,
            "met": shm <= 1.5,
            "http_shm": served["http_shm", "fp32"]["p50_ms"] / ip["ms"]["fp32"],
            "lowest_reachable": lowest["fp32"],
        },
        "f_bf16": {
            "target": TARGETS["f_bf16"],
            "case": shm_case("bf16"),
            "value": shm_bf16,
            "threshold": 1.5,
            "met": shm_bf16 <= 1.5,
            "http_shm": served["http_shm", "bf16"]["p50_ms"] / ip["ms"]["bf16"],
            "lowest_reachable": lowest["bf16"],
        },
        "g": {
            "target": TARGETS["g"],
            "case": case + " (fp32)",
            "value": ip["support_logprobs_ratio"],
            "paired_median": ip["support_logprobs_paired"],
            "best_of_rounds": ip["support_logprobs_best_of"],
            "threshold": 1.10,
            "met": ip["support_logprobs_ratio"] <= 1.10,
        },
    }


def _step_name(point: dict) -> str:
    return f"B={point['rows']} {point['path']} c={point['concurrency']}"


def step_verdicts(step: dict) -> dict:
    """Targets (h) and (i) on the step-latency table: the worst point of each."""
    points = step["points"]
    slowest = max(points, key=lambda p: p["over_slow"])
    tail = max(points, key=lambda p: p["p99_ms"] / p["p50_ms"])
    return {
        "h": {
            "target": TARGETS["h"],
            "case": f"{_step_name(slowest)}, {slowest['calls']} calls; {sum(p['over_slow'] for p in points)} in all",
            "value": slowest["over_slow"],
            "threshold": 0,
            "met": slowest["over_slow"] == 0,
        },
        "i": {
            "target": TARGETS["i"],
            "case": _step_name(tail),
            "value": tail["p99_ms"] / tail["p50_ms"],
            "threshold": STEP_TAIL_RATIO,
            "met": tail["p99_ms"] / tail["p50_ms"] <= STEP_TAIL_RATIO,
        },
    }


def _paired_rounds(numerator: dict, denominator: dict) -> float | None:
    """The median over interleaved rounds of one point's p50 over another's (None with one round)."""
    numerators, denominators = numerator.get("round_p50_ms", []), denominator.get("round_p50_ms", [])
    return paired_median_ratio(numerators, denominators) if min(len(numerators), len(denominators)) > 1 else None


def verdicts(kernel: list[dict], served: dict | None, call: dict | None = None, step: dict | None = None) -> dict:
    """Each target as measured: the value at its case (ratio of medians), the median of per-round
    ratios and the best-of-rounds ratio where the timing gives them, and pass/fail (on the value)."""
    head = headline_case(kernel)
    worst_floor = max(kernel, key=lambda c: c["ours_over_floor_mask"])
    worst_mask = max(kernel, key=lambda c: c["mask_on_over_off"])
    out = {"a": _case_verdict("a", head, "speedup_vs_baseline_mask", 15.0, at_least=True)}
    out["a"]["nomask"] = head["speedup_vs_baseline_nomask"]
    for key, ((rows, vocab, top_k), threshold) in FLOOR_TARGETS.items():
        case, stand_in = floor_target_case(kernel, rows, vocab, top_k)
        out[key] = _case_verdict(key, case, "ours_over_floor_mask", threshold, at_least=False)
        out[key]["nomask"] = case["ours_over_floor_nomask"]
        out[key]["stand_in"] = stand_in
    out["b3"]["worst"], out["b3"]["worst_case"] = worst_floor["ours_over_floor_mask"], _case_name(worst_floor)
    out["c"] = _case_verdict("c", head, "mask_on_over_off", 1.15, at_least=False)
    out["c"]["worst"], out["c"]["worst_case"] = worst_mask["mask_on_over_off"], _case_name(worst_mask)
    if served:
        top = max(e["concurrency"] for e in served["served"])
        shm_rate = next(
            e["rows_per_s"] for e in served["served"] if e["protocol"] == "grpc_shm" and e["concurrency"] == top
        )
        in_process = {e["rows_per_call"]: e["rows_per_s"] for e in served["in_process"]}
        batched = in_process.get(top, max(in_process.values()))
        out["d"] = {
            "target": TARGETS["d"],
            "concurrency": top,
            "value": shm_rate / batched,
            "vs_one_row_per_call": shm_rate / in_process[1],
            "threshold": 0.5,
            "met": shm_rate / batched >= 0.5,
        }
    if call:
        out.update(call_verdicts(call))
    if step:
        out.update(step_verdicts(step))
    return out


def _case_verdict(key: str, case: dict, ratio: str, threshold: float, at_least: bool) -> dict:
    value = case[ratio]
    return {
        "target": TARGETS[key],
        "case": _case_name(case),
        "value": value,
        "paired_median": case.get("paired", {}).get(ratio),
        "best_of_rounds": case["best_of"][ratio],
        "threshold": threshold,
        "met": value >= threshold if at_least else value <= threshold,
    }


def _case_name(case: dict) -> str:
    return f"B={case['rows']} V={case['vocab']} top_k={case['top_k']} ({case['logits']})"


def print_tables(results: dict) -> None:
    """The kernel table, the served table and the verdicts, on stdout."""
    print(
        f"\nKernel, device={results['device']}, medians in ms ({results['machine']['cpu']}, "
        f"{results['machine']['torch_threads']} threads)"
    )
    print(
        f"{'B':>3} {'V':>7} {'k':>4} {'logits':>12} | {'ours+m':>8} {'ours':>8} {'base+m':>9} {'base':>9} "
        f"{'floor':>8} | {'base/ours':>9} {'ours/flr':>8} {'on/off':>6} | best-of: {'b/o':>6} {'o/f':>5} {'on/off':>6}"
    )
    for c in results["kernel"]:
        ms = c["ms"]
        print(
            f"{c['rows']:>3} {c['vocab']:>7} {c['top_k']:>4} {c['logits']:>12} | {ms['ours_mask']:>8.2f} "
            f"{ms['ours_nomask']:>8.2f} {ms['baseline_mask']:>9.2f} {ms['baseline_nomask']:>9.2f} "
            f"{ms['floor']:>8.2f} | {c['speedup_vs_baseline_mask']:>9.1f} {c['ours_over_floor_mask']:>8.2f} "
            f"{c['mask_on_over_off']:>6.2f} |          {c['best_of']['speedup_vs_baseline_mask']:>6.1f} "
            f"{c['best_of']['ours_over_floor_mask']:>5.2f} {c['best_of']['mask_on_over_off']:>6.2f}"
        )
    if any("rival_over_ours" in c for c in results["kernel"]):
        print(
            f"\nRivals, medians in ms; ratio = rival / ours with the same outputs asked "
            f"(> 1: ours is faster); flashinfer: {results.get('flashinfer', 'not timed')}"
        )
        columns = _rival_columns(results["kernel"])
        print(
            f"{'B':>3} {'V':>7} {'k':>4} {'logits':>12} | "
            + " ".join(f"{title:>10}" for title, _ in columns)
            + " | "
            + " ".join(f"{title + '/o':>12}" for title, name in columns if name in _RIVALS)
        )
        for c in results["kernel"]:
            times = " ".join(f"{c['ms'][name]:>10.3f}" if name in c["ms"] else f"{'-':>10}" for _, name in columns)
            ratios = " ".join(
                f"{c['rival_over_ours'][name]:>12.2f}" if name in c.get("rival_over_ours", {}) else f"{'-':>12}"
                for _, name in columns
                if name in _RIVALS
            )
            print(f"{c['rows']:>3} {c['vocab']:>7} {c['top_k']:>4} {c['logits']:>12} | {times} | {ratios}")
    top_p = results.get("top_p")
    if top_p:
        print(f"\n{_top_p_title(top_p)}")
        for name, ms in top_p["ms"].items():
            ratio = (
                ""
                if name == "ours"
                else (
                    f"  {top_p['over_ours'][name]:.2f}x ours (best-of-rounds {top_p['over_ours_best_of'][name]:.2f}x)"
                )
            )
            print(f"  {name:>10} {ms:>10.2f} ms (best {top_p['min_ms'][name]:.2f}){ratio}")
    served = results.get("served")
    if served:
        print(f"\nServed, B=1 rows of V={served['vocab']}, {served['row_params']}")
        print(f"{'path':>12} {'conc':>5} | {'rows/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}")
        for e in served["in_process"]:
            print(
                f"{'in_process':>12} {e['rows_per_call']:>4}r | {e['rows_per_s']:>8.1f} {e['p50_ms']:>8.2f} "
                f"{e['p99_ms']:>8.2f} {e['requests']:>8}"
            )
        for e in served["served"]:
            print(
                f"{e['protocol']:>12} {e['concurrency']:>5} | {e['rows_per_s']:>8.1f} {e['p50_ms']:>8.2f} "
                f"{e['p99_ms']:>8.2f} {e['requests']:>8}"
            )
    if results.get("served_call"):
        print_call_table(results["served_call"])
    if results.get("step_latency"):
        print_step_table(results["step_latency"])
    print("\nTargets")
    print_verdicts(results["targets"])


def one_table_args(description: str, argv: list[str] | None, quick: str, rounds: str) -> argparse.Namespace:
    """A one-table benchmark's command line: --quick (what it does, `quick`), --rounds (`rounds`)
    and --output (the JSON)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--rounds", type=int, default=None, help=rounds)
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    return parser.parse_args(argv)


def publish(cost: dict, targets: dict, output: Path | None) -> dict:
    """A one-table benchmark's end: `cost` with its `targets` (verdicts) and the load average,
    the verdicts printed, the JSON written to `output` when given; returns `cost`."""
    from .common import machine_facts

    cost.update(targets=targets, load_average_1m=machine_facts()["load_average_1m"])
    print_verdicts(targets)
    if output:
        output.write_text(json.dumps(cost, indent=2) + "\n")
    return cost


def print_verdicts(targets: dict) -> None:
    """One line per target: met or missed, the value (with its best-of-rounds and paired median
    where measured), the threshold, and the case it was read at."""
    for key, v in targets.items():
        best = f", best-of-rounds {v['best_of_rounds']:.3f}" if "best_of_rounds" in v else ""
        best += f", paired median {v['paired_median']:.3f}" if v.get("paired_median") else ""
        where = f" [at {v['case']}{', stand-in' if v.get('stand_in') else ''}]" if "case" in v else ""
        print(
            f"  ({key}) {'MET ' if v['met'] else 'MISS'} {v['value']:.3f}{best} (threshold {v['threshold']}): "
            f"{v['target']}{where}"
        )


def _call_title(call: dict) -> str:
    bw = call["memcpy"]
    return (
        f"Served call: one request of B={call['rows']} x V={call['vocab']}, {call['params']}, seeded, every output "
        f"sent; client {call['client']} ({call['perf_analyzer']}), {call['requests_per_point']} calls per point "
        f"at concurrency 1 in {call.get('rounds', 1)} interleaved rounds, p50 = ms per call (median of the rounds' "
        f"medians). memcpy {bw['bytes_per_s'] / 1e9:.1f} GB/s (numpy copy of "
        f"{bw['bytes'] / 1e6:.1f} MB, best of {bw['repeats']}); floor = MB moved (request + response tensors) / "
        f"memcpy bandwidth; /in-proc = p50 / in-process median (same dtype); copies = (p50 - in-process) / floor; "
        f"srv input / infer = the server's compute_input (Triton's copy into the Python stub) and compute_infer "
        f"(the stub's execute, and for non-BF16 inputs its own copy before it); the no-op model reads nothing"
    )


def _call_rows(call: dict) -> list[list[str]]:
    """The call table's cells: in-process rows, then every served point."""
    ip = call["in_process"]
    rows = []
    for name, ms in ip["ms"].items():
        dtype, note = name.split("_", 1)[0], (" (no support logprobs)" if "no_support" in name else "")
        rows.append(
            [
                f"in_process{note}",
                dtype,
                "-",
                f"{ms:.1f}",
                f"{ip['min_ms'][name]:.1f} (best)",
                "-",
                f"{call['bytes'][dtype]['payload'] / 1e6:.1f}",
                "0",
                "-",
                "1.00",
                "-",
                "-",
                "-",
            ]
        )
    for e in call["served"]:
        server = e.get("server", {})
        noop = e.get("noop", False)
        rows.append(
            [
                e["path"] + (" no-op model" if noop else ""),
                e["logits"],
                e["client"],
                f"{e['p50_ms']:.1f}",
                f"{e['mean_ms']:.1f}",
                f"{e['p99_ms']:.1f}",
                f"{e['bytes']['payload'] / 1e6:.1f}",
                f"{e['socket_bytes'] / 1e6:.1f}",
                f"{e['floor_ms']:.2f}",
                "-" if noop else f"{e['over_in_process']:.2f}",
                "-" if noop else f"{e['copies_over_in_process']:.1f}",
                f"{server['compute_input_ms']:.1f}" if server else "-",
                f"{server['compute_infer_ms']:.1f}" if server else "-",
            ]
        )
    return rows


_CALL_HEADER = [
    "path",
    "logits",
    "client",
    "p50 ms",
    "mean ms",
    "p99 ms",
    "MB moved",
    "MB socket",
    "floor ms",
    "/in-proc",
    "copies",
    "srv input ms",
    "srv infer ms",
]


def print_call_table(call: dict) -> None:
    """The one-call B=64 table on stdout."""
    print(f"\n{_call_title(call)}")
    widths = [32, 6, 13, 8, 13, 7, 8, 9, 8, 8, 6, 12, 12]
    print(" ".join(f"{h:>{w}}" for h, w in zip(_CALL_HEADER, widths)))
    for cells in _call_rows(call):
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


def _step_title(step: dict) -> str:
    return (
        f"Step latency: {step['calls_per_point']} closed-loop calls per point, each of B rows of V={step['vocab']} "
        f"FP32 logits ({step['params']}, outputs {', '.join(step['outputs'])}), split over `conc` Python clients; "
        f"ms per call; > {step['slow_ms']:.0f} = calls over {step['slow_ms']:.0f} ms; queue = the server's mean "
        f"queue ms per request"
    )


_STEP_HEADER = ["B", "path", "conc", "calls", "p50", "p99", "p99.9", "max", "over", "rows/s", "queue"]


def _step_header(step: dict) -> list[str]:
    return [f"> {step['slow_ms']:.0f}" if h == "over" else h for h in _STEP_HEADER]


def _step_rows(step: dict) -> list[list[str]]:
    return [
        [
            str(p["rows"]),
            p["path"],
            str(p["concurrency"]),
            str(p["calls"]),
            f"{p['p50_ms']:.2f}",
            f"{p['p99_ms']:.2f}",
            f"{p['p999_ms']:.1f}",
            f"{p['max_ms']:.1f}",
            str(p["over_slow"]),
            f"{p['rows_per_s']:.0f}",
            f"{p['server']['queue_ms']:.2f}",
        ]
        for p in step["points"]
    ]


def _itl_line(itl: dict, slow_ms: float) -> str:
    return (
        f"generate, {itl['streams']} streams x {itl['requests_per_stream']} streaming requests of "
        f"{itl['max_new_tokens']} tokens: inter-token gap p50 {itl['p50_ms']:.1f} ms, p99 {itl['p99_ms']:.1f} ms, "
        f"p99.9 {itl['p999_ms']:.1f} ms, max {itl['max_ms']:.1f} ms, {itl['over_slow']} of {itl['calls']} gaps over "
        f"{slow_ms:.0f} ms; TTFT p50 {itl['ttft_p50_ms']:.0f} ms, p99 {itl['ttft_p99_ms']:.0f} ms; "
        f"{itl['tokens_per_s']:.0f} tokens/s"
    )


def print_step_table(step: dict) -> None:
    """The step-latency table (and generate's inter-token gaps) on stdout."""
    print(f"\n{_step_title(step)}")
    widths = [3, 9, 5, 6, 8, 8, 8, 8, 6, 7, 7]
    print(" ".join(f"{h:>{w}}" for h, w in zip(_step_header(step), widths)))
    for cells in _step_rows(step):
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    if step.get("itl"):
        print(_itl_line(step["itl"], step["slow_ms"]))


# Timed functions of the gpu grid beyond the five of every grid, in table order, with short titles.
_RIVALS = {
    "ours_plain_mask": "plain+m",
    "vllm_nomask": "vllm",
    "flashinfer_nomask": "flashinfer",
    "baseline_nomask": "sglang",
}


def _rival_columns(kernel: list[dict]) -> list[tuple[str, str]]:
    """(title, function) of the rivals table: ours (fused where it runs), the rivals present, the floor."""
    present = {name for c in kernel for name in c["ms"]}
    columns = [("ours+m", "ours_mask"), ("ours", "ours_nomask")]
    columns += [(title, name) for name, title in _RIVALS.items() if name in present]
    return columns + [("floor", "floor")]


def _top_p_title(top_p: dict) -> str:
    return (
        f"Top-p without a mask: B={top_p['rows']} V={top_p['vocab']}, temperature {top_p['temperature']}, "
        f"top_p {top_p['top_p']}, top_k -1; ours ranks {top_p['candidates']} candidates first "
        f"({top_p['fallback_rows']} of {top_p['rows']} rows fall back to a full sort); previous = the same "
        f"call with _TOP_P_CANDIDATES >= V (full sort in row blocks); medians in ms"
    )


def write_json(results: dict, path: Path) -> None:
    """Write through a temporary file and a rename: a run killed mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(path)


def plot(results: dict, path: Path) -> list[Path]:
    """Bars of the three kernel ratios per case and the served/in-process fraction, with targets, at
    `path`; beside it bench/plots.py's figures (named with the same prefix: `gpu_` for gpu_ratios.png),
    speculative decoding's from the run's own results (`speculative_of`). The files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernel = results["kernel"]
    labels = [
        f"B{c['rows']} V{c['vocab'] // 1000}k k{c['top_k']}{' bf16' if c['logits'] != 'fp32' else ''}" for c in kernel
    ]
    panels = [
        ("speedup_vs_baseline_mask", "baseline / ours (masks on)", 15.0, True),
        ("ours_over_floor_mask", "ours / floor (masks on)", None, False),
        ("mask_on_over_off", "ours: masks on / off", 1.15, False),
    ]
    served = results.get("served")
    call = results.get("served_call")
    panels_count = 3 + bool(served) + bool(call)
    fig, axes = plt.subplots(1, panels_count, figsize=(5.5 * panels_count, 5))
    for ax, (key, title, threshold, log) in zip(axes, panels):
        ax.bar(range(len(kernel)), [c[key] for c in kernel], color="tab:blue")
        if threshold is None:  # the floor targets: one line each, at its threshold
            colors = ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink")
            for (name, (case, limit)), color in zip(FLOOR_TARGETS.items(), colors, strict=True):
                label = f"({name}) B{case[0]} V{case[1] // 1000}k k{case[2]}: {limit}"
                ax.axhline(limit, color=color, linestyle="--", label=label)
        else:
            ax.axhline(threshold, color="tab:red", linestyle="--", label=f"target {threshold}")
        ax.set_xticks(range(len(kernel)), labels, rotation=70, fontsize=7)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    if served:
        ax = axes[3]
        in_process = {e["rows_per_call"]: e["rows_per_s"] for e in served["in_process"]}
        for offset, protocol in enumerate(("http", "grpc", "grpc_shm")):
            entries = [e for e in served["served"] if e["protocol"] == protocol]
            xs = [i + (offset - 1) * 0.27 for i in range(len(entries))]
            ax.bar(
                xs,
                [e["rows_per_s"] / in_process.get(e["concurrency"], in_process[1]) for e in entries],
                width=0.27,
                label=protocol,
            )
        ax.set_xticks(range(len(entries)), [f"c={e['concurrency']}" for e in entries])
        ax.axhline(0.5, color="tab:red", linestyle="--", label="target 0.5 (grpc_shm, c=16)")
        ax.set_title("served rows/s / in-process rows/s")
        ax.legend(fontsize=8)
    if call:
        ax = axes[-1]
        points = [e for e in call["served"] if not e.get("noop")]
        colors = {"fp32": "tab:blue", "bf16": "tab:orange"}
        ax.bar(range(len(points)), [e["p50_ms"] for e in points], color=[colors[e["logits"]] for e in points])
        for dtype, color in colors.items():
            ax.axhline(call["in_process"]["ms"][dtype], color=color, linestyle="--", label=f"in-process {dtype}")
        ax.axhline(
            1.5 * call["in_process"]["ms"]["fp32"], color="tab:red", linestyle=":", label="(f) 1.5x in-process fp32"
        )
        ax.set_xticks(range(len(points)), [f"{e['path']} {e['logits']}" for e in points], rotation=70, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"one call B={call['rows']} V={call['vocab']}: p50 ms")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"triton-sampling-mask on {results['machine']['cpu']} ({results['device']}, "
        f"{results['machine']['torch_threads']} threads)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [
        path,
        *plots.render(results, path.parent, path.stem.removesuffix("ratios"), speculative_of(results, path.parent)),
    ]


def speculative_of(results: dict, directory: Path) -> dict | None:
    """The run's speculative-decoding results, else those of a `speculative.json` in `directory`
    (written by `python -m bench.load.speculative --output`), else None."""
    if results.get("speculative"):
        return results["speculative"]
    saved = Path(directory) / "speculative.json"
    return json.loads(saved.read_text()) if saved.exists() else None


def _speculative_rows(speculative: dict) -> list[list[str]]:
    """A row per workload and number of streams: both algorithms' tokens/s and their ratio."""
    rate = {(p["workload"], p["streams"], p["algorithm"]): p["tokens_per_s"] for p in speculative["points"]}
    return [
        [
            r["workload"],
            str(r["streams"]),
            f"{rate[r['workload'], r['streams'], 'none']:.0f}",
            f"{rate[r['workload'], r['streams'], 'ngram']:.0f}",
            f"{r['ngram_over_none']:.2f}",
        ]
        for r in speculative.get("ratios", [])
    ]


def _markdown_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A titled markdown table's lines, a blank line before the title and before the table."""
    return ["", title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cells) + " |" for cells in rows
    ]


def markdown_summary(results: dict) -> str:
    """The committed results as markdown tables (bench/results/latest.md; bench/README.md quotes the targets)."""
    m = results["machine"]
    lines = [
        f"Measured {results['timestamp']} on {m['cpu']}, {m['cpu_cores']} cores, torch {m['torch']} "
        f"with {m['torch_threads']} threads, device `{results['device']}`; 1-min load average "
        f"{m['load_average_1m']:.1f} before, {m.get('load_average_1m_after', float('nan')):.1f} after. {results.get('note', '')}",
        "",
        "| B | V | top_k | logits | ours (mask) ms | ours (no mask) ms | baseline (mask) ms | floor ms "
        "| baseline/ours | ours/floor | mask on/off | best-of: baseline/ours, ours/floor, on/off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["kernel"]:
        ms, b = c["ms"], c["best_of"]
        lines.append(
            f"| {c['rows']} | {c['vocab']} | {c['top_k']} | {c['logits']} | {ms['ours_mask']:.2f} | {ms['ours_nomask']:.2f} "
            f"| {ms['baseline_mask']:.1f} | {ms['floor']:.2f} | {c['speedup_vs_baseline_mask']:.1f}x "
            f"| {c['ours_over_floor_mask']:.2f} | {c['mask_on_over_off']:.2f} "
            f"| {b['speedup_vs_baseline_mask']:.1f}x, {b['ours_over_floor_mask']:.2f}, {b['mask_on_over_off']:.2f} |"
        )
    if any("rival_over_ours" in c for c in results["kernel"]):
        columns = _rival_columns(results["kernel"])
        ratio_columns = [(title, name) for title, name in columns if name in _RIVALS]
        lines += [
            "",
            f"Rivals (medians, ms; rival/ours with the same outputs asked, > 1: ours is faster; "
            f"flashinfer: {results.get('flashinfer', 'not timed')}):",
            "",
            "| B | V | top_k | logits | "
            + " | ".join(f"{t} ms" for t, _ in columns)
            + " | "
            + " | ".join(f"{t}/ours" for t, _ in ratio_columns)
            + " |",
            "|" + "---|" * (4 + len(columns) + len(ratio_columns)),
        ]
        for c in results["kernel"]:
            times = " | ".join(f"{c['ms'][n]:.3f}" if n in c["ms"] else "-" for _, n in columns)
            ratios = " | ".join(
                f"{c['rival_over_ours'][n]:.2f}" if n in c.get("rival_over_ours", {}) else "-" for _, n in ratio_columns
            )
            lines.append(f"| {c['rows']} | {c['vocab']} | {c['top_k']} | {c['logits']} | {times} | {ratios} |")
    top_p = results.get("top_p")
    if top_p:
        rows = []
        for name, ms in top_p["ms"].items():
            over = "1" if name == "ours" else f"{top_p['over_ours'][name]:.2f}"
            best = "1" if name == "ours" else f"{top_p['over_ours_best_of'][name]:.2f}"
            rows.append([name, f"{ms:.2f}", f"{top_p['min_ms'][name]:.2f}", over, best])
        lines += _markdown_table(
            _top_p_title(top_p) + ".", ["function", "median ms", "best ms", "median / ours", "best / ours"], rows
        )
    served = results.get("served")
    if served:
        lines += [
            "",
            f"Served: B=1 rows of V={served['vocab']}, {served['row_params']}, "
            f"{served['duration_s']:.0f} s per point, closed loop.",
            "",
            "| path | concurrency / rows per call | rows/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|",
        ]
        for e in served["in_process"]:
            lines.append(
                f"| in-process | {e['rows_per_call']} rows/call | {e['rows_per_s']:.0f} | {e['p50_ms']:.2f} | {e['p99_ms']:.2f} |"
            )
        for e in served["served"]:
            lines.append(
                f"| {e['protocol']} | {e['concurrency']} | {e['rows_per_s']:.0f} | {e['p50_ms']:.2f} | {e['p99_ms']:.2f} |"
            )
    call = results.get("served_call")
    if call:
        lines += _markdown_table(_call_title(call) + ".", _CALL_HEADER, _call_rows(call))
    step = results.get("step_latency")
    if step:
        lines += _markdown_table(_step_title(step) + ".", _step_header(step), _step_rows(step))
        if step.get("itl"):
            lines += ["", _itl_line(step["itl"], step["slow_ms"]) + "."]
    speculative = results.get("speculative")
    if speculative:
        lines += _markdown_table(
            'Speculative decoding (`generate`, "ngram" against plain decoding, streaming; bench/load/speculative.py).',
            ["workload", "streams", "plain tokens/s", "ngram tokens/s", "ngram / plain (median of rounds)"],
            _speculative_rows(speculative),
        )
    lines += [
        "",
        "| target | case | measured (ratio of medians) | median of per-round ratios | best-of-rounds "
        "| met (ratio of medians) |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in results["targets"].items():
        best = f"{v['best_of_rounds']:.2f}" if "best_of_rounds" in v else "-"
        paired = f"{v['paired_median']:.2f}" if v.get("paired_median") else "-"
        case = v.get("case", "-") + (" (stand-in)" if v.get("stand_in") else "")
        lines.append(
            f"| ({key}) {v['target']} | {case} | {v['value']:.2f} | {paired} | {best} | {'yes' if v['met'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
