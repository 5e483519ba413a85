"""The benchmark runs end to end on a tiny size (no timings are asserted), and its baseline
samples the documented support: checked against the float64 reference on tie-free logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import baseline, kernel, run
from tests.reference import reference_row


def test_baseline_support_matches_reference():
    """The full-sort baseline is a fair comparison only if it samples the same support."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 2  # continuous: no ties
    top_k, top_p, temperature = 20, 0.8, 0.8
    out = baseline.full_sort_sample(
        torch.from_numpy(logits), torch.full((4,), temperature), torch.full((4,), top_k),
        torch.full((4,), top_p), torch.zeros(4), mask_width=32, want_mask=True,
    )
    for row in range(4):
        ref = reference_row(logits[row], temperature, top_k, top_p)
        length = int(out["mask_len"][row])
        np.testing.assert_array_equal(out["mask_ids"][row, :length].numpy(), ref.support)
        assert int(out["token_ids"][row]) in set(ref.support.tolist())
        token = int(out["token_ids"][row])
        np.testing.assert_allclose(float(out["logprobs"][row]), ref.logprobs[token], atol=1e-4)
        np.testing.assert_allclose(float(out["mask_logprobs"][row]), ref.renormalised_logprob(token, length), atol=1e-4)


def test_kernel_case_reports_every_timing():
    fake_ms = {"ours_mask": 2.0, "ours_nomask": 1.6, "baseline_mask": 30.0, "baseline_nomask": 29.0, "floor": 4.0}
    case = kernel.run_case(2, 500, 8, 16, torch.device("cpu"),
                           lambda fns, device: {n: {"median_ms": fake_ms[n], "min_ms": fake_ms[n], "rounds": 1} for n in fns})
    assert case["ms"] == fake_ms
    assert case["speedup_vs_baseline_mask"] == pytest.approx(15.0)
    assert case["ours_over_floor_mask"] == pytest.approx(0.5)
    assert case["mask_on_over_off"] == pytest.approx(1.25)


@pytest.mark.timeout(240)
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
    assert {"a", "b", "c", "d"} <= set(results["targets"])
    assert len(results["kernel"]) == 3
    protocols = {entry["protocol"] for entry in results["served"]["served"]}
    assert protocols == {"http", "grpc", "grpc_shm"}
    assert all(entry["requests"] > 0 for entry in results["served"]["served"])
    assert plot_args == ["--no-plot"] or plot.stat().st_size > 0
