"""The generate model's bound on `stop_token_ids` (generation.request.MAX_STOP_TOKEN_IDS): a longer
list is refused with a 400 naming the field before any token is generated; the bound itself is
accepted."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from testbed.metrics import counter
from triton_sampling_mask.generation.request import MAX_STOP_TOKEN_IDS

from .generate_client import grpc_generate, http_generate

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def width(http_client) -> int:
    """W, read from the served model's config (its only source)."""
    config = http_client.get_model_config("generate")
    return int(next(o for o in config["output"] if o["name"] == "sampling_mask")["dims"][-1])


def stop_ids(count: int) -> np.ndarray:
    """`count` stop ids, all inside the LM's vocabulary (repeats allowed)."""
    return np.arange(count, dtype=np.int32) % 100 + 200


def test_more_stop_token_ids_than_the_bound_are_refused_before_any_token(triton_server, width):
    assert MAX_STOP_TOKEN_IDS == 1024  # the bound docs/generate.md states
    tokens_before = counter(triton_server.metrics_url, "generate_tokens_total")
    too_many = stop_ids(MAX_STOP_TOKEN_IDS + 1)
    status, body = http_generate(triton_server.http_url, PROMPT, 4, width, stop_token_ids=too_many, ignore_eos=True)
    assert status == 400 and "stop_token_ids" in body["error"] and "1025" in body["error"], (status, body)
    with pytest.raises(InferenceServerException) as refusal:
        grpc_generate(triton_server.grpc_url, PROMPT, 4, stop_token_ids=too_many, ignore_eos=True)
    assert "stop_token_ids" in refusal.value.message() and "1025" in refusal.value.message()  # in-band on the stream
    assert counter(triton_server.metrics_url, "generate_tokens_total") == tokens_before, "a token was generated"


def test_as_many_stop_token_ids_as_the_bound_are_accepted(triton_server, width):
    status, generation = http_generate(
        triton_server.http_url, PROMPT, 4, width, stop_token_ids=stop_ids(MAX_STOP_TOKEN_IDS), ignore_eos=True
    )
    assert status == 200, generation
    assert 1 <= len(generation.output_ids) <= 4
