"""What the generate engine's loop and the response thread do per step and per token, besides the
LM and the sampler: the loop makes no metric update itself (each is an IPC round trip in the
stub), the chunks it hands over hold the values as sent, and a response carries exactly the
outputs and values it carried before these costs were moved."""

from __future__ import annotations

import threading

import numpy as np
import torch

from triton_sampling_mask.generation.engine import ContinuousEngine, EngineLimits
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.outputs import (
    FINISH_REASON,
    GENERATION_TOKEN_OUTPUT_NAMES,
    SAMPLING_MASK_LOGPROBS,
    WIRE_NEG_INF,
    to_wire_values,
)
from triton_sampling_mask.serving.generate_model import _Outbox
from triton_sampling_mask.serving.metrics import GenerateMetrics
from triton_sampling_mask.serving.triton_io import chunk_response

from .metrics_stub import MetricStub
from .test_generation import WIDTH, BigramLM, RecordingHandle, policy, request

UPDATING_THREADS: list[str] = []  # the thread of every metric update, in order


class _Family(MetricStub.MetricFamily):
    """MetricStub's family whose metrics also record the thread of each update."""

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' spelling)
        metric = super().Metric(labels, buckets)

        def recorded(update):
            def call(value):
                UPDATING_THREADS.append(threading.current_thread().name)
                update(value)

            return call

        metric.increment, metric.set = recorded(metric.increment), recorded(metric.set)
        return metric


class ThreadRecordingStub:
    """Pass as `pb_utils`: MetricStub's families, updates recorded in UPDATING_THREADS."""

    MetricFamily = _Family


class Logger:
    def log_error(self, message):
        raise AssertionError(message)


def run_engine(observer, reqs):
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    running = ContinuousEngine(BigramLM(), sampler, EngineLimits(), observer)
    handles = [RecordingHandle() for _ in reqs]
    for handle, req in zip(handles, reqs):
        running.submit(req, handle)
    running.start()
    try:
        for handle in handles:
            assert handle.done.wait(60)
    finally:
        running.stop()
    return handles


def test_the_engine_loop_makes_no_metric_update_itself():
    stub = MetricStub.reset()
    UPDATING_THREADS.clear()
    updates = _Outbox(Logger(), name="generate-metrics", lost="metrics not updated")
    metrics = GenerateMetrics(ThreadRecordingStub, "generate", defer=updates.put)
    budgets = [5, 9, 17, 3]
    reqs = [
        request([1, 2, i + 4], b, stream=i % 2 == 0, ignore_eos=True, seed=i, return_sampling_mask=True)
        for i, b in enumerate(budgets)
    ]
    run_engine(metrics, reqs)
    updates.stop()  # every update handed over is sent
    assert UPDATING_THREADS, "no metric was updated"
    assert set(UPDATING_THREADS) == {"generate-metrics"}
    assert stub.value("generate_tokens_total", model="generate") == sum(budgets)
    assert stub.value("generate_request_success_total", model="generate", finished_reason="length") == len(budgets)
    assert stub.value("generate_time_to_first_token_seconds_count", model="generate") == len(budgets)
    assert stub.value("generate_inter_token_latency_seconds_count", model="generate") == sum(budgets) - len(budgets)
    assert stub.value("generate_prompt_tokens_total", model="generate") == 3 * len(budgets)
    assert stub.value("generate_num_requests_running", model="generate") == 0


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.array(array)


class Response:
    def __init__(self, output_tensors):
        self.output_tensors = output_tensors


class PbUtils:
    Tensor = Tensor
    InferenceResponse = Response


def test_chunks_hold_the_values_as_sent_and_responses_carry_them_unchanged():
    # top_k 3 < WIDTH: every mask row is padded, so each chunk has padding to send
    reqs = [request([1, 2, 5], 6, stream=True, seed=1, top_k=3, return_sampling_mask=True)]
    reqs.append(request([1, 2, 6], 4, seed=2, top_k=3, return_sampling_mask=True))
    reqs.append(request([1, 2, 7], 4, seed=3))  # no mask: padded rows only
    handles = run_engine(_NullObserver(), reqs)
    for handle in handles:
        assert handle.chunks and not handle.errors
        for chunk in handle.chunks:
            values = chunk[SAMPLING_MASK_LOGPROBS.name]
            assert values.shape[1:] == (WIDTH,)
            assert not np.isneginf(values).any()
            np.testing.assert_array_equal(values, to_wire_values(SAMPLING_MASK_LOGPROBS.name, values))
            assert (values == np.float32(WIRE_NEG_INF)).any()  # the padding, as sent
            response = chunk_response(PbUtils, chunk)
            sent = {t.name: t.array for t in response.output_tensors}
            assert set(GENERATION_TOKEN_OUTPUT_NAMES) <= set(chunk.outputs)
            assert list(sent) == [*chunk.outputs, FINISH_REASON.name]
            for name in chunk.outputs:
                np.testing.assert_array_equal(sent[name], chunk[name][np.newaxis], err_msg=name)
            assert sent[FINISH_REASON.name].tolist() == [[chunk.finish_reason.encode()]]
            wanted = {"output_ids", FINISH_REASON.name}
            assert [t.name for t in chunk_response(PbUtils, chunk, wanted).output_tensors] == [
                "output_ids",
                FINISH_REASON.name,
            ]


class _NullObserver:
    def generated(self, tokens):
        pass

    def admitted(self, queue_seconds, prompt_tokens):
        pass

    def stepped(self, step):
        pass

    def occupancy(self, active, waiting, kv_tokens):
        pass
