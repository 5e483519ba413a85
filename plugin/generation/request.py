"""A generation request, the chunks its results come in, and the rules every request follows:
its checks, the ids that end it, and the seed of each of its steps."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..sampling import rng
from ..sampling.outputs import GENERATION_TOKEN_OUTPUT_NAMES, padding
from ..sampling.params import RowParams
from ..sampling.validation import MaskPolicy, SamplingRequestError, check_rows

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
# Most stop ids one request may carry: every id is read and checked on the instance's one thread,
# so a list millions long would hold every other request's `execute` while it is.
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class GenerationRequest:
    """One prompt to continue, already checked by `check_generation_request`."""

    prompt: np.ndarray  # int64 [L], L >= 1
    max_new_tokens: int
    stop_token_ids: np.ndarray  # int64 [S]
    ignore_eos: bool
    stream: bool
    params: RowParams  # one row


@dataclass
class GenerationChunk:
    """Tokens of one request with their sampler outputs, aligned 1:1: `outputs` holds every token
    output of `outputs.GENERATION_TOKEN_OUTPUTS` by name ([n] per token, [n, W] per mask row) as
    sent (`outputs.to_wire_values`), and `finish_reason` is "" until the request's last chunk,
    then "length" or "stop"."""

    outputs: dict[str, np.ndarray]
    finish_reason: str
    steps: list | None = None  # the final chunk of a request whose steps are traced: its engine.StepSpans

    def __getitem__(self, name: str) -> np.ndarray:
        return self.outputs[name]

    @classmethod
    def empty(cls, width: int, finish_reason: str) -> GenerationChunk:
        """No tokens (a request with max_new_tokens 0)."""
        return cls({name: padding(name, 0, width) for name in GENERATION_TOKEN_OUTPUT_NAMES}, finish_reason)

    @classmethod
    def joined(cls, chunks: list[GenerationChunk]) -> GenerationChunk:
        """Consecutive chunks of one request as one: their tokens in order, and the last one's
        request-level outputs (timings), finish reason and steps."""
        if len(chunks) == 1:
            return chunks[0]
        last = chunks[-1]
        outputs = dict(last.outputs)
        for name in GENERATION_TOKEN_OUTPUT_NAMES:
            if name in last.outputs:
                outputs[name] = np.concatenate([chunk.outputs[name] for chunk in chunks])
        return cls(outputs, last.finish_reason, last.steps)


def check_generation_request(
    prompt: np.ndarray, max_new_tokens: int, stop_token_ids: np.ndarray, vocab_size: int, context_length: int
) -> None:
    """Raise SamplingRequestError (naming the field) for a prompt or budget the LM cannot serve."""
    if prompt.size == 0:
        raise SamplingRequestError("input_ids", "input_ids must hold at least one token id")
    if stop_token_ids.size > MAX_STOP_TOKEN_IDS:
        raise SamplingRequestError(
            "stop_token_ids",
            f"stop_token_ids holds {stop_token_ids.size} ids; at most {MAX_STOP_TOKEN_IDS} are accepted",
        )
    for field, ids in (("input_ids", prompt), ("stop_token_ids", stop_token_ids)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise SamplingRequestError(field, f"{field} must be token ids in [0, {vocab_size}), got {bad}")
    if max_new_tokens < 0:
        raise SamplingRequestError("max_new_tokens", f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if prompt.size + max_new_tokens > context_length:
        raise SamplingRequestError(
            "max_new_tokens",
            f"prompt length {prompt.size} + max_new_tokens {max_new_tokens} exceeds the model's context "
            f"length {context_length}",
        )


def admission_errors(requests: list[GenerationRequest], vocab_size: int, policy: MaskPolicy) -> list[str | None]:
    """The sampler's rules (ranges, mask admission) for every request at once, before any token:
    its error message, or None when it may be generated."""
    if not requests:
        return []
    params = RowParams.concatenate([r.params for r in requests])
    errors = check_rows(params, None, vocab_size, policy)
    return [None if e is None else e.message for e in errors]


def stop_ids(request: GenerationRequest, eos_ids: tuple[int, ...]) -> np.ndarray:
    """The sorted ids that end `request` (finish "stop"): its stop ids, plus EOS unless ignored."""
    ids = [int(t) for t in request.stop_token_ids] + ([] if request.ignore_eos else list(eos_ids))
    return np.array(sorted(set(ids)), np.int64)


def step_params(params: RowParams, steps: np.ndarray) -> RowParams:
    """The rows' parameters for one sampler call, row i at its own step `steps[i]`: a seeded row
    samples with `rng.step_seeds(seed, step)`, so its tokens depend on (seed, step) only."""
    if not params.has_seed.any():
        return params
    stepped = rng.step_seeds_numpy(params.seed, steps).view(np.uint64)
    return replace(params, seed=np.where(params.has_seed, stepped, params.seed))
