"""The sampler's supports in one flat form, whatever format they arrive in, and the trainer's
log-probabilities over them.

Every format the converters produce (the server's padded rows, vLLM's CSR, prime-rl's ids and
counts, SGLang's lists) becomes a `FlatSupport`: the ids of every token's support one after the
other ([N]), each token's count ([T]) and, when carried, the sampler's log-probability of each id
([N], the server's `sampling_mask_logprobs`). `score_support` reads the trainer's logits at those
ids only, so everything computed from it (replay, corrections) costs O(N + T) memory, never
O(T x V); per-token sums over a support are segment reductions (`index_add`), differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .converters import checked_flat, csr_counts, flatten_sglang, to_prime_rl


@dataclass(frozen=True)
class FlatSupport:
    """Each token's support, flat: `ids` int64 [N] (token t's are ids[offsets[t]:offsets[t + 1]]),
    `counts` int64 [T], and `logprobs` float64 [N], the sampler's log q(id) renormalised over the
    support (None when not carried). Tensors on the host; `score_support` moves them."""

    ids: torch.Tensor
    counts: torch.Tensor
    logprobs: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """T, the number of tokens (supports)."""
        return self.counts.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        """int64 [N]: the token each id belongs to."""
        return torch.repeat_interleave(torch.arange(self.tokens, device=self.counts.device), self.counts)

    @classmethod
    def from_flat(cls, ids, counts, logprobs=None) -> FlatSupport:
        """From flat ids [N] with per-token counts [T] (prime-rl's `ids` and `counts`) and the
        sampler's per-id log-probs [N] when given."""
        ids, counts, logprobs = checked_flat(ids, counts, logprobs)
        return cls(
            torch.from_numpy(ids),
            torch.from_numpy(counts),
            None if logprobs is None else torch.from_numpy(np.asarray(logprobs, np.float64)),
        )

    @classmethod
    def from_padded(cls, mask, lengths, support_logprobs=None) -> FlatSupport:
        """From the server's layout: `sampling_mask` [T, W] (-1 padded), `sampling_mask_len` [T]
        and `sampling_mask_logprobs` [T, W] when given."""
        flat = to_prime_rl(mask, lengths, support_logprobs)
        return cls.from_flat(flat["ids"], flat["counts"], flat.get("logprobs"))

    @classmethod
    def from_csr(cls, token_ids, offsets, logprobs=None) -> FlatSupport:
        """From vLLM's CSR: `token_ids` [N], `offsets` [T + 1] (and `logprobs` [N] when given)."""
        return cls.from_flat(token_ids, csr_counts(offsets), logprobs)

    @classmethod
    def from_sglang(
        cls,
        output_token_sampling_mask: list[list[int]],
        output_token_sampling_support_logprobs: list[list[float]] | None = None,
    ) -> FlatSupport:
        """From SGLang's per-token lists (and their per-id log-probs when given)."""
        return cls.from_flat(*flatten_sglang(output_token_sampling_mask, output_token_sampling_support_logprobs))


def segment_sum(values: torch.Tensor, rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """Per-token sums [T] of flat `values` [N] (differentiable)."""
    return values.new_zeros(tokens).index_add(0, rows, values)


def segment_logsumexp(values: torch.Tensor, rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """Per-token logsumexp [T] of flat `values` [N] (differentiable; -inf for an empty segment)."""
    peak = values.new_full((tokens,), float("-inf")).scatter_reduce(0, rows, values.detach(), "amax")
    # The shift only keeps exp in range: its gradient cancels exactly, so it is held constant.
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    return segment_sum(torch.exp(values - peak[rows]), rows, tokens).log() + peak


def scoring_temperature(temperature, tokens: int, logits_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each token's temperature [T] as the sampler applies it, in float64: read in the logits'
    precision, at least float32 (the server's: a bf16 0.8 would already be 0.80078125), and 1 for
    greedy tokens (temperature 0: the sampler's convention, SGLang's too)."""
    dtype = torch.promote_types(logits_dtype, torch.float32)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=device, dtype=dtype)
    else:  # a copy: inputs may be read-only
        temperature = torch.tensor(np.asarray(temperature), device=device, dtype=dtype)
    temperature = temperature.to(torch.float64).reshape(-1).expand(tokens)
    return torch.where(temperature == 0, torch.ones_like(temperature), temperature)


@dataclass(frozen=True)
class SupportScores:
    """The trainer's logits scored over each token's support, in float64.

    `scaled` [N] holds x_v / T for the support ids (differentiable in the logits), `log_mass` [T]
    each support's logsumexp of them, so log p_S(v) = scaled - log_mass[rows] (`logprobs`).
    """

    support: FlatSupport  # on the logits' device
    rows: torch.Tensor  # int64 [N]
    temperature: torch.Tensor  # float64 [T], greedy tokens at 1
    scaled: torch.Tensor  # float64 [N]
    log_mass: torch.Tensor  # float64 [T]

    @property
    def tokens(self) -> int:
        return self.support.tokens

    @property
    def logprobs(self) -> torch.Tensor:
        """log p_S(v) [N]: the trainer's log-probability of each support id renormalised over its support."""
        return self.scaled - self.log_mass[self.rows]

    def positions(self, token_ids) -> torch.Tensor:
        """int64 [T]: where each token's id sits in the flat support (its first occurrence);
        raises ValueError when a token lies outside its support."""
        token_ids = torch.as_tensor(np.asarray(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids)
        token_ids = token_ids.to(self.rows.device, torch.int64).reshape(-1)
        if token_ids.shape[0] != self.tokens:
            raise ValueError(f"token_ids must be [T] with T = {self.tokens}, got {list(token_ids.shape)}")
        flat_index = torch.arange(self.rows.shape[0], device=self.rows.device)
        absent = self.rows.shape[0]
        at = torch.where(self.support.ids == token_ids[self.rows], flat_index, absent)
        position = torch.full_like(token_ids, absent).scatter_reduce(0, self.rows, at, "amin")
        if bool((position == absent).any()):
            raise ValueError("every sampled token must be in its row's mask")
        return position

    def token_logprobs(self, token_ids) -> torch.Tensor:
        """log p_S(y) [T] of each sampled token `token_ids` [T] (float64, differentiable)."""
        return self.logprobs[self.positions(token_ids)]


def score_support(logits: torch.Tensor, support: FlatSupport, temperature) -> SupportScores:
    """The trainer's logits [T, V] scored over `support` at the sampler's temperatures (a float or
    [T]; 0 means greedy, scored at 1). Reads only the N support entries of the logits, in float64
    (at a small temperature float32 would lose the server's 1e-5 agreement); entries outside a
    support get exactly zero gradient. Raises ValueError when shapes disagree, a support is empty
    (a token sampled without return_sampling_mask cannot be replayed) or an id is out of range."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [T, V], got {list(logits.shape)}")
    tokens, vocab = logits.shape
    if support.tokens != tokens:
        raise ValueError(f"the masks hold {support.tokens} tokens, the logits {tokens} rows (T must agree)")
    if bool((support.counts < 1).any()):
        raise ValueError(
            "every row needs a non-empty mask (rows sampled without return_sampling_mask cannot be replayed)"
        )
    if support.ids.numel() and (int(support.ids.min()) < 0 or int(support.ids.max()) >= vocab):
        raise ValueError(f"mask ids must lie in [0, {vocab})")
    device = logits.device
    support = FlatSupport(
        support.ids.to(device),
        support.counts.to(device),
        None if support.logprobs is None else support.logprobs.to(device, torch.float64),
    )
    rows = support.rows
    temperature = scoring_temperature(temperature, tokens, logits.dtype, device)
    scaled = logits[rows, support.ids].to(torch.float64) / temperature[rows]
    return SupportScores(support, rows, temperature, scaled, segment_logsumexp(scaled, rows, tokens))
