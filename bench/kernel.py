"""Kernel-level benchmark, in-process: our sampler vs the full-sort baseline vs the floor.

For each (B, V, top_k) the five functions (ours with/without masks, baseline with/without masks,
floor) are timed in interleaved rounds and reported as medians, with the ratios the targets use.
Each call of ours pays what a caller pays per call: a fresh `SamplingBatch` from the parameters'
host arrays (made once, as they arrive with a request) and the result read on the host; at B=1
that fixed cost, not the math, is most of the time on a small vocabulary.
The `gpu` grid adds rivals: ours on the plain torch path (`fused=False`), a vLLM-style torch
sampler and FlashInfer's fused sampler (where it imports). A top-p case without a mask (top_k -1)
compares ours (candidates first) with the previous path (a full sort) and the baseline.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from triton_sampling_mask.sampling import sampler as sampler_module
from triton_sampling_mask.sampling.sampler import SamplingBatch, plan_rows, sample

from .baseline import floor, full_sort_sample, vllm_style_sample
from .common import paired_median_ratio

TEMPERATURE, TOP_P = 0.8, 0.95
# `top_p_case`: (B, V) of the top-p-without-mask case (top_k -1); `rivals`: time the GPU rivals too.
FULL_GRID = {"rows": (1, 8, 64), "vocab": (32000, 151936), "top_k": (50, 512), "top_p_case": (64, 151936)}
TINY_GRID = {"rows": (1, 4), "vocab": (1000, 2000), "top_k": (8,), "top_p_case": (4, 6000)}
GPU_GRID = {
    "rows": (1, 8, 64, 256),
    "vocab": (32000, 151936, 262144),
    "top_k": (50, 512),
    "top_p_case": (64, 151936),
    "rivals": True,
}
GPU_TINY_GRID = TINY_GRID | {"rivals": True}
GRIDS = {("cpu", False): FULL_GRID, ("cpu", True): TINY_GRID, ("gpu", False): GPU_GRID, ("gpu", True): GPU_TINY_GRID}


def make_logits(rows: int, vocab: int, device: torch.device, bf16: bool = False, seed: int = 0) -> torch.Tensor:
    """Seeded N(0, 3^2) logits; `bf16` rounds them to bfloat16 first, as real model outputs are
    (many exact ties, which exercises the tie handling)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3.0
    if bf16:
        logits = logits.bfloat16().float()
    return logits.to(device)


def host_params(rows: int, top_k: int, want_mask: bool) -> dict[str, np.ndarray]:
    """The benchmark's parameters for every row, as host arrays (seeded rows), by
    `SamplingBatch.from_arrays`'s argument names."""
    return {
        "temperature": np.full(rows, TEMPERATURE, np.float32),
        "top_k": np.full(rows, top_k, np.int64),
        "top_p": np.full(rows, TOP_P, np.float32),
        "min_p": np.zeros(rows, np.float32),
        "seed": np.arange(rows, dtype=np.int64),
        "want_mask": np.full(rows, want_mask),
    }


def make_batch(logits: torch.Tensor, top_k: int, want_mask: bool) -> SamplingBatch:
    """The sampler's input for every row at the benchmark's parameters (parameters on the host,
    where requests arrive)."""
    return SamplingBatch.from_arrays(logits=logits, **host_params(logits.shape[0], top_k, want_mask))


def ours(logits: torch.Tensor, top_k: int, want_mask: bool, width: int, **options):
    """One timed call of ours: a fresh batch from host arrays made once, sampled, read on the host."""
    params = host_params(logits.shape[0], top_k, want_mask)
    return lambda: sample(SamplingBatch.from_arrays(logits=logits, **params), width, **options).host()


def _device_params(batch: SamplingBatch, device: torch.device, top_k: int | None = None) -> dict[str, torch.Tensor]:
    """The batch's parameters as device tensors, for the baselines (built once, outside the timing);
    `top_k` overrides the batch's (the baselines want V, not -1, for "no top_k")."""
    params = batch.params
    k = params.top_k.astype(np.int64) if top_k is None else np.full(params.top_k.shape, top_k, np.int64)
    return {
        "temperature": torch.from_numpy(params.temperature).to(device),
        "top_k": torch.from_numpy(k).to(device),
        "top_k_i32": torch.from_numpy(k.astype(np.int32)).to(device),
        "top_p": torch.from_numpy(params.top_p).to(device),
        "min_p": torch.from_numpy(params.min_p).to(device),
    }


