"""Converters from the sampler's fixed-width masks to the formats RL trainers read, and back.

The sampler answers T rows (tokens) with `sampling_mask` [T, W] (ids, most probable first, padded
with -1) and `sampling_mask_len` [T]. Trainers want:

* SGLang: per-token lists `output_token_sampling_mask` (list of id lists) and
  `output_token_sampling_logprobs` (list of floats);
* vLLM: CSR `token_ids` [N] with `offsets` [T + 1] (row t is token_ids[offsets[t]:offsets[t+1]]);
* prime-rl: flat `ids` [N] with per-token `counts` [T];
* a dense boolean [T, V] mask (torch), for masking training logits directly.

The per-support log-probs (`sampling_mask_logprobs` [T, W], -inf padded) travel with the ids
when given: SGLang's `output_token_sampling_support_logprobs` lists, `logprobs` [N] beside vLLM's
and prime-rl's flat ids.

Every function accepts numpy arrays or torch tensors and is vectorised over the tokens; the
`from_*` functions rebuild the fixed-width form, so each format round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_ID = -1


@dataclass
class FixedWidthMasks:
    """The sampler's own layout: ids [T, W] padded with PAD_ID, lengths [T]."""

    mask: np.ndarray  # int32 [T, W]
    lengths: np.ndarray  # int32 [T]
    support_logprobs: np.ndarray | None = None  # float32 [T, W], -inf padded, when carried


