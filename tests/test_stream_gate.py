"""The stream gate's relay without sockets: HTTP/2 frames in from the proxy and the server, the
frames it writes on either side read back. The bound and the refusal are checked against
offsets computed from the requests' sizes (the reference), for any split of the bytes into frames.
(client_tests/test_stream_gate.py runs the gate in front of a real tritonserver.)"""

from __future__ import annotations

import asyncio
import stat
import struct

import hpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from triton_sampling_mask.ops import stream_gate
from triton_sampling_mask.ops.stream_gate import DATA, END_STREAM, HEADERS, RST_STREAM, WINDOW_UPDATE, frame

STREAM = 1


@pytest.fixture(autouse=True)
def _writes_at_once(monkeypatch):
    """The relay's writes toward the proxy go at once (no coalescing), so each check reads them as
    soon as it has fed the relay; test_writes_toward_the_proxy_are_coalesced checks the coalescing."""
    monkeypatch.setattr(stream_gate.StreamGate, "coalesce_s", 0.0, raising=False)


class Transport:
    """What the relay writes on one side."""

    def __init__(self):
        self.written = bytearray()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes += 1

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        out, pos = [], 0
        data = bytes(self.written)
        while pos < len(data):
            length = int.from_bytes(data[pos : pos + 3], "big")
            stream = int.from_bytes(data[pos + 5 : pos + 9], "big")
            out.append((data[pos + 3], data[pos + 4], stream, data[pos + 9 : pos + 9 + length]))
            pos += 9 + length
        return out


def relay(max_open: int, max_message_bytes: int = 2**31 - 1, cancellable: tuple[str, ...] = ()) -> stream_gate.Relay:
    """A relay with both sides connected and stream 1 opened by the proxy."""
    gate = stream_gate.StreamGate("127.0.0.1:1", max_open, max_message_bytes, cancellable)
    relay = stream_gate.Relay(gate)
    relay.client.transport, relay.server.transport = Transport(), Transport()
    relay.client_data(stream_gate.PREFACE + frame(HEADERS, 0x4, STREAM, b"\x83"))
    relay.server.transport.written.clear()
    return relay


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def response(final: bool) -> bytes:
    message = service_pb2.ModelStreamInferResponse()
    message.infer_response.id = "r"
    message.infer_response.parameters["triton_final_response"].bool_param = final
    return grpc_message(message.SerializeToString())


def forwarded(relay: stream_gate.Relay) -> tuple[bytes, bool]:
    """The request bytes the server has been sent on the stream, and whether END_STREAM came."""
    frames = [f for f in relay.server.transport.frames() if f[0] == DATA and f[2] == STREAM]
    return b"".join(f[3] for f in frames), any(f[1] & END_STREAM for f in frames)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    cuts=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    max_open=st.integers(1, 4),
    chatter=st.integers(0, 2),
)
def test_a_stream_has_at_most_max_open_requests_forwarded_beyond_its_final_responses(sizes, cuts, max_open, chatter):
    requests = [grpc_message(bytes([i % 251]) * size) for i, size in enumerate(sizes)]
    sent = b"".join(requests)
    ends = [sum(len(r) for r in requests[: i + 1]) for i in range(len(requests))]  # the reference offsets
    gate = relay(max_open)
    pos, k = 0, 0
    while pos < len(sent):  # the proxy's DATA frames, cut anywhere
        step = cuts[k % len(cuts)]
        k += 1
        piece = sent[pos : pos + step]
        pos += len(piece)
        gate.client_data(frame(DATA, END_STREAM if pos == len(sent) else 0, STREAM, piece))
    finals = 0
    while True:
        allowed = min(len(requests), finals + max_open)
        data, end = forwarded(gate)
        assert data == sent[: ends[allowed - 1]]  # whole requests, as many as the bound allows, in order
        assert end == (allowed == len(requests))
        if allowed == len(requests):
            break
        for _ in range(chatter):  # streamed tokens: not final, nothing more may pass
            gate.server_data(frame(DATA, 0, STREAM, response(final=False)))
        assert forwarded(gate)[0] == data
        gate.server_data(frame(DATA, 0, STREAM, response(final=True)))
        finals += 1


