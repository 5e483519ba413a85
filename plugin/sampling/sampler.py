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

import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import rng
from .outputs import MASK_OUTPUT_NAMES, TOKEN_OUTPUT_NAMES
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


_PARAM_DTYPES = {
    "temperature": np.float32,
    "top_k": np.int64,
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.int64,
    "want_mask": np.bool_,
}


class SamplingResult:
    """Per-row outputs, named as on the wire (`outputs.TOKEN_OUTPUTS`: output_ids int64 [B],
    output_logprobs float32 [B], sampling_mask int32 [B, W], sampling_mask_len int32 [B],
    sampling_logprobs float32 [B], sampling_mask_logprobs float32 [B, W]) plus row_max [B] (each
    row's largest logit, NaN / +inf propagated as by `amax`, for the logits checks).

    The fused GPU path hands back one packed device tensor instead; `host()` copies it once and
    the fields are read from that copy.
    """

    FIELDS = (*TOKEN_OUTPUT_NAMES, "row_max")
    MASK_FIELDS = MASK_OUTPUT_NAMES  # [B, W]; a group may fill only its first columns

    def __init__(self, packed: torch.Tensor | None = None, **fields):
        self.packed = packed
        self._host: dict[str, np.ndarray] | None = None
        self._fields = {name: fields.get(name) for name in self.FIELDS}

    @classmethod
    def empty(cls, rows: int, mask_width: int, device: torch.device) -> SamplingResult:
        """Outputs to fill group by group (-1 padded masks, zeros elsewhere)."""

        def full(shape, value, dtype):
            if device.type == "cpu":  # numpy allocations, shared with torch: cheaper than torch's own
                return torch.from_numpy(np.full(shape, value, dtype))
            return torch.full(shape, value, dtype=getattr(torch, np.dtype(dtype).name), device=device)

        return cls(
            output_ids=full(rows, 0, np.int64),
            output_logprobs=full(rows, 0, np.float32),
            sampling_mask=full((rows, mask_width), -1, np.int32),
            sampling_mask_len=full(rows, 0, np.int32),
            sampling_logprobs=full(rows, 0, np.float32),
            sampling_mask_logprobs=full((rows, mask_width), -np.inf, np.float32),
            row_max=full(rows, 0, np.float32),
        )

    @classmethod
    def of_host(cls, arrays: dict[str, np.ndarray]) -> SamplingResult:
        """A result made of host numpy arrays (the CPU path): `host()` returns them as they are, and
        each field reads as a tensor sharing their memory."""
        result = cls()
        result._host = {name: arrays[name] for name in cls.FIELDS}
        return result

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
            if self.packed is None and self._host is None:
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


