"""`make bench`: kernel benchmark, then the served one; prints tables, writes JSON and the plot.

    python -m bench.run [--device cpu|cuda] [--grid cpu|gpu] [--tiny] [--skip-served] [--skip-top-p]
                        [--skip-served-call] [--skip-proxy-cost] [--skip-stream-cost] [--skip-api-cost]
                        [--skip-speculative] [--skip-generate-baseline] [--generate-baseline-rev REV]
                        [--call-requests N]
                        [--no-perf-analyzer]
                        [--skip-step-latency] [--step-calls N] [--skip-itl]
                        [--output PATH] [--plot PATH] [--no-plot] [--flashinfer-timeout S] [--note TEXT]

--grid cpu (default): B {1, 8, 64} x V {32000, 151936} x top_k {50, 512}, ~3 s per case; writes
bench/results/latest.json. --grid gpu: B {1, 8, 64, 256} x V {32000, 151936, 262144} x top_k
{50, 512}, ~2 s per case, plus rivals (ours on the plain torch path, a vLLM-style sampler,
FlashInfer where it imports); writes bench/results/gpu.json. Both add the top-p case without a
mask. The served part (cpu device only) times B=1 rows at concurrency 1/4/16 and one call of
B=64 x V=151936 over gRPC, HTTP and system shared memory, FP32 and BF16 logits (bench/served_call.py),
with perf_analyzer as the client where it runs (bench/perf_analyzer.py), then the step latency on
the same server (bench/step_latency.py: 10,000 calls per point of B=1 and B=8 rows at concurrency
1/8/16, gRPC with and without shared memory, every call timed; generate's inter-token gaps at 32
streams), what the front door (HAProxy) adds to the one call and to a B=1 step
(bench/proxy_cost.py), what it adds to 32 streams of `generate` (bench/stream_cost.py), and what the
HTTP API costs against the gRPC client at 1 and 32 streams (bench/api_cost.py), and generate's
tokens/s with "ngram" speculative decoding against plain decoding (bench/load/speculative.py), and
generate's tokens/s and TTFT against the same model at a baseline revision, both served side by
side, and against the first release's (static batching), both behind the front door
(bench/load/generate_baseline.py: ratios, nothing asserted).
--tiny shrinks it all to seconds. The JSON is rewritten after every case ("complete": false
until the end), so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import functools
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import kernel, report, step_latency
from .baseline import flashinfer_sampler
from .common import RESULTS_DIR, interleaved_medians, machine_facts, mask_width

# interleaved_medians settings per (grid, tiny): at least `min_rounds` rounds, then more while the
# group's `budget_s` lasts, up to `max_rounds`. The gpu grid's calls are short (tens of µs to tens
# of ms): 25 cases x 2 groups x ~1 s keep the whole run near 2 minutes on an H200.
TIMING = {
    ("cpu", False): {"min_rounds": 7, "budget_s": 3.0},
    ("gpu", False): {"min_rounds": 10, "budget_s": 1.0, "max_rounds": 200},
    ("cpu", True): {"min_rounds": 2, "budget_s": 0.0},
    ("gpu", True): {"min_rounds": 2, "budget_s": 0.0},
}
DEFAULT_OUTPUTS = {"cpu": ("latest.json", "ratios.png"), "gpu": ("gpu.json", "gpu_ratios.png")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or cuda:N")
    parser.add_argument("--grid", choices=("cpu", "gpu"), default="cpu", help="case grid and rivals (see above)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the targets assume 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, few rounds: checks that it runs")
    parser.add_argument("--skip-served", action="store_true", help="kernel benchmark only")
    parser.add_argument("--skip-top-p", action="store_true", help="no top-p-without-mask case")
    parser.add_argument("--served-seconds", type=float, default=4.0, help="measured seconds per served point")
    parser.add_argument("--skip-served-call", action="store_true", help="no one-call B=64 x V=151936 table")
    parser.add_argument(
        "--skip-proxy-cost", action="store_true", help="no front-door cost (bench/proxy_cost.py: direct vs HAProxy)"
    )
    parser.add_argument(
        "--skip-stream-cost",
        action="store_true",
        help="no front-door cost on streaming generation (bench/stream_cost.py)",
    )
    parser.add_argument(
        "--skip-api-cost",
        action="store_true",
        help="no HTTP API cost (bench/api_cost.py: /v1/completions beside the gRPC client)",
    )
    parser.add_argument(
        "--skip-speculative",
        action="store_true",
        help="no speculative-decoding table (bench/load/speculative.py: generate's tokens/s, ngram vs plain)",
    )
    parser.add_argument(
        "--skip-generate-baseline",
        action="store_true",
        help="no generate comparison with a baseline revision (bench/load/generate_baseline.py)",
    )
    parser.add_argument(
        "--generate-baseline-rev",
        default=None,
        help="the revision generate is compared with (default bench.load.generate_baseline.DEFAULT_REV)",
    )
    parser.add_argument(
        "--call-requests",
        type=int,
        default=None,
        help="calls per point of the one-call table (default 10; 3 with --tiny)",
    )
    parser.add_argument(
        "--no-perf-analyzer", action="store_true", help="the Python load generator even where perf_analyzer runs"
    )
    parser.add_argument("--skip-step-latency", action="store_true", help="no step-latency table (nor generate's gaps)")
    parser.add_argument(
        "--step-calls", type=int, default=None, help="calls per step-latency point (default 10,000; 40 with --tiny)"
    )
    parser.add_argument("--skip-itl", action="store_true", help="no generate inter-token gaps in the step latency")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default by grid, in bench/results/)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default by grid, in bench/results/)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument(
        "--flashinfer-timeout",
        type=float,
        default=60.0,
        help="seconds FlashInfer's first call (a JIT compile, maybe) may take before it is skipped",
    )
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    args = parser.parse_args(argv)
    output = args.output or RESULTS_DIR / DEFAULT_OUTPUTS[args.grid][0]
    plot_path = args.plot or RESULTS_DIR / DEFAULT_OUTPUTS[args.grid][1]

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    width = mask_width()
    started = time.perf_counter()
    machine = machine_facts()
    grid = kernel.GRIDS[args.grid, args.tiny]
    timing = functools.partial(interleaved_medians, **TIMING[args.grid, args.tiny])
    progress = functools.partial(print, flush=True)
    rivals = None
    results = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "grid": args.grid + (" (tiny)" if args.tiny else ""),
        "machine": machine,
        "note": args.note,
        "parameters": {"temperature": kernel.TEMPERATURE, "top_p": kernel.TOP_P, "mask_width": width},
        "ours_fused": device.type == "cuda" and kernel.sampler_module._fused_available(),
        "complete": False,
        "kernel": [],
    }
    if grid.get("rivals"):
        fn, reason = flashinfer_sampler(device, args.flashinfer_timeout)
        rivals = {"flashinfer": fn}
        results["flashinfer"] = reason if fn is not None else f"skipped: {reason}"
        print(f"flashinfer: {results['flashinfer']}", flush=True)
    print(
        f"kernel benchmark on {device}, grid {results['grid']} (W={width} from config.pbtxt; "
        f"ours fused: {results['ours_fused']})",
        flush=True,
    )

    def checkpoint(kernel_results: list[dict]) -> None:
        results["kernel"] = kernel_results
        report.write_json(results, output)

    checkpoint(
        kernel.run_kernel_benchmark(device, width, grid, timing, progress=progress, rivals=rivals, on_case=checkpoint)
    )
    if not args.skip_top_p:
        rows, vocab = grid["top_p_case"]
        results["top_p"] = kernel.run_top_p_case(rows, vocab, width, device, timing, rivals=rivals)
        progress(
            f"  top-p B={rows} V={vocab}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in results["top_p"]["ms"].items())
        )
        report.write_json(results, output)
    served = served_call = step = None
    if not args.skip_served and device.type == "cpu":
        from .served import run_served_benchmark

        print("served benchmark (real tritonserver)", flush=True)
        options = {
            "call_tiny": None if args.skip_served_call else args.tiny,
            "call_requests": args.call_requests,
            "use_perf_analyzer": not args.no_perf_analyzer,
            "progress": progress,
            "on_server": None
            if args.skip_step_latency
            else functools.partial(
                _step_latency,
                size=step_latency.SIZES["tiny" if args.tiny else "full"],
                calls=args.step_calls,
                itl=not args.skip_itl,
                progress=progress,
            ),
        }
        if args.tiny:
            # 0.8 s per point: one stalled request (~0.5 s stalls were seen with the machine loaded)
            # must not leave a point with no request recorded, which served.py cannot summarise.
            served, served_call, step = run_served_benchmark(
                width, 1000, (1, 2), duration_s=0.8, warmup_s=0.1, **options
            )
        else:
            served, served_call, step = run_served_benchmark(
                width, 151936, (1, 4, 16), duration_s=args.served_seconds, warmup_s=0.5, **options
            )
        results["served"] = served
        if served_call is not None:
            results["served_call"] = served_call
        if step is not None:
            results["step_latency"] = step
    if not args.skip_served and not args.skip_proxy_cost and device.type == "cpu":
        from triton_sampling_mask.ops.proxy import find_haproxy

        from . import proxy_cost

        if find_haproxy() is None:
            results["proxy_cost_skipped"] = "haproxy is not installed"
        else:
            print("front-door cost (the same calls straight to tritonserver and through HAProxy)", flush=True)
            results["proxy_cost"] = proxy_cost.run(args.tiny, progress)
            report.write_json(results, output)
            if not args.skip_stream_cost:
                from . import stream_cost

                print("front-door cost on streaming generation (straight and through the front door)", flush=True)
                results["stream_cost"] = stream_cost.run(args.tiny, progress)
    if not args.skip_served and not args.skip_api_cost and device.type == "cpu":
        from . import api_cost

        print("HTTP API cost (/v1/completions beside the gRPC client)", flush=True)
        results["api_cost"] = api_cost.run(args.tiny, progress)
        report.write_json(results, output)
    if not args.skip_served and not args.skip_speculative and device.type == "cpu":
        from .load import speculative

        print("speculative decoding against plain decoding (generate's tokens/s)", flush=True)
        sizes = speculative.TINY if args.tiny else speculative.FULL
        results["speculative"] = speculative.run(**sizes, progress=progress)
        report.write_json(results, output)
    if not args.skip_served and not args.skip_generate_baseline and device.type == "cpu":
        from .load import generate_baseline

        # The regression check (the revision before this round's generate features, served
        # straight), then the yardstick: the first release, both behind the front door.
        comparisons = (
            ("generate_baseline", args.generate_baseline_rev or generate_baseline.DEFAULT_REV, False),
            ("generate_first_release", generate_baseline.FIRST_RELEASE_REV, True),
        )
        for key, rev, door in comparisons:
            where = "through the front door" if door else "served straight"
            print(f"generate against revision {rev}, both {where}", flush=True)
            try:
                results[key] = generate_baseline.run(rev, quick=args.tiny, progress=progress, door=door)
                print(generate_baseline.table(results[key]), flush=True)
            except RuntimeError as error:  # e.g. a shallow clone without the revision
                results[f"{key}_skipped"] = str(error)
                print(f"  skipped: {error}", flush=True)
            report.write_json(results, output)
    results["targets"] = report.verdicts(results["kernel"], served, served_call, step)
    if results.get("proxy_cost"):
        from .proxy_cost import verdicts as proxy_verdicts

        results["targets"].update(proxy_verdicts(results["proxy_cost"]))
    if results.get("stream_cost"):
        from .stream_cost import verdicts as stream_verdicts

        results["targets"].update(stream_verdicts(results["stream_cost"]))
    if results.get("api_cost"):
        from .api_cost import verdicts as api_verdicts

        results["targets"].update(api_verdicts(results["api_cost"]))
    results["machine"]["load_average_1m_after"] = machine_facts()["load_average_1m"]
    results["wall_s"] = time.perf_counter() - started
    results["complete"] = True
    report.print_tables(results)
    report.write_json(results, output)
    summary = report.markdown_summary(results)
    from .load.generate_baseline import table as baseline_table

    for key, title in (
        ("generate_baseline", "generate against its baseline revision"),
        ("generate_first_release", "generate against the first release (targets: tokens/s >= 2x, TTFT p99 <= 0.1x)"),
    ):
        if results.get(key):
            summary += f"\n\n## {title}\n\n" + baseline_table(results[key]) + "\n"
    output.with_suffix(".md").write_text(summary)
    figures = [] if args.no_plot else report.plot(results, plot_path)
    print(f"\nwrote {output}{''.join(', ' + str(figure) for figure in figures)} in {results['wall_s']:.0f} s")
    return results


def _step_latency(server, **options) -> dict:
    """The step-latency table on the served benchmark's server (its on_server hook)."""
    options.get("progress", print)("step latency (every call timed, Python client)")
    return step_latency.run_on_server(server, **options)


if __name__ == "__main__":
    main()
