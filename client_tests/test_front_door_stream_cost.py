"""What a streamed token costs the front door, counted rather than timed (the host may be loaded):
HAProxy relays each token's bytes through buffers of tune.bufsize (256 KiB); with glibc's default
thresholds every buffer it freed went back to the kernel and was faulted in again, a page fault
(and a brk) per streamed token. ops.proxy starts HAProxy with malloc thresholds that keep them.
"""

from __future__ import annotations

import asyncio

import pytest

from testbed.fronted import FrontedTritonServer
from triton_sampling_mask.client import AsyncGenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.proxy import find_haproxy

PARAMS = SamplingParams(temperature=1.0, top_k=20, return_sampling_mask=True)
STREAMS, TOKENS = 8, 48


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (/proc/<pid>/stat, field 10)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


async def stream_tokens(url: str) -> int:
    clients = [AsyncGenerateClient(url) for _ in range(STREAMS)]

    async def one(client: AsyncGenerateClient, k: int) -> int:
        count = 0
        async with client.stream([[5 + k, 6, 7]], PARAMS, TOKENS, ignore_eos=True) as chunks:
            async for chunk in chunks:
                count += len(chunk.output_ids)
        return count

    try:
        await asyncio.gather(*(one(client, k) for k, client in enumerate(clients[:1])))  # connections made
        return sum(await asyncio.gather(*(one(client, k) for k, client in enumerate(clients))))
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def test_haproxy_relays_streamed_tokens_without_faulting_its_buffers_in_again(triton_server):
    if find_haproxy() is None or not isinstance(triton_server, FrontedTritonServer):
        pytest.skip("no front door here (haproxy missing, or an external server)")
    (haproxy,) = [helper.pid for helper in triton_server.helpers if helper.name == "haproxy"]
    asyncio.run(stream_tokens(triton_server.grpc_url))  # the buffers' first use is faulted in once
    before = minor_faults(haproxy)
    tokens = asyncio.run(stream_tokens(triton_server.grpc_url))
    faults = minor_faults(haproxy) - before
    assert tokens == STREAMS * TOKENS
    # about one per token without the thresholds; with them, what new connections take
    assert faults < 0.5 * tokens, f"{faults} page faults in HAProxy for {tokens} streamed tokens"
