"""What the HTTP API costs: tokens/s and time to first token of streamed generations through
`/v1/completions` (the official `openai` SDK) beside the same generations through the gRPC
client (`AsyncGenerateClient`), at 1 and 32 concurrent streams.

    .venv/bin/python -m bench.api_cost [--streams 1 32] [--requests-per-stream 4] [--max-tokens 64]

Starts one tritonserver holding the shipped `generate` model and one API process in front of it
on free ports. Each of `streams` closed-loop clients sends `requests-per-stream` streamed
requests (token-id prompts, max_tokens each, EOS ignored, masks on with top_k 20, seeded), one
request per call as the API makes them; the two paths alternate per round so the machine's load
falls on both. Target: the API costs at most 10% of the gRPC client's tokens/s at 32 streams.
Clients, API and server share the machine's CPUs: report figures with the load they ran under.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import openai

from bench.load.generate import build_repository
from testbed.api_server import ApiProcess
from triton_sampling_mask.client import AsyncGenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.server_process import TritonServer

TOP_K = 20
TARGET_COST = 0.10


def prompt(stream: int, k: int) -> list[int]:
    return [5 + stream % 50, 6 + k, 7, 8]


async def grpc_request(client: AsyncGenerateClient, ids, seed: int, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed request over gRPC."""
    params = SamplingParams(top_k=TOP_K, seed=seed, return_sampling_mask=True)
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream([ids], params, max_new_tokens=max_tokens, ignore_eos=True) as chunks:
        async for chunk in chunks:
            first = first or time.perf_counter() - start
            tokens += len(chunk.output_ids)
    return first, tokens


async def http_request(client: openai.AsyncOpenAI, ids, seed: int, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed /v1/completions request."""
    start, first, tokens = time.perf_counter(), None, 0
    stream = await client.completions.create(
        model="generate", prompt=ids, max_tokens=max_tokens, seed=seed, stream=True,
        extra_body={"top_k": TOP_K, "ignore_eos": True, "return_sampling_mask": True, "return_token_ids": True},
    )  # fmt: skip
    async for chunk in stream:
        ids_here = chunk.choices[0].model_extra.get("token_ids") or []
        if ids_here:
            first = first or time.perf_counter() - start
            tokens += len(ids_here)
    return first, tokens


async def closed_loop(request, client, streams: int, per_stream: int, max_tokens: int) -> dict:
    """`streams` clients at once, each sending its requests one after another."""
    ttfts, counts = [], []

    async def one_client(c: int) -> None:
        for k in range(per_stream):
            first, tokens = await request(client, prompt(c, k), 1000 * c + k, max_tokens)
            ttfts.append(first)
            counts.append(tokens)

    start = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(streams)))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(counts) / seconds, "ttft_p50_ms": 1000 * float(np.median(ttfts)), "tokens": sum(counts)}


async def measure(grpc_url: str, api_url: str, args) -> dict:
    results = {}
    async with (
        AsyncGenerateClient(grpc_url) as grpc_client,
        openai.AsyncOpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0) as http_client,
    ):
        await closed_loop(grpc_request, grpc_client, 2, 1, 8)  # warm-up
        await closed_loop(http_request, http_client, 2, 1, 8)
        for streams in args.streams:
            runs = {"grpc": [], "http": []}
            for _ in range(args.rounds):
                runs["grpc"].append(
                    await closed_loop(grpc_request, grpc_client, streams, args.requests_per_stream, args.max_tokens)
                )
                runs["http"].append(
                    await closed_loop(http_request, http_client, streams, args.requests_per_stream, args.max_tokens)
                )
            results[streams] = {
                path: {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}
                for path, rounds in runs.items()
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp())
    try:
        with TritonServer(build_repository(workdir / "model_repository")) as server, ApiProcess(server.grpc_url) as api:
            print(f"load average before: {os.getloadavg()} ({os.cpu_count()} CPUs, shared by clients, API and server)")
            results = asyncio.run(measure(server.grpc_url, api.url, args))
            print(f"{'streams':>7} {'path':<18} {'tokens/s':>9} {'TTFT p50 ms':>12}")
            for streams, paths in results.items():
                for path, label in (("grpc", "gRPC client"), ("http", "/v1/completions")):
                    row = paths[path]
                    print(f"{streams:>7} {label:<18} {row['tokens_per_s']:>9.1f} {row['ttft_p50_ms']:>12.1f}")
                cost = 1 - paths["http"]["tokens_per_s"] / paths["grpc"]["tokens_per_s"]
                verdict = "met" if cost <= TARGET_COST or streams != 32 else "missed"
                print(
                    f"{streams:>7} HTTP API cost: {100 * cost:.1f}% of tokens/s"
                    + (f" ({verdict})" if streams == 32 else "")
                )
            print(f"load average after: {os.getloadavg()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
