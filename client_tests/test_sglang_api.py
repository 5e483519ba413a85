"""The HTTP API's SGLang dialect: /generate requests shaped as SGLang's own sampling-mask tests
send them (masks with a finite top_k, the refusal without one, greedy singletons, streaming,
the chat path with top_k), answered with SGLang's field names and nesting, and checked against
the generate model called directly with the same ids and seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from triton_sampling_mask.client import GenerateClient
from triton_sampling_mask.sampling.validation import UNBOUNDED_MASK_MESSAGE

from .api_reference import RULES, masks, post, reference, sse_events, tokenizer

MAX_NEW_TOKENS = 4
TOP_K, TOP_P = 10, 0.99
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def direct(triton_server):
    with GenerateClient(triton_server.grpc_url) as client:
        yield client


def generate(api_server, sampling_params: dict, **fields):
    body = {
        "text": TEXT,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": MAX_NEW_TOKENS,
            "ignore_eos": True,
            **sampling_params,
        },
        "return_sampling_mask": True,
        **fields,
    }
    return post(f"{api_server.url}/generate", body)


def assert_aligned(output_ids: list[int], meta: dict, mode: str = "selected") -> None:
    """SGLang's alignment checks: one mask and log-prob entry per token, the token in its mask."""
    sampling_masks, logprobs = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert len(sampling_masks) == len(logprobs) == len(output_ids) == meta["output_token_sampling_mask_length"]
    for token, mask, value in zip(output_ids, sampling_masks, logprobs):
        assert token in mask and len(mask) == len(set(mask))
        if mode == "support":
            assert len(value) == len(mask) and all(math.isfinite(v) for v in value)
            assert abs(sum(math.exp(v) for v in value) - 1.0) < 1e-5
        else:
            assert isinstance(value, float) and math.isfinite(value) and value <= 0.0


@pytest.mark.parametrize("params", [{"top_p": TOP_P}, {}, {"top_p": 1.0}])
def test_generate_returns_sampling_masks_with_a_finite_top_k(api_server, params):
    code, output, _ = generate(api_server, {"top_k": TOP_K, **params})
    assert code == 200, output
    meta = output["meta_info"]
    assert len(output["output_ids"]) == MAX_NEW_TOKENS == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW_TOKENS}
    assert meta["prompt_tokens"] == len(tokenizer().encode(TEXT)) and isinstance(meta["id"], str)
    assert_aligned(output["output_ids"], meta)
    assert all(len(mask) <= TOP_K for mask in meta["output_token_sampling_mask"])


def test_generate_matches_the_generate_model(api_server, direct):
    ids = tokenizer().encode(TEXT)
    sampling = {"temperature": RULES["temperature"], "top_k": RULES["top_k"], "top_p": RULES["top_p"]}
    sampling.update(min_p=RULES["min_p"], sampling_seed=77, max_new_tokens=6)
    code, output, _ = post(
        f"{api_server.url}/generate",
        {
            "input_ids": ids,
            "sampling_params": {**sampling, "ignore_eos": True},
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
            "return_logprob": True,
        },
    )
    assert code == 200, output
    ref = reference(direct, ids, 77, 6)
    meta = output["meta_info"]
    assert output["output_ids"] == ref.output_ids.tolist() and meta["output_token_sampling_mask"] == masks(ref)
    assert_aligned(output["output_ids"], meta, "support")
    for got, row, n in zip(meta["output_token_sampling_logprobs"], ref.sampling_mask_logprobs, ref.sampling_mask_len):
        np.testing.assert_array_equal(np.float32(got), row[:n])
    logprobs = meta["output_token_logprobs"]  # [logprob, id, text or None] per token
    assert [entry[1] for entry in logprobs] == output["output_ids"] and all(e[2] is None for e in logprobs)
    np.testing.assert_array_equal(np.float32([e[0] for e in logprobs]), ref.output_logprobs)
    assert output["text"] == tokenizer().decode(output["output_ids"], skip_special_tokens=True)


def test_greedy_masks_are_singletons(api_server):
    code, output, _ = generate(api_server, {"temperature": 0.0})
    assert code == 200, output
    assert all(len(mask) == 1 for mask in output["meta_info"]["output_token_sampling_mask"])
    assert_aligned(output["output_ids"], output["meta_info"])