def case_functions(logits: torch.Tensor, top_k: int, width: int, rivals: dict | None = None) -> dict:
    """The timed callables of one case, all over the same logits: the five of every grid, plus,
    with `rivals` (the gpu grid), ours on the plain torch path, the vLLM-style sampler and
    FlashInfer (`rivals["flashinfer"]`, None when skipped)."""
    p = _device_params(make_batch(logits, top_k, True), logits.device)

    def baseline(want: bool):
        return lambda: full_sort_sample(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], width, want)

    functions = {
        "ours_mask": ours(logits, top_k, True, width),
        "ours_nomask": ours(logits, top_k, False, width),
        "baseline_mask": baseline(True),
        "baseline_nomask": baseline(False),
        "floor": lambda: floor(logits, top_k),
    }
    if rivals is not None:
        functions["ours_plain_mask"] = ours(logits, top_k, True, width, fused=False)
        functions["vllm_nomask"] = lambda: vllm_style_sample(logits, p["temperature"], p["top_k"], p["top_p"])
        if rivals.get("flashinfer") is not None:
            flashinfer = rivals["flashinfer"]
            functions["flashinfer_nomask"] = lambda: flashinfer(logits, p["temperature"], p["top_k_i32"], p["top_p"])
    return functions


# Functions with full-vocabulary temporaries (sorts): timed in rounds of their own (see run_case).
_SORTING = ("baseline_mask", "baseline_nomask", "vllm_nomask")
# Rival -> the function of ours it is compared with (same outputs asked: mask or not).
_RIVAL_OF = {
    "ours_plain_mask": "ours_mask",
    "vllm_nomask": "ours_nomask",
    "flashinfer_nomask": "ours_nomask",
    "baseline_nomask": "ours_nomask",
}


def run_case(
    rows: int,
    vocab: int,
    top_k: int,
    width: int,
    device: torch.device,
    timing,
    bf16: bool = False,
    rivals: dict | None = None,
) -> dict:
    """One row of the results table: medians (ms) and ratios."""
    logits = make_logits(rows, vocab, device, bf16=bf16)
    functions = case_functions(logits, top_k, width, rivals)
    # The baseline's full-vocabulary temporaries evict the cache and churn the allocator, which
    # would slow whatever runs next; it is timed in its own rounds, ours and the floor in theirs.
    medians = timing({n: f for n, f in functions.items() if n not in _SORTING}, device)
    medians |= timing({n: f for n, f in functions.items() if n in _SORTING}, device)
    ms = {name: m["median_ms"] for name, m in medians.items()}
    # Best-of-rounds times: a load-robust second view when other processes share the cores.
    best = {name: m.get("min_ms", m["median_ms"]) for name, m in medians.items()}
    case = {
        "rows": rows,
        "vocab": vocab,
        "top_k": top_k,
        "logits": "bf16-rounded" if bf16 else "fp32",
        "ms": ms,
        "min_ms": best,
        "rounds": min(m["rounds"] for m in medians.values()),
        "paired": _paired_ratios(medians),
        "best_of": {
            "speedup_vs_baseline_mask": best["baseline_mask"] / best["ours_mask"],
            "ours_over_floor_mask": best["ours_mask"] / best["floor"],
            "mask_on_over_off": best["ours_mask"] / best["ours_nomask"],
        },
        "speedup_vs_baseline_mask": ms["baseline_mask"] / ms["ours_mask"],
        "speedup_vs_baseline_nomask": ms["baseline_nomask"] / ms["ours_nomask"],
        "ours_over_floor_mask": ms["ours_mask"] / ms["floor"],
        "ours_over_floor_nomask": ms["ours_nomask"] / ms["floor"],
        "mask_on_over_off": ms["ours_mask"] / ms["ours_nomask"],
    }
    if rivals is not None:
        # Each rival's time over ours (> 1: ours is faster), ours taken with the same outputs asked.
        case["rival_over_ours"] = {name: ms[name] / ms[ours] for name, ours in _RIVAL_OF.items() if name in ms}
        case["rival_over_ours_best_of"] = {
            name: best[name] / best[ours] for name, ours in _RIVAL_OF.items() if name in best
        }
    return case


def _paired_ratios(medians: dict) -> dict:
    """Ratios (b) and (c) as medians of per-round ratios; {} when no raw samples were kept. The
    baseline runs in rounds of its own, so (a) has no paired form."""
    if any("samples_ms" not in m for m in medians.values()):
        return {}
    t = {name: m["samples_ms"] for name, m in medians.items()}
    return {
        "ours_over_floor_mask": paired_median_ratio(t["ours_mask"], t["floor"]),
        "mask_on_over_off": paired_median_ratio(t["ours_mask"], t["ours_nomask"]),
    }


@contextlib.contextmanager
def previous_top_p_path(vocab: int):
    """The sampler as it was before candidates-first top-p: `_TOP_P_CANDIDATES` at least V sends
    top_k = -1, top_p < 1 rows straight to the full sort in row blocks. Restored on exit, even
    when the call raises."""
    saved = sampler_module._TOP_P_CANDIDATES
    sampler_module._TOP_P_CANDIDATES = max(vocab, saved)
    try:
        yield
    finally:
        sampler_module._TOP_P_CANDIDATES = saved


