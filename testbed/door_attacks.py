"""The front door's third round of attacks (`make hostile`, client_tests/test_front_door.py): one
client holding more than its share of a route, framing headers spelled twice or malformed,
streams abandoned with a reset socket, the side ports flooded, the admin key guessed. Each takes
a running `stack.Stack` and returns a `hostile.Outcome` (docs/operations.md, "Threat model").
Client addresses are 127.0.0.0/8 ones: each is another source to the proxy's per-address limits.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import hpack
import numpy as np
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

from triton_sampling_mask.ops.proxy import ProxyLimits
from triton_sampling_mask.ops.server_process import ADMIN_HEADER, GRPC_ADMIN_HEADER
from triton_sampling_mask.ops.stream_gate import DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS, frame
from triton_sampling_mask.sampling.admin import WRONG_KEYS_PER_MINUTE

from .hostile import SHAPE_ATTACK, Outcome, tiny_sampler_request
from .process_memory import process_tree_rss
from .server import REPO_ROOT
from .stack import ADMIN_KEY, Stack, request


def connect_from(source: str, port: int, timeout_s: float = 10.0) -> socket.socket:
    """A TCP connection to the proxy's `port` from the loopback address `source` (127.0.0.0/8:
    each one is another client address to the proxy's per-address limits)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(timeout_s)
    sock.connect(("127.0.0.1", port))
    return sock


def _answered_status(sock: socket.socket) -> int | None:
    """The status already answered on `sock`, or None (still waiting)."""
    sock.settimeout(0.0)
    try:
        data = sock.recv(4096)
    except OSError:
        return None
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else None


