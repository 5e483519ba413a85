"""Sampling receipts: what the server's noise used for each token, and the re-derivation of each
sampled token from the trainer's logits (the train-inference mismatch detector).

The sampler's draw is a Gumbel-max over the support with noise hashed from (seed, token id)
(`sampling.rng`), so a token is a deterministic function of its logits, its parameters and the
seed its noise used: the row's seed for a `sampler` call, `rng.step_seeds(seed, s)` for step s
of a `generate` request. A receipt holds that (seed, step) and the parameters, per token. Both
models return the row's seed on request (the `sampling_seed` output, the one the server drew for
an unseeded request included), and the typed clients hand back each result's receipts
(`result.receipts`, with `return_receipts=True`); for a seeded request they can also be derived
from the request alone (`for_sampler`, `for_generation`). `rederive_tokens` runs the engine's own
sampler on the trainer's logits with each receipt and reports where it would have drawn another
token: a mismatch within the documented near-tie band (`rng.NEAR_TIE`), its served token inside
the support the trainer's logits give, is rounding between precisions; any other means the
trainer's logits are not the ones the server sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..sampling import rng
from ..sampling.params import RowParams, effective_top_k
from ..sampling.sampler import SamplingBatch, sample
from ..sampling.selection import FULL_VOCAB_BLOCK_ELEMENTS
from .sampling_params import SamplingParams, rows_to_params

SAMPLER_CALL = -1  # the step of a token drawn by a `sampler` call: its noise takes the seed as is


@dataclass(frozen=True)
class SamplingReceipts:
    """Per token (T of them): `seed` uint64 [T], the request's seed; `step` int64 [T], the
    generation step (SAMPLER_CALL for a `sampler` call); `params`, the sampling parameters [T]."""

    seed: np.ndarray
    step: np.ndarray
    params: RowParams

    def __post_init__(self):
        tokens = np.shape(self.seed)[0] if np.ndim(self.seed) == 1 else -1
        if tokens < 0 or np.shape(self.step) != (tokens,) or self.params.rows != tokens:
            raise ValueError(
                f"a receipt needs one seed, step and parameter row per token, got seed {list(np.shape(self.seed))}, "
                f"step {list(np.shape(self.step))} and {self.params.rows} parameter rows"
            )

    @property
    def tokens(self) -> int:
        return self.seed.shape[0]

    @property
    def noise_seed(self) -> np.ndarray:
        """uint64 [T]: the seed each token's noise used, as the engine derives it."""
        stepped = rng.step_seeds_numpy(self.seed, np.maximum(self.step, 0)).view(np.uint64)
        return np.where(self.step == SAMPLER_CALL, self.seed, stepped)

    @classmethod
    def for_sampler(
        cls, params: SamplingParams | Sequence[SamplingParams], rows: int | None = None
    ) -> SamplingReceipts:
        """The receipts of a `sampler` call: one SamplingParams per row, or one for `rows` rows."""
        params = _rows(params, rows)
        return cls(_seeds(params), np.full(params.rows, SAMPLER_CALL, np.int64), params)

    @classmethod
    def for_generation(
        cls, params: SamplingParams | Sequence[SamplingParams], lengths: Sequence[int]
    ) -> SamplingReceipts:
        """The receipts of `generate` requests, their tokens one request after another (as
        `concatenate_tokens` lays them out): one SamplingParams per request (or one for all) and
        each request's number of generated tokens, token i of a request drawn at step i."""
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        per_request = _rows(params, lengths.shape[0])
        owner = np.repeat(np.arange(lengths.shape[0]), lengths)
        starts = np.cumsum(lengths) - lengths
        steps = np.arange(owner.shape[0], dtype=np.int64) - starts[owner]
        return cls(_seeds(per_request)[owner], steps, per_request.take(owner))

    @classmethod
    def served(cls, sampling_seed, params: RowParams, first_step: int | None = None) -> SamplingReceipts:
        """The receipts of one answer from the server's `sampling_seed` output (uint64, one per
        token) and the parameters the tokens were drawn with (`params`, one row per token):
        a `sampler` answer's (`first_step` None), or consecutive tokens of one `generate` request,
        the first drawn at step `first_step` (0 for a whole result, the tokens before a chunk
        for a streamed one)."""
        seed = np.asarray(sampling_seed).astype(np.uint64, copy=False).reshape(-1)
        if first_step is None:
            step = np.full(seed.shape[0], SAMPLER_CALL, np.int64)
        else:
            step = np.arange(first_step, first_step + seed.shape[0], dtype=np.int64)
        return cls(seed, step, params)

    @classmethod
    def concatenate(cls, parts: Sequence[SamplingReceipts]) -> SamplingReceipts:
        """The tokens of several receipts, one after another (as `concatenate_tokens` lays out results)."""
        parts = list(parts)
        return cls(
            np.concatenate([p.seed for p in parts]),
            np.concatenate([p.step for p in parts]),
            RowParams.concatenate([p.params for p in parts]),
        )


