"""The HTTP API's hostile round (`make hostile`, client_tests/test_front_door.py): what one client
can still do to the API through the front door (`make serve`'s :9000 route): prompt lists and
texts that cost the API seconds of tokenizing and hundreds of MB before their 400, chats of
hundreds of thousands of messages, a request's own chat template, one request's `n` x tokens
holding back another client's chat, streams and requests whose clients leave, a client silent or
gone mid-body. Each takes a running `stack.Stack` and returns a `hostile.Outcome`
(docs/operations.md, "Threat model"); a well-behaved API client (ApiProber) runs beside the
attacks that could stall the API.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import threading
import time
from collections import Counter

from triton_sampling_mask.ops.settings import PROXY_CLIENT_TIMEOUT_S, PROXY_REQUEST_TIMEOUT_S

from .hostile import Outcome
from .metrics import counter
from .process_memory import process_tree_rss
from .stack import Stack, request

CANCELLED, TOKENS = "generate_cancelled_total", "generate_tokens_total"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0.0}


def api_call(stack: Stack, path: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int | None, dict]:
    """(status, JSON answer) of one call to the API's public port."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    status, text = request(stack.ports["api"], "POST" if data is not None else "GET", path, data, headers, timeout_s)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"text": text[:200]}


def _param(answer: dict) -> str | None:
    return (answer.get("error") or {}).get("param")


class ApiProber:
    """A well-behaved API client while an attack runs: `/v1/models` and a two-token completion in
    turn, each given `timeout_s`, counted by outcome."""

    def __init__(self, stack: Stack, timeout_s: float = 30.0, pause_s: float = 0.2):
        self.stack, self.timeout_s, self.pause_s = stack, timeout_s, pause_s
        self.outcomes: Counter = Counter()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        calls = [("/v1/models", None), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})]
        while not self.stopping.is_set():
            for path, body in calls:
                status, _ = api_call(self.stack, path, body, self.timeout_s)
                self.outcomes["ok" if status == 200 else str(status)] += 1
            self.stopping.wait(self.pause_s)

    def __enter__(self) -> ApiProber:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(2 * self.timeout_s + 10)

    @property
    def failed(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k != "ok")

    def summary(self) -> str:
        return f"API client meanwhile {dict(self.outcomes)}"


class ApiMemory:
    """The API process's RSS before a call and at its peak during it (sampled every 50 ms), in MB."""

    def __init__(self, stack: Stack):
        self.pid = stack.api_pid()
        self.before = self.peak = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _rss_mb(self) -> float:
        return process_tree_rss(self.pid) / 2**20 if self.pid else 0.0

    def _sample(self) -> None:
        while not self.stopping.wait(0.05):
            self.peak = max(self.peak, self._rss_mb())

    def __enter__(self) -> ApiMemory:
        self.before = self.peak = self._rss_mb()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.peak = max(self.peak, self._rss_mb())

    @property
    def growth_mb(self) -> float:
        return self.peak - self.before


def _refused_cheaply(
    stack: Stack, name: str, path: str, body: dict, field: str, growth_limit_mb: float, what: str
) -> Outcome:
    """One oversized request: held when it is refused (400 naming `field`) within the API memory
    bound, a well-behaved client answered meanwhile."""
    with ApiProber(stack) as prober, ApiMemory(stack) as memory:
        started = time.monotonic()
        status, answer = api_call(stack, path, body, timeout_s=120)
        took = time.monotonic() - started
    held = status == 400 and _param(answer) == field and memory.growth_mb <= growth_limit_mb and not prober.failed
    return Outcome(
        name,
        held,
        f"{what}: {status} naming {_param(answer)!r} after {took:.1f} s; API RSS +{memory.growth_mb:.0f} MB at the "
        f"peak (bound {growth_limit_mb:g} MB); {prober.summary()}",
        numbers={"status": status, "seconds": took, "api_growth_mb": memory.growth_mb, "others_failed": prober.failed},
    )


def prompt_list(stack: Stack) -> Outcome:
    """800,000 one-character prompts (4 MB): refused before any is tokenized."""
    return _refused_cheaply(
        stack, "api-prompt-list", "/v1/completions", {"prompt": ["a"] * 800_000}, "prompt", 100, "800,000 prompts"
    )


def long_prompt(stack: Stack) -> Outcome:
    """A 4.2 MB text prompt: refused untokenized (it cannot fit the context)."""
    body = {"prompt": "hello world " * 350_000}
    return _refused_cheaply(stack, "api-long-prompt", "/v1/completions", body, "prompt", 100, "a 4.2 MB prompt")


def many_messages(stack: Stack) -> Outcome:
    """A chat of 200,000 messages: refused before each message is validated or rendered."""
    body = {"messages": [{"role": "user", "content": "hi"}] * 200_000}
    return _refused_cheaply(
        stack, "api-many-messages", "/v1/chat/completions", body, "messages", 150, "200,000 chat messages"
    )


def many_texts(stack: Stack) -> Outcome:
    """SGLang's /generate with 600,000 texts: refused before any is tokenized."""
    return _refused_cheaply(
        stack, "api-many-texts", "/generate", {"text": ["a"] * 600_000}, "text", 100, "/generate with 600,000 texts"
    )