def _numpy(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    return np.asarray(array)


def _checked(mask, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mask [T, W], lengths [T] and the [T, W] validity grid; raises ValueError when inconsistent."""
    mask, lengths = _numpy(mask), _numpy(lengths).reshape(-1)
    if mask.ndim != 2 or lengths.shape[0] != mask.shape[0]:
        raise ValueError(f"mask must be [T, W] and lengths [T], got {list(mask.shape)} and {list(lengths.shape)}")
    if ((lengths < 0) | (lengths > mask.shape[1])).any():
        raise ValueError(f"lengths must lie in [0, W={mask.shape[1]}]")
    valid = np.arange(mask.shape[1]) < lengths[:, None]
    if (mask[valid] < 0).any():
        raise ValueError("mask ids within each row's length must be >= 0")
    return mask, lengths, valid


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _flat_logprobs(support_logprobs, valid: np.ndarray) -> np.ndarray:
    """The valid entries of per-support log-probs [T, W], flat in row order (float32 [N])."""
    support_logprobs = _numpy(support_logprobs)
    if support_logprobs.shape != valid.shape:
        raise ValueError(f"support_logprobs must be [T, W] = {list(valid.shape)}, got {list(support_logprobs.shape)}")
    return support_logprobs[valid].astype(np.float32)


def checked_flat(ids, counts, logprobs=None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Flat ids (int64 [N]), per-row counts (int64 [T]) and, when given, per-id log-probs ([N]),
    checked for consistency (counts >= 0 summing to N, one log-prob per id); raises ValueError."""
    ids, counts = _numpy(ids).reshape(-1).astype(np.int64), _numpy(counts).reshape(-1).astype(np.int64)
    if (counts < 0).any() or counts.sum() != ids.shape[0]:
        raise ValueError(f"counts must be >= 0 and sum to the number of ids ({ids.shape[0]})")
    if logprobs is not None:
        logprobs = _numpy(logprobs).reshape(-1)
        if logprobs.shape[0] != ids.shape[0]:
            raise ValueError(f"logprobs must have one value per id ({ids.shape[0]}), got {logprobs.shape[0]}")
    return ids, counts, logprobs


def csr_counts(offsets) -> np.ndarray:
    """Per-row counts (int64 [T]) of vLLM CSR `offsets` [T + 1]; raises ValueError when malformed."""
    offsets = _numpy(offsets).reshape(-1).astype(np.int64)
    if offsets.size == 0 or offsets[0] != 0:
        raise ValueError("offsets must start at 0 and have T + 1 entries")
    return np.diff(offsets)


def flatten_sglang(
    output_token_sampling_mask: list[list[int]], output_token_sampling_support_logprobs: list[list[float]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """SGLang's per-token lists as flat ids (int64 [N]), counts (int64 [T]) and, when given, the
    per-id log-probs (float64 [N])."""
    counts = np.array([len(ids) for ids in output_token_sampling_mask], dtype=np.int64)
    flat = np.fromiter((i for ids in output_token_sampling_mask for i in ids), dtype=np.int64, count=int(counts.sum()))
    logprobs = None
    if output_token_sampling_support_logprobs is not None:
        logprobs = np.fromiter((v for row in output_token_sampling_support_logprobs for v in row), dtype=np.float64)
    return flat, counts, logprobs


def _from_flat(ids, counts, width: int, logprobs=None) -> FixedWidthMasks:
    """Scatter flat ids (and their log-probs) with per-row counts into the padded [T, W] layout."""
    ids, counts, logprobs = checked_flat(ids, counts, logprobs)
    if counts.size and counts.max() > width:
        raise ValueError(f"a row holds {counts.max()} ids, more than the width W={width}")
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    starts = _offsets(counts)[:-1]
    mask = np.full((counts.shape[0], width), PAD_ID, dtype=np.int32)
    columns = np.arange(ids.shape[0]) - starts[rows]
    mask[rows, columns] = ids
    support = None
    if logprobs is not None:
        support = np.full((counts.shape[0], width), -np.inf, dtype=np.float32)
        support[rows, columns] = logprobs
    return FixedWidthMasks(mask=mask, lengths=counts.astype(np.int32), support_logprobs=support)


def to_vllm_csr(mask, lengths, support_logprobs=None) -> dict[str, np.ndarray]:
    """vLLM's CSR: `token_ids` int32 [N] and `offsets` int64 [T + 1] (and `logprobs` float32 [N]
    when `support_logprobs` [T, W] is given)."""
    mask, lengths, valid = _checked(mask, lengths)
    out = {"token_ids": mask[valid].astype(np.int32), "offsets": _offsets(lengths)}
    if support_logprobs is not None:
        out["logprobs"] = _flat_logprobs(support_logprobs, valid)
    return out


def from_vllm_csr(token_ids, offsets, width: int, logprobs=None) -> FixedWidthMasks:
    """The fixed-width layout of a vLLM CSR mask (with its per-id log-probs when given)."""
    return _from_flat(token_ids, csr_counts(offsets), width, logprobs)


def to_prime_rl(mask, lengths, support_logprobs=None) -> dict[str, np.ndarray]:
    """prime-rl's flat form: `ids` int32 [N] and per-token `counts` int32 [T] (and `logprobs`
    float32 [N] when `support_logprobs` [T, W] is given)."""
    mask, lengths, valid = _checked(mask, lengths)
    out = {"ids": mask[valid].astype(np.int32), "counts": lengths.astype(np.int32)}
    if support_logprobs is not None:
        out["logprobs"] = _flat_logprobs(support_logprobs, valid)
    return out


def from_prime_rl(ids, counts, width: int, logprobs=None) -> FixedWidthMasks:
    """The fixed-width layout of prime-rl's (ids, counts) (with per-id log-probs when given)."""
    return _from_flat(ids, counts, width, logprobs)


def to_sglang(mask, lengths, sampling_logprobs, support_logprobs=None) -> dict[str, list]:
    """SGLang's per-token lists: `output_token_sampling_mask` (one id list per token) and
    `output_token_sampling_logprobs` (one float per token); with `support_logprobs` [T, W] also
    `output_token_sampling_support_logprobs` (one float list per token, aligned with the ids)."""
    mask, lengths, valid = _checked(mask, lengths)
    logprobs = _numpy(sampling_logprobs).reshape(-1)
    if logprobs.shape[0] != mask.shape[0]:
        raise ValueError(f"sampling_logprobs must have one value per token ({mask.shape[0]}), got {logprobs.shape[0]}")
    # np.split of zero tokens would still yield one (empty) piece.
    per_token = np.split(mask[valid].astype(np.int64), _offsets(lengths)[1:-1]) if len(lengths) else []
    out = {
        "output_token_sampling_mask": [ids.tolist() for ids in per_token],
        "output_token_sampling_logprobs": logprobs.astype(np.float64).tolist(),
    }
    if support_logprobs is not None:
        flat = _flat_logprobs(support_logprobs, valid).astype(np.float64)
        pieces = np.split(flat, _offsets(lengths)[1:-1]) if len(lengths) else []
        out["output_token_sampling_support_logprobs"] = [piece.tolist() for piece in pieces]
    return out


def from_sglang(
    output_token_sampling_mask: list[list[int]],
    width: int,
    output_token_sampling_support_logprobs: list[list[float]] | None = None,
) -> FixedWidthMasks:
    """The fixed-width layout of SGLang's per-token id lists (and their log-probs when given)."""
    flat, counts, logprobs = flatten_sglang(output_token_sampling_mask, output_token_sampling_support_logprobs)
    return _from_flat(flat, counts, width, logprobs)


def to_dense(mask, lengths, vocab_size: int) -> torch.Tensor:
    """A boolean [T, V] torch tensor, True on each token's mask (on the mask's device if torch)."""
    device = mask.device if isinstance(mask, torch.Tensor) else torch.device("cpu")
    mask_np, lengths_np, valid = _checked(mask, lengths)
    if valid.any() and mask_np[valid].max() >= vocab_size:
        raise ValueError(f"mask ids must be < vocab_size={vocab_size}")
    dense = torch.zeros((mask_np.shape[0], vocab_size), dtype=torch.bool)
    rows, cols = np.nonzero(valid)
    dense[torch.from_numpy(rows), torch.from_numpy(mask_np[rows, cols].astype(np.int64))] = True
    return dense.to(device)


def from_dense(dense, width: int) -> FixedWidthMasks:
    """The fixed-width layout of a dense [T, V] mask, ids ascending (a dense mask has no ranking)."""
    dense = _numpy(dense).astype(bool)
    rows, ids = np.nonzero(dense)  # row-major: rows ascending, ids ascending within a row
    return _from_flat(ids, np.bincount(rows, minlength=dense.shape[0]), width)