def _rows(params: SamplingParams | Sequence[SamplingParams], rows: int | None) -> RowParams:
    if isinstance(params, SamplingParams):
        if rows is None:
            raise ValueError("one SamplingParams for every row needs the number of rows")
        return rows_to_params([params]).take(np.zeros(rows, np.int64))
    params = list(params)
    if rows is not None and len(params) != rows:
        raise ValueError(f"params must be one SamplingParams or {rows} of them, got {len(params)}")
    return rows_to_params(params)


def _seeds(params: RowParams) -> np.ndarray:
    unseeded = np.flatnonzero(~params.has_seed)
    if unseeded.size:
        raise ValueError(
            f"params[{int(unseeded[0])}] has no seed: an unseeded request's noise is drawn by the server "
            "and cannot be re-derived; send a seed"
        )
    return params.seed.astype(np.uint64)


@dataclass(frozen=True)
class Rederivation:
    """Each token re-derived from the trainer's logits (numpy, [T]): `token_ids` the trainer's
    draw, `served_ids` the server's; `score_gap`, the Gumbel score (x - max) / T + g of the
    trainer's draw minus the served token's, under the trainer's logits (0 where they agree);
    `band`, the near-tie band NEAR_TIE * (1 + |(x - max) / T|) of the two; `served_in_support`,
    whether the served token is in the support the trainer's logits give (the score gap says
    nothing about that: a token far outside the support may score within the band)."""

    token_ids: np.ndarray
    served_ids: np.ndarray
    score_gap: np.ndarray
    band: np.ndarray
    served_in_support: np.ndarray

    @property
    def mismatch(self) -> np.ndarray:
        """bool [T]: the trainer's logits draw another token."""
        return self.token_ids != self.served_ids

    @property
    def near_tie(self) -> np.ndarray:
        """bool [T]: a mismatch within the near-tie band (rounding between precisions), the served
        token inside the trainer's support."""
        return self.mismatch & self.served_in_support & (self.score_gap >= 0) & (self.score_gap <= self.band)

    @property
    def flagged(self) -> np.ndarray:
        """bool [T]: any other mismatch: the trainer's logits are not the server's."""
        return self.mismatch & ~self.near_tie

    def summary(self) -> dict[str, int]:
        """Counts: tokens, those re-derived exactly, near-tie mismatches and flagged ones."""
        return {
            "tokens": int(self.token_ids.shape[0]),
            "rederived": int((~self.mismatch).sum()),
            "near_ties": int(self.near_tie.sum()),
            "flagged": int(self.flagged.sum()),
        }


