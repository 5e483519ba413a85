"""The comparison point: SGLang's torch-native full-sort sampling path, plus a mask read-out.

Written from its published description (softmax -> sort descending -> cumsum -> zero what top-k,
top-p and min-p exclude -> multinomial), not copied. It ranks the whole vocabulary with one full
sort per row, which is what a user without a top-k-aware sampler runs today.
"""

from __future__ import annotations

import torch


def full_sort_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, mask_width: int, want_mask: bool) -> dict[str, torch.Tensor]:
    """Token ids and log-probs per row; with `want_mask`, the support ids (padded -1), its length
    and the token's log-prob renormalised over it. Shapes: logits [B, V], parameters [B]."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sort, dim=-1) - probs_sort
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    probs_sort[rank >= top_k.unsqueeze(1)] = 0.0
    probs_sort[mass_before > top_p.unsqueeze(1)] = 0.0
    if bool((min_p > 0).any()):  # SGLang applies min-p only when some row asks for it
        probs_sort[probs_sort < (probs_sort[:, :1] * min_p.unsqueeze(1))] = 0.0
    pick = torch.multinomial(probs_sort, num_samples=1)
    token_ids = probs_idx.gather(1, pick).squeeze(1)
    token_p = probs_sort.gather(1, pick).squeeze(1)
    out = {"token_ids": token_ids, "logprobs": token_p.log()}
    if want_mask:
        # The support is the non-zero prefix of probs_sort; read its first W ids out.
        head = probs_sort[:, :mask_width]
        in_support = head > 0
        out["mask_ids"] = torch.where(in_support, probs_idx[:, :mask_width], torch.full_like(probs_idx[:, :mask_width], -1))
        out["mask_len"] = in_support.sum(dim=-1)
        out["mask_logprobs"] = (token_p / head.sum(dim=-1)).log()
    return out


def floor(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least work the math needs with a finite top_k: one top-k selection, one log-sum-exp."""
    return torch.topk(logits, k, dim=-1), torch.logsumexp(logits, dim=-1)
