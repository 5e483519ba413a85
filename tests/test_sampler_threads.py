"""The sampler stub's intra-op threads per batch: a decode step's few rows on one thread (a team
waits at each barrier for its slowest member, which a busy neighbour keeps off a CPU), a large
batch on the stub's own threads, and the stub's number restored after either."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from triton_sampling_mask.serving import sampler_model
from triton_sampling_mask.serving.sampler_model import SamplerModel
from triton_sampling_mask.serving.tracing import BatchSpans

VOCAB = 151936


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _model(monkeypatch, seen: list[int]) -> SamplerModel:
    """A SamplerModel whose sampler records the threads it ran on (requests are their logits)."""

    class Sampler:
        def run(self, parsed):
            seen.append(torch.get_num_threads())
            return [SimpleNamespace(error="refused", reason="test")] * len(parsed)

    model = SamplerModel.__new__(SamplerModel)
    model.pb_utils, model.sampler, model.device = None, Sampler(), torch.device("cpu")
    model.max_vocab_size, model.logits_dtype = 262144, torch.float32
    monkeypatch.setattr(
        sampler_model, "parse_request", lambda request, *_: SimpleNamespace(logits=request, params=None)
    )
    monkeypatch.setattr(sampler_model, "error_response", lambda *_args, **_kwargs: "error")
    return model


@pytest.mark.parametrize(
    ("requests_rows", "threads"),
    [((1,), 1), ((2, 2, 2), 1), ((8,), 1), ((27,), 1), ((28,), 2), ((16, 16), 2), ((64,), 2)],
)
def test_a_batch_of_a_few_rows_is_sampled_on_one_thread_and_a_large_one_on_the_stubs(
    monkeypatch, two_threads, requests_rows, threads
):
    seen: list[int] = []
    model = _model(monkeypatch, seen)
    requests = [torch.zeros(rows, VOCAB) for rows in requests_rows]
    model._answer(requests, BatchSpans(None))
    assert seen == [threads]
    assert torch.get_num_threads() == 2


def test_the_stubs_threads_come_back_when_sampling_fails(monkeypatch, two_threads):
    model = _model(monkeypatch, [])

    def fail(parsed):
        raise RuntimeError("boom")

    model.sampler.run = fail
    model.logger = SimpleNamespace(log_error=lambda message: None)
    monkeypatch.setattr(sampler_model, "error_response", lambda *_args, **_kwargs: "error")
    responses, *_ = model._answer([torch.zeros(1, VOCAB)], BatchSpans(None))
    assert responses == ["error"] and torch.get_num_threads() == 2
