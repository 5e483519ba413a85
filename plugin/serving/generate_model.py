"""The `generate` model's lifecycle (decoupled Python backend), kept out of model.py.

Each execute call takes the requests the dynamic batcher grouped, answers the invalid ones with a
per-request 400 before any token is generated, and runs the rest through the LM as one padded
batch. Every request ends with exactly one response flagged COMPLETE_FINAL: its last token
(streaming), its whole result (non-streaming), its error, or an empty final once it is cancelled.
"""

from __future__ import annotations

import traceback

import numpy as np
import torch

from ..sampling.backends import load_backend
from ..sampling.batching import BatchSampler
from ..generation.generator import GenerationChunk, GenerationRequest, Generator, check_generation_request
from ..generation.lm import load_lm
from ..model_config import config_path, instance_device, int_parameter, load_model_config, string_parameter
from .triton_io import error_response, read_input, read_params, wanted_outputs
from .sampler_model import declared_outputs, mask_policy
from ..sampling.validation import SamplingRequestError


def _input(request, pb_utils, name: str, dtype, required: bool = False) -> np.ndarray | None:
    """A request input as a flat numpy array of `dtype`, one per request (batch size 1)."""
    values = read_input(request, pb_utils, name, dtype, required)
    if values is None:
        return None
    if values.ndim < 1 or values.shape[0] != 1:
        raise SamplingRequestError(name, f"{name}: generate takes one prompt per request (batch size 1), got shape {list(values.shape)}")
    return values.reshape(-1)


def _flag(request, pb_utils, name: str) -> bool:
    values = _input(request, pb_utils, name, np.bool_)
    if values is None:
        return False
    if values.size != 1:
        raise SamplingRequestError(name, f"{name} must hold one value, got {values.size}")
    return bool(values[0])


def parse_generation_request(request, pb_utils, vocab_size: int, context_length: int) -> GenerationRequest:
    """A GenerationRequest from a Triton request; raises SamplingRequestError naming a bad field."""
    prompt = _input(request, pb_utils, "input_ids", np.int32, required=True).astype(np.int64)
    budget = _input(request, pb_utils, "max_new_tokens", np.int32, required=True)
    if budget.size != 1:
        raise SamplingRequestError("max_new_tokens", f"max_new_tokens must hold one value, got {budget.size}")
    stops = _input(request, pb_utils, "stop_token_ids", np.int32)
    stops = np.zeros(0, np.int64) if stops is None else stops.astype(np.int64)
    check_generation_request(prompt, int(budget[0]), stops, vocab_size, context_length)
    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=int(budget[0]),
        stop_token_ids=stops,
        ignore_eos=_flag(request, pb_utils, "ignore_eos"),
        stream=_flag(request, pb_utils, "stream"),
        params=read_params(request, pb_utils, rows=1),
    )


def chunk_response(pb_utils, chunk: GenerationChunk, wanted: set[str] | None = None):
    """A response with a chunk's outputs (the `wanted` ones when given), each with the leading
    batch dimension of 1."""
    arrays = {
        "output_ids": chunk.output_ids,
        "output_logprobs": chunk.output_logprobs,
        "sampling_mask": chunk.sampling_mask,
        "sampling_mask_len": chunk.sampling_mask_len,
        "sampling_logprobs": chunk.sampling_logprobs,
        "sampling_mask_logprobs": chunk.sampling_mask_logprobs,
        "finish_reason": np.array([chunk.finish_reason.encode()], dtype=np.object_),
    }
    tensors = [pb_utils.Tensor(name, np.ascontiguousarray(value)[np.newaxis]) for name, value in arrays.items()
               if wanted is None or name in wanted]
    return pb_utils.InferenceResponse(output_tensors=tensors)


class _TritonSink:
    """Sends the generator's results through each request's response sender."""

    def __init__(self, model: "GenerateModel", requests: list, senders: list):
        self.model, self.requests, self.senders = model, requests, senders
        self.final = model.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.done = [False] * len(requests)
        self.broken: set[int] = set()

    def is_cancelled(self, position: int) -> bool:
        # A request whose sender failed is dropped like a cancelled one, so its batch-mates go on.
        return position in self.broken or self.requests[position].is_cancelled()

    def send(self, position: int, chunk: GenerationChunk, final: bool) -> None:
        try:
            wanted = wanted_outputs(self.requests[position], self.model.declared_outputs)
            self.senders[position].send(chunk_response(self.model.pb_utils, chunk, wanted), flags=self.final if final else 0)
        except Exception as exc:  # e.g. the client went away: fail this request only
            self.model.logger.log_error(f"generate: response for one request not sent ({type(exc).__name__}: {exc}); dropping it")
            self.broken.add(position)
            self.done[position] = True
            return
        self.done[position] = final

    def cancelled(self, position: int, tokens: int) -> None:
        if position in self.broken:
            return
        self.model.cancelled_counter.increment(1)
        self.model.logger.log_info(f"generate: request cancelled by the client after {tokens} tokens; stopped")
        self.done[position] = True
        try:  # the final flag releases the request; the client may already be gone
            self.senders[position].send(flags=self.final)
        except Exception as exc:
            self.model.logger.log_verbose(f"generate: final flag after cancellation not sent: {exc}")

    def generated(self, tokens: int) -> None:
        self.model.tokens_counter.increment(tokens)

    def fail(self, position: int, message: str, code_name: str = "INTERNAL") -> None:
        self.senders[position].send(error_response(self.model.pb_utils, message, code_name), flags=self.final)
        self.done[position] = True


