"""Batches shaped as serving shapes them, against the float64 reference (tests/reference.py).

Dynamic batching stacks several requests into one sampler call: more rows than one row block of
the CPU normaliser and selection, each row with its own temperature, top_k, top_p, min_p, seed
and mask flag, at the vocabularies served (32,000 / 151,936 / 262,144). Also: half-precision
logits on every path give what their float32 values give, and the CPU epilogue's cut of a
support wider than W.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling import fused, normalisers, selection
from triton_sampling_mask.sampling.epilogues import epilogue_numpy
from triton_sampling_mask.sampling.params import RowParams, effective_top_k
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

from .reference import reference_row

TOLERANCE = 1e-6  # the reference's boundary band
LOGPROB_ATOL = 1e-4  # float32 sums over a whole vocabulary, against float64
MASK_WIDTH = 64


def rows_per_block(vocab: int) -> int:
    """Rows in one block of the CPU normaliser, and of the CPU selection: a batch with more rows
    than the larger of the two crosses both."""
    return max(normalisers._NORMALISER_BLOCK_ELEMENTS // vocab, selection.FULL_VOCAB_BLOCK_ELEMENTS // vocab)


def mixed_rows(rows: int, vocab: int, generator: np.random.Generator, large_k: bool) -> dict[str, np.ndarray]:
    """Per-row parameters drawn independently, as several requests would bring them; `large_k`
    adds rows past the small-k bound and whole-vocabulary rows (the sampler's other paths)."""
    temperature = generator.choice([0.0, 0.25, 0.6, 1.0, 1.7, 3.0], rows).astype(np.float32)
    top_k = generator.choice([1, 5, 40, MASK_WIDTH, 200, 1000], rows)
    if large_k:
        top_k = np.where(generator.random(rows) < 0.4, generator.choice([-1, 2000, vocab + 7], rows), top_k)
    top_p = np.where(generator.random(rows) < 0.5, 1.0, generator.uniform(0.3, 0.99, rows)).astype(np.float32)
    min_p = np.where(generator.random(rows) < 0.6, 0.0, generator.uniform(0.0, 0.2, rows)).astype(np.float32)
    return dict(
        temperature=temperature,
        top_k=top_k.astype(np.int64),
        top_p=top_p,
        min_p=min_p,
        seed=generator.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64),
        want_mask=generator.random(rows) < 0.6,
    )


def serving_logits(rows: int, vocab: int, generator: np.random.Generator) -> np.ndarray:
    """Peaked rows (a scale that differs row to row, so each temperature matters) with a few -inf."""
    scale = generator.uniform(1.0, 4.0, (rows, 1))
    logits = (generator.standard_normal((rows, vocab)) * scale).astype(np.float32)
    logits[:, generator.permutation(vocab)[:5]] = -np.inf
    return logits


def run(logits, params, device_path="cpu", dtype=torch.float32, fused_path=False) -> dict[str, np.ndarray]:
    batch = SamplingBatch.from_arrays(torch.from_numpy(logits).to(dtype), **params)
    return sample(batch, MASK_WIDTH, fused=fused_path, device_path=device_path).host()


def check_rows(out: dict[str, np.ndarray], logits: np.ndarray, params: dict[str, np.ndarray]) -> None:
    """Every row: token inside the reference support, log-probs as the reference's, mask the
    reference's first ids (cut at W) and renormalised over the whole support."""
    for row in range(logits.shape[0]):
        ref = reference_row(
            logits[row],
            float(params["temperature"][row]),
            int(params["top_k"][row]),
            float(params["top_p"][row]),
            float(params["min_p"][row]),
            tolerance=TOLERANCE,
        )
        token = int(out["output_ids"][row])
        rank = int(np.flatnonzero(ref.order == token)[0])
        assert rank < ref.support_max, f"row {row}: token of rank {rank} outside the support ({ref.support_max})"
        assert out["output_logprobs"][row] == pytest.approx(ref.logprobs[token], abs=LOGPROB_ATOL), row
        length = int(out["sampling_mask_len"][row])
        if not params["want_mask"][row]:
            assert length == 0 and out["sampling_logprobs"][row] == 0.0, row
            continue
        assert min(ref.support_min, MASK_WIDTH) <= length <= min(ref.support_max, MASK_WIDTH), row
        np.testing.assert_array_equal(out["sampling_mask"][row, :length], ref.order[:length], err_msg=f"row {row}")
        # Renormalised over the whole support, not its first W ids.
        supports = [n for n in range(ref.support_min, ref.support_max + 1) if rank < n]
        errors = [abs(out["sampling_logprobs"][row] - ref.renormalised_logprob(token, n)) for n in supports]
        assert min(errors) <= LOGPROB_ATOL, (row, errors)
        n = supports[int(np.argmin(errors))]
        expected = [ref.renormalised_logprob(int(i), n) for i in out["sampling_mask"][row, :length]]
        np.testing.assert_allclose(out["sampling_mask_logprobs"][row, :length], expected, atol=LOGPROB_ATOL, rtol=0)


