"""The benchmark runs end to end on a tiny size (no timings are asserted), and its baseline
samples the documented support: checked against the float64 reference on tie-free logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from bench import api_cost, baseline, kernel, report, run, stream_cost
from tests.reference import reference_row


def test_baseline_support_matches_reference():
    """The full-sort baseline is a fair comparison only if it samples the same support."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 2  # continuous: no ties
    top_k, top_p, temperature = 20, 0.8, 0.8
    out = baseline.full_sort_sample(
        torch.from_numpy(logits),
        torch.full((4,), temperature),
        torch.full((4,), top_k),
        torch.full((4,), top_p),
        torch.zeros(4),
        mask_width=32,
        want_mask=True,
    )
    for row in range(4):
        ref = reference_row(logits[row], temperature, top_k, top_p)
        length = int(out["mask_len"][row])
        np.testing.assert_array_equal(out["mask_ids"][row, :length].numpy(), ref.support)
        assert int(out["token_ids"][row]) in set(ref.support.tolist())
        token = int(out["token_ids"][row])
        np.testing.assert_allclose(float(out["logprobs"][row]), ref.logprobs[token], atol=1e-4)
        np.testing.assert_allclose(float(out["mask_logprobs"][row]), ref.renormalised_logprob(token, length), atol=1e-4)


def test_ours_is_timed_with_a_fresh_batch_per_call_and_its_result_on_the_host(monkeypatch):
    """What a caller pays per call: the batch is built inside the timed call and the result read."""
    built, read = [], []
    real_from_arrays = kernel.SamplingBatch.from_arrays
    monkeypatch.setattr(
        kernel.SamplingBatch, "from_arrays", lambda **kw: built.append(kw["logits"].shape) or real_from_arrays(**kw)
    )
    functions = kernel.case_functions(kernel.make_logits(1, 500, torch.device("cpu")), 8, 16)
    built.clear()
    for name in ("ours_mask", "ours_nomask"):
        result = functions[name]()
        read.append(isinstance(result, dict) and result["output_ids"].shape == (1,))
    assert built == [(1, 500), (1, 500)] and read == [True, True]


def test_kernel_case_reports_every_timing():
    fake_ms = {"ours_mask": 2.0, "ours_nomask": 1.6, "baseline_mask": 30.0, "baseline_nomask": 29.0, "floor": 4.0}
    case = kernel.run_case(
        2,
        500,
        8,
        16,
        torch.device("cpu"),
        lambda fns, device: {n: {"median_ms": fake_ms[n], "min_ms": fake_ms[n], "rounds": 1} for n in fns},
    )
    assert case["ms"] == fake_ms
    assert case["speedup_vs_baseline_mask"] == pytest.approx(15.0)
    assert case["ours_over_floor_mask"] == pytest.approx(0.5)
    assert case["mask_on_over_off"] == pytest.approx(1.25)


def test_vllm_style_sampler_stays_in_support():
    """The vLLM-style rival draws only from the documented support (one row repeated: many draws)."""
    rng = np.random.default_rng(5)
    row = rng.standard_normal(300).astype(np.float32) * 2  # continuous: no ties
    logits = torch.from_numpy(np.repeat(row[None], 256, axis=0))
    for top_k, top_p in ((20, 0.8), (None, 0.5), (7, None)):
        ids = baseline.vllm_style_sample(
            logits,
            torch.full((256,), 0.8),
            None if top_k is None else torch.full((256,), top_k),
            None if top_p is None else torch.full((256,), top_p),
        )
        ref = reference_row(row, 0.8, -1 if top_k is None else top_k, 1.0 if top_p is None else top_p)
        assert set(ids.tolist()) <= set(ref.support.tolist())


