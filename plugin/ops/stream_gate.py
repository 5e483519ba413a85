"""The stream gate: gRPC ModelStreamInfer between the proxy and tritonserver, with a bound on the
requests each stream has open, and the route's queue of streams.

Why by hand: Triton 2.51 reads a stream's requests on and queues their responses without bound,
HAProxy cannot count gRPC messages, and its own queue cannot answer a stream whole (HAProxy issue
#1219); a relay of gRPC calls (grpc.aio, the gate's first form) spent far more CPU per streamed
token. So this relays HTTP/2 frames: a stream's next request goes on only while fewer than
`max_open` of its requests wait for their final response; a message over `max_message_bytes` is
refused (RESOURCE_EXHAUSTED); at most `max_streams` streams reach the server, `max_queue` more
wait up to `queue_timeout_s` (then UNAVAILABLE); the refusals are served as JSON on
`--counters-socket` (ops.proxy_metrics). How, frame by frame: docs/stream-gate.md.

    python -m triton_sampling_mask.ops.stream_gate --listen 127.0.0.1:P --upstream 127.0.0.1:Q
        [--max-open N] [--max-message-bytes B] [--max-streams N --max-queue N --queue-timeout S]
        [--counters-socket PATH] [--keyed-listen 127.0.0.1:R --keyed-max-streams N ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import hpack

from .proxy import QUEUE_FULL, QUEUE_TIMEOUT

FINAL_PARAMETER = b"triton_final_response"
_FINAL_KEY = b"\x0a" + bytes([len(FINAL_PARAMETER)]) + FINAL_PARAMETER  # a parameters entry's key field
_FRAME_HEAD = struct.Struct(">BHBBI")  # an HTTP/2 frame's 9 bytes: length (24 bits), type, flags, stream
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113).
DATA, HEADERS, RST_STREAM, SETTINGS, PUSH_PROMISE, WINDOW_UPDATE, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x5, 0x8, 0x9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x4
DEFAULT_WINDOW = 65535  # RFC 9113's initial flow-control window, of a stream and of a connection
CANCEL = 0x8
# Every peer accepts frames this large (SETTINGS_MAX_FRAME_SIZE is at least this).
MAX_FRAME_BYTES = 16384
GRPC_PREFIX_BYTES = 5  # compressed flag, big-endian length
# The leading bytes of a response kept to tell whether it is final (its fields before `outputs`).
RESPONSE_HEAD_BYTES = 65536
RESOURCE_EXHAUSTED, UNAVAILABLE = "8", "14"
COMPACT_BYTES = 65536  # held bytes already forwarded are dropped once past this and half the buffer
REFUSED_MEMORY = 1024  # streams the gate ended, remembered to drop their late frames
READ_BYTES = 65536  # one socket read at most
STOP_GRACE_S = 2.0  # after SIGTERM, how long open connections may go on
MODEL_NAME_BYTES = 256  # a first request's leading bytes read for its model's name
DRAIN_LIMIT_S = 60.0  # how long an abandoned stream's remaining responses may take to be read
DRAIN_WINDOW_BYTES = 2**30  # the window opened for them (a window may not pass 2**31 - 1)
# Toward the proxy, at most one write per connection in this time: tritonserver sends each streamed
# token in a packet of its own, and a write per token costs this relay, the proxy (its read, its
# WINDOW_UPDATE back, its write) and the client a system call and a wake-up each. A write after a
# quiet spell goes at once, so a lone stream's tokens are never held.
COALESCE_S = 0.001


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def is_final(response: bytes) -> bool:
    """Whether a serialized ModelStreamInferResponse ends its request: it carries an error
    message (field 1), or its infer_response (field 2) has the parameter triton_final_response
    set to true. Reads the message's leading fields only; a malformed one counts as not final."""
    try:
        tag, pos = _varint(response, 0)
        if tag == 0x0A:  # error_message
            return True
        if tag != 0x12:  # not infer_response
            return False
        length, pos = _varint(response, pos)
        end = min(len(response), pos + length)
        while pos < end:
            tag, pos = _varint(response, pos)
            field, wire = tag >> 3, tag & 7
            if wire != 2:  # model_name, model_version, id and parameters are all length-delimited
                return False
            size, pos = _varint(response, pos)
            if field == 4:  # one parameters map entry: key (1), InferParameter value (2)
                if response[pos : pos + len(_FINAL_KEY)] == _FINAL_KEY:
                    return response[pos + len(_FINAL_KEY) : pos + size] == b"\x12\x02\x08\x01"  # bool_param: true
            elif field > 4:  # past the parameters
                return False
            pos += size
    except (IndexError, ValueError):
        pass
    return False


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def window_update(stream: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame (nothing when there is nothing to credit)."""
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment)) if increment > 0 else b""


def _data_frames(stream: int, data: bytes, end: bool) -> list[bytes]:
    """`data` as DATA frames no larger than every peer accepts, END_STREAM on the last if `end`."""
    chunks = [data[i : i + MAX_FRAME_BYTES] for i in range(0, len(data), MAX_FRAME_BYTES)] or [b""]
    if not data and not end:
        return []
    return [frame(DATA, END_STREAM if end and i == len(chunks) - 1 else 0, stream, c) for i, c in enumerate(chunks)]


def _unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (and HEADERS' priority fields)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        start, end = 1, len(payload) - payload[0]
    return payload[start:end]


def _read_model(stream: _Stream, data: bytes) -> None:
    """Collect the first request's leading bytes until its model_name (ModelInferRequest field 1,
    its first field as tritonclient and grpc write it) is read; b"" when it does not come first."""
    stream.first += data[: MODEL_NAME_BYTES - len(stream.first)]
    first = bytes(stream.first)
    try:
        if first[0] != 0x0A:
            stream.model = b""
            return
        length, pos = _varint(first, 1)
    except (IndexError, ValueError):
        if len(first) >= MODEL_NAME_BYTES:
            stream.model = b""
        return
    if pos + length <= len(first):
        stream.model = first[pos : pos + length]
    elif len(first) >= MODEL_NAME_BYTES:
        stream.model = b""


@dataclass(eq=False, slots=True)
class _Stream:
    """What the gate tracks of one stream: its open requests and the message it is reading in
    each direction, the request bytes it holds back, whether the server has answered."""

    open: int = 0
    request_head: bytes = b""  # a request's 5-byte prefix, while it is incomplete
    request_left: int = 0  # bytes of the current request still to pass
    # request bytes from the client; those before held_from are forwarded
    held: bytearray = field(default_factory=bytearray)
    held_from: int = 0
    held_end: bool = False  # the client's END_STREAM came after the held bytes
    response_head: bytes = b""
    response_left: int = 0
    response_bytes: bytearray = field(default_factory=bytearray)  # the current response's leading bytes
    answered: bool = False  # the server has sent its response headers
    sent_end: bool = False  # END_STREAM has gone to the server
    draining: bool = False  # the client left: the server's responses are read and dropped
    window: int = DEFAULT_WINDOW  # what the server may still send on it toward the client
    model: bytes | None = None  # the model its first request names, once read
    first: bytearray = field(default_factory=bytearray)  # that request's leading bytes, until the name is read
    admitted: bool | None = None  # holds one of the server's slots (False: waits for one)
    expired: bool = False  # it waited out the queue timeout
    credit: int = 0  # window the client granted on it, not yet passed to the server

    @property
    def waiting(self) -> int:
        """Request bytes held back (from the first byte of a request past the bound)."""
        return len(self.held) - self.held_from


class _Half(asyncio.BufferedProtocol):
    """One socket of a relayed connection: what it reads goes to the relay, and while its peer's
    socket cannot take more, it stops reading. It reads into a buffer of its own, reused: a
    fresh 256 KiB bytes object per read (asyncio's plain protocols) costs an mmap, an mremap, a
    munmap and page faults per streamed token."""

    def __init__(self, relay: Relay, from_client: bool):
        self.relay, self.from_client = relay, from_client
        self.transport: asyncio.Transport | None = None
        self.view = memoryview(bytearray(READ_BYTES))

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.relay.connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        if self.from_client:
            self.relay.client_data(self.view[:nbytes])
        else:
            self.relay.server_data(self.view[:nbytes])

    def connection_lost(self, exc) -> None:
        if self.from_client:
            self.relay.client_lost()
        else:
            self.relay.close()

    def pause_writing(self) -> None:
        self.relay.peer(self).pause_reading()

    def resume_writing(self) -> None:
        self.relay.peer(self).resume_reading()


class Relay:
    """One connection from the proxy and its connection to tritonserver."""

    def __init__(self, gate: StreamGate):
        self.gate = gate
        self.client = _Half(self, from_client=True)
        self.server = _Half(self, from_client=False)
        self.streams: dict[int, _Stream] = {}
        self.refused: OrderedDict[int, None] = OrderedDict()  # streams the gate ended itself
        self.client_buffer = bytearray()
        self.server_buffer = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder()
        self.encoder = hpack.Encoder()
        self.encoder.header_table_size = 0  # no dynamic table toward the proxy: headers may be dropped or added
        self.block: list = []  # the server's header block being read: [stream, flags, fragments]
        self.to_client: list[bytes] = []
        self.to_server: list[bytes] = []
        self.client_timer: asyncio.TimerHandle | None = None  # a write toward the client, due
        self.client_written = float("-inf")  # when the last one went (time.monotonic, the loop's clock)
        self.closed = False
        self.connecting: asyncio.Future | None = None
        # A header block the proxy has begun and not ended: no frame may be sent to the server
        # before its CONTINUATION, so releases wait (the streams they would release, in order).
        self.client_block_open = False
        self.pending: dict[int, None] = {}
        self.client_gone = False
        # The flow-control windows the client (the proxy) grants the server: per stream on _Stream.
        self.client_initial_window = DEFAULT_WINDOW
        self.client_window = DEFAULT_WINDOW
        self.credit = 0  # connection window the client granted, not yet passed to the server (_credit)
        self.window_opened = False  # the connection's window opened for draining streams
        gate.relays.add(self)

    # ---- plumbing ----

    def connected(self, half: _Half) -> None:
        if half is self.client:
            half.transport.pause_reading()  # until the server side is connected (a first read may come)
            self.connecting = asyncio.ensure_future(self._connect_upstream())
        elif self.closed:  # the client left while this connection was made
            half.transport.close()
        else:
            self.client.transport.resume_reading()
            self.client_data(b"")  # what arrived before

    async def _connect_upstream(self) -> None:
        host, port = self.gate.upstream.rsplit(":", 1)
        try:
            await asyncio.get_running_loop().create_connection(lambda: self.server, host, int(port))
        except OSError:
            self.close()

    def peer(self, half: _Half) -> asyncio.Transport:
        return (self.server if half is self.client else self.client).transport

    def _flush(self) -> None:
        """Send what is queued: toward the server at once; toward the client at once when nothing
        went to it in the last COALESCE_S, else with what else comes by then, in one write."""
        if self.closed:
            return
        if self.client_gone:
            self.to_client.clear()
        if self.to_server and self.server.transport is not None:
            self.server.transport.write(b"".join(self.to_server))
        self.to_server.clear()
        if self.to_client and self.client_timer is None:
            due = self.client_written + self.gate.coalesce_s
            if time.monotonic() >= due:
                self._flush_client()
            else:
                self.client_timer = asyncio.get_running_loop().call_at(due, self._flush_client)

    def _flush_client(self) -> None:
        self.client_timer = None
        if self.to_client and not self.closed and not self.client_gone:
            self.client.transport.write(b"".join(self.to_client))
            self.client_written = time.monotonic()
        self.to_client.clear()

    def close(self) -> None:
        if not self.closed:
            if self.client_timer is not None:  # what waits for the client goes before the close
                self.client_timer.cancel()
                self._flush_client()
            self.closed = True
            self.gate.relays.discard(self)
            streams, self.streams = self.streams, {}
            for stream_id, stream in streams.items():
                self.gate.release(self, stream_id, stream)
            for half in (self.client, self.server):
                if half.transport is not None:
                    half.transport.close()

    def client_lost(self) -> None:
        """The proxy's connection ended: its streams with open requests are drained, the
        others reset; the server connection closes once none is left (or after DRAIN_LIMIT_S)."""
        self.to_client.clear()  # nothing more can reach it
        if self.closed or self.server.transport is None:
            self.close()
            return
        self.client_gone = True
        for stream_id, stream in list(self.streams.items()):
            if not self._drain(stream_id, stream):
                self.to_server.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", CANCEL)))
                self._forget(stream_id)
        if not self.streams:  # none to drain: close now (tritonserver's gRPC shutdown waits for the connection)
            self.close()
        if self.closed:
            return
        self.server.transport.resume_reading()  # it may have been paused for the client's sake
        self._flush()
        asyncio.get_running_loop().call_later(DRAIN_LIMIT_S, self.close)

    def _stalled(self, stream: _Stream) -> bool:
        """Whether the stream's responses wait on its client: its window, or the connection's,
        below half of what the client grants a stream (a reading client keeps them near full)."""
        return min(stream.window, self.client_window) < self.client_initial_window // 2

    def _drain(self, stream_id: int, stream: _Stream) -> bool:
        """Whether the stream is drained instead of reset: it has open requests and none of them
        is half forwarded. Its requests are ended, held bytes dropped and its window opened."""
        if stream.draining:
            return True
        if not stream.open or stream.request_left or stream.request_head:
            return False
        if stream.model in self.gate.cancellable and not self._stalled(stream):
            return False
        stream.draining = True
        self.to_client.append(window_update(0, stream.waiting))
        stream.held, stream.held_from = bytearray(), 0
        if not stream.sent_end:
            self.to_server.append(frame(DATA, END_STREAM, stream_id))
            stream.sent_end = True
        if not self.window_opened:
            self.to_server.append(window_update(0, DRAIN_WINDOW_BYTES))
            self.window_opened = True
        self.to_server.append(window_update(stream_id, DRAIN_WINDOW_BYTES))
        return True

    @staticmethod
    def _frames(buffer: bytearray, data=b""):
        """The complete frames of `buffer` followed by `data` (the incomplete rest is kept in
        `buffer`): (type, flags, stream, payload, raw bytes), the last two views of one copy of
        the bytes (a read's buffer is reused by the next read)."""
        if buffer:
            buffer += data
            data = bytes(buffer)
            buffer.clear()
        else:
            data = bytes(data)
        view, pos, size = memoryview(data), 0, len(data)
        while size - pos >= 9:
            high, low, kind, flags, stream = _FRAME_HEAD.unpack_from(data, pos)
            end = pos + 9 + (high << 16 | low)
            if end > size:
                break
            yield kind, flags, stream & 0x7FFFFFFF, view[pos + 9 : end], view[pos:end]
            pos = end
        buffer += view[pos:]

    # ---- client (proxy) to server ----

    def client_data(self, data: bytes) -> None:
        buffer = self.client_buffer
        if not self.preface_seen or self.server.transport is None:
            buffer += data
            data = b""
            if self.server.transport is None:  # read before the server side is connected
                return
            if len(buffer) < len(PREFACE):
                return
            self.to_server.append(bytes(buffer[: len(PREFACE)]))
            del buffer[: len(PREFACE)]
            self.preface_seen = True
        for kind, flags, stream_id, payload, raw in self._frames(buffer, data):
            if kind == DATA:
                self._client_data_frame(stream_id, flags, payload, raw)
                continue
            stream = self.streams.get(stream_id)
            if kind in (HEADERS, CONTINUATION):
                self.client_block_open = not flags & END_HEADERS
            if kind == HEADERS:
                if stream is None and stream_id not in self.refused:
                    stream = self.streams[stream_id] = _Stream()
                    stream.window = self.client_initial_window
                elif stream is not None and stream.waiting:
                    self._release(stream_id, stream, force=True)  # trailers end the requests: no bound left
            elif kind == RST_STREAM:
                if stream_id in self.refused or (stream is not None and self._drain(stream_id, stream)):
                    continue
                self._forget(stream_id)
            elif kind == SETTINGS and not flags & 1:
                self._read_settings(payload)
            elif kind == WINDOW_UPDATE and len(payload) == 4 and (stream_id == 0 or stream is not None):
                increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if increment:  # kept, and passed on once it matters (a zero increment is the server's to refuse)
                    self._credit(stream_id, stream, increment)
                    continue
            self.to_server.append(raw)
            if self.pending and not self.client_block_open:
                self._release_pending()
        self._flush()

    def resume(self, stream_id: int, stream: _Stream) -> None:
        """A waiting stream has its slot, or has waited out the queue timeout: its held requests go
        on, or it is refused (once no header block is half sent to the server)."""
        if self.client_block_open:
            self.pending[stream_id] = None
        else:
            self._release(stream_id, stream)
            self._flush()

    def _release_pending(self) -> None:
        pending, self.pending = self.pending, {}
        for stream_id in pending:
            stream = self.streams.get(stream_id)
            if stream is not None and (stream.waiting or stream.expired):
                self._release(stream_id, stream)

    def _client_data_frame(self, stream_id: int, flags: int, payload: bytes, raw: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id in self.refused:  # the server never sees it: credit the client's window
                self.to_client.append(window_update(0, len(payload)))
            else:
                self.to_server.append(raw)  # not a stream the gate knows: the server answers it
            return
        data = _unpad(flags, payload)
        if len(data) != len(payload):  # padding never reaches the server: credit it here
            self.to_client += [
                window_update(0, len(payload) - len(data)),
                window_update(stream_id, len(payload) - len(data)),
            ]
        waiting = stream.waiting
        stream.held += data
        stream.held_end = stream.held_end or bool(flags & END_STREAM)
        if not waiting:  # else these bytes wait behind the held ones, for a final response
            self._release(stream_id, stream)

    def _release(self, stream_id: int, stream: _Stream, force: bool = False) -> None:
        """Forward the stream's held request bytes up to the first request past its bound (all
        of them when `force`), END_STREAM after the last; refuse the stream at an oversized request."""
        data, start = stream.held, stream.held_from
        pos = self._admit(stream_id, stream, data, start, force)
        if pos is None:
            return
        end = stream.held_end and pos == len(data)
        self.to_server += _data_frames(stream_id, bytes(data[start:pos]), end)
        stream.sent_end = stream.sent_end or end
        if pos == len(data):
            stream.held, stream.held_from, stream.held_end = bytearray(), 0, False
        elif pos > COMPACT_BYTES and 2 * pos > len(data):  # forwarded bytes go, in a copy of O(what waits)
            del data[:pos]
            stream.held_from = 0
        else:
            stream.held_from = pos

    def _admit(self, stream_id: int, stream: _Stream, data: bytearray, pos: int, force: bool) -> int | None:
        """Where the stream's request bytes `data[pos:]` must stop: at the first request past the
        bound (none when `force`), at `pos` while the stream waits for a slot, or their end; None
        after refusing the stream (an oversized request, or no slot: the queue full or waited out)."""
        if stream.admitted is None:  # its first bytes: a slot at the server, a place in the queue, or neither
            stream.admitted = self.gate.enter(self, stream_id)
        if stream.admitted is None or stream.expired:
            self._refuse(stream_id, stream, QUEUE_TIMEOUT if stream.expired else QUEUE_FULL, UNAVAILABLE)
            return None
        if not stream.admitted:
            return pos
        size, limit = len(data), self.gate.max_message_bytes
        while pos < size:
            if stream.request_left:
                step = min(stream.request_left, size - pos)
                if stream.model is None:
                    _read_model(stream, data[pos : pos + step])
                stream.request_left -= step
                pos += step
                continue
            if not stream.request_head:  # a request starts here
                if stream.open >= self.gate.max_open and not force:
                    break
                stream.open += 1
            step = min(GRPC_PREFIX_BYTES - len(stream.request_head), size - pos)
            stream.request_head += data[pos : pos + step]
            pos += step
            if len(stream.request_head) == GRPC_PREFIX_BYTES:
                length = int.from_bytes(stream.request_head[1:], "big")
                stream.request_head = b""
                if length > limit:
                    message = f"request message of {length} bytes, more than {limit}"
                    self._refuse(stream_id, stream, message, RESOURCE_EXHAUSTED)
                    return None
                stream.request_left = length
        return pos

    def _refuse(self, stream_id: int, stream: _Stream, message: str, status: str) -> None:
        """End a stream with gRPC `status`: reset toward the server, trailers to the client (which
        HAProxy passes on whole: no reset follows them), the client's bytes the server will never
        read credited back."""
        self.to_client.append(window_update(0, stream.waiting))
        del self.streams[stream_id]
        self.gate.release(self, stream_id, stream)
        self.refused[stream_id] = None
        while len(self.refused) > REFUSED_MEMORY:
            self.refused.popitem(last=False)
        self.to_server.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", CANCEL)))
        headers = [] if stream.answered else [(":status", "200"), ("content-type", "application/grpc")]
        headers += [("grpc-status", status), ("grpc-message", message)]
        self._headers_to_client(stream_id, END_STREAM, headers)

    def _forget(self, stream_id: int) -> None:
        """A stream has ended: its held bytes, which the server will never read, credited back."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self.to_client.append(window_update(0, stream.waiting))
            self.gate.release(self, stream_id, stream)
        if self.client_gone and not self.streams:
            self._flush()
            self.close()

    def _credit(self, stream_id: int, stream: _Stream | None, increment: int) -> None:
        """The client's WINDOW_UPDATE of `increment` on the connection (stream 0) or a stream, kept
        and passed to the server in one update once it is half of what the client's window now
        allows: the proxy credits every DATA frame it reads, and a WINDOW_UPDATE relayed per
        streamed token costs the gate a read and a write and the server a read. The server's window
        is the client's less what is kept, so it never sends more than the client allows, and
        always has more than half of it."""
        if stream is None:
            self.client_window += increment
            self.credit += increment
            if 2 * self.credit >= self.client_window:
                self.to_server.append(window_update(0, self.credit))
                self.credit = 0
        else:
            stream.window += increment
            stream.credit += increment
            if 2 * stream.credit >= stream.window:
                self.to_server.append(window_update(stream_id, stream.credit))
                stream.credit = 0

    def _read_settings(self, payload: bytes) -> None:
        for pos in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, pos)
            if key == SETTINGS_HEADER_TABLE_SIZE:  # what the server's encoder may now use
                self.decoder.max_allowed_table_size = value
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:  # every open stream's window moves by the change
                delta, self.client_initial_window = value - self.client_initial_window, value
                for stream_id, stream in self.streams.items():
                    stream.window += delta
                    # a smaller window may leave the server none while credit is kept: pass it on
                    self._credit(stream_id, stream, 0)

    # ---- server to client (proxy) ----

    def server_data(self, data: bytes) -> None:
        for kind, flags, stream_id, payload, raw in self._frames(self.server_buffer, data):
            if self.block and kind != CONTINUATION:
                self.close()  # a header block interrupted: a protocol error
                return
            if kind == DATA:
                self._server_data_frame(stream_id, flags, payload, raw)
            elif kind in (HEADERS, CONTINUATION):
                if kind == HEADERS:
                    fragment = _unpad(flags, payload)[5 if flags & PRIORITY else 0 :]
                    self.block = [stream_id, flags, [fragment]]
                else:
                    self.block[2].append(payload)
                if flags & END_HEADERS:
                    self._server_headers(*self.block)
                    self.block = []
            elif kind == PUSH_PROMISE:
                self.close()  # gRPC clients refuse pushes
                return
            elif kind == RST_STREAM:
                if stream_id in self.refused:
                    continue
                stream = self.streams.get(stream_id)
                self._forget(stream_id)
                if stream is None or not stream.draining:
                    self.to_client.append(raw)
            else:
                self.to_client.append(raw)
        self._flush()

    def _server_data_frame(self, stream_id: int, flags: int, payload: bytes, raw: bytes) -> None:
        if stream_id in self.refused:  # the client never sees it: credit the server's window
            self.to_server.append(window_update(0, len(payload)))
            return
        stream = self.streams.get(stream_id)
        if stream is not None and stream.draining:  # read and dropped, the windows kept open
            self.to_server.append(window_update(0, len(payload)))
            if flags & END_STREAM:
                self._forget(stream_id)
            else:
                self.to_server.append(window_update(stream_id, len(payload)))
            return
        self.to_client.append(raw)
        self.client_window -= len(payload)
        if 2 * self.credit >= self.client_window and self.credit:
            self._credit(0, None, 0)
        if stream is None:
            return
        stream.window -= len(payload)
        if 2 * stream.credit >= stream.window and stream.credit:
            self._credit(stream_id, stream, 0)
        data, pos, freed = _unpad(flags, payload), 0, False
        size = len(data)
        while pos < size:
            if not stream.response_left and not stream.response_head and size - pos >= GRPC_PREFIX_BYTES:
                start = pos + GRPC_PREFIX_BYTES
                length = int.from_bytes(data[pos + 1 : start], "big")
                if size - start >= length:  # the whole response in this frame (a streamed token's): read in place
                    pos = start + length
                    if stream.open and is_final(data[start : start + min(length, RESPONSE_HEAD_BYTES)]):
                        stream.open -= 1
                        freed = True
                    continue
            if stream.response_left:
                step = min(stream.response_left, size - pos)
                room = RESPONSE_HEAD_BYTES - len(stream.response_bytes)
                if room > 0:
                    stream.response_bytes += data[pos : pos + min(step, room)]
                stream.response_left -= step
                pos += step
            else:
                step = min(GRPC_PREFIX_BYTES - len(stream.response_head), size - pos)
                stream.response_head += data[pos : pos + step]
                pos += step
                if len(stream.response_head) == GRPC_PREFIX_BYTES:
                    stream.response_left = int.from_bytes(stream.response_head[1:], "big")
                    stream.response_head = b""
                    stream.response_bytes = bytearray()
                else:
                    continue
            # a whole response has passed: a final one frees a request's place
            if not stream.response_left and stream.open and is_final(stream.response_bytes):
                stream.open -= 1
                freed = True
        if freed and stream.waiting:
            if self.client_block_open:
                self.pending[stream_id] = None
            else:
                self._release(stream_id, stream)
        if flags & END_STREAM:
            self._forget(stream_id)

    def _server_headers(self, stream_id: int, flags: int, fragments: list) -> None:
        try:
            headers = self.decoder.decode(b"".join(fragments), raw=True)
        except hpack.HPACKError:
            self.close()
            return
        if stream_id in self.refused:
            return  # decoded (the table stays in step), not passed on
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.answered = True
        if stream is None or not stream.draining:
            self._headers_to_client(stream_id, flags & END_STREAM, headers)
        if flags & END_STREAM:
            self._forget(stream_id)

    def _headers_to_client(self, stream_id: int, flags: int, headers: list) -> None:
        block = self.encoder.encode(headers)
        pieces = [block[i : i + MAX_FRAME_BYTES] for i in range(0, len(block), MAX_FRAME_BYTES)] or [b""]
        for i, piece in enumerate(pieces):
            last = END_HEADERS if i == len(pieces) - 1 else 0
            self.to_client.append(
                frame(HEADERS if i == 0 else CONTINUATION, (flags if i == 0 else 0) | last, stream_id, piece)
            )


class StreamGate:
    """Relays ModelStreamInfer calls to `upstream`, each with at most `max_open` open requests, and
    at most `max_streams` streams at once (0: no bound), `max_queue` more waiting `queue_timeout_s`."""

    coalesce_s = COALESCE_S  # the least time between two writes toward the proxy on a connection

    def __init__(
        self,
        upstream: str,
        max_open: int,
        max_message_bytes: int,
        cancellable: tuple[str, ...] = (),
        max_streams: int = 0,
        max_queue: int = 0,
        queue_timeout_s: float = 0.0,
    ):
        self.upstream = upstream
        self.max_open = max_open
        self.max_message_bytes = max_message_bytes
        self.cancellable = frozenset(name.encode() for name in cancellable)  # models a reset may cancel
        self.relays: set[Relay] = set()  # the connections open now
        self.max_streams, self.max_queue, self.queue_timeout_s = max_streams, max_queue, queue_timeout_s
        self.running = 0  # streams holding a slot
        self.queue: OrderedDict[tuple[Relay, int], asyncio.TimerHandle] = OrderedDict()  # waiting, oldest first
        self.refusals = {"queue_full": 0, "queue_timeout": 0}
        self.keyed: StreamGate | None = None  # keyed clients' gate, when it runs: its queue in the counters

    def enter(self, relay: Relay, stream_id: int) -> bool | None:
        """A stream's first request: True (it has a slot), False (it waits for one), None (the queue is full)."""
        if not self.max_streams or (self.running < self.max_streams and not self.queue):
            self.running += 1
            return True
        if len(self.queue) >= self.max_queue:
            self.refusals["queue_full"] += 1
            return None
        expire = asyncio.get_running_loop().call_later(self.queue_timeout_s, self._expire, relay, stream_id)
        self.queue[relay, stream_id] = expire
        return False

    def release(self, relay: Relay, stream_id: int, stream: _Stream) -> None:
        """A stream has ended: its slot goes to the stream that has waited longest, or its place in
        the queue is freed."""
        if stream.admitted:
            stream.admitted = False
            self.running -= 1
        elif (expire := self.queue.pop((relay, stream_id), None)) is not None:
            expire.cancel()
        while self.queue and self.running < self.max_streams:
            (waiting_relay, waiting_id), expire = self.queue.popitem(last=False)
            expire.cancel()
            if (waiting := waiting_relay.streams.get(waiting_id)) is not None:  # none on a closed relay
                self.running += 1
                waiting.admitted = True
                waiting_relay.resume(waiting_id, waiting)

    def _expire(self, relay: Relay, stream_id: int) -> None:
        if self.queue.pop((relay, stream_id), None) is not None and stream_id in relay.streams:
            self.refusals["queue_timeout"] += 1
            relay.streams[stream_id].expired = True
            relay.resume(stream_id, relay.streams[stream_id])

    def counters(self) -> dict[str, int]:
        """The streams refused for want of a slot, by reason, and those waiting or holding one now."""
        keyed = {"keyed_waiting": len(self.keyed.queue)} if self.keyed else {}
        return {**self.refusals, "waiting": len(self.queue), "running": self.running, **keyed}

    async def _answer_counters(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json.dumps(self.counters()).encode())
        writer.close()

    async def serve(self, listen: str, stop: asyncio.Event, counters_socket: str | None = None) -> None:
        """Serve on `listen` until `stop` is set (and the counters on the unix socket `counters_socket`)."""
        host, port = listen.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Relay(self).client, host, int(port))
        counters = None
        if counters_socket:
            counters = await asyncio.start_unix_server(self._answer_counters, counters_socket)
            os.chmod(counters_socket, 0o600)  # this user's only, as HAProxy's exporter socket (in a 0700 directory)
        await stop.wait()
        server.close()  # no new connections; those open get STOP_GRACE_S to finish
        if counters is not None:
            counters.close()
        deadline = loop.time() + STOP_GRACE_S
        while self.relays and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for relay in list(self.relays):
            relay.close()


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    relay = (args.upstream, args.max_open, args.max_message_bytes, tuple(args.cancellable))
    gate = StreamGate(*relay, args.max_streams, args.max_queue, args.queue_timeout)
    serving = [gate.serve(args.listen, stop, args.counters_socket)]
    if args.keyed_listen:  # the same relay, with keyed clients' queue; its refusals counted with the others
        gate.keyed = StreamGate(*relay, args.keyed_max_streams, args.keyed_max_queue, args.keyed_queue_timeout)
        gate.keyed.refusals = gate.refusals
        serving.append(gate.keyed.serve(args.keyed_listen, stop))
    await asyncio.gather(*serving)


def main(argv: list[str] | None = None) -> None:
    """Run the gate until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="host:port to serve ModelStreamInfer on")
    parser.add_argument("--upstream", required=True, help="tritonserver's gRPC host:port")
    parser.add_argument("--max-open", type=int, default=64, help="open requests per stream (default %(default)s)")
    parser.add_argument(
        "--cancellable", action="append", default=[], help="a model that stops cancelled requests (repeatable)"
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=2**31 - 1, help="largest request message (default %(default)s)"
    )
    parser.add_argument("--max-streams", type=int, default=0, help="streams at the server at once (0: no bound)")
    parser.add_argument("--max-queue", type=int, default=0, help="streams waiting for one of those (default 0)")
    parser.add_argument("--queue-timeout", type=float, default=0.0, help="seconds a stream may wait (default 0)")
    parser.add_argument("--counters-socket", help="a unix socket to serve the refusal counters on, as JSON")
    parser.add_argument("--keyed-listen", help="host:port to serve keyed clients' streams on")
    parser.add_argument("--keyed-max-streams", type=int, default=0, help="their streams at the server (0: no bound)")
    parser.add_argument("--keyed-max-queue", type=int, default=0, help="their streams waiting (default 0)")
    parser.add_argument("--keyed-queue-timeout", type=float, default=0.0, help="seconds one may wait (default 0)")
    args = parser.parse_args(argv)
    # uvloop (libuv) runs the relay's per-token reads, writes and callbacks in C: a streamed token
    # passes here, so the gate's CPU is most of the front door's.
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_main(args))


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # the front door still runs on asyncio's own loop
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    main()
