"""The routers slime and Miles put in front of their engines (sglang-router 0.3.2, its successor smg
1.13) in front of two replicas of `make serve`'s stack: they register each replica (their info probes),
then re-serialise every request with their own defaults (`model: null`/"unknown", log_metrics,
return_hidden_states, background, ...; see /work notes frameworks.md §8) and must still be answered."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from testbed.stack import launch, shipped_repository

from .conftest import TRUSTED
from .routers import launch_router
from .wire import read

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = [17, 301, 42, 9, 555]


@pytest.fixture(scope="module")
def second_replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat_replica")
    running = launch(
        shipped_repository(root / "models"), root / "launcher.log", env={"TRITON_API_TRUSTED_NETWORKS": TRUSTED}
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module", params=["sglang-router", "smg"])
def router(request, stack, second_replica, tmp_path_factory):
    workers = [f"http://127.0.0.1:{s.ports['api']}" for s in (stack, second_replica)]
    running = launch_router(request.param, workers, tmp_path_factory.mktemp("router") / f"{request.param}.log")
    try:
        yield running
    finally:
        running.stop()


def slime_payload() -> dict:
    spec = json.loads((FIXTURES / "slime_generate.json").read_text())
    body = copy.deepcopy(spec["payload"])
    body["input_ids"] = list(PROMPT)
    return body


def test_slime_payload_through_the_router(router):
    spec = json.loads((FIXTURES / "slime_generate.json").read_text())
    for _ in range(4):  # round robin: each replica answers twice
        status, answer = router.post("/generate", slime_payload())
        assert status == 200, (router.kind, answer)
        tokens = read(answer, spec["reads"]["tokens"])
        assert len(tokens) == len(read(answer, spec["reads"]["logprobs"])) >= 1
        assert read(answer, spec["reads"]["finish_reason"]) in spec["finish_reasons"]
        assert isinstance(read(answer, spec["optional_reads"]["weight_version"]), str)


def test_chat_through_the_router(router):
    body = {"model": "generate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}
    status, answer = router.post("/v1/chat/completions", body)
    assert status == 200, (router.kind, answer)
    assert len(answer["choices"][0]["logprobs"]["content"]) >= 1


def test_mask_request_through_smg(router):
    """smg forwards fields it does not know (sglang-router 0.3.2 drops return_sampling_mask: through it a
    /generate client cannot ask for masks at all)."""
    if router.kind != "smg":
        pytest.skip("sglang-router 0.3.2 drops return_sampling_mask from /generate before it reaches a worker")
    body = slime_payload()
    body["sampling_params"]["top_k"] = 8
    body["return_sampling_mask"] = True
    status, answer = router.post("/generate", body)
    assert status == 200, answer
    tokens = [entry[1] for entry in answer["meta_info"]["output_token_logprobs"]]
    masks = answer["meta_info"]["output_token_sampling_mask"]
    assert len(masks) == len(tokens) and all(t in m for t, m in zip(tokens, masks))
