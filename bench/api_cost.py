"""What the HTTP API costs: tokens/s and time to first token of streamed generations through
`/v1/completions` (the official `openai` SDK) beside the same generations through the gRPC
client (`AsyncGenerateClient`), at 1 and 32 concurrent streams.

    .venv/bin/python -m bench.api_cost [--quick] [--rounds N] [--output PATH]

Starts one tritonserver holding the shipped `generate` model and one API process in front of it
on free ports. Each of `streams` closed-loop clients sends `requests` streamed requests (token-id
prompts, max_tokens each, EOS ignored, masks on with top_k 20, seeded), one request per call as
the API makes them; per stream count, rounds alternate gRPC / HTTP, the first side alternating
too, so the machine's load falls on both alike. Reported per path: tokens/s and TTFT p50 over all
rounds, the median over rounds of the API's cost (1 - HTTP tokens/s / gRPC tokens/s), and the API
process's CPU time per streamed token (/proc: what the API spends, whatever else runs). Target:
the API costs at most 10% of the gRPC client's tokens/s at 32 streams. Clients, API and server
share the machine's CPUs: report figures with the load they ran under. `make bench` runs it
(`--quick` with `--tiny`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openai

from bench.load.generate import build_repository
from testbed.api_server import ApiProcess
from testbed.server import TritonServer
from triton_sampling_mask.client import AsyncGenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams

from . import report
from .common import machine_facts

TOP_K = 20
TARGET_COST = 0.10
TARGET_STREAMS = 32
TARGETS = {"api_tokens": "32 streams through /v1/completions: tokens/s at least 0.90x the gRPC client's (cost <= 10%)"}
SIZES = {
    "full": {"streams": (1, TARGET_STREAMS), "requests": 2, "max_tokens": 32, "rounds": 4},
    "quick": {"streams": (1, 4), "requests": 1, "max_tokens": 4, "rounds": 1},
}
PATHS = {"grpc": "gRPC client", "http": "/v1/completions"}

# --quick and --rounds
OPTION_HELP = ("1 and 4 streams, one short round: checks that it runs", "round pairs per stream count (default 4)")


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process's threads have run, to the nanosecond (/proc/PID/task/*/schedstat:
    /proc/PID/stat counts 10 ms ticks, too coarse for a short round). Threads that ended are not
    counted; the API's (the event loop, gRPC's poller) live as long as it does."""
    total = 0
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(schedstat.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


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
    return {"seconds": time.perf_counter() - start, "ttft_s": ttfts, "tokens": sum(counts)}


def _pooled(rounds: list[dict]) -> dict:
    ttft = [t for r in rounds for t in r["ttft_s"]]
    return {
        "tokens_per_s": sum(r["tokens"] for r in rounds) / sum(r["seconds"] for r in rounds),
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
        "tokens": sum(r["tokens"] for r in rounds),
    }


async def measure_async(grpc_url: str, api: ApiProcess, size: dict, progress=print) -> dict:
    """Per stream count: both paths' pooled figures, the median per-round cost, the API's CPU per token."""
    points = {}
    async with (
        AsyncGenerateClient(grpc_url) as grpc_client,
        openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0) as http_client,
    ):
        sides = {"grpc": (grpc_request, grpc_client), "http": (http_request, http_client)}
        for request, client in sides.values():  # warm-up: connections, the model config, the engine
            await closed_loop(request, client, 2, 1, 8)
        for streams in size["streams"]:
            rounds = {side: [] for side in sides}
            api_cpu_s = 0.0
            for number in range(size["rounds"]):
                for side in list(sides) if number % 2 == 0 else list(sides)[::-1]:
                    request, client = sides[side]
                    before = cpu_seconds(api.process.pid)
                    result = await closed_loop(request, client, streams, size["requests"], size["max_tokens"])
                    if side == "http":
                        api_cpu_s += cpu_seconds(api.process.pid) - before
                    rounds[side].append(result)
                    progress(
                        f"  {streams:>3} streams, round {number} {PATHS[side]:<16}: "
                        f"{result['tokens'] / result['seconds']:7.1f} tokens/s"
                    )
            http_tokens = sum(r["tokens"] for r in rounds["http"])
            points[str(streams)] = {
                **{side: _pooled(rounds[side]) for side in sides},
                "cost": statistics.median(
                    1 - (h["tokens"] / h["seconds"]) / (g["tokens"] / g["seconds"])
                    for g, h in zip(rounds["grpc"], rounds["http"])
                ),
                "api_cpu_us_per_token": 1e6 * api_cpu_s / http_tokens,
            }
    return points


