"""The fused Triton fast path (sampling.fused) against the independent float64 numpy reference.

On CPU the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before the
module is imported); on a GPU they run natively. The interpreter is slow, so sizes stay small
except for a few single large-vocabulary rows.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from scipy import stats
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.reference import reference_row
from tests.sampling import DISTRIBUTION_DRAWS, REFERENCE_EXAMPLES, sampling_cases
from triton_sampling_mask.sampling import fused, rng
from triton_sampling_mask.sampling.sampler import SamplingBatch, plan_rows

pytestmark = pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed")

DEVICE = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
TOLERANCE = 1e-5  # the fused path computes in float32


def run_fused(
    logits, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, seed=0, want_mask=True, mask_width=64, dtype=torch.float32
) -> dict[str, np.ndarray]:
    """Sample rows of `logits` [B, V] with the fused path; scalar parameters broadcast over rows."""
    logits = np.asarray(logits, dtype=np.float32)
    rows, vocab = logits.shape
    params = pack(np.broadcast_to(np.float32(temperature), (rows,)), top_k, top_p, min_p, seed, want_mask, vocab)
    k_max = int(params[:, fused.PARAM_K_EFF].max())
    packed = fused.sample_packed(
        torch.from_numpy(logits).to(DEVICE, dtype), torch.from_numpy(params), k_max, mask_width
    )
    assert packed.dtype == torch.int32 and packed.shape == (rows, fused.PACKED_COLUMNS + 2 * mask_width)
    return fused.unpack(packed.cpu().numpy())


def pack(temperature, top_k, top_p, min_p, seed, want_mask, vocab: int) -> np.ndarray:
    """The kernels' parameters as the sampler packs them (from its plan) for rows given one array or
    scalar per parameter; scalars broadcast over the rows `temperature` counts."""
    rows = np.size(temperature)
    arrays = (
        np.broadcast_to(np.asarray(value), (rows,)) for value in (temperature, top_k, top_p, min_p, seed, want_mask)
    )
    plan = plan_rows(SamplingBatch.from_arrays(torch.empty(rows, vocab, device="meta"), *arrays))
    return fused.pack_params(plan.params, plan.k_eff)


def check_row(out, row, logits, temperature, top_k, top_p, min_p, want_mask, mask_width) -> None:
    """One row of `run_fused`'s output against reference_row: mask, token, both log-probs."""
    ref = reference_row(logits, temperature, top_k, top_p, min_p, tolerance=TOLERANCE)
    shortest, longest = ref.support_min, ref.support_max
    token = int(out["output_ids"][row])
    rank = int(np.flatnonzero(ref.order == token)[0])
    assert rank < longest, f"row {row}: token {token} (rank {rank}) is outside the support (<= {longest})"
    expected = ref.logprobs[token]
    assert abs(out["output_logprobs"][row] - expected) <= TOLERANCE * max(1.0, abs(expected)), (
        row,
        out["output_logprobs"][row],
        expected,
    )

    mask_len, mask_ids = int(out["sampling_mask_len"][row]), out["sampling_mask"][row]
    support_logprobs = out["sampling_mask_logprobs"][row]
    if not want_mask:
        assert mask_len == 0 and (mask_ids == -1).all() and out["sampling_logprobs"][row] == 0.0
        assert np.isneginf(support_logprobs).all()
        return
    assert min(shortest, mask_width) <= mask_len <= min(longest, mask_width), (row, mask_len, shortest, longest)
    np.testing.assert_array_equal(mask_ids[:mask_len], ref.order[:mask_len], err_msg=f"row {row}")
    assert (mask_ids[mask_len:] == -1).all()
    # The support length: the mask's unless the mask was cut at W (then any allowed length past W).
    lengths = [mask_len] if mask_len < mask_width else range(max(shortest, mask_width), longest + 1)
    assert rank < max(lengths)
    errors = [abs(out["sampling_logprobs"][row] - ref.renormalised_logprob(token, n)) for n in lengths if rank < n]
    assert min(errors) <= TOLERANCE, (row, out["sampling_logprobs"][row], errors)
    # Per-support log-probs: each mask id's, renormalised over the same support; -inf padding.
    assert np.isneginf(support_logprobs[mask_len:]).all()
    support_length = [n for n in lengths if rank < n][int(np.argmin(errors))]
    expected = [ref.renormalised_logprob(int(i), support_length) for i in mask_ids[:mask_len]]
    np.testing.assert_allclose(support_logprobs[:mask_len], expected, atol=TOLERANCE, rtol=0, err_msg=f"row {row}")
    if rank < mask_len:  # the sampled token's entry is sampling_logprobs itself
        assert support_logprobs[rank] == out["sampling_logprobs"][row]


