"""CPU top-k layouts the other ranking tests miss, each against a float64 lexsort: logits too close
to tell apart at 1.0, an id of 2**n at V = 2**n + 1, a batch of exactly one row block, and rows
needing the tie repair with rows between them that do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.selection import FULL_VOCAB_BLOCK_ELEMENTS, ranked_candidates


def check_ranking(logits: np.ndarray, k: int) -> None:
    values, ids = ranked_candidates(torch.from_numpy(logits), k, "cpu")
    vocab = logits.shape[1]
    expected = np.stack([np.lexsort((np.arange(vocab), -row.astype(np.float64)))[:k] for row in logits])
    np.testing.assert_array_equal(ids.numpy(), expected)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(logits, expected, axis=1))


def test_tiny_distinct_logits_rank_by_value_on_the_threshold_path():
    rng = np.random.default_rng(5)
    rows, vocab = 3, 4096  # V >= 8 (k + 1): the threshold selection
    check_ranking((rng.permuted(np.tile(np.arange(vocab), (rows, 1)), axis=1) * 1e-12).astype(np.float32), 8)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_highest_id_of_a_vocabulary_one_past_a_power_of_two_ranks(rows):
    vocab = 4097  # ids need 13 bits, one more than vocab - 2 does
    logits = np.random.default_rng(6).standard_normal((rows, vocab)).astype(np.float32)
    logits[:, vocab - 1] = 10.0
    check_ranking(logits, 8)


def test_a_batch_of_exactly_one_row_block():
    vocab = 32768
    rows = FULL_VOCAB_BLOCK_ELEMENTS // vocab
    check_ranking(np.random.default_rng(7).standard_normal((rows, vocab)).astype(np.float32), 8)


def test_tie_repair_of_rows_with_untied_rows_between_them():
    # V < 8 (k + 1): one top-(k + 1); rows 0 and 3 hold a run of equal logits across the k-th
    # place (its lowest ids must win), rows 1 and 2 none.
    rng = np.random.default_rng(8)
    vocab, k = 64, 10
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    for row in (0, 3):
        logits[row, rng.choice(vocab, 20, replace=False)] = 5.0
    check_ranking(logits, k)
