"""The benchmark's figures as PNG files, drawn with matplotlib from the results JSON.

`make bench` draws them beside its tables (report.plot calls `render`); to redraw them from saved
results without measuring again:

    .venv/bin/python -m bench.plots [--results bench/results/latest.json]
                                    [--speculative bench/results/speculative.json] [--out bench/results]

- `latency_cdf.png`: per path, the distribution of call latencies from the quantiles the bench
  keeps (p50, p90, p99, p99.9 and the largest call), one panel per table: the served rows (B=1,
  per protocol and concurrency) and the step-latency points (B rows per call, per path and
  concurrency). The y axis is the quantile on a log scale of 1 - q, so the tail is spread out.
- `throughput.png`: rows/s against concurrency, per protocol, with the in-process rate for
  comparison; and the step-latency points' rows/s per path and B.
- `speculative.png`: generate's tokens/s, plain decoding against "ngram" speculative decoding, per
  workload and number of streams: `make bench` measures it (bench/load/speculative.py's `run`,
  kept in the results JSON); `python -m bench.load.speculative --output JSON` writes the same
  alone, which `--speculative JSON` draws instead.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIGURES = ("latency_cdf.png", "throughput.png", "speculative.png")
# The quantile each kept latency figure stands for ("max_ms": the largest of `calls`, placed below).
QUANTILE_KEYS = (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99), ("p999_ms", 0.999))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def quantile_points(point: dict) -> tuple[list[float], list[float]]:
    """(latencies ms, quantiles) of one bench point, in increasing order: the percentiles it kept
    and its largest call, placed at quantile 1 - 1/(2 calls) (where a sample's maximum sits)."""
    pairs = [(point[key], q) for key, q in QUANTILE_KEYS if key in point]
    calls = point.get("calls") or point.get("requests")
    if "max_ms" in point and calls:
        pairs.append((point["max_ms"], 1 - 1 / (2 * calls)))
    pairs.sort(key=lambda pair: pair[1])
    return [ms for ms, _ in pairs], [q for _, q in pairs]


def _tail_axis(ax) -> None:
    """A y axis of quantiles spread by -log10(1 - q): 0.5, 0.9, 0.99, 0.999 equally spaced."""
    ticks = (0.5, 0.9, 0.99, 0.999, 0.9999)
    ax.set_yticks([-math.log10(1 - q) for q in ticks], [f"{q:g}" for q in ticks])
    ax.set_ylabel("quantile")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(_plain_numbers())
    ax.xaxis.set_minor_formatter(_plain_numbers(minor=True))
    ax.set_xlabel("ms per call")
    ax.grid(True, which="both", alpha=0.3)


def plot_latency_cdf(results: dict, path: Path) -> Path | None:
    """Latency distributions per path (served and step-latency tables); None without either."""
    served, step = results.get("served"), results.get("step_latency")
    panels = []
    if served:
        lines = [(f"{e['protocol']} c={e['concurrency']}", e) for e in served["served"]]
        panels.append((f"served, B=1 rows of V={served['vocab']}", lines))
    if step:
        for rows in sorted({p["rows"] for p in step["points"]}):
            lines = [(f"{p['path']} c={p['concurrency']}", p) for p in step["points"] if p["rows"] == rows]
            panels.append((f"step latency, B={rows} rows of V={step['vocab']}", lines))
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for label, point in lines:
            latencies, quantiles = quantile_points(point)
            ax.plot(latencies, [-math.log10(1 - q) for q in quantiles], marker="o", label=label)
        _tail_axis(ax)
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, plt, results, path, "latency per call")