@given(before=st.integers(0, 3), size=st.integers(1025, 5000), cut=st.integers(1, 700))
def test_an_oversized_request_ends_its_stream_and_every_dropped_byte_is_credited_back(before, size, cut):
    gate = relay(max_open=64, max_message_bytes=1024)
    sent = b"".join(grpc_message(b"a" * 10) for _ in range(before)) + grpc_message(b"b" * size)
    for pos in range(0, len(sent), cut):
        gate.client_data(frame(DATA, 0, STREAM, sent[pos : pos + cut]))
    data, _ = forwarded(gate)
    to_client = gate.client.transport.frames()
    credited = sum(int.from_bytes(f[3], "big") for f in to_client if f[0] == WINDOW_UPDATE and f[2] == 0)
    assert len(data) + credited == len(sent)  # the connection's window is whole again
    assert (RST_STREAM, STREAM) in {(f[0], f[2]) for f in gate.server.transport.frames()}
    (trailers,) = [f for f in to_client if f[0] == HEADERS]
    assert trailers[1] & END_STREAM and trailers[2] == STREAM
    headers = dict(hpack.Decoder().decode(trailers[3]))
    assert headers["grpc-status"] == "8" and headers[":status"] == "200"
    assert f"request message of {size} bytes, more than 1024" == headers["grpc-message"]


def test_a_release_waits_for_the_end_of_a_header_block_the_proxy_has_begun():
    """No frame may come between HEADERS and its CONTINUATION: a request a final response
    releases then is sent after the block."""
    gate = relay(max_open=1)
    first, second = grpc_message(b"1" * 20), grpc_message(b"2" * 20)
    gate.client_data(frame(DATA, 0, STREAM, first + second))
    gate.client_data(frame(HEADERS, 0, 3, b"\x83"))  # a new stream's headers, to be continued
    gate.server_data(frame(DATA, 0, STREAM, response(final=True)))
    assert forwarded(gate)[0] == first
    gate.client_data(frame(stream_gate.CONTINUATION, 0x4, 3, b"\x86"))
    assert forwarded(gate)[0] == first + second
    kinds = [(f[0], f[2]) for f in gate.server.transport.frames()]
    assert kinds[-3:] == [(HEADERS, 3), (stream_gate.CONTINUATION, 3), (DATA, STREAM)]


def test_writes_toward_the_proxy_are_coalesced_and_a_write_after_a_quiet_spell_goes_at_once(monkeypatch):
    """tritonserver sends each streamed token in a packet of its own: the relay writes the first at
    once, the ones that follow within coalesce_s in one write when that time is up, and what is
    still waiting when the server's connection ends before the relay closes; every frame arrives,
    in order."""
    monkeypatch.setattr(stream_gate.StreamGate, "coalesce_s", 0.05, raising=False)
    tokens = [frame(DATA, 0, STREAM, response(final=False)) for _ in range(4)]

    async def run():
        gate = relay(max_open=4)
        gate.client_data(frame(DATA, 0, STREAM, grpc_message(b"a")))
        client = gate.client.transport
        gate.server_data(tokens[0])
        assert client.writes == 1 and bytes(client.written) == tokens[0]  # the first: at once
        for token in tokens[1:]:
            gate.server_data(token)
        assert client.writes == 1  # the others wait for coalesce_s
        await asyncio.sleep(0.1)
        assert client.writes == 2 and bytes(client.written) == b"".join(tokens)
        await asyncio.sleep(0.1)
        gate.server_data(tokens[0])  # after a quiet spell: at once
        assert client.writes == 3
        gate.server_data(tokens[1])
        gate.close()  # the server's connection ended: what waits goes before the close
        assert client.writes == 4 and bytes(client.written) == b"".join(tokens) + tokens[0] + tokens[1]

    asyncio.run(run())


