"""Turn benchmark results into the target verdicts, a terminal table, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = {
    "a": "ours >= 15x faster than the full-sort baseline at the headline case (masks on)",
    "b": "ours <= 1.3x the floor (topk + logsumexp)",
    "c": "masks on <= 1.15x masks off",
    "d": "served via gRPC + system shared memory >= 50% of in-process rows/s at concurrency 16",
}


def headline_case(kernel: list[dict]) -> dict:
    """The largest fp32 case (B=64, V=151936, top_k=512 on the full grid)."""
    fp32 = [c for c in kernel if c["logits"] == "fp32"]
    return max(fp32, key=lambda c: (c["rows"] * c["vocab"], c["top_k"]))


def verdicts(kernel: list[dict], served: dict | None) -> dict:
    """Each target as measured: the value at the headline case, the worst case, and pass/fail."""
    head = headline_case(kernel)
    worst_floor = max(kernel, key=lambda c: c["ours_over_floor_mask"])
    worst_mask = max(kernel, key=lambda c: c["mask_on_over_off"])
    out = {
        "a": {"value": head["speedup_vs_baseline_mask"], "nomask": head["speedup_vs_baseline_nomask"],
              "threshold": 15.0, "met": head["speedup_vs_baseline_mask"] >= 15.0},
        "b": {"value": head["ours_over_floor_mask"], "nomask": head["ours_over_floor_nomask"],
              "worst": worst_floor["ours_over_floor_mask"], "worst_case": _case_name(worst_floor),
              "threshold": 1.3, "met": head["ours_over_floor_mask"] <= 1.3},
        "c": {"value": head["mask_on_over_off"], "worst": worst_mask["mask_on_over_off"],
              "worst_case": _case_name(worst_mask), "threshold": 1.15, "met": head["mask_on_over_off"] <= 1.15},
    }
    for key, ratio in (("a", "speedup_vs_baseline_mask"), ("b", "ours_over_floor_mask"), ("c", "mask_on_over_off")):
        out[key]["target"], out[key]["case"] = TARGETS[key], _case_name(head)
        out[key]["best_of_rounds"] = head["best_of"][ratio]
        out[key]["paired_median"] = head.get("paired", {}).get(ratio)
    if served:
        top = max(e["concurrency"] for e in served["served"])
        shm_rate = next(e["rows_per_s"] for e in served["served"] if e["protocol"] == "grpc_shm" and e["concurrency"] == top)
        in_process = {e["rows_per_call"]: e["rows_per_s"] for e in served["in_process"]}
        batched = in_process.get(top, max(in_process.values()))
        out["d"] = {"target": TARGETS["d"], "concurrency": top, "value": shm_rate / batched,
                    "vs_one_row_per_call": shm_rate / in_process[1], "threshold": 0.5,
                    "met": shm_rate / batched >= 0.5}
    return out


def _case_name(case: dict) -> str:
    return f"B={case['rows']} V={case['vocab']} top_k={case['top_k']} ({case['logits']})"


def print_tables(results: dict) -> None:
    """The kernel table, the served table and the verdicts, on stdout."""
    print(f"\nKernel, device={results['device']}, medians in ms ({results['machine']['cpu']}, "
          f"{results['machine']['torch_threads']} threads)")
    print(f"{'B':>3} {'V':>7} {'k':>4} {'logits':>12} | {'ours+m':>8} {'ours':>8} {'base+m':>9} {'base':>9} "
          f"{'floor':>8} | {'base/ours':>9} {'ours/flr':>8} {'on/off':>6} | best-of: {'b/o':>6} {'o/f':>5} {'on/off':>6}")
    for c in results["kernel"]:
        ms = c["ms"]
        print(f"{c['rows']:>3} {c['vocab']:>7} {c['top_k']:>4} {c['logits']:>12} | {ms['ours_mask']:>8.2f} "
              f"{ms['ours_nomask']:>8.2f} {ms['baseline_mask']:>9.2f} {ms['baseline_nomask']:>9.2f} "
              f"{ms['floor']:>8.2f} | {c['speedup_vs_baseline_mask']:>9.1f} {c['ours_over_floor_mask']:>8.2f} "
              f"{c['mask_on_over_off']:>6.2f} |          {c['best_of']['speedup_vs_baseline_mask']:>6.1f} "
              f"{c['best_of']['ours_over_floor_mask']:>5.2f} {c['best_of']['mask_on_over_off']:>6.2f}")
    served = results.get("served")
    if served:
        print(f"\nServed, B=1 rows of V={served['vocab']}, {served['row_params']}")
        print(f"{'path':>12} {'conc':>5} | {'rows/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>8}")
        for e in served["in_process"]:
            print(f"{'in_process':>12} {e['rows_per_call']:>4}r | {e['rows_per_s']:>8.1f} {e['p50_ms']:>8.2f} "
                  f"{e['p99_ms']:>8.2f} {e['requests']:>8}")
        for e in served["served"]:
            print(f"{e['protocol']:>12} {e['concurrency']:>5} | {e['rows_per_s']:>8.1f} {e['p50_ms']:>8.2f} "
                  f"{e['p99_ms']:>8.2f} {e['requests']:>8}")
    print("\nTargets")
    for key, v in results["targets"].items():
        best = f", best-of-rounds {v['best_of_rounds']:.3f}" if "best_of_rounds" in v else ""
        best += f", paired median {v['paired_median']:.3f}" if v.get("paired_median") else ""
        print(f"  ({key}) {'MET ' if v['met'] else 'MISS'} {v['value']:.3f}{best} (threshold {v['threshold']}): {v['target']}")


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def plot(results: dict, path: Path) -> None:
    """Bars of the three kernel ratios per case and the served/in-process fraction, with targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernel = results["kernel"]
    labels = [f"B{c['rows']} V{c['vocab'] // 1000}k k{c['top_k']}{' bf16' if c['logits'] != 'fp32' else ''}" for c in kernel]
    panels = [
        ("speedup_vs_baseline_mask", "baseline / ours (masks on)", 15.0, True),
        ("ours_over_floor_mask", "ours / floor (masks on)", 1.3, False),
        ("mask_on_over_off", "ours: masks on / off", 1.15, False),
    ]
    served = results.get("served")
    fig, axes = plt.subplots(1, 4 if served else 3, figsize=(22 if served else 16, 5))
    for ax, (key, title, threshold, log) in zip(axes, panels):
        ax.bar(range(len(kernel)), [c[key] for c in kernel], color="tab:blue")
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
            ax.bar(xs, [e["rows_per_s"] / in_process.get(e["concurrency"], in_process[1]) for e in entries],
                   width=0.27, label=protocol)
        ax.set_xticks(range(len(entries)), [f"c={e['concurrency']}" for e in entries])
        ax.axhline(0.5, color="tab:red", linestyle="--", label="target 0.5 (grpc_shm, c=16)")
        ax.set_title("served rows/s / in-process rows/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"triton-sampling-mask on {results['machine']['cpu']} ({results['device']}, "
                 f"{results['machine']['torch_threads']} threads)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_summary(results: dict) -> str:
    """The committed results as markdown tables (pasted into bench/README.md)."""
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
    served = results.get("served")
    if served:
        lines += ["", f"Served: B=1 rows of V={served['vocab']}, {served['row_params']}, "
                      f"{served['duration_s']:.0f} s per point, closed loop.", "",
                  "| path | concurrency / rows per call | rows/s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
        for e in served["in_process"]:
            lines.append(f"| in-process | {e['rows_per_call']} rows/call | {e['rows_per_s']:.0f} | {e['p50_ms']:.2f} | {e['p99_ms']:.2f} |")
        for e in served["served"]:
            lines.append(f"| {e['protocol']} | {e['concurrency']} | {e['rows_per_s']:.0f} | {e['p50_ms']:.2f} | {e['p99_ms']:.2f} |")
    lines += ["", "| target | measured (ratio of medians) | median of per-round ratios | best-of-rounds | met (ratio of medians) |",
              "|---|---|---|---|---|"]
    for key, v in results["targets"].items():
        best = f"{v['best_of_rounds']:.2f}" if "best_of_rounds" in v else "-"
        paired = f"{v['paired_median']:.2f}" if v.get("paired_median") else "-"
        lines.append(f"| ({key}) {v['target']} | {v['value']:.2f} | {paired} | {best} | {'yes' if v['met'] else 'no'} |")
    return "\n".join(lines) + "\n"