def _stalled_large_body(source: str, port: int, vocab: int = 151936) -> socket.socket:
    """A sampler request from `source` whose binary body is larger than the proxy's buffer: its
    first 400 KiB are sent (the proxy forwards the request to a tritonserver slot once its buffer
    is full), the rest never is, so the request holds its slot for as long as the client waits."""
    logits = httpclient.InferInput("logits", [1, vocab], "FP32")
    logits.set_data_from_numpy(np.zeros((1, vocab), np.float32), binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([logits])
    head = (
        f"POST /v2/models/sampler/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {json_size}\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    sock = connect_from(source, port)
    sock.sendall(head + body[: 400 * 1024])
    return sock


def route_share(stack: Stack, source: str = "127.0.0.9") -> Outcome:
    """One address opens as many stalled large-body sampler requests as the route has slots: past
    its share (PROXY_REQUESTS_PER_IP) they must be refused with 429 at once, and a client on
    another address served meanwhile (without the share it waits for a slot and is shed)."""
    limits = ProxyLimits()
    held = []
    try:
        for _ in range(limits.max_in_flight):
            held.append(_stalled_large_body(source, stack.ports["http"]))
        time.sleep(1.5)
        refused = [status for status in map(_answered_status, held) if status is not None]
        served = sum(stack.sampler_answers() for _ in range(3))
    finally:
        for sock in held:
            sock.close()
    expected = limits.max_in_flight - limits.requests_per_ip
    return Outcome(
        "route-share",
        refused.count(429) == expected and served == 3,
        f"{len(held)} stalled large bodies from {source}: {refused.count(429)} refused with 429 "
        f"(share {limits.requests_per_ip}), other statuses {sorted(set(refused) - {429}) or 'none'}; "
        f"another client: {served} of 3 sampler calls answered",
        numbers={"refused_429": refused.count(429), "others_served": served},
    )


def trickled_bodies(stack: Stack, source: str = "127.0.0.4", connections: int = 64) -> Outcome:
    """`connections` small bodies from one address, a byte a second: they wait at the proxy
    (which forwards a request once its body is in), never in tritonserver's slots."""
    slow = []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.send(b"x")
            stop.wait(1.0)

    try:
        for _ in range(connections):
            sock = connect_from(source, stack.ports["http"])
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nContent-Length: 70\r\n\r\n")
            slow.append(sock)
        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        time.sleep(1.0)
        health = sum(request(stack.ports["http"], "GET", "/v2/health/ready", timeout_s=5.0)[0] == 200 for _ in range(5))
        sampled = stack.sampler_answers()
    finally:
        stop.set()
        for sock in slow:
            sock.close()
    return Outcome(
        "trickled-bodies",
        health == 5 and sampled,
        f"{connections} bodies trickled from {source}: {health} of 5 health calls and "
        f"{'a' if sampled else 'no'} sampler call answered meanwhile",
        numbers={"health_served": health, "sampler_served": int(sampled)},
    )


def header_only_calls(stack: Stack, calls: int = 64) -> Outcome:
    """`calls` ModelInfer calls on one connection that send their headers and never a message:
    they wait at the proxy and are cut after its request timeout; another client's calls are
    answered meanwhile."""
    release = threading.Event()

    def nothing():
        release.wait()
        return
        yield  # a generator that ends without a message once released

    channel = grpc.insecure_channel(stack.grpc_url)
    call = channel.stream_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda m: m, response_deserializer=bytes
    )
    futures = [call.future(nothing()) for _ in range(calls)]
    try:
        time.sleep(1.0)
        other = grpc.insecure_channel(stack.grpc_url)
        try:
            ready = other.unary_unary(
                "/inference.GRPCInferenceService/ServerReady",
                request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
                response_deserializer=service_pb2.ServerReadyResponse.FromString,
            )
            answered = ready(service_pb2.ServerReadyRequest(), timeout=10).ready
        except grpc.RpcError:
            answered = False
        finally:
            other.close()
        sampled = stack.sampler_answers()
    finally:
        release.set()
        for future in futures:
            future.cancel()
        channel.close()
    return Outcome(
        "header-only-calls",
        answered and sampled,
        f"{calls} header-only ModelInfer calls on one connection: another client's ServerReady "
        f"{'answered' if answered else 'NOT answered'}, sampler {'answered' if sampled else 'NOT answered'}",
    )


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def _h2_request_headers(path: str, extra: list[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "x"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def _grpc_message(message) -> bytes:
    payload = message.SerializeToString()
    return b"\0" + struct.pack(">I", len(payload)) + payload


def raw_grpc_status(port: int, headers: list[tuple[str, str]], body: bytes, timeout_s: float = 10.0) -> str | None:
    """The grpc-status answered to one call sent as raw HTTP/2 frames (headers as given, repeats
    included, which no gRPC library sends), or None when no status came."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(
            H2_PREFACE
            + frame(SETTINGS, 0, 0)
            + frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(headers))
            + frame(DATA, END_STREAM, 1, body)
        )
        decoder, buffer = hpack.Decoder(), b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buffer += chunk
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                size = int.from_bytes(buffer[:3], "big")
                kind, flags, payload = buffer[3], buffer[4], buffer[9 : 9 + size]
                buffer = buffer[9 + size :]
                if kind == SETTINGS and not flags & 1:
                    sock.sendall(frame(SETTINGS, 1, 0))
                elif kind == HEADERS:
                    for name, value in decoder.decode(payload):
                        if name == "grpc-status":
                            return value
    return None


def header_spellings(stack: Stack) -> Outcome:
    """Every check reads one value per header: repeated or malformed framing headers (HTTP) and
    a second grpc-encoding or key header (gRPC) are refused, never passed on."""
    infer = "/v2/models/sampler/infer"
    shape = SHAPE_ATTACK
    http_cases = {
        "Content-Length overflow": ({"Content-Length": "18446744073709551615"}, b"{}"),
        "Inference-Header-Content-Length twice": (
            [("Inference-Header-Content-Length", "10"), ("Inference-Header-Content-Length", str(len(shape)))],
            shape,
        ),
        "Inference-Header-Content-Length 12.5": ({"Inference-Header-Content-Length": "12.5"}, shape),
        "Content-Encoding twice": ([("Content-Encoding", "identity"), ("Content-Encoding", "gzip")], b"{}"),
        "key header twice": ([(ADMIN_HEADER, ADMIN_KEY), (ADMIN_HEADER, ADMIN_KEY)], b"{}"),
    }
    wrong = []
    for name, (headers, body) in http_cases.items():
        pairs = list(headers.items()) if isinstance(headers, dict) else headers
        if not any(key.lower() == "content-length" for key, _ in pairs):
            pairs.append(("Content-Length", str(len(body))))
        head = "".join(f"{key}: {value}\r\n" for key, value in pairs)
        raw = f"POST {infer} HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n\r\n".encode() + body
        with connect_from("127.0.0.1", stack.ports["http"]) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
        if not answer.startswith(b"HTTP/1.1 400"):
            wrong.append(f"{name}: {answer[:40]!r}")
    message = _grpc_message(tiny_sampler_request())
    grpc_cases = {
        "grpc-encoding identity then gzip": [("grpc-encoding", "identity"), ("grpc-encoding", "gzip")],
        "grpc key header twice": [(GRPC_ADMIN_HEADER, ADMIN_KEY), (GRPC_ADMIN_HEADER, ADMIN_KEY)],
    }
    for name, extra in grpc_cases.items():
        status = raw_grpc_status(stack.ports["grpc"], _h2_request_headers(MODEL_INFER, extra), message)
        if status != "3":  # INVALID_ARGUMENT
            wrong.append(f"{name}: grpc-status {status}")
    return Outcome(
        "header-spellings",
        not wrong,
        f"{len(http_cases)} HTTP and {len(grpc_cases)} gRPC header spellings: "
        + (f"passed on: {wrong}" if wrong else "each refused (400 / INVALID_ARGUMENT)"),
    )


def _abandon_streams(port: int, streams: int, requests: int) -> socket.socket:
    """`streams` ModelStreamInfer streams of `requests` tiny sampler requests each (every answer
    the full [256, W] set), on a connection whose window never opens: nothing is ever read."""
    sock = socket.create_connection(("127.0.0.1", port))
    encoder = hpack.Encoder()
    payload = _grpc_message(tiny_sampler_request()) * requests
    out = [H2_PREFACE, frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 0))]  # SETTINGS_INITIAL_WINDOW_SIZE 0
    for index in range(streams):
        stream = 2 * index + 1
        out.append(frame(HEADERS, END_HEADERS, stream, encoder.encode(_h2_request_headers(MODEL_STREAM_INFER))))
        out += [frame(DATA, 0, stream, payload[i : i + 16384]) for i in range(0, len(payload), 16384)]
    sock.sendall(b"".join(out))
    time.sleep(0.3)
    sock.sendall(frame(SETTINGS, 1, 0))  # the proxy's settings acknowledged
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed or killed client leaves."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def abandoned_streams(
    stack: Stack, cycles: int = 3, streams: int = 8, hold_s: float = 4.0, growth_limit_mb: float = 300.0
) -> Outcome:
    """`cycles` times: `streams` unread ModelStreamInfer streams filled with requests, then the
    socket reset. tritonserver's memory must come back after each cycle (Triton 2.51 keeps what
    a cancelled stream had queued: about 540 MB a cycle without the stream gate's draining)."""
    pid = stack.server_pid()
    base = process_tree_rss(pid)
    peaks, kept = [], []
    for _ in range(cycles):
        sock = _abandon_streams(stack.ports["grpc"], streams, ProxyLimits().stream_max_open)
        time.sleep(hold_s)
        peaks.append((process_tree_rss(pid) - base) / 2**20)
        _reset(sock)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (process_tree_rss(pid) - base) / 2**20 > growth_limit_mb:
            time.sleep(0.5)
        kept.append((process_tree_rss(pid) - base) / 2**20)
    answers = stack.sampler_answers()
    return Outcome(
        "abandoned-streams",
        kept[-1] <= growth_limit_mb and answers,
        f"{cycles} cycles of {streams} unread streams then a reset socket: tritonserver tree RSS "
        f"+{max(peaks):.0f} MB at the peak, +{kept[-1]:.0f} MB after the last reset (bound {growth_limit_mb:g} MB); "
        f"sampler {'answered' if answers else 'NOT answered'}",
        numbers={"peak_mb": max(peaks), "kept_mb": kept[-1]},
    )


def probe_flood(stack: Stack, sources: tuple[str, ...] = ("127.0.0.5", "127.0.0.6"), each: int = 32) -> Outcome:
    """Each address opens `each` requests on the probe port that never finish their head: per-
    address caps and the short head timeout keep /ready answering the kubelet."""
    held = []
    try:
        for source in sources:
            for _ in range(each):
                try:
                    sock = connect_from(source, stack.ports["probe"])
                    sock.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n")  # the head never ends
                    held.append(sock)
                except OSError:
                    pass  # refused at the address's cap
        answered = sum(request(stack.ports["probe"], "GET", "/ready", timeout_s=3.0)[0] == 200 for _ in range(5))
    finally:
        for sock in held:
            sock.close()
    return Outcome(
        "probe-flood",
        answered == 5,
        f"{len(sources)} addresses x {each} unfinished /ready requests ({len(held)} connected): "
        f"{answered} of 5 /ready answered within 3 s",
        numbers={"ready_answered": answered},
    )


def _raw_http_status(source: str, port: int, raw: bytes) -> int:
    with connect_from(source, port) as sock:
        sock.sendall(raw)
        return int(sock.recv(4096).split(b" ", 2)[1])


def admin_key_guessing(stack: Stack, source: str = "127.0.0.8") -> Outcome:
    """The key with a NUL and anything after it, or a suffix, is not the key; wrong keys from one
    address are refused past WRONG_KEYS_PER_MINUTE (the right one too, from there, for a minute)."""

    def logging_status(key: bytes, source: str) -> int:
        raw = b"GET /v2/logging HTTP/1.1\r\nHost: x\r\n" + ADMIN_HEADER.encode() + b": " + key
        return _raw_http_status(source, stack.ports["http"], raw + b"\r\nConnection: close\r\n\r\n")

    tricks = [logging_status(ADMIN_KEY.encode() + suffix, "127.0.0.7") for suffix in (b"\0anything", b"x")]
    wrong = [logging_status(b"w" * 40, source) for _ in range(WRONG_KEYS_PER_MINUTE + 3)]
    right_after = logging_status(ADMIN_KEY.encode(), source)
    elsewhere = request(stack.ports["http"], "GET", "/v2/logging", headers={ADMIN_HEADER: ADMIN_KEY})[0]
    held = all(s in (400, 403) for s in tricks) and wrong[0] == 403 and wrong[-1] == 429
    held = held and right_after == 429 and elsewhere == 200
    return Outcome(
        "admin-key-guessing",
        held,
        f"key+NUL / key+suffix: {tricks}; {len(wrong)} wrong keys from {source}: first {wrong[0]}, last {wrong[-1]}; "
        f"the right key from there {right_after}, from another address {elsewhere}",
    )


def short_admin_key(stack: Stack) -> Outcome:
    """A one-character TRITON_ADMIN_KEY: the launcher must refuse to start, saying why (it is
    stopped, and the attack lost, if it starts instead)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "triton_sampling_mask.ops.launcher", "--model-repository", "model_repository"],
        env={**os.environ, "TRITON_ADMIN_KEY": "a"},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = launcher.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, 9)
        output, _ = launcher.communicate()
    said = "TRITON_ADMIN_KEY" in output
    return Outcome(
        "short-admin-key",
        launcher.returncode not in (0, None, -9) and said,
        f"TRITON_ADMIN_KEY=a: exit {launcher.returncode}, " + (output.strip().splitlines() or ["no message"])[-1][:160],
    )


ATTACKS = {
    "route-share": route_share,
    "trickled-bodies": trickled_bodies,
    "header-only-calls": header_only_calls,
    "header-spellings": header_spellings,
    "abandoned-streams": abandoned_streams,
    "probe-flood": probe_flood,
    "admin-key-guessing": admin_key_guessing,
    "short-admin-key": short_admin_key,
}
