"""Running generations for the API: token-id prompts to the generate model through
`AsyncGenerateClient`, and its chunks turned into text deltas, stop strings applied.

Every sequence goes in a client call of its own, once its turn comes (admission.py: the engine
holds so many sequences at once, and a request asking for many does not hold back the others); a
sequence with stop strings is streamed, so that the API can cancel it on the server the moment its
text reaches a stop string. Every sequence yields `Delta`s: its new tokens (the generate model's
outputs, aligned 1:1), the text they complete, and on its last one why it finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field

from ..client import AsyncGenerateClient, GenerateResult, SampleResult, concatenate_tokens
from ..client.generate_client import RequestTimings
from ..client.sampling_params import SamplingParams
from ..sampling.outputs import (
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    SAMPLING_LOGPROBS,
    SAMPLING_MASK,
    SAMPLING_MASK_LEN,
    SAMPLING_MASK_LOGPROBS,
    TIMING_OUTPUTS,
    WEIGHT_VERSION,
)
from .errors import bad_request
from .text import IncrementalDetokenizer, StopStrings, ids_decoder

FINISH_STOP, FINISH_LENGTH = "stop", "length"
FINISH_ABORT = "abort"  # an abort request stopped it (plugin/api/in_flight.py)
# The outputs every sequence receives (each token's weight version too: SGLang's meta_info and
# vLLM's weight_versions report them), and those a mask request adds.
PLAIN_OUTPUTS = (OUTPUT_IDS.name, OUTPUT_LOGPROBS.name, WEIGHT_VERSION.name)
MASK_OUTPUTS = (SAMPLING_MASK.name, SAMPLING_MASK_LEN.name, SAMPLING_LOGPROBS.name, SAMPLING_MASK_LOGPROBS.name)
# The per-request timings a request with `return_timings` adds (sent on its last response).
TIMING_NAMES = tuple(spec.name for spec in TIMING_OUTPUTS)


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: its prompt ids, sampling parameters, budget and stop rules."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    return_timings: bool = False  # ask the generate model for the request's timings
    # vLLM's include_stop_str_in_output / SGLang's no_stop_trim: the text keeps the stop string, or
    # the text of the stop token (EOS or a stop id) that ended it; both leave it out by default.
    keep_stop_text: bool = False
    # vLLM's min_tokens / SGLang's min_new_tokens: no stop string ends the sequence before this many
    # tokens (the routes admit it above 0 only where no EOS or stop id can end it earlier).
    min_tokens: int = 0
    spaces_between_special_tokens: bool = True
    # slime's custom_params.return_top_p_token_ids: the masks also as meta_info.top_p_token_ids / _offsets
    top_p_token_ids: bool = False


def check_min_tokens(min_tokens: int, ignore_eos: bool, stop_token_ids, field: str) -> None:
    """min_tokens above 0 is honoured where only stop strings could end a sequence early (the API
    holds them back): the generate model cannot forbid EOS or stop ids for the first tokens."""
    if min_tokens and (not ignore_eos or stop_token_ids):
        raise bad_request(
            f"{field} > 0 needs ignore_eos true and no stop_token_ids: the generate model cannot keep EOS or stop "
            "ids from being sampled before the minimum",
            field,
        )


@dataclass
class Delta:
    """New tokens of one sequence (its position `index` in the request) and their text."""

    index: int
    tokens: SampleResult  # the generate model's outputs for these tokens (mask fields None unless asked)
    text: str  # text released by these tokens (a stream holds back a possible stop string's start)
    token_texts: list[str]  # each token's own piece of the text (what it completed)
    weight_versions: list[str]  # the weights that sampled each of these tokens
    finish_reason: str | None = None  # "stop" or "length" on the sequence's last delta
    stop_reason: int | str | None = None  # the stop string or stop id that ended it (None for EOS)
    # On the last delta of a sequence the engine ended, when asked: the generate model's timings
    # (queue_time_s, time_to_first_token_s, generation_time_s); None for one a stop string ended.
    timings: RequestTimings | None = None


@dataclass
class SequenceResult:
    """A whole sequence: every token's outputs, its text and why it finished."""

    index: int
    tokens: SampleResult
    text: str
    token_texts: list[str]
    finish_reason: str
    stop_reason: int | str | None
    prompt_ids: tuple[int, ...] = ()
    timings: RequestTimings | None = None  # as Delta.timings
    weight_versions: list[str] = field(default_factory=list)  # one per token


