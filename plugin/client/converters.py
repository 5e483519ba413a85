"""Converters from the sampler's fixed-width masks to the formats RL trainers read, and back.

The sampler answers T rows (tokens) with `sampling_mask` [T, W] (ids, most probable first, padded
with -1) and `sampling_mask_len` [T]. Trainers want:

* SGLang: per-token lists `output_token_sampling_mask` (list of id lists) and
  `output_token_sampling_logprobs` (list of floats);
* vLLM: CSR `token_ids` [N] with `offsets` [T + 1] (row t is token_ids[offsets[t]:offsets[t+1]]);
* prime-rl: flat `ids` [N] with per-token `counts` [T];
* a dense boolean [T, V] mask (torch), for masking training logits directly.

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


def _from_flat(ids, counts, width: int) -> FixedWidthMasks:
    """Scatter flat ids with per-row counts into the padded [T, W] layout."""
    ids, counts = _numpy(ids).reshape(-1).astype(np.int64), _numpy(counts).reshape(-1).astype(np.int64)
    if (counts < 0).any() or counts.sum() != ids.shape[0]:
        raise ValueError(f"counts must be >= 0 and sum to the number of ids ({ids.shape[0]})")
    if counts.size and counts.max() > width:
        raise ValueError(f"a row holds {counts.max()} ids, more than the width W={width}")
    rows = np.repeat(np.arange(counts.shape[0]), counts)
    starts = _offsets(counts)[:-1]
    mask = np.full((counts.shape[0], width), PAD_ID, dtype=np.int32)
    mask[rows, np.arange(ids.shape[0]) - starts[rows]] = ids
    return FixedWidthMasks(mask=mask, lengths=counts.astype(np.int32))


def to_vllm_csr(mask, lengths) -> dict[str, np.ndarray]:
    """vLLM's CSR: `token_ids` int32 [N] and `offsets` int64 [T + 1]."""
    mask, lengths, valid = _checked(mask, lengths)
    return {"token_ids": mask[valid].astype(np.int32), "offsets": _offsets(lengths)}


def from_vllm_csr(token_ids, offsets, width: int) -> FixedWidthMasks:
    """The fixed-width layout of a vLLM CSR mask."""
    offsets = _numpy(offsets).reshape(-1).astype(np.int64)
    if offsets.size == 0 or offsets[0] != 0:
        raise ValueError("offsets must start at 0 and have T + 1 entries")
    return _from_flat(token_ids, np.diff(offsets), width)


def to_prime_rl(mask, lengths) -> dict[str, np.ndarray]:
    """prime-rl's flat form: `ids` int32 [N] and per-token `counts` int32 [T]."""
    mask, lengths, valid = _checked(mask, lengths)
    return {"ids": mask[valid].astype(np.int32), "counts": lengths.astype(np.int32)}


def from_prime_rl(ids, counts, width: int) -> FixedWidthMasks:
    """The fixed-width layout of prime-rl's (ids, counts)."""
    return _from_flat(ids, counts, width)


def to_sglang(mask, lengths, sampling_logprobs) -> dict[str, list]:
    """SGLang's per-token lists: `output_token_sampling_mask` (one id list per token) and
    `output_token_sampling_logprobs` (one float per token)."""
    mask, lengths, valid = _checked(mask, lengths)
    logprobs = _numpy(sampling_logprobs).reshape(-1)
    if logprobs.shape[0] != mask.shape[0]:
        raise ValueError(f"sampling_logprobs must have one value per token ({mask.shape[0]}), got {logprobs.shape[0]}")
    # np.split of zero tokens would still yield one (empty) piece.
    per_token = np.split(mask[valid].astype(np.int64), _offsets(lengths)[1:-1]) if len(lengths) else []
    return {
        "output_token_sampling_mask": [ids.tolist() for ids in per_token],
        "output_token_sampling_logprobs": logprobs.astype(np.float64).tolist(),
    }


def from_sglang(output_token_sampling_mask: list[list[int]], width: int) -> FixedWidthMasks:
    """The fixed-width layout of SGLang's per-token id lists."""
    counts = np.array([len(ids) for ids in output_token_sampling_mask], dtype=np.int64)
    flat = np.fromiter((i for ids in output_token_sampling_mask for i in ids), dtype=np.int64, count=int(counts.sum()))
    return _from_flat(flat, counts, width)


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
