"""Batched token sampler that also returns the sampling mask (plain torch, no Triton).

Semantics (SGLang's): p = softmax(logits / T) over the whole vocabulary; tokens are ranked by
logit, descending, ties broken by lower token id (a total order, so a support never depends on
the batch or on a kernel's tie-breaking). The support of a row is

    {rank < top_k} ∩ {mass ranked strictly before the token <= top_p} ∩ {p >= min_p * p_max}
    ∩ {logit > -inf}

and the token is drawn from p restricted to it. top_p >= 1 disables the top-p rule outright.
T == 0 is greedy (SGLang's convention: top_k = 1 and T = 1 for the log-probabilities).
Because every rule keeps a prefix of the ranking, the support is the first `support_len` ranked
ids. With a finite top_k only a top-k selection and one exp-sum pass over the vocabulary are
needed; a full sort happens only for rows with top_k = -1 and top_p < 1 or a top_k above
1024, and those rows are ranked apart from the others, in row blocks of bounded memory.

This module plans (`plan_rows`: each row's path, from its parameters on the host) and dispatches
each row group to the ops: `selection` ranks candidates, `normalisers` sum the row's mass,
`epilogues` apply the rules and draw, `fused` does all three in Triton kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .epilogues import epilogue_numpy, epilogue_torch, unranked_outputs
from .normalisers import normaliser_cpu, normaliser_torch
from .params import (
    MIN_P,
    PARAM_SPECS,
    RETURN_SAMPLING_MASK,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_K_ALL,
    TOP_P,
    RowParams,
    applied_top_k,
)
from .results import ROW_MAX, HostResult, SamplingResult, TensorResult
from .selection import FULL_VOCAB_BLOCK_ELEMENTS, device_path_for, ranked_candidates, ranked_candidates_cpu


@dataclass
class SamplingBatch:
    """Rows to sample: logits [B, V] (float32, bfloat16 or float16) on the sampling device and
    their parameters on the host, every row seeded (`RowParams.with_seeds`).

    The parameters stay on the host, where requests arrive: the sampler plans its row groups and
    candidate counts from them without a device-to-host sync, and copies to the device only what
    a path needs.
    """

    logits: torch.Tensor
    params: RowParams

    def __post_init__(self):
        if not self.params.has_seed.all():
            raise ValueError("every row to sample needs its seed: resolve them with RowParams.with_seeds")

    @classmethod
    def from_arrays(cls, logits: torch.Tensor, temperature, top_k, top_p, min_p, seed, want_mask) -> SamplingBatch:
        """A batch from one array or tensor [B] per parameter (any other parameter at its default);
        `seed` holds the uint64 seeds or their int64 bit patterns, `want_mask` is return_sampling_mask."""
        rows = logits.shape[0]
        given = {
            TEMPERATURE.name: temperature,
            TOP_K.name: top_k,
            TOP_P.name: top_p,
            MIN_P.name: min_p,
            RETURN_SAMPLING_MASK.name: want_mask,
        }
        # Every field is built once (no defaults made and then replaced): a caller may build a batch
        # per step. The seed is given as uint64 bit patterns, every row seeded.
        fields = {
            spec.name: _host(given[spec.name], spec.dtype) if spec.name in given else spec.filled(rows)
            for spec in PARAM_SPECS
            if spec is not SEED
        }
        fields[SEED.name] = _host(seed, np.int64).view(SEED.dtype)
        fields[SEED.presence] = np.ones(rows, np.bool_)
        return cls(logits, RowParams(**fields))


def _host(value, dtype) -> np.ndarray:
    """`value` (an array, a tensor or a sequence) as a contiguous host array of `dtype`."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value).astype(dtype, copy=False)


# Rows whose effective top_k is above this are ranked apart from the rest (see sample()).
_SMALL_TOP_K = 1024
# Top-p rows without a top_k rank this many candidates first; only rows whose candidates hold
# less than top_p of the mass fall back to a full sort.
_TOP_P_CANDIDATES = 4096


@dataclass
class RowPlan:
    """What the sampler applies to each row and the path each takes, derived once from the rows'
    parameters on the host (no device sync)."""

    params: RowParams  # the batch's, greedy applied (RowParams.greedy_applied)
    k_eff: np.ndarray  # int64, the effective top_k (params.effective_top_k)
    small_k: np.ndarray  # bool: ranked to a top-k of at most _SMALL_TOP_K candidates
    top_p_first: np.ndarray  # bool: no top_k, top_p < 1: candidates first, full sort if needed
    full_sort: np.ndarray  # bool: ranked over the whole vocabulary, in row blocks
    unranked: np.ndarray  # bool: no ranking at all (whole-vocabulary Gumbel-max)

    def rows(self, index: np.ndarray | None) -> tuple[RowParams, np.ndarray]:
        """The parameters and effective top_k of the rows `index` (None: every row, no copies)."""
        if index is None:
            return self.params, self.k_eff
        return self.params.take(index), self.k_eff[index]


