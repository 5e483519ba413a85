"""Load on the `generate` model's continuous engine (default tiny Llama) on a real tritonserver.

    .venv/bin/python -m bench.load.generate [--clients 32] [--requests-per-client 3]

Starts one server holding the shipped `generate` model on free ports. Non-streaming, then
streaming, `clients` closed-loop clients (one shipped GenerateClient each, over gRPC streams,
next request sent when the previous one ends) each send `requests-per-client` requests whose
max_new_tokens are drawn from [16, 256] (the same draws for both), sampling masks on (top_k 20);
every output is sent and decoded, as a trainer's client receives it. Prints tokens/s, time to
first token p50/p99 (non-streaming: the time to the one response) and inter-token latency
p50/p99 (streaming), what streaming costs in tokens/s, and the machine's load average (the
clients share the CPUs with the server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.server import TritonServer, copy_model
from triton_sampling_mask.client import GenerateClient, GenerateError
from triton_sampling_mask.client.sampling_params import SamplingParams

PARAMS = dict(temperature=1.0, top_k=20, top_p=0.95, return_sampling_mask=True, ignore_eos=True)
MODEL = "generate"
BUDGET_RANGE = (16, 256)


@dataclass
class LoadStats:
    """What the clients of one configuration saw."""

    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)  # seconds, one per request
    itl: list = field(default_factory=list)  # seconds between a request's consecutive tokens (streaming)
    errors: list = field(default_factory=list)

    def row(self, label: str) -> str:
        def pct(values, q):
            return f"{1000 * np.percentile(values, q):8.1f}" if values else "       -"

        return (
            f"{label:<26} {self.tokens / self.seconds:9.1f} {pct(self.ttft, 50)} {pct(self.ttft, 99)} "
            f"{pct(self.itl, 50)} {pct(self.itl, 99)}   ({self.tokens} tokens in {self.seconds:.1f}s)"
        )


def default_prompt(client: int, k: int) -> list[int]:
    """The prompt of client `client`'s k-th request."""
    return [5 + client % 50, 6 + k, 7]


def client_loop(
    url: str,
    model: str,
    budgets: list[int],
    stream: bool,
    client: int,
    stats: LoadStats,
    lock,
    params: dict = PARAMS,
    prompt: Callable[[int, int], list[int]] = default_prompt,
) -> None:
    """One closed-loop client: its requests one after another through the shipped GenerateClient
    (gRPC streams), every output received."""
    ttft, itl, tokens, errors = [], [], 0, []
    sampling = {name: value for name, value in params.items() if name != "ignore_eos"}
    with GenerateClient(url, model_name=model, max_in_flight=1) as connection:
        for k, budget in enumerate(budgets):
            request = dict(
                prompts=[prompt(client, k)],
                params=SamplingParams(**sampling, seed=client * 1000 + k),
                max_new_tokens=budget,
                ignore_eos=params.get("ignore_eos", False),
            )
            sent = last = time.perf_counter()
            try:
                if not stream:
                    [result] = connection.generate(**request)
                    tokens += result.output_ids.size
                    ttft.append(time.perf_counter() - sent)
                    continue
                first = True
                with connection.stream(**request) as chunks:
                    for chunk in chunks:
                        now = time.perf_counter()
                        if not chunk.output_ids.size:
                            continue
                        tokens += chunk.output_ids.size
                        if first:
                            ttft.append(now - sent)
                            first = False
                        else:
                            itl.append(now - last)
                        last = now
            except GenerateError as error:
                errors.append(str(error))
    with lock:
        stats.tokens += tokens
        stats.ttft += ttft
        stats.itl += itl
        stats.errors += errors


def closed_loop(url: str, model: str, budgets: np.ndarray, stream: bool, **workload) -> LoadStats:
    """All clients at once (budgets: [clients, requests per client]); wall time to the last answer.
    `workload`: the clients' `params` and `prompt` (client_loop's defaults otherwise)."""
    stats, lock = LoadStats(), threading.Lock()
    threads = [
        threading.Thread(
            target=client_loop, args=(url, model, [int(b) for b in row], stream, c, stats, lock), kwargs=workload
        )
        for c, row in enumerate(budgets)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats.seconds = time.perf_counter() - start
    return stats


def build_repository(dest: Path) -> Path:
    """A repository holding only the shipped generate model (the sampler models stay unloaded)."""
    copy_model(dest, MODEL)
    return dest


@contextlib.contextmanager
def serving(build: Callable[[Path], Path], what: str) -> Iterator[TritonServer]:
    """A TritonServer on the repository `build(dest)` writes into a temporary folder (removed
    after), with one line when it is ready (`what` the run does) and the load average at the end."""
    workdir = Path(tempfile.mkdtemp())
    started = time.perf_counter()
    try:
        with TritonServer(build(workdir / "model_repository")) as server:
            print(
                f"server ready in {time.perf_counter() - started:.1f}s; {what}; load average before: {os.getloadavg()}"
            )
            yield server
            print(f"load average after: {os.getloadavg()} ({os.cpu_count()} CPUs; the clients run on them too)")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the max_new_tokens draws")
    args = parser.parse_args()
    budgets = np.random.default_rng(args.seed).integers(
        BUDGET_RANGE[0], BUDGET_RANGE[1] + 1, size=(args.clients, args.requests_per_client)
    )
    what = (
        f"{args.clients} closed-loop clients x {args.requests_per_client} requests, "
        f"max_new_tokens in {list(BUDGET_RANGE)} (mean {budgets.mean():.0f})"
    )
    with serving(build_repository, what) as server:
        closed_loop(server.grpc_url, MODEL, np.full((2, 1), 8), stream=False)  # warm-up
        print(
            f"{'configuration':<26} {'tokens/s':>9} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8}   (ms)"
        )
        results = {}
        for stream in (False, True):
            stats = closed_loop(server.grpc_url, MODEL, budgets, stream)
            results[stream] = stats
            print(
                stats.row("streaming" if stream else "non-streaming")
                + (f"  ERRORS: {len(stats.errors)} e.g. {stats.errors[0]}" if stats.errors else ""),
                flush=True,
            )
        ratio = (results[True].tokens / results[True].seconds) / (results[False].tokens / results[False].seconds)
        print(f"streaming/non-streaming tokens/s x{ratio:.2f} (each streamed token is one response)")


if __name__ == "__main__":
    main()
