"""A stream that ends before its last token is a cut, never a short result.

tritonserver itself never ends a request without its finish reason unless it was cancelled (an
empty final) or it died (a reset connection, which the clients already raise); what ends one
cleanly is a proxy or router between them (smg relays a dead replica's stream as a clean, short
one and appends `data: [DONE]`). So the peers here are stand-ins for that in-between: an HTTP
server that closes the body after some tokens, and a gRPC stream whose last response is an empty
final. The clients must raise a replica failure for both, and a seeded stream retried on another
replica must resume where the cut one stopped.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from tritonclient.grpc import service_pb2

from triton_sampling_mask.client.generate_client import AsyncGenerateClient
from triton_sampling_mask.client.generate_transport import GenerateError, GrpcStream, HttpConnection, WireRequest
from triton_sampling_mask.client.replicas import is_replica_failure
from triton_sampling_mask.client.sampling_params import SamplingParams

TOKENS = [11, 12, 13, 14, 15]
CUT_AFTER = 2


def _event(token: int, last: bool) -> bytes:
    body = {"output_ids": [token], "output_logprobs": [-1.0], "finish_reason": "length" if last else ""}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _serve(cut: bool) -> tuple[web.AppRunner, str]:
    """An HTTP peer answering generate_stream with TOKENS, or only the first CUT_AFTER of them and
    a clean end of the body (what a proxy relaying a dead server sends)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        tokens = TOKENS[:CUT_AFTER] if cut else TOKENS
        for position, token in enumerate(tokens):
            await response.write(_event(token, not cut and position == len(tokens) - 1))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v2/models/generate/generate_stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"127.0.0.1:{port}"


def test_an_http_stream_closed_before_its_last_token_is_a_replica_failure():
    async def run():
        runner, url = await _serve(cut=True)
        connection = HttpConnection(url, "generate", 4)
        got = []
        try:
            with pytest.raises(GenerateError, match="no finish reason") as error:
                async for outputs in connection.exchange(WireRequest("0", True, {}, None), mask_width=8):
                    got.append(outputs["output_ids"].tolist())
        finally:
            await connection.close()
            await runner.cleanup()
        return got, error.value

    got, error = asyncio.run(run())
    assert got == [[t] for t in TOKENS[:CUT_AFTER]]
    assert is_replica_failure(error.status, error.message)  # another replica may answer it


def test_a_seeded_stream_cut_on_one_replica_resumes_on_the_other():
    """Through the client: the cut replica's tokens, then the rest from the whole one, each once."""

    async def run():
        cut_runner, cut_url = await _serve(cut=True)
        whole_runner, whole_url = await _serve(cut=False)
        try:
            async with AsyncGenerateClient([cut_url, whole_url], "http", mask_width=8) as client:
                # The cut replica first: fewest outstanding requests, ties taken in order.
                chunks = client.stream([[1, 2]], SamplingParams(seed=5), max_new_tokens=len(TOKENS))
                return [(c.output_ids.tolist(), c.finish_reason) async for c in chunks], client.replica_shares()
        finally:
            await cut_runner.cleanup()
            await whole_runner.cleanup()

    chunks, shares = asyncio.run(run())
    assert [ids for ids, _ in chunks] == [[t] for t in TOKENS]
    assert [reason for _, reason in chunks] == [""] * (len(TOKENS) - 1) + ["length"]
    assert list(shares.values()) == [0, 1]


def test_an_unseeded_stream_cut_after_tokens_raises_instead_of_ending_short():
    async def run():
        runner, url = await _serve(cut=True)
        got = []
        try:
            async with AsyncGenerateClient(url, "http", mask_width=8) as client:
                with pytest.raises(GenerateError, match="no finish reason"):
                    async for chunk in client.stream([[1, 2]], SamplingParams(), max_new_tokens=len(TOKENS)):
                        got.append(chunk.output_ids.tolist())
        finally:
            await runner.cleanup()
        return got

    assert asyncio.run(run()) == [[t] for t in TOKENS[:CUT_AFTER]]


class _Stub:
    """A gRPC stub whose ModelStreamInfer answers the first request with `responses`."""

    def __init__(self, responses):
        self.responses = responses

    def ModelStreamInfer(self, requests, metadata=None):  # noqa: N802 (the generated stub's name)
        responses = self.responses

        class Call:
            def cancel(self):
                pass

            def __aiter__(self):
                return self._answers()

            async def _answers(self):
                async for request in requests:
                    for response in responses:
                        response.infer_response.id = request.id
                        yield response
                    return

        return Call()


def _response(final: bool, token: int | None = None) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelStreamInferResponse()
    infer = response.infer_response
    infer.parameters["triton_final_response"].bool_param = final
    if token is not None:
        tensor = infer.outputs.add()
        tensor.name, tensor.datatype = "output_ids", "INT32"
        tensor.shape.extend([1, 1])
        infer.raw_output_contents.append(int(token).to_bytes(4, "little"))
    return response


def test_a_grpc_stream_whose_final_response_is_empty_is_a_replica_failure():
    """The generate model answers a request cancelled on the server with an empty final."""

    async def run():
        stream = GrpcStream(_Stub([_response(False, 11), _response(True)]), "generate")
        got = []
        try:
            with pytest.raises(GenerateError, match="no finish reason") as error:
                async for outputs in stream.exchange(WireRequest("7", True, {}, None)):
                    got.append(outputs["output_ids"].tolist())
        finally:
            await stream.close(cancel=True)
        return got, error.value

    got, error = asyncio.run(run())
    assert got == [[11]]
    assert is_replica_failure(error.status, error.message)
