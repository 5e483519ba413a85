"""Top-k selection: each row's k first candidates in the total order (logit desc, lower id first).

One entry point, `ranked_candidates`; on the CPU a threshold selection (with a top-(k + 1)
fallback), elsewhere a top-k with a margin past k; both repair runs of equal logits at the k-th
place, so the order never depends on how a library's top-k breaks ties. Which ops run is the
device path (`device_path_for`): the tests also run the GPU's ops on CPU tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from .normalisers import workspace

# Entries per row block on the full-vocabulary paths (float64 scores and sort indices per entry).
FULL_VOCAB_BLOCK_ELEMENTS = 1 << 21

# The two sets of ops: "cpu" (threshold selection, numpy epilogue) and "gpu" (margin top-k, torch epilogue).
DEVICE_PATHS = ("cpu", "gpu")


def device_path_for(device: torch.device, requested: str | None = None) -> str:
    """The ops a sampler call runs on `device`: `requested` ("cpu" or "gpu"), else "cpu" for CPU
    tensors and "gpu" for any other device. The "cpu" ops read the rows through numpy, so they
    need CPU tensors; the "gpu" ops run anywhere (the tests run them on CPU tensors)."""
    if requested is None:
        return "cpu" if device.type == "cpu" else "gpu"
    if requested not in DEVICE_PATHS:
        raise ValueError(f"device_path must be one of {DEVICE_PATHS}, got {requested!r}")
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu device path needs CPU tensors, got {device}")
    return requested


def ranked_candidates(
    logits: torch.Tensor, k: int, device_path: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest logits of each row in the total order (logit desc, id asc): values, ids.
    `device_path` as `device_path_for` reads it. On the CPU path, rows holding NaN may rank
    without it (the sampler takes their max apart)."""
    if device_path_for(logits.device, device_path) == "cpu":
        values, ids = ranked_candidates_cpu(logits, k)
        ranked_values = torch.from_numpy(values)
        return ranked_values if logits.dtype == torch.float32 else ranked_values.to(logits.dtype), torch.from_numpy(ids)
    if k >= logits.shape[1]:
        # A stable descending sort keeps equal logits in ascending id order.
        return torch.sort(logits, dim=-1, descending=True, stable=True)
    return _ranked_candidates_device(logits, k)


