"""slime's and Miles's exact /generate payloads (neither is on PyPI: fixtures/ name the upstream file,
lines and commit of each payload and of the reads that parse the answer), replayed through the front
door; the reads must succeed and give the reference's tokens and log-probs, the answer must carry
`meta_info.weight_version` (both read it when present), and masks come back when asked."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from .reference import assert_same_tokens, generate
from .wire import int32_array, post, read

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = [17, 301, 42, 9, 555]
SEED = 1234
PAYLOADS = ["slime_generate.json", "miles_generate_hub.json", "miles_generate_legacy.json"]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def payload(spec: dict) -> dict:
    body = copy.deepcopy(spec["payload"])
    body["input_ids"] = list(PROMPT)
    # seeded so the reference can replay it (slime's --sglang-enable-deterministic-inference sends it, :320-322)
    body["sampling_params"]["sampling_seed"] = SEED
    return body


@pytest.mark.parametrize("name", PAYLOADS)
def test_exact_payload_is_answered_with_what_the_framework_reads(api_url, name):
    spec = fixture(name)
    status, answer = post(api_url + spec["route"], payload(spec))
    assert status == 200, f"{spec['source']['payload']}: {answer}"
    tokens = read(answer, spec["reads"]["tokens"])
    logprobs = read(answer, spec["reads"]["logprobs"])
    assert isinstance(read(answer, spec["reads"]["text"]), str)
    assert read(answer, spec["reads"]["finish_reason"]) in spec["finish_reasons"]
    assert len(tokens) == len(logprobs)
    sampling = spec["payload"]["sampling_params"]
    expected = generate(api_url, PROMPT, sampling["max_new_tokens"], SEED, temperature=sampling["temperature"])
    assert_same_tokens(tokens, logprobs, expected)
    version = read(answer, spec["optional_reads"]["weight_version"])
    assert isinstance(version, str) and version, answer["meta_info"]


@pytest.mark.parametrize("name", PAYLOADS)
def test_exact_payload_with_a_mask_request_gets_one_mask_per_token(api_url, name):
    """The same payload run with a finite --rollout-top-k and SGLang's return_sampling_mask."""
    spec = fixture(name)
    body = payload(spec)
    body["sampling_params"]["top_k"] = 8
    body["return_sampling_mask"] = True
    status, answer = post(api_url + spec["route"], body)
    assert status == 200, answer
    tokens = read(answer, spec["reads"]["tokens"])
    masks = answer["meta_info"]["output_token_sampling_mask"]
    assert len(masks) == len(tokens)
    assert all(token in mask and len(mask) <= 8 for token, mask in zip(tokens, masks))
    expected = generate(api_url, PROMPT, len(tokens), SEED, temperature=1.0, top_k=8)
    assert [sorted(m) for m in masks] == [sorted(m) for m in expected["masks"][: len(tokens)]]


def test_slime_top_p_replay_without_a_finite_top_k_is_refused_by_the_contract(api_url):
    """slime's top-p replay asks for every token's kept set (custom_params.return_top_p_token_ids):
    a mask. With slime's default --rollout-top-k -1 its width is unbounded, so it is refused as every
    unbounded mask request is (SGLang PR #35205's message), naming the field to set."""
    spec = fixture("slime_generate_top_p.json")
    status, answer = post(api_url + spec["route"], payload(spec))
    assert status == 400, answer
    assert answer["error"]["param"] == "sampling_params.top_k"
    assert "requires finite top_k" in answer["error"]["message"]


def test_slime_top_p_replay_with_a_finite_top_k_gets_its_kept_sets(api_url):
    """The same payload with --rollout-top-k 8: slime's reads find the kept sets as flat int32 ids
    plus offsets, and each set is the token's sampling mask (the reference's, seeded)."""
    spec = fixture("slime_generate_top_p.json")
    body = payload(spec)
    body["sampling_params"]["top_k"] = 8
    status, answer = post(api_url + spec["route"], body)
    assert status == 200, answer
    meta = answer["meta_info"]
    tokens = read(answer, spec["reads"]["tokens"])
    replay = spec["top_p_replay"]
    ids_key = next((k for k in replay["ids"] if k.split(".")[-1] in meta), None)
    offsets_key = next((k for k in replay["offsets"] if k.split(".")[-1] in meta), None)
    assert ids_key and offsets_key, f"no top-p kept sets in meta_info: {sorted(meta)}"
    ids = int32_array(read(answer, ids_key))
    offsets = int32_array(read(answer, offsets_key))
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == len(tokens) + 1
    sampling = spec["payload"]["sampling_params"]
    expected = generate(
        api_url, PROMPT, len(tokens), SEED, temperature=sampling["temperature"], top_k=8, top_p=sampling["top_p"]
    )
    for position, token in enumerate(tokens):
        kept = list(ids[offsets[position] : offsets[position + 1]])
        assert token in kept, (position, token, kept)
        assert sorted(kept) == sorted(expected["masks"][position]), position