def plan_rows(batch: SamplingBatch) -> RowPlan:
    """Which path each row takes, from the host-side parameters alone."""
    rows, vocab = batch.logits.shape
    params = batch.params.greedy_applied()
    k_eff = applied_top_k(params.top_k, vocab)
    everything = params.top_k == TOP_K_ALL
    if not everything.any():  # the decode step's common case: a handful of numpy calls, not two dozen
        small_k = k_eff <= _SMALL_TOP_K
        return RowPlan(params, k_eff, small_k, np.zeros(rows, bool), ~small_k, np.zeros(rows, bool))
    unranked = everything & (params.top_p >= 1) & ~params.return_sampling_mask
    small_k = ~unranked & (k_eff <= _SMALL_TOP_K)
    # k_eff = V there: such a row is small-k only when V <= _SMALL_TOP_K < _TOP_P_CANDIDATES.
    top_p_first = everything & ~unranked & (vocab > _TOP_P_CANDIDATES)
    full_sort = ~(unranked | small_k | top_p_first)
    return RowPlan(params, k_eff, small_k, top_p_first, full_sort, unranked)


def _small_k_group(batch: SamplingBatch) -> tuple[RowParams, np.ndarray, int] | None:
    """(params greedy applied, effective top_k, the largest) when every row of the batch is ranked
    to a top-k of at most _SMALL_TOP_K candidates, read in a few numpy calls; None when a row may
    take another path (`plan_rows` then routes every row)."""
    params = batch.params.greedy_applied()
    if params.top_k.min() <= TOP_K_ALL:  # the whole vocabulary, or a top_k no request may send
        return None
    k_eff = applied_top_k(params.top_k, batch.logits.shape[1])
    largest = int(k_eff.max())
    return (params, k_eff, largest) if largest <= _SMALL_TOP_K else None


def sample(
    batch: SamplingBatch, mask_width: int, fused: bool | None = None, device_path: str | None = None
) -> SamplingResult:
    """Draw one token per row and, for rows that ask, its support (at most `mask_width` ids).

    `fused` picks the Triton kernels for the finite-top_k rows (default: on CUDA when Triton is
    importable); the tests also run them on CPU tensors under Triton's interpreter. `device_path`
    picks the ops of the other rows, "cpu" or "gpu" (default: the logits' device's, see
    `selection.device_path_for`); the tests also run the "gpu" ops on CPU tensors.
    """
    rows = batch.logits.shape[0]
    device = batch.logits.device
    device_path = device_path_for(device, device_path)
    if fused is None:
        fused = device.type == "cuda" and _fused_available()
    if rows and device_path == "cpu" and not fused:
        group = _small_k_group(batch)
        if group is not None:
            # The decode step's common case on the CPU: one group, read without a full plan; its
            # padded numpy outputs are the result, with no scatter.
            return HostResult(_ranked_outputs(batch.logits, *group, mask_width, device_path)[0])
    plan = plan_rows(batch)
    if rows and fused and plan.small_k.all():
        # One group on the fused kernels: on the GPU no sync and a handful of launches (fused.py).
        return _sample_fused(batch, plan, None, mask_width)
    result = TensorResult.empty(rows, mask_width, device)
    if plan.small_k.any():
        index = np.flatnonzero(plan.small_k)
        if fused:
            _write(result, index, _sample_fused(batch, plan, index, mask_width).host())
        else:
            _sample_ranked(batch, plan, index, int(plan.k_eff[index].max()), mask_width, result, device_path)
    if plan.top_p_first.any():
        index = np.flatnonzero(plan.top_p_first)
        candidates = _TOP_P_CANDIDATES
        support_len = _sample_ranked(batch, plan, index, candidates, mask_width, result, device_path)
        # A support that fills every candidate may continue past them: rank those rows fully.
        plan.full_sort[index[support_len >= candidates]] = True
    # Full-vocabulary groups run in row blocks: their [rows, V] temporaries stay bounded.
    for index in _row_blocks(plan.full_sort, batch.logits.shape[1]):
        _sample_ranked(batch, plan, index, int(plan.k_eff[index].max()), mask_width, result, device_path)
    for index in _row_blocks(plan.unranked, batch.logits.shape[1]):
        _write(result, index, unranked_outputs(_rows(batch, index), plan.rows(index)[0]))
    return result


