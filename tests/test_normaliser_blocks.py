"""The CPU normaliser over several row blocks with subnormal temperatures (the divisor path,
taken per block), and the per-thread host workspace it sums through: a fresh thread gets its own
buffers. The reference is tests/reference.py's float64 brute force."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling import normalisers
from triton_sampling_mask.sampling.normalisers import normaliser_cpu, workspace

from .reference import reference_row
from .sampling import run_sampler
from .test_boundaries import SUBNORMAL_TEMPERATURES

# Enough logits per row that a few rows fill the normaliser's block: 4 rows a block here.
VOCAB = 1 << 18


def rows_of(count: int) -> np.ndarray:
    rng = np.random.default_rng(count)
    logits = rng.standard_normal((count, VOCAB)).astype(np.float32)
    logits[:, 100:103] = 6.0  # three tied at the max: p = 1/3 each at a subnormal temperature
    return logits


def test_these_rows_take_several_normaliser_blocks():
    assert normalisers._NORMALISER_BLOCK_ELEMENTS // VOCAB == 4  # 6 rows: two blocks


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
def test_the_normaliser_divides_by_a_subnormal_temperature_in_every_block():
    logits = rows_of(6)
    temperature = np.array([1.0, SUBNORMAL_TEMPERATURES[0], 0.5, 2.0, SUBNORMAL_TEMPERATURES[1], 1.0], np.float32)
    z = normaliser_cpu(torch.from_numpy(logits), logits.max(axis=1), temperature)
    for row in range(6):
        shifted = (logits[row].astype(np.float64) - 6.0) / np.float64(temperature[row])
        assert z[row] == pytest.approx(np.exp(shifted).sum(), rel=1e-5), row
    assert z[1] == z[4] == 3.0  # only the ties at the max count at a subnormal temperature


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
def test_sampled_log_probs_at_subnormal_temperatures_over_several_blocks_match_the_reference():
    logits = rows_of(6)
    temperature = np.float32(SUBNORMAL_TEMPERATURES[2])
    out = run_sampler(logits, temperature=temperature, top_k=5, seed=np.arange(6), device_path="cpu", fused=False)
    for row in range(6):
        token = int(out["ids"][row])
        assert token in (100, 101, 102)
        assert out["logprobs"][row] == pytest.approx(reference_row(logits[row], temperature).logprobs[token], abs=1e-6)
        assert out["mask_len"][row] == 5  # top_k: the tokens below the max keep p > 0 (if tiny)


def in_a_new_thread(work):
    """work() run in a thread of its own (a fresh thread-local workspace), its result or exception."""
    box = {}

    def run():
        try:
            box["result"] = work()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_a_new_thread_gets_float32_workspaces_that_grow_on_demand():
    def work():
        small = workspace("test-slot", (2, 3))
        small.fill_(1.0)
        larger = workspace("test-slot", (4, 5))
        again = workspace("test-slot", (1, 2))
        return small, larger, again

    small, larger, again = in_a_new_thread(work)
    assert small.shape == (2, 3) and small.dtype == torch.float32
    assert larger.shape == (4, 5) and larger.dtype == torch.float32
    assert again.shape == (1, 2) and again.data_ptr() == larger.data_ptr()  # reused, not reallocated


def test_the_cpu_path_samples_in_a_fresh_thread_as_in_this_one():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 5000)).astype(np.float32)
    params = dict(temperature=0.8, top_k=np.array([-1, 40, 4000]), top_p=0.9, seed=np.arange(3), device_path="cpu")
    there = in_a_new_thread(lambda: run_sampler(logits, **params))
    here = run_sampler(logits, **params)
    for name in here:
        np.testing.assert_array_equal(there[name], here[name], err_msg=name)
    for row in range(3):
        ref = reference_row(logits[row], 0.8, int(params["top_k"][row]), 0.9)
        token = int(there["ids"][row])
        assert there["logprobs"][row] == pytest.approx(ref.logprobs[token], abs=1e-5)
