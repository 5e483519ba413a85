"""Corrections and receipts against the real server: a trainer holding the sampler's own logits
re-derives every token from its receipt, measures the kept mass the server reports and finds
ratios of 1 and zero KL over the support; logits perturbed on purpose are flagged."""

from __future__ import annotations

import numpy as np
import torch

from tests.reference import reference_draw
from triton_sampling_mask.client import SamplerClient
from triton_sampling_mask.client.corrections import (
    ratio_diagnostics,
    server_kept_log_mass,
    support_divergences,
)
from triton_sampling_mask.client.receipts import SamplingReceipts, rederive_tokens
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.client.support import FlatSupport, score_support

ROWS, VOCAB = 96, 2000
SETTINGS = [
    dict(temperature=0.8, top_k=40, top_p=0.9),
    dict(temperature=1.2, top_k=100, min_p=0.02),
    dict(temperature=0.0, top_k=5),
    dict(temperature=0.6, top_k=8),
]


def test_receipts_rederive_every_served_token_and_flag_perturbed_logits(triton_server):
    logits = (np.random.default_rng(21).standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
    params = [
        SamplingParams(**SETTINGS[i % len(SETTINGS)], seed=2**63 + 977 * i, return_sampling_mask=True)
        for i in range(ROWS)
    ]
    with SamplerClient(triton_server.grpc_url, protocol="grpc") as client:
        result = client.sample(logits, params)
    receipts = SamplingReceipts.for_sampler(params)

    exact = rederive_tokens(torch.from_numpy(logits), receipts, result.output_ids)
    assert exact.summary() == {"tokens": ROWS, "rederived": ROWS, "near_ties": 0, "flagged": 0}

    perturbed = logits + np.random.default_rng(22).standard_normal(logits.shape).astype(np.float32)
    found = rederive_tokens(torch.from_numpy(perturbed), receipts, result.output_ids)
    assert found.flagged.sum() >= ROWS // 10, found.summary()
    # Every flag is a real difference: the float64 reference support of the perturbed row, with
    # the receipt's noise, no longer draws the served token there.
    for t in np.flatnonzero(found.flagged):
        p = params[t]
        draw = reference_draw(perturbed[t], p.temperature, p.top_k, p.top_p, p.min_p, int(receipts.noise_seed[t]))
        assert draw in (None, int(found.token_ids[t])) and draw != result.output_ids[t]


def test_the_trainer_measures_what_the_server_reports(triton_server):
    """Over the server's own logits: the trainer's kept mass is the server's
    output_logprobs - sampling_logprobs, the support ratios are 1 and both KLs are 0."""
    logits = (np.random.default_rng(23).standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
    params = [SamplingParams(**SETTINGS[i % 2], seed=i, return_sampling_mask=True) for i in range(ROWS)]
    with SamplerClient(triton_server.http_url, protocol="http") as client:
        result = client.sample(logits, params)
    support = FlatSupport.from_padded(result.sampling_mask, result.sampling_mask_len, result.sampling_mask_logprobs)
    temperatures = np.array([p.temperature for p in params], np.float32)
    trainer_logits = torch.from_numpy(logits)
    scores = score_support(trainer_logits, support, temperatures)
    diagnostics = ratio_diagnostics(trainer_logits, scores, result.output_ids, result.sampling_logprobs)
    served = server_kept_log_mass(result.output_logprobs, result.sampling_logprobs)
    np.testing.assert_allclose(diagnostics.kept_log_mass.numpy(), served, atol=1e-5)
    assert (served < -1e-3).any(), "the truncation should cost mass for these parameters"
    np.testing.assert_allclose(diagnostics.support_log_ratio.numpy(), 0.0, atol=1e-5)
    divergences = support_divergences(scores)
    assert float(divergences.kl_behaviour_trainer.abs().max()) < 1e-5
    assert float(divergences.kl_trainer_behaviour.abs().max()) < 1e-5