def rederive_tokens(logits: torch.Tensor, receipts: SamplingReceipts, token_ids) -> Rederivation:
    """Re-draw every token from the trainer's `logits` [T, V] with its receipt, through the
    engine's own sampler, and compare with the served `token_ids` [T]. Rows go to the sampler in
    blocks of at most `FULL_VOCAB_BLOCK_ELEMENTS` logits (float64 logits converted to float32 one
    block at a time), so memory stays bounded whatever T is."""
    if logits.ndim != 2 or logits.shape[0] != receipts.tokens:
        raise ValueError(f"logits must be [T, V] with T = {receipts.tokens} receipts, got {list(logits.shape)}")
    served = np.asarray(token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else token_ids)
    served = served.astype(np.int64).reshape(-1)
    if served.shape[0] != receipts.tokens:
        raise ValueError(f"token_ids must hold {receipts.tokens} ids, got {served.shape[0]}")
    tokens, vocab = logits.shape
    if served.size and (served.min() < 0 or served.max() >= vocab):
        raise ValueError(f"token_ids must lie in [0, {vocab})")
    params = receipts.params.greedy_applied()
    seeds = receipts.noise_seed
    noise_seed = seeds.view(np.int64)
    drawn = np.empty(tokens, np.int64)
    pair_logits = np.empty((tokens, 2), np.float64)  # the served and the drawn token's logits
    row_max = np.empty(tokens, np.float64)
    for rows, block in _blocks(logits, np.arange(tokens)):  # a loop over memory blocks, not over requests
        result = sample(SamplingBatch(block, _as_served(receipts, seeds, rows, False)), mask_width=0).host()
        drawn[rows] = result["output_ids"]
        row_max[rows] = result["row_max"]
        pair = torch.from_numpy(np.stack([served[rows], drawn[rows]], axis=1)).to(block.device)
        pair_logits[rows] = block.gather(1, pair).double().cpu().numpy()
    # The drawn token is in the support; a served one that differs is looked up in the support
    # the sampler builds for its row (only mismatched rows: they are few where it matters).
    in_support = drawn == served
    widths = effective_top_k(params, vocab)
    for rows, block in _blocks(logits, np.flatnonzero(~in_support)):
        result = sample(SamplingBatch(block, _as_served(receipts, seeds, rows, True)), int(widths[rows].max())).host()
        support = np.arange(result["sampling_mask"].shape[1]) < result["sampling_mask_len"][:, None]
        in_support[rows] = ((result["sampling_mask"] == served[rows, None]) & support).any(axis=1)
    ids = np.stack([served, drawn], axis=1)
    temperature = params.temperature.astype(np.float64)[:, None]
    scaled = (pair_logits - row_max[:, None]) / temperature
    noise = -rng.negated_gumbel_numpy(rng.seed_state_numpy(noise_seed)[:, None], ids)
    noise[receipts.params.temperature == 0] = 0.0  # greedy rows draw the argmax: no noise decides
    score = scaled + noise
    return Rederivation(
        token_ids=drawn,
        served_ids=served,
        score_gap=np.where(drawn == served, 0.0, score[:, 1] - score[:, 0]),
        band=rng.NEAR_TIE * (1 + np.abs(scaled).max(axis=1)),
        served_in_support=in_support,
    )


def _blocks(logits: torch.Tensor, rows: np.ndarray):
    """(row ids, their logits as the sampler takes them) in blocks of at most
    FULL_VOCAB_BLOCK_ELEMENTS logits."""
    block_rows = max(1, FULL_VOCAB_BLOCK_ELEMENTS // max(logits.shape[1], 1))
    for start in range(0, rows.shape[0], block_rows):
        index = rows[start : start + block_rows]
        if index[-1] - index[0] + 1 == index.shape[0]:  # consecutive rows: a view, no copy
            block = logits[int(index[0]) : int(index[-1]) + 1].detach()
        else:
            block = logits[torch.from_numpy(index).to(logits.device)].detach()
        if block.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            block = block.to(torch.float32)
        yield index, block


def _as_served(receipts: SamplingReceipts, seeds: np.ndarray, rows: np.ndarray, want_mask: bool) -> RowParams:
    """The rows' parameters as served (a new one included), each token's noise seed, and the mask
    asked for or not."""
    return replace(
        receipts.params.take(rows),
        seed=seeds[rows],
        has_seed=np.ones(rows.shape[0], np.bool_),
        return_sampling_mask=np.full(rows.shape[0], want_mask),
    )