def request_template(stack: Stack) -> Outcome:
    """A chat bringing its own template (a loop, a 200 MB string): refused, never rendered."""
    templates = {
        "loop": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "200 MB string": "{{ 'a' * 200000000 }}",
    }
    answers = {}
    with ApiProber(stack) as prober, ApiMemory(stack) as memory:
        for name, template in templates.items():
            body = {**CHAT, "chat_template_kwargs": {"chat_template": template}}
            answers[name] = api_call(stack, "/v1/chat/completions", body, timeout_s=120)
    field = "chat_template_kwargs.chat_template"
    held = all(s == 400 and _param(a) == field for s, a in answers.values()) and not prober.failed
    held = held and memory.growth_mb <= 100
    return Outcome(
        "api-request-template",
        held,
        "; ".join(f"{name}: {s} naming {_param(a)!r}" for name, (s, a) in answers.items())
        + f"; API RSS +{memory.growth_mb:.0f} MB at the peak; {prober.summary()}",
    )


def _open_stream(stack: Stack, path: str, body: dict) -> tuple[socket.socket, http.client.HTTPResponse]:
    sock = socket.create_connection(("127.0.0.1", stack.ports["api"]), timeout=300)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    response = http.client.HTTPResponse(sock)
    response.begin()
    return sock, response


def _events(response: http.client.HTTPResponse):
    """The JSON payloads of an SSE answer, to `[DONE]`."""
    while line := response.readline():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            yield json.loads(line[6:])


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed client leaves."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def engine_rows(stack: Stack) -> int:
    """The generate engine's rows (max_active_sequences), from its config through the proxy."""
    status, text = request(stack.ports["http"], "GET", "/v2/models/generate/config")
    parameters = json.loads(text).get("parameters", {}) if status == 200 else {}
    return int(parameters.get("max_active_sequences", {}).get("string_value", 32))


def big_request(stack: Stack, n: int = 256, max_tokens: int = 500) -> Outcome:
    """One streamed request for `n` sequences of `max_tokens` (ignore_eos), then another client's
    8-token chat: it must be answered once a row frees, while the big request is still in its
    first rows' turn (at most `rows` of its sequences finished), not after all of them. The big
    request's client then leaves (and its sequences are cancelled)."""
    rows = engine_rows(stack)
    metrics = f"http://127.0.0.1:{stack.ports['metrics']}/metrics"
    body = {"prompt": "hello", "n": n, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    finished, chat = set(), {}
    sock, response = _open_stream(stack, "/v1/completions", body)
    first, leave = threading.Event(), threading.Event()

    def read_big() -> None:
        try:
            for event in _events(response):
                first.set()
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        finished.add(choice["index"])
                if leave.is_set():
                    break
        except (OSError, ValueError, http.client.HTTPException):
            pass
        finally:
            first.set()
            response.close()  # the socket's file: only then does closing the socket reset it
            _reset(sock)

    reader = threading.Thread(target=read_big, daemon=True)
    reader.start()
    try:
        first.wait(300)
        cancelled_before = counter(metrics, CANCELLED)
        started = time.monotonic()
        chat["status"], chat["answer"] = api_call(stack, "/v1/chat/completions", CHAT, timeout_s=600)
        chat["seconds"] = time.monotonic() - started
        finished_then = len(finished)
    finally:
        leave.set()
    reader.join(60)
    deadline = time.monotonic() + 60
    while counter(metrics, CANCELLED) == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.5)
    cancelled = counter(metrics, CANCELLED) - cancelled_before
    held = chat["status"] == 200 and finished_then <= rows and finished_then < n and cancelled > 0
    return Outcome(
        "api-big-request",
        held,
        f"n {n} x {max_tokens} tokens (ignore_eos) streamed, then another client's 8-token chat: {chat['status']} "
        f"after {chat['seconds']:.1f} s, when {finished_then} of the {n} had finished (engine rows {rows}); the big "
        f"request's client then left: {cancelled:.0f} sequences cancelled in the engine",
        numbers={"chat_seconds": chat["seconds"], "finished_before_chat": finished_then, "cancelled": cancelled},
    )