def check_batch(logits, mask_width=64, dtype=torch.float32, **params) -> dict[str, np.ndarray]:
    """Run a batch and check every row; `params` are scalars or per-row arrays."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = logits.shape[0]
    out = run_fused(logits, mask_width=mask_width, dtype=dtype, **params)
    defaults = dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, want_mask=True)
    per_row = {name: np.broadcast_to(np.asarray(params.get(name, value)), (rows,)) for name, value in defaults.items()}
    for row in range(rows):
        check_row(
            out,
            row,
            logits[row],
            float(per_row["temperature"][row]),
            int(per_row["top_k"][row]),
            float(per_row["top_p"][row]),
            float(per_row["min_p"][row]),
            bool(per_row["want_mask"][row]),
            mask_width,
        )
    return out


def make_logits(kind: str, rows: int, vocab: int, rng_: np.random.Generator) -> np.ndarray:
    """Logit rows of one shape class, as float32 (bf16/fp16 kinds already rounded to that dtype)."""
    if kind == "integer":  # few distinct values: ties everywhere
        return np.round(rng_.standard_normal((rows, vocab)) * 2).astype(np.float32)
    if kind in ("bf16", "fp16"):
        dtype = torch.bfloat16 if kind == "bf16" else torch.float16
        return torch.from_numpy(rng_.standard_normal((rows, vocab)) * 3).to(dtype).float().numpy()
    if kind == "long_run":  # a run of equal logits far longer than the margin fetched past k
        logits = rng_.standard_normal((rows, vocab)).astype(np.float32) - 10
        logits[:, rng_.permutation(vocab)[: vocab // 2]] = 0.0
        logits[:, rng_.permutation(vocab)[:5]] = 1.0
        return logits
    if kind == "all_equal":
        return np.zeros((rows, vocab), np.float32)
    logits = (rng_.standard_normal((rows, vocab)) * 3).astype(np.float32)
    if kind == "neg_inf":
        logits[rng_.random((rows, vocab)) < 0.3] = -np.inf
        logits[:, 7] = -np.inf
    return logits


# Per-row parameters (temperature, top_k, top_p, min_p, want_mask) covering each rule.
ROW_PARAMS = [
    (1.0, 50, 1.0, 0.0, True),
    (0.7, 20, 0.9, 0.0, True),
    (1.3, 64, 0.5, 0.05, True),
    (0.0, 50, 0.9, 0.0, True),  # greedy: top_k 1 at temperature 1
    (1.0, 1, 1.0, 0.0, True),
    (1.0, 100, 1.0, 0.0, True),  # more than W = 64: the mask is cut at W
    (0.9, 30, 0.95, 0.1, False),
    (2.0, 200, 0.999, 0.0, True),
]


def params_of(rows: int) -> dict[str, np.ndarray]:
    table = np.array([ROW_PARAMS[row % len(ROW_PARAMS)] for row in range(rows)], dtype=object)
    return dict(
        temperature=table[:, 0].astype(np.float32),
        top_k=table[:, 1].astype(np.int64),
        top_p=table[:, 2].astype(np.float32),
        min_p=table[:, 3].astype(np.float32),
        want_mask=table[:, 4].astype(bool),
        seed=np.arange(rows, dtype=np.int64) * 7919 - 3,
    )


@pytest.mark.parametrize("kind", ["random", "integer", "bf16", "fp16", "long_run", "all_equal", "neg_inf"])
def test_rows_match_the_float64_reference(kind):
    rows, vocab = len(ROW_PARAMS), 1000  # V not a power of two
    logits = make_logits(kind, rows, vocab, np.random.default_rng(len(kind)))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind, torch.float32)
    check_batch(logits, mask_width=64, dtype=dtype, **params_of(rows))


def test_batch_of_one_and_batch_of_64():
    generator = np.random.default_rng(1)
    check_batch(make_logits("random", 1, 777, generator), top_k=40, top_p=0.9, temperature=0.8, seed=5)
    logits = np.concatenate(
        [make_logits(kind, 16, 1000, generator) for kind in ("random", "integer", "bf16", "neg_inf")]
    )
    check_batch(logits, mask_width=64, **params_of(64))


@pytest.mark.parametrize("vocab, top_k, rows", [(32000, 1024, 2), (151936, 1024, 1), (151936, 40, 2), (262144, 8, 1)])
def test_large_vocabularies(vocab, top_k, rows):
    generator = np.random.default_rng(vocab + top_k)
    logits = make_logits("bf16", rows, vocab, generator)
    logits[:, generator.permutation(vocab)[:3]] = -np.inf
    check_batch(
        logits,
        mask_width=1024,
        dtype=torch.bfloat16,
        top_k=top_k,
        top_p=np.array([1.0, 0.8][:rows], np.float32),
        temperature=0.9,
        seed=np.arange(rows),
    )


def test_top_k_above_the_vocabulary_and_whole_vocabulary():
    generator = np.random.default_rng(3)
    logits = make_logits("integer", 4, 40, generator)
    out = check_batch(logits, mask_width=64, top_k=np.array([100, -1, 41, 40]), top_p=1.0)
    assert (out["sampling_mask_len"] == 40).all()  # every id, in the total order
    check_batch(make_logits("random", 3, 1, generator), top_k=np.array([1, 5, -1]))  # V = 1


def test_mask_narrower_than_top_k_is_cut_at_w():
    logits = make_logits("random", 3, 500, np.random.default_rng(4))
    out = check_batch(logits, mask_width=16, top_k=np.array([100, 16, 5]))
    assert list(out["sampling_mask_len"]) == [16, 16, 5]
    check_batch(logits, mask_width=1, top_k=np.array([100, 16, 5]))


def worst_case_ties_topk(logits, k, dim=-1, largest=True, sorted=True):
    """torch.topk as an adversarial device might answer: the HIGHEST ids first among equal values."""
    values = logits.float().cpu().numpy().astype(np.float64)
    order = np.stack([np.lexsort((-np.arange(row.size), -row))[:k] for row in values])
    ids = torch.from_numpy(order).to(logits.device)
    return logits.gather(1, ids), ids


@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("kind", ["long_run", "all_equal", "integer", "bf16"])
def test_boundary_ties_take_the_lowest_ids(monkeypatch, kind, adversarial):
    vocab = 3000
    logits = make_logits(kind, 4, vocab, np.random.default_rng(11))
    top_k = np.array([1, 7, 50, 512])
    expected = [np.lexsort((np.arange(vocab), -row.astype(np.float64)))[:k] for row, k in zip(logits, top_k)]
    if adversarial:
        monkeypatch.setattr(torch, "topk", worst_case_ties_topk)
        if kind in ("long_run", "all_equal"):  # the repair is what fixes these rows
            _, fetched = worst_case_ties_topk(torch.from_numpy(logits), fused.candidate_count(512, vocab))
            assert any(not set(e) <= set(f.tolist()) for e, f in zip(expected, fetched.numpy()))
    out = check_batch(logits, mask_width=512, top_k=top_k, top_p=1.0, seed=np.arange(4))
    for row, ids in enumerate(expected):
        np.testing.assert_array_equal(out["sampling_mask"][row, : len(ids)], ids)


SEEDS = np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -0x0123456789ABCDEF, 42], dtype=np.int64)


def test_kernel_noise_is_rng_bit_for_bit():
    generator = np.random.default_rng(5)
    ids = np.concatenate([np.arange(64), generator.integers(0, 262144, 448), [262143, 2**31 - 1]])
    token_ids = torch.from_numpy(np.broadcast_to(ids, (len(SEEDS), ids.size)).copy()).to(DEVICE)
    uniforms, noise = fused.debug_noise(torch.from_numpy(SEEDS).to(DEVICE), token_ids)
    state = rng.seed_state(torch.from_numpy(SEEDS).to(DEVICE)).unsqueeze(1)
    expected_uniforms = rng.uniform(state, token_ids)
    assert torch.equal(uniforms, expected_uniforms)  # the 64-bit hash, bit for bit
    expected_noise = rng.gumbel(state, token_ids)
    if DEVICE.type == "cuda":  # libdevice logf on both sides
        assert torch.equal(noise, expected_noise)
    else:
        # The interpreter's log is numpy's, torch's CPU log is Sleef's: they differ by an ulp on
        # some inputs. The formula is checked bit for bit against numpy, the values against torch
        # (an ulp of either log moves the noise by ~1e-7 at most).
        u = expected_uniforms.cpu().numpy()
        np.testing.assert_array_equal(noise.numpy(), -np.log(-np.log(u)))
        np.testing.assert_allclose(noise.numpy(), expected_noise.numpy(), rtol=0, atol=1e-6)


def test_draws_are_the_gumbel_argmax_of_rng_noise():
    # All logits equal and no truncation: every score is 0 + noise, so the token is the argmax of
    # the seed's noise over the ids (lowest id on ties).
    vocab = 64
    out = run_fused(np.zeros((len(SEEDS), vocab)), top_k=vocab, seed=SEEDS, mask_width=vocab)
    noise = rng.gumbel(
        rng.seed_state(torch.from_numpy(SEEDS)).unsqueeze(1), torch.arange(vocab).expand(len(SEEDS), vocab)
    )
    np.testing.assert_array_equal(out["output_ids"], noise.argmax(dim=1).numpy())
    assert (out["sampling_mask_len"] == vocab).all()
    np.testing.assert_allclose(out["sampling_logprobs"], -np.log(vocab), atol=TOLERANCE)


def test_seeded_rows_ignore_their_batch_and_the_mask_flag():
    generator = np.random.default_rng(6)
    target = make_logits("bf16", 1, 1000, generator)
    params = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, seed=-123456789)
    alone = run_fused(target, want_mask=True, **params)
    again = run_fused(target, want_mask=True, **params)
    no_mask = run_fused(target, want_mask=False, **params)
    for name in ("output_ids", "output_logprobs", "sampling_mask_len", "sampling_logprobs", "sampling_mask"):
        np.testing.assert_array_equal(again[name], alone[name])
    np.testing.assert_array_equal(no_mask["output_ids"], alone["output_ids"])
    np.testing.assert_array_equal(no_mask["output_logprobs"], alone["output_logprobs"])

    # Inside 64 other random rows whose top_k reach 300 (a larger candidate block), at row 37.
    rows, position = 65, 37
    logits = make_logits("random", rows, 1000, generator)
    logits[position] = target[0]
    batch = {name: generator.permutation(np.resize(values, rows)) for name, values in params_of(rows).items()}
    batch["top_k"][batch["top_k"] == 200] = 300
    for name, value in params.items():
        batch[name][position] = value
    batch["want_mask"][position] = True
    inside = run_fused(logits, **batch)
    for name in ("output_ids", "output_logprobs", "sampling_mask_len", "sampling_logprobs", "sampling_mask"):
        np.testing.assert_array_equal(inside[name][position], alone[name][0])
    different_seed = run_fused(
        np.repeat(target, 8, 0), seed=np.arange(8), **{k: v for k, v in params.items() if k != "seed"}
    )
    assert len(set(different_seed["output_ids"].tolist())) > 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter, on the invalid rows
def test_row_max_semantics_and_invalid_rows_do_not_leak():
    generator = np.random.default_rng(7)
    logits = make_logits("random", 7, 300, generator)
    logits[1, 5] = np.nan
    logits[2, 9] = np.inf
    logits[3, :] = -np.inf
    logits[4, 3], logits[4, 4] = np.nan, np.inf
    logits[5, ::2] = -np.inf
    logits[6, :] = 0.0
    logits[6, 17] = np.inf  # +inf inside a run of ties at the boundary
    out = run_fused(logits, top_k=20, top_p=0.9, seed=np.arange(7))
    row_max = out["row_max"]
    assert np.isnan(row_max[1]) and np.isnan(row_max[4])
    assert row_max[2] == np.inf and row_max[6] == np.inf and row_max[3] == -np.inf
    np.testing.assert_array_equal(row_max[[0, 5]], np.nanmax(logits[[0, 5]], axis=1))
    for row in (0, 5):
        check_row(out, row, logits[row], 1.0, 20, 0.9, 0.0, True, 64)
        alone = run_fused(logits[row : row + 1], top_k=20, top_p=0.9, seed=row)
        assert alone["output_ids"][0] == out["output_ids"][row]
        np.testing.assert_array_equal(alone["sampling_mask"][0], out["sampling_mask"][row])


# the kernels take rows with a finite top_k only, at the mask widths a model may declare
FUSED_CASES = dict(max_rows=4, unbounded_top_k=False, mask_widths=(1, 5, 16, 96))


_PROPERTY_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=25, **_PROPERTY_SETTINGS)
@given(sampling_cases(**FUSED_CASES))
def test_property_random_batches_match_the_reference(case):
    check_batch(**case)


@pytest.mark.slow
@settings(max_examples=REFERENCE_EXAMPLES, **_PROPERTY_SETTINGS)
@given(sampling_cases(**FUSED_CASES))
def test_property_random_batches_match_the_reference_full_budget(case):
    check_batch(**case)


def check_draws(draws: int) -> None:
    """Seeded draws of one row follow the renormalised distribution over its support (chi-square)."""
    logits = np.array([[2.0, 1.5, 1.5, 1.0, 0.3, 0.0, -0.5, -3.0]], np.float32)
    temperature, top_k, top_p, min_p = 0.9, 7, 0.95, 0.15
    ref = reference_row(logits[0], temperature, top_k, top_p, min_p, tolerance=TOLERANCE)
    support = ref.support
    # top_p alone would keep 6 of the 7, min_p keeps 5.
    assert len(reference_row(logits[0], temperature, top_k, top_p, 0.0).support) == 6 and len(support) == 5
    out = run_fused(np.repeat(logits, draws, 0), temperature, top_k, top_p, min_p, seed=np.arange(draws) * 1000003 + 11)
    assert set(out["output_ids"].tolist()) <= set(support.tolist())
    probs = np.exp(ref.logprobs[support] - np.logaddexp.reduce(ref.logprobs[support]))
    counts = np.array([(out["output_ids"] == token).sum() for token in support])
    _, p_value = stats.chisquare(counts, probs * draws)
    assert p_value > 1e-4, (counts, probs * draws)


def test_draws_follow_the_renormalised_distribution():
    check_draws(240)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the interpreter runs one program per draw
def test_draws_follow_the_renormalised_distribution_full_budget():
    check_draws(DISTRIBUTION_DRAWS)


class _Paused:
    """Set while a kernel launch runs: the interpreter's own torch calls are not the wrapper's."""

    active = False


_HOST_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


def _targets_cpu(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)


class _FailOnHostSync(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _Paused.active:
            assert func not in _HOST_SYNCS, f"host synchronisation: {func.__name__}"
            assert not (func is torch.Tensor.to and _targets_cpu(args, kwargs)), "host synchronisation: .to('cpu')"
        return func(*args, **kwargs)


class _CountAtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _Paused.active:
            self.ops.append(str(func))
            for leaf in tree_leaves(out):
                assert not (isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64), f"float64 from {func}"
        return out


@pytest.fixture
def counted_launches(monkeypatch):
    """fused._launch, paused for the modes while the kernel (and the interpreter) runs."""
    launch = fused._launch

    def paused_launch(*args, **kwargs):
        _Paused.active = True
        try:
            launch(*args, **kwargs)
        finally:
            _Paused.active = False

    monkeypatch.setattr(fused, "_launch", paused_launch)


@pytest.mark.parametrize("rows", [1, 64])
def test_no_host_sync_no_float64_and_at_most_six_ops(counted_launches, rows):
    generator = np.random.default_rng(8)
    logits = torch.from_numpy(make_logits("long_run", rows, 1000, generator)).to(DEVICE)  # the repair runs too
    params = pack(np.full(rows, 0.8, np.float32), 7, 0.9, 0.05, np.arange(rows), True, 1000)
    params = torch.from_numpy(params)
    if DEVICE.type == "cuda":
        params = params.pin_memory()
    launches = fused.LAUNCHES
    with _FailOnHostSync(), _CountAtenOps() as counter:
        packed = fused.sample_packed(logits, params, 7, 64)
    launches = fused.LAUNCHES - launches
    assert launches == 2
    assert len(counter.ops) + launches <= 6, counter.ops
    out = fused.unpack(packed.cpu().numpy())
    for row in range(rows):
        check_row(out, row, logits[row].cpu().numpy(), 0.8, 7, 0.9, 0.05, True, 64)


def test_the_sync_and_float64_checks_can_fail():
    tensor = torch.ones(3)
    with pytest.raises(AssertionError, match="host synchronisation"), _FailOnHostSync():
        tensor.sum().item()
    with pytest.raises(AssertionError, match="host synchronisation"), _FailOnHostSync():
        tensor.to("cpu")
    with pytest.raises(AssertionError, match="float64"), _CountAtenOps():
        tensor.to(torch.float64)


def test_pack_params_conventions():
    params = pack(
        np.array([0.0, 0.5, 1.0], np.float32),
        np.array([7, -1, 5000]),
        np.float32(0.9),
        np.float32(0.1),
        np.array([1, 2, 3], np.uint64) << np.uint64(62),
        np.array([True, False, True]),
        1000,
    )
    assert params.dtype == np.int64 and params.shape == (3, fused.PARAM_COLUMNS)
    temperature = params[:, fused.PARAM_TEMPERATURE].astype(np.int32).view(np.float32)
    np.testing.assert_array_equal(temperature, [1.0, 0.5, 1.0])  # greedy: temperature 1 ...
    np.testing.assert_array_equal(params[:, fused.PARAM_K_EFF], [1, 1000, 1000])  # ... top_k 1; -1 and > V: V
    assert params[:, fused.PARAM_TOP_P].astype(np.int32).view(np.float32)[0] == np.float32(0.9)
    np.testing.assert_array_equal(
        params[:, fused.PARAM_SEED], (np.array([1, 2, 3], np.uint64) << np.uint64(62)).view(np.int64)
    )
    np.testing.assert_array_equal(params[:, fused.PARAM_WANT_MASK], [1, 0, 1])
    assert fused.candidate_count(1024, 262144) == 1024 + 16 + 256
    assert fused.candidate_count(50, 60) == 60 and fused.candidate_count(5, 3) == 3


NO_TRITON_PROBE = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")

sys.meta_path.insert(0, Block())
import numpy as np, torch
from triton_sampling_mask.sampling import fused
from triton_sampling_mask.sampling.params import RowParams
assert not fused.AVAILABLE
params = fused.pack_params(RowParams.defaults(2), np.full(2, 5))
try:
    fused.sample_packed(torch.zeros(2, 100), torch.from_numpy(params), 5, 8)
except RuntimeError as error:
    print("refused:", error)
"""


def test_module_imports_without_triton():
    done = subprocess.run([sys.executable, "-c", NO_TRITON_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused: sampling.fused needs triton" in done.stdout, done.stderr[-2000:]
