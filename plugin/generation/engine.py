"""Continuous (in-flight) batching: one background loop owns the LM batch of a model instance
(the only generation loop of the `generate` model).

`submit` only enqueues (or refuses at once, `EngineFull`, beyond the configured bounds). Every
step the loop asks each active request once whether it was cancelled, runs one LM forward pass
for the rows in flight (each row's last token, plus its drafted tokens under speculative
decoding), prefills the admitted waiting requests together and merges them into the batch
(`CausalLM.merge`), runs one sampler call over every row's positions, hands each row's tokens to
its request's handle and retires finished, cancelled or failed rows at once (their KV-cache rows
are dropped). A row's step counter is its own, and every row is seeded (an unseeded request gets
a fresh seed at admission), so step s of a row samples with `rng.step_seeds(seed, s)` whenever it
joined: its tokens do not depend on its batch-mates.

Speculative decoding (a `drafter`, on an LM that can `decode_many` and `rollback`): the tokens a
row drafts at step s are fed with its last token in the same forward pass; position i is
sampled with step s + i's seed, exactly as plain decoding would sample it, and a drafted token
is kept only if it is the token sampled before it; the first sampled token that differs (or the
one after the last draft) is emitted too, and the rejected drafts leave the cache. Each step
emits 1 to 1 + drafts tokens per row: the tokens, masks and log-probs of plain decoding.

Weight updates (`update_weights`) happen between two steps, with the loop paused, in one of
SGLang's pause modes (`PAUSE_MODES`): "abort" ends every request in flight or waiting with a
retryable error, "finish" lets the rows in flight finish on the old weights while new requests
wait, "in_place" keeps the rows in flight and recomputes their KV cache on the new weights, so
every later token is the new weights' own. Every token carries the weight version it was
sampled with (`weight_version`). `pause` / `resume` hold and release the loop on their own.
No Triton here: results go through a `RequestHandle`, counters through an `EngineObserver`.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from ..sampling.batching import BatchSampler, outputs_to_numpy
from ..sampling.outputs import (
    GENERATION_TOKEN_OUTPUT_NAMES,
    MASK_OUTPUT_NAMES,
    NEG_INF_FILLED,
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    SAMPLING_LOGPROBS,
    SAMPLING_SEED,
    TIMING_OUTPUTS,
    UNMASKED_OUTPUT_NAMES,
    WEIGHT_VERSION,
    padding,
    to_wire_values,
)
from ..sampling.params import RowParams
from ..sampling.refusals import RETRY_MARKER
from ..sampling.results import ROW_MAX
from ..sampling.validation import SamplingRequestError, check_logit_rows
from .drafting import PAD, NgramDrafter, TokenHistory
from .lm import CausalLM, can_merge, can_speculate
from .request import FINISH_LENGTH, FINISH_STOP, GenerationChunk, GenerationRequest, step_params, stop_ids

# How a weight update (or a pause) treats the requests in flight, as SGLang's pause_generation modes.
ABORT, FINISH, IN_PLACE = "abort", "finish", "in_place"
PAUSE_MODES = (ABORT, FINISH, IN_PLACE)
DEFAULT_WEIGHT_VERSION = "default"


class EngineFull(Exception):
    """A request refused at submission (the engine's bounds, or the engine is stopping)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class EngineLimits:
    """Bounds of one engine: rows decoded together, KV positions reserved, and what may wait for
    a slot: requests (each holds a Triton request, its inputs and a response sender) and the
    prompt tokens they hold (the prefill work queued)."""

    max_active_sequences: int = 32
    max_waiting: int = 4096
    kv_budget_tokens: int = 32 * 512  # each request reserves prompt + max_new_tokens positions
    max_waiting_tokens: int = 1 << 20

    def __post_init__(self):
        for name in ("max_active_sequences", "max_waiting", "kv_budget_tokens", "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"config parameter {name!r} must be >= 1, got {getattr(self, name)}")


class RequestHandle(Protocol):
    """Where one request's results go (called from the engine thread).

    A handle whose `traces_steps` attribute is true (optional; false when absent) also gets the
    request's `StepSpan`s on its final chunk (`GenerationChunk.steps`), for its trace."""

    def is_cancelled(self) -> bool: ...

    def send(self, chunk: GenerationChunk, final: bool) -> None: ...

    def cancelled(self, tokens: int) -> None: ...

    def fail(self, message: str, code_name: str = "INTERNAL") -> None: ...


@dataclass(frozen=True)
class StepSpan:
    """One engine step as one traced request saw it: when the step began and when its sampling
    ended (epoch ns, as OpenTelemetry's), how many rows the step ran, and this request's tokens
    emitted, drafted and accepted in it."""

    start_ns: int
    end_ns: int
    batch_rows: int
    emitted: int
    drafted: int
    accepted: int


@dataclass(frozen=True)
class StepRecord:
    """What one engine step measured, as arrays (no per-token work to build them): the time to
    first token of the rows that emitted their first token, the time since the previous step of
    the rows that emitted later tokens, the end-to-end time of the requests that finished, how
    many finished for each reason, and log(kept mass) = output_logprob - sampling_logprob of each
    emitted token whose request asked for a mask."""

    first_token_s: np.ndarray
    inter_token_s: np.ndarray
    e2e_s: np.ndarray
    finished: dict[str, int]
    log_kept_mass: np.ndarray


class EngineObserver(Protocol):
    """Counters, gauges and timings of an engine (the serving layer turns them into metrics)."""

    def generated(self, tokens: int) -> None: ...

    def admitted(self, queue_seconds: np.ndarray, prompt_tokens: int) -> None:
        """The requests one step admitted: each one's wait since submission, their prompt tokens."""
        ...

    def stepped(self, step: StepRecord) -> None: ...

    def occupancy(self, active: int, waiting: int, kv_tokens: int) -> None: ...

    def speculated(self, drafts: int, drafted: int, accepted: int) -> None:
        """One step's speculation: rows that drafted, tokens drafted, drafted tokens accepted."""
        ...


@dataclass
class _Sequence:
    """One admitted request: its handle, its own step counter and (non-streamed) its outputs so far."""

    request: GenerationRequest
    handle: RequestHandle
    enqueued: float
    stops: np.ndarray
    step: int = 0
    admitted_at: float = 0.0  # when it joined the batch (monotonic seconds, as the others)
    first_token_at: float = 0.0
    last_token_at: float = 0.0  # when its latest token was sampled
    tokens: list = field(default_factory=list)  # ids generated so far (to recompute the cache after an update)
    parts: list = field(default_factory=list)  # per step: dict of that step's tokens' outputs (non-streamed)
    steps: list[StepSpan] | None = None  # the steps it took part in, when its handle traces them

    @cached_property
    def stop_set(self) -> frozenset[int]:  # for membership tests in Python, once per emitted token
        return frozenset(self.stops.tolist())

    @property
    def reserved(self) -> int:
        return int(self.request.prompt.size + self.request.max_new_tokens)

    @property
    def cached(self) -> int:
        return int(self.request.prompt.size + self.step)


class ContinuousEngine:
    """The background generation loop of one model instance (start with `start`, end with `stop`)."""

    def __init__(
        self,
        lm: CausalLM,
        sampler: BatchSampler,
        limits: EngineLimits,
        observer: EngineObserver,
        log_error: Callable[[str], None] = print,
        drafter: NgramDrafter | None = None,
        weight_version: str = DEFAULT_WEIGHT_VERSION,
    ):
        self.lm, self.sampler, self.limits, self.observer, self.log_error = lm, sampler, limits, observer, log_error
        self.width = sampler.policy.mask_width
        self._merges = can_merge(self.lm)
        # An LM that cannot verify several tokens in one pass decodes one at a time.
        self.drafter = drafter if can_speculate(self.lm) else None
        # Unseeded requests draw their seed here at admission (all 2**64 streams reachable).
        self._entropy = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._waiting_tokens = 0  # prompt tokens of the waiting requests
        self._stopping = False
        self._rows: list[_Sequence] = []  # the decode batch, aligned with _state, _last and _params
        self._state = None  # the LM's cache: each row's tokens but its last
        self._last: torch.Tensor | None = None  # int64 [rows]: each row's last token, fed next step
        self._params: RowParams | None = None  # every row seeded
        self._history = TokenHistory() if self.drafter else None  # what the drafter looks in
        self._reserved = 0
        self.weight_version = weight_version  # tags every token sampled until the next update
        self._version_tag = np.array([weight_version.encode()], dtype=WEIGHT_VERSION.dtype)
        self._pause_mode: str | None = None  # a pause asked for and not yet reached
        self._pause_reason = ""
        self._draining = False  # "finish": rows in flight finish, nothing new is admitted
        self._paused = False  # the loop holds between two steps; requests wait
        self._updating = threading.Lock()  # one weight update at a time
        self._thread = threading.Thread(target=self._run, name="generate-engine", daemon=True)

    def start(self) -> ContinuousEngine:
        """Start the loop thread (requests submitted before wait for it); returns the engine."""
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest, handle: RequestHandle) -> None:
        """Queue a checked request; raises EngineFull (nothing sent) when it cannot be taken now,
        SamplingRequestError when it can never be (larger than the whole KV budget)."""
        if request.max_new_tokens == 0:  # nothing to generate: answered here, no slot taken
            handle.send(GenerationChunk.empty(self.width, FINISH_LENGTH), final=True)
            return
        never = self.never_fits(request)
        if never is not None:
            raise SamplingRequestError("max_new_tokens", never)
        sequence = _Sequence(request, handle, time.monotonic(), stop_ids(request, self.lm.eos_token_ids))
        if getattr(handle, "traces_steps", False):
            sequence.steps = []
        prompt_tokens = int(request.prompt.size)
        with self._cv:
            if self._stopping:
                raise EngineFull(f"the generate model is shutting down; {RETRY_MARKER}")
            if len(self._waiting) >= self.limits.max_waiting:
                raise EngineFull(
                    f"generate is at capacity: {len(self._waiting)} requests already wait "
                    f"(max_waiting {self.limits.max_waiting}); {RETRY_MARKER}"
                )
            # The head of an empty queue is always taken, so no prompt is refused for good.
            if self._waiting and self._waiting_tokens + prompt_tokens > self.limits.max_waiting_tokens:
                raise EngineFull(
                    f"generate is at capacity: {self._waiting_tokens} prompt tokens already wait and this "
                    f"prompt has {prompt_tokens} (max_waiting_tokens {self.limits.max_waiting_tokens}); {RETRY_MARKER}"
                )
            self._waiting.append(sequence)
            self._waiting_tokens += prompt_tokens
            self._cv.notify_all()

    def never_fits(self, request: GenerationRequest) -> str | None:
        """Why `request` can never be admitted here (it needs more than the whole KV budget), or None."""
        if request.prompt.size + request.max_new_tokens <= self.limits.kv_budget_tokens:
            return None
        return (
            f"prompt length {request.prompt.size} + max_new_tokens {request.max_new_tokens} exceeds "
            f"this instance's KV budget of {self.limits.kv_budget_tokens} tokens (kv_budget_tokens)"
        )

    def stop(
        self, message: str = f"the generate model was unloaded before this request finished; {RETRY_MARKER}"
    ) -> None:
        """End the loop after its current step; every request not yet finished gets `message` as its final."""
        with self._cv:
            self._stopping = True
            self._stop_message = message
            self._cv.notify_all()
        self._thread.join()

    @property
    def paused(self) -> bool:
        """Whether the loop holds between two steps (requests wait; nothing is generated)."""
        return self._paused

    def pause(self, mode: str = IN_PLACE, reason: str = "pause_generation") -> None:
        """Hold the loop between two steps, the requests in flight treated as `mode` says (one of
        PAUSE_MODES; `reason` ends up in an aborted request's message); returns once it holds.
        New requests are queued meanwhile (within the bounds) and start after `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._cv:
            if self._paused:
                return
            self._pause_mode, self._pause_reason = mode, reason
            self._cv.notify_all()
            while not self._paused and not self._stopping:
                self._cv.wait()

    def resume(self) -> None:
        """Let a paused loop go on (a no-op when it is not paused)."""
        with self._cv:
            self._paused, self._pause_mode, self._draining = False, None, False
            self._cv.notify_all()

    def update_weights(self, apply: Callable[[], object], version: str, mode: str = IN_PLACE) -> object:
        """Pause the loop in `mode`, run `apply()` (which writes the new weights into the LM, or
        raises with nothing written), tag every later token `version`, and resume unless the loop
        was paused before. In "in_place" mode the rows in flight get their KV cache recomputed on
        the new weights. Returns what `apply` returned; its exception passes through, the old
        weights and version left serving."""
        with self._updating:
            was_paused = self._paused
            self.pause(mode, f"the weight update to version {version!r}")
            try:
                outcome = apply()
                self._set_version(version)
                if self._rows:
                    self._recompute_cache()
                return outcome
            finally:
                if not was_paused:
                    self.resume()

    def _set_version(self, version: str) -> None:
        self.weight_version = version
        self._version_tag = np.array([version.encode()], dtype=WEIGHT_VERSION.dtype)

    def _recompute_cache(self) -> None:
        """The rows' KV cache rebuilt by the LM as it is now (the loop holds: nothing else touches
        it): each row's prompt and tokens but its last, which is fed at the next step as ever."""
        prefixes = [
            torch.from_numpy(np.concatenate([s.request.prompt, np.asarray(s.tokens[:-1], np.int64)]))
            for s in self._rows
        ]
        _, self._state = self.lm.prefill(prefixes)

    # The loop (engine thread only below this line).

    def _hold(self) -> bool:
        """Wait (under the lock) until there is a step to run; False when the loop must end. A pause
        asked for is reached here, between two steps."""
        while not self._stopping:
            if self._pause_mode is not None and not self._paused:
                self._enter_pause()
            if self._paused or (self._draining and not self._rows) or not (self._waiting or self._rows):
                self._cv.wait()
                continue
            return True
        return False

    def _enter_pause(self) -> None:
        mode = self._pause_mode
        if mode == ABORT:
            message = f"generation aborted by {self._pause_reason}; {RETRY_MARKER}"
            for sequence in self._rows + list(self._waiting):
                _quietly(sequence.handle.fail, message, "UNAVAILABLE")
            self._waiting.clear()
            self._waiting_tokens = 0
            self._reset()
        if mode == FINISH and self._rows:
            self._draining = True  # paused once the last row in flight finishes
            return
        self._paused, self._draining = True, False
        self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._hold():
                    break
                newcomers = [] if self._draining else self._admit()
            try:
                self._step(newcomers)
            except Exception as exc:  # an internal fault: end this batch's requests, keep serving
                self.log_error(f"generate engine step failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                for sequence in {id(s): s for s in self._rows + newcomers}.values():
                    _quietly(
                        sequence.handle.fail, f"internal generate error ({type(exc).__name__}); see the server log"
                    )
                self._reset()
            try:
                self._report()
            except Exception as exc:  # a metric update failed: the requests matter more
                self.log_error(f"generate engine metrics not updated: {type(exc).__name__}: {exc}")
        with self._cv:
            leftovers = self._rows + list(self._waiting)
            self._waiting.clear()
        for sequence in leftovers:
            _quietly(sequence.handle.fail, self._stop_message, "UNAVAILABLE")
        self._reset()
        _quietly(self._report)

    def _admit(self) -> list[_Sequence]:
        """Waiting requests (FIFO) that fit the free slots and the KV budget (called under the lock)."""
        if self._rows and not self._merges:  # this LM cannot merge states: new batch only when empty
            return []
        newcomers, reserved = [], self._reserved
        while self._waiting and len(self._rows) + len(newcomers) < self.limits.max_active_sequences:
            need = self._waiting[0].reserved
            if reserved + need > self.limits.kv_budget_tokens:
                break  # FIFO: no overtaking, so a large request is never starved
            newcomers.append(self._waiting.popleft())
            self._waiting_tokens -= newcomers[-1].request.prompt.size
            reserved += need
        return newcomers

    def _step(self, newcomers: list[_Sequence]) -> None:
        started_ns = time.time_ns()  # a traced request's step span begins here
        # Every handle is asked every step; one whose question is costly paces it itself (the
        # Triton handle asks tritonserver at most once per serving.generate_model.CANCEL_CHECK_INTERVAL_S).
        cancelled = [s.handle.is_cancelled() for s in self._rows]
        self._drop(np.array(cancelled, bool), cancel=True)
        fresh = []
        for sequence in newcomers:
            if sequence.handle.is_cancelled():
                sequence.handle.cancelled(0)
            else:
                fresh.append(sequence)
        drafts = self._draft() if self._rows else None  # [in flight, K], PAD-padded, or None
        logits = [self._forward(drafts)] if self._rows else []
        in_flight = len(self._rows)
        if fresh:
            logits.append(self._join(fresh))
        if not self._rows:
            return
        drafted = np.zeros(len(self._rows), np.int64)  # fresh rows draft nothing in their first step
        if drafts is not None:
            drafted[:in_flight] = (drafts != PAD).sum(axis=1)
        self._emit(torch.cat(logits) if len(logits) > 1 else logits[0], drafts, drafted, started_ns)

    def _draft(self) -> np.ndarray | None:
        """Each in-flight row's drafted tokens (at most what its budget can still use), or None when
        no row drafts this step."""
        if self.drafter is None or not self.drafter.drafts_for(len(self._rows)):
            return None
        room = np.array([s.request.max_new_tokens - s.step - 1 for s in self._rows])  # after the sure token
        drafts = self.drafter.propose(self._history.tokens, self._history.lengths, room)
        return drafts if (drafts != PAD).any() else None

    def _forward(self, drafts: np.ndarray | None) -> torch.Tensor:
        """One LM pass over the in-flight rows' last tokens (and drafts): the logits of every
        position to sample, [sum over rows of 1 + drafts, V], row by row."""
        if drafts is None:
            return self.lm.decode(self._state, self._last)
        tokens = torch.cat([self._last.unsqueeze(1), torch.from_numpy(np.maximum(drafts, 0))], dim=1)
        lengths = torch.from_numpy(1 + (drafts != PAD).sum(axis=1))
        return self.lm.decode_many(self._state, tokens, lengths)

    def _emit(self, logits: torch.Tensor, drafts: np.ndarray | None, drafted: np.ndarray, started_ns: int) -> None:
        """Sample every position of every row in one call, keep each row's drafts up to the first
        one plain decoding would not have drawn, send the tokens, retire finished rows and roll
        the rejected drafts out of the cache."""
        rows = len(self._rows)
        positions = drafted + 1
        owner = np.repeat(np.arange(rows), positions)  # the row of each sampled position
        first = np.cumsum(positions) - positions
        within = np.arange(owner.size) - first[owner]
        steps = np.array([s.step for s in self._rows])
        enqueued = np.array([s.enqueued for s in self._rows])
        last_at = np.array([s.last_token_at for s in self._rows])
        params = self._params if owner.size == rows else self._params.take(owner)
        result = self.sampler.sample(logits, step_params(params, steps[owner] + within))
        # The sampler returns each row's max with its outputs: positions whose logits the LM broke
        # (NaN, +inf, all -inf) are found here, without a separate pass over the logits.
        broken = ~np.equal(check_logit_rows(result.host()[ROW_MAX]), None).astype(bool)
        arrays = outputs_to_numpy(result)
        for name in NEG_INF_FILLED:  # as sent, once per step rather than once per response
            arrays[name] = to_wire_values(name, arrays[name])
        arrays[WEIGHT_VERSION.name] = np.broadcast_to(self._version_tag, (owner.size,))
        # The receipt: each position's row seed (its step is its token's place in the request).
        arrays[SAMPLING_SEED.name] = params.seed
        width = int(positions.max())
        sampled = np.full((rows, width), PAD, np.int64)
        sampled[owner, within] = arrays["output_ids"]
        unusable = np.zeros((rows, width), bool)
        unusable[owner, within] = broken
        accepted = _accepted(sampled, drafts, unusable)
        # Plain decoding would emit the accepted drafts, then the next sampled token, unless broken.
        usable = accepted + ~unusable[np.arange(rows), accepted]
        emitted = np.zeros(rows, np.int64)
        finished = np.zeros(rows, bool)
        ended = np.zeros(rows, bool)  # finished with a reason (not failed)
        stopped_rows = np.zeros(rows, bool)
        now, now_ns = time.monotonic(), time.time_ns()
        for i, (sequence, tokens) in enumerate(zip(self._rows, sampled.tolist())):
            count = min(int(usable[i]), sequence.request.max_new_tokens - sequence.step)
            # Generation ends at the first stop token, as plain decoding would: later ones are dropped.
            stop = next((j for j in range(count) if tokens[j] in sequence.stop_set), None)
            stopped = stop is not None
            if stopped:
                count = stop + 1
            done = stopped or sequence.step + count >= sequence.request.max_new_tokens
            if count:
                if sequence.step == 0:
                    sequence.first_token_at = now
                sequence.last_token_at = now
            if sequence.steps is not None:  # before _send: a final chunk carries its steps
                kept = int(min(accepted[i], count))
                sequence.steps.append(StepSpan(started_ns, now_ns, rows, count, int(drafted[i]), kept))
            self._send(
                sequence, arrays, int(first[i]), count, (FINISH_STOP if stopped else FINISH_LENGTH) if done else ""
            )
            sequence.step += count
            sequence.tokens.extend(tokens[:count])
            emitted[i], finished[i], ended[i], stopped_rows[i] = count, done, done, stopped
            if not done and unusable[i, accepted[i]]:  # plain decoding would fail at this step
                finished[i] = True
                _quietly(sequence.handle.fail, f"the language model produced unusable logits at step {sequence.step}")
        speculated = drafts is not None
        if speculated:  # before generate_tokens_total: who sees a step's tokens counted sees this too
            self.observer.speculated(
                int((drafted > 0).sum()), int(drafted.sum()), int(np.minimum(accepted, emitted).sum())
            )
        self.observer.generated(int(emitted.sum()))
        self.observer.stepped(
            _step_record(
                now, steps, enqueued, last_at, emitted, ended, stopped_rows, arrays, owner, within, self._params
            )
        )
        self._last = torch.from_numpy(sampled[np.arange(rows), np.maximum(emitted - 1, 0)])
        if self._history is not None:
            self._history.append(sampled, emitted)
        rejected = drafted - accepted  # a continuing row emitted accepted + 1 tokens
        self._drop(finished)
        if speculated and self._rows:
            self._state = self.lm.rollback(self._state, torch.from_numpy(rejected[~finished]))

    def _send(self, sequence: _Sequence, arrays: dict, start: int, count: int, finish_reason: str) -> None:
        """Hand `count` tokens (the outputs at positions start...) to the request: one response per
        token when it streams, else kept, and sent whole with its last token."""
        done = bool(finish_reason)
        if sequence.request.stream:
            for position in range(start, start + count):
                row = {name: value[position : position + 1] for name, value in arrays.items()}
                last = position == start + count - 1
                chunk = GenerationChunk(row, finish_reason if last else "")
                if done and last:
                    row.update(_timings(sequence))
                    chunk.steps = sequence.steps
                sequence.handle.send(chunk, final=done and last)
            return
        if count:  # copies: a view would keep the whole step's arrays alive
            masked = sequence.request.params.return_sampling_mask[0]
            kept = GENERATION_TOKEN_OUTPUT_NAMES if masked else UNMASKED_OUTPUT_NAMES
            sequence.parts.append({name: arrays[name][start : start + count].copy() for name in kept})
        if done:
            sequence.handle.send(_whole(sequence, finish_reason, self.width), final=True)

    def _join(self, fresh: list[_Sequence]) -> torch.Tensor:
        """Prefill the newcomers together and merge them into the running batch (after its rows);
        their logits for step 0. Unseeded ones get a fresh seed here."""
        logits, state = self.lm.prefill([torch.from_numpy(s.request.prompt) for s in fresh])
        params = RowParams.concatenate([s.request.params for s in fresh])
        unseeded = ~params.has_seed
        params.seed[unseeded] = self._entropy.integers(0, 2**64, int(unseeded.sum()), dtype=np.uint64)
        params.has_seed[:] = True
        if self._rows:
            self._state = self.lm.merge([self._state, state])
            self._params = RowParams.concatenate([self._params, params])
        else:
            self._state, self._params = state, params
        if self._history is not None:
            self._history.join([s.request.prompt for s in fresh], [s.reserved for s in fresh])
        self._rows = self._rows + fresh
        now = time.monotonic()
        for sequence in fresh:
            sequence.admitted_at = now
        self.observer.admitted(
            np.array([now - s.enqueued for s in fresh]), int(sum(s.request.prompt.size for s in fresh))
        )
        self._reserved += sum(s.reserved for s in fresh)
        return logits

    def _drop(self, gone: np.ndarray, cancel: bool = False) -> None:
        """Retire the rows where `gone` is true: their slots, reservations and KV rows are freed now."""
        if not gone.any():
            return
        for i in np.flatnonzero(gone):
            if cancel:
                self._rows[i].handle.cancelled(self._rows[i].step)
            self._reserved -= self._rows[i].reserved
        keep = ~gone
        self._rows = [s for s, kept in zip(self._rows, keep) if kept]
        if not self._rows:
            self._reset()
            return
        index = torch.from_numpy(np.flatnonzero(keep))
        self._state = self.lm.keep(self._state, index)
        self._last = self._last[index]
        self._params = self._params.take(keep)
        if self._history is not None:
            self._history.keep(keep)

    def _reset(self) -> None:
        self._rows, self._state, self._last, self._params, self._reserved = [], None, None, None, 0
        if self._history is not None:
            self._history = TokenHistory()

    def _report(self) -> None:
        with self._cv:
            waiting = len(self._waiting)
        self.observer.occupancy(len(self._rows), waiting, sum(s.cached for s in self._rows))


def _step_record(
    now: float,
    steps: np.ndarray,
    enqueued: np.ndarray,
    last_at: np.ndarray,
    emitted: np.ndarray,
    ended: np.ndarray,
    stopped: np.ndarray,
    arrays: dict,
    owner: np.ndarray,
    within: np.ndarray,
    params: RowParams,
) -> StepRecord:
    """One step's timings and kept masses, vectorised over rows and sampled positions (rows
    aligned with `steps`, positions with `owner` / `within`)."""
    spoke = emitted > 0
    # Only the tokens a row emitted count (not its rejected drafts), and only where it asked for a mask.
    kept = (within < emitted[owner]) & params.return_sampling_mask[owner].astype(bool)
    log_kept = arrays[OUTPUT_LOGPROBS.name][kept].astype(np.float64) - arrays[SAMPLING_LOGPROBS.name][kept]
    return StepRecord(
        first_token_s=(now - enqueued)[spoke & (steps == 0)],
        inter_token_s=(now - last_at)[spoke & (steps > 0)],
        e2e_s=(now - enqueued)[ended],
        finished={FINISH_STOP: int(stopped.sum()), FINISH_LENGTH: int((ended & ~stopped).sum())},
        log_kept_mass=log_kept,
    )


def _accepted(sampled: np.ndarray, drafts: np.ndarray | None, unusable: np.ndarray) -> np.ndarray:
    """How many of each row's drafts stand ([rows]): draft i + 1 stands iff position i sampled it
    (a broken position samples nothing) and every draft before it stood. `sampled` and `unusable`
    are [rows, 1 + most drafts]; `drafts` covers the first rows (the later ones drafted nothing)."""
    rows, width = sampled.shape
    if drafts is None or width == 1:
        return np.zeros(rows, np.int64)
    proposed = np.full((rows, width - 1), PAD, np.int64)
    proposed[: drafts.shape[0]] = drafts[:, : width - 1]
    agree = (sampled[:, :-1] == proposed) & (proposed != PAD) & ~unusable[:, :-1]
    return np.cumprod(agree, axis=1).sum(axis=1)


def _whole(sequence: _Sequence, finish_reason: str, width: int) -> GenerationChunk:
    """A non-streamed request's outputs, all steps; mask rows only where it asked for them."""
    arrays = {name: np.concatenate([p[name] for p in sequence.parts]) for name in sequence.parts[0]}
    for name in MASK_OUTPUT_NAMES:
        if name not in arrays:
            arrays[name] = to_wire_values(name, padding(name, len(arrays[OUTPUT_IDS.name]), width))
    outputs = {name: arrays[name] for name in GENERATION_TOKEN_OUTPUT_NAMES}
    return GenerationChunk({**outputs, **_timings(sequence)}, finish_reason, sequence.steps)


def _timings(sequence: _Sequence) -> dict[str, np.ndarray]:
    """A finished request's timing outputs (seconds): queue, time to first token, generation."""
    seconds = (
        sequence.admitted_at - sequence.enqueued,
        sequence.first_token_at - sequence.enqueued,
        sequence.last_token_at - sequence.admitted_at,
    )
    return {spec.name: np.array([value], spec.dtype) for spec, value in zip(TIMING_OUTPUTS, seconds)}


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # the client may be gone; the request ends either way
        pass
