"""A client that leaves the HTTP API stops its generation: streamed or not, on every text route,
its requests are cancelled on the server (the generate model counts them in
`generate_cancelled_total`) and generate a small share of their budgets. Against the API process
in front of the session's server, clients resetting their sockets as a killed process does
(through the front door: client_tests/test_front_door.py, testbed/api_attacks.py)."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from testbed.metrics import counter, wait_for_counter

CLIENTS = 3
BUDGET = 400
ROUTES = {
    "completions": ("/v1/completions", {"prompt": "hello", "max_tokens": BUDGET, "ignore_eos": True}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": BUDGET, "ignore_eos": True},
    ),
    "generate": ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True}}),
    "tokens": (
        "/inference/v1/generate",
        {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": BUDGET, "ignore_eos": True}},
    ),
}


def _send(port: int, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_leaves_cancels_its_generation(api_server, triton_server, route, stream):
    metrics = triton_server.metrics_url
    path, body = ROUTES[route]
    port = int(api_server.url.rsplit(":", 1)[1])
    cancelled = counter(metrics, "generate_cancelled_total")
    tokens = counter(metrics, "generate_tokens_total")
    sockets = [_send(port, path, {**body, "stream": stream}) for _ in range(CLIENTS)]
    try:
        if stream:  # each has its first event
            for sock in sockets:
                assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "no stream opened"
        else:  # each is generating
            wait_for_counter(metrics, "generate_num_requests_running", lambda n: n >= CLIENTS, "not generating")
    finally:
        for sock in sockets:
            _reset(sock)
    wait_for_counter(
        metrics,
        "generate_cancelled_total",
        lambda n: n >= cancelled + CLIENTS,
        f"the server never cancelled the generations of {CLIENTS} clients that left",
    )
    deadline = time.monotonic() + 30
    while counter(metrics, "generate_num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    generated = counter(metrics, "generate_tokens_total") - tokens
    assert generated < CLIENTS * BUDGET / 2, f"{generated} tokens generated for clients that had left"