def _server_frames(gate: stream_gate.Relay) -> list[tuple[int, int, int, bytes]]:
    frames = gate.server.transport.frames()
    gate.server.transport.written.clear()
    return frames


def _stall(gate: stream_gate.Relay) -> None:
    """The server fills the stream's window toward the client, which reads nothing."""
    gate.server_data(frame(DATA, 0, STREAM, b"\0" * 40000))
    gate.server_data(frame(DATA, 0, STREAM, b"\0" * (stream_gate.DEFAULT_WINDOW - 40000)))


def test_an_abandoned_stalled_stream_with_open_requests_is_drained_not_reset():
    """The client resets a stream with two requests open and its window used up: tritonserver
    gets END_STREAM and an open window (no RST_STREAM, which would leave its queued responses
    behind for good); the stream's remaining responses are read and credited back, never passed
    to the client."""
    gate = relay(max_open=4)
    gate.client_data(frame(DATA, 0, STREAM, grpc_message(b"a") + grpc_message(b"b")))
    _stall(gate)
    _server_frames(gate)
    gate.client_data(frame(RST_STREAM, 0, STREAM, struct.pack(">I", 8)))
    sent = _server_frames(gate)
    assert not [f for f in sent if f[0] == RST_STREAM]
    assert (DATA, END_STREAM, STREAM, b"") in sent
    opened = {f[2] for f in sent if f[0] == WINDOW_UPDATE}
    assert opened == {0, STREAM}
    gate.client.transport.written.clear()
    body = response(final=False) + response(final=True)
    gate.server_data(frame(DATA, 0, STREAM, body))
    credits = [(f[2], struct.unpack(">I", f[3])[0]) for f in _server_frames(gate) if f[0] == WINDOW_UPDATE]
    assert sorted(credits) == [(0, len(body)), (STREAM, len(body))]
    gate.server_data(frame(HEADERS, END_STREAM | 0x4, STREAM, hpack.Encoder().encode([("grpc-status", "0")])))
    assert not gate.client.transport.written and STREAM not in gate.streams


def _request_to(model: str) -> bytes:
    return grpc_message(service_pb2.ModelInferRequest(model_name=model, id="r").SerializeToString())


def test_a_reading_clients_reset_reaches_a_cancellable_model_as_a_cancellation():
    """A client that read its responses (its window open) cancels a stream to a model that stops
    cancelled requests: the reset passes, so the model sees its requests cancelled."""
    gate = relay(max_open=4, cancellable=("generate",))
    request = _request_to("generate")
    gate.client_data(frame(DATA, 0, STREAM, request[:9]) + frame(DATA, 0, STREAM, request[9:]))  # name split
    gate.server_data(frame(DATA, 0, STREAM, b"\0" * 40000))
    gate.client_data(frame(stream_gate.WINDOW_UPDATE, 0, STREAM, struct.pack(">I", 40000)))
    gate.client_data(frame(stream_gate.WINDOW_UPDATE, 0, 0, struct.pack(">I", 40000)))
    _server_frames(gate)
    gate.client_data(frame(RST_STREAM, 0, STREAM, struct.pack(">I", 8)))
    sent = _server_frames(gate)
    assert [f[0] for f in sent] == [RST_STREAM] and STREAM not in gate.streams


def test_a_reset_stream_to_a_model_that_ignores_cancellation_is_drained_even_while_read():
    gate = relay(max_open=4, cancellable=("generate",))
    gate.client_data(frame(DATA, 0, STREAM, _request_to("sampler")))
    _server_frames(gate)
    gate.client_data(frame(RST_STREAM, 0, STREAM, struct.pack(">I", 8)))
    sent = _server_frames(gate)
    assert not [f for f in sent if f[0] == RST_STREAM] and (DATA, END_STREAM, STREAM, b"") in sent


