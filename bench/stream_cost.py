"""What the front door costs streaming generation: 32 gRPC streaming clients of the `generate`
model straight to tritonserver and through the front door (HAProxy and the stream gate, as
`make serve` runs them), in interleaved rounds on one server.

Each round runs `clients` closed-loop clients (one `AsyncGenerateClient` each, its own channel, as
separate trainers would) on one side: each streams `requests` requests one after another
(max_new_tokens drawn from a fixed range, masks on, every output sent and decoded), timing each
request's first token. Rounds alternate direct / proxied, the first side alternating too, so load
from other processes lands on both alike. Per side: TTFT p50 / p99 and tokens/s; the targets read
the median over round pairs of proxied / direct (TTFT p50 and p99 at most 1.10x, tokens/s at
least 1 / 1.10 of direct).

`python -m bench.stream_cost [--quick]` runs it alone; `make bench` runs it beside the proxy cost.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.fronted import FrontedTritonServer
from triton_sampling_mask.client import AsyncGenerateClient
from triton_sampling_mask.client.sampling_params import SamplingParams

from . import report
from .load.generate import MODEL, build_repository

PARAMS = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, return_sampling_mask=True)
SIZES = {
    "full": {"clients": 32, "requests": 3, "budget": (16, 64), "rounds": 8},
    "quick": {"clients": 4, "requests": 1, "budget": (4, 8), "rounds": 1},
}
THRESHOLD = 1.10
TARGETS = {
    "stream_ttft_p50": "32 gRPC streams of generate: TTFT p50 through the front door <= 1.10x straight",
    "stream_ttft_p99": "32 gRPC streams of generate: TTFT p99 through the front door <= 1.10x straight",
    "stream_tokens": "32 gRPC streams of generate: tokens/s straight <= 1.10x through the front door",
}


@dataclass
class Round:
    """What one side's clients saw in one round."""

    ttft_s: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    errors: list = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "ttft_p50_ms": 1000 * float(np.percentile(self.ttft_s, 50)),
            "ttft_p99_ms": 1000 * float(np.percentile(self.ttft_s, 99)),
            "tokens_per_s": self.tokens / self.seconds,
            "requests": len(self.ttft_s),
        }


async def _client_loop(client: AsyncGenerateClient, prompts: list, budgets: list[int], out: Round) -> None:
    """One closed-loop client: its requests one after another, each streamed."""
    for prompt, budget in zip(prompts, budgets):
        sent, first = time.perf_counter(), True
        try:
            async with client.stream([prompt], PARAMS, budget, ignore_eos=True) as chunks:
                async for chunk in chunks:
                    if first:
                        out.ttft_s.append(time.perf_counter() - sent)
                        first = False
                    out.tokens += len(chunk.output_ids)
        except Exception as exc:  # counted and reported, the round goes on
            out.errors.append(f"{type(exc).__name__}: {exc}")


async def one_round(clients: list[AsyncGenerateClient], budgets: np.ndarray, offset: int) -> Round:
    """Every client at once (budgets: [clients, requests]); wall time to the last token."""
    out = Round()
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _client_loop(client, [[5 + (c + offset) % 50, 6 + k, 7] for k in range(len(row))], row.tolist(), out)
            for c, (client, row) in enumerate(zip(clients, budgets))
        )
    )
    out.seconds = time.perf_counter() - start
    return out


# --quick and --rounds
OPTION_HELP = ("4 clients, one short round: checks that it runs", "round pairs (default 8; 1 with --quick)")


def _pooled(rounds: list[Round]) -> dict:
    ttft = [t for r in rounds for t in r.ttft_s]
    return {
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)),
        "tokens_per_s": sum(r.tokens for r in rounds) / sum(r.seconds for r in rounds),
        "requests": len(ttft),
    }


