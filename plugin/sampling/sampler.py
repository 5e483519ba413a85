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
from .params import TOP_K_ALL


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


_PARAM_DTYPES = {"temperature": np.float32, "top_k": np.int64, "top_p": np.float32, "min_p": np.float32,
                 "seed": np.int64, "want_mask": np.bool_}


class SamplingResult:
    """Per-row outputs: token_ids int64 [B], logprobs float32 [B] (full-vocabulary softmax(logits / T)),
    mask_ids int32 [B, W] (most probable first, -1 padded), mask_len int32 [B] (0 where not asked),
    mask_logprobs float32 [B] (renormalised over the support, 0 where not asked),
    mask_support_logprobs float32 [B, W] (each mask id's log-probability renormalised over the
    support, -inf padded) and row_max [B] (each row's largest logit, NaN / +inf propagated as by
    `amax`, for the logits checks).

    The fused GPU path hands back one packed device tensor instead; `host()` copies it once and
    the fields are read from that copy.
    """

    FIELDS = ("token_ids", "logprobs", "mask_ids", "mask_len", "mask_logprobs", "mask_support_logprobs", "row_max")
    MASK_FIELDS = ("mask_ids", "mask_support_logprobs")  # [B, W]; a group may fill only its first columns

    def __init__(self, token_ids=None, logprobs=None, mask_ids=None, mask_len=None, mask_logprobs=None,
                 mask_support_logprobs=None, row_max=None, packed: torch.Tensor | None = None):
        self.packed = packed
        self._host: dict[str, np.ndarray] | None = None
        self._fields = dict(token_ids=token_ids, logprobs=logprobs, mask_ids=mask_ids, mask_len=mask_len,
                            mask_logprobs=mask_logprobs, mask_support_logprobs=mask_support_logprobs, row_max=row_max)

    @classmethod
    def empty(cls, rows: int, mask_width: int, device: torch.device) -> "SamplingResult":
        """Outputs to fill group by group (-1 padded masks, zeros elsewhere)."""
        if device.type == "cpu":  # numpy allocations, shared with torch: cheaper than torch's own
            full = lambda shape, value, dtype: torch.from_numpy(np.full(shape, value, dtype))  # noqa: E731
        else:
            full = lambda shape, value, dtype: torch.full(shape, value, dtype=getattr(torch, np.dtype(dtype).name), device=device)  # noqa: E731
        return cls(full(rows, 0, np.int64), full(rows, 0, np.float32), full((rows, mask_width), -1, np.int32),
                   full(rows, 0, np.int32), full(rows, 0, np.float32), full((rows, mask_width), -np.inf, np.float32),
                   full(rows, 0, np.float32))

    def host(self) -> dict[str, np.ndarray]:
        """Every field as numpy, with one device-to-host copy for a packed result."""
        if self._host is None:
            if self.packed is not None:
                from . import fused  # only packed results come from there

                self._host = fused.unpack(self.packed.cpu().numpy())
            else:
                self._host = {name: value.cpu().numpy() for name, value in self._fields.items()}
        return self._host

    def __getattr__(self, name):
        if name in SamplingResult.FIELDS:
            if self.packed is None:
                return self._fields[name]
            return torch.from_numpy(self.host()[name])
        raise AttributeError(name)


# Rows whose effective top_k is above this are ranked apart from the rest (see sample()).
_SMALL_TOP_K = 1024
# Top-p rows without a top_k rank this many candidates first; only rows whose candidates hold
# less than top_p of the mass fall back to a full sort.
_TOP_P_CANDIDATES = 4096
# Entries per row block on the full-vocabulary paths (float64 scores and sort indices per entry).
_FULL_VOCAB_BLOCK_ELEMENTS = 1 << 21


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
    vocab = batch.logits.shape[1]
    greedy = batch.temperature == 0
    temperature = np.where(greedy, np.float32(1), batch.temperature)
    top_k = np.where(greedy, 1, batch.top_k)
    k_eff = np.where(top_k == TOP_K_ALL, vocab, np.minimum(top_k, vocab))
    unranked = (top_k == TOP_K_ALL) & (batch.top_p >= 1) & ~batch.want_mask
    small_k = ~unranked & (k_eff <= _SMALL_TOP_K)
    top_p_first = ~unranked & ~small_k & (top_k == TOP_K_ALL) & (vocab > _TOP_P_CANDIDATES)
    full_sort = ~unranked & ~small_k & ~top_p_first
    return RowPlan(temperature, k_eff.astype(np.int64), small_k, top_p_first, full_sort, unranked)


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
    if fused and rows and plan.small_k.all():
        # The decode step's common case: one group, no sync, a handful of launches (fused.py).
        return _sample_fused(batch, plan, np.arange(rows), mask_width)
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
    params = fused.pack_params(batch.temperature[index], batch.top_k[index], batch.top_p[index], batch.min_p[index],
                               batch.seed[index], batch.want_mask[index], batch.logits.shape[1])
    k_max = int(plan.k_eff[index].max())
    return SamplingResult(packed=fused.sample_packed(logits, torch.from_numpy(params), k_max, mask_width))


