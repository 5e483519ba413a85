"""A trainer's rollout burst through the front door, as the official `openai` SDK and `GenerateClient`
send it (docs/api.md, "Sizing for a trainer"): a keyed client on one address submits its whole batch
at once, streaming chat completions to the HTTP API and requests to `generate` over gRPC, while an
unauthenticated flood comes from a second address and a keyless client asks from a third.

`run(stack)` returns what each client got: refusals, losses, answers that differ from their
sequential seeded twin (each request is one of `distinct` prompt-and-seed pairs, asked once alone
first), and the burst's wall time and latencies. client_tests/test_trainer_burst.py asserts on it;
bench/load/trainer_burst.py writes its figures.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx2
import openai

from triton_sampling_mask.client import GenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams

from .stack import CLIENT_KEY as KEY
from .stack import Stack

KEYED, FLOOD, KEYLESS = "127.0.0.1", "127.0.0.2", "127.0.0.3"  # the three clients' addresses
MODEL = "generate"


@dataclass
class ClientOutcome:
    """What one client's requests got: answers equal to their twins, refused (429 or 503, or a
    gRPC busy refusal), lost (any other failure), different from their twins; latencies in s."""

    sent: int = 0
    equal: int = 0
    refused: int = 0
    lost: int = 0
    different: int = 0
    latencies: list[float] = field(default_factory=list)

    def p(self, quantile: float) -> float:
        """A latency quantile in seconds (0 without answers)."""
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] if ordered else 0.0


@dataclass
class BurstOutcome:
    """The burst's clients, by name, and its wall time."""

    clients: dict[str, ClientOutcome]
    seconds: float


def _sdk(stack: Stack, source: str, key: str) -> openai.AsyncOpenAI:
    """The SDK as a user makes it (its own connection limits, no retries), bound to `source`."""
    limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=100)  # the SDK's defaults
    transport = httpx2.AsyncHTTPTransport(local_address=source, limits=limits)
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{stack.ports['api']}/v1",
        api_key=key,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(transport=transport, timeout=600),
    )


def _prompts(distinct: int) -> list[tuple[str, int]]:
    return [(f"rollout {index}: the sampler's masks", 1000 + index) for index in range(distinct)]


async def _chat(client: openai.AsyncOpenAI, prompt: str, seed: int, max_tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        stream=True,
    )
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


async def _chats(client, outcome: ClientOutcome, pairs, twins: dict, max_tokens: int) -> None:
    async def one(prompt: str, seed: int) -> None:
        started = time.monotonic()
        try:
            text = await _chat(client, prompt, seed, max_tokens)
        except (openai.RateLimitError, openai.InternalServerError):
            outcome.refused += 1  # 429, or 503 with the busy marker
            return
        except Exception:  # noqa: BLE001 - anything else is a lost request, counted as such
            outcome.lost += 1
            return
        outcome.latencies.append(time.monotonic() - started)
        if text == twins[(prompt, seed)]:
            outcome.equal += 1
        else:
            outcome.different += 1

    outcome.sent += len(pairs)
    await asyncio.gather(*(one(prompt, seed) for prompt, seed in pairs))


def _generate(stack: Stack, outcome: ClientOutcome, requests: int, distinct: int, max_tokens: int) -> None:
    """`requests` prompts through GenerateClient over gRPC, keyed, at once; twins asked alone first."""
    prompts = [[5 + index, 6, 7, 8] for index in range(distinct)]
    params = [SamplingParams(temperature=1.0, top_k=20, seed=2000 + index) for index in range(distinct)]
    with GenerateClient(stack.grpc_url, api_key=KEY, max_in_flight=requests) as client:
        twins = [
            client.generate([prompt], param, max_new_tokens=max_tokens)[0] for prompt, param in zip(prompts, params)
        ]
        started = time.monotonic()
        try:
            results = client.generate(
                [prompts[i % distinct] for i in range(requests)],
                [params[i % distinct] for i in range(requests)],
                max_new_tokens=max_tokens,
            )
        except Exception:  # noqa: BLE001 - the call failed: every request of it is lost
            outcome.sent, outcome.lost = requests, requests
            return
        outcome.latencies.append(time.monotonic() - started)  # one call: its whole time
        outcome.sent = requests
        outcome.refused = client.busy_refusals
        for index, result in enumerate(results):
            if result.output_ids.tolist() == twins[index % distinct].output_ids.tolist():
                outcome.equal += 1
            else:
                outcome.different += 1


def run(
    stack: Stack,
    requests: int = 1024,
    generate_requests: int = 2000,
    flood: int = 100,
    distinct: int = 16,
    max_tokens: int = 4,
) -> BurstOutcome:
    """The burst (see the module docstring) against a running stack whose key file holds KEY."""
    pairs = _prompts(distinct)
    clients = {name: ClientOutcome() for name in ("keyed sdk", "keyed generate", "flood", "keyless")}

    async def main() -> float:
        async with _sdk(stack, KEYED, KEY) as keyed, _sdk(stack, FLOOD, "no-key") as flooding:
            async with _sdk(stack, KEYLESS, "no-key") as keyless:
                twins = {pair: await _chat(keyed, *pair, max_tokens) for pair in pairs}  # one at a time
                generating = threading.Thread(
                    target=_generate,
                    args=(stack, clients["keyed generate"], generate_requests, distinct, max_tokens),
                )
                started = time.monotonic()
                generating.start()
                burst = [pairs[i % distinct] for i in range(requests)]
                await asyncio.gather(
                    _chats(keyed, clients["keyed sdk"], burst, twins, max_tokens),
                    _chats(flooding, clients["flood"], [pairs[i % distinct] for i in range(flood)], twins, max_tokens),
                    _keyless(keyless, clients["keyless"], pairs[:4], twins, max_tokens),
                )
                await asyncio.to_thread(generating.join)
                return time.monotonic() - started

    async def _keyless(client, outcome, few, twins, max_tokens) -> None:
        await asyncio.sleep(0.5)  # once the burst and the flood are in
        for pair in few:  # one after another, as a lone user asks
            await _chats(client, outcome, [pair], twins, max_tokens)

    seconds = asyncio.run(main())
    return BurstOutcome(clients, seconds)
