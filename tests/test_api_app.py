"""The HTTP API application without a tritonserver, served in-process by uvicorn on a free port:
the API key (vLLM's Bearer scheme, /health left open), the body limit, /v1/models, /health saying
503 with Retry-After while the model cannot be reached, and a bad command line exiting non-zero."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from testbed.app_thread import app_on_a_thread
from triton_sampling_mask.api.app import create_app, main
from triton_sampling_mask.api.config import ApiConfig
from triton_sampling_mask.api.schemas import CompletionRequest, GenerateRequest, SGLangSamplingParams
from triton_sampling_mask.api.service import sampling_knobs
from triton_sampling_mask.api.sglang_routes import SGLANG_NAMES, SGLANG_RENAMES
from triton_sampling_mask.ops.server_process import free_port

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def api():
    unreachable = f"127.0.0.1:{free_port()}"  # nothing listens: the routes below never need the model
    with app_on_a_thread(create_app(ApiConfig(triton_url=unreachable, api_key=KEY, max_body_bytes=1000))) as url:
        yield url


def call(url: str, data: bytes | None = None, key: str | None = None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def test_the_api_key_is_required_except_for_health(api):
    status, body, _ = call(f"{api}/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(f"{api}/v1/models", key="wrong")[0] == 401
    assert call(f"{api}/generate", b"{}", key="wrong")[0] == 401
    status, body, _ = call(f"{api}/v1/models", key=KEY)
    assert status == 200 and body["data"][0]["id"] == "generate" and body["data"][0]["max_model_len"] == 512
    status, body, headers = call(f"{api}/health")  # open, and honest: the model cannot be reached
    assert status == 503 and headers["Retry-After"] == "1"


def test_a_body_past_the_limit_is_refused_before_it_is_read(api):
    status, body, _ = call(f"{api}/v1/completions", b'{"prompt": "' + b"a" * 2000 + b'"}', key=KEY)
    assert status == 413 and "1000" in body["error"]["message"]


def test_an_unreachable_model_is_a_503_with_retry_after(api):
    status, body, headers = call(f"{api}/v1/completions", b'{"prompt": "hello", "max_tokens": 2}', key=KEY)
    assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "overloaded"


@pytest.mark.parametrize("argv", [["--model-path", "/nonexistent-checkpoint"], ["--port", "http"], []])
def test_a_bad_command_line_exits_non_zero(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--triton-url", "127.0.0.1:1", *argv] if argv != [] else ["--port", "1"])
    assert exited.value.code == 2


SENT = dict(temperature=0.5, top_k=7, top_p=0.9, min_p=0.125, return_sampling_mask=True)


def test_every_sampling_parameter_is_read_from_the_openai_fields():
    request = CompletionRequest(prompt="x", seed=3, **SENT)
    assert sampling_knobs(request) == dict(SENT, seed=3)
    assert sampling_knobs(CompletionRequest(prompt="x")) == dict.fromkeys(SENT, None) | {
        "seed": None,
        "return_sampling_mask": False,
    }


def test_every_sampling_parameter_is_read_from_sglangs_fields_and_the_request():
    knobs = {k: v for k, v in SENT.items() if k != "return_sampling_mask"}
    request = GenerateRequest(text="x", sampling_params={**knobs, "sampling_seed": 9}, return_sampling_mask=True)
    fields = SGLangSamplingParams(**request.sampling_params)
    read = sampling_knobs(fields, SGLANG_RENAMES, return_sampling_mask=request.return_sampling_mask)
    assert read == dict(SENT, seed=9)


def test_sglang_messages_name_each_sampling_parameter_where_sglang_carries_it():
    assert SGLANG_NAMES == {
        "temperature": "sampling_params.temperature",
        "top_k": "sampling_params.top_k",
        "top_p": "sampling_params.top_p",
        "min_p": "sampling_params.min_p",
        "seed": "sampling_params.sampling_seed",
        "max_new_tokens": "sampling_params.max_new_tokens",
    }
