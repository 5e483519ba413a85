"""Counter-based uniforms: u(seed, token_id), the same on every device and in every batch.

A row's draw depends only on its full 64-bit seed and the token ids it looks at, never on its
neighbours, its position in the batch or how many candidates the batch selected; that is what
makes seeded rows reproducible across dynamic batches and independent of whether a mask was
asked for.

The hash is SplitMix64's finaliser over int64 bit patterns: multiplications wrap modulo 2**64
(two's complement, identically in torch on CPU and CUDA and in Triton kernels) and right shifts
are made logical by masking off the sign extension. `plugin/sampling/fused.py` implements the
same arithmetic in Triton; tests check the two agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 bit pattern torch and Triton store."""
    return value - (1 << 64) if value >= 1 << 63 else value


MIX_MUL_1 = _signed(0xBF58476D1CE4E5B9)
MIX_MUL_2 = _signed(0x94D049BB133111EB)
GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment: spreads consecutive counters
STEP_GAMMA = _signed(0xD1B54A32D192ED03)  # a second odd constant, for generation steps
UNIFORM_BITS = 23  # (2 * bits + 1) < 2**24 is exact in float32: u is identical on every device
# Paths that compute the Gumbel score (x - max) / T + g in different precisions may draw different
# tokens only when the two best scores lie within NEAR_TIE * (1 + |(x - max) / T|) of each other
# (docs/sampler.md, "Seeds"): the band a re-derived draw is judged against.
NEAR_TIE = 1e-5


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (a bijection of 2**64 with full avalanche)."""
    x = (x ^ _shift_right_logical(x, 30)) * MIX_MUL_1
    x = (x ^ _shift_right_logical(x, 27)) * MIX_MUL_2
    return x ^ _shift_right_logical(x, 31)


def seed_state(seeds: torch.Tensor) -> torch.Tensor:
    """Per-row stream keys (int64) from the int64 bit patterns of the uint64 seeds; all 64 bits count."""
    return mix64(seeds ^ GOLDEN_GAMMA)


def uniform(state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Float32 uniforms in (0, 1), one per (row state [rows, 1], token id [rows, n]) pair."""
    bits = mix64(state + token_ids * GOLDEN_GAMMA)
    top = _shift_right_logical(bits, 64 - UNIFORM_BITS).to(torch.float32)
    return (top * 2 + 1) * (1.0 / (1 << (UNIFORM_BITS + 1)))  # odd multiples of 2**-24: never 0 or 1


def gumbel(state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float32): argmax(log p + noise) draws from p (the Gumbel-max trick)."""
    return -torch.log(-torch.log(uniform(state, token_ids)))


def step_seeds(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Per-step seeds (int64 bit patterns of uint64) for multi-token generation.

    Generation step s of a row seeded with `seed` samples with seed step_seeds(seed, s), so the
    stream depends only on (seed, s): reproducible, and independent of batching and masks.
    `step_seeds_numpy` is the same on host arrays, each row at its own step.
    """
    return mix64(seed_state(seeds) + _signed(((step + 1) * STEP_GAMMA) & ((1 << 64) - 1)))


# The same hash on host numpy arrays (uint64 arithmetic wraps and shifts logically by itself):
# the CPU sampler's epilogue runs in numpy, whose per-op cost is a fraction of torch's. The
# constants are 0-d uint64 arrays made once: building them per call would cost more than the hash,
# and a ufunc takes a 0-d array without the conversion a numpy scalar needs on every call.
_MASK64 = (1 << 64) - 1


def _u64(value: int) -> np.ndarray:
    return np.array(value & _MASK64, np.uint64)


_NP_MUL_1, _NP_MUL_2, _NP_GOLDEN = _u64(MIX_MUL_1), _u64(MIX_MUL_2), _u64(GOLDEN_GAMMA)
_NP_STEP_GAMMA, _NP_ONE = _u64(STEP_GAMMA), _u64(1)
_NP_SHIFTS = tuple(_u64(bits) for bits in (30, 27, 31, 64 - UNIFORM_BITS))
# The same constants as unsigned Python integers, for one row's seed.
_INT_MUL_1, _INT_MUL_2, _INT_GOLDEN = (value & _MASK64 for value in (MIX_MUL_1, MIX_MUL_2, GOLDEN_GAMMA))
_NP_UNIFORM_SCALE = 1.0 / (1 << (UNIFORM_BITS + 1))


