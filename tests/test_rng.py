"""The counter hash behind seeded draws: all 64 seed bits count, and it is the same everywhere."""

from __future__ import annotations

import numpy as np
import torch

from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import MaskPolicy

from .sampling import run_sampler

# These two seeds folded to the same 32-bit state under the old hash (low ^ high halves).
COLLIDING_UNDER_32_BITS = (0, 11892718254545698817)


def test_seeds_differing_only_in_their_high_bits_draw_differently():
    flat = np.zeros((64, 1000), np.float32)  # uniform rows: the draw is decided by the noise alone
    pairs = [np.array(COLLIDING_UNDER_32_BITS, np.uint64).view(np.int64), np.array([1 << 32, 2 << 32], np.int64)]
    for seeds in pairs:
        first, second = (
            run_sampler(flat, top_k=1000, seed=seed, want_mask=False, mask_width=1)["ids"] for seed in seeds
        )
        assert not np.array_equal(first, second), seeds


def test_stream_keys_do_not_collide_birthday_style():
    # 300k random 64-bit seeds: a 32-bit key space gives ~10 collisions, a 64-bit bijection none.
    seeds = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 300_000, dtype=np.int64)
    keys = rng.seed_state(torch.from_numpy(seeds)).numpy()
    assert np.unique(keys).size == seeds.size


def test_unseeded_rows_draw_64_bit_seeds():
    sampler = BatchSampler(load_backend("torch"), MaskPolicy(8, "test"), torch.device("cpu"))
    drawn = np.concatenate([sampler._entropy.integers(0, 2**64, 100_000, dtype=np.uint64) for _ in range(3)])
    assert np.unique(drawn).size == drawn.size
    assert (drawn >= np.uint64(1 << 63)).any() and (drawn < np.uint64(1 << 32)).sum() < 5  # whole range used
    # and unseeded rows do differ from call to call
    logits = torch.zeros(32, 500)
    params = RowParams.defaults(32)
    first, second = (sampler.sample(logits, params).host()["output_ids"] for _ in range(2))
    assert not np.array_equal(first, second)


def test_numpy_and_torch_hashes_agree_bit_for_bit():
    seeds = np.array([0, 1, -1, 2**62, -(2**63), 12345, *COLLIDING_UNDER_32_BITS[:1]], np.int64)
    ids = np.arange(0, 300_000, 13, dtype=np.int64)[None].repeat(seeds.size, 0)
    torch_u = rng.uniform(rng.seed_state(torch.from_numpy(seeds)).unsqueeze(1), torch.from_numpy(ids)).numpy()
    numpy_u = rng.uniform_numpy(rng.seed_state_numpy(seeds)[:, None], ids)
    assert np.array_equal(torch_u.astype(np.float64), numpy_u)
    assert numpy_u.min() > 0 and numpy_u.max() < 1
    assert abs(numpy_u.mean() - 0.5) < 1e-3


def test_step_seeds_use_all_64_bits():
    steps = torch.stack([rng.step_seeds(torch.tensor([7]), s) for s in range(2000)]).flatten().numpy()
    assert (steps < 0).any() and (steps > 0).any()  # the sign bit (bit 63) varies
    assert np.unique(steps).size == steps.size


def test_numpy_step_seeds_equal_torch_bit_for_bit_each_row_at_its_own_step():
    draw = np.random.default_rng(1)
    seeds = np.concatenate([[0, -1, 2**63 - 1, -(2**63)], draw.integers(-(2**63), 2**63 - 1, 60, dtype=np.int64)])
    steps = np.concatenate([[0, 1, 511, 2**40], draw.integers(0, 100_000, 60)])
    expected = [int(rng.step_seeds(torch.tensor([seed]), int(step))[0]) for seed, step in zip(seeds, steps)]
    assert rng.step_seeds_numpy(seeds, steps).tolist() == expected
    assert rng.step_seeds_numpy(seeds.view(np.uint64), steps).tolist() == expected  # uint64 seeds too


def test_numpy_gumbel_is_minus_log_minus_log_u_bit_for_bit():
    # The CPU epilogue draws with scaled - negated_gumbel_numpy: it must be the Gumbel noise
    # -log(-log(u)) exactly, u the uniforms every device shares.
    seeds = np.array([0, -1, 2**62, 12345], np.int64)
    ids = np.arange(0, 200_000, 7, dtype=np.int64)[None].repeat(seeds.size, 0)
    state = rng.seed_state_numpy(seeds)[:, None]
    u = rng.uniform_numpy(state, ids)
    expected = -np.log(-np.log(u))
    assert np.array_equal(rng.gumbel_numpy(state, ids), expected)
    assert np.array_equal(np.float64(1.5) - rng.negated_gumbel_numpy(state, ids), np.float64(1.5) + expected)
    mixed = rng.mix64(torch.from_numpy(ids)).numpy().view(np.uint64)
    assert np.array_equal(rng.mix64_numpy(ids.view(np.uint64)), mixed)
