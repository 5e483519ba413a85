"""The front door's template with the launcher's values on each image line's HAProxy (2.4 on the
24.10 line, 2.8 on 26.09, and this host's): `haproxy -c` accepts it without a warning, and, run in front of a stub
server, every framing-header check refuses what it must whatever that version does itself with
overflowing or repeated lengths, and the Lua JSON checks run on its Lua (5.3 or 5.4); and a
ModelStreamInfer stream refused for want of a slot reaches tritonclient as UNAVAILABLE with the
proxy's message (2.4 and 2.6 reset a stream after any answer of their own: CANCELLED), and a
unary call refused (queue full or timed out, over its address's share) gets gRPC's trailers-only
answer (HTTP 200, application/grpc) that tritonclient reads as UNAVAILABLE or RESOURCE_EXHAUSTED.

The lines' binaries are unpacked by `make setup` (scripts/haproxy_lines.py); without them those
cases skip, saying so.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops import proxy, proxy_metrics
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.door_commands import door_children
from triton_sampling_mask.ops.proxy import MESSAGES, QUEUE_FULL, QUEUE_TIMEOUT, FrontDoor, ProxyLimits
from triton_sampling_mask.ops.server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import haproxy_lines  # noqa: E402  (scripts/, standard library only)

REPOSITORY = ROOT / "model_repository"
OVER_SHARE = MESSAGES["MSG_OVER_SHARE"]


def _haproxy(line: str) -> list[str]:
    if line == "host":
        found = proxy.find_haproxy()
        if found is None:
            pytest.skip("haproxy is not installed here")
        return [found]
    command = haproxy_lines.command(line)
    if command is None:
        pytest.skip(f"HAProxy {line} is not unpacked: run `python scripts/haproxy_lines.py` (make setup does)")
    return command


class _Stub(http.server.BaseHTTPRequestHandler):
    """tritonserver's stand-in: 200 and a JSON body for anything that reaches it."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"reached": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def _door(tmp_path: Path, stub_port: int, command: list[str]) -> FrontDoor:
    internal = {name: free_port() for name in ("grpc", "metrics", "probe", "stream_gate", "api")}
    door = FrontDoor(
        REPOSITORY,
        public={"http": free_port(), "grpc": free_port(), "metrics": free_port(), "probe": 0},
        admin_key="k" * 40,
        internal={**internal, "http": stub_port},
        internal_key="i" * 40,
        haproxy=command,
    )
    door.directory = tmp_path
    door.write_files()
    assert door.stats_socket is not None  # the exporter's frontend (ops.proxy_metrics): every line has it
    return door


def _status(port: int, raw: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):  # Connection: close, so the answer ends with the socket
            answer += chunk
        return int(answer.split(b" ", 2)[1]), answer


def _post(path: str, body: bytes, *headers: str) -> bytes:
    head = "".join(f"{header}\r\n" for header in headers)
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n\r\n".encode() + body