def _mix64_numpy_inplace(x: np.ndarray) -> np.ndarray:
    """`mix64` on a uint64 array the caller owns, overwritten: fewer temporaries than `mix64_numpy`."""
    x ^= x >> _NP_SHIFTS[0]
    x *= _NP_MUL_1
    x ^= x >> _NP_SHIFTS[1]
    x *= _NP_MUL_2
    x ^= x >> _NP_SHIFTS[2]
    return x


def mix64_numpy(x: np.ndarray) -> np.ndarray:
    """`mix64` on uint64 numpy arrays, bit for bit (the input is left as it is)."""
    return _mix64_numpy_inplace(np.array(x, np.uint64))


def seed_state_numpy(seeds: np.ndarray) -> np.ndarray:
    """`seed_state` on the int64 (or uint64) bit patterns of seeds; returns uint64 keys."""
    seeds = np.asarray(seeds)
    if seeds.size == 1:  # one row (the B=1 decode step): Python integers cost less than 8 numpy calls
        key = _mix64_int(int(seeds.view(np.uint64).flat[0]) ^ _INT_GOLDEN)
        keys = np.empty(seeds.shape, np.uint64)
        keys.fill(key)
        return keys
    return _mix64_numpy_inplace(seeds.view(np.uint64) ^ _NP_GOLDEN)


def _mix64_int(x: int) -> int:
    """`mix64` on one unsigned 64-bit Python integer, bit for bit."""
    x = ((x ^ (x >> 30)) * _INT_MUL_1) & _MASK64
    x = ((x ^ (x >> 27)) * _INT_MUL_2) & _MASK64
    return x ^ (x >> 31)


def step_seeds_numpy(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`step_seeds` on host numpy arrays, bit for bit: the int64 (or uint64) bit patterns of the
    seeds and each row's step (int64 >= 0); returns int64 bit patterns."""
    offset = (np.asarray(steps, np.int64).view(np.uint64) + _NP_ONE) * _NP_STEP_GAMMA
    offset += seed_state_numpy(seeds)
    return _mix64_numpy_inplace(offset).view(np.int64)


def uniform_numpy(state: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """`uniform` on uint64 keys [rows, 1] and int64 ids [rows, n], as float64 (same values)."""
    bits = np.asarray(token_ids).view(np.uint64) * _NP_GOLDEN
    bits += state
    # mix64 without its last step, x ^= x >> 31: that step leaves the top UNIFORM_BITS bits as they
    # are (x >> 31 has none of them set), and only those are kept.
    bits ^= bits >> _NP_SHIFTS[0]
    bits *= _NP_MUL_1
    bits ^= bits >> _NP_SHIFTS[1]
    bits *= _NP_MUL_2
    bits >>= _NP_SHIFTS[3]
    # (2 * top + 1) * 2**-24 as top * 2**-23 + 2**-24: every step is exact in float64, so the
    # values are `uniform`'s bit for bit, in two numpy calls instead of four.
    uniform = bits * (2 * _NP_UNIFORM_SCALE)
    uniform += _NP_UNIFORM_SCALE
    return uniform


def gumbel_numpy(state: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Gumbel noise from `uniform_numpy`, in float64 (the same uniforms as every other device)."""
    return np.negative(negated_gumbel_numpy(state, token_ids))


def negated_gumbel_numpy(state: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """log(-log(u)), minus `gumbel_numpy`: `x - negated` is `x + gumbel` bit for bit, one numpy call
    fewer (the CPU sampler's draw counts its calls)."""
    noise = uniform_numpy(state, token_ids)
    np.log(noise, out=noise)
    np.negative(noise, out=noise)
    return np.log(noise, out=noise)
