"""Off-policy corrections and sampling receipts against a float64 brute force over the whole
vocabulary (numpy, sharing no code with the client: dense [T, V] probabilities, finite-difference
gradients, a pure-Python SplitMix64 for the noise), on every mask format the converters produce."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from triton_sampling_mask.client.converters import to_prime_rl, to_sglang, to_vllm_csr
from triton_sampling_mask.client.corrections import (
    centered_policy_loss,
    centered_score_surrogate,
    log_ratios,
    ratio_diagnostics,
    server_kept_log_mass,
    support_divergences,
)
from triton_sampling_mask.client.receipts import SAMPLER_CALL, SamplingReceipts, rederive_tokens
from triton_sampling_mask.client.sampling_params import SamplingParams, rows_to_params
from triton_sampling_mask.client.support import FlatSupport, score_support
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

from .reference import reference_draw, reference_gumbel, reference_noise_seed, reference_row

FORMATS = ("padded", "csr", "prime-rl", "sglang")
WIDTH = 8


# ---------------------------------------------------------------- the brute force


def dense_reference(logits, temperature, mask, lengths, behaviour, tokens):
    """Every quantity per token over the whole vocabulary, float64: dict of [T] arrays."""
    out = {k: [] for k in ("log_ratio", "kept", "full_ratio", "kl_qp", "kl_pq", "entropy", "q_entropy")}
    for t in range(logits.shape[0]):
        tau = temperature[t] or 1.0
        scaled = logits[t] / tau
        log_p = scaled - np.logaddexp.reduce(scaled)  # the whole vocabulary
        ids = mask[t, : lengths[t]]
        in_s = np.zeros(logits.shape[1], bool)
        in_s[ids] = True
        kept = np.logaddexp.reduce(log_p[in_s])
        p_s = np.where(in_s, np.exp(log_p - kept), 0.0)
        q = np.zeros(logits.shape[1])
        q[ids] = np.exp(behaviour[t, : lengths[t]].astype(np.float64))
        q /= q.sum()
        y = tokens[t]
        log_q_y = behaviour[t, list(ids).index(y)]
        out["log_ratio"].append(np.log(p_s[y]) - log_q_y)
        out["kept"].append(kept)
        out["full_ratio"].append(log_p[y] - log_q_y)
        on = q > 0
        out["kl_qp"].append(np.sum(q[on] * np.log(q[on] / p_s[on])))
        on = p_s > 0
        out["kl_pq"].append(np.sum(p_s[on] * np.log(p_s[on] / q[on])))
        out["entropy"].append(-np.sum(p_s[on] * np.log(p_s[on])))
        out["q_entropy"].append(-np.sum(q[q > 0] * np.log(q[q > 0])))
    return {k: np.array(v) for k, v in out.items()}


def reference_surrogate(row_logits, tau, ids, q_ids, y):
    """log p_S(y) - sum_S q log p_S (q fixed) of one row, float64."""
    scaled = row_logits[ids] / tau
    log_p_s = scaled - np.logaddexp.reduce(scaled)
    return log_p_s[list(ids).index(y)] - np.sum(q_ids * log_p_s)


def numeric_gradient(function, x, step=1e-6):
    """Central differences of a scalar function of a float64 vector."""
    grad = np.zeros_like(x)
    for i in range(x.size):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        grad[i] = (function(up) - function(down)) / (2 * step)
    return grad


def random_rollout(seed, rows, vocab, temperature):
    """Trainer logits [T, V] float64, masks (padded, random order), the sampler's float32
    per-support log-probs from logits of its own (so q differs from p_S), sampled tokens."""
    gen = np.random.default_rng(seed)
    logits = gen.standard_normal((rows, vocab)) * 2
    sampler_logits = logits + gen.standard_normal((rows, vocab)) * 0.5
    mask = np.full((rows, WIDTH), -1, np.int64)
    behaviour = np.full((rows, WIDTH), -np.inf, np.float32)
    lengths = gen.integers(1, min(vocab, WIDTH) + 1, rows)
    tokens = np.zeros(rows, np.int64)
    for t, n in enumerate(lengths):
        ids = gen.permutation(vocab)[:n]
        mask[t, :n] = ids
        scaled = sampler_logits[t, ids] / (temperature or 1.0)
        behaviour[t, :n] = scaled - np.logaddexp.reduce(scaled)
        tokens[t] = ids[gen.integers(n)]
    return logits, mask, lengths, behaviour, tokens


def support_in(fmt, mask, lengths, behaviour) -> FlatSupport:
    """The masks through converter `fmt` and back into a FlatSupport."""
    if fmt == "padded":
        return FlatSupport.from_padded(mask, lengths, behaviour)
    if fmt == "csr":
        csr = to_vllm_csr(mask, lengths, behaviour)
        return FlatSupport.from_csr(csr["token_ids"], csr["offsets"], csr["logprobs"])
    if fmt == "prime-rl":
        flat = to_prime_rl(mask, lengths, behaviour)
        return FlatSupport.from_flat(flat["ids"], flat["counts"], flat["logprobs"])
    lists = to_sglang(mask, lengths, np.zeros(len(lengths)), behaviour)
    return FlatSupport.from_sglang(lists["output_token_sampling_mask"], lists["output_token_sampling_support_logprobs"])


def behaviour_at_tokens(mask, behaviour, tokens):
    return np.array([behaviour[t, list(mask[t]).index(y)] for t, y in enumerate(tokens)])


# ---------------------------------------------------------------- values


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 5),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    fmt=st.sampled_from(FORMATS),
)
def test_every_quantity_matches_the_full_vocabulary_brute_force(seed, rows, vocab, temperature, fmt):
    logits, mask, lengths, behaviour, tokens = random_rollout(seed, rows, vocab, temperature)
    want = dense_reference(logits, np.full(rows, temperature), mask, lengths, behaviour, tokens)
    sampling_logprobs = behaviour_at_tokens(mask, behaviour, tokens)
    scores = score_support(torch.from_numpy(logits), support_in(fmt, mask, lengths, behaviour), temperature)

    close = dict(rtol=0, atol=1e-9)
    np.testing.assert_allclose(log_ratios(scores, tokens, sampling_logprobs).numpy(), want["log_ratio"], **close)
    untouched = logits.copy()
    diagnostics = ratio_diagnostics(torch.from_numpy(logits), scores, tokens, sampling_logprobs)
    np.testing.assert_array_equal(logits, untouched)
    np.testing.assert_allclose(diagnostics.kept_log_mass.numpy(), want["kept"], **close)
    np.testing.assert_allclose(diagnostics.full_vocab_log_ratio.numpy(), want["full_ratio"], **close)
    divergences = support_divergences(scores)
    np.testing.assert_allclose(divergences.kl_behaviour_trainer.detach().numpy(), want["kl_qp"], **close)
    np.testing.assert_allclose(divergences.kl_trainer_behaviour.detach().numpy(), want["kl_pq"], **close)
    np.testing.assert_allclose(divergences.entropy.detach().numpy(), want["entropy"], **close)
    np.testing.assert_allclose(divergences.behaviour_entropy.numpy(), want["q_entropy"], **close)

    stats = diagnostics.statistics()
    kept_mass = np.exp(want["kept"])
    assert math.isclose(stats["kept_mass_mean"], kept_mass.mean(), abs_tol=1e-12)
    assert math.isclose(stats["truncation_bias"], 1 - kept_mass.mean(), abs_tol=1e-12)
    assert math.isclose(stats["full_vocab_ratio_max"], np.exp(want["full_ratio"]).max(), rel_tol=1e-9)
    assert math.isclose(stats["support_ratio_std"], np.exp(want["log_ratio"]).std(), abs_tol=1e-9)


def test_an_empty_batch_gives_empty_values_and_nan_statistics():
    """No tokens: every function of the kit answers for zero tokens, and the statistics keep their
    keys, each NaN (a mean of nothing) rather than raising."""
    logits = torch.zeros((0, 7), dtype=torch.float64)
    support = FlatSupport.from_flat(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    scores = score_support(logits, support, 1.0)
    tokens, sampling = np.zeros(0, np.int64), np.zeros(0)
    diagnostics = ratio_diagnostics(logits, scores, tokens, sampling)
    assert diagnostics.support_log_ratio.shape == diagnostics.kept_log_mass.shape == (0,)
    assert support_divergences(scores).entropy.shape == (0,)
    assert centered_policy_loss(scores, tokens, 1.0).shape == (0,)
    stats = diagnostics.statistics()
    one_token = ratio_diagnostics(
        torch.zeros((1, 7), dtype=torch.float64),
        score_support(torch.zeros((1, 7)), FlatSupport.from_sglang([[0]]), 1.0),
        [0],
        [0.0],
    ).statistics()
    assert stats.keys() == one_token.keys()
    assert all(math.isnan(value) for value in stats.values()), stats


def test_the_server_kept_mass_is_output_minus_sampling_logprobs():
    # p = [0.4, 0.3, 0.2, 0.1] with support {0, 1}: kept mass 0.7, for whichever token was drawn.
    log_p = np.log([0.4, 0.3, 0.2, 0.1])
    output_logprobs, sampling_logprobs = log_p[[0, 1]], log_p[[0, 1]] - np.log(0.7)
    np.testing.assert_allclose(server_kept_log_mass(output_logprobs, sampling_logprobs), np.log([0.7, 0.7]))


def test_the_full_vocabulary_ratio_averages_to_the_kept_mass_on_policy():
    """With the trainer's logits equal to the sampler's, E_q[p(y) / q(y)] = M: the bias a
    full-vocabulary ratio carries (TRL's ratio mean below 1 at top_p < 1)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64).repeat(5, 1)
    ids = [4, 0, 1]  # any order
    support = FlatSupport.from_sglang([ids] * 5)
    scores = score_support(logits, support, 1.0)
    q = torch.exp(scores.logprobs[:3])
    sampling = scores.logprobs.detach().view(5, 3)[:, [0, 1, 2, 0, 1]].diagonal()
    tokens = [4, 0, 1, 4, 0]
    diagnostics = ratio_diagnostics(logits, scores, tokens, sampling)
    assert torch.allclose(diagnostics.support_log_ratio, torch.zeros(5, dtype=torch.float64), atol=1e-12)
    full = torch.exp(diagnostics.full_vocab_log_ratio[:3])
    kept = float(np.exp(np.logaddexp.reduce(np.array([0.0, 2.0, 1.0])) - np.logaddexp.reduce([2, 1, 0.5, -1, 0])))
    assert math.isclose(float((q * full).sum()), kept, rel_tol=1e-12)


# ---------------------------------------------------------------- gradients


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 3),
    vocab=st.integers(2, 12),
    temperature=st.sampled_from([0.0, 0.5, 1.3]),
    importance=st.sampled_from(["none", "ratio", "clipped"]),
    fmt=st.sampled_from(FORMATS),
)
def test_gradients_match_finite_differences_of_the_brute_force(seed, rows, vocab, temperature, importance, fmt):
    logits, mask, lengths, behaviour, tokens = random_rollout(seed, rows, vocab, temperature)
    advantages = np.random.default_rng(seed + 1).standard_normal(rows)
    sampling_logprobs = behaviour_at_tokens(mask, behaviour, tokens)
    x = torch.from_numpy(logits).requires_grad_(True)
    scores = score_support(x, support_in(fmt, mask, lengths, behaviour), temperature)
    divergences = support_divergences(scores)
    loss = centered_policy_loss(scores, tokens, advantages, sampling_logprobs, importance, 0.1, 0.1)
    objectives = {
        "loss": loss.sum(),
        "kl_qp": divergences.kl_behaviour_trainer.sum(),
        "kl_pq": divergences.kl_trainer_behaviour.sum(),
        "entropy": divergences.entropy.sum(),
    }
    tau = temperature or 1.0
    want = dense_reference(logits, np.full(rows, temperature), mask, lengths, behaviour, tokens)
    for name, objective in objectives.items():
        (grad,) = torch.autograd.grad(objective, x, retain_graph=True)
        for t in range(rows):
            ids = mask[t, : lengths[t]]
            q_ids = np.exp(behaviour[t, : lengths[t]].astype(np.float64))
            q_ids /= q_ids.sum()

            def row_value(row, t=t, ids=ids, q_ids=q_ids, name=name):
                scaled = row[ids] / tau
                log_p_s = scaled - np.logaddexp.reduce(scaled)
                p_s = np.exp(log_p_s)
                if name == "kl_qp":
                    return np.sum(q_ids * (np.log(q_ids) - log_p_s))
                if name == "kl_pq":
                    return np.sum(p_s * (log_p_s - np.log(q_ids)))
                if name == "entropy":
                    return -np.sum(p_s * log_p_s)
                # the loss: -A w L, with w the ratio held at its value (0 where PPO's clip holds)
                ratio = np.exp(want["log_ratio"][t])
                weight = 1.0 if importance == "none" else ratio
                if importance == "clipped" and (
                    (advantages[t] > 0 and ratio > 1.1) or (advantages[t] < 0 and ratio < 0.9)
                ):
                    weight = 0.0
                return -advantages[t] * weight * reference_surrogate(row, tau, ids, q_ids, tokens[t])

            np.testing.assert_allclose(grad[t].numpy(), numeric_gradient(row_value, logits[t]), atol=1e-6)


