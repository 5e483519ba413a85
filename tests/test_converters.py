"""Converters: each trainer format holds exactly the per-token id lists, and round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.client import converters

VOCAB = 40
WIDTH = 12


@st.composite
def per_token_lists(draw):
    """The ground truth: T lists of distinct ids (ranked order is arbitrary), each <= WIDTH long."""
    tokens = draw(st.integers(0, 6))
    return [draw(st.lists(st.integers(0, VOCAB - 1), max_size=WIDTH, unique=True)) for _ in range(tokens)]


def fixed_width(lists):
    """The sampler's layout of the lists, built row by row (independent of the converters)."""
    mask = np.full((len(lists), WIDTH), -1, np.int32)
    for row, ids in enumerate(lists):
        mask[row, : len(ids)] = ids
    return mask, np.array([len(ids) for ids in lists], np.int32)


@settings(max_examples=60, deadline=None)
@given(per_token_lists())
def test_every_format_holds_the_lists_and_round_trips(lists):
    mask, lengths = fixed_width(lists)
    logprobs = -np.arange(len(lists), dtype=np.float32) / 7

    sglang = converters.to_sglang(mask, lengths, logprobs)
    assert sglang["output_token_sampling_mask"] == lists
    assert sglang["output_token_sampling_logprobs"] == pytest.approx(logprobs.tolist())
    back = converters.from_sglang(sglang["output_token_sampling_mask"], WIDTH)
    np.testing.assert_array_equal(back.mask, mask)
    np.testing.assert_array_equal(back.lengths, lengths)

    csr = converters.to_vllm_csr(mask, lengths)
    for row, ids in enumerate(lists):
        assert csr["token_ids"][csr["offsets"][row] : csr["offsets"][row + 1]].tolist() == ids
    assert csr["offsets"][0] == 0 and csr["offsets"][-1] == sum(map(len, lists))
    back = converters.from_vllm_csr(csr["token_ids"], csr["offsets"], WIDTH)
    np.testing.assert_array_equal(back.mask, mask)

    prime = converters.to_prime_rl(mask, lengths)
    assert prime["ids"].tolist() == [i for ids in lists for i in ids]
    assert prime["counts"].tolist() == [len(ids) for ids in lists]
    back = converters.from_prime_rl(prime["ids"], prime["counts"], WIDTH)
    np.testing.assert_array_equal(back.mask, mask)
    np.testing.assert_array_equal(back.lengths, lengths)

    dense = converters.to_dense(torch.from_numpy(mask), torch.from_numpy(lengths), VOCAB)
    assert dense.dtype == torch.bool and dense.shape == (len(lists), VOCAB)
    for row, ids in enumerate(lists):
        assert set(torch.nonzero(dense[row]).flatten().tolist()) == set(ids)
    back = converters.from_dense(dense, WIDTH)  # a dense mask has no ranking: ids come back sorted
    assert [row[:n].tolist() for row, n in zip(back.mask, back.lengths)] == [sorted(ids) for ids in lists]


def test_padding_beyond_length_is_ignored():
    mask = np.array([[3, 1, 7, 9], [5, 8, -1, -1]], np.int32)
    assert converters.to_prime_rl(mask, [2, 1])["ids"].tolist() == [3, 1, 5]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: converters.to_vllm_csr(np.zeros((2, 3), np.int32), [4, 0]), "lengths"),
        (lambda: converters.to_vllm_csr(np.array([[-1, 0, 0]]), [1]), ">= 0"),
        (lambda: converters.to_prime_rl(np.zeros((2, 3), np.int32), [1]), r"\[T, W\]"),
        (lambda: converters.from_prime_rl([1, 2, 3], [3], 2), "width"),
        (lambda: converters.from_prime_rl([1, 2, 3], [1, 1], 4), "sum"),
        (lambda: converters.from_vllm_csr([1, 2], [1, 2], 4), "start at 0"),
        (lambda: converters.to_dense(np.array([[50]]), [1], VOCAB), "vocab_size"),
        (lambda: converters.to_sglang(np.zeros((2, 3), np.int32), [1, 1], [0.0]), "one value per token"),
    ],
)
def test_inconsistent_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@settings(max_examples=60, deadline=None)
@given(per_token_lists())
def test_per_support_logprobs_travel_with_their_ids_and_round_trip(lists):
    mask, lengths = fixed_width(lists)
    # A distinct value per (token, place), built row by row: -inf beyond each row's length.
    support = np.full((len(lists), WIDTH), -np.inf, np.float32)
    for row, ids in enumerate(lists):
        support[row, : len(ids)] = -(np.arange(len(ids)) + row * WIDTH + 1) / 8
    expected = [support[row, : len(ids)].tolist() for row, ids in enumerate(lists)]

    sglang = converters.to_sglang(mask, lengths, np.zeros(len(lists)), support)
    assert sglang["output_token_sampling_support_logprobs"] == expected
    back = converters.from_sglang(
        sglang["output_token_sampling_mask"], WIDTH, sglang["output_token_sampling_support_logprobs"]
    )
    np.testing.assert_array_equal(back.support_logprobs, support)

    csr = converters.to_vllm_csr(mask, lengths, support)
    assert csr["logprobs"].tolist() == [v for row in expected for v in row]
    back = converters.from_vllm_csr(csr["token_ids"], csr["offsets"], WIDTH, csr["logprobs"])
    np.testing.assert_array_equal(back.support_logprobs, support)

    prime = converters.to_prime_rl(mask, lengths, support)
    assert prime["logprobs"].tolist() == [v for row in expected for v in row]
    back = converters.from_prime_rl(prime["ids"], prime["counts"], WIDTH, prime["logprobs"])
    np.testing.assert_array_equal(back.support_logprobs, support)
    np.testing.assert_array_equal(back.mask, mask)


def test_support_logprobs_of_the_wrong_shape_raise():
    mask, lengths = fixed_width([[1, 2], [3]])
    with pytest.raises(ValueError, match="support_logprobs must be"):
        converters.to_vllm_csr(mask, lengths, np.zeros((2, WIDTH + 1)))