def _slice(result: SampleResult, stop: int) -> SampleResult:
    """The first `stop` tokens of a result (the result itself when it holds no more)."""
    if stop >= len(result.output_ids):
        return result
    fields = SampleResult.__dataclass_fields__
    return SampleResult(**{n: (None if getattr(result, n) is None else getattr(result, n)[:stop]) for n in fields})


@dataclass
class _SequenceState:
    """One sequence's text so far: the detokenizer, the stop strings, what was released."""

    request: SequenceRequest
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    text: str = ""
    released: int = 0
    count: int = 0  # tokens fed so far
    finished: bool = False
    token_texts: list[str] = field(default_factory=list)

    def feed(self, index: int, chunk: GenerateResult) -> Delta:
        """The delta of one chunk; a stop string in its text ends the sequence at the token that
        completed it (later tokens of the chunk are dropped), the text cut before the string (after
        it with keep_stop_text). The text of a stop token that ended the sequence is left out
        unless keep_stop_text, as vLLM and SGLang leave it out."""
        request = self.request
        ids = chunk.output_ids.tolist()
        trim_last = chunk.finish_reason == FINISH_STOP and bool(ids) and not request.keep_stop_text
        pieces, kept, match = [], len(ids), None
        for position, token_id in enumerate(ids):
            self.count += 1
            if trim_last and position == len(ids) - 1:
                pieces.append(self.detokenizer.decode([token_id]))  # its own text, kept out of the text
                break
            piece = self.detokenizer.push(token_id)
            new_from = len(self.text)
            self.text += piece
            pieces.append(piece)
            if self.count >= request.min_tokens:
                match = self.stops.search(self.text, new_from)
            if match is not None:
                kept = position + 1
                break
        finish, reason, timings = None, None, None
        if match is not None:
            end = match.position + (len(match.string) if request.keep_stop_text else 0)
            self.text = self.text[:end]
            finish, reason = FINISH_STOP, match.string
        elif chunk.finish_reason:
            tail = self.detokenizer.flush()
            self.text += tail
            if pieces and not trim_last:
                pieces[-1] += tail
            finish = chunk.finish_reason
            last = ids[-1] if ids else None
            reason = last if finish == FINISH_STOP and last in request.stop_token_ids else None
            timings = chunk.timings
        self.finished = finish is not None
        end = len(self.text) if self.finished else max(self.released, len(self.text) - self.stops.hold_back)
        released, self.released = self.text[self.released : end], end
        self.token_texts.extend(pieces)
        versions = [] if chunk.weight_version is None else chunk.weight_version[:kept].tolist()
        return Delta(index, _slice(chunk, kept), released, pieces, versions, finish, reason, timings)


def _outputs(requests: list[SequenceRequest]) -> tuple[str, ...]:
    masks = any(r.params.return_sampling_mask for r in requests)
    timings = any(r.return_timings for r in requests)
    return PLAIN_OUTPUTS + (MASK_OUTPUTS if masks else ()) + (TIMING_NAMES if timings else ())