def test_the_centred_score_is_onehot_minus_q_and_averages_to_zero_under_q():
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    q_ids = np.array([0.5, 0.3, 0.2])
    ids = [4, 0, 1]
    support = FlatSupport.from_sglang([ids], [np.log(q_ids).tolist()])
    gradients = []
    for y in ids:
        (grad,) = torch.autograd.grad(centered_score_surrogate(score_support(x, support, 0.5), [y]).sum(), x)
        want = np.zeros(5)
        want[ids] -= q_ids / 0.5
        want[y] += 1 / 0.5
        np.testing.assert_allclose(grad[0].numpy(), want, atol=1e-12)
        gradients.append(grad[0].numpy())
    np.testing.assert_allclose(q_ids @ np.array(gradients), np.zeros(5), atol=1e-12)


def test_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = np.array([[5, 2, 9, -1], [0, -1, -1, -1], [11, 3, 4, 7], [6, 1, -1, -1]])
    lengths = np.array([3, 1, 4, 2])
    behaviour = np.where(mask >= 0, np.log(np.array([0.5, 0.3, 0.15, 0.05])), -np.inf).astype(np.float32)
    tokens = np.array([2, 0, 7, 6])
    sampling = behaviour_at_tokens(mask, behaviour, tokens)
    advantages = np.array([1.0, -0.5, 2.0, -1.0])
    support = FlatSupport.from_padded(mask, lengths, behaviour)
    temperature = np.array([0.7, 1.0, 1.3, 0.0])

    def functions(x):
        scores = score_support(x, support, temperature)
        divergences = support_divergences(scores)
        return (
            log_ratios(scores, tokens, sampling),
            divergences.kl_behaviour_trainer,
            divergences.kl_trainer_behaviour,
            divergences.entropy,
            centered_score_surrogate(scores, tokens),
            # The ratio-weighted losses hold their weight constant on purpose, so their gradient
            # is not their value's derivative: finite differences check them above.
            centered_policy_loss(scores, tokens, advantages),
        )

    assert torch.autograd.gradcheck(functions, (logits,))
    # Ids outside the masks are never read: exactly zero gradient there.
    sum(value.sum() for value in functions(logits)).backward()
    inside = torch.zeros_like(logits, dtype=torch.bool)
    for row, n in enumerate(lengths):
        inside[row, mask[row, :n]] = True
    assert (logits.grad[~inside] == 0).all() and (logits.grad[inside] != 0).any()