def ranked_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest logits of each row in the total order (logit desc, id asc): values, ids.
    On the CPU, rows holding NaN may rank without it (the sampler takes their max apart)."""
    vocab = logits.shape[1]
    if k >= vocab:
        # A stable descending sort keeps equal logits in ascending id order.
        return torch.sort(logits, dim=-1, descending=True, stable=True)
    if logits.device.type == "cpu":
        return _ranked_candidates_cpu(logits, k)
    # Fetch a few candidates past k: a run of equal logits at the k-th place (common with bf16
    # logits) then usually ends inside the fetched set, and ranking the set by (logit, id) is
    # exact without another pass over the vocabulary (on a GPU the margin costs next to nothing).
    fetched = k + min(vocab - k, 16 + k // 4)
    values, ids = torch.topk(logits, fetched, dim=-1, sorted=True)
    boundary = values[:, k - 1]
    overflows = (values[:, -1] == boundary) & (boundary > float("-inf"))
    if bool(overflows.any()):  # the run reaches past the fetched set: find its lowest ids
        ids = _repair_boundary_ties(logits, values, ids, overflows)
    # topk already ranks by value, so only ids inside runs of equal values may be out of order:
    # one sort of the key (run index, id), nearly sorted already, replaces two full sorts.
    changes = values[:, 1:] != values[:, :-1]
    run = torch.cat([changes.new_zeros(logits.shape[0], 1, dtype=torch.int64), torch.cumsum(changes, dim=-1)], dim=-1)
    run *= vocab
    ids = torch.sort(run + ids, dim=-1).values - run
    return values[:, :k], ids[:, :k]


# Threshold selection, the CPU's top-k (`_select_by_threshold`): logits sampled per row to place the
# threshold, the least sample rank it may take, and the smallest V / (k + 1) worth it.
_THRESHOLD_SAMPLE = 2048
_THRESHOLD_MIN_RANK = 16
_THRESHOLD_MIN_RATIO = 8


def _ranked_candidates_cpu(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_candidates` on the CPU, for k < V.

    torch's CPU top-k copies each row into a buffer of (value, index) pairs (2.4 MB at V=151936),
    which costs more than the selection itself and evicts the caches the rest of the step needs.
    Where V is large next to k, rows are ranked by threshold selection instead (a few numpy passes
    over the row, then a sort of ~2k candidates); the rows it cannot settle, and small
    vocabularies, take one top-(k + 1). Both give the same exact order.
    """
    rows, vocab = logits.shape
    if vocab < _THRESHOLD_MIN_RATIO * (k + 1):
        return _ranked_by_topk_cpu(logits, k)
    block_rows = max(1, _FULL_VOCAB_BLOCK_ELEMENTS // vocab)
    if block_rows < rows:
        values, ids = np.empty((rows, k), np.float32), np.empty((rows, k), np.int64)
    for start in range(0, rows, block_rows):  # a loop over memory blocks, not over requests
        block = logits if block_rows >= rows else logits[start : start + block_rows]
        block_values, block_ids, settled = _select_by_threshold(_float32_host(block).numpy(), k)
        if not settled.all():  # the rest by top-k, within the block: memory stays bounded
            index = np.flatnonzero(~settled)
            rest = block if index.size == block.shape[0] else block[torch.from_numpy(index)]
            rest_values, rest_ids = _ranked_by_topk_cpu(rest, k)
            block_values[index], block_ids[index] = rest_values.float().numpy(), rest_ids.numpy()
        if block_rows >= rows:  # one block: its arrays are the result (no copy at B=1)
            values, ids = block_values, block_ids
        else:
            values[start : start + block_rows], ids[start : start + block_rows] = block_values, block_ids
    ranked_values = torch.from_numpy(values)
    return ranked_values if logits.dtype == torch.float32 else ranked_values.to(logits.dtype), torch.from_numpy(ids)


def _select_by_threshold(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k first (logit desc, id asc) of each row of float32 `logits` [rows, V], by threshold:
    values [rows, k], ids [rows, k] and `settled` [rows]; where settled is False the row's values
    and ids are meaningless (its caller ranks it by top-k).

    A strided sample of each row places a threshold that about 2(k + 1) logits reach; one
    comparison and one flat nonzero collect them. Every logit at or above the threshold is a
    candidate, so a run of equal logits at the k-th place is whole among them, and one sort of
    unique keys (row, logit descending, id) gives the exact order with no repair. A row is not
    settled when k or fewer logits reach its threshold (the sample misled it, or NaN) or too many
    do (a long run of equal logits at the threshold, such as -inf): sorting those would cost more
    than a top-k. Rows*V is at most _FULL_VOCAB_BLOCK_ELEMENTS (or one row), so keys fit in int64.
    """
    rows, vocab = logits.shape
    sample = logits[:, :: max(1, vocab // _THRESHOLD_SAMPLE)]
    points = sample.shape[1]
    rank = min(points, max(_THRESHOLD_MIN_RANK, -(-2 * (k + 1) * points // vocab)))  # ceil
    threshold = np.partition(sample, points - rank, axis=1)[:, points - rank]
    flat = np.flatnonzero(logits >= threshold[:, None])
    most = 4 * rank * vocab // points  # four times the count expected: more is a long run of ties
    if rows == 1:  # the B=1 decode step: none of the per-row bookkeeping below
        settled = np.array([k < flat.size <= most])
        if not settled[0]:
            return np.empty((rows, k), np.float32), np.empty((rows, k), np.int64), settled
        key, places = _descending_key(logits.ravel()[flat]), np.arange(k)
    else:
        row = flat // vocab
        counts = np.bincount(row, minlength=rows)
        settled = (counts > k) & (counts <= most)
        if not settled.all():  # drop the unsettled rows' candidates: they may be the whole row
            kept = settled[row]
            if not kept.any():
                return np.empty((rows, k), np.float32), np.empty((rows, k), np.int64), settled
            flat, row = flat[kept], row[kept]
            counts = np.where(settled, counts, 0)
        # Each row's first k keys, clipped in range for unsettled rows (their result is not used).
        places = np.minimum((np.cumsum(counts) - counts)[:, None] + np.arange(k), flat.size - 1)
        key = _descending_key(logits.ravel()[flat])
        key |= row << 32  # the row leads the key
        flat = flat - row * vocab  # the ids
    id_bits = (vocab - 1).bit_length()
    key <<= id_bits
    key |= flat  # ties rank by lower id
    key.sort()
    ids = key[places].reshape(rows, k)
    ids &= (1 << id_bits) - 1
    return logits[np.arange(rows)[:, None], ids], ids, settled


def _descending_key(values: np.ndarray) -> np.ndarray:
    """Non-negative int64 keys, below 2**32, whose ascending order is the float32 `values`' descending
    order, equal values (-0.0 and 0.0 too) getting equal keys. NaN is not expected."""
    negated = np.float32(0) - values  # 0 - x: -0.0 and 0.0 both become 0.0
    bits = negated.view(np.int32)
    # Negative floats order backwards as integers: flipping their magnitude bits fixes that.
    bits ^= (bits >> 31) & 0x7FFFFFFF
    key = bits.astype(np.int64)
    key += 1 << 31
    return key


_WORKSPACE = threading.local()


def _workspace(slot: str, shape: tuple[int, int]) -> torch.Tensor:
    """An uninitialised host float32 tensor of `shape` from a per-thread buffer reused from call to
    call (valid until the next call with the same `slot`).

    Row blocks are several MiB: allocators hand blocks that size back to the OS when freed
    (jemalloc's huge arena at once), so a fresh one per call paid its page faults every call, which
    cost more than the work done in it (measured: bf16 B=64 33-57 ms against 23 ms in float32).
    """
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    numel = shape[0] * shape[1]
    buffer = buffers.get(slot)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[slot] = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel].view(shape)


def _float32_host(block: torch.Tensor) -> torch.Tensor:
    """A host float32 `block` [rows, V]: itself when float32, else its exact conversion in the
    "convert" workspace."""
    if block.dtype == torch.float32:
        return block
    return _workspace("convert", tuple(block.shape)).copy_(block)


def _ranked_by_topk_cpu(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_candidates` on the CPU by one top-(k + 1) and numpy bookkeeping, for k < V.

    On the CPU a top-k's cost grows with k, so no margin is fetched past k: the one extra
    candidate only tells whether a run of equal logits crosses the k-th place. Such a run (common
    with bf16 logits) is then given its lowest ids by one comparison pass over the rows concerned
    (`_repair_boundary_ties_cpu`), still cheaper than the margin's larger top-k. The small
    [rows, k + 1] bookkeeping runs in numpy on views: a numpy call costs a few microseconds where
    a torch op's dispatch costs several times that.
    """
    values, ids = torch.topk(logits, k + 1, dim=-1, sorted=True)
    values_view = (values if values.dtype == torch.float32 else values.float()).numpy()
    ids_view = ids.numpy()
    boundary = values_view[:, k - 1]
    overflows = (values_view[:, k] == boundary) & (boundary > -np.inf)
    if overflows.any():
        _repair_boundary_ties_cpu(logits, values_view, ids_view, np.flatnonzero(overflows))
    # topk already ranks by value, so only ids inside runs of equal values may be out of order;
    # with continuous logits there is no such run and nothing to sort.
    changes = values_view[:, 1:k] != values_view[:, : k - 1]
    if not changes.all():
        # One sort of the key (run index, id), nearly sorted already, orders every run at once.
        run = np.zeros((values_view.shape[0], k), np.int64)
        np.cumsum(changes, axis=1, out=run[:, 1:])
        run *= logits.shape[1]
        ids_view[:, :k] = np.sort(run + ids_view[:, :k], axis=1) - run
    values = torch.from_numpy(values_view[:, :k]) if values.dtype == torch.float32 else values[:, :k]
    return values, torch.from_numpy(ids_view[:, :k])


def _repair_boundary_ties_cpu(logits: torch.Tensor, values: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Give the places holding the last fetched value, in `rows`, to the lowest tied ids (in place).

    `values` [*, fetched] is sorted descending, so each row holds `above` candidates strictly above
    its last value, then ones equal to it; those places go to the first ids, in id order, whose
    logit equals that value. numpy's flat nonzero lists them in (row, id) order in one pass (a
    sort or a top-k would cost several passes); the rows are scanned in blocks of bounded memory.
    """
    fetched = values.shape[1]
    vocab = logits.shape[1]
    block_rows = max(1, _FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows.size, block_rows):  # a loop over memory blocks, not over requests
        block = rows[start : start + block_rows]
        tied_value = values[block, -1]
        above = (values[block] > tied_value[:, None]).sum(axis=1)
        consecutive = block[-1] - block[0] + 1 == block.size  # then a view, not a copy of the rows
        selected = logits[block[0] : block[-1] + 1] if consecutive else logits[torch.from_numpy(block)]
        flat = np.flatnonzero(_float32_host(selected).numpy() == tied_value[:, None])
        row, tied_id = np.divmod(flat, vocab)
        # Each tied id's place: `above` plus its rank among its row's tied ids.
        place = np.arange(flat.size) - np.searchsorted(row, row) + above[row]
        taken = place < fetched
        ids[block[row[taken]], place[taken]] = tied_id[taken]


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
_LOG2_E = 1.4426950408889634


def _log_normaliser(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log sum exp((logits - max) / T) per row in float64, on the GPU: one fused-enough pass
    (memory traffic is not the cost there)."""
    scratch = logits - row_max.float().unsqueeze(1)  # bf16 / fp16 logits: the exp-sum runs in float32
    scratch.div_(temperature.unsqueeze(1)).exp_()
    return scratch.sum(dim=-1).to(torch.float64).log()


def _normaliser_cpu(logits: torch.Tensor, row_max: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """sum exp((logits - max) / T) per row, as float32 numpy (the epilogue widens it to float64), in
    one pass over cache-sized row blocks. row_max float32 [rows] (each row's largest logit),
    temperature float32 [rows].

    exp((x - max) / T) is computed as exp2((x - max) * (log2(e) / T)): torch's float32 exp2 costs
    about half its exp on the CPU. The subtraction comes first, so the largest terms stay exact.
    """
    rows, vocab = logits.shape
    shift = torch.from_numpy(row_max[:, None])
    scale = torch.from_numpy((_LOG2_E / temperature)[:, None])  # float32 (a Python float does not widen it)
    block = max(1, min(rows, _NORMALISER_BLOCK_ELEMENTS // max(vocab, 1)))
    scratch = _workspace("normaliser", (block, vocab))
    if block == rows:  # one block: no slicing (at B=1 every torch call's dispatch shows)
        return _exp_sum(logits, shift, scale, scratch).numpy()
    sums = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, block):  # a loop over memory blocks, not over requests
        stop = min(rows, start + block)
        sums[start:stop] = _exp_sum(logits[start:stop], shift[start:stop], scale[start:stop], scratch[: stop - start])
    return sums.numpy()


def _exp_sum(logits: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """sum exp2((logits - shift) * scale) per row, through `scratch` (four calls, five for bf16 / fp16;
    one small allocation)."""
    if logits.dtype == torch.float32:
        torch.sub(logits, shift, out=scratch)
    else:  # bf16 / fp16: converted into scratch first (a mixed-dtype sub would allocate a float32 copy)
        scratch.copy_(logits).sub_(shift)
    scratch.mul_(scale).exp2_()
    return scratch.sum(dim=-1)


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


def _epilogue_numpy(values32: np.ndarray, ids: np.ndarray, z: np.ndarray, rows: _RowParams, mask_width: int) -> dict:
    """The prefix rules, the seeded draw and the outputs over [rows, k] ranked candidates (float32
    values, int64 ids, float32 normalisers z = sum exp((x - max) / T)), in float64 numpy: on CPU a
    numpy op costs a fraction of a torch op's dispatch, and these arrays are small. Even so each
    call costs about a microsecond, most of the epilogue at B=1, so calls are counted: each rule
    keeps a prefix of the ranking, so the support length is the least of the rules' prefix
    lengths (a rule no row uses is skipped), work past the longest support is skipped, and the
    masks are written straight into their padded [rows, mask_width] arrays."""
    count, k = values32.shape
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN / inf rows: refused later
        # (x - max) / T in float64; the float32 operands are widened exactly.
        scaled = np.subtract(values32, values32[:, :1], dtype=np.float64)
        scaled /= rows.temperature[:, None]
        relative = np.exp(scaled)  # p / p_max
        support_len = np.minimum(rows.k_eff, k)
        if values32[:, -1].min() == -np.inf:  # banned tokens among the candidates
            support_len = np.minimum(support_len, (values32 > -np.inf).sum(axis=1))
        if rows.top_p.min() < 1:  # the mass ranked strictly before a token must not pass top_p
            probs = relative / z[:, None]  # z widens to float64 exactly
            mass_before = np.cumsum(probs, axis=1)
            mass_before -= probs
            top_p = rows.top_p
            if top_p.max() >= 1:  # top_p >= 1 disables the rule in its rows
                top_p = np.where(top_p >= 1, np.inf, top_p)
            support_len = np.minimum(support_len, (mass_before <= top_p[:, None]).sum(axis=1))
        if rows.min_p.max() > 0:
            support_len = np.minimum(support_len, (relative >= rows.min_p[:, None]).sum(axis=1))
        # Past the longest support nothing can be drawn or returned: the rest of the work stops there.
        longest = max(1, int(support_len.max()))
        scaled, relative, ids = scaled[:, :longest], relative[:, :longest], ids[:, :longest]
        keep = np.arange(longest) < support_len[:, None]
        # Gumbel-max: scaled - log(-log u) is scaled + Gumbel noise, bit for bit.
        score = np.subtract(scaled, rng.negated_gumbel_numpy(rng.seed_state_numpy(rows.seed)[:, None], ids))
        at = np.arange(count), np.where(keep, score, -np.inf).argmax(axis=1)
        token_scaled = scaled[at]
        # log of the support's mass relative to p_max: a singleton's renormalised log-prob is 0 exactly.
        support_log_mass = np.log(np.where(keep, relative, 0.0).sum(axis=1))
        mask_len = np.where(rows.want_mask, np.minimum(support_len, mask_width), 0)
        width = min(longest, mask_width)
        in_mask = keep[:, :width] & rows.want_mask[:, None]
        # Outside the mask the padding stays: -1 ids, -inf log-probs, 0 where no mask was asked.
        mask_ids = np.full((count, mask_width), -1, np.int32)
        np.copyto(mask_ids[:, :width], ids[:, :width], casting="same_kind", where=in_mask)
        support_logprobs = np.full((count, mask_width), -np.inf, np.float32)
        np.subtract(
            scaled[:, :width],
            support_log_mass[:, None],
            out=support_logprobs[:, :width],
            where=in_mask,
            casting="same_kind",
        )
        mask_logprobs = np.zeros(count, np.float32)
        np.subtract(token_scaled, support_log_mass, out=mask_logprobs, where=rows.want_mask, casting="same_kind")
    return {
        "output_ids": ids[at],
        "output_logprobs": (token_scaled - np.log(z, dtype=np.float64)).astype(np.float32),
        "sampling_mask": mask_ids,
        "sampling_mask_len": mask_len.astype(np.int32),
        "sampling_logprobs": mask_logprobs,
        "sampling_mask_logprobs": support_logprobs,
        "row_max": values32[:, 0].copy(),
        "support_len": support_len,
    }


def _epilogue_torch(
    values: torch.Tensor, ids: torch.Tensor, log_z: torch.Tensor, rows: _RowParams, mask_width: int
) -> dict:
    """`_epilogue_numpy` in torch on the logits' device (GPU rows the fused kernels do not take)."""
    device = values.device
    on = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
    count, k = values.shape
    scaled = (values.to(torch.float64) - values[:, :1].to(torch.float64)) / on(rows.temperature).to(
        torch.float64
    ).unsqueeze(1)
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
        "output_ids": ids.gather(1, pick).squeeze(1),
        "output_logprobs": token_logp,
        "sampling_mask": torch.where(in_mask, ids[:, :width], torch.full_like(ids[:, :width], -1)),
        "sampling_mask_len": mask_len,
        "sampling_logprobs": torch.where(want, token_logp - support_logmass, torch.zeros_like(token_logp)),
        "sampling_mask_logprobs": torch.where(in_mask, logp[:, :width] - support_logmass.unsqueeze(1), minus_inf),
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