class SequenceRunner:
    """Runs a request's sequences on the generate model; see the module docstring."""

    def __init__(self, client: AsyncGenerateClient, tokenizer, admission=None):
        """`admission`: an async callable giving the FairAdmission sequences wait in (or None)."""
        self.client, self.tokenizer, self._admission = client, tokenizer, admission
        self._decoders = {
            (skip, spaces): ids_decoder(tokenizer, skip, spaces) for skip in (False, True) for spaces in (False, True)
        }

    def _state(self, request: SequenceRequest) -> _SequenceState:
        key = (request.skip_special_tokens, request.spaces_between_special_tokens)
        return _SequenceState(
            request,
            IncrementalDetokenizer(self.tokenizer, *key, self._decoders[key]),
            StopStrings(request.stop_strings, request.keep_stop_text),
        )

    @asynccontextmanager
    async def _share(self):
        """This request's share of the admission (None without one), given up at its end."""
        admission = await self._admission() if self._admission is not None else None
        share = admission.share() if admission is not None else None
        try:
            yield share
        finally:
            if share is not None:
                admission.leave(share)

    @staticmethod
    def _slot(share, request: SequenceRequest):
        """The sequence's turn in the engine (at once without an admission)."""
        if share is None:
            return nullcontext()
        return share.slot(len(request.prompt_ids) + request.max_new_tokens)

    async def stream(self, requests: list[SequenceRequest]) -> AsyncIterator[Delta]:
        """Every sequence's deltas as they come (one per generated token), in arrival order."""
        async with self._share() as share:
            producers = [self._sequence(i, request, share) for i, request in enumerate(requests)]
            async for delta in _merge(producers):
                yield delta

    async def _sequence(self, index: int, request: SequenceRequest, share):
        """One sequence streamed in a call of its own, once admitted."""
        state = self._state(request)
        async with self._slot(share, request):
            chunks = self.client.stream(
                [list(request.prompt_ids)],
                [request.params],
                [request.max_new_tokens],
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                outputs=_outputs([request]),
            )
            async with chunks:  # leaving early (a stop string, a cancelled request) cancels it on the server
                async for chunk in chunks:
                    yield state.feed(index, chunk)
                    if state.finished:
                        return

    async def generate(self, requests: list[SequenceRequest]) -> list[SequenceResult]:
        """Every sequence to its end, each in a non-streamed call of its own (one response);
        sequences with stop strings are streamed, to be cancelled at their string."""
        if any(r.stop_strings for r in requests):
            return await collect(self.stream(requests), requests)
        results: list[SequenceResult | None] = [None] * len(requests)

        async def run(index: int, request: SequenceRequest, share) -> None:
            async with self._slot(share, request):
                (answer,) = await self.client.generate(
                    [list(request.prompt_ids)],
                    [request.params],
                    [request.max_new_tokens],
                    stop_token_ids=request.stop_token_ids,
                    ignore_eos=request.ignore_eos,
                    outputs=_outputs([request]),
                )
            delta = self._state(request).feed(index, answer)
            results[index] = SequenceResult(
                index,
                delta.tokens,
                delta.text,
                delta.token_texts,
                delta.finish_reason,
                delta.stop_reason,
                request.prompt_ids,
                delta.timings,
                delta.weight_versions,
            )

        async with self._share() as share:
            await _gather_or_cancel([run(i, request, share) for i, request in enumerate(requests)])
        return results


async def collect(deltas: AsyncIterator[Delta], requests: list[SequenceRequest]) -> list[SequenceResult]:
    """The whole sequences of a stream of deltas."""
    parts: list[list[Delta]] = [[] for _ in requests]
    async for delta in deltas:
        parts[delta.index].append(delta)
    results = []
    for index, (request, pieces) in enumerate(zip(requests, parts)):
        last = pieces[-1]
        results.append(
            SequenceResult(
                index,
                concatenate_tokens([p.tokens for p in pieces]),
                "".join(p.text for p in pieces),
                [t for p in pieces for t in p.token_texts],
                last.finish_reason,
                last.stop_reason,
                request.prompt_ids,
                last.timings,
                [v for p in pieces for v in p.weight_versions],
            )
        )
    return results


async def _gather_or_cancel(coroutines) -> list:
    """Run coroutines together; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(producers: list) -> AsyncIterator:
    """The items of several async iterators in arrival order; the first failure cancels the
    others and is raised; leaving early cancels them all."""
    if len(producers) == 1:  # the common case: no task, no queue
        try:
            async for item in producers[0]:
                yield item
        finally:
            await producers[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(producer) -> None:
        try:
            async for item in producer:
                queue.put_nowait(item)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(drain(p)) for p in producers]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
                failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed.exception()
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
