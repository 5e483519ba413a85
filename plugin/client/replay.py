"""Trainer-side replay: log-probs of the sampled tokens renormalised over the sampler's masks.

A trainer recomputes logits [T, V] for a rollout and must score each sampled token under the
same truncated distribution the sampler drew from:

    log p_mask(token) = logits[token] / T - logsumexp_{i in mask} logits[i] / T

which is what the server returns as `sampling_logprobs`. The function is differentiable in the
logits; entries outside a row's mask get exactly zero gradient (they are never read).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    scored = _score_masks(logits, mask, mask_len, temperature)
    token_ids = _tensor(token_ids, logits.device, torch.int64).reshape(-1)
    if token_ids.shape[0] != logits.shape[0]:
        raise ValueError("token_ids must be [T], with T = logits.shape[0]")
    if not bool(((scored.mask == token_ids.unsqueeze(1)) & scored.valid).any(dim=1).all()):
        raise ValueError("every sampled token must be in its row's mask")
    token_scaled = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).to(scored.in_mask.dtype) / scored.temperature
    return (token_scaled - scored.log_mass).to(logits.dtype)


def replay_support_logprobs(logits: torch.Tensor, mask, mask_len, temperature) -> torch.Tensor:
    """Log-probs [T, W] of every mask id renormalised over its row's mask, -inf padded: the
    trainer's side of the server's `sampling_mask_logprobs` (the behaviour distribution over the
    support, for exact KL / entropy terms). Differentiable in `logits`; arguments as `replay_logprobs`."""
    scored = _score_masks(logits, mask, mask_len, temperature)
    neg_inf = torch.tensor(float("-inf"), dtype=scored.in_mask.dtype, device=logits.device)
    return torch.where(scored.valid, scored.in_mask - scored.log_mass.unsqueeze(1), neg_inf).to(logits.dtype)


@dataclass
class _Scored:
    mask: torch.Tensor  # int64 [T, W]
    valid: torch.Tensor  # bool [T, W]
    temperature: torch.Tensor  # [T] in float64, greedy rows at 1
    in_mask: torch.Tensor  # [T, W] float64 scaled logits of the mask ids (padding: those of id 0)
    log_mass: torch.Tensor  # [T] logsumexp of the scaled logits over each mask


def _score_masks(logits: torch.Tensor, mask, mask_len, temperature) -> _Scored:
    """Checks the masks against the logits and scores them at the sampler's temperature."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, V], got {list(logits.shape)}")
    rows, vocab = logits.shape
    device = logits.device
    mask = _tensor(mask, device, torch.int64)
    mask_len = _tensor(mask_len, device, torch.int64).reshape(-1)
    # Scored in float64 over the W mask columns only, as the server does: at a small temperature
    # the scaled logits are large and float32 would lose the 1e-5 agreement. The temperature is
    # read in the logits' precision, at least float32 (the server's own: a bf16 0.8 would already
    # be 0.80078125).
    temperature_dtype = torch.promote_types(logits.dtype, torch.float32)
    temperature = _tensor(temperature, device, temperature_dtype).to(torch.float64).reshape(-1).expand(rows)
    if mask.ndim != 2 or mask.shape[0] != rows or mask_len.shape[0] != rows:
        raise ValueError("mask must be [T, W] and mask_len [T], with T = logits.shape[0]")

    valid = torch.arange(mask.shape[1], device=device).unsqueeze(0) < mask_len.unsqueeze(1)
    if bool((mask_len < 1).any()):
        raise ValueError(
            "every row needs a non-empty mask (rows sampled without return_sampling_mask cannot be replayed)"
        )
    if bool(((mask < 0) & valid).any()) or bool(((mask >= vocab) & valid).any()):
        raise ValueError(f"mask ids must lie in [0, {vocab})")

    # Greedy rows are scored at temperature 1 (the sampler's convention, SGLang's too).
    temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    in_mask = logits.gather(1, torch.where(valid, mask, torch.zeros_like(mask))).to(
        torch.float64
    ) / temperature.unsqueeze(1)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    log_mass = torch.logsumexp(torch.where(valid, in_mask, neg_inf), dim=1)
    return _Scored(mask, valid, temperature, in_mask, log_mass)
