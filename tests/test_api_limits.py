"""What a request may cost the HTTP API before the generate model sees it, without a tritonserver
(served in-process by uvicorn on a free port; the model's address answers nothing): prompt and
message counts and text lengths refused before any tokenizing or template rendering, a request's
own chat template refused unless trusted, tokenizing off the event loop behind a bounded queue, a
client silent mid-body answered 408, a client leaving mid-body logged in one line, no
/openapi.json, and no internal address in any answer.

The tokenizer is the built-in tiny LM's behind a spy that counts encodes and renders, and can hold
an encode until the test lets it go (an event, never a clock)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from testbed.app_thread import app_on_a_thread
from triton_sampling_mask.api.app import create_app
from triton_sampling_mask.api.config import ApiConfig
from triton_sampling_mask.api.service import ApiService
from triton_sampling_mask.api.text import load_tokenizer
from triton_sampling_mask.ops.server_process import free_port

CONTEXT = 512  # the tiny LM's


class SpyTokenizer:
    """The tiny tokenizer, counting `encode` and `apply_chat_template` calls; an encode waits for
    `gate` (when given) before it runs."""

    def __init__(self, gate: threading.Event | None = None):
        self._inner = load_tokenizer("")
        self.encodes = self.renders = 0
        self.gate = gate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, *args, **kwargs):
        self.encodes += 1
        if self.gate is not None:
            assert self.gate.wait(60), "the test never let the encode go"
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self._inner.apply_chat_template(*args, **kwargs)


@contextmanager
def serving(tokenizer=None, **settings):
    """An API on a free port in front of a model address nothing listens on: (base URL, service)."""
    config = ApiConfig(triton_url=f"127.0.0.1:{free_port()}", **settings)
    service = ApiService(config, tokenizer=tokenizer)
    with app_on_a_thread(create_app(config, service)) as url:
        yield url, service


def call(url: str, body: dict | None = None, timeout_s: float = 30):
    """(status, JSON body) of a POST (GET without `body`)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def raw_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/completions", {"prompt": ["a"] * 5000}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 200}, "n"),
        ("/generate", {"text": ["a"] * 5000}, "text"),
        ("/generate", {"text": "a", "sampling_params": {"n": 300}}, "sampling_params.n"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 200}, {"n": 200}]}, "sampling_params.n"),
    ],
)
def test_too_many_sequences_are_refused_before_any_prompt_is_tokenized(route, body, field):
    spy = SpyTokenizer()
    with serving(spy) as (url, _):
        status, answer = call(url + route, body)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert "--max-choices" in answer["error"]["message"]
    assert spy.encodes == 0


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/completions", {"prompt": "tell me more " * 20000}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "tell me more " * 20000]}, "prompt"),
        ("/generate", {"text": "tell me more " * 20000}, "text"),
    ],
)
def test_a_text_longer_than_the_context_can_hold_is_refused_untokenized(route, body, field):
    spy = SpyTokenizer()
    with serving(spy) as (url, service):
        status, answer = call(url + route, body)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert f"context of {CONTEXT} tokens" in answer["error"]["message"]
    assert spy.encodes == 0
    # the bound is what the context holds at the vocabulary's longest token (with its margin)
    longest = max(len(token) for token in spy.get_vocab())
    assert 240_000 > service.bounds.max_prompt_chars >= CONTEXT * longest


def test_a_prompt_is_refused_as_soon_as_its_tokens_pass_the_context():
    spy = SpyTokenizer()
    long_enough = "word " * 2000  # within the character bound, past the context in tokens
    with serving(spy) as (url, service):
        assert len(long_enough) <= service.bounds.max_prompt_chars
        status, answer = call(url + "/v1/completions", {"prompt": [long_enough] * 5})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert spy.encodes == 1  # the other four were never tokenized


def test_more_messages_than_the_context_holds_are_refused_unrendered():
    spy = SpyTokenizer()
    messages = [{"role": "user", "content": "hi"}] * (CONTEXT + 1)
    with serving(spy) as (url, _):
        status, answer = call(url + "/v1/chat/completions", {"messages": messages})
        assert status == 400 and answer["error"]["param"] == "messages", answer
        status, answer = call(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10**6}]})
        assert status == 400 and answer["error"]["param"] == "messages", answer
    assert spy.renders == 0 and spy.encodes == 0


LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_requests_own_chat_template_is_refused_unless_trusted():
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}}
    spy = SpyTokenizer()
    with serving(spy) as (url, _):
        status, answer = call(url + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == "chat_template_kwargs.chat_template", answer
    assert "--trust-request-chat-template" in answer["error"]["message"]
    assert spy.renders == 0
    trusted = {**body, "chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}!"}}
    with serving(SpyTokenizer(), trust_request_chat_template=True) as (url, service):
        status, answer = call(url + "/v1/chat/completions", trusted)
        assert status == 503, answer  # rendered, then sent to the model, which cannot be reached
        assert service.tokenizer.renders == 1


def test_tokenizing_runs_off_the_event_loop():
    gate = threading.Event()
    spy = SpyTokenizer(gate)
    with serving(spy) as (url, _):
        held = threading.Thread(target=call, args=(url + "/v1/completions", {"prompt": "hello"}), daemon=True)
        held.start()
        try:
            deadline = time.monotonic() + 30
            while spy.encodes == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert spy.encodes == 1
            status, answer = call(url + "/v1/models", timeout_s=10)  # answered while the encode is held
            assert status == 200 and not gate.is_set()
        finally:
            gate.set()
            held.join(30)


def _held_requests(url: str, count: int, prompt: str = "hello") -> list[threading.Thread]:
    threads = [
        threading.Thread(target=call, args=(url + "/v1/completions", {"prompt": prompt}), daemon=True)
        for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads


def _wait_pending(pool, count: int) -> None:
    deadline = time.monotonic() + 30
    while pool.pending < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.pending == count


def test_a_burst_of_small_requests_waits_for_the_preparing_threads():
    """A trainer's burst (64 requests on one preparing thread) waits: what is bounded is bytes."""
    gate = threading.Event()
    with serving(SpyTokenizer(gate), tokenizer_threads=1) as (url, service):
        waiting = _held_requests(url, 64)
        try:
            _wait_pending(service.preparation, 64)
        finally:
            gate.set()
            for thread in waiting:
                thread.join(30)


def test_requests_past_the_preparing_queue_are_refused_with_503():
    """Past the bytes waiting (a body alone always taken) or the request count: 503, overloaded."""
    gate = threading.Event()
    with serving(SpyTokenizer(gate), tokenizer_threads=1) as (url, service):
        pool = service.preparation
        pool.capacity_bytes = 2000
        waiting = _held_requests(url, 1, "x" * 1500)
        try:
            _wait_pending(pool, 1)
            status, answer = call(url + "/v1/completions", {"prompt": "y" * 600}, timeout_s=10)
            assert status == 503 and answer["error"]["code"] == "overloaded", answer
            waiting += _held_requests(url, 1, "z" * 100)  # fits beside it
            _wait_pending(pool, 2)
            pool.capacity = 2
            status, answer = call(url + "/v1/completions", {"prompt": "w"}, timeout_s=10)
            assert status == 503 and answer["error"]["code"] == "overloaded", answer
        finally:
            gate.set()
            for thread in waiting:
                thread.join(30)


def test_a_client_silent_mid_body_is_answered_408_and_closed():
    with serving(client_timeout_s=0.5) as (url, _):
        with raw_socket(url) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":')
            answer = b""
            while chunk := sock.recv(4096):  # until the API closes the connection
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"sent nothing for 0.5 s" in answer


def test_a_client_leaving_mid_body_is_logged_in_one_line_without_a_traceback(caplog):
    caplog.set_level(logging.INFO)
    with serving() as (url, _):
        with raw_socket(url) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":')
        deadline = time.monotonic() + 30
        while "left before sending its whole body" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    mine = [r for r in caplog.records if "left before sending its whole body" in r.getMessage()]
    assert len(mine) == 1 and "\n" not in mine[0].getMessage(), caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_no_openapi_schema_is_served():
    with serving() as (url, _):
        status, answer = call(url + "/openapi.json")
    assert status == 404 and answer["error"]["code"] == "not_found"


def test_answers_name_no_internal_address():
    with serving() as (url, service):
        port = service.config.triton_url.rsplit(":", 1)[1]
        answers = [
            call(url + "/v1/completions", {"prompt": "hello", "max_tokens": 2}),
            call(url + "/generate", {"text": "hello"}),
            call(url + "/get_weight_version"),
        ]
    for status, answer in answers:
        message = json.dumps(answer)
        assert status == 503, answer
        assert "127.0.0.1" not in message and port not in message, answer
