"""What the HTTP API tests compare against: the generate model called directly through
GenerateClient with the same token ids, parameters and seed, and the checkpoint's tokenizer
loaded on its own from the package data."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
from transformers import AutoTokenizer

from triton_sampling_mask.client import GenerateClient, GenerateResult
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.generation.lm import DEFAULT_TOKENIZER

RULES = dict(temperature=0.8, top_k=12, top_p=0.95, min_p=0.01)


def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER), local_files_only=True)


def reference(
    client: GenerateClient, prompt_ids, seed: int, max_tokens: int, ignore_eos: bool = True, **rules
) -> GenerateResult:
    """The generate model's own answer for one prompt, masks included."""
    params = SamplingParams(**(rules or RULES), seed=seed, return_sampling_mask=True)
    return client.generate([list(prompt_ids)], params, max_new_tokens=max_tokens, ignore_eos=ignore_eos)[0]


def masks(result: GenerateResult) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(result.sampling_mask, result.sampling_mask_len)]


def mask_logprobs(result: GenerateResult) -> list[np.ndarray]:
    return [row[:n] for row, n in zip(result.sampling_mask_logprobs, result.sampling_mask_len)]


def assert_same_as_reference(
    ids, mask_lists, support_logprobs, sampling_logprobs, token_logprobs, ref: GenerateResult, exact: bool = True
) -> None:
    """Ids and masks bit-equal, log-probs equal (JSON carries each float32 exactly). With `exact`
    False the log-probs may differ by float32 rounding: a sequence generated in a batch of several
    gets its logits from the LM's batched forward pass, which rounds differently from a lone one."""
    assert ids == ref.output_ids.tolist()
    assert mask_lists == masks(ref)

    def same(got, want) -> None:
        if exact:
            np.testing.assert_array_equal(np.float32(got), want)
        else:
            np.testing.assert_allclose(np.float32(got), want, rtol=0, atol=1e-4)

    for got, want in zip(support_logprobs, mask_logprobs(ref), strict=True):
        same(got, want)
    same(sampling_logprobs, ref.sampling_logprobs)
    if token_logprobs is not None:
        same(token_logprobs, ref.output_logprobs)


def decode_compact(field: dict) -> dict[str, np.ndarray]:
    """A compact mask object's base64 arrays."""
    kinds = {"ids": "<i4", "counts": "<i4", "logprobs": "<f4", "sampling_logprobs": "<f4"}
    return {name: np.frombuffer(base64.b64decode(field[name]), kind) for name, kind in kinds.items()}


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict | str, object]:
    """(status, JSON body or raw text, headers (case-insensitive)) of a POST; `body` is sent as is when bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text, status, reply_headers = response.read().decode(), response.status, response.headers
    except urllib.error.HTTPError as error:
        text, status, reply_headers = error.read().decode(), error.code, error.headers
    try:
        return status, json.loads(text), reply_headers
    except ValueError:
        return status, text, reply_headers


def sse_events(text: str) -> list:
    """The JSON events of an SSE body, checking it ends with `data: [DONE]`."""
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(line) for line in lines[:-1]]
