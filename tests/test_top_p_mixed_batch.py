"""top_p = 1 turns the rule off in its own rows even when another row of the batch uses top_p."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.sampler import SamplingBatch, sample


@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
def test_top_p_one_rows_keep_a_negligible_tail_token_beside_a_top_p_row(device_path):
    # 999 near-equal logits and one e**-30 below them: the float32 normaliser may round below the
    # float64 mass before the tail token, so only the rule being off keeps that token. The last
    # row's top_p of 0.5 makes the batch apply the rule.
    generator = np.random.default_rng(41)
    rows, vocab = 17, 1000
    logits = (generator.standard_normal((rows, vocab)) * 0.01).astype(np.float32)
    logits[:, -1] = -30.0
    top_p = np.ones(rows, np.float32)
    top_p[-1] = 0.5
    params = dict(
        temperature=np.ones(rows, np.float32),
        top_k=np.full(rows, vocab),
        top_p=top_p,
        min_p=np.zeros(rows, np.float32),
        seed=np.arange(rows),
        want_mask=np.ones(rows, bool),
    )
    batch = SamplingBatch.from_arrays(torch.from_numpy(logits), **params)
    out = sample(batch, 1024, fused=False, device_path=device_path).host()
    assert (out["sampling_mask_len"][:-1] == vocab).all(), out["sampling_mask_len"]
    # Reference for the top_p row: the smallest prefix whose mass before its last token stays
    # within half of the float64 total.
    row = logits[-1].astype(np.float64)
    p = np.sort(np.exp(row - row.max()))[::-1]
    before = np.cumsum(p) - p
    assert abs(int(out["sampling_mask_len"][-1]) - int((before <= 0.5 * p.sum()).sum())) <= 1
