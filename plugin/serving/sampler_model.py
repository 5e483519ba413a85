"""The `sampler` model's lifecycle, kept out of model.py so the repository's file stays thin."""

from __future__ import annotations

import contextlib
import time
import traceback

import numpy as np
import torch

from ..model_config import input_dtype, int_parameter
from ..sampling.outputs import SAMPLING_MASK_LEN
from ..sampling.validation import SamplingRequestError
from . import metrics
from .deployment import LOGITS_DATA_TYPES, load_deployment
from .tracing import BATCH_SIZE, MASK_WIDTH, OUTCOME, REASON, BatchSpans, ModelTracer
from .triton_io import error_response, parse_request, sampler_response, wanted_outputs

DEFAULT_MAX_VOCAB_SIZE = 262144
# A CPU batch of at most this many logits (rows x vocabulary: up to 27 rows at V=151,936, what
# the dynamic batcher makes of a few engines' decode steps) is sampled on one thread. A team of
# threads waits at every barrier for its slowest member, which a busy neighbour keeps off a CPU
# for milliseconds at a time: on a loaded 2-core host two threads took up to twice the CPU and
# two to three times as long as one, at B=1 and B=8 alike. Larger batches keep the stub's threads.
SINGLE_THREAD_ELEMENTS = 2**22


@contextlib.contextmanager
def batch_threads(elements: int, device: torch.device):
    """torch's intra-op threads while one batch of `elements` logits is sampled: one for a small
    CPU batch, the stub's own number otherwise (restored after)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or elements > SINGLE_THREAD_ELEMENTS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SamplerModel:
    """Triton glue for the sampler: parse, sample the batch once, answer each request."""

    def __init__(self, args: dict, pb_utils):
        self.pb_utils = pb_utils
        self.logger = pb_utils.Logger
        deployment = load_deployment(args)
        self.device, self.sampler = deployment.device, deployment.sampler
        self.declared_outputs = deployment.declared_outputs
        self.max_vocab_size = int_parameter(deployment.model_config, "max_vocab_size", DEFAULT_MAX_VOCAB_SIZE)
        # FP32 by default; BF16 / FP16 when the deployment declares it (the engine's own dtype).
        self.logits_dtype = input_dtype(deployment.model_config, "logits", LOGITS_DATA_TYPES)
        self.metrics = metrics.SamplerMetrics(
            pb_utils, args["model_name"], args["model_version"], deployment.policy.mask_width
        )
        self.tracer = ModelTracer(args["model_name"], log_error=self.logger.log_error)
        self.mask_width = deployment.policy.mask_width
        self.logger.log_info(
            deployment.ready_message("sampler", f"logits {str(self.logits_dtype).removeprefix('torch.')}")
        )

    def execute(self, requests) -> list:
        """One response per request; nothing escapes (a raise here would fail the whole batch)."""
        spans = BatchSpans(self.tracer)
        responses, outcomes, mask_lengths, sampler_seconds = self._answer(requests, spans)
        if spans.tracer:  # child spans of the requests tritonserver traces
            shared = {BATCH_SIZE: len(requests), MASK_WIDTH: self.mask_width}
            spans.emit(requests, [{OUTCOME: outcome, REASON: reason} for outcome, reason in outcomes], shared)
        try:
            self.metrics.record(outcomes, mask_lengths, sampler_seconds)
        except Exception as exc:  # metrics must never cost a request its answer
            self.logger.log_error(f"sampler metrics update failed: {type(exc).__name__}: {exc}")
        return responses

    def _answer(self, requests, spans: BatchSpans):
        """Responses, (outcome, reason) per request, mask lengths of mask rows, sampler seconds."""
        responses: list = [None] * len(requests)
        outcomes: list = [(metrics.INTERNAL, metrics.INTERNAL)] * len(requests)
        mask_lengths, sampler_seconds = np.zeros(0, np.int32), None
        try:
            parsed, positions = [], []
            for position, request in enumerate(requests):
                try:
                    item = parse_request(request, self.pb_utils, self.device, self.max_vocab_size, self.logits_dtype)
                except SamplingRequestError as exc:
                    responses[position] = error_response(self.pb_utils, exc.message)
                    outcomes[position] = (metrics.REJECTED, exc.reason)
                    continue
                parsed.append((item.logits, item.params))
                positions.append(position)
            spans.mark("parse")
            start = time.perf_counter()
            with batch_threads(sum(logits.numel() for logits, _ in parsed), self.device):
                results = self.sampler.run(parsed)
            sampler_seconds = time.perf_counter() - start if parsed else None
            spans.mark("sample")
            answered = []
            for position, outcome in zip(positions, results):
                if outcome.error is not None:
                    responses[position] = error_response(self.pb_utils, outcome.error)
                    outcomes[position] = (metrics.REJECTED, outcome.reason)
                else:
                    wanted = wanted_outputs(requests[position], self.declared_outputs)
                    responses[position] = sampler_response(self.pb_utils, outcome.outputs, wanted)
                    outcomes[position] = (metrics.OK, metrics.OK)
                    answered.append(outcome.outputs[SAMPLING_MASK_LEN.name])
            spans.mark("response")
            if answered:
                lengths = np.concatenate(answered).reshape(-1)
                mask_lengths = lengths[lengths > 0]  # rows that asked always have a non-empty support
        except Exception as exc:  # a genuine internal fault: fail only the unanswered requests
            self.logger.log_error(f"sampler internal error: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            message = f"internal sampler error ({type(exc).__name__}); see the server log"
            responses = [r if r is not None else error_response(self.pb_utils, message, "INTERNAL") for r in responses]
        return responses, outcomes, mask_lengths, sampler_seconds

    def finalize(self) -> None:
        """Only queued spans to export: the stub runs execute and finalize on one thread, and execute
        returns only once its batch is answered (Triton itself waits for in-flight requests on unload)."""
        self.tracer.shutdown()
        self.logger.log_info("sampler finalized")