def test_a_lost_client_connection_drains_its_open_streams_then_closes():
    gate = relay(max_open=4)
    gate.client_data(frame(DATA, 0, STREAM, grpc_message(b"a")))
    _stall(gate)
    _server_frames(gate)
    closed = []
    gate.server.transport.close = lambda: closed.append(True)
    gate.client.transport.close = lambda: None

    async def lose():
        gate.client_lost()

    asyncio.run(lose())
    sent = _server_frames(gate)
    assert (DATA, END_STREAM, STREAM, b"") in sent and not closed
    gate.server_data(frame(HEADERS, END_STREAM | 0x4, STREAM, hpack.Encoder().encode([("grpc-status", "0")])))
    assert closed and gate.closed


def test_a_lost_client_connection_without_open_streams_closes_the_server_connection_at_once():
    """tritonserver's gRPC shutdown waits for every connection: one the proxy closed must not linger."""
    gate = relay(max_open=4)
    gate.client_data(frame(DATA, END_STREAM, STREAM, grpc_message(b"a")))
    gate.server_data(frame(DATA, 0, STREAM, response(final=True)))
    gate.server_data(frame(HEADERS, END_STREAM | 0x4, STREAM, hpack.Encoder().encode([("grpc-status", "0")])))
    closed = []
    gate.server.transport.close = lambda: closed.append(True)

    async def lose():
        gate.client_lost()

    asyncio.run(lose())
    assert closed and gate.closed and not gate.gate.relays


def _connected(gate: stream_gate.StreamGate) -> stream_gate.Relay:
    """A relay of `gate` (a proxy connection) with stream 1 opened."""
    relay = stream_gate.Relay(gate)
    relay.client.transport, relay.server.transport = Transport(), Transport()
    relay.client_data(stream_gate.PREFACE + frame(HEADERS, 0x4, STREAM, b"\x83"))
    relay.server.transport.written.clear()
    return relay


def _answers(relay: stream_gate.Relay) -> list[tuple[int, dict]]:
    """The header blocks the relay sent the client: (flags, headers)."""
    decoder = hpack.Decoder()
    return [(f[1], dict(decoder.decode(f[3]))) for f in relay.client.transport.frames() if f[0] == HEADERS]


def _refused_with(relay: stream_gate.Relay, message: str) -> bool:
    """The client read a trailers-only UNAVAILABLE with `message`, and no reset; the server a reset."""
    refusal = (END_STREAM | 0x4, {":status": "200", "content-type": "application/grpc", "grpc-status": "14"})
    (flags, headers), *_ = _answers(relay) or [(0, {})]
    return (
        (flags, {k: headers.get(k) for k in refusal[1]}) == refusal
        and headers["grpc-message"] == message
        and RST_STREAM not in {f[0] for f in relay.client.transport.frames()}
        and (RST_STREAM, STREAM) in {(f[0], f[2]) for f in relay.server.transport.frames()}
    )


def test_streams_past_the_slots_wait_in_arrival_order_and_past_the_queue_are_refused_unavailable():
    """One slot, two places in the queue: the first stream's request goes to the server, the next
    two wait (nothing of theirs reaches it) and go on in arrival order as slots free, the fourth
    is refused at once with the proxy's queue-full message."""

    async def run():
        gate = stream_gate.StreamGate("127.0.0.1:1", 4, 2**31 - 1, max_streams=1, max_queue=2, queue_timeout_s=60)
        relays = [_connected(gate) for _ in range(4)]
        for relay in relays:
            relay.client_data(frame(DATA, 0, STREAM, grpc_message(b"x" * 30)))
        assert [len(forwarded(relay)[0]) for relay in relays] == [35, 0, 0, 0]
        assert _refused_with(relays[3], stream_gate.QUEUE_FULL)
        assert gate.counters() == {"queue_full": 1, "queue_timeout": 0, "waiting": 2, "running": 1}
        trailers = frame(HEADERS, END_STREAM | 0x4, STREAM, hpack.Encoder().encode([("grpc-status", "0")]))
        relays[0].server_data(trailers)
        assert [len(forwarded(relay)[0]) for relay in relays[1:3]] == [35, 0]
        # the client leaves with its request open: the stream is drained, and holds its slot until the server ends it
        relays[1].client_data(frame(RST_STREAM, 0, STREAM, struct.pack(">I", 8)))
        assert len(forwarded(relays[2])[0]) == 0
        relays[1].server_data(trailers)
        assert len(forwarded(relays[2])[0]) == 35
        relays[2].close()
        assert gate.counters() == {"queue_full": 1, "queue_timeout": 0, "waiting": 0, "running": 0}

    asyncio.run(run())


