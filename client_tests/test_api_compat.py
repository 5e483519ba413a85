"""The HTTP API with the RL frameworks' and routers' own request bodies: each payload is the one
the named upstream client builds (its source named beside it), sent to the API in front of the
session's real server, and the seeded answers are compared with the generate model called
directly with the same ids and seed. Every field the field table accepts at a neutral value only
is refused at any other value with a 400 naming it; fields nobody knows follow each route's
upstream server; the worker routes routers read answer as SGLang's do."""

from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import pytest

from triton_sampling_mask.api.field_table import (
    CHAT,
    COMPLETIONS,
    FIELD_RULES,
    GENERATE,
    GENERATE_SAMPLING,
    NEUTRAL,
    OPENAI,
    TOKENS_SAMPLING,
)
from triton_sampling_mask.client import GenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams

from .api_reference import masks, post, sse_events, tokenizer

SEED = 1234
PROMPT_TEXT = "Rollouts return sampling masks"


@pytest.fixture(scope="module")
def direct(triton_server):
    with GenerateClient(triton_server.grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def ids():
    return tokenizer().encode(PROMPT_TEXT)


def run_direct(direct, prompt_ids, seed, max_new_tokens, ignore_eos=False, stop_token_ids=(), **rules):
    """The generate model's own answer (masks when the rules bound the support)."""
    params = SamplingParams(**rules, seed=seed)
    return direct.generate(
        [list(prompt_ids)], params, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )[0]


def spans(versions) -> list[dict]:
    """The weight-version spans of per-token versions, built here independently of the API."""
    out = []
    for i, v in enumerate(list(versions)):
        if out and out[-1]["version"] == v:
            out[-1]["end"] = i + 1
        else:
            out.append({"version": v, "start": i, "end": i + 1})
    return out


# -- SGLang's /generate: slime, Miles, AReaL and the routers' re-serialised bodies --


def slime_payload(prompt_ids, max_new_tokens: int) -> dict:
    """slime's `slime/rollout/sglang_rollout.py` (GenerateState.sampling_params, generate()), with
    its defaults: --rollout-top-k -1, --rollout-top-p 1.0, no stop, skip_special_tokens false, a
    sampling_seed under --sglang-enable-deterministic-inference."""
    return {
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "sampling_seed": SEED,
        },
        "return_logprob": True,
        "input_ids": list(prompt_ids),
    }


def check_against_direct(output: dict, ref, skip_special_tokens: bool, keep_stop_text: bool) -> None:
    meta = output["meta_info"]
    assert output["output_ids"] == ref.output_ids.tolist()
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == ref.output_ids.tolist()
    np.testing.assert_array_equal(np.float32([e[0] for e in entries]), ref.output_logprobs)
    ids = ref.output_ids.tolist()
    if ref.finish_reason == "stop" and not keep_stop_text:
        ids = ids[:-1]
    assert output["text"] == tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)
    assert meta["weight_version"] == ref.weight_version[-1]
    assert meta["weight_versions"] == spans(ref.weight_version)


def test_slimes_payload_is_served_as_the_generate_model_answers(api_server, direct, ids):
    code, output, _ = post(f"{api_server.url}/generate", slime_payload(ids, 24))
    assert code == 200, output
    ref = run_direct(direct, ids, SEED, 24, temperature=1.0, top_p=1.0, top_k=-1)
    check_against_direct(output, ref, skip_special_tokens=False, keep_stop_text=True)


def test_miles_payload_with_its_moe_switches_off_is_served(api_server, direct, ids):
    """Miles (slime's fork) adds `return_routed_experts` and `return_indexer_topk`, false unless
    its routing replay is on (miles/rollout/sglang_rollout.py)."""
    body = slime_payload(ids, 12) | {"return_routed_experts": False, "return_indexer_topk": False}
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, output
    ref = run_direct(direct, ids, SEED, 12, temperature=1.0, top_p=1.0, top_k=-1)
    check_against_direct(output, ref, skip_special_tokens=False, keep_stop_text=True)


