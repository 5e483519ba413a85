"""Trainer-side replay: log-probs of the sampled tokens renormalised over the sampler's masks.

A trainer recomputes logits [T, V] for a rollout and must score each sampled token under the
same truncated distribution the sampler drew from:

    log p_mask(token) = logits[token] / T - logsumexp_{i in mask} logits[i] / T

which is what the server returns as `sampling_logprobs`. The function is differentiable in the
logits; entries outside a row's mask get exactly zero gradient (they are never read). These take
the server's padded layout; `support.score_support` takes every other format (and
`corrections` builds the off-policy terms on it).
"""

from __future__ import annotations

import torch

from .support import FlatSupport, score_support


def replay_logprobs(logits: torch.Tensor, mask, mask_len, temperature, token_ids) -> torch.Tensor:
    """Log-probs [T] of `token_ids` renormalised over each row's mask, in the logits' dtype.

    logits: [T, V] float (may require grad). mask: [T, W] ids padded with -1 (the server's
    `sampling_mask`); mask_len: [T] valid ids per row; temperature: a float or [T] (0 means
    greedy, scored at temperature 1 like the server); token_ids: [T] sampled ids. Raises
    ValueError when a row has an empty mask or its token lies outside its mask.
    """
    scores = score_support(logits, FlatSupport.from_padded(mask, mask_len), temperature)
    return scores.token_logprobs(token_ids).to(logits.dtype)


def replay_support_logprobs(logits: torch.Tensor, mask, mask_len, temperature) -> torch.Tensor:
    """Log-probs [T, W] of every mask id renormalised over its row's mask, -inf padded: the
    trainer's side of the server's `sampling_mask_logprobs` (the behaviour distribution over the
    support, for exact KL / entropy terms). Differentiable in `logits`; arguments as `replay_logprobs`."""
    support = FlatSupport.from_padded(mask, mask_len)
    scores = score_support(logits, support, temperature)
    tokens, width = scores.tokens, torch.as_tensor(mask).shape[1]
    starts = torch.cumsum(scores.support.counts, 0) - scores.support.counts
    columns = torch.arange(scores.rows.shape[0], device=logits.device) - starts[scores.rows]
    padded = torch.full((tokens, width), float("-inf"), dtype=torch.float64, device=logits.device)
    return padded.index_put((scores.rows, columns), scores.logprobs).to(logits.dtype)