def verdicts(cost: dict) -> dict:
    """The target on the median per-round cost at the largest stream count measured."""
    streams = max(cost["points"], key=int)
    return {
        "api_tokens": {
            "target": TARGETS["api_tokens"],
            "case": f"{streams} streams x {cost['requests_per_stream']} requests of {cost['max_tokens']} tokens, "
            f"{cost['rounds']} round pairs",
            "value": cost["points"][streams]["cost"],
            "threshold": TARGET_COST,
            "met": cost["points"][streams]["cost"] <= TARGET_COST and int(streams) == TARGET_STREAMS,
        }
    }


def table(cost: dict) -> str:
    """The markdown table of one run (bench/results/api_cost.md)."""
    lines = [
        "| streams | gRPC client tokens/s | `/v1/completions` tokens/s | API cost (median of rounds) "
        "| TTFT p50 gRPC / HTTP | API CPU per token |",
        "|---|---|---|---|---|---|",
    ]
    for streams, p in cost["points"].items():
        lines.append(
            f"| {streams} | {p['grpc']['tokens_per_s']:,.1f} | {p['http']['tokens_per_s']:,.1f} | "
            f"{100 * p['cost']:.1f}% | {p['grpc']['ttft_p50_ms']:.1f} / {p['http']['ttft_p50_ms']:.1f} ms | "
            f"{p['api_cpu_us_per_token']:.0f} µs |"
        )
    return "\n".join(lines) + "\n"


def run(quick: bool, progress=print, rounds: int | None = None) -> dict:
    """A fresh tritonserver holding only `generate` and one API process in front of it; the
    measurement (`rounds` round pairs per stream count, default by size)."""
    size = dict(SIZES["quick" if quick else "full"])
    size["rounds"] = rounds or size["rounds"]
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        with (
            TritonServer(build_repository(Path(tmp) / "model_repository")) as server,
            ApiProcess(server.grpc_url) as api,
        ):
            progress(f"API cost: {size['streams']} streams, tritonserver {server.grpc_url}, API {api.url}")
            points = asyncio.run(measure_async(server.grpc_url, api, size, progress))
    cost = {
        "streams": list(size["streams"]),
        "requests_per_stream": size["requests"],
        "max_tokens": size["max_tokens"],
        "rounds": size["rounds"],
        "points": points,
    }
    for streams, p in points.items():
        progress(
            f"  {streams:>3} streams: gRPC {p['grpc']['tokens_per_s']:.1f} tokens/s, HTTP {p['http']['tokens_per_s']:.1f}"
            f" tokens/s; API cost {100 * p['cost']:.1f}% (median of rounds); TTFT p50 "
            f"{p['grpc']['ttft_p50_ms']:.1f} / {p['http']['ttft_p50_ms']:.1f} ms; API CPU "
            f"{p['api_cpu_us_per_token']:.0f} us/token"
        )
    return cost


def main(argv: list[str] | None = None) -> dict:
    """This table alone."""
    args = report.one_table_args(__doc__, argv, *OPTION_HELP)
    load_before = machine_facts()["load_average_1m"]
    cost = run(args.quick, rounds=args.rounds)
    cost["targets"] = verdicts(cost)
    cost["load_average_1m"] = [load_before, machine_facts()["load_average_1m"]]
    print(f"load average (1 min) before / after: {cost['load_average_1m']}\n")
    print(table(cost))
    report.print_verdicts(cost["targets"])
    if args.output:
        args.output.write_text(json.dumps(cost, indent=2) + "\n")
    return cost


if __name__ == "__main__":
    main()
