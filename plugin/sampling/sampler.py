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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import rng
from .epilogues import _epilogue_numpy, _epilogue_torch
from .normalisers import _log_normaliser, _normaliser_cpu
from .params import TOP_K_ALL
from .results import SamplingResult
from .selection import _FULL_VOCAB_BLOCK_ELEMENTS, ranked_candidates


@dataclass
class SamplingBatch:
    """Rows to sample. logits [B, V] on the sampling device; the per-row parameters [B] on the host.

    Parameters live on the host (numpy) because that is where requests arrive: the sampler plans
    its row groups and candidate counts from them without a device-to-host sync, and copies to
    the device only what a path needs. Tensors are accepted too (copied to the host once).
    """

    logits: torch.Tensor  # float32 (or bfloat16 / float16)
    temperature: np.ndarray  # float32, 0 = greedy
    top_k: np.ndarray  # int64, -1 = whole vocabulary
    top_p: np.ndarray  # float32 in (0, 1]
    min_p: np.ndarray  # float32 in [0, 1)
    seed: np.ndarray  # int64 bit pattern of the uint64 seed
    want_mask: np.ndarray  # bool

    def __post_init__(self):
        for name, dtype in _PARAM_DTYPES.items():
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            setattr(self, name, np.ascontiguousarray(value, dtype=dtype))


_PARAM_DTYPES = {
    "temperature": np.float32,
    "top_k": np.int64,
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.int64,
    "want_mask": np.bool_,
}


# Rows whose effective top_k is above this are ranked apart from the rest (see sample()).
_SMALL_TOP_K = 1024
# Top-p rows without a top_k rank this many candidates first; only rows whose candidates hold
# less than top_p of the mass fall back to a full sort.
_TOP_P_CANDIDATES = 4096


@dataclass
class RowPlan:
    """Host-side facts about the rows that decide the path each takes (no device sync needed)."""

    temperature: np.ndarray  # float32, greedy rows at 1 (SGLang's convention)
    k_eff: np.ndarray  # int64, the effective top_k: min(top_k, V), V for -1, 1 for greedy
    small_k: np.ndarray  # bool: ranked to a top-k of at most _SMALL_TOP_K candidates
    top_p_first: np.ndarray  # bool: no top_k, top_p < 1: candidates first, full sort if needed
    full_sort: np.ndarray  # bool: ranked over the whole vocabulary, in row blocks
    unranked: np.ndarray  # bool: no ranking at all (whole-vocabulary Gumbel-max)


def plan_rows(batch: SamplingBatch) -> RowPlan:
    """Which path each row takes, from the host-side parameters alone."""
    rows, vocab = batch.logits.shape
    temperature, top_k = batch.temperature, batch.top_k
    greedy = temperature == 0
    if greedy.any():
        temperature = np.where(greedy, np.float32(1), temperature)
        top_k = np.where(greedy, 1, top_k)
    everything = top_k == TOP_K_ALL
    k_eff = np.minimum(top_k, vocab)  # a new array: the batch's top_k stays as it came
    if not everything.any():  # the decode step's common case: a handful of numpy calls, not two dozen
        small_k = k_eff <= _SMALL_TOP_K
        return RowPlan(temperature, k_eff, small_k, np.zeros(rows, bool), ~small_k, np.zeros(rows, bool))
    k_eff[everything] = vocab
    unranked = everything & (batch.top_p >= 1) & ~batch.want_mask
    small_k = ~unranked & (k_eff <= _SMALL_TOP_K)
    # k_eff = V there: such a row is small-k only when V <= _SMALL_TOP_K < _TOP_P_CANDIDATES.
    top_p_first = everything & ~unranked & (vocab > _TOP_P_CANDIDATES)
    full_sort = ~(unranked | small_k | top_p_first)
    return RowPlan(temperature, k_eff, small_k, top_p_first, full_sort, unranked)


