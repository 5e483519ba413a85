"""Normalisers: each row's sum of exp((logits - max) / T), and the per-thread host workspace."""

from __future__ import annotations

import threading

import numpy as np
import torch

_WORKSPACE = threading.local()


def workspace(slot: str, shape: tuple[int, int]) -> torch.Tensor:
    """An uninitialised host float32 tensor of `shape` from a per-thread buffer reused from call to
    call (valid until the next call with the same `slot`).

    Row blocks are several MiB, and allocators hand blocks that size back to the OS when freed: a
    fresh one per call would pay its page faults on every call, more than the work done in it.
    """
    views = _WORKSPACE.__dict__.setdefault("views", {})
    held = views.get(slot)
    # The view of the last shape asked is kept: a decode step asks the same shape every time, and
    # making a view costs two torch calls, which show at B=1.
    if held is not None and held[0] == shape:
        return held[1]
    numel = shape[0] * shape[1]
    buffer = held[2] if held is not None and held[2].numel() >= numel else torch.empty(numel, dtype=torch.float32)
    views[slot] = (shape, buffer[:numel].view(shape), buffer)
    return views[slot][1]


# Logits per scratch block in the CPU normaliser: a few MiB stays in cache and under the
# allocator's mmap threshold.
_NORMALISER_BLOCK_ELEMENTS = 1 << 20
_LOG2_E = 1.4426950408889634
_SMALLEST_NORMAL = np.finfo(np.float32).tiny  # below it, log2(e) / T may overflow float32


def normaliser_torch(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """sum exp((logits - max) / T) per row as float64 (summed in float32), in one pass on the
    logits' device (the GPU path, where memory traffic is not the cost). The sum itself, not its
    log: a run of logits tied at the max adds exact ones, so the top-p rule can be decided exactly."""
    scratch = logits - row_max.float().unsqueeze(1)  # bf16 / fp16 logits: the exp-sum runs in float32
    scratch.div_(temperature.unsqueeze(1)).exp_()
    return scratch.sum(dim=-1).to(torch.float64)


def normaliser_cpu(logits: torch.Tensor, row_max: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """sum exp((logits - max) / T) per row, as float32 numpy (the epilogue widens it to float64), in
    one pass over cache-sized row blocks. row_max float32 [rows] (each row's largest logit),
    temperature float32 [rows].

    exp((x - max) / T) is computed as exp2((x - max) * (log2(e) / T)), torch's cheaper float32
    exponential on the CPU. The subtraction comes first, so the largest terms stay exact. Where
    log2(e) / T overflows float32 (a subnormal T) the scale would turn the max's 0 into 0 * inf =
    NaN: such calls divide by T first, (x - max) / T * log2(e), which is right for every T.
    """
    rows, vocab = logits.shape
    divisor = None
    if (
        not temperature.size or temperature.min() >= _SMALLEST_NORMAL
    ):  # log2(e) / T cannot overflow: no error state to set
        scale = _LOG2_E / temperature  # float32 (a Python float does not widen it)
    else:
        with np.errstate(over="ignore"):
            scale = _LOG2_E / temperature
        if np.isinf(scale).any():
            divisor, scale = torch.from_numpy(temperature[:, None]), np.full_like(scale, _LOG2_E)
    shift, scale = torch.from_numpy(row_max[:, None]), torch.from_numpy(scale[:, None])
    block = max(1, min(rows, _NORMALISER_BLOCK_ELEMENTS // max(vocab, 1)))
    scratch = workspace("normaliser", (block, vocab))
    if block == rows:  # one block: no slicing (at B=1 every torch call's dispatch shows)
        return _exp_sum(logits, shift, scale, scratch, divisor).numpy()
    sums = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, block):  # a loop over memory blocks, not over requests
        stop = min(rows, start + block)
        part = None if divisor is None else divisor[start:stop]
        sums[start:stop] = _exp_sum(
            logits[start:stop], shift[start:stop], scale[start:stop], scratch[: stop - start], part
        )
    return sums.numpy()


def _exp_sum(
    logits: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor, divisor: torch.Tensor | None
) -> torch.Tensor:
    """sum exp2((logits - shift) / divisor * scale) per row (no division where `divisor` is None),
    through `scratch` (four calls, five for bf16 / fp16; one small allocation). Torch's ops, not
    numpy's: a row spanning more than float32's range overflows (x - max) to -inf, which numpy
    would warn about on every such call."""
    if logits.dtype == torch.float32:
        torch.sub(logits, shift, out=scratch)
    else:  # bf16 / fp16: converted into scratch first (a mixed-dtype sub would allocate a float32 copy)
        scratch.copy_(logits).sub_(shift)
    if divisor is not None:
        scratch.div_(divisor)
    scratch.mul_(scale).exp2_()
    return scratch.sum(dim=-1)
