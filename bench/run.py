"""`make bench`: kernel benchmark, then the served one; prints tables, writes JSON and the plot.

    python -m bench.run [--device cpu|cuda] [--tiny] [--skip-served] [--output PATH] [--plot PATH] [--no-plot]
"""

from __future__ import annotations

import argparse
import functools
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import kernel, report
from .common import RESULTS_DIR, interleaved_medians, machine_facts, mask_width


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the targets assume 2)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, few rounds: checks that it runs")
    parser.add_argument("--skip-served", action="store_true", help="kernel benchmark only")
    parser.add_argument("--served-seconds", type=float, default=4.0, help="measured seconds per served point")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "latest.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "ratios.png")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    width = mask_width()
    started = time.perf_counter()
    machine = machine_facts()
    if args.tiny:
        grid, timing = kernel.TINY_GRID, functools.partial(interleaved_medians, min_rounds=2, budget_s=0.0)
    else:
        grid, timing = kernel.FULL_GRID, functools.partial(interleaved_medians, min_rounds=7, budget_s=3.0)
    print(f"kernel benchmark on {device} (W={width} from config.pbtxt)", flush=True)
    results = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "machine": machine,
        "note": args.note,
        "parameters": {"temperature": kernel.TEMPERATURE, "top_p": kernel.TOP_P, "mask_width": width},
        "kernel": kernel.run_kernel_benchmark(device, width, grid, timing,
                                              progress=functools.partial(print, flush=True)),
    }
    served = None
    if not args.skip_served and device.type == "cpu":
        from .served import run_served_benchmark

        print("served benchmark (real tritonserver)", flush=True)
        if args.tiny:
            served = run_served_benchmark(width, 1000, (1, 2), duration_s=0.3, warmup_s=0.1)
        else:
            served = run_served_benchmark(width, 151936, (1, 4, 16), duration_s=args.served_seconds, warmup_s=0.5,
                                          progress=functools.partial(print, flush=True))
        results["served"] = served
    results["targets"] = report.verdicts(results["kernel"], served)
    results["machine"]["load_average_1m_after"] = machine_facts()["load_average_1m"]
    results["wall_s"] = time.perf_counter() - started
    report.print_tables(results)
    report.write_json(results, args.output)
    args.output.with_suffix(".md").write_text(report.markdown_summary(results))
    if not args.no_plot:
        report.plot(results, args.plot)
    print(f"\nwrote {args.output}{'' if args.no_plot else ' and ' + str(args.plot)} in {results['wall_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