def sample(batch: SamplingBatch, mask_width: int, fused: bool | None = None) -> SamplingResult:
    """Draw one token per row and, for rows that ask, its support (at most `mask_width` ids).

    `fused` picks the Triton kernels for the finite-top_k rows (default: on CUDA when Triton is
    importable); the tests also run them on CPU tensors under Triton's interpreter.
    """
    rows = batch.logits.shape[0]
    device = batch.logits.device
    plan = plan_rows(batch)
    if fused is None:
        fused = device.type == "cuda" and _fused_available()
    if rows and plan.small_k.all():
        # The decode step's common case: one group. On the GPU no sync and a handful of launches
        # (fused.py); on the CPU its padded numpy outputs are the result, with no scatter.
        if fused:
            return _sample_fused(batch, plan, np.arange(rows), mask_width)
        if device.type == "cpu":
            return SamplingResult.of_host(_ranked_outputs(batch, plan, None, int(plan.k_eff.max()), mask_width))
    result = SamplingResult.empty(rows, mask_width, device)
    if plan.small_k.any():
        index = np.flatnonzero(plan.small_k)
        if fused:
            _write(result, index, _sample_fused(batch, plan, index, mask_width).host())
        else:
            _sample_ranked(batch, plan, index, int(plan.k_eff[index].max()), mask_width, result)
    if plan.top_p_first.any():
        index = np.flatnonzero(plan.top_p_first)
        candidates = _TOP_P_CANDIDATES
        support_len = _sample_ranked(batch, plan, index, candidates, mask_width, result)
        # A support that fills every candidate may continue past them: rank those rows fully.
        plan.full_sort[index[support_len >= candidates]] = True
    # Full-vocabulary groups run in row blocks: their [rows, V] temporaries stay bounded.
    for index in _row_blocks(plan.full_sort, batch.logits.shape[1]):
        _sample_ranked(batch, plan, index, int(plan.k_eff[index].max()), mask_width, result)
    for index in _row_blocks(plan.unranked, batch.logits.shape[1]):
        _sample_unranked(batch, plan, index, result)
    return result


def _row_blocks(selected: np.ndarray, vocab: int) -> list[np.ndarray]:
    """The indices of the `selected` rows in blocks of at most _FULL_VOCAB_BLOCK_ELEMENTS logits."""
    index = np.flatnonzero(selected)
    block_rows = max(1, _FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    return [index[start : start + block_rows] for start in range(0, index.size, block_rows)]


def _fused_available() -> bool:
    try:
        from . import fused
    except ImportError:  # pragma: no cover - fused.py guards its own triton import
        return False
    return fused.AVAILABLE


def _sample_fused(batch: SamplingBatch, plan: RowPlan, index: np.ndarray, mask_width: int) -> SamplingResult:
    from . import fused

    logits = _rows(batch, index)
    params = fused.pack_params(
        batch.temperature[index],
        batch.top_k[index],
        batch.top_p[index],
        batch.min_p[index],
        batch.seed[index],
        batch.want_mask[index],
        batch.logits.shape[1],
    )
    k_max = int(plan.k_eff[index].max())
    return SamplingResult(packed=fused.sample_packed(logits, torch.from_numpy(params), k_max, mask_width))


def _write(result: SamplingResult, index: np.ndarray, values: dict) -> None:
    """Write one group's outputs into the batch's result tensors (through numpy views on the CPU,
    where a torch indexing op would cost more than the copy)."""
    on_cpu = result.output_ids.device.type == "cpu"
    rows = index if on_cpu else torch.from_numpy(index).to(result.output_ids.device)
    for name in SamplingResult.FIELDS:
        target, source = getattr(result, name), values[name]
        if on_cpu:
            target, source = target.numpy(), source.cpu().numpy() if isinstance(source, torch.Tensor) else source
        else:
            source = torch.as_tensor(source).to(device=target.device, dtype=target.dtype)
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
    batch: SamplingBatch, plan: RowPlan, index: np.ndarray, k: int, mask_width: int, result: SamplingResult
) -> np.ndarray:
    """Rows whose support is a prefix of their top-k ranking (k = the largest effective top_k, or
    the candidate count); writes their outputs and returns their support lengths (numpy)."""
    outputs = _ranked_outputs(batch, plan, index, k, mask_width)
    _write(result, index, outputs)
    support_len = outputs["support_len"]
    return support_len.cpu().numpy() if isinstance(support_len, torch.Tensor) else support_len