def test_bad_inputs_name_what_is_wrong():
    logits = torch.zeros(2, 8)
    support = FlatSupport.from_sglang([[1, 2], [3]])
    with pytest.raises(ValueError, match="T must agree"):
        score_support(torch.zeros(3, 8), support, 1.0)
    scores = score_support(logits, support, 1.0)
    with pytest.raises(ValueError, match="sampling_mask_logprobs"):
        support_divergences(scores)
    with pytest.raises(ValueError, match="in its row's mask"):
        log_ratios(scores, [1, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="importance must be one of"):
        centered_policy_loss(scores, [1, 3], 1.0, importance="ppo")
    with pytest.raises(ValueError, match="advantages"):
        centered_policy_loss(scores, [1, 3], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="needs sampling_logprobs"):
        centered_policy_loss(scores, [1, 3], 1.0, importance="ratio")
    with pytest.raises(ValueError, match="counts must be"):
        FlatSupport.from_flat([1, 2], [3])
    with pytest.raises(ValueError, match=r"params\[1\] has no seed"):
        SamplingReceipts.for_sampler([SamplingParams(seed=1), SamplingParams()])


# ---------------------------------------------------------------- receipts


def reference_draw_of(row_logits, params: SamplingParams, noise_seed: int) -> int | None:
    return reference_draw(row_logits, params.temperature, params.top_k, params.top_p, params.min_p, noise_seed)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    requests=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 0.6, 1.0, 1.5]),
    top_k=st.sampled_from([-1, 1, 5, 40]),
    top_p=st.sampled_from([0.7, 1.0]),
    min_p=st.sampled_from([0.0, 0.1]),
)
def test_receipts_rederive_the_brute_force_draw(seed, requests, temperature, top_k, top_p, min_p):
    gen = np.random.default_rng(seed)
    lengths = gen.integers(1, 5, requests)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=int(s))
        for s in gen.integers(0, 2**63, requests, dtype=np.uint64) * 2 + 1  # high bits too
    ]
    receipts = SamplingReceipts.for_generation(params, lengths)
    logits = (gen.standard_normal((int(lengths.sum()), 50)) * 2).astype(np.float32)
    owner = np.repeat(np.arange(requests), lengths)
    want = []
    for t, row in enumerate(logits):
        step = int(receipts.step[t])
        assert step == t - int(lengths[: owner[t]].sum())
        noise_seed = reference_noise_seed(params[owner[t]].seed, None if step == SAMPLER_CALL else step)
        assert int(receipts.noise_seed[t]) == noise_seed
        want.append(reference_draw_of(row.astype(np.float64), params[owner[t]], noise_seed))
    decided = np.array([w is not None for w in want])
    served = np.array([w if w is not None else 0 for w in want])
    found = rederive_tokens(torch.from_numpy(logits), receipts, served)
    np.testing.assert_array_equal(found.token_ids[decided], served[decided])
    assert not found.flagged[decided].any()


