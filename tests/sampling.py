"""Small helpers to call the torch sampler from numpy in the unit tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

# Where the sampler tests run: the plain torch path on CPU, and CUDA (the fused kernels, as a GPU
# instance runs them) where a GPU is present. `pytest -m gpu tests/` runs only the CUDA cases.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="no CUDA device here; run `pytest -m gpu tests/` on a GPU"
            ),
        ],
    ),
]
_device = {"name": "cpu"}


def use_device(name: str) -> None:
    """Make `run_sampler` put the logits on `name` (set per test by the `sampler_device` fixture)."""
    _device["name"] = name


def run_sampler(
    logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, want_mask=True, mask_width=64, fused=None
):
    """Sample rows of `logits` [B, V]; scalar parameters are broadcast over the rows."""
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float32)).to(_device["name"])
    rows = logits.shape[0]
    column = lambda value, dtype: np.broadcast_to(np.asarray(value), (rows,)).astype(dtype)  # noqa: E731
    batch = SamplingBatch.from_arrays(
        logits=logits,
        temperature=column(temperature, np.float32),
        top_k=column(top_k, np.int64),
        top_p=column(top_p, np.float32),
        min_p=column(min_p, np.float32),
        seed=column(seed, np.int64),
        want_mask=column(want_mask, np.bool_),
    )
    host = sample(batch, mask_width, fused=fused).host()
    return {
        "ids": host["output_ids"],
        "logprobs": host["output_logprobs"],
        "mask": host["sampling_mask"],
        "mask_len": host["sampling_mask_len"],
        "mask_logprobs": host["sampling_logprobs"],
        "support_logprobs": host["sampling_mask_logprobs"],
    }
