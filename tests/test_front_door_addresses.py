"""The client address behind the door is the door's word, never the client's: the HTTP API reads
the last X-Forwarded-For entry (the one the door appends, after dropping any the client wrote), and
the models read the gRPC header `triton-client-address` the door sets (tritonserver forwards it as
a request parameter). Checked with stand-ins for the API and for tritonserver's gRPC port that
record what reaches them, behind this host's HAProxy running the template."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import hpack
import pytest

from triton_sampling_mask.ops import proxy
from triton_sampling_mask.ops.door_commands import door_children
from triton_sampling_mask.ops.proxy import FrontDoor
from triton_sampling_mask.ops.server_process import free_port
from triton_sampling_mask.sampling.admin import CLIENT_ADDRESS_PARAMETER

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
pytestmark = pytest.mark.skipif(proxy.find_haproxy() is None, reason="haproxy is not installed")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """The HTTP API's stand-in: it keeps every X-Forwarded-For it is sent."""

    seen: list[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(self.headers.get_all("X-Forwarded-For") or [])
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


class _GrpcRecorder(threading.Thread):
    """tritonserver's gRPC stand-in: it records each stream's request headers and ends the call
    with grpc-status 0 and no message."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.headers: list[list[tuple[str, str]]] = []

    def run(self) -> None:
        try:
            while True:
                connection, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(connection,), daemon=True).start()
        except OSError:  # the listener closed
            pass

    def _serve(self, connection: socket.socket) -> None:
        decoder, encoder, buffer = hpack.Decoder(), hpack.Encoder(), b""
        with contextlib.suppress(OSError), connection:  # the proxy closed or reset it
            connection.sendall(b"\0\0\0\x04\0\0\0\0\0")  # SETTINGS
            while chunk := connection.recv(65536):
                buffer += chunk
                if buffer.startswith(b"PRI * HTTP/2.0"):
                    buffer = buffer[24:]
                while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                    size, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                    stream, payload, buffer = (
                        int.from_bytes(buffer[5:9], "big"),
                        buffer[9 : 9 + size],
                        buffer[9 + size :],
                    )
                    if kind == 4 and not flags & 1:
                        connection.sendall(b"\0\0\0\x04\x01\0\0\0\0")  # SETTINGS ACK
                    elif kind == 1:  # HEADERS (END_HEADERS: HAProxy sends no CONTINUATION here)
                        self.headers.append(decoder.decode(payload))
                        reply = [(":status", "200"), ("content-type", "application/grpc")]
                        trailers = [("grpc-status", "0")]
                        for block, end in ((encoder.encode(reply), 0), (encoder.encode(trailers), 1)):
                            head = len(block).to_bytes(3, "big") + bytes([1, 4 | end]) + stream.to_bytes(4, "big")
                            connection.sendall(head + block)


def _http_from(source: str, port: int, raw: bytes) -> bytes:
    """The answer to `raw` (Connection: close) sent from the loopback address `source`."""
    with socket.socket() as sock:
        sock.bind((source, 0))
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


@pytest.fixture
def door(tmp_path):
    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    grpc = _GrpcRecorder()
    grpc.start()
    internal = {name: free_port() for name in ("http", "metrics", "probe", "stream_gate")}
    front = FrontDoor(
        REPOSITORY,
        {"http": free_port(), "grpc": free_port(), "api": free_port()},
        None,
        {**internal, "grpc": grpc.port, "api": api.server_address[1]},
        stream_gate=False,
    )
    if not front.serves_api():
        pytest.skip("the HTTP API's extra is not installed")
    front.directory = tmp_path
    front.write_files()
    [haproxy] = door_children(front)[:1]
    running = subprocess.Popen(haproxy.command, env=haproxy.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", front.public["grpc"]), timeout=1).close()
                break
            except OSError:
                assert running.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield front, grpc
    finally:
        running.terminate()
        running.wait(10)
        api.shutdown()
        grpc.listener.close()


def test_the_api_reads_the_address_the_door_appends_not_the_one_the_client_wrote(door):
    front, _ = door
    _Recorder.seen.clear()
    raw = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.6.0.1\r\nConnection: close\r\n\r\n"
    assert _http_from("127.0.0.3", front.public["api"], raw).split(b" ", 2)[1] == b"200"
    assert _Recorder.seen == [["127.0.0.3"]]


def test_the_models_read_the_address_the_door_sets_not_the_one_the_client_sent(door):
    front, grpc = door
    encoder = hpack.Encoder()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        (CLIENT_ADDRESS_PARAMETER, "10.7.7.7"),
    ]
    block = encoder.encode(headers)
    message = b"\0\0\0\0\0"  # an empty ModelInferRequest
    frames = [
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0",
        len(block).to_bytes(3, "big") + b"\x01\x04" + (1).to_bytes(4, "big") + block,
        len(message).to_bytes(3, "big") + b"\x00\x01" + (1).to_bytes(4, "big") + message,
    ]
    with socket.socket() as sock:
        sock.bind(("127.0.0.4", 0))
        sock.settimeout(10)
        sock.connect(("127.0.0.1", front.public["grpc"]))
        sock.sendall(b"".join(frames))
        deadline = time.monotonic() + 10
        while not grpc.headers and time.monotonic() < deadline:
            time.sleep(0.05)
    [seen] = grpc.headers
    assert [value for name, value in seen if name == CLIENT_ADDRESS_PARAMETER] == ["127.0.0.4"]


def test_an_http_client_cannot_name_its_address_as_a_request_parameter(door):
    """tritonserver forwards no header on HTTP /generate or /infer: a request parameter naming the
    client's address would reach the model as the address, so the door refuses it (400, named)."""
    front, _ = door
    bodies = {
        "/v2/models/generate/generate": {"input_ids": [1], "parameters": {CLIENT_ADDRESS_PARAMETER: "10.6.0.1"}},
        "/v2/models/sampler/infer": {
            "inputs": [{"name": "logits", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}],
            "parameters": {CLIENT_ADDRESS_PARAMETER: "10.6.0.1"},
        },
    }
    for path, body in bodies.items():
        data = json.dumps(body).encode()
        raw = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        answer = _http_from("127.0.0.5", front.public["http"], raw.encode() + data)
        assert answer.split(b" ", 2)[1] == b"400" and CLIENT_ADDRESS_PARAMETER.encode() in answer, answer
    assert f'["{CLIENT_ADDRESS_PARAMETER}"] = true' in proxy.LUA_CHECKS.read_text()  # the checks' one name
