"""Batched token sampler that also returns the sampling mask (plain torch, no Triton).

Semantics (SGLang's): p = softmax(logits / T) over the whole vocabulary; tokens are ranked by
logit, descending, ties broken by lower token id (a total order, so a support never depends on
the batch or on a kernel's tie-breaking). The support of a row is

    {rank < top_k} ∩ {mass ranked strictly before the token <= top_p} ∩ {p >= min_p * p_max}
    ∩ {logit > -inf}

and the token is drawn from p restricted to it. top_p >= 1 disables the top-p rule outright.
T == 0 is greedy (SGLang's convention: top_k = 1 and T = 1 for the log-probabilities).
Because every rule keeps a prefix of the ranking, the support is the first `support_len` ranked
ids. With a finite top_k only a top-k selection and one exp-sum pass over the vocabulary are
needed; a full sort happens only for rows with top_k = -1 and top_p < 1 or a top_k above
1024, and those rows are ranked apart from the others, in row blocks of bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from .params import TOP_K_ALL


@dataclass
class SamplingBatch:
    """Rows to sample, all tensors on one device. Shapes: logits [B, V], the rest [B]."""

    logits: torch.Tensor  # float32
    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # int64, -1 = whole vocabulary
    top_p: torch.Tensor  # float32 in (0, 1]
    min_p: torch.Tensor  # float32 in [0, 1)
    seed: torch.Tensor  # int64 bit pattern of the uint64 seed
    want_mask: torch.Tensor  # bool


@dataclass
class SamplingResult:
    """Per-row outputs. mask_ids is [B, W] padded with -1; rows that did not ask get len 0."""

    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # float32 [B], under softmax(logits / T) over the full vocabulary
    mask_ids: torch.Tensor  # int32 [B, W], most probable first
    mask_len: torch.Tensor  # int32 [B]
    mask_logprobs: torch.Tensor  # float32 [B], renormalised over the support (0 when not asked)


# Rows whose effective top_k is above this are ranked apart from the rest (see sample()).
_SMALL_TOP_K = 1024
# Entries per row block on the full-vocabulary paths (float64 scores and sort indices per entry).
_FULL_VOCAB_BLOCK_ELEMENTS = 1 << 21


def sample(batch: SamplingBatch, mask_width: int) -> SamplingResult:
    """Draw one token per row and, for rows that ask, its support (at most `mask_width` ids)."""
    rows, vocab = batch.logits.shape
    device = batch.logits.device
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    top_k = torch.where(greedy, torch.ones_like(batch.top_k), batch.top_k)
    k_eff = torch.where(top_k == TOP_K_ALL, vocab, top_k.clamp(max=vocab))
    state = rng.seed_state(batch.seed)

    result = SamplingResult(
        token_ids=torch.zeros(rows, dtype=torch.int64, device=device),
        logprobs=torch.zeros(rows, dtype=torch.float32, device=device),
        mask_ids=torch.full((rows, mask_width), -1, dtype=torch.int32, device=device),
        mask_len=torch.zeros(rows, dtype=torch.int32, device=device),
        mask_logprobs=torch.zeros(rows, dtype=torch.float32, device=device),
    )
    # Plain temperature/min_p sampling over the whole vocabulary needs no ranking at all.
    no_ranking = (top_k == TOP_K_ALL) & (batch.top_p >= 1) & ~batch.want_mask
    # A group is ranked to its largest k, so rows with a large k get a group of their own: one
    # request's huge top_k must not make its batch-mates pay for a full sort.
    small_k = ~no_ranking & (k_eff <= _SMALL_TOP_K)
    full_vocab_rows = max(1, _FULL_VOCAB_BLOCK_ELEMENTS // max(vocab, 1))
    groups = ((small_k, rows, True), (~no_ranking & ~small_k, full_vocab_rows, True), (no_ranking, full_vocab_rows, False))
    for rows_mask, block_rows, ranked in groups:
        group = torch.nonzero(rows_mask).flatten()
        if group.numel() == 0:
            continue
        # Full-vocabulary groups run in row blocks: their [rows, V] temporaries stay bounded.
        for index in torch.split(group, block_rows):
            part = _select(batch, index, temperature, k_eff, state)
            if ranked:
                _sample_ranked(part, int(part["k_eff"].max()), mask_width, result, index)
            else:
                _sample_unranked(part, result, index)
    return result


def _select(batch: SamplingBatch, index: torch.Tensor, temperature, k_eff, state) -> dict:
    """The tensors of one partition of rows (no copy when the partition is the whole batch)."""
    whole = index.numel() == batch.logits.shape[0]
    pick = (lambda t: t) if whole else (lambda t: t.index_select(0, index))
    return {
        "logits": pick(batch.logits),
        "temperature": pick(temperature),
        "k_eff": pick(k_eff),
        "top_p": pick(batch.top_p),
        "min_p": pick(batch.min_p),
        "state": pick(state),
        "want_mask": pick(batch.want_mask),
    }


def ranked_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k highest logits of each row in the total order (logit desc, id asc): values, ids."""
    rows, vocab = logits.shape
    if k >= vocab:
        # A stable descending sort keeps equal logits in ascending id order.
        return torch.sort(logits, dim=-1, descending=True, stable=True)
    # Fetch a few candidates past k: a run of equal logits at the k-th place (common with bf16
    # logits) then usually ends inside the fetched set, and ranking the set by (logit, id) is
    # exact without another pass over the vocabulary.
    fetched = k + min(vocab - k, 16 + k // 4)
    values, ids = torch.topk(logits, fetched, dim=-1, sorted=True)
    boundary = values[:, k - 1]
    overflows = (values[:, -1] == boundary) & (boundary > float("-inf"))
    if bool(overflows.any()):  # the run reaches past the fetched set: find its lowest ids
        ids = _repair_boundary_ties(logits, values, ids, overflows)
    # topk already ranks by value, so only ids inside runs of equal values may be out of order:
    # one sort of the key (run index, id), nearly sorted already, replaces two full sorts.
    run = torch.cumsum(values[:, 1:] != values[:, :-1], dim=-1)
    run = torch.cat([run.new_zeros(rows, 1), run], dim=-1) * vocab
    ids = torch.sort(run + ids, dim=-1).values - run
    return values[:, :k], ids[:, :k]


def _repair_boundary_ties(logits, values, ids, overflows):
    """Give the places holding the last fetched value, in `overflows` rows, to the lowest tied ids.

    `values` is sorted descending (topk's order), so each row holds `above` candidates strictly
    above its last value, then ones equal to it; those places go to the lowest ids whose
    logit equals the boundary. One comparison pass plus nonzero finds them (nonzero lists ids in
    ascending order per row), without copying or re-ranking the logits.
    """
    rows, k = values.shape
    boundary = torch.where(overflows, values[:, -1], torch.tensor(float("nan"), device=values.device))
    above = (values > boundary.unsqueeze(1)).sum(dim=-1)  # other rows: NaN boundary, no ties found
    row_of, tied_ids = torch.nonzero(logits == boundary.unsqueeze(1), as_tuple=True)
    counts = torch.bincount(row_of, minlength=rows)
    first = torch.cumsum(counts, dim=0) - counts
    place = above[row_of] + torch.arange(row_of.numel(), device=row_of.device) - first[row_of]
    take = place < k
    ids = ids.clone()
    ids[row_of[take], place[take]] = tied_ids[take]
    return ids


# Rows of logits processed per scratch block in the normaliser: a few MiB keeps the block in
# cache and under the allocator's mmap threshold, so no page faults on every call.
_NORMALISER_BLOCK_ELEMENTS = 1 << 20


def _log_normaliser(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log sum exp((logits - max) / T) per row in float64, one pass over cache-sized row blocks."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu":  # one fused-enough pass; GPU memory traffic is not the cost
        scratch = logits - row_max.unsqueeze(1)
        scratch.div_(temperature.unsqueeze(1)).exp_()
        return scratch.sum(dim=-1).to(torch.float64).log()
    block = max(1, min(rows, _NORMALISER_BLOCK_ELEMENTS // max(vocab, 1)))
    scratch = torch.empty(block, vocab, dtype=logits.dtype)
    sums = torch.empty(rows, dtype=logits.dtype)
    row_max, temperature = row_max.unsqueeze(1), temperature.unsqueeze(1)
    for start in range(0, rows, block):  # a loop over memory blocks, not over requests
        stop = min(rows, start + block)
        part = scratch[: stop - start]
        torch.sub(logits[start:stop], row_max[start:stop], out=part)
        part.div_(temperature[start:stop]).exp_()
        torch.sum(part, dim=-1, out=sums[start:stop])
    return sums.to(torch.float64).log()


def _sample_ranked(part: dict, k: int, mask_width: int, result: SamplingResult, index: torch.Tensor) -> None:
    """Rows whose support is a prefix of their top-k ranking (k = the largest effective top_k)."""
    logits, temperature = part["logits"], part["temperature"].to(torch.float64)
    values, ids = ranked_candidates(logits, k)
    row_max = values[:, 0]
    log_z = _log_normaliser(logits, row_max, part["temperature"])
    scaled = (values.to(torch.float64) - row_max.to(torch.float64).unsqueeze(1)) / temperature.unsqueeze(1)
    logp = scaled - log_z.unsqueeze(1)  # log-probability under the full-vocabulary softmax
    probs = logp.exp()

    rank = torch.arange(k, device=logits.device).unsqueeze(0)
    keep = (rank < part["k_eff"].unsqueeze(1)) & (values > float("-inf"))
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p = part["top_p"].to(torch.float64).unsqueeze(1)
    keep &= (top_p >= 1) | (mass_before <= top_p)
    keep &= scaled.exp() >= part["min_p"].to(torch.float64).unsqueeze(1)  # p / p_max >= min_p
    # Each rule keeps a prefix, so the support is the first support_len candidates.
    support_len = keep.sum(dim=-1)

    noise = rng.gumbel(part["state"].unsqueeze(1), ids)
    score = torch.where(keep, scaled + noise, torch.tensor(float("-inf"), dtype=torch.float64, device=logits.device))
    pick = score.argmax(dim=-1, keepdim=True)
    token_logp = logp.gather(1, pick).squeeze(1)
    support_logmass = torch.logsumexp(torch.where(keep, logp, torch.tensor(float("-inf"), dtype=torch.float64, device=logits.device)), dim=-1)

    want = part["want_mask"]
    result.token_ids[index] = ids.gather(1, pick).squeeze(1)
    result.logprobs[index] = token_logp.to(torch.float32)
    width = min(k, mask_width)
    mask_len = torch.where(want, support_len.clamp(max=mask_width), torch.zeros_like(support_len))
    in_mask = rank[:, :width] < mask_len.unsqueeze(1)
    result.mask_ids[index, :width] = torch.where(in_mask, ids[:, :width], torch.full_like(ids[:, :width], -1)).to(torch.int32)
    result.mask_len[index] = mask_len.to(torch.int32)
    renormalised = torch.where(want, token_logp - support_logmass, torch.zeros_like(token_logp))
    result.mask_logprobs[index] = renormalised.to(torch.float32)


def _sample_unranked(part: dict, result: SamplingResult, index: torch.Tensor) -> None:
    """Rows with top_k = -1, top_p >= 1 and no mask: Gumbel-max over the whole vocabulary."""
    logits = part["logits"]
    row_max = logits.amax(dim=-1)
    temperature = part["temperature"].to(torch.float64).unsqueeze(1)
    scaled = (logits.to(torch.float64) - row_max.to(torch.float64).unsqueeze(1)) / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    keep = (logits > float("-inf")) & (scaled.exp() >= part["min_p"].to(torch.float64).unsqueeze(1))
    vocab_ids = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    noise = rng.gumbel(part["state"].unsqueeze(1), vocab_ids)
    score = torch.where(keep, scaled + noise, torch.tensor(float("-inf"), dtype=torch.float64, device=logits.device))
    pick = score.argmax(dim=-1, keepdim=True)
    result.token_ids[index] = pick.squeeze(1)
    result.logprobs[index] = (scaled.gather(1, pick).squeeze(1) - log_z).to(torch.float32)