def test_receipts_rederive_every_sampler_token_and_flag_a_perturbation():
    """The engine's draw from its own logits is re-derived token for token (sampler calls and
    generation steps); logits perturbed by a trainer that differs are flagged where they draw
    another token, and every flag is a real difference by the brute force."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 300, 1000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7 + i) for i in range(rows)]
    receipts = SamplingReceipts.for_sampler(params)
    batch = SamplingBatch.from_arrays(
        logits,
        receipts.params.temperature,
        receipts.params.top_k,
        receipts.params.top_p,
        receipts.params.min_p,
        receipts.noise_seed.view(np.int64),
        np.zeros(rows, bool),
    )
    served = sample(batch, 64).output_ids.numpy()
    exact = rederive_tokens(logits.double(), receipts, served)  # float64 logits: converted per block
    assert exact.summary() == {"tokens": rows, "rederived": rows, "near_ties": 0, "flagged": 0}

    perturbed = logits + torch.randn(rows, vocab, generator=gen)
    found = rederive_tokens(perturbed, receipts, served)
    assert found.flagged.sum() > rows // 10
    for t in np.flatnonzero(found.flagged):
        draw = reference_draw_of(perturbed[t].double().numpy(), params[t], int(receipts.noise_seed[t]))
        assert draw in (None, int(found.token_ids[t])) and draw != served[t]


def test_a_near_tie_is_told_apart_from_a_mismatch():
    """The documented example (docs/sampler.md, "Seeds"): logits [-0.5472064, 0.0], seed 12345,
    top_k 2 score within 3e-8 of each other: serving token 1 there is a near-tie, not a flag."""
    logits = torch.tensor([[-0.5472064, 0.0]])
    receipts = SamplingReceipts.for_sampler(SamplingParams(top_k=2, seed=12345), rows=1)
    found = rederive_tokens(logits, receipts, [1])
    assert found.token_ids[0] == 0 and found.near_tie[0] and not found.flagged[0]
    assert 0 <= found.score_gap[0] < 1e-7


def served_outside_the_support_within_the_band(rows: int, vocab: int, top_k: int):
    """Rows whose served token lies far outside the support the logits give, yet scores within
    the near-tie band of the draw, all by the float64 reference: (logits, params, served, how far
    below the support's last logit each served token lies). The served token is the non-support
    token with the largest noise, its logit set so that its score is the draw's less 2e-6."""
    gen = np.random.default_rng(43)
    logits = gen.standard_normal((rows, vocab)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=900 + i) for i in range(rows)]
    served, below = np.empty(rows, np.int64), np.empty(rows)
    for t, row in enumerate(logits):
        support = reference_row(row, 1.0, top_k).support
        drawn = reference_draw(row, 1.0, top_k, 1.0, 0.0, params[t].seed)
        score = float(row[drawn]) - float(row.max()) + reference_gumbel(params[t].seed, drawn)
        outside = np.setdiff1d(np.arange(vocab), support)
        token = int(max(outside, key=lambda i: reference_gumbel(params[t].seed, int(i))))
        row[token] = np.float32(float(row.max()) + score - 2e-6 - reference_gumbel(params[t].seed, token))
        ref = reference_row(row, 1.0, top_k)
        assert token not in ref.support and reference_draw(row, 1.0, top_k, 1.0, 0.0, params[t].seed) == drawn
        token_score = float(row[token]) - float(row.max()) + reference_gumbel(params[t].seed, token)
        assert 0 <= score - token_score <= 1e-5, "within the band: what the detector took for a near tie"
        served[t], below[t] = token, float(row[ref.support[-1]]) - float(row[token])
    return logits, params, served, below


