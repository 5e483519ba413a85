"""A stop after traffic is clean: after a burst of streaming chats to the HTTP API and a
GenerateClient call through the front door's stream gate, SIGTERM ends tritonserver by itself
(every model finalized, exit code 0), never by the supervisor's SIGKILL.

Two things held it past its exit timeout: the API cancelled each chat's gRPC stream after its
final token (Triton 2.51 can keep a cancelled stream's responses, and with them the model, for
good), and the gate kept its connection to tritonserver open after the proxy closed its side
(tritonserver's gRPC shutdown waits for every connection to close)."""

from __future__ import annotations

import asyncio
import resource

import openai
import pytest

from testbed.server import ExternalTritonServer
from testbed.stack import CLIENT_KEY, Stack, launch_keyed
from triton_sampling_mask.client import GenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.proxy import find_haproxy

pytestmark = pytest.mark.skipif(find_haproxy() is None, reason="the front door needs haproxy")
CHATS = 1024  # a trainer's batch: enough streams at once to show the race


async def _chats(stack: Stack) -> list[str]:
    # The API's own port: the burst is between it and tritonserver (the proxy's per-address caps aside).
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.api_internal_port}/v1", api_key=CLIENT_KEY, max_retries=0
    )

    async def one(index: int) -> str:
        messages = [{"role": "user", "content": f"rollout {index}"}]
        stream = await client.chat.completions.create(
            model="generate", messages=messages, max_tokens=4, seed=index, stream=True
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

    async with client:
        return await asyncio.gather(*(one(index) for index in range(CHATS)))


def test_a_stop_after_api_streams_and_a_door_stream_ends_tritonserver_without_sigkill(tmp_path):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("needs a local launcher of its own, stopped by the test")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))  # the SDK's connections
    stack = launch_keyed(tmp_path)
    try:
        texts = asyncio.run(_chats(stack))
        assert len(texts) == CHATS and all(texts), stack.log_tail()
        with GenerateClient(stack.grpc_url, api_key=CLIENT_KEY) as client:  # through the gate, keyed
            (result,) = client.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=1), max_new_tokens=2)
        assert result.finish_reason == "length"
    finally:
        stack.stop()
    log = stack.log_path.read_text()
    supervisor = [line for line in log.splitlines() if line.startswith("[supervisor] tritonserver")]
    assert "generate finalized" in log, stack.log_tail()
    assert not [line for line in supervisor if "SIGKILL" in line], supervisor
    assert any("tritonserver stopped (exit code 0)" in line for line in supervisor), supervisor
    assert stack.process.returncode == 0, stack.log_tail()
