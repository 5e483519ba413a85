"""The front door's template with the launcher's values on each image line's HAProxy (2.4 on the
24.10 line, 2.8 on 26.09, and this host's): `haproxy -c` accepts it without a warning, and, run in front of a stub
server, every framing-header check refuses what it must whatever that version does itself with
overflowing or repeated lengths, and the Lua JSON checks run on its Lua (5.3 or 5.4).

The lines' binaries are unpacked by `make setup` (scripts/haproxy_lines.py); without them those
cases skip, saying so.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from triton_sampling_mask.ops import proxy, proxy_metrics
from triton_sampling_mask.ops.proxy import FrontDoor
from triton_sampling_mask.ops.server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import haproxy_lines  # noqa: E402  (scripts/, standard library only)

REPOSITORY = ROOT / "model_repository"


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
    [haproxy] = door.children()[:1]
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