def ranked_candidates_cpu(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`ranked_candidates` on the CPU path, as host arrays: float32 values (exact for bf16 / fp16
    logits) and int64 ids, [rows, min(k, V)] each."""
    if k >= logits.shape[1]:
        values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        return (values if values.dtype == torch.float32 else values.float()).numpy(), ids.numpy()
    return _ranked_candidates_cpu(logits, k)


def candidate_count(k: int, vocab: int) -> int:
    """Candidates a device top-k fetches for a top_k of k: k + min(V - k, 16 + k // 4).

    The margin past k lets a run of equal logits at the k-th place (common with bf16 logits)
    usually end inside the fetched set, so ranking the set by (logit, id) is exact without another
    pass over the vocabulary; on a GPU the margin costs next to nothing.
    """
    k = min(k, vocab)
    return k + min(vocab - k, 16 + k // 4)


def _ranked_candidates_device(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_candidates` on the GPU path, for k < V: one top-k of `candidate_count` candidates."""
    vocab = logits.shape[1]
    values, ids = torch.topk(logits, candidate_count(k, vocab), dim=-1, sorted=True)
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


def _ranked_candidates_cpu(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`ranked_candidates_cpu` for k < V.

    torch's CPU top-k copies each row into a buffer of (value, index) pairs, which costs more than
    the selection itself and evicts the caches the rest of the step needs.
    Where V is large next to k, rows are ranked by threshold selection instead (a few numpy passes
    over the row, then a sort of ~2k candidates); the rows it cannot settle, and small
    vocabularies, take one top-(k + 1). Both give the same exact order.
    """
    rows, vocab = logits.shape
    if vocab < _THRESHOLD_MIN_RATIO * (k + 1):
        return _topk_host(logits, k)
    if rows == 1:  # the B=1 decode step: no blocks, and top-k only for a row the threshold cannot settle
        ranked = _select_by_threshold(_float32_host(logits).numpy(), k)
        return ranked[:2] if ranked[2][0] else _topk_host(logits, k)
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // vocab)
    if block_rows < rows:
        values, ids = np.empty((rows, k), np.float32), np.empty((rows, k), np.int64)
    for start in range(0, rows, block_rows):  # a loop over memory blocks, not over requests
        block = logits if block_rows >= rows else logits[start : start + block_rows]
        block_values, block_ids, settled = _select_by_threshold(_float32_host(block).numpy(), k)
        if not settled.all():  # the rest by top-k, within the block: memory stays bounded
            index = np.flatnonzero(~settled)
            rest = block if index.size == block.shape[0] else block[torch.from_numpy(index)]
            block_values[index], block_ids[index] = _topk_host(rest, k)
        if block_rows >= rows:  # one block: its arrays are the result (no copy at B=1)
            return block_values, block_ids
        values[start : start + block_rows], ids[start : start + block_rows] = block_values, block_ids
    return values, ids


def _topk_host(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`_ranked_by_topk_cpu` as host arrays: float32 values, int64 ids."""
    values, ids = _ranked_by_topk_cpu(logits, k)
    return (values if values.dtype == torch.float32 else values.float()).numpy(), ids.numpy()


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
    than a top-k. Rows*V is at most FULL_VOCAB_BLOCK_ELEMENTS (or one row), so keys fit in int64.
    """
    rows, vocab = logits.shape
    stride = max(1, vocab // _THRESHOLD_SAMPLE)
    points = -(-vocab // stride)  # the strided sample's length
    rank = min(points, max(_THRESHOLD_MIN_RANK, -(-2 * (k + 1) * points // vocab)))  # ceil
    most = 4 * rank * vocab // points  # four times the count expected: more is a long run of ties
    if rows == 1:
        return _select_row_by_threshold(logits[0], k, stride, points - rank, most)
    sample = logits[:, ::stride]
    threshold = np.partition(sample, points - rank, axis=1)[:, points - rank]
    flat = np.flatnonzero(logits >= threshold[:, None])
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


def _select_row_by_threshold(
    row: np.ndarray, k: int, stride: int, place: int, most: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_select_by_threshold` of one row (the B=1 decode step) in a handful of numpy calls: the
    threshold is the `place`-th smallest of the strided sample, and the candidates (in id order,
    as the flat nonzero lists them) are ranked by one stable sort of their negated logits, which
    keeps equal logits (-0.0 and 0.0 too) in id order."""
    sample = row[::stride].copy()  # partitioned in place: a copy, not the logits
    sample.partition(place)
    (flat,) = (row >= sample[place]).nonzero()
    if not k < flat.size <= most:
        return np.empty((1, k), np.float32), np.empty((1, k), np.int64), np.array([False])
    candidates = row[flat]
    order = np.negative(candidates).argsort(kind="stable")[:k]
    return candidates[order][None], flat[order][None], np.array([True])


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


def _float32_host(block: torch.Tensor) -> torch.Tensor:
    """A host float32 `block` [rows, V]: itself when float32, else its exact conversion in the
    "convert" workspace."""
    if block.dtype == torch.float32:
        return block
    return workspace("convert", tuple(block.shape)).copy_(block)


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
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
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
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    for block in torch.split(torch.nonzero(overflows).flatten(), block_rows):
        boundary = values[block, -1].unsqueeze(1)
        above = (values[block] > boundary).sum(dim=-1, keepdim=True)
        key = torch.where(logits[block] == boundary, vocab_ids, vocab)
        lowest_tied = torch.topk(key, fetched, dim=-1, largest=False, sorted=True).values.long()
        tied_place = places >= above
        ids[block] = torch.where(tied_place, lowest_tied.gather(1, (places - above).clamp(min=0)), ids[block])
    return ids
