"""The supervisor's probe port under clients that drop their connections: it keeps answering and
logs no traceback per connection (a reset is no news; any other failure is one line)."""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from triton_sampling_mask.ops.server_process import free_port
from triton_sampling_mask.ops.supervisor import Supervisor, SupervisorConfig

DROPPED = 300


@pytest.fixture
def probe_port():
    """A supervisor's probe endpoint alone (no tritonserver: /ready answers 503)."""
    config = SupervisorConfig(model_repository=Path("model_repository"), ports={}, probe_port=free_port())
    supervisor = Supervisor(config)
    supervisor._start_probe_server()
    yield config.probe_port, supervisor._probe_server
    supervisor._probe_server.shutdown()
    supervisor._probe_server.server_close()


def handlers_running() -> int:
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def reset(port: int, sent: bytes) -> None:
    """Connect, send `sent`, then close with a TCP reset (SO_LINGER 0) instead of a FIN."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if sent:
            sock.sendall(sent)


def test_dropped_connections_log_nothing_and_the_port_keeps_answering(probe_port, capfd):
    port, _ = probe_port
    capfd.readouterr()
    for index in range(DROPPED):
        reset(port, [b"", b"GET /ready HTTP/1.1\r\n", b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n"][index % 3])
    # Accepted after every dropped one (the accept queue is first in, first out), and answered.
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=30)
    assert answer.value.code == 503  # no tritonserver here
    deadline = time.monotonic() + 30  # a wait for the handlers to finish, not a timing assertion
    while handlers_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    out, err = capfd.readouterr()
    assert out + err == "", f"{len((out + err).splitlines())} log lines for {DROPPED} dropped connections"


def test_any_other_connection_failure_is_one_line(probe_port, capfd):
    _, server = probe_port
    capfd.readouterr()
    try:
        raise ValueError("unexpected")
    except ValueError:
        server.handle_error(None, ("192.0.2.7", 40000))
    out, err = capfd.readouterr()
    assert (out + err).splitlines() == [
        "[supervisor] probe port: connection from 192.0.2.7 failed: ValueError: unexpected"
    ]
