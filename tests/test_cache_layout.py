"""The padded KV cache's layout helpers (lm.py) on hand-made caches: both transformers cache shapes
(`layers`, older `key_cache`/`value_cache` lists), columns of padding trimmed, and gaps closed with
every row's positions moved to the right end in order, against a plain-Python reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_sampling_mask.generation.lm import (
    PaddedBatchState,
    _close_gaps,
    _layer_tensors,
    _set_layer_tensors,
    _trim_left_padding,
)


def layer(rows: int, width: int, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys/values [rows, heads 2, width, dim 3]: key [r, h, c, d] = 1000 * layer + 100 * r + c
    (+ 0.5 for values), so a gathered column names where it came from."""
    base = 1000.0 * layer_index + 100.0 * torch.arange(rows)[:, None] + torch.arange(width)[None, :]
    keys = base[:, None, :, None].expand(rows, 2, width, 3).clone()
    return keys, keys + 0.5


def legacy_cache(rows: int, width: int, layers: int = 2) -> SimpleNamespace:
    tensors = [layer(rows, width, i) for i in range(layers)]
    return SimpleNamespace(key_cache=[k for k, _ in tensors], value_cache=[v for _, v in tensors])


def layered_cache(rows: int, width: int, layers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        layers=[SimpleNamespace(keys=k, values=v) for k, v in (layer(rows, width, i) for i in range(layers))]
    )


def test_the_legacy_cache_lists_are_read_and_written_in_place():
    cache = legacy_cache(2, 3)
    keys, values = list(cache.key_cache), list(cache.value_cache)
    assert [(k is keys[i], v is values[i]) for i, (k, v) in enumerate(_layer_tensors(cache))] == [(True, True)] * 2
    key_list, value_list = cache.key_cache, cache.value_cache
    new = [(k[:, :, 1:], v[:, :, 1:]) for k, v in zip(keys, values)]
    _set_layer_tensors(cache, new)
    assert cache.key_cache is key_list and cache.value_cache is value_list  # the same lists, refilled
    assert [k is n for k, (n, _) in zip(cache.key_cache, new)] == [True, True]
    assert [v is n for v, (_, n) in zip(cache.value_cache, new)] == [True, True]


def test_the_layered_cache_is_read_and_written_per_layer():
    cache = layered_cache(2, 3)
    assert [(k is lay.keys, v is lay.values) for (k, v), lay in zip(_layer_tensors(cache), cache.layers)] == [
        (True, True)
    ] * 2


def test_an_unknown_cache_is_refused_naming_its_type():
    class StaticCache:
        pass

    with pytest.raises(NotImplementedError) as caught:
        _layer_tensors(StaticCache())
    assert str(caught.value) == "cannot merge a StaticCache: joining a running batch needs a transformers dynamic cache"


def mask_of(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


def expected_layout(mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """The reference: each row's positions (their source columns) moved to the right end in order,
    padded on the left to the longest row; and the mask of that layout."""
    kept = [[c for c, m in enumerate(row) if m] for row in mask.tolist()]
    width = max(len(k) for k in kept)
    return [[-1] * (width - len(k)) + k for k in kept], [[0] * (width - len(k)) + [1] * len(k) for k in kept]


def assert_layout(state: PaddedBatchState, mask: torch.Tensor, cache_tensors) -> None:
    columns, expected_mask = expected_layout(mask)
    assert state.attention_mask.tolist() == expected_mask
    for index, (keys, values) in enumerate(cache_tensors(state.cache)):
        assert keys.shape == (mask.shape[0], 2, len(expected_mask[0]), 3)
        for r, row in enumerate(columns):
            for j, source in enumerate(row):
                if source >= 0:  # a position: its own key and value; padding may hold anything
                    want = 1000.0 * index + 100.0 * r + source
                    assert torch.all(keys[r, :, j, :] == want) and torch.all(values[r, :, j, :] == want + 0.5)


def layered(cache):
    return [(lay.keys, lay.values) for lay in cache.layers]


def legacy(cache):
    return list(zip(cache.key_cache, cache.value_cache))


@pytest.mark.parametrize("make, tensors", [(legacy_cache, legacy), (layered_cache, layered)])
def test_columns_of_padding_in_every_row_are_trimmed(make, tensors):
    mask = mask_of("0011", "0001", "0111")
    state = PaddedBatchState(make(3, 4), mask, torch.tensor([2, 1, 3]))
    trimmed = _trim_left_padding(state)
    assert_layout(trimmed, mask, tensors)
    assert trimmed.next_position.tolist() == [2, 1, 3]


def test_a_cache_without_leading_padding_is_left_as_it_is():
    state = PaddedBatchState(legacy_cache(2, 3), mask_of("011", "111"), torch.tensor([2, 3]))
    assert _trim_left_padding(state) is state


def test_a_cache_with_no_positions_at_all_is_left_as_it_is():
    state = PaddedBatchState(legacy_cache(2, 3), mask_of("000", "000"), torch.tensor([0, 0]))
    assert _trim_left_padding(state) is state
    assert [k.shape[2] for k in state.cache.key_cache] == [3, 3]


@pytest.mark.parametrize("make, tensors", [(legacy_cache, legacy), (layered_cache, layered)])
def test_gaps_are_closed_with_each_rows_positions_in_order(make, tensors):
    mask = mask_of("101101", "011100", "000011", "110000")
    state = PaddedBatchState(make(4, 6), mask, torch.tensor([5, 4, 2, 2]))
    closed = _close_gaps(state)
    assert_layout(closed, mask, tensors)
    assert closed.next_position.tolist() == [5, 4, 2, 2]


def test_wide_rows_keep_their_positions_order_when_gaps_close():
    generator = torch.Generator().manual_seed(3)
    mask = (torch.rand(3, 300, generator=generator) < 0.5).to(torch.int64)
    state = PaddedBatchState(legacy_cache(3, 300, layers=1), mask, torch.tensor([1, 1, 1]))
    assert_layout(_close_gaps(state), mask, legacy)


def test_without_gaps_the_padding_is_only_trimmed_never_copied():
    mask = mask_of("0011", "0001", "0111")
    cache = legacy_cache(3, 4)
    storages = [k.untyped_storage().data_ptr() for k in cache.key_cache]
    closed = _close_gaps(PaddedBatchState(cache, mask, torch.tensor([2, 1, 3])))
    assert_layout(closed, mask, legacy)
    assert [k.untyped_storage().data_ptr() for k in closed.cache.key_cache] == storages  # views of the same tensors
