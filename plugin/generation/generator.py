"""Multi-token generation with per-token sampling masks (no Triton here).

The requests of one batch are prefilled together (left-padded) and then advance one token per
step; every step samples all active rows in one BatchSampler call, with the sampler's semantics
and a per-step seed derived from (seed, step). A row leaves the batch when it samples an EOS /
stop token (finish "stop", the token and its mask row are kept), reaches max_new_tokens
(finish "length") or is cancelled. Results reach the caller through a `GenerationSink`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from ..sampling import rng
from ..sampling.batching import BatchSampler, outputs_to_numpy
from ..sampling.outputs import (
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    SAMPLING_LOGPROBS,
    SAMPLING_MASK,
    SAMPLING_MASK_LEN,
    SAMPLING_MASK_LOGPROBS,
)
from ..sampling.params import RowParams
from ..sampling.validation import check_logit_rows, check_rows
from .lm import CausalLM
from .request import FINISH_LENGTH, FINISH_STOP, GenerationChunk, GenerationRequest


class GenerationSink(Protocol):
    """Where the generator sends results; `position` is the request's index in the batch."""

    def is_cancelled(self, position: int) -> bool: ...

    def send(self, position: int, chunk: GenerationChunk, final: bool) -> None: ...

    def cancelled(self, position: int, tokens: int) -> None: ...

    def generated(self, tokens: int) -> None:
        """Called once per step, before that step's results are sent (for counters)."""

    def fail(self, position: int, message: str) -> None: ...


class Generator:
    """Drives a CausalLM with the plugin's sampler, a batch of requests at a time."""

    def __init__(self, lm: CausalLM, sampler: BatchSampler):
        self.lm = lm
        self.sampler = sampler
        self.width = sampler.policy.mask_width

    def admission_errors(self, requests: list[GenerationRequest]) -> list[str | None]:
        """The sampler's rules (ranges, mask admission) for every request at once, before any token."""
        if not requests:
            return []
        params = RowParams.concatenate([r.params for r in requests])
        errors = check_rows(params, None, self.lm.vocab_size, self.sampler.policy)
        return [None if e is None else e.message for e in errors]

    def run(self, requests: list[GenerationRequest], sink: GenerationSink) -> int:
        """Generate every (admitted) request to its end; returns the number of tokens generated."""
        max_new = np.array([r.max_new_tokens for r in requests], np.int64)
        for position in np.flatnonzero(max_new == 0):
            sink.send(int(position), GenerationChunk.empty(self.width, FINISH_LENGTH), final=True)
        rows = np.flatnonzero(max_new > 0)
        if rows.size == 0:
            return 0
        buffers = _Buffers(requests, rows, int(max_new.max()), self.width)
        logits, state = self.lm.prefill([torch.from_numpy(requests[r].prompt) for r in rows])
        active = _ActiveRows(
            rows=rows,
            params=RowParams.concatenate([requests[r].params for r in rows]),
            stops=_stop_matrix([requests[r] for r in rows], self.lm.eos_token_ids),
            stream=np.array([requests[r].stream for r in rows]),
            state=state,
        )
        generated = 0
        for step in range(int(max_new.max())):
            cancelled = np.array([sink.is_cancelled(int(r)) for r in active.rows])  # a cheap flag per request
            broken = ~np.equal(check_logit_rows(logits.amax(dim=-1).cpu().numpy()), None).astype(bool)
            for i in np.flatnonzero(cancelled):
                sink.cancelled(int(active.rows[i]), step)
            for i in np.flatnonzero(broken & ~cancelled):
                sink.fail(int(active.rows[i]), f"the language model produced unusable logits at step {step}")
            if (cancelled | broken).any():
                logits = active.narrow(self.lm, ~cancelled & ~broken, logits)
                if active.rows.size == 0:
                    break

            result = self.sampler.sample(logits, _step_params(active.params, step))
            generated += active.rows.size
            sink.generated(active.rows.size)
            step_arrays = buffers.write(active.rows, step, result)
            tokens = result.output_ids.cpu()
            stopped = (active.stops == tokens.numpy()[:, None]).any(axis=1)
            finished = stopped | (step + 1 >= max_new[active.rows])
            reasons = np.where(stopped, FINISH_STOP, FINISH_LENGTH)
            for i in np.flatnonzero(active.stream):  # streaming rows: this step's token now
                reason = str(reasons[i]) if finished[i] else ""
                sink.send(int(active.rows[i]), _chunk_of(step_arrays, i, reason), final=bool(finished[i]))
            for i in np.flatnonzero(finished & ~active.stream):  # the rest: everything at the end
                row = int(active.rows[i])
                sink.send(row, buffers.chunk(row, step + 1, str(reasons[i])), final=True)
            if finished.any():
                tokens = active.narrow(self.lm, ~finished, tokens)
                if active.rows.size == 0:
                    break
            logits = self.lm.decode(active.state, tokens)
        return generated


