"""The stream gate (ops.stream_gate) in front of the session's tritonserver, as the front door runs
it between HAProxy and the server's gRPC port, here with one open request per stream and a 64 KiB
message cap: a stream's requests then run one at a time, an oversized request is refused with
RESOURCE_EXHAUSTED, and neither the refusal nor the bytes it drops harm the connection's other
streams."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest

from testbed.startup_wait import wait_until_ready
from triton_sampling_mask.client import AsyncGenerateClient, GenerateError
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.server_process import free_port

MAX_MESSAGE_BYTES = 65536
PARAMS = SamplingParams(temperature=1.0, top_k=20, return_sampling_mask=True)


def direct_grpc_url(triton_server) -> str:
    """tritonserver's own gRPC port: the gate under test sits right in front of it, as in the stack."""
    return getattr(triton_server, "server", triton_server).grpc_url


@pytest.fixture(scope="module")
def gate(triton_server):
    """A gate with --max-open 1 relaying to the session server's gRPC port; its URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "triton_sampling_mask.ops.stream_gate",
        f"--listen=127.0.0.1:{port}",
        f"--upstream={direct_grpc_url(triton_server)}",
        "--max-open=1",
        f"--max-message-bytes={MAX_MESSAGE_BYTES}",
    ]
    process = Child("stream gate", command).start()
    try:
        wait_until_ready(f"the stream gate on port {port}", lambda: listening(port), [process], poll_s=0.1)
        yield f"127.0.0.1:{port}"
    finally:
        process.stop(10)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def arrival_order(url: str, prompts: list, budget: int) -> list[int]:
    """The request index of each streamed token, in arrival order: all requests on one stream (a
    chunk may hold several tokens of its request)."""

    async def run():
        async with AsyncGenerateClient(url, mask_width=128) as client:
            async with client.stream(prompts, PARAMS, budget, ignore_eos=True) as chunks:
                return [chunk.index async for chunk in chunks for _ in chunk.output_ids]

    return asyncio.run(run())


def test_a_streams_requests_run_one_at_a_time_through_a_gate_of_one(triton_server, gate):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    direct = arrival_order(direct_grpc_url(triton_server), prompts, 24)
    gated = arrival_order(gate, prompts, 24)
    assert sorted(direct) == sorted(gated) == [i for i in range(3) for _ in range(24)]
    # Straight to the server the three run together (their tokens interleave); through the gate the
    # next one is forwarded only once the previous one has had its final response.
    assert direct != sorted(direct)
    assert gated == [0] * 24 + [1] * 24 + [2] * 24


def test_an_oversized_request_is_refused_and_its_connection_keeps_serving(gate):
    async def run():
        async with AsyncGenerateClient(gate, mask_width=128) as client:
            # Each refusal drops the rest of its message: were those bytes not credited back, the
            # connection's flow-control window (64 KiB to start) would be spent in a few rounds.
            for _ in range(20):
                with pytest.raises(GenerateError) as refused:
                    await client.generate([list(range(5, 5 + MAX_MESSAGE_BYTES // 4))], PARAMS, 1)
                assert refused.value.status == "StatusCode.RESOURCE_EXHAUSTED"
                assert f"more than {MAX_MESSAGE_BYTES}" in refused.value.message
            return await asyncio.wait_for(client.generate([[5, 6, 7]], PARAMS, 8, ignore_eos=True), 60)

    (result,) = asyncio.run(run())
    assert len(result.output_ids) == 8


def test_a_stream_many_flow_control_windows_long_arrives_whole(triton_server, gate):
    """A stream whose responses add up to several times the client's 64 KiB window (gRPC's
    bandwidth probe off, so its windows stay at the protocol's start): the gate keeps the client's
    WINDOW_UPDATEs and passes them on in batches, and every token still arrives, the same count as
    straight to tritonserver."""
    budget = 500  # two requests of it (the context is 512): over 0.5 MB of masks (128 INT32 a token)

    async def tokens(url: str) -> int:
        options = [("grpc.http2.bdp_probe", 0)]
        async with AsyncGenerateClient(url, mask_width=128, channel_options=options) as client:
            async with client.stream([[5, 6, 7], [8, 9]], PARAMS, budget, ignore_eos=True) as chunks:
                return sum([len(chunk.output_ids) async for chunk in chunks])

    async def run():
        direct = await tokens(direct_grpc_url(triton_server))
        gated = await asyncio.wait_for(tokens(gate), 120)  # a stall would hang: the bound fails it
        return direct, gated

    assert asyncio.run(run()) == (2 * budget, 2 * budget)
