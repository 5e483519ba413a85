"""The CPU sampler's one-row routes (the B=1 decode step) against the batch code, bit for bit.

A batch of one row takes its own routes on the CPU: routing without a full plan, the threshold
selection ranked by one stable sort, an epilogue on scalars without numpy's error state, and one
seed hashed in Python integers. Each must give exactly the outputs the batch code gives the same
row, so every test here samples one-row batches twice, with the routes and with them switched
off (`batch_code`), and compares every output's bytes; where a route hands a row back to the
batch code (a broken row, log-probs past float32's range), that is checked to happen. The float64
reference (`tests/reference.py`) checks the outputs themselves. What a one-row call costs is
counted last, in units no machine load changes.

(Sampling a row alone and inside a larger batch is not a bit-exact oracle: torch's CPU `exp2_`
puts a row's last elements in SIMD lanes or in its scalar tail depending on the rows before it,
so the normaliser, and with it the log-probs, may differ in the last bit; tokens and masks do
not, which test_sampler checks.)
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import triton_sampling_mask
from triton_sampling_mask.sampling import epilogues, rng, sampler, selection
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

from .reference import reference_draw, reference_gumbel, reference_row
from .sampling import sampling_cases

WIDTH = 64


def sample_rows(logits: np.ndarray, dtype=torch.float32, **params) -> dict[str, np.ndarray]:
    """Every output of the CPU path for `logits` [B, V], parameters [B] each (numpy)."""
    batch = SamplingBatch.from_arrays(logits=torch.from_numpy(logits).to(dtype), **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no route may leak a numpy warning
        return sample(batch, WIDTH, device_path="cpu").host()


@contextlib.contextmanager
def batch_code():
    """The one-row routes switched off: every one-row batch takes the code of larger batches (the
    full plan and its scatter, the packed-key selection of a block of rows, the keep-masked
    epilogue, the seed hashed as an array)."""

    def select_as_a_block(row, k, *_):
        values, ids, settled = selection._select_by_threshold(np.stack([row, row]), k)
        return values[:1], ids[:1], settled[:1]

    def seed_as_an_array(seeds):
        seeds = np.asarray(seeds)
        return rng._mix64_numpy_inplace(seeds.view(np.uint64) ^ rng._NP_GOLDEN)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler, "_small_k_group", lambda batch: None)
        patch.setattr(selection, "_select_row_by_threshold", select_as_a_block)
        patch.setattr(epilogues, "_epilogue_one_row", lambda *args: None)
        patch.setattr(rng, "seed_state_numpy", seed_as_an_array)
        yield


def assert_same_bits(fast: dict, batch: dict) -> None:
    """Every output holds the same bytes (and dtype and shape) in both."""
    assert fast.keys() == batch.keys()
    for name, value in fast.items():
        expected = batch[name]
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        assert value.tobytes() == expected.tobytes(), (
            f"{name}: {value} by the one-row routes, {expected} by the batch code"
        )


def each_row_both_ways(logits: np.ndarray, dtype=torch.float32, **params) -> None:
    """Each row of `logits`, as a batch of one, has the same outputs with and without the routes."""
    for row in range(logits.shape[0]):
        one = (logits[row : row + 1], dtype)
        one_params = {name: value[row : row + 1] for name, value in params.items()}
        fast = sample_rows(*one, **one_params)
        with batch_code():
            assert_same_bits(fast, sample_rows(*one, **one_params))


def row_params(rows: int, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, seed=None, want_mask=True) -> dict:
    column = lambda value, dtype: np.broadcast_to(np.asarray(value, dtype), (rows,)).copy()  # noqa: E731
    return dict(
        temperature=column(temperature, np.float32),
        top_k=column(top_k, np.int64),
        top_p=column(top_p, np.float32),
        min_p=column(min_p, np.float32),
        seed=np.arange(rows, dtype=np.int64) * 7919 - 3 if seed is None else column(seed, np.int64),
        want_mask=column(want_mask, np.bool_),
    )


class RouteSpy:
    """Counts what the one-row routes returned: a result, or None (the batch code took the row)."""

    def __init__(self, monkeypatch):
        self.epilogue, self.selection = [], []
        one_row, select_row = epilogues._epilogue_one_row, selection._select_row_by_threshold

        def spied_epilogue(*args):
            result = one_row(*args)
            self.epilogue.append(result is not None)
            return result

        def spied_selection(*args):
            result = select_row(*args)
            self.selection.append(bool(result[2][0]))
            return result

        monkeypatch.setattr(epilogues, "_epilogue_one_row", spied_epilogue)
        monkeypatch.setattr(selection, "_select_row_by_threshold", spied_selection)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampling_cases(max_rows=3))
def test_a_one_row_batch_has_the_batch_codes_bits(case):
    logits = case.pop("logits")
    each_row_both_ways(logits, **case)


# Rows of a 32,000-token vocabulary that stress the one-row routes: ties of every kind at the k-th
# place, banned tokens, each rule binding, greedy, masks on and off, seeds at the ends of the range.
def _large_rows(kind: str) -> tuple[np.ndarray, dict]:
    draw = np.random.default_rng(sum(map(ord, kind)))
    vocab, rows = 32000, 3
    logits = (draw.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = row_params(rows)
    if kind == "bf16-ties":  # rounded as an LM head's outputs are: runs of equal logits at the k-th place
        logits = torch.from_numpy(logits).bfloat16().float().numpy()
    elif kind == "integer-ties":
        logits = draw.integers(-4, 5, (rows, vocab)).astype(np.float32)
    elif kind == "signed-zeros":  # -0.0 and 0.0 are one logit: ranked by id
        logits = np.where(draw.random((rows, vocab)) < 0.5, np.float32(-0.0), np.float32(0.0))
        logits[:, draw.integers(0, vocab, 40)] = 1.0
    elif kind == "banned":
        logits[draw.random((rows, vocab)) < 0.99] = -np.inf
    elif kind == "few-finite":  # fewer finite logits than top_k: the support stops at the first -inf
        logits[:] = -np.inf
        logits[:, draw.integers(0, vocab, 20)] = draw.standard_normal((rows, 20))
    elif kind == "top-p":
        params = row_params(rows, temperature=[0.7, 1.3, 0.25], top_k=[50, 512, 1024], top_p=[0.9, 0.3, 0.999])
    elif kind == "min-p":
        params = row_params(rows, top_k=[512, 50, 1024], min_p=[0.05, 0.5, 0.9])
    elif kind == "greedy":
        params = row_params(rows, temperature=0.0, top_k=[-1, 50, 1])
    elif kind == "masks-off":
        params = row_params(rows, want_mask=[False, True, False], top_k=[1, 50, 1024])
    elif kind == "seeds":
        params = row_params(rows, seed=[0, -1, -(2**63)])
    elif kind == "subnormal-temperature":
        params = row_params(rows, temperature=[1e-39, 1e-45, 0.5], top_p=[0.9, 1.0, 0.5])
    return logits, params


LARGE_KINDS = (
    "normal",
    "bf16-ties",
    "integer-ties",
    "signed-zeros",
    "banned",
    "few-finite",
    "top-p",
    "min-p",
    "greedy",
    "masks-off",
    "seeds",
    "subnormal-temperature",
)


@pytest.mark.parametrize("kind", LARGE_KINDS)
def test_large_vocabulary_rows_have_the_batch_codes_bits_and_the_reference_support(kind, monkeypatch):
    logits, params = _large_rows(kind)
    spy = RouteSpy(monkeypatch)
    each_row_both_ways(logits, **params)
    assert spy.epilogue and spy.selection, "the one-row routes did not run"
    for row in range(logits.shape[0]):
        out = sample_rows(logits[row : row + 1], **{n: v[row : row + 1] for n, v in params.items()})
        temperature = float(params["temperature"][row])
        rules = (int(params["top_k"][row]), float(params["top_p"][row]), float(params["min_p"][row]))
        ref = reference_row(logits[row], temperature, *rules)
        token = int(out["output_ids"][0])
        assert token in ref.order[: ref.support_max]
        if params["want_mask"][row] and ref.support_min == ref.support_max:
            length = int(out["sampling_mask_len"][0])
            np.testing.assert_array_equal(out["sampling_mask"][0, :length], ref.support[:WIDTH])
        if temperature >= 1e-3:  # the subnormal ones' log-probs are -inf or 0 on both sides
            assert out["output_logprobs"][0] == pytest.approx(ref.logprobs[token], abs=1e-4)
            expected = reference_draw(logits[row], temperature, *rules, int(params["seed"][row]) % 2**64)
            assert expected is None or token == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_have_the_batch_codes_bits(dtype):
    logits, params = _large_rows("normal")
    each_row_both_ways(logits, dtype, **params)


def test_the_one_row_routes_run_on_an_ordinary_row(monkeypatch):
    spy = RouteSpy(monkeypatch)
    logits, params = _large_rows("normal")
    sample_rows(logits[:1], **{n: v[:1] for n, v in params.items()})
    assert spy.epilogue == [True] and spy.selection == [True]


@pytest.mark.parametrize(
    "broken, temperature, taken_by",
    [
        # A NaN is never a candidate: the row runs the one-row epilogue (NaN log-probs), and its
        # row max, from amax, is NaN, so the row is refused as the batch code's would be.
        ("nan", 1.0, "one-row epilogue"),
        ("+inf", 1.0, "batch epilogue"),  # no finite max: refused later
        ("all -inf", 1.0, "batch epilogue"),
        ("span", 1e-30, "batch epilogue"),  # (x - max) / T past float32's range: cast to -inf there
        ("long run", 1.0, "top-k selection"),  # a run of equal logits too long to sort
    ],
)
def test_rows_the_one_row_routes_hand_back_get_the_batch_codes_bits(broken, temperature, taken_by, monkeypatch):
    draw = np.random.default_rng(11)
    logits = (draw.standard_normal((2, 32000)) * 3).astype(np.float32)
    if broken == "nan":
        logits[:, 77] = np.nan
    elif broken == "+inf":
        logits[:, 123] = np.inf
    elif broken == "all -inf":
        logits[:] = -np.inf
    elif broken == "span":
        logits[:, :100] = draw.standard_normal((2, 100)).astype(np.float32)
        logits[:, 100:] = -3e37
    elif broken == "long run":
        logits[:] = 0.0
        logits[:, :10] = 1.0
    spy = RouteSpy(monkeypatch)
    params = row_params(2, temperature=temperature, top_k=1024)
    each_row_both_ways(logits, **params)
    ran = {
        "one-row epilogue": spy.epilogue,
        "batch epilogue": [not ran for ran in spy.epilogue],
        "top-k selection": [not ran for ran in spy.selection],
    }[taken_by]
    assert ran and all(ran), f"expected the {taken_by} to take the row"
    if broken == "nan":
        assert np.isnan(sample_rows(logits[:1], **{n: v[:1] for n, v in params.items()})["row_max"]).all()


def test_one_row_threshold_selection_is_the_batch_selection_of_that_row():
    draw = np.random.default_rng(2)
    rows = np.stack(
        [
            (draw.standard_normal(20000) * 2).astype(np.float32),
            np.round(draw.standard_normal(20000)).astype(np.float32),  # long runs of ties
            np.where(draw.random(20000) < 0.5, np.float32(-0.0), np.float32(0.0)),
            np.where(draw.random(20000) < 0.999, np.float32(-np.inf), np.float32(1.0)),
        ]
    )
    for k in (1, 7, 50, 300):
        batch_values, batch_ids, batch_settled = selection._select_by_threshold(rows, k)
        for row in range(rows.shape[0]):
            values, ids, settled = selection._select_by_threshold(rows[row : row + 1], k)
            assert settled.tolist() == batch_settled[row : row + 1].tolist()
            if settled[0]:
                assert values.tobytes() == batch_values[row : row + 1].tobytes()
                assert np.array_equal(ids, batch_ids[row : row + 1])
                expected = np.lexsort((np.arange(rows.shape[1]), -rows[row].astype(np.float64)))[:k]
                assert np.array_equal(ids[0], expected)


@pytest.mark.parametrize("seed", [0, 1, -1, 2**62, -(2**63), 2**63 - 1, 0x9E3779B97F4A7C15 - 2**64])
def test_one_seeds_stream_key_is_the_arrays_and_the_references(seed):
    one = rng.seed_state_numpy(np.array([seed], np.int64))
    among = rng.seed_state_numpy(np.array([seed, 5, -9], np.int64))[:1]
    assert one.dtype == np.uint64 and one.shape == (1,) and one.tobytes() == among.tobytes()
    assert int(one[0]) == int(rng.seed_state(torch.tensor([seed])).numpy().view(np.uint64)[0])
    assert rng.seed_state_numpy(np.array(seed, np.int64)).shape == ()  # a 0-d seed keeps its shape
    ids = np.array([0, 1, 31999, 151935], np.int64)
    noise = -rng.negated_gumbel_numpy(one, ids)
    np.testing.assert_allclose(noise, [reference_gumbel(seed % 2**64, int(i)) for i in ids], rtol=1e-12)


# What one B=1 call of the CPU path may cost, counted (not timed): numpy's error state is never set
# (each errstate costs more than a dozen numpy calls), torch computes only the normaliser's four
# ops (torch.from_numpy's own lift/detach aside), and the package runs at most this many Python
# frames, batch construction included.
ONE_ROW_FRAME_BUDGET = 40
NORMALISER_OPS = ["sub", "mul_", "exp2_", "sum"]


class ComputeOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("lift_fresh", "detach"):  # torch.from_numpy's wrapping, no computation
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_one_row_call_is_within_its_counted_budget():
    logits, params = _large_rows("normal")
    logits, params = torch.from_numpy(logits[:1]), {n: v[:1] for n, v in params.items()}

    def call():
        return sample(SamplingBatch.from_arrays(logits=logits, **params), 512, device_path="cpu").host()

    call()  # the workspace exists from here on
    package = triton_sampling_mask.__file__.rsplit("/", 1)[0]
    frames, error_state_changes = [], []

    def profile(frame, event, arg):
        if event == "call":
            if frame.f_code.co_filename.startswith(package):
                frames.append(frame.f_code.co_name)
            if frame.f_code.co_name == "seterr":
                error_state_changes.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert error_state_changes == []
    assert len(frames) <= ONE_ROW_FRAME_BUDGET, sorted(frames)
    with ComputeOps() as counted:
        call()
    assert counted.ops == NORMALISER_OPS