def _ranked_outputs(batch: SamplingBatch, plan: RowPlan, index: np.ndarray | None, k: int, mask_width: int) -> dict:
    """`_sample_ranked`'s outputs, and "support_len", for the rows `index` (None: every row)."""
    logits = _rows(batch, index)
    values, ids = ranked_candidates(logits, k)
    rows = _RowParams.of(batch, plan, index)
    if logits.device.type == "cpu":
        values32 = (values if values.dtype == torch.float32 else values.float()).numpy()  # bf16 / fp16: exact
        z = _normaliser_cpu(logits, values32[:, 0], rows.temperature)
        outputs = _epilogue_numpy(values32, ids.numpy(), z, rows, mask_width)
        # z is NaN where the row holds a NaN or an inf, or no finite logit. Threshold selection
        # never selects a NaN, so such rows (refused later) take their max as `amax` gives it.
        if np.isnan(z.sum()):
            broken = np.isnan(z)
            outputs["row_max"][broken] = logits[torch.from_numpy(broken)].amax(dim=-1).float().numpy()
        return outputs
    log_z = _log_normaliser(logits, values[:, 0], torch.from_numpy(rows.temperature).to(logits.device))
    return _epilogue_torch(values, ids, log_z, rows, mask_width)


@dataclass
class _RowParams:
    """One group's host-side parameters, greedy already applied."""

    temperature: np.ndarray
    k_eff: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    want_mask: np.ndarray

    @classmethod
    def of(cls, batch: SamplingBatch, plan: RowPlan, index: np.ndarray | None) -> _RowParams:
        """The parameters of the rows `index`; None: every row, without copies."""
        fields = (plan.temperature, plan.k_eff, batch.top_p, batch.min_p, batch.seed, batch.want_mask)
        return cls(*(fields if index is None else (field[index] for field in fields)))


def _sample_unranked(batch: SamplingBatch, plan: RowPlan, index: np.ndarray, result: SamplingResult) -> None:
    """Rows with top_k = -1, top_p >= 1 and no mask: Gumbel-max over the whole vocabulary."""
    logits = _rows(batch, index)
    device = logits.device
    row_max = logits.amax(dim=-1)
    temperature = torch.from_numpy(plan.temperature[index]).to(device, torch.float64).unsqueeze(1)
    scaled = (logits.to(torch.float64) - row_max.to(torch.float64).unsqueeze(1)) / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    min_p = torch.from_numpy(batch.min_p[index]).to(device, torch.float64).unsqueeze(1)
    keep = (logits > float("-inf")) & (scaled.exp() >= min_p)
    vocab_ids = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    noise = rng.gumbel(rng.seed_state(torch.from_numpy(batch.seed[index]).to(device)).unsqueeze(1), vocab_ids)
    score = torch.where(keep, scaled + noise, torch.tensor(float("-inf"), dtype=torch.float64, device=device))
    pick = score.argmax(dim=-1, keepdim=True)
    _write(
        result,
        index,
        {
            "output_ids": pick.squeeze(1),
            "output_logprobs": scaled.gather(1, pick).squeeze(1) - log_z,
            "sampling_mask": torch.full((index.size, 0), -1, dtype=torch.int32),
            "sampling_mask_len": torch.zeros(index.size, dtype=torch.int32),
            "sampling_logprobs": torch.zeros(index.size, dtype=torch.float32),
            "sampling_mask_logprobs": torch.full((index.size, 0), float("-inf")),
            "row_max": row_max,
        },
    )
