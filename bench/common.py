"""What both benchmarks share: the mask width from config.pbtxt, timing, and machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from testbed.server import MODEL_REPOSITORY, REPO_ROOT  # noqa: F401 (the benchmarks' paths, from here)
from triton_sampling_mask.model_config import output_width, read_config_file

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def mask_width() -> int:
    """W, read from the dims of the `sampling_mask` output in the shipped config.pbtxt."""
    return output_width(read_config_file(MODEL_REPOSITORY / "sampler" / "config.pbtxt"), "sampling_mask")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall time measures the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    functions: dict, device: torch.device, min_rounds: int, budget_s: float, max_rounds: int = 50
) -> dict[str, dict]:
    """Median milliseconds of each function, timed in interleaved rounds (one call of each per
    round, order rotated) so load from other processes lands on all of them alike; one warm-up
    call each."""
    for fn in functions.values():
        fn()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in functions}
    start = time.perf_counter()
    rounds = 0
    names = list(functions)
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < max_rounds):
        # Rotate the order each round: the first call after another function's large frees pays
        # for the allocator and the cache, and no function should always be the one that pays.
        for name in names[rounds % len(names) :] + names[: rounds % len(names)]:
            fn = functions[name]
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            samples[name].append((time.perf_counter() - t0) * 1e3)
        rounds += 1
    return {
        name: {"median_ms": statistics.median(v), "min_ms": min(v), "rounds": len(v), "samples_ms": v}
        for name, v in samples.items()
    }


def paired_median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator/denominator timed in the same round: load that lasts
    longer than a round slows both sides alike and cancels."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def machine_facts() -> dict:
    """Where the numbers came from: CPU model, cores, torch threads and versions, current load."""
    cpu = platform.processor() or platform.machine()
    try:  # psutil names no CPU model: /proc/cpuinfo does
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def server_breakdown(before: dict, after: dict) -> dict:
    """Where a point's time went inside the server: mean rows per execute and mean ms per
    request spent queued, copying inputs in, inside execute, and copying outputs out."""
    executions = int(after["execution_count"]) - int(before["execution_count"])
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    out = {"mean_rows_per_execute": inferences / executions if executions else 0.0}
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        count = int(after["inference_stats"][phase]["count"]) - int(before["inference_stats"][phase]["count"])
        ns = int(after["inference_stats"][phase]["ns"]) - int(before["inference_stats"][phase]["ns"])
        out[f"{phase}_ms"] = ns / count / 1e6 if count else 0.0
    return out
