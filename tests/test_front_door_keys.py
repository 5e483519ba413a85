"""Keyed clients at the front door (TRITON_CLIENT_KEYS_FILE), against this host's HAProxy running
the template in front of stand-ins for tritonserver and the HTTP API that hold each request until
the test lets it go: a keyed client from one address waits where its address's share would refuse
it, while another address's keyless requests are shared out as before and a third's are served;
keys take turns in the keyed queue; a keyed trainer's first burst of connections is let in; its key
never reaches tritonserver, and the API sees its own key. The key file's rules come first."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import queue
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops import proxy
from triton_sampling_mask.ops.door_commands import door_children
from triton_sampling_mask.ops.proxy import FrontDoor, ProxyLimits
from triton_sampling_mask.ops.secret_files import API_KEY_CLIENT, read_client_keys
from triton_sampling_mask.ops.server_process import free_port

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
KEYS = {"trainer": "t" * 40, "team-b": "b" * 40}
GENERATE = b'{"input_ids": [1, 2], "max_new_tokens": 1}'
READY = "/v2/health/ready"  # no model route: no address's share
needs_haproxy = pytest.mark.skipif(proxy.find_haproxy() is None, reason="haproxy is not installed")


# ---- the key file ----


def _key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "client.keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_file_names_each_client_and_its_key(tmp_path):
    path = _key_file(tmp_path, f"# trainers\ntrainer {'t' * 40}\n\nteam-b   {'b' * 40}\n")
    assert read_client_keys(path) == KEYS
    assert read_client_keys(path, "a" * 32) == {API_KEY_CLIENT: "a" * 32, **KEYS}
    assert read_client_keys(None, "a" * 32) == {API_KEY_CLIENT: "a" * 32}
    assert read_client_keys(None, "short") == {}  # an API key that cannot be a client key: the API's own


@pytest.mark.parametrize(
    ("text", "mode", "says"),
    [
        (f"trainer {'t' * 40}\n", 0o644, "readable by its owner only"),
        ("trainer short\n", 0o600, "line 1: expected `<name> <key>`"),
        (f"trainer {'t' * 40} extra\n", 0o600, "line 1"),
        (f"# a comment\ntrainer {'t' * 31}\n", 0o600, "line 2"),
        (f"a {'t' * 40}\nb {'t' * 40}\n", 0o600, "line 2: a name or key given twice"),
        (f"{API_KEY_CLIENT} {'t' * 40}\n", 0o600, "TRITON_API_KEY's"),
    ],
)
def test_a_key_file_that_cannot_be_used_is_refused_saying_where_never_what(tmp_path, text, mode, says):
    with pytest.raises(ValueError, match=says) as refusal:
        read_client_keys(_key_file(tmp_path, text, mode))
    assert "t" * 31 not in str(refusal.value)


def test_beside_a_key_file_the_api_key_must_be_a_client_key(tmp_path):
    with pytest.raises(ValueError, match="TRITON_API_KEY must have a client key's shape"):
        read_client_keys(_key_file(tmp_path, f"x {'t' * 40}\n"), "short")


# ---- at the door ----


class _HeldServer(http.server.ThreadingHTTPServer):
    """tritonserver's (or the API's) stand-in: it records each request (its X-Who and
    Authorization) as it arrives and answers it only once `release` lets one go."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(self):
        self.arrived: list[tuple[str, str]] = []
        self.gate = threading.Semaphore(0)
        super().__init__(("127.0.0.1", 0), _Held)

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self.gate.release()