def test_previous_top_p_path_restores_the_candidate_count():
    from triton_sampling_mask.sampling import sampler

    saved = sampler._TOP_P_CANDIDATES
    with pytest.raises(RuntimeError), kernel.previous_top_p_path(10 * saved):
        assert 10 * saved == sampler._TOP_P_CANDIDATES
        raise RuntimeError("a failing call")
    assert saved == sampler._TOP_P_CANDIDATES


def test_floor_targets_read_their_cases():
    """b1/b2/b3 read B=1 V=151936, B=1 V=32000 and B=64 V=151936 (top_k 512) on the full grid, and
    b1_k50/b2_k50 the two B=1 cases at top_k 50."""
    grid = kernel.FULL_GRID
    cases = [
        {
            "rows": b,
            "vocab": v,
            "top_k": k,
            "logits": "fp32",
            "ours_over_floor_mask": b + v / 1e6 + k / 1e9,
            "ours_over_floor_nomask": 1.0,
            "speedup_vs_baseline_mask": 20.0,
            "speedup_vs_baseline_nomask": 20.0,
            "mask_on_over_off": 1.0,
            "best_of": dict.fromkeys(("ours_over_floor_mask", "speedup_vs_baseline_mask", "mask_on_over_off"), 1.0),
        }
        for b in grid["rows"]
        for v in grid["vocab"]
        for k in grid["top_k"]
    ]
    targets = report.verdicts(cases, None)
    assert "b" not in targets
    for key, (rows, vocab) in {"b1": (1, 151936), "b2": (1, 32000), "b3": (64, 151936)}.items():
        assert targets[key]["case"] == f"B={rows} V={vocab} top_k=512 (fp32)" and not targets[key]["stand_in"]
        assert targets[key]["value"] == pytest.approx(rows + vocab / 1e6 + 512 / 1e9)
    assert [targets[k]["threshold"] for k in ("b1", "b2", "b3")] == [1.5, 2.0, 1.0]
    for key, (vocab, threshold) in {"b1_k50": (151936, 1.5), "b2_k50": (32000, 2.0)}.items():
        assert targets[key]["case"] == f"B=1 V={vocab} top_k=50 (fp32)" and not targets[key]["stand_in"]
        assert targets[key]["value"] == pytest.approx(1 + vocab / 1e6 + 50 / 1e9)
        assert targets[key]["threshold"] == threshold


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_targets_and_top_p(results: dict) -> None:
    """The new floor targets (each with its three views) and the top-p case, all positive and finite."""
    assert {"a", "b1", "b2", "b3", "c"} <= set(results["targets"])
    for key in ("b1", "b2", "b3"):
        verdict = results["targets"][key]
        assert all(_positive_finite(verdict[view]) for view in ("value", "paired_median", "best_of_rounds")), verdict
    top_p = results["top_p"]
    assert top_p["top_k"] == -1 and top_p["vocab"] > top_p["candidates"]  # the candidates path runs
    assert {"ours", "previous", "baseline"} <= set(top_p["ms"])
    assert all(_positive_finite(v) for v in [*top_p["ms"].values(), *top_p["over_ours"].values()])