def plot_throughput(results: dict, path: Path) -> Path | None:
    """Rows/s against concurrency per protocol (and per step-latency path and B); None without either."""
    served, step = results.get("served"), results.get("step_latency")
    if not served and not step:
        return None
    plt = _pyplot()
    count = bool(served) + bool(step)
    fig, axes = plt.subplots(1, count, figsize=(6 * count, 4.8), squeeze=False)
    axes = list(axes[0])
    if served:
        ax = axes.pop(0)
        for protocol in dict.fromkeys(e["protocol"] for e in served["served"]):
            entries = sorted((e for e in served["served"] if e["protocol"] == protocol), key=lambda e: e["concurrency"])
            ax.plot([e["concurrency"] for e in entries], [e["rows_per_s"] for e in entries], marker="o", label=protocol)
        for e in served["in_process"]:
            ax.axhline(e["rows_per_s"], linestyle=":", color="grey")
            ax.annotate(
                f"in-process, {e['rows_per_call']} rows/call",
                (0, e["rows_per_s"]),
                fontsize=7,
                color="grey",
                xycoords=("axes fraction", "data"),
                va="bottom",
            )
        ax.set_title(f"served rows/s, B=1 rows of V={served['vocab']}")
        _concurrency_axis(ax, [e["concurrency"] for e in served["served"]])
    if step:
        ax = axes.pop(0)
        keys = dict.fromkeys((p["rows"], p["path"]) for p in step["points"])
        for rows, path_name in keys:
            points = sorted(
                (p for p in step["points"] if (p["rows"], p["path"]) == (rows, path_name)),
                key=lambda p: p["concurrency"],
            )
            ax.plot(
                [p["concurrency"] for p in points],
                [p["rows_per_s"] for p in points],
                marker="o",
                label=f"{path_name}, B={rows}",
            )
        ax.set_title(f"step latency points: rows/s, V={step['vocab']}")
        _concurrency_axis(ax, [p["concurrency"] for p in step["points"]])
    return _save(fig, plt, results, path, "throughput")


def _plain_numbers(minor: bool = False):
    """Tick labels as plain numbers (3, 20, 150), not powers; minor ticks labelled at 2, 3 and 5 only."""
    from matplotlib.ticker import FuncFormatter

    def label(value, _):
        if minor and f"{value:.0e}"[0] not in "235":
            return ""
        return f"{value:g}"

    return FuncFormatter(label)


def _concurrency_axis(ax, concurrencies) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(concurrencies)), [str(c) for c in sorted(set(concurrencies))])
    ax.minorticks_off()
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("rows/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot_speculative(speculative: dict | None, path: Path) -> Path | None:
    """Tokens/s of plain against speculative decoding per workload and streams; None without data."""
    if not speculative or not speculative.get("points"):
        return None
    plt = _pyplot()
    points = speculative["points"]
    workloads = list(dict.fromkeys(p["workload"] for p in points))
    algorithms = list(dict.fromkeys(p["algorithm"] for p in points))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        streams = sorted({p["streams"] for p in points if p["workload"] == workload})
        width = 0.8 / len(algorithms)
        for offset, algorithm in enumerate(algorithms):
            rate = {
                p["streams"]: p["tokens_per_s"]
                for p in points
                if (p["workload"], p["algorithm"]) == (workload, algorithm)
            }
            xs = [i + (offset - (len(algorithms) - 1) / 2) * width for i in range(len(streams))]
            ax.bar(xs, [rate.get(s, 0.0) for s in streams], width=width, label=f"speculative: {algorithm}")
        ax.set_xticks(range(len(streams)), [f"{s} streams" for s in streams])
        ax.set_ylabel("tokens/s (median of rounds)")
        ax.set_title(f"generate, {workload}")
        ax.legend(fontsize=8)
    return _save(fig, plt, speculative, path, "plain against speculative decoding")


def _save(fig, plt, results: dict, path: Path, what: str) -> Path:
    machine = results.get("machine", {})
    where = f" on {machine['cpu']} ({results.get('device', 'cpu')})" if machine.get("cpu") else ""
    stamp = f", {results['timestamp']}" if results.get("timestamp") else ""
    fig.suptitle(f"triton-sampling-mask: {what}{where}{stamp}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render(results: dict, directory: Path, prefix: str = "", speculative: dict | None = None) -> list[Path]:
    """Every figure the results (and speculative results, if any) can give, as `directory/<prefix><figure>`."""
    directory = Path(directory)
    drawn = [
        plot_latency_cdf(results, directory / f"{prefix}{FIGURES[0]}"),
        plot_throughput(results, directory / f"{prefix}{FIGURES[1]}"),
        plot_speculative(speculative, directory / f"{prefix}{FIGURES[2]}"),
    ]
    return [path for path in drawn if path is not None]


def main(argv: list[str] | None = None) -> None:
    """Redraw the figures from saved results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "latest.json")
    parser.add_argument("--speculative", type=Path, default=RESULTS_DIR / "speculative.json")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--prefix", default="", help="file name prefix (the gpu grid's: gpu_)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    speculative = results.get("speculative")
    if args.speculative.exists() and (speculative is None or args.speculative != RESULTS_DIR / "speculative.json"):
        speculative = json.loads(args.speculative.read_text())  # named, or the only results there are
    for path in render(results, args.out, args.prefix, speculative):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