def test_a_served_token_outside_the_trainers_support_is_flagged_even_within_the_band():
    """docs/corrections.md, section 4: a token outside the support the trainer's logits give is
    flagged; the near-tie band is for tokens inside it."""
    logits, params, served, below = served_outside_the_support_within_the_band(8, 32_000, 20)
    assert below.min() > 2, "logits below the support, not a boundary case"
    found = rederive_tokens(torch.from_numpy(logits), SamplingReceipts.for_sampler(params), served)
    assert ((found.score_gap >= 0) & (found.score_gap <= found.band)).all()
    assert found.mismatch.all() and found.flagged.all() and not found.near_tie.any()
    assert not found.served_in_support.any()


def test_the_support_lookup_agrees_with_the_reference_on_every_path():
    """served_in_support against the float64 reference's support, for tokens in and out of it,
    on rows that rank (top_k, top_p, min_p) and rows that do not (top_k -1, top_p 1)."""
    gen = np.random.default_rng(7)
    rows, vocab = 60, 300
    logits = (gen.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=i)
        for i, (t, k, p, m) in enumerate(
            zip(
                gen.choice([0.0, 0.7, 1.3], rows),
                gen.choice([-1, 1, 7, 50], rows),
                gen.choice([0.8, 1.0], rows),
                gen.choice([0.0, 0.05], rows),
            )
        )
    ]
    served = gen.integers(0, vocab, rows)
    found = rederive_tokens(torch.from_numpy(logits), SamplingReceipts.for_sampler(params), served)
    for t, p in enumerate(params):
        support = reference_row(logits[t], p.temperature, p.top_k, p.top_p, p.min_p).support
        assert found.served_in_support[t] == (served[t] in support), t


