"""Trainer-side replay: log-probs of the sampled tokens renormalised over the sampler's masks.

A trainer recomputes logits [T, V] for a rollout and must score each sampled token under the
same truncated distribution the sampler drew from:

    log p_mask(token) = logits[token] / T - logsumexp_{i in mask} logits[i] / T

which is what the server returns as `sampling_logprobs`. The function is differentiable in the
logits; entries outside a row's mask get exactly zero gradient (they are never read).
"""

from __future__ import annotations

import numpy as np
import torch


def _tensor(value, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype or value.dtype)
    return torch.tensor(np.asarray(value), device=device, dtype=dtype)  # a copy: inputs may be read-only


def replay_logprobs(logits: torch.Tensor, mask, mask_len, temperature, token_ids) -> torch.Tensor:
    """Log-probs [T] of `token_ids` renormalised over each row's mask, in the logits' dtype.

    logits: [T, V] float (may require grad). mask: [T, W] ids padded with -1 (the server's
    `sampling_mask`); mask_len: [T] valid ids per row; temperature: a float or [T] (0 means
    greedy, scored at temperature 1 like the server); token_ids: [T] sampled ids. Raises
    ValueError when a row has an empty mask or its token lies outside its mask.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, V], got {list(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    mask = _tensor(mask, device, torch.int64)
    mask_len = _tensor(mask_len, device, torch.int64).reshape(-1)
    token_ids = _tensor(token_ids, device, torch.int64).reshape(-1)
    # bf16/fp16 logits are scored in float32: a bf16 temperature would already differ from the
    # server's float32 one (0.8 -> 0.80078125).
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    temperature = _tensor(temperature, device, compute_dtype).reshape(-1).expand(rows)
    if mask.ndim != 2 or mask.shape[0] != rows or mask_len.shape[0] != rows or token_ids.shape[0] != rows:
        raise ValueError("mask must be [T, W] and mask_len, token_ids [T], with T = logits.shape[0]")

    valid = torch.arange(mask.shape[1], device=device).unsqueeze(0) < mask_len.unsqueeze(1)
    if bool((mask_len < 1).any()):
        raise ValueError("every row needs a non-empty mask (rows sampled without return_sampling_mask cannot be replayed)")
    if bool(((mask < 0) & valid).any()) or bool(((mask >= vocab) & valid).any()):
        raise ValueError(f"mask ids must lie in [0, {vocab})")
    if not bool(((mask == token_ids.unsqueeze(1)) & valid).any(dim=1).all()):
        raise ValueError("every sampled token must be in its row's mask")

    # Greedy rows are scored at temperature 1 (the sampler's convention, SGLang's too).
    temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    scaled = logits.to(compute_dtype) / temperature.unsqueeze(1)
    in_mask = scaled.gather(1, torch.where(valid, mask, torch.zeros_like(mask)))
    neg_inf = torch.tensor(float("-inf"), dtype=scaled.dtype, device=device)
    log_mass = torch.logsumexp(torch.where(valid, in_mask, neg_inf), dim=1)
    return (scaled.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_mass).to(logits.dtype)