@pytest.mark.timeout(420)  # one tritonserver per served table, the API process too: minutes on 2 loaded cores
def test_tiny_benchmark_writes_results(tmp_path):
    """`make bench` on tiny sizes, served part included (it starts its own tritonserver)."""
    output, plot = tmp_path / "latest.json", tmp_path / "ratios.png"
    try:  # matplotlib comes with `make bench`, not `make setup`: plot only where it is installed
        import matplotlib  # noqa: F401

        plot_args = ["--plot", str(plot)]
    except ImportError:
        plot_args = ["--no-plot"]
    run.main(["--tiny", "--output", str(output), *plot_args])
    results = json.loads(output.read_text())
    assert {"a", "b1", "b2", "b3", "c", "d"} <= set(results["targets"])
    assert results["complete"] and len(results["kernel"]) == 5  # 2 B x 2 V, plus the bf16 headline
    _check_targets_and_top_p(results)
    protocols = {entry["protocol"] for entry in results["served"]["served"]}
    assert protocols == {"http", "grpc", "grpc_shm"}
    assert all(entry["requests"] > 0 for entry in results["served"]["served"])
    # The one-call table: every path with both logits dtypes, each point answered, (e)-(g) reported.
    call = results["served_call"]
    sampled = {(entry["path"], entry["logits"]) for entry in call["served"] if not entry.get("noop")}
    assert sampled == {(path, dtype) for path in ("grpc", "http", "grpc_shm", "http_shm") for dtype in ("fp32", "bf16")}
    assert all(entry["requests"] > 0 and _positive_finite(entry["p50_ms"]) for entry in call["served"])
    assert all(_positive_finite(results["targets"][key]["value"]) for key in ("e", "f", "g"))
    # The step-latency table: every rows x path x concurrency point timed call by call, (h) and (i)
    # reported, and generate's inter-token gaps.
    step = results["step_latency"]
    points = {(p["rows"], p["path"], p["concurrency"]) for p in step["points"]}
    assert points == {(rows, path, c) for rows in (1, 8) for path in ("grpc", "grpc_shm") for c in (1, 2)}
    assert all(p["calls"] == step["calls_per_point"] and _positive_finite(p["max_ms"]) for p in step["points"])
    assert step["itl"]["calls"] > 0 and _positive_finite(step["itl"]["p50_ms"])
    assert {"h", "i"} <= set(results["targets"]) and _positive_finite(results["targets"]["i"]["value"])
    # The front door's cost: every point timed both ways, both targets reported.
    if "proxy_cost_skipped" not in results:
        points = results["proxy_cost"]["points"]
        assert set(points) == {"call_grpc", "call_grpc_shm", "step_grpc", "step_http"}
        assert all(
            _positive_finite(p["direct_p50_ms"]) and _positive_finite(p["proxy_p50_ms"]) for p in points.values()
        )
        assert _positive_finite(results["targets"]["proxy_call"]["value"])
        assert "proxy_step" in results["targets"]
        # ... and on streaming generation: both sides answered every request, three targets.
        stream = results["stream_cost"]
        assert stream["errors"] == 0 and stream["direct"]["requests"] == stream["proxy"]["requests"] > 0
        figures = ("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s")
        assert all(_positive_finite(stream[side][name]) for side in ("direct", "proxy") for name in figures)
        assert all(_positive_finite(results["targets"][key]["value"]) for key in stream_cost.TARGETS)
    # The HTTP API's cost: both paths streamed every token at each stream count, the target reported.
    for point in results["api_cost"]["points"].values():
        assert point["grpc"]["tokens"] == point["http"]["tokens"] > 0
        assert _positive_finite(point["api_cpu_us_per_token"]) and _positive_finite(point["http"]["ttft_p50_ms"])
    assert set(api_cost.TARGETS) <= set(results["targets"])
    # Speculative decoding against plain: every workload x streams x algorithm point measured, a
    # ratio per workload and streams, drawn as speculative.png beside the other figures.
    speculative = results["speculative"]
    measured = {(p["workload"], p["streams"], p["algorithm"]) for p in speculative["points"]}
    assert measured == {(w, n, a) for w in ("repetitive", "non-repetitive") for n in (1, 2) for a in ("none", "ngram")}
    assert all(_positive_finite(p["tokens_per_s"]) for p in speculative["points"])
    assert len(speculative["ratios"]) == 4 and all(
        _positive_finite(r["ngram_over_none"]) for r in speculative["ratios"]
    )
    assert "Speculative decoding" in output.with_suffix(".md").read_text()
    assert plot_args == ["--no-plot"] or (plot.stat().st_size > 0 and (tmp_path / "speculative.png").stat().st_size > 0)


