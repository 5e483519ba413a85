"""The `generate` model's lifecycle (decoupled Python backend), kept out of model.py.

Each execute call takes the requests the dynamic batcher grouped, answers the invalid ones with a
per-request 400 before any token is generated, and only enqueues the rest on the instance's
`ContinuousEngine`, whose background loop admits them into the running decode batch (a request
beyond the engine's bounds gets UNAVAILABLE at once). Every request ends with exactly one response
flagged COMPLETE_FINAL: its last token (streaming), its whole result (non-streaming), its error, or
an empty final once it is cancelled.

A request with the `control` input is a control request (weight updates, pause / continue, the
weight version: `weight_control`), answered with one `control_result` response.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import traceback

import torch

from ..generation.drafting import NGRAM, SPECULATIVE_ALGORITHMS, NgramDrafter
from ..generation.engine import DEFAULT_WEIGHT_VERSION, ContinuousEngine, EngineFull, EngineLimits
from ..generation.lm import can_speculate, load_lm
from ..generation.request import GenerationChunk, admission_errors
from ..model_config import int_parameter, string_parameter
from ..sampling.validation import SamplingRequestError
from .deployment import load_deployment
from .metrics import CANCELLED, KIND_CONTROL, KIND_GENERATION, NOT_SENT, OK, GenerateMetrics
from .tracing import BATCH_SIZE, MASK_WIDTH, BatchSpans, ModelTracer, RequestSpans
from .triton_io import chunk_response, error_response, parse_generation_request, wanted_outputs
from .weight_control import CONTROL, ControlError, WeightControl, control_response


def build_drafter(model_config: dict, config_file: str) -> NgramDrafter | None:
    """The drafter `speculative_algorithm` asks for ("ngram": prompt lookup, with its parameters
    `num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`,
    `speculative_disable_by_batch_size`), else None."""
    if string_parameter(model_config, "speculative_algorithm", "none").strip().lower() != NGRAM:
        return None
    try:
        return NgramDrafter(
            num_tokens=int_parameter(model_config, "num_speculative_tokens", NgramDrafter.num_tokens),
            max_n=int_parameter(model_config, "prompt_lookup_max", NgramDrafter.max_n),
            min_n=int_parameter(model_config, "prompt_lookup_min", NgramDrafter.min_n),
            disable_at_rows=int_parameter(
                model_config, "speculative_disable_by_batch_size", NgramDrafter.disable_at_rows
            ),
        )
    except ValueError as exc:
        raise ValueError(f"{exc} (config parameters in {config_file})") from exc


def speculation_summary(algorithm: str, drafter: NgramDrafter | None, lm) -> str:
    """How the engine decodes, for the load log line."""
    if drafter is not None and can_speculate(lm):
        return (
            f"speculative decoding: {NGRAM} (up to {drafter.num_tokens} drafted tokens, "
            f"n-grams of {drafter.max_n} down to {drafter.min_n}), exact"
        )
    if drafter is not None:
        return (
            f"speculative decoding: the LM has no decode_many / rollback, so speculative_algorithm "
            f"{NGRAM!r} falls back to plain decoding"
        )
    if algorithm.strip().lower() not in ("", "none"):
        return (
            f"speculative decoding: {algorithm!r} is not drafted here (only {sorted(SPECULATIVE_ALGORITHMS)}): "
            "plain decoding, mask requests refused"
        )
    return "speculative decoding: none"


class _Outbox:
    """Runs calls on a thread of its own, in order: the engine's responses (one FIFO for all
    requests, so a request's final always follows its tokens) while the engine computes its next
    step, or (a second one) its metric updates, each an IPC round trip the engine does not wait for."""

    def __init__(self, logger, after_each=None, name: str = "generate-outbox", lost: str = "response not sent"):
        self.logger, self.after_each, self.lost = logger, after_each, lost  # after_each(idle): after every item
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, call, *args) -> None:
        self.queue.put((call, args))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            call, args = item
            try:
                call(*args)
            except Exception as exc:  # one response lost must not stop the others
                self.logger.log_error(f"generate: {self.lost} ({type(exc).__name__}: {exc})")
            if self.after_each is not None:
                try:
                    self.after_each(self.queue.empty())
                except Exception as exc:  # a metric update failed: the responses go on
                    self.logger.log_error(f"generate metrics not updated: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Send everything queued, then end the thread."""
        self.queue.put(None)
        self.thread.join()


