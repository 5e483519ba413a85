"""Continuous (in-flight) batching: one background loop owns the LM batch of a model instance
(the only generation loop of the `generate` model).

`submit` only enqueues (or refuses at once, `EngineFull`, beyond the configured bounds). Every
step the loop admits waiting requests (prefilled together, then merged into the running decode
batch with `CausalLM.merge`), asks each active request once whether it was cancelled, runs one
sampler call for all active rows, hands each row's token to its request's handle and retires
finished, cancelled or failed rows at once (their KV-cache rows are dropped), then runs one LM
decode for the rows left. A row's step counter is its own, so a seeded request samples step s
with `rng.step_seeds(seed, s)` whenever it joined: its tokens do not depend on its batch-mates.
No Triton here: results go through a `RequestHandle`, counters through an `EngineObserver`.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..sampling.batching import BatchSampler, outputs_to_numpy
from ..sampling.outputs import MASK_OUTPUT_NAMES, TOKEN_OUTPUT_NAMES, UNMASKED_OUTPUT_NAMES, padding
from ..sampling.params import RowParams
from ..sampling.validation import check_logit_rows
from .lm import CausalLM, can_merge
from .request import FINISH_LENGTH, FINISH_STOP, GenerationChunk, GenerationRequest, step_params, stop_ids


class EngineFull(Exception):
    """A request refused at submission (the engine's bounds, or the engine is stopping)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class EngineLimits:
    """Bounds of one engine: rows decoded together, requests queued, KV positions reserved."""

    max_active_sequences: int = 32
    max_waiting: int = 64
    kv_budget_tokens: int = 32 * 512  # each request reserves prompt + max_new_tokens positions

    def __post_init__(self):
        for name in ("max_active_sequences", "max_waiting", "kv_budget_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"config parameter {name!r} must be >= 1, got {getattr(self, name)}")


class RequestHandle(Protocol):
    """Where one request's results go (called from the engine thread)."""

    def is_cancelled(self) -> bool: ...

    def send(self, chunk: GenerationChunk, final: bool) -> None: ...

    def cancelled(self, tokens: int) -> None: ...

    def fail(self, message: str, code_name: str = "INTERNAL") -> None: ...


class EngineObserver(Protocol):
    """Counters and gauges of an engine (the serving layer turns them into metrics)."""

    def generated(self, tokens: int) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def occupancy(self, active: int, waiting: int, kv_tokens: int) -> None: ...


@dataclass
class _Sequence:
    """One admitted request: its handle, its own step counter and (non-streamed) its outputs so far."""

    request: GenerationRequest
    handle: RequestHandle
    enqueued: float
    stops: np.ndarray
    step: int = 0
    parts: list = field(default_factory=list)  # per step: dict of that row's outputs (non-streamed)

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
    ):
        self.lm, self.sampler, self.limits, self.observer, self.log_error = lm, sampler, limits, observer, log_error
        self.width = sampler.policy.mask_width
        self._merges = can_merge(self.lm)
        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._stopping = False
        self._rows: list[_Sequence] = []  # the decode batch, aligned with _state and _logits
        self._state = None
        self._logits: torch.Tensor | None = None
        self._params: RowParams | None = None
        self._reserved = 0
        self._thread = threading.Thread(target=self._run, name="generate-engine", daemon=True)

    def start(self) -> ContinuousEngine:
        """Start the loop thread (requests submitted before wait for it); returns the engine."""
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest, handle: RequestHandle) -> None:
        """Queue a checked request; raises EngineFull (nothing sent) when it cannot be taken now."""
        if request.max_new_tokens == 0:  # nothing to generate: answered here, no slot taken
            handle.send(GenerationChunk.empty(self.width, FINISH_LENGTH), final=True)
            return
        sequence = _Sequence(request, handle, time.monotonic(), stop_ids(request, self.lm.eos_token_ids))
        if sequence.reserved > self.limits.kv_budget_tokens:
            raise EngineFull(
                f"prompt length {request.prompt.size} + max_new_tokens {request.max_new_tokens} exceeds "
                f"this instance's KV budget of {self.limits.kv_budget_tokens} tokens (kv_budget_tokens)"
            )
        with self._cv:
            if self._stopping:
                raise EngineFull("the generate model is shutting down")
            if len(self._waiting) >= self.limits.max_waiting:
                raise EngineFull(
                    f"generate is at capacity: {len(self._waiting)} requests already wait "
                    f"(max_waiting {self.limits.max_waiting}); retry later"
                )
            self._waiting.append(sequence)
            self._cv.notify()

    def stop(self, message: str = "the generate model was unloaded before this request finished") -> None:
        """End the loop after its current step; every request not yet finished gets `message` as its final."""
        with self._cv:
            self._stopping = True
            self._stop_message = message
            self._cv.notify()
        self._thread.join()

    # The loop (engine thread only below this line).

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._rows and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                newcomers = self._admit()
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
            reserved += need
        return newcomers

    def _step(self, newcomers: list[_Sequence]) -> None:
        # One cancellation query per request per step (the backend has no batch query).
        cancelled = [s.handle.is_cancelled() for s in self._rows]
        self._drop(np.array(cancelled, bool), cancel=True)
        fresh = []
        for sequence in newcomers:
            if sequence.handle.is_cancelled():
                sequence.handle.cancelled(0)
            else:
                fresh.append(sequence)
        if fresh:
            self._join(fresh)
        if not self._rows:
            return
        steps = np.array([s.step for s in self._rows])  # each row samples at its own step
        result = self.sampler.sample(self._logits, step_params(self._params, steps))
        # The sampler returns each row's max with its outputs: rows whose logits the LM broke
        # (NaN, +inf, all -inf) fail here, without a separate pass over the logits.
        broken = ~np.equal(check_logit_rows(result.host()["row_max"]), None).astype(bool)
        for i in np.flatnonzero(broken):
            _quietly(
                self._rows[i].handle.fail, f"the language model produced unusable logits at step {self._rows[i].step}"
            )
        arrays = outputs_to_numpy(result)
        self.observer.generated(int((~broken).sum()))
        tokens = result.output_ids.cpu()
        token_list = tokens.tolist()
        finished = broken.copy()
        now = time.monotonic()
        for i, sequence in enumerate(self._rows):
            if broken[i]:
                continue
            if sequence.step == 0:
                self.observer.first_token(now - sequence.enqueued)
            sequence.step += 1
            stopped = bool(sequence.stops.size) and token_list[i] in sequence.stops
            done = stopped or sequence.step >= sequence.request.max_new_tokens
            reason = (FINISH_STOP if stopped else FINISH_LENGTH) if done else ""
            if sequence.request.stream:
                row = {name: value[i : i + 1] for name, value in arrays.items()}
                sequence.handle.send(GenerationChunk(row, reason), final=done)
            else:  # copies: a view would keep the whole step's arrays alive
                kept = TOKEN_OUTPUT_NAMES if sequence.request.params.return_sampling_mask[0] else UNMASKED_OUTPUT_NAMES
                sequence.parts.append({name: arrays[name][i : i + 1].copy() for name in kept})
                if done:
                    sequence.handle.send(_whole(sequence, reason, self.width), final=True)
            finished[i] = done
        if finished.any():
            tokens = tokens[torch.from_numpy(~finished)]
            self._drop(finished)
        if self._rows:
            self._logits = self.lm.decode(self._state, tokens)

    def _join(self, fresh: list[_Sequence]) -> None:
        """Prefill the newcomers together and merge them into the running batch (after its rows)."""
        logits, state = self.lm.prefill([torch.from_numpy(s.request.prompt) for s in fresh])
        params = RowParams.concatenate([s.request.params for s in fresh])
        if self._rows:
            self._state = self.lm.merge([self._state, state])
            self._logits = torch.cat([self._logits, logits])
            self._params = RowParams.concatenate([self._params, params])
        else:
            self._state, self._logits, self._params = state, logits, params
        self._rows = self._rows + fresh
        self._reserved += sum(s.reserved for s in fresh)

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
        self._logits = self._logits.index_select(0, index.to(self._logits.device))
        self._params = self._params.take(keep)

    def _reset(self) -> None:
        self._rows, self._state, self._logits, self._params, self._reserved = [], None, None, None, 0

    def _report(self) -> None:
        with self._cv:
            waiting = len(self._waiting)
        self.observer.occupancy(len(self._rows), waiting, sum(s.cached for s in self._rows))


def _whole(sequence: _Sequence, finish_reason: str, width: int) -> GenerationChunk:
    """A non-streamed request's outputs, all steps; mask rows only where it asked for them."""
    arrays = {name: np.concatenate([p[name] for p in sequence.parts]) for name in sequence.parts[0]}
    for name in MASK_OUTPUT_NAMES:
        if name not in arrays:
            arrays[name] = padding(name, len(sequence.parts), width)
    return GenerationChunk({name: arrays[name] for name in TOKEN_OUTPUT_NAMES}, finish_reason)


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # the client may be gone; the request ends either way
        pass