async def measure_async(direct_url: str, proxy_url: str, size: dict, progress=print) -> dict:
    """Interleaved rounds on both URLs; per-side pooled figures and the per-round-pair ratios."""
    rng = np.random.default_rng(0)
    sides = {"direct": direct_url, "proxy": proxy_url}
    clients = {side: [AsyncGenerateClient(url) for _ in range(size["clients"])] for side, url in sides.items()}
    rounds: dict[str, list[Round]] = {side: [] for side in sides}
    try:
        for side in sides:  # warm-up: channels connected, the model config read, the engine warm
            await one_round(clients[side], np.full((size["clients"], 1), 4), 0)
        for number in range(size["rounds"]):
            budgets = rng.integers(size["budget"][0], size["budget"][1] + 1, size=(size["clients"], size["requests"]))
            order = list(sides) if number % 2 == 0 else list(sides)[::-1]
            for side in order:
                result = await one_round(clients[side], budgets, number)
                rounds[side].append(result)
                summary = result.summary()
                progress(
                    f"  round {number} {side:>6}: TTFT p50 {summary['ttft_p50_ms']:7.1f} ms, "
                    f"p99 {summary['ttft_p99_ms']:7.1f} ms, {summary['tokens_per_s']:7.1f} tokens/s"
                    + (f", ERRORS {len(result.errors)}: {result.errors[0]}" if result.errors else "")
                )
    finally:
        await asyncio.gather(*(c.close() for side in clients.values() for c in side), return_exceptions=True)
    pairs = [(d.summary(), p.summary()) for d, p in zip(rounds["direct"], rounds["proxy"])]
    ratios = {
        "ttft_p50": statistics.median(p["ttft_p50_ms"] / d["ttft_p50_ms"] for d, p in pairs),
        "ttft_p99": statistics.median(p["ttft_p99_ms"] / d["ttft_p99_ms"] for d, p in pairs),
        # direct over proxied: above 1 when the front door costs throughput, like the TTFT ratios
        "tokens": statistics.median(d["tokens_per_s"] / p["tokens_per_s"] for d, p in pairs),
    }
    return {
        "clients": size["clients"],
        "requests_per_client_per_round": size["requests"],
        "max_new_tokens": list(size["budget"]),
        "rounds": size["rounds"],
        "direct": _pooled(rounds["direct"]),
        "proxy": _pooled(rounds["proxy"]),
        "ratios": ratios,
        "errors": sum(len(r.errors) for side in rounds.values() for r in side),
    }


def verdicts(cost: dict) -> dict:
    """The three targets on the median per-round-pair ratios."""
    case = f"{cost['clients']} streams, max_new_tokens {cost['max_new_tokens']}, {cost['rounds']} round pairs"
    return {
        f"stream_{name}": {
            "target": TARGETS[f"stream_{name}"],
            "case": case,
            "value": cost["ratios"][name],
            "threshold": THRESHOLD,
            "met": cost["ratios"][name] <= THRESHOLD and cost["errors"] == 0,
        }
        for name in ("ttft_p50", "ttft_p99", "tokens")
    }


def run(quick: bool, progress=print, rounds: int | None = None) -> dict:
    """A fresh tritonserver holding only `generate`, behind its own front door; the measurement
    (`rounds` round pairs, default by size)."""
    size = dict(SIZES["quick" if quick else "full"])
    size["rounds"] = rounds or size["rounds"]
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        repository = build_repository(Path(tmp) / "model_repository")
        with FrontedTritonServer(repository, log_path=Path(tmp) / "tritonserver.log") as server:
            progress(
                f"stream cost: {size['clients']} streaming clients of '{MODEL}', tritonserver "
                f"{server.server.grpc_url}, front door {server.grpc_url}"
            )
            cost = asyncio.run(measure_async(server.server.grpc_url, server.grpc_url, size, progress))
    for side in ("direct", "proxy"):
        figures = cost[side]
        progress(
            f"  {side:>6}: TTFT p50 {figures['ttft_p50_ms']:.1f} ms, p99 {figures['ttft_p99_ms']:.1f} ms, "
            f"{figures['tokens_per_s']:.1f} tokens/s ({figures['requests']} requests)"
        )
    ratios = cost["ratios"]
    progress(
        f"  through the front door / straight (median of round pairs): TTFT p50 x{ratios['ttft_p50']:.3f}, "
        f"p99 x{ratios['ttft_p99']:.3f}, tokens/s straight / through x{ratios['tokens']:.3f}"
    )
    return cost


def main(argv: list[str] | None = None) -> dict:
    """This table alone."""
    args = report.one_table_args(__doc__, argv, *OPTION_HELP)
    cost = run(args.quick, rounds=args.rounds)
    return report.publish(cost, verdicts(cost), args.output)


if __name__ == "__main__":
    main()