def check_alone(out, logits, params, rows, device_path="cpu") -> None:
    """Rows sampled alone give the token and mask they got inside the batch."""
    for row in rows:
        alone = run(logits[row : row + 1], {k: v[row : row + 1] for k, v in params.items()}, device_path)
        assert alone["output_ids"][0] == out["output_ids"][row], f"row {row}'s token depends on its batch"
        np.testing.assert_array_equal(alone["sampling_mask"][0], out["sampling_mask"][row])
        assert alone["output_logprobs"][0] == pytest.approx(out["output_logprobs"][row], abs=1e-6)


def multi_block_case(vocab: int, large_k: bool, seed: int, extra_rows: int = 2):
    generator = np.random.default_rng(seed)
    rows = rows_per_block(vocab) + extra_rows
    return serving_logits(rows, vocab, generator), mixed_rows(rows, vocab, generator, large_k)


@pytest.mark.parametrize(
    "device_path, large_k", [("cpu", False), ("cpu", True), ("gpu", True)], ids=["cpu-small-k", "cpu", "gpu"]
)
def test_a_multi_block_batch_of_mixed_requests_at_32000(device_path, large_k):
    logits, params = multi_block_case(32000, large_k, seed=3 + large_k)
    assert logits.shape[0] > normalisers._NORMALISER_BLOCK_ELEMENTS // 32000
    out = run(logits, params, device_path)
    check_rows(out, logits, params)
    check_alone(out, logits, params, rows=[0, logits.shape[0] - 1], device_path=device_path)


@pytest.mark.parametrize("vocab, large_k", [(151936, True), (262144, False)])
def test_a_multi_block_batch_of_mixed_requests_at_large_vocabularies(vocab, large_k):
    logits, params = multi_block_case(vocab, large_k, seed=vocab, extra_rows=1)
    out = run(logits, params)
    check_rows(out, logits, params)
    check_alone(out, logits, params, rows=[logits.shape[0] - 1])


def test_each_normaliser_block_takes_its_own_rows_temperatures():
    """The CPU normaliser's blocks against float64, rows of one logit vector at many temperatures."""
    vocab = 32000
    block = normalisers._NORMALISER_BLOCK_ELEMENTS // vocab
    rows = 2 * block + 3
    generator = np.random.default_rng(8)
    logits = np.repeat((generator.standard_normal((1, vocab)) * 3).astype(np.float32), rows, axis=0)
    temperature = generator.uniform(0.2, 3.0, rows).astype(np.float32)
    row_max = logits.max(axis=1)
    z = normalisers.normaliser_cpu(torch.from_numpy(logits), row_max, temperature)
    shifted = logits.astype(np.float64) - row_max[:, None]
    expected = np.exp(shifted / temperature.astype(np.float64)[:, None]).sum(axis=1)
    np.testing.assert_allclose(z, expected, rtol=1e-5)


# Half precision: the values as sent rank the tokens, probabilities are computed in float32 or
# better. A half-precision exp-sum rounds z to 8 (bf16) or 11 (fp16) bits: log-probs off by ~1e-3.
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
HALF_ATOL = 2e-6  # float32 rounding between paths that compute alike; far below a half-precision sum's error


def half_case(dtype, rows: int, vocab: int, seed: int):
    generator = np.random.default_rng(seed)
    logits = torch.from_numpy(serving_logits(rows, vocab, generator)).to(dtype).float().numpy()  # exactly representable
    params = mixed_rows(rows, vocab, generator, large_k=False)
    params["top_k"] = np.minimum(params["top_k"], 200)
    params["temperature"] = np.where(params["temperature"] == 0, np.float32(0.8), params["temperature"])
    return logits, params


def check_half_matches_float32(half, single, logits, params) -> None:
    np.testing.assert_array_equal(half["output_ids"], single["output_ids"])
    np.testing.assert_array_equal(half["sampling_mask"], single["sampling_mask"])
    for name in ("output_logprobs", "sampling_logprobs", "sampling_mask_logprobs"):
        np.testing.assert_allclose(half[name], single[name], atol=HALF_ATOL, rtol=0, err_msg=name)
    check_rows(half, logits, params)


@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_logits_sample_as_their_float32_values(dtype, device_path):
    logits, params = half_case(dtype, rows=6, vocab=5000, seed=21)
    half = run(logits, params, device_path, dtype)
    single = run(logits, params, device_path, torch.float32)
    check_half_matches_float32(half, single, logits, params)


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_logits_in_the_whole_vocabulary_rows_as_their_float32_values(dtype):
    # top_k -1 with top_p < 1 and top_k above the small-k bound: the rows ranked apart.
    logits, params = half_case(dtype, rows=3, vocab=5000, seed=22)
    params["top_k"] = np.array([-1, 2000, -1])
    params["top_p"] = np.array([0.9, 1.0, 1.0], np.float32)
    params["want_mask"] = np.array([False, True, False])
    for device_path in ("cpu", "gpu"):
        half = run(logits, params, device_path, dtype)
        single = run(logits, params, device_path, torch.float32)
        check_half_matches_float32(half, single, logits, params)


@pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed")
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_logits_in_the_fused_kernels_as_their_float32_values(dtype):
    logits, params = half_case(dtype, rows=3, vocab=700, seed=23)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU under TRITON_INTERPRET=1 (conftest.py)

    def fused_run(as_dtype):
        batch = SamplingBatch.from_arrays(torch.from_numpy(logits).to(device, as_dtype), **params)
        return sample(batch, MASK_WIDTH, fused=True).host()

    check_half_matches_float32(fused_run(dtype), fused_run(torch.float32), logits, params)


@pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed or too old")
def test_a_mixed_batch_sends_only_its_small_k_rows_through_the_fused_kernels(monkeypatch):
    generator = np.random.default_rng(24)
    vocab = 1500
    logits = serving_logits(5, vocab, generator)
    params = mixed_rows(5, vocab, generator, large_k=False)
    params["top_k"] = np.array([5, -1, MASK_WIDTH, 1100, 40])  # rows 1 and 3 take the torch ops
    params["top_p"][1] = np.float32(0.9)
    params["want_mask"] = np.array([True, False, True, False, False])
    calls = []
    sample_packed = fused.sample_packed
    monkeypatch.setattr(fused, "sample_packed", lambda lg, *a: calls.append(lg.shape[0]) or sample_packed(lg, *a))
    batch = SamplingBatch.from_arrays(torch.from_numpy(logits), **params)
    out = sample(batch, MASK_WIDTH, fused=True).host()
    assert calls == [3]
    check_rows(out, logits, params)


@pytest.mark.parametrize("beside_a_top_p_row", [False, True], ids=["alone", "beside-top-p"])
@pytest.mark.parametrize("device_path", ["cpu", "gpu"])
def test_top_p_one_keeps_a_negligible_tail_token_whatever_the_float32_normaliser_rounds(
    device_path, beside_a_top_p_row
):
    # 999 near-equal logits and one e**-30 below them: the float32 normaliser may round below the
    # float64 mass before the tail token. top_p = 1 turns the rule off in its rows, so the token
    # stays, also when a last row of top_p 0.5 makes the batch apply the rule.
    generator = np.random.default_rng(41)
    rows, vocab = 16 + beside_a_top_p_row, 1000
    logits = (generator.standard_normal((rows, vocab)) * 0.01).astype(np.float32)
    logits[:, -1] = -30.0
    top_p = np.ones(rows, np.float32)
    if beside_a_top_p_row:
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
    plain = 16
    assert (out["sampling_mask_len"][:plain] == vocab).all(), out["sampling_mask_len"]
    if beside_a_top_p_row:  # the top_p row's reference: the smallest prefix whose mass before its
        # last token stays within half of the float64 total
        row = logits[-1].astype(np.float64)
        p = np.sort(np.exp(row - row.max()))[::-1]
        before = np.cumsum(p) - p
        assert abs(int(out["sampling_mask_len"][-1]) - int((before <= 0.5 * p.sum()).sum())) <= 1


def test_the_cpu_epilogue_cuts_a_support_wider_than_w():
    """epilogue_numpy called directly: a 200-id support, W = 16: the mask holds the first 16 ids,
    every log-prob renormalised over all 200."""
    vocab, width = 3000, 16
    generator = np.random.default_rng(31)
    logits = (generator.standard_normal((3, vocab)) * 0.5).astype(np.float32)  # flat: top_k decides
    temperature = np.array([1.0, 0.7, 2.0], np.float32)
    params = RowParams.defaults(3)
    params.temperature, params.top_k = temperature, np.array([200, 17, 16], np.int32)
    params.seed, params.has_seed = np.array([1, 2, 3], np.uint64), np.ones(3, bool)
    params.return_sampling_mask = np.ones(3, bool)
    k_eff = effective_top_k(params, vocab)
    order = np.stack([np.lexsort((np.arange(vocab), -row.astype(np.float64))) for row in logits])
    ranked = np.take_along_axis(logits, order, 1)[:, :200]
    z = np.exp((logits.astype(np.float64) - ranked[:, :1]) / temperature[:, None]).sum(axis=1).astype(np.float32)
    out, support_len = epilogue_numpy(ranked, order[:, :200].copy(), z, params, k_eff, width)
    assert support_len.tolist() == [200, 17, 16]
    assert out["sampling_mask_len"].tolist() == [width] * 3
    np.testing.assert_array_equal(out["sampling_mask"], order[:, :width])
    for row, length in enumerate([200, 17, 16]):
        ref = reference_row(logits[row], float(temperature[row]), length)
        token = int(out["output_ids"][row])
        assert token in order[row, :length]
        expected = [ref.renormalised_logprob(int(i), length) for i in order[row, :width]]
        np.testing.assert_allclose(out["sampling_mask_logprobs"][row], expected, atol=1e-5, rtol=0)
        assert out["sampling_logprobs"][row] == pytest.approx(ref.renormalised_logprob(token, length), abs=1e-5)
        assert out["output_logprobs"][row] == pytest.approx(ref.logprobs[token], abs=1e-5)