def test_sglang_router_reserialised_generate_is_served(api_server, direct, ids):
    """sglang-router 0.3.2 forwards /generate re-serialised from its GenerateRequest
    (sgl-router/src/protocols/generate.rs): every bool field written with its default, the
    sampling parameters it knows (ignore_eos always), `model: null`."""
    body = {
        "input_ids": list(ids),
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 10, "top_k": 20, "ignore_eos": True},
        "return_logprob": True,
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "model": None,
        "rid": "router-1",
    }
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, output
    assert output["meta_info"]["id"] == "router-1" and len(output["output_ids"]) == 10
    seeded = dict(body, sampling_params={**body["sampling_params"], "sampling_seed": 9})
    code, output, _ = post(f"{api_server.url}/generate", seeded)
    ref = run_direct(direct, ids, 9, 10, ignore_eos=True, temperature=0.7, top_k=20)
    assert code == 200 and output["output_ids"] == ref.output_ids.tolist()


def test_smgs_unknown_model_on_generate_is_ignored_as_sglang_ignores_it(api_server, direct, ids):
    """smg 1.13 forwards /generate with `"model": "unknown"` (the name it gives a worker whose model
    it could not read); SGLang's GenerateReqInput has no `model`, so SGLang ignores it."""
    body = slime_payload(ids, 8) | {"model": "unknown"}
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, output
    ref = run_direct(direct, ids, SEED, 8, temperature=1.0, top_p=1.0, top_k=-1)
    assert output["output_ids"] == ref.output_ids.tolist()


def test_slimes_top_p_replay_gets_each_tokens_mask_as_flat_ids_and_offsets(api_server, direct, ids):
    """slime with --rollout-top-p below 1 sends custom_params.return_top_p_token_ids and reads
    meta_info.top_p_token_ids / top_p_token_offsets (slime/utils/types.py): with a finite top_k they
    are the generate model's masks, flat; with slime's default top_k -1 the mask is unbounded and
    refused as every unbounded mask request is; any other custom parameter is refused by name."""
    body = slime_payload(ids, 10)
    body["sampling_params"] |= {"top_p": 0.9, "top_k": 12, "custom_params": {"return_top_p_token_ids": True}}
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, output
    ref = run_direct(direct, ids, SEED, 10, temperature=1.0, top_p=0.9, top_k=12, return_sampling_mask=True)
    expected = masks(ref)
    meta = output["meta_info"]
    assert "output_token_sampling_mask" not in meta  # only what slime asked for
    offsets = meta["top_p_token_offsets"]
    assert offsets == [0, *np.cumsum([len(m) for m in expected]).tolist()]
    assert [meta["top_p_token_ids"][a:b] for a, b in zip(offsets, offsets[1:])] == expected
    body["sampling_params"]["top_k"] = -1
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 400 and output["error"]["param"] == "sampling_params.top_k", output
    assert "requires finite top_k" in output["error"]["message"]
    body["sampling_params"] |= {"top_k": 12, "custom_params": {"return_top_p_token_ids": True, "temp": 2}}
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 400 and output["error"]["param"] == "sampling_params.custom_params", output
    assert "custom_params.temp is not supported" in output["error"]["message"]


