"""Counter-based uniforms: u(seed, token_id), the same on every device and in every batch.

A row's draw depends only on its seed and the token ids it looks at, never on its neighbours,
its position in the batch or how many candidates the batch selected; that is what makes seeded
rows reproducible across dynamic batches and independent of whether a mask was asked for.
Arithmetic stays in int64 below 2**63, so no signed overflow occurs on any backend.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9  # golden-ratio constant: keeps seed 0 away from the hash's fixed point


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for 0 <= x < 2**32, via 16-bit halves to stay inside int64."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (Wellons' lowbias32) over non-negative int64 values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_state(seeds: torch.Tensor) -> torch.Tensor:
    """Fold 64-bit seeds (int64 bit patterns of the uint64 inputs) into a 32-bit stream key."""
    low = seeds & _MASK32
    high = (seeds >> 32) & _MASK32
    return _mix32(_mix32(low ^ _SEED_SALT) ^ high)


def uniform(state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Float64 uniforms in (0, 1), one per (row state [rows, 1], token id [rows, n]) pair."""
    bits = _mix32(_mix32(state ^ token_ids) ^ _SEED_SALT)
    return (bits.to(torch.float64) + 0.5) * (1.0 / 2**32)


def gumbel(state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise: argmax(log p + noise) draws from p (the Gumbel-max trick)."""
    return -torch.log(-torch.log(uniform(state, token_ids)))


def step_seeds(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """Per-step seeds (int64, >= 0) for multi-token generation: a fresh noise stream per (seed, step).

    Generation step s of a row seeded with `seed` samples with seed step_seeds(seed, s), so the
    stream depends only on (seed, s): reproducible, and independent of batching and masks.
    """
    state = seed_state(seeds)
    step_key = _mix32(torch.full_like(state, step & _MASK32) ^ _SEED_SALT)
    high = _mix32(state ^ step_key)
    low = _mix32(high ^ state ^ 0x85EBCA6B)
    return ((high & 0x7FFFFFFF) << 32) | low
