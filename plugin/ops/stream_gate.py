"""The stream gate: gRPC ModelStreamInfer between the proxy and tritonserver, with a bound on the
requests each stream has open.

Triton 2.51 reads a stream's next request as soon as it has read one, whatever the client does
with the responses, and queues every response it cannot write without bound (its
`--grpc-max-response-pool-size` came in 2.56). A client that sends small requests asking for
large responses and never reads them pins server memory for good. HAProxy cannot count gRPC
messages, so this relay sits behind it for ModelStreamInfer only: it forwards a stream's next
request only while fewer than `max_open` of the stream's requests wait for their final response
(`triton_final_response`, or an error). A client that stops reading stops being read, and the
server holds at most `max_open` requests' responses for it. Messages larger than
`max_message_bytes` are refused (RESOURCE_EXHAUSTED), the cap HAProxy cannot apply to gRPC.

    python -m triton_sampling_mask.ops.stream_gate --listen 127.0.0.1:P --upstream 127.0.0.1:Q
        [--max-open N] [--max-message-bytes B]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import grpc

SERVICE = "inference.GRPCInferenceService"
METHOD = f"/{SERVICE}/ModelStreamInfer"
FINAL_PARAMETER = b"triton_final_response"
# Headers grpc sets itself on the upstream call.
HOP_HEADERS = {"user-agent", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout", "te", "content-type"}


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
                entry = response[pos : pos + size]
                key = b"\x0a" + bytes([len(FINAL_PARAMETER)]) + FINAL_PARAMETER
                if entry.startswith(key):
                    return entry[len(key) :] == b"\x12\x02\x08\x01"  # bool_param: true
            elif field > 4:  # past the parameters
                return False
            pos += size
    except (IndexError, ValueError):
        pass
    return False


class StreamGate:
    """Relays ModelStreamInfer calls to `upstream`, each with at most `max_open` open requests."""

    def __init__(self, upstream: str, max_open: int, max_message_bytes: int):
        self.upstream = upstream
        self.max_open = max_open
        self.max_message_bytes = max_message_bytes
        self.channel: grpc.aio.Channel | None = None

    async def relay(self, requests, context: grpc.aio.ServicerContext):
        """One client stream: requests forwarded while its open count allows, responses relayed
        as the client takes them, the final status passed on."""
        metadata = [(k, v) for k, v in context.invocation_metadata() if not k.startswith(":") and k not in HOP_HEADERS]
        call = self.channel.stream_stream(METHOD)(metadata=metadata, timeout=context.time_remaining())
        slots = asyncio.BoundedSemaphore(self.max_open)

        async def forward_requests() -> None:
            async for request in requests:
                await slots.acquire()
                await call.write(request)
            await call.done_writing()

        forwarding = asyncio.ensure_future(forward_requests())
        try:
            async for response in call:
                if is_final(response):
                    with contextlib.suppress(ValueError):  # an error and a final flag for one request
                        slots.release()
                await context.write(response)
            code = await call.code()
            if code != grpc.StatusCode.OK:
                await context.abort(code, await call.details())
        finally:
            forwarding.cancel()
            call.cancel()

    async def serve(self, listen: str, stop: asyncio.Event) -> None:
        """Serve on `listen` until `stop` is set."""
        options = [("grpc.max_receive_message_length", self.max_message_bytes), ("grpc.max_send_message_length", -1)]
        self.channel = grpc.aio.insecure_channel(
            self.upstream,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        server = grpc.aio.server(options=options)
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self.relay)}
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(listen)
        await server.start()
        await stop.wait()
        await server.stop(grace=2.0)
        await self.channel.close()


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await StreamGate(args.upstream, args.max_open, args.max_message_bytes).serve(args.listen, stop)


def main(argv: list[str] | None = None) -> None:
    """Run the gate until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="host:port to serve ModelStreamInfer on")
    parser.add_argument("--upstream", required=True, help="tritonserver's gRPC host:port")
    parser.add_argument("--max-open", type=int, default=64, help="open requests per stream (default %(default)s)")
    parser.add_argument(
        "--max-message-bytes", type=int, default=2**31 - 1, help="largest request message (default %(default)s)"
    )
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
