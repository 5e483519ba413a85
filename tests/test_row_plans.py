"""The sampler's routing (`sampler.plan_rows`): the path each row takes at every boundary of its
rules, read from the parameters alone; the decode step's CPU fast path; a row group as wide as
the vocabulary; and the checks of `SamplingBatch` itself.

Every path gives the same outputs (the float64 reference tests check each), so a wrong route
would pass those tests and cost only time: here the routes themselves are pinned down, as the
docstrings of `plan_rows` and `RowPlan` state them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling import sampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.results import HostResult
from triton_sampling_mask.sampling.sampler import SamplingBatch, plan_rows
from triton_sampling_mask.sampling.selection import device_path_for

from .reference import reference_draw, reference_noise_seed

SMALL_TOP_K = 1024  # ranked to a top-k of at most this many: the "small_k" group
TOP_P_CANDIDATES = 4096  # rows with no top_k rank this many first when the vocabulary is larger
FIELDS = ("small_k", "top_p_first", "full_sort", "unranked")


def batch(vocab: int, top_k, top_p=None, want_mask=None, temperature=None) -> SamplingBatch:
    rows = len(top_k)
    column = lambda value, default, dtype: np.asarray(  # noqa: E731
        [default] * rows if value is None else value, dtype
    )
    return SamplingBatch.from_arrays(
        torch.zeros(rows, vocab),
        temperature=column(temperature, 1.0, np.float32),
        top_k=np.asarray(top_k, np.int64),
        top_p=column(top_p, 1.0, np.float32),
        min_p=np.zeros(rows, np.float32),
        seed=np.arange(rows, dtype=np.int64),
        want_mask=column(want_mask, False, np.bool_),
    )


def routes(plan) -> list[str]:
    """Each row's one path, checking that every field is a bool per row and exactly one holds."""
    for name in FIELDS:
        field = getattr(plan, name)
        assert field.dtype == np.bool_ and field.shape == plan.k_eff.shape, name
    chosen = np.stack([getattr(plan, name) for name in FIELDS], axis=1)
    assert (chosen.sum(axis=1) == 1).all(), chosen
    return [FIELDS[i] for i in chosen.argmax(axis=1)]


def test_finite_top_k_rows_are_small_up_to_the_bound_and_fully_sorted_past_it():
    plan = plan_rows(batch(5000, [1, SMALL_TOP_K, SMALL_TOP_K + 1, 5000]))
    assert routes(plan) == ["small_k", "small_k", "full_sort", "full_sort"]
    assert plan.k_eff.tolist() == [1, SMALL_TOP_K, SMALL_TOP_K + 1, 5000]


def test_rows_without_top_k_are_unranked_only_at_top_p_1_without_a_mask():
    top_k = [-1, -1, -1, SMALL_TOP_K, SMALL_TOP_K + 1]
    top_p = [1.0, 0.999, 1.0, 1.0, 1.0]
    want_mask = [False, False, True, False, False]
    plan = plan_rows(batch(TOP_P_CANDIDATES + 1, top_k, top_p, want_mask))
    # past the candidate count, a row with no top_k that must rank ranks its candidates first
    assert routes(plan) == ["unranked", "top_p_first", "top_p_first", "small_k", "full_sort"]
    assert plan.k_eff.tolist() == [TOP_P_CANDIDATES + 1] * 3 + [SMALL_TOP_K, SMALL_TOP_K + 1]


def test_rows_without_top_k_sort_fully_when_the_vocabulary_is_no_larger_than_the_candidates():
    plan = plan_rows(batch(TOP_P_CANDIDATES, [-1, -1, 7], [1.0, 0.5, 1.0], [False, False, True]))
    assert routes(plan) == ["unranked", "full_sort", "small_k"]


def test_a_greedy_row_without_top_k_is_ranked_to_its_one_token():
    plan = plan_rows(batch(5000, [-1, -1], temperature=[0.0, 1.0]))
    assert routes(plan) == ["small_k", "unranked"] and plan.k_eff[0] == 1


def test_a_cpu_batch_of_small_k_rows_is_answered_from_its_host_arrays():
    # The decode step's common case on the CPU: one group, its padded numpy outputs are the result.
    logits = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 300)).astype(np.float32))
    small = SamplingBatch(logits, batch(300, [5, 20, 300]).params)
    assert isinstance(sampler.sample(small, 16, fused=False, device_path="cpu"), HostResult)
    mixed = SamplingBatch(logits, batch(300, [5, -1, 300]).params)
    assert not isinstance(sampler.sample(mixed, 16, fused=False, device_path="cpu"), HostResult)


@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
def test_a_row_group_as_wide_as_the_vocabulary_takes_its_own_rows(device_path):
    # 6 rows of a 4-token vocabulary: 4 unranked rows (a group of V rows, not the whole batch) and 2
    # masked top-k rows; every row's draw against the float64 reference.
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 4)).astype(np.float32) * 3
    top_k = np.array([-1, 2, -1, -1, 3, -1])
    want_mask = top_k > 0
    params = batch(4, top_k, want_mask=want_mask).params
    assert routes(plan_rows(SamplingBatch(torch.from_numpy(logits), params))).count("unranked") == 4
    result = sampler.sample(SamplingBatch(torch.from_numpy(logits), params), 4, fused=False, device_path=device_path)
    ids = result.host()["output_ids"]
    for row in range(6):
        expected = reference_draw(logits[row], 1.0, int(top_k[row]), 1.0, 0.0, reference_noise_seed(row, None))
        assert expected is not None and int(ids[row]) == expected, row


def test_from_arrays_gives_every_parameter_one_value_per_row():
    made = batch(7, [1, 2, 3]).params  # 3 rows of 7 logits: rows and vocabulary told apart
    for name, value in vars(made).items():
        assert np.shape(value) == (3,), name
    assert made.seed.dtype == np.uint64 and made.seed.tolist() == [0, 1, 2]
    assert made.has_seed.dtype == np.bool_ and made.has_seed.all()
    given = {"temperature", "top_k", "top_p", "min_p", "return_sampling_mask", "seed", "has_seed"}
    defaults = RowParams.defaults(3)
    for name in set(vars(made)) - given:  # every other parameter at its default
        np.testing.assert_array_equal(getattr(made, name), getattr(defaults, name), err_msg=name)


def test_a_batch_with_an_unseeded_row_is_refused_saying_how_to_seed_it():
    params = batch(5, [1, 2]).params
    params.has_seed[1] = False
    with pytest.raises(ValueError) as caught:
        SamplingBatch(torch.zeros(2, 5), params)
    assert str(caught.value) == "every row to sample needs its seed: resolve them with RowParams.with_seeds"


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_the_device_path_is_gpu_for_any_device_but_the_cpu(device):
    # No GPU is needed to ask: a torch.device names one without touching it.
    assert device_path_for(torch.device(device)) == "gpu" and device_path_for(torch.device(device), "gpu") == "gpu"
    with pytest.raises(ValueError) as caught:
        device_path_for(torch.device(device), "cpu")
    assert str(caught.value) == f"the cpu device path needs CPU tensors, got {device}"
    assert device_path_for(torch.device("cpu")) == "cpu" and device_path_for(torch.device("cpu"), "gpu") == "gpu"