# ---------------------------------------------------------------- memory


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage any torch op returns (views of inputs included, which are small
    only if nothing copies them)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                self.largest = max(self.largest, value.untyped_storage().nbytes())
        return out


BIG_TOKENS, BIG_VOCAB, BIG_WIDTH = 4096, 151_936, 32


def big_batch():
    """4,096 tokens over a 151,936 vocabulary: logits [T, V] that are one row's memory read T
    times (requires grad), the masks (the row's top BIG_WIDTH ids), uniform behaviour log-probs,
    tokens and their sampling log-probs."""
    tokens, vocab, width = BIG_TOKENS, BIG_VOCAB, BIG_WIDTH
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(1, vocab, generator=gen) * 3).requires_grad_(True)
    logits = base.expand(tokens, vocab)  # one row's memory, read as T rows
    top = torch.topk(base.detach()[0], width).indices.numpy()
    mask = np.tile(top, (tokens, 1))
    lengths = np.full(tokens, width)
    behaviour = np.tile(np.log(np.full(width, 1 / width, np.float32)), (tokens, 1))
    return logits, mask, lengths, behaviour, mask[:, 0], behaviour[:, 0]


def memory_bound() -> int:
    """The N support entries (ids and values) or one row block of the full-vocabulary passes in
    float64, whichever is larger, with a factor 4 for temporaries: far below T x V."""
    support_bytes = 8 * (BIG_TOKENS * BIG_WIDTH + BIG_TOKENS)
    block_bytes = 8 * (1 << 21)
    return 4 * max(support_bytes, block_bytes)