def _abandoned(stack: Stack, name: str, stream: bool, clients: int, max_tokens: int) -> Outcome:
    """`clients` long generations (the three text routes in turn), their sockets reset about a
    second in: held when the engine cancels them and, once they are gone, generates a small share
    of their budgets (what it generated while the clients were there is not the attack's)."""
    metrics = f"http://127.0.0.1:{stack.ports['metrics']}/metrics"
    routes = [
        ("/v1/completions", {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": max_tokens, "ignore_eos": True}),
        ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}),
    ]
    cancelled_before, tokens_before = counter(metrics, CANCELLED), counter(metrics, TOKENS)
    sockets = []
    for i in range(clients):
        path, body = routes[i % len(routes)]
        sock = socket.create_connection(("127.0.0.1", stack.ports["api"]), timeout=60)
        data = json.dumps({**body, "stream": stream}).encode()
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        sockets.append(sock)
    time.sleep(1.0)
    tokens_at_reset = counter(metrics, TOKENS)
    for sock in sockets:
        _reset(sock)
    # Wait for the engine to hold no request (each was cancelled, or ran to its end).
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and any(
        counter(metrics, gauge) > 0 for gauge in ("generate_num_requests_running", "generate_num_requests_waiting")
    ):
        time.sleep(0.5)
    cancelled = counter(metrics, CANCELLED) - cancelled_before
    tokens_after = counter(metrics, TOKENS)
    generated, after_reset = tokens_after - tokens_before, tokens_after - tokens_at_reset
    budget = clients * max_tokens
    status, _ = api_call(stack, "/v1/chat/completions", CHAT, timeout_s=60)
    held = cancelled > 0 and after_reset <= budget / 10 and status == 200
    return Outcome(
        name,
        held,
        f"{clients} {'streams' if stream else 'non-streamed requests'} of {max_tokens} tokens reset about 1 s in: "
        f"{cancelled:.0f} cancelled in the engine, {generated:.0f} tokens generated of their {budget}, "
        f"{after_reset:.0f} of them after the resets (bound {budget // 10}); a chat after them: {status}",
        numbers={"cancelled": cancelled, "generated": generated, "after_reset": after_reset},
    )


def abandoned_streams(stack: Stack, clients: int = 100, max_tokens: int = 400) -> Outcome:
    """Streams on every text route whose clients reset their sockets."""
    return _abandoned(stack, "api-abandoned-streams", True, clients, max_tokens)


def abandoned_requests(stack: Stack, clients: int = 30, max_tokens: int = 400) -> Outcome:
    """Non-streamed requests whose clients reset their sockets while waiting: the proxy must pass
    the departure on (HAProxy's `option abortonclose`)."""
    return _abandoned(stack, "api-abandoned-requests", False, clients, max_tokens)


def _head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()


def silent_body(stack: Stack) -> Outcome:
    """A body larger than the proxy's buffer that stops half-way (the proxy passes a body on once
    its buffer is full, and times out a smaller one itself): the API answers 408 after
    PROXY_CLIENT_TIMEOUT_S of silence and closes its connection, where it used to wait for the
    API route's ten-minute stream timeout, and the proxy closes the client's connection after
    passing the 408 on (it kept it for the API route's client timeout)."""
    limit = PROXY_REQUEST_TIMEOUT_S.value() + PROXY_CLIENT_TIMEOUT_S.value() + 20
    started = time.monotonic()
    answer, answered_s, closed = b"", None, False
    with socket.create_connection(("127.0.0.1", stack.ports["api"]), timeout=limit) as sock:
        sock.sendall(_head("/v1/completions", 2 * 2**20) + b'{"prompt": "' + b"a" * 2**19)
        try:
            while chunk := sock.recv(4096):
                if answered_s is None:
                    answered_s = time.monotonic() - started
                    sock.settimeout(5.0)  # the proxy's own close, if it comes soon
                answer += chunk
            closed = True
        except OSError:
            pass
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "no answer"
    when = "never" if answered_s is None else f"after {answered_s:.0f} s"
    try:  # the API's own answer, whoever sends it
        message = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return Outcome(
        "api-silent-body",
        status == "408" and answered_s is not None and answered_s < limit and closed and bool(message),
        f"half a 2 MiB body, then silence: {status} {when} (bound {limit:g} s), {message!r}; the proxy "
        f"{'closed' if closed else 'kept'} the client's connection {'' if closed else 'open '}after it",
        numbers={"seconds": answered_s, "door_closed": closed},
    )


def gone_mid_body(stack: Stack, clients: int = 20) -> Outcome:
    """Clients that leave half-way through their bodies: no traceback in the API's log."""
    before = stack.log_tail(200_000).count("Traceback")
    for _ in range(clients):
        with socket.create_connection(("127.0.0.1", stack.ports["api"]), timeout=10) as sock:
            sock.sendall(_head("/v1/completions", 600_000) + b'{"prompt": "' + b"a" * 300_000)
    time.sleep(2.0)
    tracebacks = stack.log_tail(200_000).count("Traceback") - before
    status, _ = api_call(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    return Outcome(
        "api-gone-mid-body",
        tracebacks == 0 and status == 200,
        f"{clients} clients gone mid-body: {tracebacks} tracebacks logged; a completion after them: {status}",
    )


def schema_surface(stack: Stack) -> Outcome:
    """The API's generated schema is not served (it listed every route, the weight routes too)."""
    status, _ = api_call(stack, "/openapi.json")
    return Outcome("api-schema", status == 404, f"/openapi.json: {status}")


ATTACKS = {
    "api-prompt-list": prompt_list,
    "api-long-prompt": long_prompt,
    "api-many-messages": many_messages,
    "api-many-texts": many_texts,
    "api-request-template": request_template,
    "api-big-request": big_request,
    "api-abandoned-streams": abandoned_streams,
    "api-abandoned-requests": abandoned_requests,
    "api-gone-mid-body": gone_mid_body,
    "api-schema": schema_surface,
    "api-silent-body": silent_body,
}