# How long a request in flight goes at most without asking tritonserver whether its client
# cancelled it. The engine asks every row every step, but each `request.is_cancelled()` is an IPC
# round trip the engine's thread waits for (the backend has no batch query), as many per step as
# rows: so a handle passes the question on at most this often and answers "not cancelled" in
# between. A cancelled request stops within this interval and one step.
CANCEL_CHECK_INTERVAL_S = 0.1
# Requests admitted together would ask together in one step every interval: the k-th handle's
# first interval is shortened to the fractional part of k times this (the golden ratio's
# multiples spread any number of requests evenly), which spreads the asks over the steps.
_CANCEL_CHECK_STAGGER = 0.6180339887498949


class _RequestHandle:
    """One request's response sender: tokens, its error, or the empty final after cancellation.

    The responses are built and sent on the outbox thread; `done` is set at once."""

    def __init__(self, model: GenerateModel, request, outbox: _Outbox, ordinal: int = 0, clock=time.monotonic):
        self.model, self.request, self.outbox = model, request, outbox
        self._clock = clock
        self._next_cancel_check: float | None = None  # None: never asked (the first ask goes through)
        self._first_interval_s = CANCEL_CHECK_INTERVAL_S * ((ordinal * _CANCEL_CHECK_STAGGER) % 1.0)
        self.sender = request.get_response_sender()
        self.final_flag = model.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.done = False
        self.broken = False  # its sender failed: dropped like a cancelled request, batch-mates go on
        self._wanted: set[str] | None = None
        self._held: dict = {}  # the shared outputs' values the client holds (chunk_response)
        # A streamed request's chunks not sent yet: while the outbox is behind (each send is a round
        # trip to tritonserver), a request's tokens queued meanwhile go in one response, so the
        # outbox's backlog is at most one response per request, not one per token.
        self._unsent: collections.deque = collections.deque()
        self._flush_queued = False
        self.spans: RequestSpans | None = None  # set when tritonserver traces the request

    def is_cancelled(self) -> bool:
        """Whether the request is cancelled or its sender broke; tritonserver is asked at most
        once per CANCEL_CHECK_INTERVAL_S (the first time at once)."""
        if self.broken:
            return True
        now = self._clock()
        if self._next_cancel_check is not None and now < self._next_cancel_check:
            return False
        first = self._next_cancel_check is None
        self._next_cancel_check = now + (self._first_interval_s if first else CANCEL_CHECK_INTERVAL_S)
        return self.request.is_cancelled()

    @property
    def traces_steps(self) -> bool:
        """Whether the engine records this request's steps (tritonserver traces it)."""
        return self.spans is not None

    def send(self, chunk: GenerationChunk, final: bool) -> None:
        self.done = self.done or final
        self._unsent.append((chunk, final))
        if not self._flush_queued:  # one flush in the outbox at a time sends whatever has come by then
            self._flush_queued = True
            self.outbox.put(self._flush)

    def _flush(self) -> None:
        # Cleared before taking the chunks: one the engine adds from now on queues a flush of its own.
        self._flush_queued = False
        taken = []
        while self._unsent:
            taken.append(self._unsent.popleft())
        if taken:
            self._send_now(GenerationChunk.joined([chunk for chunk, _ in taken]), taken[-1][1])

    def _send_now(self, chunk: GenerationChunk, final: bool) -> None:
        if self.broken:
            return
        try:
            if self._wanted is None:  # the same for every response of the request
                self._wanted = wanted_outputs(self.request, self.model.declared_outputs)
            sending_ns = time.time_ns() if final and self.spans else 0
            self.sender.send(
                chunk_response(self.model.pb_utils, chunk, self._wanted, self._held),
                flags=self.final_flag if final else 0,
            )
            if final:
                self.model.metrics.ended(KIND_GENERATION, OK)
            if sending_ns:
                self.spans.finish(chunk.outputs, chunk.finish_reason, sending_ns, time.time_ns(), chunk.steps)
        except Exception as exc:  # e.g. the client went away: fail this request only
            self.model.logger.log_error(
                f"generate: response for one request not sent ({type(exc).__name__}: {exc}); dropping it"
            )
            self.broken = self.done = True
            self.model.metrics.ended(KIND_GENERATION, NOT_SENT)

    def cancelled(self, tokens: int) -> None:
        if self.broken:
            return
        self.done = True
        self.model.metrics.cancelled()
        self.model.logger.log_info(f"generate: request cancelled by the client after {tokens} tokens; stopped")
        self.outbox.put(self._final_flag_now)

    def _final_flag_now(self) -> None:
        self.model.metrics.ended(KIND_GENERATION, CANCELLED)
        try:  # the final flag releases the request; the client may already be gone
            self.sender.send(flags=self.final_flag)
        except Exception as exc:
            self.model.logger.log_verbose(f"generate: final flag after cancellation not sent: {exc}")

    def fail(self, message: str, code_name: str = "INTERNAL") -> None:
        if self.done:
            return
        self.done = True
        self.outbox.put(self._fail_now, message, code_name)

    def _fail_now(self, message: str, code_name: str) -> None:
        if self.broken:
            return
        try:
            self.sender.send(error_response(self.model.pb_utils, message, code_name), flags=self.final_flag)
        except Exception:
            self.model.metrics.ended(KIND_GENERATION, NOT_SENT)
            raise
        self.model.metrics.ended(KIND_GENERATION, code_name.lower())