def test_a_stream_that_waits_out_the_queue_timeout_is_refused_unavailable_once_no_header_block_is_open():
    async def run():
        gate = stream_gate.StreamGate("127.0.0.1:1", 4, 2**31 - 1, max_streams=1, max_queue=1, queue_timeout_s=0)
        first, second = _connected(gate), _connected(gate)
        first.client_data(frame(DATA, 0, STREAM, grpc_message(b"x" * 30)))
        second.client_data(frame(DATA, 0, STREAM, grpc_message(b"y" * 30)))
        second.client_data(frame(HEADERS, 0, 3, b"\x83"))  # the proxy begins another stream's header block
        await asyncio.sleep(0.01)
        assert not _answers(second) and RST_STREAM not in {f[0] for f in second.server.transport.frames()}
        second.client_data(frame(stream_gate.CONTINUATION, 0x4, 3, b"\x86"))
        assert _refused_with(second, stream_gate.QUEUE_TIMEOUT) and not forwarded(second)[0]
        credited = [f for f in second.client.transport.frames() if f[0] == WINDOW_UPDATE and f[2] == 0]
        assert sum(int.from_bytes(f[3], "big") for f in credited) == 35  # its held request, never read
        assert gate.counters() == {"queue_full": 0, "queue_timeout": 1, "waiting": 0, "running": 1}

    asyncio.run(run())


def test_the_counters_are_served_on_their_unix_socket(tmp_path):
    from triton_sampling_mask.ops import proxy_metrics
    from triton_sampling_mask.ops.server_process import free_port

    async def run():
        gate = stream_gate.StreamGate("127.0.0.1:1", 4, 2**31 - 1, max_streams=2, max_queue=3)
        gate.refusals["queue_timeout"] = 5
        stop = asyncio.Event()
        serving = asyncio.ensure_future(gate.serve(f"127.0.0.1:{free_port()}", stop, str(tmp_path / "gate.sock")))
        while not (tmp_path / "gate.sock").exists():
            await asyncio.sleep(0.01)
        read = await asyncio.to_thread(proxy_metrics.gate_counters, tmp_path / "gate.sock")
        assert stat.S_IMODE((tmp_path / "gate.sock").stat().st_mode) == 0o600
        stop.set()
        await serving
        return read

    assert asyncio.run(run()) == {"queue_full": 0, "queue_timeout": 5, "waiting": 0, "running": 0}