@pytest.mark.parametrize("params", [{"top_p": TOP_P}, {"top_p": 1.0}, {"top_k": 129}])
def test_unbounded_or_too_wide_masks_are_refused(api_server, params):
    code, answer, _ = generate(api_server, params)
    assert code == 400
    message = answer["error"]["message"]
    assert (UNBOUNDED_MASK_MESSAGE if "top_p" in params else "W=128") in message
    assert answer["error"]["param"] == "sampling_params.top_k"
    code, answer, _ = generate(api_server, params, stream=True)  # refused before streaming starts
    assert code == 400 and answer["error"]["param"] == "sampling_params.top_k"


def test_streamed_events_are_aligned_and_end_as_the_whole_answer(api_server):
    params = {"top_k": TOP_K, "top_p": TOP_P, "sampling_seed": 5}
    code, whole, _ = generate(api_server, params, return_logprob=True)
    assert code == 200, whole
    code, text, headers = generate(api_server, params, return_logprob=True, stream=True)
    assert code == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(text)
    lengths = [len(event["output_ids"]) for event in events]  # each holds the sequence so far, as SGLang's
    assert lengths == sorted(set(lengths)) and lengths[0] >= 1 and lengths[-1] == MAX_NEW_TOKENS, lengths
    for event in events:  # one token or more per event: those made while the last event waited
        assert_aligned(event["output_ids"], event["meta_info"])
    last = events[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    for key in (
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
        "output_token_logprobs",
        "finish_reason",
    ):
        assert last["meta_info"][key] == whole["meta_info"][key]
    assert all(event["meta_info"]["finish_reason"] is None for event in events[:-1])


def test_a_batch_with_per_prompt_parameters_and_n(api_server, direct):
    prompts = [[5, 6, 7], [40, 41]]
    body = {
        "input_ids": prompts,
        "sampling_params": [
            {"top_k": 8, "max_new_tokens": 3, "sampling_seed": 1, "n": 2, "ignore_eos": True},
            {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True},
        ],
        "return_sampling_mask": True,
        "rid": "batch",
    }
    code, outputs, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, outputs
    assert [o["meta_info"]["id"] for o in outputs] == ["batch-0", "batch-1", "batch-2"]
    assert [len(o["output_ids"]) for o in outputs] == [3, 3, 2]
    for j in range(2):  # the n copies of a seeded prompt: seed + j
        ref = reference(direct, prompts[0], 1 + j, 3, temperature=1.0, top_k=8)
        assert outputs[j]["output_ids"] == ref.output_ids.tolist()
        assert outputs[j]["meta_info"]["output_token_sampling_mask"] == masks(ref)


def test_a_stop_string_is_matched_on_the_text_and_reported(api_server):
    params = {"top_k": TOP_K, "sampling_seed": 9, "max_new_tokens": 16}
    code, whole, _ = generate(api_server, params)
    text = whole["text"]
    stop = text[5:8]
    code, cut, _ = generate(api_server, {**params, "stop": stop})
    assert code == 200, cut
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert_aligned(cut["output_ids"], cut["meta_info"])


def test_without_a_mask_no_mask_fields(api_server):
    code, output, _ = post(
        f"{api_server.url}/generate",
        {
            "text": TEXT,
            "sampling_params": {"top_k": 1, "max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert code == 200 and len(output["meta_info"]["output_token_logprobs"]) == 3
    for key in ("output_token_sampling_mask", "output_token_sampling_logprobs", "output_token_sampling_mask_length"):
        assert key not in output["meta_info"]


def test_the_chat_path_with_top_k_returns_sglangs_meta_info(api_server):
    code, answer, _ = post(
        f"{api_server.url}/v1/chat/completions",
        {
            "model": "generate",
            "messages": [{"role": "user", "content": "Name a capital city."}],
            "temperature": 1.0,
            "top_k": TOP_K,
            "top_p": TOP_P,
            "max_tokens": MAX_NEW_TOKENS,
            "ignore_eos": True,
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
            "return_meta_info": True,
            "return_token_ids": True,
        },
    )
    assert code == 200, answer
    choice = answer["choices"][0]
    assert len(choice["response_token_ids"]) == MAX_NEW_TOKENS and choice["token_ids"] == choice["response_token_ids"]
    assert_aligned(choice["response_token_ids"], choice["meta_info"], "support")
    code, refused, _ = post(
        f"{api_server.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0.8, "stream": True, "return_sampling_mask": True},
    )
    assert code == 400 and refused["error"]["message"] == UNBOUNDED_MASK_MESSAGE


BAD = {
    "text and input_ids": ({"text": "a", "input_ids": [1]}, "text", "either"),
    "neither": ({"sampling_params": {}}, "text", "either"),
    "unknown sampling param": ({"text": "a", "sampling_params": {"top_a": 1}}, "sampling_params.top_a", "unknown"),
    "wrong type": (
        {"text": "a", "sampling_params": {"max_new_tokens": "3"}},
        "sampling_params.max_new_tokens",
        "integer",
    ),
    "params per prompt": ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "2 prompts"),
    "top logprobs": ({"text": "a", "top_logprobs_num": 5}, "top_logprobs_num", "sampled token"),
    "past the context": ({"input_ids": [3] * 600}, "input_ids", "context"),
    "huge n": ({"text": "a", "sampling_params": {"n": 100000}}, "sampling_params.n", "--max-choices"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_generate_requests_name_the_field(api_server, name):
    body, param, words = BAD[name]
    code, answer, _ = post(f"{api_server.url}/generate", body)
    assert code == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer


def test_sglangs_weight_endpoints_answer_and_need_the_admin_key(api_server):
    """The SGLang-named weight endpoints reach the generate model's control requests: the version
    is open, every operation that changes something needs the server's admin key (the session's
    server sets none, so they are refused), refusals in SGLang's `{"success": false, "message"}`
    shape, and what SGLang has that we do not is a 400 (client_tests/test_api_weights.py: the rest)."""
    status, body = api_server.get("/get_weight_version")
    assert status == 200 and isinstance(body["weight_version"], str) and body["weight_version"], body
    key = {"triton-admin-key": "w" * 40}
    for path, payload in (
        ("/update_weights_from_disk", {"model_path": "step-1"}),
        ("/pause_generation", {"mode": "abort"}),
        ("/continue_generation", {}),
    ):
        status, answer, _ = post(api_server.url + path, payload, key)
        assert status == 403 and answer["success"] is False, (path, status, answer)
        assert "admin key" in answer["message"], answer
        status, answer, _ = post(api_server.url + path, payload)  # no key: refused before the model
        assert status == 403 and "admin key" in answer["message"], answer
    status, answer, _ = post(api_server.url + "/pause_generation", {"mode": "retract"}, key)
    assert status == 400 and "retract" in answer["message"], answer
    status, answer, _ = post(api_server.url + "/update_weights_from_disk", {"model_path": "x", "extra": 1}, key)
    assert status == 400 and "unknown field 'extra'" in answer["message"], answer
    assert api_server.get("/get_weight_version")[0] == 200  # and the API serves on


@pytest.mark.parametrize("stream", [False, True])
def test_timings_in_meta_info_on_request(api_server, stream):
    """SGLang's own keys where the meanings match (queue_time, inference_time), consistent with
    e2e_latency (the API's clock, around the engine's) and with the client's clock."""
    import time

    status, plain, _ = generate(api_server, {"sampling_seed": 2, "top_k": TOP_K})
    assert status == 200 and "queue_time" not in plain["meta_info"]
    started = time.perf_counter()
    status, body, _ = generate(api_server, {"sampling_seed": 2, "top_k": TOP_K}, return_timings=True, stream=stream)
    seconds = time.perf_counter() - started
    assert status == 200, body
    meta = (sse_events(body)[-1] if stream else body)["meta_info"]
    n = meta["completion_tokens"]
    assert n == MAX_NEW_TOKENS
    slack = 1e-5  # float32 seconds from the engine
    assert 0 <= meta["queue_time"] <= meta["time_to_first_token"] + slack
    assert meta["time_to_first_token"] <= meta["queue_time"] + meta["inference_time"] + slack
    assert meta["queue_time"] + meta["inference_time"] <= meta["e2e_latency"] + slack <= seconds + slack
    assert meta["tokens_per_second"] == pytest.approx(n / meta["inference_time"], rel=1e-9)
    itl = (meta["queue_time"] + meta["inference_time"] - meta["time_to_first_token"]) / (n - 1)
    assert meta["mean_inter_token_latency"] == pytest.approx(itl, rel=1e-9)
