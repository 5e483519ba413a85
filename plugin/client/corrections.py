"""Exact off-policy corrections from the sampler's masks: importance ratios, kept mass, KL and
entropy over the support, and the exact-support centred score (docs/corrections.md).

Notation, per token t: S the sampler's support, y the sampled id, q(v) the sampler's probability
of v renormalised over S (the server's `sampling_mask_logprobs`, `FlatSupport.logprobs`), p the
trainer's softmax(x / T) over the whole vocabulary and p_S(v) = p(v) / M its renormalisation over
S, where M = sum_{v in S} p(v) is the trainer's kept mass.

Everything takes `support.SupportScores` (`score_support(logits, support, temperature)`), whatever
format the masks came in, and is batched over the tokens with segment sums: O(N + T) memory for N
support ids; only `kept_log_mass` reads whole rows of the logits, in row blocks of bounded size.
The losses are differentiable in the trainer's logits; the diagnostics are not (no_grad).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..sampling.selection import FULL_VOCAB_BLOCK_ELEMENTS
from .support import SupportScores, segment_logsumexp, segment_sum

IMPORTANCE_MODES = ("none", "ratio", "clipped")


def _float64(values, device: torch.device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to(device, torch.float64).reshape(-1)
    return torch.tensor(np.asarray(values, np.float64), device=device).reshape(-1)


def _per_token(values, scores: SupportScores, field: str) -> torch.Tensor:
    values = _float64(values, scores.rows.device)
    if values.shape[0] == 1:
        values = values.expand(scores.tokens)
    if values.shape[0] != scores.tokens:
        raise ValueError(f"{field} must hold one value per token ({scores.tokens}), got {values.shape[0]}")
    return values


def log_ratios(scores: SupportScores, token_ids, sampling_logprobs) -> torch.Tensor:
    """log p_S(y) - log q(y) [T]: the exact-support importance log-ratio of each sampled token
    (`sampling_logprobs` is the server's log q(y)); differentiable in the logits."""
    return scores.token_logprobs(token_ids) - _per_token(sampling_logprobs, scores, "sampling_logprobs")


@torch.no_grad()
def kept_log_mass(logits: torch.Tensor, scores: SupportScores) -> torch.Tensor:
    """log M [T] = logsumexp_S(x / T) - logsumexp_V(x / T): the log of the trainer's probability
    mass on each support (0 when the support holds all of it), in float64. The full-vocabulary
    logsumexp runs in row blocks of at most `FULL_VOCAB_BLOCK_ELEMENTS` logits."""
    tokens, vocab = logits.shape
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    log_total = torch.empty(tokens, dtype=torch.float64, device=logits.device)
    for start in range(0, tokens, block_rows):  # a loop over memory blocks, not over requests
        stop = min(tokens, start + block_rows)
        block = logits[start:stop].to(torch.float64, copy=True)  # a copy: divided in place
        block /= scores.temperature[start:stop].unsqueeze(1)
        log_total[start:stop] = torch.logsumexp(block, dim=1)
    return scores.log_mass.detach() - log_total


def server_kept_log_mass(output_logprobs, sampling_logprobs) -> np.ndarray:
    """log M [T] as the server measured it: `output_logprobs - sampling_logprobs` (float64), the
    log of the sampler's probability mass on each support: the truncation a full-vocabulary
    importance ratio ignores."""
    return np.asarray(output_logprobs, np.float64).reshape(-1) - np.asarray(sampling_logprobs, np.float64).reshape(-1)


@dataclass(frozen=True)
class RatioDiagnostics:
    """Per-token importance diagnostics (float64 [T], no gradient): the exact-support log-ratio
    log p_S(y) - log q(y), the trainer's log kept mass log M, and the log-ratio a
    full-vocabulary replay would give, log p(y) - log q(y) = log-ratio + log M."""

    support_log_ratio: torch.Tensor
    kept_log_mass: torch.Tensor
    full_vocab_log_ratio: torch.Tensor

    def statistics(self) -> dict[str, float]:
        """Batch statistics, ready to log: mean, std, min and max of the support ratio, the
        full-vocabulary ratio and the kept mass, and the truncation bias 1 - mean kept mass
        (what the full-vocabulary ratio's mean falls short of 1 by, for an on-policy trainer). An
        empty batch has the same keys, each NaN (a mean of nothing, as torch's)."""
        out = {}
        for name, log_values in (
            ("support_ratio", self.support_log_ratio),
            ("full_vocab_ratio", self.full_vocab_log_ratio),
            ("kept_mass", self.kept_log_mass),
        ):
            values = torch.exp(log_values)
            if values.numel() == 0:  # torch's min and max of nothing raise
                out.update({f"{name}_{statistic}": math.nan for statistic in ("mean", "std", "min", "max")})
                continue
            out[f"{name}_mean"] = float(values.mean())
            out[f"{name}_std"] = float(values.std(unbiased=False))
            out[f"{name}_min"] = float(values.min())
            out[f"{name}_max"] = float(values.max())
        out["truncation_bias"] = 1.0 - out["kept_mass_mean"]
        return out


@torch.no_grad()
def ratio_diagnostics(logits: torch.Tensor, scores: SupportScores, token_ids, sampling_logprobs) -> RatioDiagnostics:
    """The exact-support and full-vocabulary ratios of each sampled token, and the kept mass
    that separates them (`RatioDiagnostics`); `scores` from `score_support(logits, ...)`."""
    support_log_ratio = log_ratios(scores, token_ids, sampling_logprobs).detach()
    kept = kept_log_mass(logits, scores)
    return RatioDiagnostics(support_log_ratio, kept, support_log_ratio + kept)


def _behaviour_logprobs(scores: SupportScores) -> torch.Tensor:
    """log q [N], renormalised over each support in float64 (the server's float32 values sum to 1
    only to float32 rounding); raises ValueError when the masks carry no log-probs."""
    behaviour = scores.support.logprobs
    if behaviour is None:
        raise ValueError(
            "the sampler's per-support log-probs are needed (sampling_mask_logprobs): build the FlatSupport with them"
        )
    return behaviour - segment_logsumexp(behaviour, scores.rows, scores.tokens)[scores.rows]


def _entropy_like(log_a: torch.Tensor, log_b: torch.Tensor, scores: SupportScores) -> torch.Tensor:
    """sum_S a (log a - log b) per token, with 0 log 0 = 0 (an id whose probability underflows)."""
    a = torch.exp(log_a)
    # Both logs zeroed where a = 0, so neither the value nor the gradient meets 0 * inf.
    held = a > 0
    zero = torch.zeros_like(a)
    terms = a * (torch.where(held, log_a, zero) - torch.where(held, log_b, zero))
    return segment_sum(terms, scores.rows, scores.tokens)


@dataclass(frozen=True)
class SupportDivergences:
    """Per-token divergences over the support (float64 [T]): KL(q||p_S), KL(p_S||q), the
    trainer's entropy H(p_S) (differentiable in the logits) and the sampler's H(q) (constant)."""

    kl_behaviour_trainer: torch.Tensor
    kl_trainer_behaviour: torch.Tensor
    entropy: torch.Tensor
    behaviour_entropy: torch.Tensor


def support_divergences(scores: SupportScores) -> SupportDivergences:
    """KL(q||p_S), KL(p_S||q) and the entropies over each support, exactly (no sampling):
    sums over the N support ids. Needs the sampler's per-support log-probs in `scores.support`."""
    log_q = _behaviour_logprobs(scores)
    log_p = scores.logprobs
    return SupportDivergences(
        kl_behaviour_trainer=_entropy_like(log_q, log_p, scores),
        kl_trainer_behaviour=_entropy_like(log_p, log_q, scores),
        entropy=-_entropy_like(log_p, torch.zeros_like(log_p), scores),
        behaviour_entropy=-_entropy_like(log_q, torch.zeros_like(log_q), scores),
    )


def centered_score_surrogate(scores: SupportScores, token_ids) -> torch.Tensor:
    """L [T] = log p_S(y) - sum_{v in S} q(v) log p_S(v), q held constant: its gradient is the
    exact-support centred score grad log p_S(y) - sum_{v in S} q(v) grad log p_S(v), whose mean
    under the sampler is zero (with respect to the logits it is (onehot(y) - q) / T on S).
    Only its gradient is meant to be used."""
    q = torch.exp(_behaviour_logprobs(scores))
    baseline = segment_sum(q * scores.logprobs, scores.rows, scores.tokens)
    return scores.token_logprobs(token_ids) - baseline


def centered_policy_loss(
    scores: SupportScores,
    token_ids,
    advantages,
    sampling_logprobs=None,
    importance: str = "none",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> torch.Tensor:
    """Per-token policy-gradient loss [T] with the exact-support centred score (reduce it as your
    trainer does: mean over tokens, per sequence, ...). Its gradient is

        -A w (grad log p_S(y) - sum_{v in S} q(v) grad log p_S(v))

    with `advantages` A (a float or [T]) and the weight w held constant: `importance` "none"
    (w = 1, on-policy REINFORCE / GRPO), "ratio" (w = p_S(y) / q(y), the exact-support importance
    ratio) or "clipped" (PPO: w = the ratio where min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
    takes the unclipped term, 0 where the clip holds). "ratio" and "clipped" need
    `sampling_logprobs` (the server's log q(y))."""
    if importance not in IMPORTANCE_MODES:
        raise ValueError(f"importance must be one of {IMPORTANCE_MODES}, got {importance!r}")
    if importance != "none" and sampling_logprobs is None:
        raise ValueError(f"importance {importance!r} needs sampling_logprobs (the server's log q(y))")
    advantages = _per_token(advantages, scores, "advantages")
    surrogate = centered_score_surrogate(scores, token_ids)
    if importance == "none":
        return -advantages * surrogate
    ratio = torch.exp(log_ratios(scores, token_ids, sampling_logprobs).detach())
    weight = ratio
    if importance == "clipped":
        clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
        weight = torch.where(clipped, torch.zeros_like(ratio), ratio)
    return -advantages * weight * surrogate