def _row_blocks(selected: np.ndarray, vocab: int) -> list[np.ndarray]:
    """The indices of the `selected` rows in blocks of at most FULL_VOCAB_BLOCK_ELEMENTS logits."""
    index = np.flatnonzero(selected)
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    return [index[start : start + block_rows] for start in range(0, index.size, block_rows)]


def _fused_available() -> bool:
    try:
        from . import fused
    except ImportError:  # pragma: no cover - fused.py guards its own triton import
        return False
    return fused.AVAILABLE


def _sample_fused(batch: SamplingBatch, plan: RowPlan, index: np.ndarray | None, mask_width: int) -> SamplingResult:
    """The rows `index` (None: every row) through the fused kernels."""
    from . import fused  # imported on first use: it imports triton, which only this path needs

    params, k_eff = plan.rows(index)
    packed_params = torch.from_numpy(fused.pack_params(params, k_eff))
    return fused.PackedResult(fused.sample_packed(_rows(batch, index), packed_params, int(k_eff.max()), mask_width))


def _write(result: TensorResult, index: np.ndarray, values: dict) -> None:
    """Write one group's outputs into the batch's result tensors (through numpy views on the CPU,
    where a torch indexing op would cost more than the copy)."""
    on_cpu = result.output_ids.device.type == "cpu"
    rows = index if on_cpu else torch.from_numpy(index).to(result.output_ids.device)
    for name in SamplingResult.FIELDS:
        target, source = result.tensors[name], values[name]
        if on_cpu:
            target, source = target.numpy(), source.cpu().numpy() if isinstance(source, torch.Tensor) else source
        else:
            source = torch.as_tensor(source).to(device=target.device, dtype=target.dtype)
        # float64 log-probs past float32's range (a subnormal temperature's) become -inf, as a cast on the GPU.
        with np.errstate(over="ignore"):
            if name in SamplingResult.MASK_FIELDS:
                target[rows, : source.shape[1]] = source
            else:
                target[rows] = source


def _rows(batch: SamplingBatch, index: np.ndarray | None) -> torch.Tensor:
    """The logits of a row group (no copy when it is the whole batch; index None means that)."""
    if index is None or index.size == batch.logits.shape[0]:
        return batch.logits
    return batch.logits.index_select(0, torch.from_numpy(index).to(batch.logits.device))


def _sample_ranked(
    batch: SamplingBatch, plan: RowPlan, index: np.ndarray, k: int, mask_width: int, result: TensorResult, path: str
) -> np.ndarray:
    """Rows whose support is a prefix of their top-k ranking (k = the largest effective top_k, or
    the candidate count); writes their outputs and returns their support lengths (numpy)."""
    outputs, support_len = _ranked_outputs(_rows(batch, index), *plan.rows(index), k, mask_width, path)
    _write(result, index, outputs)
    return support_len.cpu().numpy() if isinstance(support_len, torch.Tensor) else support_len


def _ranked_outputs(
    logits: torch.Tensor, params: RowParams, k_eff: np.ndarray, k: int, mask_width: int, path: str
) -> tuple[dict, np.ndarray | torch.Tensor]:
    """The outputs and support lengths of the rows `logits` with their (greedy-applied) `params` and
    effective top_k: select, normalise, epilogue, with the ops of the device path `path` ("cpu" or
    "gpu"); k is the largest effective top_k, or the candidate count."""
    if path == "cpu":
        values32, ids = ranked_candidates_cpu(logits, k)  # float32 values: exact for bf16 / fp16
        z = normaliser_cpu(logits, values32[:, 0], params.temperature)
        outputs, support_len = epilogue_numpy(values32, ids, z, params, k_eff, mask_width)
        # z is NaN where the row holds a NaN or an inf, or no finite logit. Threshold selection
        # never selects a NaN, so such rows (refused later) take their max as `amax` gives it.
        if math.isnan(z.sum()):
            broken = np.isnan(z)
            outputs[ROW_MAX][broken] = logits[torch.from_numpy(broken)].amax(dim=-1).float().numpy()
        return outputs, support_len
    values, ids = ranked_candidates(logits, k, path)
    z = normaliser_torch(logits, values[:, 0], torch.from_numpy(params.temperature).to(logits.device))
    return epilogue_torch(values, ids, z, params, k_eff, mask_width)