@pytest.mark.timeout(120)
def test_tiny_gpu_grid_runs_on_cpu(tmp_path):
    """What bench/gpu.sh runs with BENCH_DEVICE=cpu: the gpu grid's rivals, FlashInfer skipped."""
    output = tmp_path / "gpu.json"
    run.main(["--grid", "gpu", "--tiny", "--skip-served", "--no-plot", "--output", str(output)])
    results = json.loads(output.read_text())
    assert results["flashinfer"].startswith("skipped")
    _check_targets_and_top_p(results)
    assert "vllm" in results["top_p"]["ms"]
    for case in results["kernel"]:
        assert {"ours_plain_mask", "vllm_nomask", "baseline_nomask"} <= set(case["rival_over_ours"])
        assert all(_positive_finite(v) for v in case["rival_over_ours"].values())


# A small results table as `make bench` writes it (only the fields bench/plots.py reads).
PLOT_FIXTURE = {
    "timestamp": "2026-12-03T00:00:00+00:00",
    "device": "cpu",
    "machine": {"cpu": "fixture"},
    "served": {
        "vocab": 2000,
        "in_process": [{"rows_per_call": 1, "rows_per_s": 800.0}, {"rows_per_call": 4, "rows_per_s": 1300.0}],
        "served": [
            {
                "protocol": protocol,
                "concurrency": c,
                "rows_per_s": 100.0 * c,
                "p50_ms": 2.0 * c,
                "p90_ms": 3.0 * c,
                "p99_ms": 5.0 * c,
                "requests": 500,
            }
            for protocol in ("http", "grpc")
            for c in (1, 4)
        ],
    },
    "step_latency": {
        "vocab": 2000,
        "points": [
            {
                "rows": rows,
                "path": "grpc",
                "concurrency": c,
                "calls": 1000,
                "p50_ms": 1.0,
                "p99_ms": 2.0,
                "p999_ms": 3.0,
                "max_ms": 4.0,
                "rows_per_s": 50.0 * rows * c,
            }
            for rows in (1, 8)
            for c in (1, 2)
        ],
    },
}
SPECULATIVE_FIXTURE = {
    "points": [
        {"workload": w, "streams": s, "algorithm": a, "tokens_per_s": 100.0 * s * (2 if a == "ngram" else 1)}
        for w in ("repetitive", "non-repetitive")
        for s in (1, 8)
        for a in ("none", "ngram")
    ]
}


def test_quantile_points_put_each_kept_figure_at_its_quantile():
    from bench import plots

    point = {"p99_ms": 9.0, "p50_ms": 2.0, "p999_ms": 20.0, "max_ms": 31.0, "calls": 1000}
    assert plots.quantile_points(point) == ([2.0, 9.0, 20.0, 31.0], [0.5, 0.99, 0.999, 1 - 1 / 2000])
    assert plots.quantile_points({"p50_ms": 1.0, "p90_ms": 2.0, "requests": 10}) == ([1.0, 2.0], [0.5, 0.9])


def test_the_figures_render_from_a_results_table(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib comes with `make bench` (the bench extra)")
    from bench import plots

    written = plots.render(PLOT_FIXTURE, tmp_path, "gpu_", SPECULATIVE_FIXTURE)
    assert [path.name for path in written] == [f"gpu_{name}" for name in plots.FIGURES]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and path.stat().st_size > 10_000
    # without served tables or speculative results there is nothing to draw, and nothing is written
    assert plots.render({"kernel": []}, tmp_path / "none") == [] and not (tmp_path / "none").exists()


def test_stream_cost_counts_the_clients_process_without_the_servers_it_started():
    """The servers the benchmark measures are its own children, each counted under its own name:
    the clients' CPU time is this process's alone, not its descendants' as well."""
    burn = "import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE)
    try:
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.5:
            time.sleep(0.05)
        own = psutil.Process().cpu_times()
        counted = stream_cost.cpu_times([os.getpid()])
    finally:
        child.communicate(b"")
    assert sum(counted) - (own.user + own.system) < 0.25
