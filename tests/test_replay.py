"""Trainer replay: renormalised log-probs against the float64 reference and the sampler itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.client.replay import replay_logprobs, replay_support_logprobs
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

from .reference import reference_row

VOCAB = 64
WIDTH = 16


def reference_masks(logits: np.ndarray, temperature, top_k, top_p, min_p):
    """Supports by the float64 reference, in the sampler's [T, W] layout, and their rows. Replay
    takes any mask, so a boundary within the reference's tolerance is simply included."""
    rows = [reference_row(row, t, k, p, m) for row, t, k, p, m in zip(logits, temperature, top_k, top_p, min_p)]
    mask = np.full((len(rows), WIDTH), -1, np.int64)
    lengths = np.zeros(len(rows), np.int64)
    for i, ref in enumerate(rows):
        support = ref.order[: ref.support_max]
        mask[i, : len(support)] = support
        lengths[i] = len(support)
    return mask, lengths, rows


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 6),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.integers(1, WIDTH),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05]),
)
def test_matches_float64_reference(seed, rows, temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, VOCAB)) * 3
    params = [np.full(rows, v) for v in (temperature, top_k, top_p, min_p)]
    mask, lengths, refs = reference_masks(logits, *params)
    tokens = np.array([row[rng.integers(n)] for row, n in zip(mask, lengths)])
    got = replay_logprobs(torch.from_numpy(logits), mask, lengths, temperature, tokens)
    want = [ref.renormalised_logprob(int(t), int(n)) for ref, t, n in zip(refs, tokens, lengths)]
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-9)


def test_reproduces_sampler_logprobs_on_float32_logits():
    rows = 32
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, 1000, generator=gen) * 4
    temperature = torch.linspace(0.0, 1.5, rows)  # row 0 greedy
    batch = SamplingBatch.from_arrays(
        logits=logits,
        temperature=temperature,
        top_k=torch.randint(1, 65, (rows,), generator=gen),
        top_p=torch.full((rows,), 0.9),
        min_p=torch.full((rows,), 0.01),
        seed=torch.arange(rows, dtype=torch.int64),
        want_mask=torch.ones(rows, dtype=torch.bool),
    )
    result = sample(batch, 64)
    got = replay_logprobs(logits, result.sampling_mask, result.sampling_mask_len, temperature, result.output_ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, result.sampling_logprobs, rtol=0, atol=1e-5)
    # The trainer's per-support log-probs equal the server's sampling_mask_logprobs, padding included.
    support = replay_support_logprobs(logits, result.sampling_mask, result.sampling_mask_len, temperature)
    torch.testing.assert_close(support, result.sampling_mask_logprobs, rtol=0, atol=1e-5)


def test_support_logprobs_match_float64_reference_and_carry_gradients():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    mask, lengths = torch.tensor([[4, 0, 1, -1]]), torch.tensor([3])
    support = replay_support_logprobs(logits, mask, lengths, 0.5)
    scaled = np.array([3.0, 2.0, 1.0]) / 0.5
    expected = scaled - np.log(np.exp(scaled).sum())
    np.testing.assert_allclose(support[0, :3].detach().numpy(), expected, rtol=0, atol=1e-12)
    assert support[0, 3] == float("-inf")
    support[0, :3].exp().sum().backward()  # a constant (1): the gradient vanishes on the mask
    assert logits.grad[0, [2, 3]].abs().max() == 0  # ids outside the mask are never read


def test_gradcheck_float64_and_zero_gradient_outside_the_mask():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.tensor([[5, 2, 9, -1], [0, -1, -1, -1], [11, 3, 4, 7], [6, 1, -1, -1]])
    lengths = torch.tensor([3, 1, 4, 2])
    tokens = torch.tensor([2, 0, 7, 6])
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0], dtype=torch.float64)

    assert torch.autograd.gradcheck(lambda x: replay_logprobs(x, mask, lengths, temperature, tokens), (logits,))

    replay_logprobs(logits, mask, lengths, temperature, tokens).sum().backward()
    inside = torch.zeros_like(logits, dtype=torch.bool)
    for row, n in enumerate(lengths.tolist()):
        inside[row, mask[row, :n]] = True
    assert (logits.grad[~inside] == 0).all()
    # d/dlogits of (x_t - logsumexp_mask x) / T: (onehot_t - softmax_mask) / T, computed here in numpy.
    x = logits.detach().numpy()
    for row, n in enumerate(lengths.tolist()):
        ids = mask[row, :n].numpy()
        t = temperature[row].item() or 1.0
        p = np.exp(x[row, ids] / t - np.logaddexp.reduce(x[row, ids] / t))
        want = -p / t
        want[ids.tolist().index(tokens[row].item())] += 1 / t
        np.testing.assert_allclose(logits.grad[row, ids].numpy(), want, atol=1e-12)


@pytest.mark.parametrize(
    "mask, lengths, tokens, match",
    [
        ([[1, 2]], [2], [3], "in its row's mask"),
        ([[1, 2]], [0], [1], "non-empty mask"),
        ([[1, 99]], [2], [1], "mask ids"),
    ],
)
def test_rejects_inconsistent_rows(mask, lengths, tokens, match):
    with pytest.raises(ValueError, match=match):
        replay_logprobs(torch.zeros(1, 8), mask, lengths, 1.0, tokens)