def _windows_granted(gate: stream_gate.Relay, windows: dict[int, int]) -> None:
    """Add the WINDOW_UPDATEs the server has been sent to `windows` (stream: what it may send)."""
    for kind, _, stream, payload in _server_frames(gate):
        if kind == WINDOW_UPDATE:
            windows[stream] += struct.unpack(">I", payload)[0]


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 20000), min_size=1, max_size=60),
    lazy=st.booleans(),
)
def test_the_server_never_has_more_window_than_the_client_granted_and_always_over_half(tokens, lazy):
    """Each of the server's DATA frames is credited by the client (at once, as the proxy does, or
    only once its window is under half, as a lazy client does): the window the server has been
    given stays within what the client granted, and above half of it."""
    gate = relay(max_open=64)
    _server_frames(gate)
    granted = {0: stream_gate.DEFAULT_WINDOW, STREAM: stream_gate.DEFAULT_WINDOW}  # the client's
    server = dict(granted)  # what the server was given
    for size in tokens:
        size = min(size, server[0], server[STREAM])  # the server keeps to its windows
        if size:
            gate.server_data(frame(DATA, 0, STREAM, b"\0" * size))
            for stream in (0, STREAM):
                granted[stream] -= size
                server[stream] -= size
        for stream in (0, STREAM):
            used = stream_gate.DEFAULT_WINDOW - granted[stream]
            if used and (not lazy or 2 * granted[stream] < stream_gate.DEFAULT_WINDOW):
                gate.client_data(frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", used)))
                granted[stream] += used
        _windows_granted(gate, server)
        for stream in (0, STREAM):
            assert granted[stream] / 2 <= server[stream] <= granted[stream]


def test_a_proxy_crediting_every_streamed_token_costs_the_server_few_window_updates():
    """The proxy answers each DATA frame with WINDOW_UPDATEs for the connection and the stream;
    the server gets one per half window, not one per token."""
    gate = relay(max_open=64)
    _server_frames(gate)
    updates = 0
    for _ in range(200):
        gate.server_data(frame(DATA, 0, STREAM, response(final=False)))
        gate.client_data(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", len(response(final=False)))))
        gate.client_data(frame(WINDOW_UPDATE, 0, STREAM, struct.pack(">I", len(response(final=False)))))
        updates += sum(1 for f in _server_frames(gate) if f[0] == WINDOW_UPDATE)
    size = 200 * len(response(final=False))
    assert updates <= 2 * (2 * size // stream_gate.DEFAULT_WINDOW + 1)


@settings(max_examples=60, deadline=None)
@given(
    finals=st.lists(st.booleans(), min_size=1, max_size=10),
    padding=st.lists(st.integers(0, 3000), min_size=1, max_size=10),
    cuts=st.lists(st.integers(1, 4000), min_size=1, max_size=10),
)
def test_a_final_response_ends_its_request_once_its_last_byte_has_passed_however_the_frames_cut_it(
    finals, padding, cuts
):
    """Responses (final or not, of any size) cut into DATA frames anywhere: a request counts as
    open until its final response has passed whole (the reference counts the final responses whose
    last byte has been sent)."""
    requests = len(finals)
    gate = relay(max_open=requests)
    gate.client_data(frame(DATA, 0, STREAM, b"".join(grpc_message(bytes([i])) for i in range(requests))))
    bodies = []
    for i, final in enumerate(finals):
        message = service_pb2.ModelStreamInferResponse()
        message.infer_response.id = "r" * padding[i % len(padding)]
        message.infer_response.parameters["triton_final_response"].bool_param = final
        bodies.append(grpc_message(message.SerializeToString()))
    sent = b"".join(bodies)
    ends = [sum(len(b) for b in bodies[: i + 1]) for i in range(len(bodies))]
    pos, k = 0, 0
    while pos < len(sent):
        piece = sent[pos : pos + cuts[k % len(cuts)]]
        k += 1
        pos += len(piece)
        gate.server_data(frame(DATA, 0, STREAM, piece))
        done = sum(1 for end, final in zip(ends, finals) if final and end <= pos)
        assert gate.streams[STREAM].open == requests - done


def _settings_frame(initial_window: int) -> bytes:
    return frame(
        stream_gate.SETTINGS, 0, 0, struct.pack(">HI", stream_gate.SETTINGS_INITIAL_WINDOW_SIZE, initial_window)
    )


# HAProxy's window, crediting every frame; small windows credited late; the window made smaller
# while the gate keeps credit (the server's would then be shut).
@example(1048576, "every frame", 3 * 1048576, 16384, 3 * 1048576, 4096)
@example(16384, "when spent", 1048576, 16384, 1048576, 4096)
@example(stream_gate.DEFAULT_WINDOW, "under half", 1048576, 1000, 1048576, 4096)
@example(stream_gate.DEFAULT_WINDOW, "every frame", 200000, 1000, 5000, 4096)
@settings(max_examples=80, deadline=None)
@given(
    initial_window=st.sampled_from([16384, stream_gate.DEFAULT_WINDOW, 1048576]),
    policy=st.sampled_from(["every frame", "under half", "when spent"]),
    size=st.one_of(st.integers(1, 70000), st.integers(70000, 3 * 1048576)),
    frame_bytes=st.sampled_from([1000, 16384]),
    resize_after=st.integers(0, 3 * 1048576),
    resized=st.integers(4096, 2 * 1048576),
)
def test_a_response_many_windows_long_completes_whatever_the_client_credits_and_when(
    initial_window, policy, size, frame_bytes, resize_after, resized
):
    """A final response of up to 3 MiB on one stream, the server sending whenever its windows allow
    (RFC 9113: what the WINDOW_UPDATEs and SETTINGS it was sent add up to) and the client crediting
    what it read after every frame (as HAProxy does), once its window is under half, or once it is
    spent; once, mid-stream, the client changes its streams' initial window (up or down). Each side
    keeps its own account of the windows: the server never sends past what the client allows, and
    the response always arrives whole (a stall: the server's windows shut while the client waits)."""
    message = service_pb2.ModelStreamInferResponse()
    message.infer_response.parameters["triton_final_response"].bool_param = True
    message.infer_response.raw_output_contents.append(b"\0" * size)
    body = grpc_message(message.SerializeToString())
    gate = stream_gate.StreamGate("127.0.0.1:1", 64, 2**31 - 1, ())
    relay = stream_gate.Relay(gate)
    relay.client.transport, relay.server.transport = Transport(), Transport()
    relay.client_data(stream_gate.PREFACE + _settings_frame(initial_window) + frame(HEADERS, 0x4, STREAM, b"\x83"))
    del relay.server.transport.written[: len(stream_gate.PREFACE)]
    relay.client_data(frame(DATA, 0, STREAM, grpc_message(b"\x01")))
    assert relay.streams[STREAM].open == 1
    # Each side's own account: the client's receive windows, the server's send windows.
    client = {"window": {0: stream_gate.DEFAULT_WINDOW, STREAM: initial_window}, "initial": initial_window}
    server = {0: stream_gate.DEFAULT_WINDOW, STREAM: stream_gate.DEFAULT_WINDOW}
    sent = received = 0
    resize_pending = True

    def server_reads() -> None:
        for kind, _, stream, payload in _server_frames(relay):
            if kind == WINDOW_UPDATE:
                server[stream] += struct.unpack(">I", payload)[0]
            elif kind == stream_gate.SETTINGS and payload:
                for pos in range(0, len(payload), 6):
                    key, value = struct.unpack_from(">HI", payload, pos)
                    if key == stream_gate.SETTINGS_INITIAL_WINDOW_SIZE:
                        server[STREAM] += value - server.setdefault("initial", stream_gate.DEFAULT_WINDOW)
                        server["initial"] = value

    def client_credits(stream: int) -> None:
        full = client["initial"] if stream else stream_gate.DEFAULT_WINDOW
        window = client["window"][stream]
        due = {"every frame": window < full, "under half": 2 * window < full, "when spent": window <= 0}[policy]
        if due and full > window:
            relay.client_data(frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", full - window)))
            client["window"][stream] = full

    server_reads()
    while sent < len(body):  # every pass sends a frame, or fails
        if resize_pending and sent >= resize_after:
            resize_pending = False
            relay.client_data(_settings_frame(resized))
            client["window"][STREAM] += resized - client["initial"]
            client["initial"] = resized
            client_credits(STREAM)
            server_reads()
        chunk = min(frame_bytes, len(body) - sent, server[0], server[STREAM])
        assert chunk > 0, f"stalled at {sent} of {len(body)} bytes: the server's windows {server}"
        relay.server_data(frame(DATA, 0, STREAM, body[sent : sent + chunk]))
        sent += chunk
        server[0] -= chunk
        server[STREAM] -= chunk
        for kind, _, _, payload in relay.client.transport.frames():
            if kind == DATA:
                assert len(payload) <= min(client["window"][0], client["window"][STREAM])
                received += len(payload)
                client["window"][0] -= len(payload)
                client["window"][STREAM] -= len(payload)
        relay.client.transport.written.clear()
        for stream in (0, STREAM):
            client_credits(stream)
        server_reads()
    assert received == sent == len(body)
    assert relay.streams[STREAM].open == 0