class _Held(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.arrived.append((self.headers.get("X-Who", ""), self.headers.get("Authorization", "")))
        self.server.gate.acquire(timeout=60)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


LIMITS = ProxyLimits(
    max_in_flight=2,
    max_queue=2,
    requests_per_ip=3,
    connections_per_ip=8,
    keyed_max_in_flight=4,
    keyed_max_queue=60,
    keyed_queue_timeout_s=30.0,
    keyed_connections_per_ip=100,
    server_timeout_s=60.0,
)


@pytest.fixture
def door(tmp_path):
    """HAProxy with KEYS (and an API key) before a held tritonserver and a held API."""
    server, api = _HeldServer(), _HeldServer()
    for held in (server, api):
        threading.Thread(target=held.serve_forever, daemon=True).start()
    internal = {name: free_port() for name in ("grpc", "metrics", "probe", "stream_gate")}
    keys = {**KEYS, API_KEY_CLIENT: "a" * 40}
    front = FrontDoor(
        REPOSITORY,
        {"http": free_port(), "grpc": free_port(), "api": free_port()},
        None,
        {**internal, "http": server.server_address[1], "api": api.server_address[1]},
        LIMITS,
        client_keys=keys,
    )
    front.directory = tmp_path
    front.write_files()
    [haproxy] = door_children(front)[:1]
    running = haproxy.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", front.public["http"]), timeout=1).close()
                break
            except OSError:
                assert running.running() and time.monotonic() < deadline
                time.sleep(0.1)
        yield front, server, api
    finally:
        server.release(1000)
        api.release(1000)
        running.stop()
        server.shutdown()
        api.shutdown()


def _connect(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def _send(sock: socket.socket, who: str, key: str | None = None, path: str = "/v2/models/generate/generate") -> None:
    """A generate request (POST), or a GET of a path that is no model route's."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    body = GENERATE if path.endswith("generate") or path.startswith("/v1") else b""
    head = f"{'POST' if body else 'GET'} {path} HTTP/1.1\r\nHost: x\r\nX-Who: {who}\r\n{auth}"
    sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def _request(source: str, port: int, who: str, key: str | None = None, path: str = "/v2/models/generate/generate"):
    """A connection from `source` that sends one request at once, as an HTTP client does."""
    sock = _connect(source, port)
    _send(sock, who, key, path)
    return sock


def _status(sock: socket.socket) -> int | None:
    """The status answered on `sock` (waiting for it), None when the connection was closed unanswered."""
    try:
        data = sock.recv(4096)
    except OSError:
        return None
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None


def _answered_now(sock: socket.socket) -> int | None:
    """The status already answered on `sock`, or None while it waits."""
    sock.setblocking(False)
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return None
    except OSError:  # reset
        return -1
    finally:
        sock.setblocking(True)
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else -1  # -1: closed


def _wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@needs_haproxy
def test_a_keyed_client_waits_where_its_address_share_refuses_and_others_are_served(door):
    front, server, _ = door
    port = front.public["http"]
    keyed = [_request("127.0.0.2", port, "trainer", KEYS["trainer"]) for _ in range(30)]
    _wait_for(lambda: len(server.arrived) == LIMITS.keyed_max_in_flight)
    # an address without a key: PROXY_MAX_IN_FLIGHT slots and PROXY_REQUESTS_PER_IP at once, as before
    flood = [_request("127.0.0.3", port, "flood") for _ in range(8)]
    _wait_for(lambda: len(server.arrived) == LIMITS.keyed_max_in_flight + LIMITS.max_in_flight)
    answered: dict[int, int | None] = {}

    def refused() -> int:
        answered.update({i: _answered_now(sock) for i, sock in enumerate(flood) if answered.get(i) is None})
        return list(answered.values()).count(429)

    _wait_for(lambda: refused() == 8 - LIMITS.requests_per_ip)
    time.sleep(0.3)
    assert refused() == 8 - LIMITS.requests_per_ip and set(answered.values()) == {None, 429}, answered
    third = _request("127.0.0.4", port, "third")  # a keyless client of its own address finds a queue place
    time.sleep(0.5)
    assert [_answered_now(sock) for sock in keyed] == [None] * 30  # every keyed request waits, none refused
    assert _answered_now(third) is None
    server.release(1000)
    assert [_status(sock) for sock in keyed] == [200] * 30
    assert _status(third) == 200
    assert {who for who, _ in server.arrived} == {"trainer", "flood", "third"}
    assert all(authorization == "" for who, authorization in server.arrived)  # the key stays at the door
    for sock in [*keyed, *flood, third]:
        sock.close()


@needs_haproxy
def test_keys_take_turns_in_the_keyed_queue(door):
    front, server, _ = door
    port = front.public["http"]
    first = [_request("127.0.0.5", port, "trainer", KEYS["trainer"]) for _ in range(40)]
    _wait_for(lambda: len(server.arrived) == LIMITS.keyed_max_in_flight)
    time.sleep(0.3)  # the rest of the first key's burst waits in the queue
    second = [_request("127.0.0.6", port, "team-b", KEYS["team-b"]) for _ in range(2)]
    time.sleep(0.3)
    for count in range(LIMITS.keyed_max_in_flight + 1, 43):
        server.release()
        _wait_for(lambda count=count: len(server.arrived) >= count)
    order = [who for who, _ in server.arrived]
    # arrival order would put team-b last (41st and 42nd); a key's Nth request waits as if N x 0.1 s later
    assert max(index for index, who in enumerate(order) if who == "team-b") < 10, order
    server.release(1000)
    for sock in [*first, *second]:
        assert _status(sock) == 200
        sock.close()


@needs_haproxy
def test_a_keyed_burst_of_connections_is_let_in_and_keyless_ones_keep_their_cap(door):
    front, server, _ = door
    port = front.public["http"]
    cap = LIMITS.connections_per_ip
    # a keyless address: twice its cap of connections, then none (closed as they are accepted, in
    # whatever order HAProxy's threads accept them); past its cap its requests are refused
    opened, refused = [], 0
    for _ in range(2 * cap + 4):
        try:
            opened.append(_connect("127.0.0.7", port))
        except OSError:  # reset before connect() returned
            refused += 1
    time.sleep(0.5)
    closed = [sock for sock in opened if _answered_now(sock) == -1]
    assert refused + len(closed) == 4
    server.release(1000)
    statuses = []
    for sock in (sock for sock in opened if sock not in closed):
        _send(sock, "keyless", path=READY)  # each refusal closes its connection: the next may be within the cap
        statuses.append(_status(sock))
    assert statuses[0] == 429 and statuses.count(200) <= cap and statuses.count(429) >= cap, statuses
    for sock in opened:
        sock.close()
    time.sleep(0.3)
    within = [_request("127.0.0.7", port, "keyless", path=READY) for _ in range(cap)]  # within its cap, as before
    assert [_status(sock) for sock in within] == [200] * cap
    # a trainer opens its whole burst before the door read any key: let in, its requests held
    burst = [_connect("127.0.0.8", port) for _ in range(2 * cap)]
    for sock in burst:
        _send(sock, "trainer", KEYS["trainer"])
    more = [_request("127.0.0.8", port, "trainer", KEYS["trainer"]) for _ in range(40)]  # its address showed a key
    server.release(1000)
    assert [_status(sock) for sock in [*burst, *more]] == [200] * (2 * cap + 40)
    for sock in [*within, *burst, *more]:
        sock.close()


@needs_haproxy
def test_the_api_sees_its_own_key_for_a_keyed_client_and_the_clients_key_otherwise(door):
    front, _, api = door
    api.release(1000)
    for key in (KEYS["team-b"], "not-a-client-key"):
        sock = _request("127.0.0.9", front.public["api"], "api", key, path="/v1/completions")
        assert _status(sock) == 200
        sock.close()
    assert [authorization for _, authorization in api.arrived] == [f"Bearer {'a' * 40}", "Bearer not-a-client-key"]


def test_without_keys_the_door_is_as_before(tmp_path):
    internal = {name: free_port() for name in ("http", "grpc", "metrics", "probe", "stream_gate")}
    front = FrontDoor(REPOSITORY, {"http": 1, "grpc": 2}, None, internal, LIMITS)
    front.directory = tmp_path
    front.write_files()
    environment = front.environment()
    assert "DOOR_CLIENT_KEYS" not in environment and not (tmp_path / "client_keys.map").exists()
    assert environment["DOOR_PORT_MAXCONN"] == str(LIMITS.max_connections // 2)
    keyed = FrontDoor(REPOSITORY, {"http": 1, "grpc": 2}, None, internal, LIMITS, client_keys=KEYS)
    keyed.directory = tmp_path / "keyed"
    keyed.directory.mkdir()
    keyed.write_files()
    assert keyed.environment()["DOOR_PORT_MAXCONN"] == str(LIMITS.max_connections // 2 + 100)
    assert os.stat(keyed.directory / "client_keys.map").st_mode & 0o077 == 0


class _SilentGrpcServer(threading.Thread):
    """tritonserver's gRPC stand-in: it speaks HTTP/2's preface and never answers; `reached`
    counts the connections a request has reached it on (the gate opens one per proxy connection)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.reached = 0

    def run(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                connection, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:
            connection.sendall(b"\0\0\0\x04\0\0\0\0\0")  # SETTINGS
            received, acked, counted = b"", False, False
            while chunk := connection.recv(65536):
                if not acked:
                    connection.sendall(b"\0\0\0\x04\x01\0\0\0\0")  # SETTINGS ACK
                    acked = True
                received += chunk
                pos = received.find(b"SM\r\n\r\n") + 6 if b"SM\r\n\r\n" in received else len(received)
                while len(received) - pos >= 9 and not counted:  # a DATA frame: a request reached here
                    if received[pos + 3] == 0:
                        self.reached, counted = self.reached + 1, True
                    pos += 9 + int.from_bytes(received[pos : pos + 3], "big")


@needs_haproxy
def test_a_keyed_stream_has_the_gates_queue_of_its_own(tmp_path):
    """ModelStreamInfer with one slot and one queue place for keyless streams: a keyed stream still
    reaches the server (its own listener and queue at the gate) while a third keyless one is refused."""
    upstream = _SilentGrpcServer()
    upstream.start()
    internal = {name: free_port() for name in ("http", "metrics", "probe", "stream_gate", "stream_gate_keyed", "api")}
    limits = dataclasses.replace(LIMITS, max_in_flight=1, max_queue=1, queue_timeout_s=20.0)
    front = FrontDoor(
        REPOSITORY, {"http": free_port(), "grpc": free_port()}, None, {**internal, "grpc": upstream.port}, limits
    )
    front.client_keys = KEYS
    front.directory = tmp_path
    front.write_files()
    children = [child.start() for child in door_children(front)[:2]]  # HAProxy and the gate
    clients = []

    def stream(key: str | None = None) -> queue.Queue:
        outcomes: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{front.public['grpc']}")
        headers = {"authorization": f"Bearer {key}"} if key else None
        client.start_stream(callback=lambda result, error: outcomes.put(error and error.status()), headers=headers)
        client.async_stream_infer("sampler", sampler_inputs(grpcclient, np.zeros((1, 8), np.float32), top_k=5))
        clients.append(client)
        return outcomes

    try:
        _wait_for(lambda: all(child.running() for child in children) and _listening(front.public["grpc"]), 20)
        stream()
        _wait_for(lambda: upstream.reached == 1, 20)  # the keyless slot taken
        stream()  # the keyless queue's one place
        time.sleep(0.5)
        keyed = stream(KEYS["trainer"])
        _wait_for(lambda: upstream.reached == 2, 20)  # the keyed stream reached the server
        assert stream().get(timeout=20) == "StatusCode.UNAVAILABLE"  # the keyless queue is full
        assert keyed.empty()
    finally:
        for client in clients:
            client.stop_stream(cancel_requests=True)
            client.close()
        for child in children:
            child.stop()
        upstream.listener.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