class GenerateModel:
    """Triton glue for generation: parse, check, enqueue on the engine, which streams or answers each request."""

    def __init__(self, args: dict, pb_utils):
        self.pb_utils = pb_utils
        self.logger = pb_utils.Logger
        deployment = load_deployment(args, exact_speculative=SPECULATIVE_ALGORITHMS)
        model_config = deployment.model_config
        threads = int_parameter(model_config, "cpu_threads", 0)
        if threads > 0:  # this stub process runs only this instance, so the setting stays local
            torch.set_num_threads(threads)
        self.sampler, self.declared_outputs = deployment.sampler, deployment.declared_outputs
        model_path = string_parameter(model_config, "model_path", "")
        self.lm = load_lm(
            model_path,
            string_parameter(model_config, "lm", ""),
            deployment.device,
            string_parameter(model_config, "lm_dtype", ""),
        )
        drafter = build_drafter(model_config, deployment.config_file)
        self.tracer = ModelTracer(args.get("model_name", "generate"), log_error=self.logger.log_error)
        self.mask_width = deployment.policy.mask_width
        self.metric_updates = _Outbox(self.logger, name="generate-metrics", lost="metrics not updated")
        self.metrics = GenerateMetrics(pb_utils, args.get("model_name", "generate"), defer=self.metric_updates.put)
        limits = EngineLimits(
            max_active_sequences=int_parameter(model_config, "max_active_sequences", EngineLimits.max_active_sequences),
            max_waiting=int_parameter(model_config, "max_waiting", EngineLimits.max_waiting),
            kv_budget_tokens=int_parameter(model_config, "kv_budget_tokens", EngineLimits.kv_budget_tokens),
            max_waiting_tokens=int_parameter(model_config, "max_waiting_tokens", EngineLimits.max_waiting_tokens),
        )
        self.outbox = _Outbox(self.logger, self.metrics.send_outcomes)
        self._handle_ordinals = itertools.count()  # staggers the handles' cancellation asks
        self.engine = ContinuousEngine(
            self.lm,
            self.sampler,
            limits,
            self.metrics,
            self.logger.log_error,
            drafter=drafter,
            weight_version=string_parameter(model_config, "weight_version", DEFAULT_WEIGHT_VERSION),
        ).start()
        module = getattr(self.lm, "model", None)
        self.control = WeightControl(
            self.engine,
            module if isinstance(module, torch.nn.Module) else None,
            string_parameter(model_config, "weights_root", ""),
            self.logger,
        )
        self.logger.log_info(
            deployment.ready_message(
                "generate",
                f"lm={model_path or 'built-in tiny llama'}",
                f"vocab={self.lm.vocab_size}",
                f"context={self.lm.context_length}",
                f"eos={list(self.lm.eos_token_ids)}",
                f"{self.engine.limits}",
                speculation_summary(deployment.policy.speculative_algorithm, drafter, self.lm),
            )
        )

    def execute(self, requests) -> None:
        """Answers every request through its response sender; nothing escapes (decoupled: returns None)."""
        handles, engine_owned = [], set()  # once submitted, only the engine answers a request
        invalid = shed = 0
        spans = BatchSpans(self.tracer)
        try:
            requests = [r for r in requests if not self._is_control(r)]
            handles = [_RequestHandle(self, request, self.outbox, next(self._handle_ordinals)) for request in requests]
            parsed, admitted_handles = [], []
            for handle in handles:
                try:
                    parsed.append(
                        parse_generation_request(
                            handle.request, self.pb_utils, self.lm.vocab_size, self.lm.context_length
                        )
                    )
                    admitted_handles.append(handle)
                except SamplingRequestError as exc:
                    handle.fail(exc.message, "INVALID_ARG")
                    invalid += 1
            spans.mark("parse")
            admitted, checked_handles = [], []
            for item, handle, error in zip(
                parsed, admitted_handles, admission_errors(parsed, self.lm.vocab_size, self.sampler.policy)
            ):
                error = error or self.engine.never_fits(item)  # 400: no retry would ever fit
                if error is not None:
                    handle.fail(error, "INVALID_ARG")
                    invalid += 1
                else:
                    admitted.append(item)
                    checked_handles.append(handle)
            for item, handle in zip(admitted, checked_handles):  # every 400 is sent before any token
                try:
                    if spans.tracer:
                        traced = {BATCH_SIZE: len(handles), MASK_WIDTH: self.mask_width}
                        handle.spans = RequestSpans.for_request(spans, handle.request, traced)
                    self.engine.submit(item, handle)
                    engine_owned.add(id(handle))
                except EngineFull as exc:  # load shedding: refused now, never queued unboundedly
                    handle.fail(exc.message, "UNAVAILABLE")
                    shed += 1
        except Exception as exc:  # an internal fault: end every unanswered request, never raise
            self.logger.log_error(f"generate internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            message = f"internal generate error ({type(exc).__name__}); see the server log"
            for handle in handles:
                if not handle.done and id(handle) not in engine_owned:
                    try:
                        handle.fail(message)
                    except Exception:  # the sender may already be closed
                        pass
        try:
            self.metrics.rejected(invalid, shed)
        except Exception as exc:  # a metric update failed: the requests are answered all the same
            self.logger.log_error(f"generate metrics not updated: {type(exc).__name__}: {exc}")
        return None

    def _is_control(self, request) -> bool:
        """Hand a control request to the control thread (True), or leave a generation request (False)."""
        tensor = self.pb_utils.get_input_tensor_by_name(request, CONTROL)
        if tensor is None:
            return False
        sender = request.get_response_sender()

        def answer(outcome) -> None:
            self.outbox.put(self._send_control, sender, outcome)

        try:
            text = tensor.as_numpy().reshape(-1)
            if text.size != 1:
                raise ControlError(f"{CONTROL} must hold one JSON text, got {text.size}")
            self.control.submit(text[0], request.parameters(), answer)
        except ControlError as error:
            answer(error)
        except Exception as exc:  # an internal fault: this request is answered all the same
            self.logger.log_error(f"generate: control request not taken: {type(exc).__name__}: {exc}")
            answer(ControlError(f"internal generate error ({type(exc).__name__}); see the server log", "INTERNAL"))
        return True

    def _send_control(self, sender, outcome) -> None:
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        refused = isinstance(outcome, ControlError)
        try:
            if refused:
                sender.send(error_response(self.pb_utils, outcome.message, outcome.code_name), flags=final)
            else:
                sender.send(control_response(self.pb_utils, outcome), flags=final)
        except Exception:
            self.metrics.ended(KIND_CONTROL, NOT_SENT)
            raise
        self.metrics.ended(KIND_CONTROL, outcome.code_name.lower() if refused else OK)

    def finalize(self) -> None:
        """Stop the engine loop: requests still in flight or waiting end with an UNAVAILABLE final."""
        self.engine.stop()  # first: a control op waiting for a pause returns once it stops
        self.control.stop()
        self.outbox.stop()
        self.metric_updates.stop()
        self.tracer.shutdown()
        self.logger.log_info("generate finalized")