def test_areal_empty_image_data_is_neutral(api_server, ids):
    """AReaL 1.0.4's SGLang request (areal/engine/sglang_remote.py) carries `"image_data": []`."""
    body = {
        "input_ids": list(ids),
        "image_data": [],
        "sampling_params": {"top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "temperature": 1.0, "stop_token_ids": [2]},
        "return_logprob": True,
        "stream": False,
    }
    code, output, _ = post(f"{api_server.url}/generate", body)
    assert code == 200, output
    code, refused, _ = post(f"{api_server.url}/generate", body | {"image_data": ["data:image/png;base64,AAAA"]})
    assert code == 400 and refused["error"]["param"] == "image_data", refused
    assert "text token ids only" in refused["error"]["message"]


def test_stop_text_is_trimmed_unless_asked(api_server, direct, ids):
    """SGLang trims a stop string from the text unless no_stop_trim; vLLM likewise unless
    include_stop_str_in_output; the tokens end with the one that completed it either way."""
    base = {"input_ids": list(ids), "return_logprob": True}
    params = {"top_k": 30, "sampling_seed": 5, "max_new_tokens": 24, "ignore_eos": True}
    code, whole, _ = post(f"{api_server.url}/generate", base | {"sampling_params": params})
    text = whole["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    at = text.index(stop)
    for keep in (False, True):
        sampling = params | {"stop": stop, "no_stop_trim": keep}
        code, cut, _ = post(f"{api_server.url}/generate", base | {"sampling_params": sampling})
        assert code == 200, cut
        assert cut["text"] == (text[: at + len(stop)] if keep else text[:at])
        events = sse_events(post(f"{api_server.url}/generate", base | {"sampling_params": sampling, "stream": True})[1])
        assert events[-1]["text"] == cut["text"] and events[-1]["output_ids"] == cut["output_ids"]
    # A stop token's own text: left out by default, kept with include_stop_str_in_output.
    ref = run_direct(direct, ids, 5, 24, ignore_eos=True, top_k=30)
    stop_id = int(ref.output_ids[6])
    first = ref.output_ids.tolist().index(stop_id)
    request = {"model": "generate", "prompt": list(ids), "max_tokens": 24, "seed": 5, "top_k": 30}
    request |= {"ignore_eos": True, "stop_token_ids": [stop_id], "temperature": 1.0}
    for keep in (False, True):
        code, answer, _ = post(f"{api_server.url}/v1/completions", request | {"include_stop_str_in_output": keep})
        assert code == 200, answer
        kept = ref.output_ids.tolist()[: first + (1 if keep else 0)]
        assert answer["choices"][0]["text"] == tokenizer().decode(kept, skip_special_tokens=True)


def test_min_tokens_holds_back_stop_strings_and_is_refused_where_eos_could_end_it(api_server, ids):
    base = {"model": "generate", "prompt": list(ids), "max_tokens": 24, "seed": 8, "top_k": 30, "ignore_eos": True}
    code, whole, _ = post(f"{api_server.url}/v1/completions", base | {"return_token_ids": True})
    text = whole["choices"][0]["text"]
    stop = text[2:4]
    code, early, _ = post(f"{api_server.url}/v1/completions", base | {"stop": [stop], "return_token_ids": True})
    assert early["choices"][0]["finish_reason"] == "stop"
    cut = len(early["choices"][0]["token_ids"])
    code, held, _ = post(
        f"{api_server.url}/v1/completions", base | {"stop": [stop], "min_tokens": cut + 1, "return_token_ids": True}
    )
    assert code == 200 and len(held["choices"][0]["token_ids"]) > cut, held
    code, refused, _ = post(f"{api_server.url}/v1/completions", base | {"min_tokens": 3, "ignore_eos": False})
    assert code == 400 and refused["error"]["param"] == "min_tokens", refused
    code, refused, _ = post(
        f"{api_server.url}/generate",
        {"input_ids": list(ids), "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [5], "ignore_eos": True}},
    )
    assert code == 400 and refused["error"]["param"] == "sampling_params.min_new_tokens", refused


# -- OpenAI dialect: TRL's VLLMClient, lax types, vLLM's extensions --


def test_trl_vllm_client_generate_payload(api_server, direct):
    """TRL 1.16's `VLLMClient.generate` (trl/generation/vllm_client.py): prompts, top_k 0 (vLLM's
    off), logprobs 0, return_tokens_as_token_ids; it reads choice.prompt_token_ids,
    choice.token_ids and logprobs.tokens / top_logprobs (a list of dicts) keyed `token_id:N`."""
    n = 2
    payload = {
        "model": "generate",
        "prompt": [PROMPT_TEXT],
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "n": n,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 8,
        "logprobs": 0,
        "seed": SEED,  # generation_kwargs
    }
    code, answer, _ = post(f"{api_server.url}/v1/completions", payload)
    assert code == 200, answer
    choices = answer["choices"]
    prompt_ids = choices[0]["prompt_token_ids"]
    for j, choice in enumerate(choices):
        ref = run_direct(direct, prompt_ids, SEED + j, 8, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
        assert choice["token_ids"] == ref.output_ids.tolist()
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
        # TRL's parse_logprobs: the sampled token plus top_logprobs, sorted; each token_id:N parsed.
        for token, value, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert top == {token: value}
        np.testing.assert_allclose(np.float32(logprobs["token_logprobs"]), ref.output_logprobs, rtol=0, atol=1e-4)


def test_lax_types_as_vllm_takes_them(api_server):
    """vLLM's request models are pydantic's lax mode: a numeric string is a number."""
    body = {"prompt": PROMPT_TEXT, "max_tokens": "5", "ignore_eos": "true", "n": "1", "temperature": "0"}
    code, answer, _ = post(f"{api_server.url}/v1/completions", body)
    assert code == 200 and answer["usage"]["completion_tokens"] == 5, answer
    code, answer, _ = post(f"{api_server.url}/generate", {"text": "a", "sampling_params": {"max_new_tokens": "5"}})
    assert code == 400 and answer["error"]["param"] == "sampling_params.max_new_tokens"  # SGLang's contract: strict


def test_sglang_router_chat_defaults_and_continue_final_message(api_server, ids):
    """sglang-router 0.3.2 re-serialises chat with SGLang's chat extras at their defaults
    (no_stop_trim, continue_final_message, separate_reasoning, stream_reasoning)."""
    messages = [{"role": "user", "content": "Name a rule."}, {"role": "assistant", "content": "The rule"}]
    body = {
        "model": "generate",
        "messages": messages[:1],
        "max_tokens": 4,
        "no_stop_trim": False,
        "continue_final_message": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_token_ids": True,
    }
    code, answer, _ = post(f"{api_server.url}/v1/chat/completions", body)
    assert code == 200, answer
    code, answer, _ = post(
        f"{api_server.url}/v1/chat/completions",
        body | {"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert code == 200, answer
    text = tokenizer().apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert answer["prompt_token_ids"] == tokenizer().encode(text, add_special_tokens=False)


def test_openai_weight_versions(api_server, direct, ids):
    request = {"model": "generate", "prompt": list(ids), "max_tokens": 6, "seed": 3, "top_k": 12, "ignore_eos": True}
    ref = run_direct(direct, ids, 3, 6, ignore_eos=True, top_k=12)
    code, answer, _ = post(f"{api_server.url}/v1/completions", request | {"return_weight_versions": True})
    assert code == 200 and answer["choices"][0]["weight_versions"] == spans(ref.weight_version), answer
    code, text, _ = post(f"{api_server.url}/v1/completions", request | {"return_weight_versions": True, "stream": True})
    events = sse_events(text)  # one token or more each: those made while the last event waited
    carried = [e["choices"][0].get("weight_versions") is not None for e in events]
    assert 1 <= len(events) <= 6 and carried == [False] * (len(events) - 1) + [True], carried
    assert events[-1]["choices"][0]["weight_versions"] == spans(ref.weight_version)
    assert "".join(e["choices"][0]["text"] for e in events) == answer["choices"][0]["text"]


# -- vLLM's token route: verifiers' TrainClient (renderers.client.generate) and skyrl --


def renderers_payload(prompt_ids, sampling: dict) -> dict:
    """`renderers.client.generate` 0.1.12, which verifiers 0.4's TrainClient calls: the caller's
    sampling params with stop_token_ids, logprobs 1 and skip_special_tokens false set."""
    return {
        "model": "generate",
        "token_ids": list(prompt_ids),
        "sampling_params": {**sampling, "stop_token_ids": [], "logprobs": 1, "skip_special_tokens": False},
    }


def test_verifiers_train_client_gets_tokens_logprobs_and_masks(api_server, direct, ids):
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 16, "max_tokens": 8, "seed": 21, "ignore_eos": True}
    sampling["routed_experts_prompt_start"] = 0  # sent when it bridges turns
    code, answer, _ = post(f"{api_server.url}/inference/v1/generate", renderers_payload(ids, sampling))
    assert code == 200, answer
    ref = run_direct(
        direct, ids, 21, 8, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=16, return_sampling_mask=True
    )
    choice = answer["choices"][0]
    assert choice["token_ids"] == ref.output_ids.tolist() and choice["sampling_mask"] == masks(ref)
    assert choice["finish_reason"] == "length" and choice["weight_versions"] == spans(ref.weight_version)
    content = choice["logprobs"]["content"]
    # renderers' _parse_completion_logprobs: one entry per token, token == "token_id:N", a finite number.
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in choice["token_ids"]]
    np.testing.assert_array_equal(np.float32([e["logprob"] for e in content]), ref.output_logprobs)
    for row, entry in enumerate(content):  # the sampled token first, then the most probable support id
        top = entry["top_logprobs"]
        assert top[0]["token_id"] == entry["token_id"]
        mask_row = ref.sampling_mask[row, : ref.sampling_mask_len[row]].tolist()
        if mask_row[0] != entry["token_id"]:
            log_mass = ref.output_logprobs[row] - ref.sampling_logprobs[row]
            expected = np.float32(ref.sampling_mask_logprobs[row, 0]) + np.float32(log_mass)
            assert top[1]["token_id"] == mask_row[0] and top[1]["rank"] == 1
            np.testing.assert_allclose(top[1]["logprob"], expected, rtol=0, atol=1e-5)
        else:
            assert len(top) == 1
    assert answer["usage"]["completion_tokens"] == 8 and answer["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("sampling", "has_masks"),
    [({"top_k": 0}, False), ({"top_k": -1}, False), ({"top_k": 8}, True), ({"temperature": 0.0}, True)],
)
def test_token_route_returns_masks_for_a_bounded_support_without_a_request_field(api_server, ids, sampling, has_masks):
    """As vLLM's --return-sampling-mask: no request field; a finite top_k (or greedy) has masks."""
    body = {"token_ids": list(ids), "sampling_params": {"max_tokens": 3, "ignore_eos": True, **sampling}}
    code, answer, _ = post(f"{api_server.url}/inference/v1/generate", body)
    assert code == 200, answer
    mask = answer["choices"][0]["sampling_mask"]
    assert (mask is not None) == has_masks and answer["choices"][0]["logprobs"] is None
    if sampling.get("temperature") == 0.0:
        assert all(len(m) == 1 for m in mask) and [m[0] for m in mask] == answer["choices"][0]["token_ids"]


def test_prime_rls_return_sampling_mask_on_the_token_route(api_server, ids):
    """prime-rl's orchestrator puts `return_sampling_mask` in sampling_params (notes/frameworks.md)."""
    url = f"{api_server.url}/inference/v1/generate"
    body = {"token_ids": list(ids), "sampling_params": {"max_tokens": 2, "top_k": 8, "return_sampling_mask": False}}
    code, answer, _ = post(url, body)
    assert code == 200 and answer["choices"][0]["sampling_mask"] is None, answer
    body["sampling_params"] |= {"top_k": -1, "return_sampling_mask": True}
    code, refused, _ = post(url, body)
    assert code == 400 and refused["error"]["param"] == "sampling_params.top_k", refused


def test_token_route_streams_deltas_ending_with_the_whole_answer(api_server, ids):
    body = {
        "token_ids": list(ids),
        "return_token_ids": True,
        "sampling_params": {"max_tokens": 5, "top_k": 10, "seed": 4, "logprobs": 0, "ignore_eos": True, "n": 2},
        "stream_options": {"include_usage": True},
    }
    code, whole, _ = post(f"{api_server.url}/inference/v1/generate", body)
    code, text, _ = post(f"{api_server.url}/inference/v1/generate", body | {"stream": True})
    events = sse_events(text)
    assert events[0]["prompt_token_ids"] == list(ids) and events[-1]["usage"]["completion_tokens"] == 10
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert sum((c["token_ids"] for c in chunks), []) == whole["choices"][index]["token_ids"]
        assert sum((c["sampling_mask"] for c in chunks), []) == whole["choices"][index]["sampling_mask"]
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["weight_versions"]


def test_trl_token_route_payload_with_output_kind(api_server, ids):
    """TRL's _generate_from_features sends vLLM's output_kind 2 (FINAL_ONLY) and a request_id."""
    body = {
        "request_id": "trl-abc",
        "model": "generate",
        "token_ids": list(ids),
        "features": None,
        "sampling_params": {
            "n": 1,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "max_tokens": 4,
            "logprobs": 0,
            "output_kind": 2,
        },
    }
    code, answer, _ = post(f"{api_server.url}/inference/v1/generate", body)
    assert code == 200 and answer["request_id"] == "trl-abc", answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in answer["choices"][0]["token_ids"]]


# -- fields: neutral values only, unknown fields as upstream --


def _base(route: str) -> tuple[str, dict, str]:
    """A valid request of `route` (path, body, where its fields go: "" top level, else a key)."""
    if route in (OPENAI, COMPLETIONS):
        return "/v1/completions", {"prompt": "a", "max_tokens": 1}, ""
    if route == CHAT:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}, ""
    if route in (GENERATE, GENERATE_SAMPLING):
        return (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": 1}},
            "sampling_params" * (route == GENERATE_SAMPLING),
        )
    return (
        "/inference/v1/generate",
        {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1}},
        "sampling_params" * (route == TOKENS_SAMPLING),
    )


NEUTRAL_RULES = [r for r in FIELD_RULES if r.handling == NEUTRAL]
NON_NEUTRAL = {"not": "neutral"}  # no field takes this at its neutral value


def test_every_neutral_only_field_is_refused_at_any_other_value(api_server):
    """Each field the table accepts at neutral values only: 200 at each of them, and a 400 naming
    the field (as the request spells it) and saying why at any other value."""
    problems = []
    for rule in NEUTRAL_RULES:
        path, body, nested = _base(rule.route)
        where = f"{nested}.{rule.name}" if nested else rule.name
        for value in (*rule.neutral, NON_NEUTRAL):
            sent = json.loads(json.dumps(body))
            (sent[nested] if nested else sent)[rule.name] = value
            code, answer, _ = post(api_server.url + path, sent)
            refused = (
                code == 400
                and answer["error"]["param"] == where
                and "is not supported" in answer["error"]["message"]
                and rule.note in answer["error"]["message"]
            )
            if (code != 200) if value is not NON_NEUTRAL else not refused:
                problems.append((rule.route, where, value, code, answer))
    assert not problems, problems[:5]


def test_unknown_fields_follow_each_upstream(api_server):
    code, answer, _ = post(f"{api_server.url}/v1/completions", {"prompt": "a", "max_tokens": 1, "new_field": 1})
    assert code == 200, answer  # vLLM ignores them
    code, answer, _ = post(
        f"{api_server.url}/generate", {"text": "a", "new_field": 1, "sampling_params": {"max_new_tokens": 1}}
    )
    assert code == 200, answer  # SGLang's GenerateReqInput ignores them
    code, answer, _ = post(f"{api_server.url}/generate", {"text": "a", "sampling_params": {"new_field": 1}})
    assert code == 400 and answer["error"]["param"] == "sampling_params.new_field", answer  # SGLang refuses
    code, answer, _ = post(
        f"{api_server.url}/inference/v1/generate",
        {"token_ids": [5], "new": 1, "sampling_params": {"max_tokens": 1, "new": 2}},
    )
    assert code == 200, answer  # vLLM ignores them


# -- the worker routes routers read --


def test_server_and_model_info_name_the_served_model(api_server, direct):
    version = next(iter(direct.get_weight_version().values()))
    for path in ("/get_server_info", "/server_info"):
        status, info = api_server.get(path)
        assert status == 200, info
        assert info["model_path"] == info["served_model_name"] == "generate" and info["dp_size"] == 1
        assert info["context_length"] == 512 and info["weight_version"] == version
        assert "/" not in info["model_path"]  # no server path disclosed
    for path in ("/get_model_info", "/model_info"):
        status, info = api_server.get(path)
        assert status == 200 and info["model_path"] == "generate" and info["is_generation"] is True, info
        assert info["weight_version"] == version and info["model_type"] == "llama"
    status, _ = api_server.get("/version")
    assert status == 404  # smg would take a worker answering /version for vLLM


def test_flush_cache_answers_200_with_nothing_to_flush(api_server):
    for method in ("GET", "POST"):
        request = urllib.request.Request(
            f"{api_server.url}/flush_cache", method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and b"no prefix cache" in response.read()


def _stream_lines(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=120)
    return response


def _events(response) -> list:
    events = []
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
            yield events[-1]


@pytest.mark.parametrize("how", [{"rid": "abort-me"}, {"abort_all": True}])
def test_abort_request_stops_a_streamed_generate(api_server, ids, how):
    body = {"input_ids": list(ids), "rid": "abort-me", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 500 - len(ids), "ignore_eos": True, "top_k": 5}
    response = _stream_lines(f"{api_server.url}/generate", body)
    events = _events(response)
    first = next(events)
    assert first["meta_info"]["finish_reason"] is None
    code, _, _ = post(f"{api_server.url}/abort_request", how)
    assert code == 200
    last = list(events)[-1]
    response.close()
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]["finish_reason"]
    assert 1 <= last["meta_info"]["completion_tokens"] < 500 - len(ids)


def test_abort_request_stops_a_non_streamed_generate_and_a_token_request(api_server, ids):
    answers = {}

    def run(name, path, body):
        answers[name] = post(api_server.url + path, body)

    long = 500 - len(ids)
    threads = [
        threading.Thread(
            target=run,
            args=(
                "sglang",
                "/generate",
                {
                    "input_ids": list(ids),
                    "rid": "ab-1",
                    "sampling_params": {"max_new_tokens": long, "ignore_eos": True},
                },
            ),
        ),
        threading.Thread(
            target=run,
            args=(
                "vllm",
                "/inference/v1/generate",
                {
                    "token_ids": list(ids),
                    "request_id": "ab-2",
                    "sampling_params": {"max_tokens": long, "ignore_eos": True},
                },
            ),
        ),
    ]
    for thread in threads:
        thread.start()
    # Abort until both answered (an abort before a request registers finds nothing and is repeated).
    while any(thread.is_alive() for thread in threads):
        post(f"{api_server.url}/abort_request", {"rid": "ab-1"})
        post(f"{api_server.url}/inference/v1/abort_requests", {"request_ids": ["ab-2"]})
        for thread in threads:
            thread.join(0.05)
    code, output, _ = answers["sglang"]
    assert code == 200 and output["meta_info"]["finish_reason"]["type"] == "abort", output
    code, output, _ = answers["vllm"]
    assert code == 200 and output["choices"][0]["finish_reason"] == "abort", output
    code, refused, _ = post(f"{api_server.url}/inference/v1/abort_requests", {})
    assert code == 400 and refused["error"]["param"] == "request_ids"
