"""Small helpers to call the torch sampler from numpy in the unit tests."""

from __future__ import annotations

import numpy as np
import torch

from triton_sampling_mask.sampling.sampler import SamplingBatch, sample


def run_sampler(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, want_mask=True, mask_width=64):
    """Sample rows of `logits` [B, V]; scalar parameters are broadcast over the rows."""
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float32))
    rows = logits.shape[0]
    column = lambda value, dtype: torch.as_tensor(np.broadcast_to(np.asarray(value), (rows,)).copy()).to(dtype)  # noqa: E731
    batch = SamplingBatch(
        logits=logits,
        temperature=column(temperature, torch.float32),
        top_k=column(top_k, torch.int64),
        top_p=column(top_p, torch.float32),
        min_p=column(min_p, torch.float32),
        seed=column(seed, torch.int64),
        want_mask=column(want_mask, torch.bool),
    )
    result = sample(batch, mask_width)
    return {
        "ids": result.token_ids.numpy(),
        "logprobs": result.logprobs.numpy(),
        "mask": result.mask_ids.numpy(),
        "mask_len": result.mask_len.numpy(),
        "mask_logprobs": result.mask_logprobs.numpy(),
    }