SHAPE = json.dumps({"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32", "data": [1.0]}]}).encode()
INFER = "/v2/models/sampler/infer"
# (what is sent, the status the front door must answer, what its answer must say)
CASES = {
    "content-length-overflow": (_post(INFER, b"{}", "Content-Length: 18446744073709551615"), 400, b""),
    "content-length-twice": (_post(INFER, b"{}", "Content-Length: 2", "Content-Length: 2"), 400, b""),
    "content-length-signed": (_post(INFER, b"{}", "Content-Length: +2"), 400, b""),
    "header-length-twice": (
        _post(INFER, SHAPE, f"Content-Length: {len(SHAPE)}", "Inference-Header-Content-Length: 10").replace(
            b"Connection", b"Inference-Header-Content-Length: 99\r\nConnection"
        ),
        400,
        b"Inference-Header-Content-Length",
    ),
    "header-length-fraction": (
        _post(INFER, SHAPE, f"Content-Length: {len(SHAPE)}", "Inference-Header-Content-Length: 12.5"),
        400,
        b"Inference-Header-Content-Length",
    ),
    "chunked": (_post(INFER, b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked"), 400, b""),
    "compressed": (_post(INFER, b"{}", "Content-Length: 2", "Content-Encoding: gzip"), 400, b"compressed"),
    "json-shape": (_post(INFER, SHAPE, f"Content-Length: {len(SHAPE)}"), 400, b"shape declares"),
}


@pytest.mark.parametrize("line", ["host", "2.4", "2.8"])
def test_each_lines_haproxy_accepts_the_config_and_refuses_every_bad_framing(tmp_path, line):
    command = _haproxy(line)
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    door = _door(tmp_path, stub.server_address[1], command)
    check = door.check()
    assert check.returncode == 0 and "warning" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    [haproxy] = door_children(door)[:1]
    running = subprocess.Popen(haproxy.command, env=haproxy.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    port = door.public["http"]
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                ready = _status(port, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                break
            except OSError:
                assert running.poll() is None and time.monotonic() < deadline, running.stderr.read().decode()
                time.sleep(0.2)
        assert ready[0] == 200 and b"reached" in ready[1]  # a good request goes through
        answers = {name: _status(port, raw) for name, (raw, _, _) in CASES.items()}
        wrong = {
            name: answers[name][1][:300]
            for name, (_, status, says) in CASES.items()
            if answers[name][0] != status or says not in answers[name][1] or b"reached" in answers[name][1]
        }
        assert not wrong, wrong
        # each refusal counted on this line's exporter, read as the supervisor reads it (ops.proxy_metrics)
        refused = proxy_metrics.refusals(proxy_metrics.scrape(door.stats_socket))["http"]
        assert refused["refused"] + refused["bad_request"] == len(CASES) and refused["queue_full"] == 0, refused
    finally:
        running.terminate()
        running.wait(10)
        stub.shutdown()


class _SilentGrpcServer(threading.Thread):
    """tritonserver's gRPC stand-in: it speaks HTTP/2's preface and never answers a stream, so the
    first stream keeps its slot; `data` is set once a stream's request has reached it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.data = threading.Event()

    def run(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                connection, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError), connection:  # the gate reset or closed it
            self._read(connection)

    def _read(self, connection: socket.socket) -> None:
        connection.sendall(b"\0\0\0\x04\0\0\0\0\0")  # SETTINGS
        received, acked = b"", False
        while chunk := connection.recv(65536):
            if not acked:
                connection.sendall(b"\0\0\0\x04\x01\0\0\0\0")  # SETTINGS ACK
                acked = True
            received += chunk
            pos = received.find(b"\r\n\r\nSM\r\n\r\n") + 8 if b"SM\r\n" in received else len(received)
            while len(received) - pos >= 9:  # the frames after the preface: a DATA frame is a request
                if received[pos + 3] == 0:
                    self.data.set()
                pos += 9 + int.from_bytes(received[pos : pos + 3], "big")


def _wait_listening(port: int, children: list[Child]) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert all(child.running() for child in children) and time.monotonic() < deadline, f"nothing on {port}"
            time.sleep(0.1)


def _stream_outcome(url: str, logits: np.ndarray) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
    """A tritonclient stream with one request sent: the client, and where its outcome arrives."""
    outcomes: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: outcomes.put("ok" if error is None else f"{error.status()} {error.message()}")
    )
    client.async_stream_infer("sampler", sampler_inputs(grpcclient, logits, top_k=5))
    return client, outcomes


def _door_before_a_silent_server(command: list[str], limits: ProxyLimits, directory) -> tuple:
    """A started gRPC server that never answers, and a front door (files written into
    `directory`, not started) whose gRPC route leads to it."""
    upstream = _SilentGrpcServer()
    upstream.start()
    internal = {name: free_port() for name in ("http", "metrics", "probe", "stream_gate", "api")}
    door = FrontDoor(
        REPOSITORY,
        public={"http": free_port(), "grpc": free_port(), "metrics": 0, "probe": 0},
        admin_key=None,
        internal={**internal, "grpc": upstream.port},
        limits=limits,
        haproxy=command,
    )
    door.directory = directory
    door.write_files()
    return upstream, door


@pytest.mark.parametrize("line", ["host", "2.4", "2.8"])
def test_each_lines_stream_refusals_reach_tritonclient_as_unavailable_with_the_proxys_message(tmp_path, line):
    """One slot and one queue place for ModelStreamInfer: a first stream holds the slot, and of the
    next two one waits out the queue timeout and one finds the queue full (which is which depends
    on their arrival); both read UNAVAILABLE and the proxy's message, never CANCELLED."""
    command = _haproxy(line)
    upstream, door = _door_before_a_silent_server(
        command, ProxyLimits(max_in_flight=1, max_queue=1, queue_timeout_s=0.5), tmp_path
    )
    children = door_children(door)[:2]  # HAProxy and the gate
    clients = []
    try:
        for child in children:
            child.start()
        for port in (door.internal["stream_gate"], door.public["grpc"]):
            _wait_listening(port, children)
        url = f"127.0.0.1:{door.public['grpc']}"
        logits = np.zeros((1, 8), dtype=np.float32)
        clients.append(_stream_outcome(url, logits))
        assert upstream.data.wait(20), "the first stream's request never reached the server"
        clients += [_stream_outcome(url, logits) for _ in range(2)]
        outcomes = {clients[i][1].get(timeout=20) for i in (1, 2)}
        unavailable = "StatusCode.UNAVAILABLE"
        assert outcomes == {f"{unavailable} {QUEUE_FULL}", f"{unavailable} {QUEUE_TIMEOUT}"}, outcomes
        assert clients[0][1].empty()  # the first stream still waits for its answer
    finally:
        for client, _ in clients:
            client.stop_stream(cancel_requests=True)
            client.close()
        for child in children:
            child.stop()
        upstream.listener.close()


def _unary_outcome(client: grpcclient.InferenceServerClient, logits: np.ndarray) -> queue.Queue:
    """One ModelInfer call sent: where its outcome ("ok" or "<status> <message>") arrives."""
    outcomes: queue.Queue = queue.Queue()
    client.async_infer(
        "sampler",
        sampler_inputs(grpcclient, logits, top_k=5),
        callback=lambda result, error: outcomes.put("ok" if error is None else f"{error.status()} {error.message()}"),
    )
    return outcomes


GRPC_CODES = {"8": "RESOURCE_EXHAUSTED", "14": "UNAVAILABLE"}


def _raw_grpc_calls(port: int, count: int, directory: Path) -> list[dict[str, str]]:
    """`count` concurrent ModelInfer calls (one empty message each) by curl over HTTP/2: each
    answer's head, its status under "status" and its headers by lower-case name."""
    if shutil.which("curl") is None:
        pytest.skip("no curl here to read the refusals' HTTP/2 heads")
    url = f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer"
    command = ["curl", "-s", "--http2-prior-knowledge", "-o", "/dev/null", "-D", "-", "--max-time", "20"]
    message = directory / "empty-message"
    message.write_bytes(b"\0\0\0\0\0")  # uncompressed, 0 bytes
    command += ["-H", "content-type: application/grpc", "-H", "te: trailers", "--data-binary", f"@{message}", url]
    calls = [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(count)]
    heads = []
    for call in calls:
        text = call.communicate(timeout=30)[0].decode()
        lines = [line for line in text.splitlines() if line.strip()]
        head = {"status": lines[0].split()[1]} if lines else {}
        head |= {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
        heads.append(head)
    return heads


# (the limits, the two refusals the calls behind a first one that holds the only slot read)
UNARY_REFUSALS = {
    "queue": (
        {"max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 0.5},
        {f"StatusCode.UNAVAILABLE {QUEUE_FULL}", f"StatusCode.UNAVAILABLE {QUEUE_TIMEOUT}"},
    ),
    "address-share": (
        {"max_in_flight": 1, "requests_per_ip": 1},
        {f"StatusCode.RESOURCE_EXHAUSTED {OVER_SHARE.replace('${PROXY_REQUESTS_PER_IP}', '1')}"},
    ),
}


@pytest.mark.parametrize("refusal", list(UNARY_REFUSALS))
@pytest.mark.parametrize("line", ["host", "2.4", "2.8"])
def test_each_lines_unary_refusals_reach_tritonclient_as_grpc_statuses_with_the_proxys_message(tmp_path, line, refusal):
    """One slot for ModelInfer, held by a first call the server never answers: of the next two, on
    the queue's limits one finds the queue full and one waits out the queue timeout (which is which
    depends on their arrival), on one address's share both are over it. Each is a trailers-only
    gRPC answer tritonclient reads as its status and the proxy's message."""
    command = _haproxy(line)
    limits, expected = UNARY_REFUSALS[refusal]
    upstream, door = _door_before_a_silent_server(command, ProxyLimits(**limits), tmp_path)
    [haproxy] = door_children(door)[:1]
    client = None
    try:
        haproxy.start()
        _wait_listening(door.public["grpc"], [haproxy])
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{door.public['grpc']}")
        logits = np.zeros((1, 8), dtype=np.float32)
        first = _unary_outcome(client, logits)
        assert upstream.data.wait(20), "the first call's request never reached the server"
        later = [_unary_outcome(client, logits) for _ in range(2)]
        outcomes = {outcome.get(timeout=20) for outcome in later}
        assert outcomes == expected, outcomes
        # on the wire, as gRPC's HTTP/2 protocol writes a trailers-only answer (any gRPC client)
        answers = _raw_grpc_calls(door.public["grpc"], 2, tmp_path)
        for head in answers:
            assert head["status"] == "200" and head.get("content-type") == "application/grpc", head
        wire = {f"StatusCode.{GRPC_CODES[head['grpc-status']]} {head['grpc-message']}" for head in answers}
        assert wire == expected, answers
        assert first.empty()  # the first call still waits for its answer
    finally:
        if client is not None:
            client.close()
        haproxy.stop()
        upstream.listener.close()