class GenerateModel:
    """Triton glue for generation: parse, admit, generate the batch, stream or answer each request."""

    def __init__(self, args: dict, pb_utils):
        self.pb_utils = pb_utils
        self.logger = pb_utils.Logger
        model_config = load_model_config(args)
        device = instance_device(args)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        threads = int_parameter(model_config, "cpu_threads", 0)
        if threads > 0:  # this stub process runs only this instance, so the setting stays local
            torch.set_num_threads(threads)
        backend = load_backend(string_parameter(model_config, "sampling_backend", "torch"))
        policy = mask_policy(args, model_config, backend)
        self.declared_outputs = declared_outputs(model_config, policy.mask_width, config_path(args))
        model_path = string_parameter(model_config, "model_path", "")
        self.lm = load_lm(model_path, string_parameter(model_config, "lm", ""), device)
        self.generator = Generator(self.lm, BatchSampler(backend, policy, device))
        labels = {"model": args.get("model_name", "generate")}
        tokens = pb_utils.MetricFamily(
            name="generate_tokens_total", description="Tokens generated by the generate model", kind=pb_utils.MetricFamily.COUNTER
        )
        cancelled = pb_utils.MetricFamily(
            name="generate_cancelled_total", description="Generate requests stopped by client cancellation", kind=pb_utils.MetricFamily.COUNTER
        )
        # The families must outlive their metrics, so the model holds both.
        self.metric_families = (tokens, cancelled)
        self.tokens_counter = tokens.Metric(labels=labels)
        self.cancelled_counter = cancelled.Metric(labels=labels)
        self.logger.log_info(
            f"generate ready on {device}: lm={model_path or 'built-in tiny llama'}, vocab={self.lm.vocab_size}, "
            f"context={self.lm.context_length}, eos={list(self.lm.eos_token_ids)}, mask width={policy.mask_width}, "
            f"torch threads={torch.get_num_threads()}"
        )

    def execute(self, requests) -> None:
        """Answers every request through its response sender; nothing escapes (decoupled: returns None)."""
        senders = [request.get_response_sender() for request in requests]
        sink = _TritonSink(self, requests, senders)
        try:
            parsed, positions = [], []
            for position, request in enumerate(requests):
                try:
                    parsed.append(parse_generation_request(request, self.pb_utils, self.lm.vocab_size, self.lm.context_length))
                    positions.append(position)
                except SamplingRequestError as exc:
                    sink.fail(position, exc.message, "INVALID_ARG")
            admitted, admitted_positions = [], []
            for item, position, error in zip(parsed, positions, self.generator.admission_errors(parsed)):
                if error is not None:
                    sink.fail(position, error, "INVALID_ARG")
                else:
                    admitted.append(item)
                    admitted_positions.append(position)
            if admitted:
                batch_sink = _PositionMap(sink, admitted_positions)
                self.generator.run(admitted, batch_sink)
        except Exception as exc:  # an internal fault: end every unanswered request, never raise
            self.logger.log_error(f"generate internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            message = f"internal generate error ({type(exc).__name__}); see the server log"
            for position, done in enumerate(sink.done):
                if not done:
                    try:
                        sink.fail(position, message)
                    except Exception:  # the sender may already be closed
                        pass
        return None

    def finalize(self) -> None:
        """execute generates to completion before returning, so nothing is left in flight."""
        self.logger.log_info("generate finalized")


class _PositionMap:
    """A sink over a subset of the batch: generator position i is batch position positions[i]."""

    def __init__(self, sink: _TritonSink, positions: list[int]):
        self.sink, self.positions = sink, positions

    def is_cancelled(self, i: int) -> bool:
        return self.sink.is_cancelled(self.positions[i])

    def send(self, i: int, chunk, final: bool) -> None:
        self.sink.send(self.positions[i], chunk, final)

    def cancelled(self, i: int, tokens: int) -> None:
        self.sink.cancelled(self.positions[i], tokens)

    def fail(self, i: int, message: str) -> None:
        self.sink.fail(self.positions[i], message)

    def generated(self, tokens: int) -> None:
        self.sink.generated(tokens)