def make_top_p_batch(logits: torch.Tensor) -> SamplingBatch:
    """Top-p without a top_k and without a mask (valid; the mask would need a finite top_k)."""
    return make_batch(logits, -1, False)


def run_top_p_case(rows: int, vocab: int, width: int, device: torch.device, timing, rivals: dict | None = None) -> dict:
    """Top-p only (top_k -1, top_p 0.95, temperature 0.8, no mask): ours (candidates first) vs the
    previous path (full sort in row blocks) vs the full-sort baseline, plus the vLLM-style sampler
    and FlashInfer with `rivals`. Each in rounds of its own: the sorts' temporaries would slow
    whatever followed them."""
    logits = make_logits(rows, vocab, device)
    batch = make_top_p_batch(logits)
    p = _device_params(batch, device, top_k=vocab)  # the baselines' "no top_k" is k = V
    plan = plan_rows(batch)
    with previous_top_p_path(vocab):
        previous_plan = plan_rows(batch)
    if not (plan.top_p_first.all() and previous_plan.full_sort.all()):
        raise RuntimeError(
            f"top-p case B={rows} V={vocab}: the rows do not take the paths it compares "
            f"(candidates {sampler_module._TOP_P_CANDIDATES}; V must exceed it)"
        )

    def previous():
        with previous_top_p_path(vocab):
            return sample(batch, width)

    groups = [
        {"ours": lambda: sample(batch, width)},
        {"previous": previous},
        {
            "baseline": lambda: full_sort_sample(
                logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], width, False
            )
        },
    ]
    if rivals is not None:
        groups[2]["vllm"] = lambda: vllm_style_sample(logits, p["temperature"], None, p["top_p"])
        if rivals.get("flashinfer") is not None:
            flashinfer = rivals["flashinfer"]
            groups[0]["flashinfer"] = lambda: flashinfer(logits, p["temperature"], p["top_k_i32"], p["top_p"])
    medians = {}
    for group in groups:
        medians |= timing(group, device)
    ms = {name: m["median_ms"] for name, m in medians.items()}
    best = {name: m.get("min_ms", m["median_ms"]) for name, m in medians.items()}
    return {
        "rows": rows,
        "vocab": vocab,
        "top_k": -1,
        "top_p": TOP_P,
        "temperature": TEMPERATURE,
        "want_mask": False,
        "candidates": sampler_module._TOP_P_CANDIDATES,
        "fallback_rows": _fallback_rows(logits, sampler_module._TOP_P_CANDIDATES),
        "ms": ms,
        "min_ms": best,
        "rounds": min(m["rounds"] for m in medians.values()),
        "over_ours": {name: ms[name] / ms["ours"] for name in ms if name != "ours"},
        "over_ours_best_of": {name: best[name] / best["ours"] for name in best if name != "ours"},
    }


def _fallback_rows(logits: torch.Tensor, candidates: int) -> int:
    """Rows whose first `candidates` ranked tokens hold too little mass to end the support, i.e. that
    the sampler ranks again with a full sort (its test: the support fills every candidate)."""
    log_p = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
    head = torch.topk(log_p, min(candidates, logits.shape[1]), dim=-1).values.exp()
    mass_before_last = head[:, :-1].sum(dim=-1)
    return int((mass_before_last <= TOP_P).sum())


def run_kernel_benchmark(
    device: torch.device, width: int, grid: dict, timing, progress=print, rivals: dict | None = None, on_case=None
) -> list[dict]:
    """Every case of the grid, plus the headline case again on bf16-rounded (tied) logits. Rivals
    are timed only when the grid asks for them; `on_case(results)` runs after every case (the
    caller writes what finished, so a timeout keeps it)."""
    rivals = rivals if grid.get("rivals") else None
    results = []

    def done(case: dict, label: str) -> None:
        results.append(case)
        extra = ""
        if case.get("rival_over_ours"):
            extra = ", " + ", ".join(f"{name} {case['ms'][name]:.3f}" for name in case["rival_over_ours"])
        progress(f"  kernel {label}: ours {case['ms']['ours_mask']:.3f} ms, floor {case['ms']['floor']:.3f}{extra}")
        if on_case is not None:
            on_case(results)

    for vocab in grid["vocab"]:
        for rows in grid["rows"]:
            for top_k in grid["top_k"]:
                done(
                    run_case(rows, vocab, top_k, width, device, timing, rivals=rivals),
                    f"B={rows} V={vocab} top_k={top_k}",
                )
    headline = (max(grid["rows"]), max(grid["vocab"]), max(grid["top_k"]))
    done(run_case(*headline, width, device, timing, bf16=True, rivals=rivals), f"{headline} bf16-rounded")
    return results