def _write(result: SamplingResult, index: np.ndarray, values: dict) -> None:
    """Write one group's outputs into the batch's result tensors (through numpy views on the CPU,
    where a torch indexing op would cost more than the copy)."""
    on_cpu = result.token_ids.device.type == "cpu"
    rows = index if on_cpu else torch.from_numpy(index).to(result.token_ids.device)
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


def _rows(batch: SamplingBatch, index: np.ndarray) -> torch.Tensor:
    """The logits of a row group (no copy when it is the whole batch)."""
    if index.size == batch.logits.shape[0]:
        return batch.logits
    return batch.logits.index_select(0, torch.from_numpy(index).to(batch.logits.device))


def ranked_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest logits of each row in the total order (logit desc, id asc): values, ids."""
    rows, vocab = logits.shape
    if k >= vocab:
        # A stable descending sort keeps equal logits in ascending id order.
        return torch.sort(logits, dim=-1, descending=True, stable=True)
    # Fetch a few candidates past k: a run of equal logits at the k-th place (common with bf16
    # logits) then usually ends inside the fetched set, and ranking the set by (logit, id) is
    # exact without another pass over the vocabulary.
    fetched = k + min(vocab - k, 16 + k // 4)
    values, ids = torch.topk(logits, fetched, dim=-1, sorted=True)
    # On the CPU the small [rows, fetched] bookkeeping runs in numpy (views, no copies): a numpy
    # op costs a few microseconds where a torch op's dispatch costs several times that.
    array = np if logits.device.type == "cpu" else torch
    view = (lambda tensor: tensor.numpy()) if array is np else (lambda tensor: tensor)  # noqa: E731
    values_view = view(values.float() if values.dtype != torch.float32 and array is np else values)
    boundary = values_view[:, k - 1]
    overflows = (values_view[:, -1] == boundary) & (boundary > float("-inf"))
    if bool(overflows.any()):  # the run reaches past the fetched set: find its lowest ids
        ids = _repair_boundary_ties(logits, values, ids, torch.as_tensor(overflows).to(logits.device))
    # topk already ranks by value, so only ids inside runs of equal values may be out of order:
    # one sort of the key (run index, id), nearly sorted already, replaces two full sorts.
    changes = values_view[:, 1:] != values_view[:, :-1]
    if array is np:
        run = np.zeros((rows, fetched), np.int64)
        np.cumsum(changes, axis=1, out=run[:, 1:])
        run *= vocab
        ids = torch.from_numpy(np.sort(run + ids.numpy(), axis=1) - run)
    else:
        run = torch.cat([changes.new_zeros(rows, 1, dtype=torch.int64), torch.cumsum(changes, dim=-1)], dim=-1) * vocab
        ids = torch.sort(run + ids, dim=-1).values - run
    return values[:, :k], ids[:, :k]


def _repair_boundary_ties(logits, values, ids, overflows):
    """Give the places holding the last fetched value, in `overflows` rows, to the lowest tied ids.

    `values` is sorted descending (topk's order), so each row holds `above` candidates strictly
    above its last value, then ones equal to it; those places go to the lowest ids whose logit
    equals the boundary: the smallest keys of (id where tied, else V), one bounded top-k. Only
    overflowing rows are scanned, in row blocks, so memory stays bounded even when every logit ties.
    """
    fetched = values.shape[1]
    vocab = logits.shape[1]
    ids = ids.clone()
    vocab_ids = torch.arange(vocab, dtype=torch.int32, device=logits.device)
    places = torch.arange(fetched, device=logits.device).unsqueeze(0)
    block_rows = max(1, _FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    for block in torch.split(torch.nonzero(overflows).flatten(), block_rows):
        boundary = values[block, -1].unsqueeze(1)
        above = (values[block] > boundary).sum(dim=-1, keepdim=True)
        key = torch.where(logits[block] == boundary, vocab_ids, vocab)
        lowest_tied = torch.topk(key, fetched, dim=-1, largest=False, sorted=True).values.long()
        tied_place = places >= above
        ids[block] = torch.where(tied_place, lowest_tied.gather(1, (places - above).clamp(min=0)), ids[block])
    return ids


# Rows of logits processed per scratch block in the normaliser: a few MiB keeps the block in
# cache and under the allocator's mmap threshold, so no page faults on every call.
_NORMALISER_BLOCK_ELEMENTS = 1 << 20


def _log_normaliser(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log sum exp((logits - max) / T) per row in float64, one pass over cache-sized row blocks."""
    rows, vocab = logits.shape
    row_max = row_max.float()  # bf16 / fp16 logits: the exp-sum runs in float32
    if logits.device.type != "cpu":  # one fused-enough pass; GPU memory traffic is not the cost
        scratch = logits - row_max.unsqueeze(1)
        scratch.div_(temperature.unsqueeze(1)).exp_()
        return scratch.sum(dim=-1).to(torch.float64).log()
    if rows * vocab <= _NORMALISER_BLOCK_ELEMENTS:  # small batches: one fused library call
        scaled_max = (row_max / temperature).unsqueeze(1)
        return (torch.logsumexp(logits / temperature.unsqueeze(1), dim=-1, keepdim=True) - scaled_max).squeeze(1).to(torch.float64)
    block = max(1, min(rows, _NORMALISER_BLOCK_ELEMENTS // max(vocab, 1)))
    scratch = torch.empty(block, vocab, dtype=torch.float32)
    sums = torch.empty(rows, dtype=torch.float32)
    row_max, temperature = row_max.unsqueeze(1), temperature.unsqueeze(1)
    for start in range(0, rows, block):  # a loop over memory blocks, not over requests
        stop = min(rows, start + block)
        part = scratch[: stop - start]
        torch.sub(logits[start:stop], row_max[start:stop], out=part)
        part.div_(temperature[start:stop]).exp_()
        torch.sum(part, dim=-1, out=sums[start:stop])
    return sums.to(torch.float64).log()


def _sample_ranked(batch: SamplingBatch, plan: RowPlan, index: np.ndarray, k: int, mask_width: int,
                   result: SamplingResult) -> np.ndarray:
    """Rows whose support is a prefix of their top-k ranking (k = the largest effective top_k, or
    the candidate count); writes their outputs and returns their support lengths (numpy)."""
    logits = _rows(batch, index)
    values, ids = ranked_candidates(logits, k)
    temperature = plan.temperature[index]
    log_z = _log_normaliser(logits, values[:, 0], torch.from_numpy(temperature).to(logits.device))
    rows = _RowParams(temperature, plan.k_eff[index], batch.top_p[index], batch.min_p[index], batch.seed[index],
                      batch.want_mask[index])
    epilogue = _epilogue_numpy if logits.device.type == "cpu" else _epilogue_torch
    outputs = epilogue(values, ids, log_z, rows, mask_width)
    _write(result, index, outputs)
    support_len = outputs["support_len"]
    return support_len.cpu().numpy() if isinstance(support_len, torch.Tensor) else support_len


@dataclass
class _RowParams:
    """One group's host-side parameters, greedy already applied."""

    temperature: np.ndarray
    k_eff: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    want_mask: np.ndarray


def _epilogue_numpy(values: torch.Tensor, ids: torch.Tensor, log_z: torch.Tensor, rows: _RowParams, mask_width: int) -> dict:
    """The prefix rules, the seeded draw and the outputs over [rows, k] ranked candidates, in float64
    numpy: on CPU a numpy op costs a fraction of a torch op's dispatch, and these arrays are small.
    Returned mask columns stop at the longest support (the caller's arrays are padded already)."""
    values32 = (values if values.dtype == torch.float32 else values.float()).numpy()  # bf16 / fp16: exact
    ids = ids.numpy()
    count, k = values32.shape
    rank = np.arange(k)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN / inf rows: refused later
        scaled = values32.astype(np.float64)
        scaled -= scaled[:, :1]
        scaled /= rows.temperature.astype(np.float64)[:, None]
        relative = np.exp(scaled)  # p / p_max
        keep = (rank < rows.k_eff[:, None]) & (values32 > -np.inf)
        if (rows.top_p < 1).any():
            probs = relative * np.exp(-log_z.numpy())[:, None]
            top_p = rows.top_p.astype(np.float64)[:, None]
            keep &= (top_p >= 1) | (np.cumsum(probs, axis=1) - probs <= top_p)
        if (rows.min_p > 0).any():
            keep &= relative >= rows.min_p.astype(np.float64)[:, None]
        support_len = keep.sum(axis=1)  # each rule keeps a prefix
        # Past the longest support nothing can be drawn or returned: the rest of the work stops there.
        longest = max(1, int(support_len.max()))
        keep, scaled, relative, ids_kept = keep[:, :longest], scaled[:, :longest], relative[:, :longest], ids[:, :longest]
        score = np.where(keep, scaled + rng.gumbel_numpy(rng.seed_state_numpy(rows.seed)[:, None], ids_kept), -np.inf)
        pick = score.argmax(axis=1)
        token_scaled = scaled[np.arange(count), pick]
        # log of the support's mass relative to p_max: a singleton's renormalised log-prob is 0 exactly.
        support_log_mass = np.log(np.where(keep, relative, 0.0).sum(axis=1))
        width = min(longest, mask_width)
        mask_len = np.where(rows.want_mask, np.minimum(support_len, mask_width), 0)
        in_mask = rank[:width] < mask_len[:, None]
        support_logprobs = np.where(in_mask, scaled[:, :width] - support_log_mass[:, None], -np.inf)
    return {
        "token_ids": ids_kept[np.arange(count), pick],
        "logprobs": (token_scaled - log_z.numpy()).astype(np.float32),
        "mask_ids": np.where(in_mask, ids_kept[:, :width], -1).astype(np.int32),
        "mask_len": mask_len.astype(np.int32),
        "mask_logprobs": np.where(rows.want_mask, token_scaled - support_log_mass, 0).astype(np.float32),
        "mask_support_logprobs": support_logprobs.astype(np.float32),
        "row_max": values32[:, 0],
        "support_len": support_len,
    }


def _epilogue_torch(values: torch.Tensor, ids: torch.Tensor, log_z: torch.Tensor, rows: _RowParams, mask_width: int) -> dict:
    """`_epilogue_numpy` in torch on the logits' device (GPU rows the fused kernels do not take)."""
    device = values.device
    on = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
    count, k = values.shape
    scaled = (values.to(torch.float64) - values[:, :1].to(torch.float64)) / on(rows.temperature).to(torch.float64).unsqueeze(1)
    logp = scaled - log_z.unsqueeze(1)
    probs = logp.exp()
    rank = torch.arange(k, device=device).unsqueeze(0)
    keep = (rank < on(rows.k_eff).unsqueeze(1)) & (values > float("-inf"))
    top_p = on(rows.top_p).to(torch.float64).unsqueeze(1)
    keep &= (top_p >= 1) | (torch.cumsum(probs, dim=-1) - probs <= top_p)
    keep &= scaled.exp() >= on(rows.min_p).to(torch.float64).unsqueeze(1)
    support_len = keep.sum(dim=-1)
    noise = rng.gumbel(rng.seed_state(on(rows.seed)).unsqueeze(1), ids)
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    pick = torch.where(keep, scaled + noise, minus_inf).argmax(dim=-1, keepdim=True)
    token_logp = logp.gather(1, pick).squeeze(1)
    support_logmass = torch.logsumexp(torch.where(keep, logp, minus_inf), dim=-1)
    want = on(rows.want_mask)
    width = min(k, mask_width)
    mask_len = torch.where(want, support_len.clamp(max=mask_width), torch.zeros_like(support_len))
    in_mask = rank[:, :width] < mask_len.unsqueeze(1)
    return {
        "token_ids": ids.gather(1, pick).squeeze(1),
        "logprobs": token_logp,
        "mask_ids": torch.where(in_mask, ids[:, :width], torch.full_like(ids[:, :width], -1)),
        "mask_len": mask_len,
        "mask_logprobs": torch.where(want, token_logp - support_logmass, torch.zeros_like(token_logp)),
        "mask_support_logprobs": torch.where(in_mask, logp[:, :width] - support_logmass.unsqueeze(1), minus_inf),
        "row_max": values[:, 0],
        "support_len": support_len,
    }


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
    _write(result, index, {
        "token_ids": pick.squeeze(1),
        "logprobs": scaled.gather(1, pick).squeeze(1) - log_z,
        "mask_ids": torch.full((index.size, 0), -1, dtype=torch.int32),
        "mask_len": torch.zeros(index.size, dtype=torch.int32),
        "mask_logprobs": torch.zeros(index.size, dtype=torch.float32),
        "mask_support_logprobs": torch.full((index.size, 0), float("-inf")),
        "row_max": row_max,
    })