def test_memory_stays_within_the_support_on_a_151936_vocabulary_batch_of_4096_tokens():
    """No function copies the [T, V] logits: the largest tensor any op makes (and numpy's peak) is
    bounded by the N support entries or one row block, not T x V (2.5 GB in float32 here)."""
    tokens, vocab, width = BIG_TOKENS, BIG_VOCAB, BIG_WIDTH
    logits, mask, lengths, behaviour, token_ids, sampling = big_batch()
    params = SamplingParams(temperature=0.8, top_k=width, seed=3)
    receipts_for = lambda rows: SamplingReceipts.for_sampler(params, rows=rows)  # noqa: E731
    support = FlatSupport.from_padded(mask, lengths, behaviour)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # allocations are measured, not speed: no contention on a shared box
    recorder = LargestAllocation()
    try:
        with recorder:
            scores = score_support(logits, support, 0.8)
            log_ratios(scores, token_ids, sampling)
            divergences = support_divergences(scores)
            loss = centered_policy_loss(scores, token_ids, 1.0, sampling, "clipped").mean()
            loss = loss + divergences.kl_behaviour_trainer.mean()
            # The two passes over whole rows read all T x V logits whatever they allocate, in row
            # blocks whose size does not depend on T: a quarter of the batch shows their bound.
            quarter = tokens // 4
            part = score_support(logits[:quarter], FlatSupport.from_padded(mask[:quarter], lengths[:quarter]), 0.8)
            ratio_diagnostics(logits[:quarter], part, token_ids[:quarter], sampling[:quarter]).statistics()
            # The engine's sampler also works in numpy: tracemalloc sees those arrays (only
            # around it: under the dispatch mode torch's own bookkeeping shows there too).
            tracemalloc.start()
            rederive_tokens(logits[:quarter].detach(), receipts_for(quarter), token_ids[:quarter])
            numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        torch.set_num_threads(threads)
    bound = memory_bound()
    print(f"largest torch allocation {recorder.largest} B, numpy peak {numpy_peak} B, bound {bound} B")
    assert recorder.largest <= bound < tokens * vocab * 4 / 30, (recorder.largest, bound)
    assert numpy_peak <= bound, (numpy_peak, bound)
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_the_full_row_passes_stay_within_a_row_block_on_the_whole_4096_token_batch():
    """The two passes over whole rows (kept mass, and the re-derivation with the receipts a
    sampler answer carries), which the test above runs on a quarter of the batch, over all 4,096
    tokens: the same bound."""
    logits, mask, lengths, _, token_ids, sampling = big_batch()
    support = FlatSupport.from_padded(mask, lengths)
    params = rows_to_params([SamplingParams(temperature=0.8, top_k=BIG_WIDTH)]).take(np.zeros(BIG_TOKENS, np.int64))
    receipts = SamplingReceipts.served(np.arange(BIG_TOKENS, dtype=np.uint64), params)  # as the server sends them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    recorder = LargestAllocation()
    try:
        with recorder:
            scores = score_support(logits, support, 0.8)
            ratio_diagnostics(logits, scores, token_ids, sampling).statistics()
            tracemalloc.start()
            found = rederive_tokens(logits.detach(), receipts, token_ids)
            numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        torch.set_num_threads(threads)
    assert recorder.largest <= memory_bound() and numpy_peak <= memory_bound(), (recorder.largest, numpy_peak)
    assert found.token_ids.shape == (BIG_TOKENS,) and np.isin(found.token_ids, mask[0]).all()