@dataclass
class _ActiveRows:
    """The requests still generating: batch positions, parameters, stop ids, stream flags, LM state."""

    rows: np.ndarray
    params: RowParams
    stops: np.ndarray
    stream: np.ndarray
    state: object

    def narrow(self, lm: CausalLM, keep: np.ndarray, per_row: torch.Tensor) -> torch.Tensor:
        """Keep only the rows where `keep` is true (the LM frees the others' cache); narrows `per_row` too."""
        self.rows, self.params, self.stops, self.stream = (
            self.rows[keep],
            self.params.take(keep),
            self.stops[keep],
            self.stream[keep],
        )
        index = torch.from_numpy(np.flatnonzero(keep))
        if self.rows.size:
            self.state = lm.keep(self.state, index)
        return per_row.index_select(0, index.to(per_row.device))


def _step_params(params: RowParams, step: int) -> RowParams:
    """The rows' parameters for one step: seeded rows get the step's derived seed."""
    seeds = rng.step_seeds(torch.from_numpy(params.seed.view(np.int64)), step).numpy()
    return replace(params, seed=np.where(params.has_seed, seeds.view(np.uint64), params.seed))


def _stop_matrix(requests: list[GenerationRequest], eos_ids: tuple[int, ...]) -> np.ndarray:
    """[rows, S] ids that end each row (its stop ids, plus EOS unless ignored), -1 padded."""
    lists = [np.concatenate([r.stop_token_ids, [] if r.ignore_eos else list(eos_ids)]) for r in requests]
    matrix = np.full((len(lists), max(1, max(len(ids) for ids in lists))), -1, np.int64)
    for i, ids in enumerate(lists):  # once per batch, not per step
        matrix[i, : len(ids)] = ids
    return matrix


def _chunk_of(arrays: dict[str, np.ndarray], i: int, finish_reason: str) -> GenerationChunk:
    """Row i of one step's sampler outputs as a one-token chunk."""
    return GenerationChunk({name: value[i : i + 1] for name, value in arrays.items()}, finish_reason)


class _Buffers:
    """Per-request outputs of non-streamed requests, filled one step (column) at a time."""

    def __init__(self, requests, rows: np.ndarray, max_steps: int, width: int):
        slots = len(requests)
        self.ids = np.zeros((slots, max_steps), np.int32)
        self.logprobs = np.zeros((slots, max_steps), np.float32)
        self.mask_len = np.zeros((slots, max_steps), np.int32)
        self.mask_logprobs = np.zeros((slots, max_steps), np.float32)
        # Mask rows are kept only for non-streamed requests that asked (a response carries them anyway).
        wants = [int(r) for r in rows if requests[r].params.return_sampling_mask[0] and not requests[r].stream]
        self.mask_slot = np.full(slots, -1, np.int64)
        self.mask_slot[wants] = np.arange(len(wants))
        self.masks = np.full((len(wants), max_steps, width), -1, np.int32)
        self.support_logprobs = np.full((len(wants), max_steps, width), -np.inf, np.float32)
        self.width = width

    def write(self, rows: np.ndarray, step: int, result) -> dict[str, np.ndarray]:
        """Store one step's outputs of `rows`; returns them as numpy arrays (row-aligned)."""
        arrays = outputs_to_numpy(result)
        self.ids[rows, step] = arrays[OUTPUT_IDS.name]
        self.logprobs[rows, step] = arrays[OUTPUT_LOGPROBS.name]
        self.mask_len[rows, step] = arrays[SAMPLING_MASK_LEN.name]
        self.mask_logprobs[rows, step] = arrays[SAMPLING_LOGPROBS.name]
        slots = self.mask_slot[rows]
        stored = slots >= 0
        if stored.any():
            self.masks[slots[stored], step] = arrays[SAMPLING_MASK.name][stored]
            self.support_logprobs[slots[stored], step] = arrays[SAMPLING_MASK_LOGPROBS.name][stored]
        return arrays

    def chunk(self, row: int, length: int, finish_reason: str) -> GenerationChunk:
        """The first `length` tokens of request `row`."""
        slot = self.mask_slot[row]
        mask = self.masks[slot, :length] if slot >= 0 else np.full((length, self.width), -1, np.int32)
        support = (
            self.support_logprobs[slot, :length] if slot >= 0 else np.full((length, self.width), -np.inf, np.float32)
        )
        outputs = {
            OUTPUT_IDS.name: self.ids[row, :length].copy(),
            OUTPUT_LOGPROBS.name: self.logprobs[row, :length].copy(),
            SAMPLING_MASK.name: mask.copy(),
            SAMPLING_MASK_LEN.name: self.mask_len[row, :length].copy(),
            SAMPLING_LOGPROBS.name: self.mask_logprobs[row, :length].copy(),
            SAMPLING_MASK_LOGPROBS.name: support.copy(),
        }
        return GenerationChunk(outputs, finish_reason)
