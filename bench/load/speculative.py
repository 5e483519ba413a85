"""Speculative decoding ("ngram", prompt lookup) against plain decoding on the `generate` model
(default tiny Llama) on a real tritonserver.

    .venv/bin/python -m bench.load.speculative [--streams 1 8 32] [--requests-per-stream 4]
                                               [--max-new-tokens 128] [--rounds 3] [--tiny] [--output JSON]

Starts one server holding each workload's LM twice, as the shipped `generate` model with
speculative_algorithm "none" and with "ngram" (the shipped drafting parameters). For each
workload and each number of concurrent streams, closed-loop streaming clients
(bench.load.generate's, one gRPC stream each) send `requests-per-stream` requests of
`max-new-tokens` tokens (EOS ignored, masks on, seeded) to each model in turn, in `rounds`
interleaved rounds (the order swapped every round). Workloads:

- repetitive: greedy, on `bench.load.looping_lm` (the default tiny Llama with its attention
  outputs zeroed: the same cost per pass, but its outputs soon cycle; the default LM's random
  weights rarely repeat themselves), prompts repeating a short pattern;
- non-repetitive: the default tiny Llama at temperature 1, prompts of distinct random ids
  (drafts are rare and mostly rejected: what drafting costs when it does not help).

Prints tokens/s (median of the rounds), inter-token latency p50 / p99 / mean (the tokens of one step arrive together, so
p50 falls under speculation while the mean tracks tokens/s), the speed-up (the median of the
rounds' ratios), and the acceptance rate
and accepted tokens per drafted step from the server's counters. The outputs of both models are
the same token for token (client_tests/test_speculative.py checks it), so only speed differs.
`--tiny` is a smoke run (streams 1 and 2, one short request each), not a measurement. `--output
JSON` also writes the tokens/s per point, which bench/plots.py draws as speculative.png; `make
bench` runs the same measurement (`run`) and draws it with its other figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np

from testbed.metrics import counter, wait_for_counter
from testbed.server import copy_model

from .generate import LoadStats, closed_loop, serving

ALGORITHMS = ("none", "ngram")  # speculative_algorithm of the two models of each workload
SPEC_COUNTERS = ("drafts", "drafted_tokens", "accepted_tokens")
LOOPING_LM = Path(__file__).with_name("looping_lm.py")
VOCAB = 1024  # the default tiny Llama's
MASKED = dict(top_k=20, return_sampling_mask=True, ignore_eos=True)


def repetitive_prompt(client: int, k: int) -> list[int]:
    """A pattern of 3 to 6 ids repeated to 24 tokens (its own per client and request)."""
    draw = np.random.default_rng([client, k])
    pattern = draw.integers(3, VOCAB, int(draw.integers(3, 7))).tolist()
    return (pattern * 24)[:24]


def distinct_prompt(client: int, k: int) -> list[int]:
    """24 distinct random ids (its own per client and request)."""
    return np.random.default_rng([client, k, 1]).choice(np.arange(3, VOCAB), 24, replace=False).tolist()


# workload -> (its LM: the `lm` parameter, "" for the default; the clients' prompt and parameters)
WORKLOADS = {
    "repetitive": ("looping_lm:factory", dict(prompt=repetitive_prompt, params=dict(MASKED, temperature=0.0))),
    "non-repetitive": ("", dict(prompt=distinct_prompt, params=dict(MASKED, temperature=1.0, top_p=0.95))),
}


def model_name(workload: str, algorithm: str) -> str:
    return f"generate_{workload.replace('-', '_')}_{algorithm}"


def build_repository(dest: Path) -> Path:
    """Per workload, the shipped generate model on its LM, with speculative_algorithm "none" and "ngram"."""
    for workload, (lm, _) in WORKLOADS.items():
        for algorithm in ALGORITHMS:
            parameters = {"speculative_algorithm": algorithm, "lm": lm}
            copy_model(dest, "generate", model_name(workload, algorithm), parameters, files=(LOOPING_LM,))
    return dest


def measure(server, model: str, budgets: np.ndarray, workload: dict) -> tuple[LoadStats, list]:
    """One closed-loop run (streaming) and the server's speculation counters over it (drafts,
    drafted tokens, accepted tokens)."""
    before = [counter(server.metrics_url, f"generate_spec_{c}_total", model) for c in SPEC_COUNTERS]
    tokens_before = counter(server.metrics_url, "generate_tokens_total", model)
    stats = closed_loop(server.grpc_url, model, budgets, True, **workload)
    # The engine counts a step after sending its tokens (speculation first, then the tokens).
    wait_for_counter(
        server.metrics_url,
        "generate_tokens_total",
        lambda value: value >= tokens_before + stats.tokens,
        "the server never counted the tokens it sent",
        model=model,
    )
    after = [counter(server.metrics_url, f"generate_spec_{c}_total", model) for c in SPEC_COUNTERS]
    return stats, [a - b for a, b in zip(after, before)]


def rate(stats: LoadStats) -> float:
    return stats.tokens / stats.seconds


def row(label: str, runs: list[tuple[LoadStats, list]]) -> str:
    """One algorithm's rounds: median tokens/s, inter-token latency over every round's gaps, the
    speculation counters summed, and any client errors."""
    itl = [gap for stats, _ in runs for gap in stats.itl]

    def ms(q=None):
        if not itl:
            return "       -"
        return f"{1000 * (np.mean(itl) if q is None else np.percentile(itl, q)):8.2f}"

    line = f"{label:<34} {np.median([rate(stats) for stats, _ in runs]):9.1f} {ms(50)} {ms(99)} {ms()}"
    drafts, drafted, accepted = (sum(counts[i] for _, counts in runs) for i in range(3))
    if drafted:
        line += (
            f"  acceptance {accepted / drafted:.0%} ({accepted:.0f}/{drafted:.0f} drafted), "
            f"{accepted / drafts:.2f} accepted per drafted step"
        )
    errors = [error for stats, _ in runs for error in stats.errors]
    return line + (f"  ERRORS: {len(errors)} e.g. {errors[0]}" if errors else "")


# The sizes of a run: the documented measurement, and the smoke run of --tiny.
FULL = dict(streams=(1, 8, 32), requests_per_stream=4, max_new_tokens=128, rounds=3)
TINY = dict(streams=(1, 2), requests_per_stream=1, max_new_tokens=48, rounds=2)


def run(
    streams=FULL["streams"],
    requests_per_stream: int = FULL["requests_per_stream"],
    max_new_tokens: int = FULL["max_new_tokens"],
    rounds: int = FULL["rounds"],
    progress=print,
) -> dict:
    """Measure every workload at every number of streams (see the module docstring), printing a
    line per point; returns {"timestamp", "points": [{workload, streams, algorithm, tokens_per_s,
    round_tokens_per_s}], "ratios": [{workload, streams, ngram_over_none, rounds}]}, which
    bench/plots.py draws as speculative.png."""
    points, ratios = [], []
    with serving(
        build_repository, f"streaming clients x {requests_per_stream} requests of {max_new_tokens} tokens"
    ) as server:
        for workload_name, (_, workload) in WORKLOADS.items():  # warm-up
            for algorithm in ALGORITHMS:
                closed_loop(server.grpc_url, model_name(workload_name, algorithm), np.full((2, 1), 8), True, **workload)
        header = f"{'workload / streams / algorithm':<34} {'tokens/s':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL mean':>8}"
        progress(header + "  (ms)")
        for workload_name, (_, workload) in WORKLOADS.items():
            for count in streams:
                budgets = np.full((count, requests_per_stream), max_new_tokens)
                runs = {algorithm: [] for algorithm in ALGORITHMS}
                for round_ in range(rounds):  # interleaved, the order swapped every round
                    for algorithm in ALGORITHMS[:: 1 if round_ % 2 == 0 else -1]:
                        runs[algorithm].append(measure(server, model_name(workload_name, algorithm), budgets, workload))
                for algorithm in ALGORITHMS:
                    progress(row(f"{workload_name} / {count} / {algorithm}", runs[algorithm]))
                    rates = [rate(stats) for stats, _ in runs[algorithm]]
                    points.append(
                        {
                            "workload": workload_name,
                            "streams": count,
                            "algorithm": algorithm,
                            "tokens_per_s": float(np.median(rates)),
                            "round_tokens_per_s": rates,
                        }
                    )
                round_ratios = [rate(ngram[0]) / rate(none[0]) for none, ngram in zip(runs["none"], runs["ngram"])]
                ratios.append(
                    {
                        "workload": workload_name,
                        "streams": count,
                        "ngram_over_none": float(np.median(round_ratios)),
                        "rounds": round_ratios,
                    }
                )
                progress(
                    f"{workload_name} / {count}: ngram/none tokens/s x{np.median(round_ratios):.2f} "
                    f"(median of {len(round_ratios)} interleaved rounds: {', '.join(f'{r:.2f}' for r in round_ratios)})"
                )
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    return {"timestamp": stamp, "points": points, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=list(FULL["streams"]))
    parser.add_argument("--requests-per-stream", type=int, default=FULL["requests_per_stream"])
    parser.add_argument("--max-new-tokens", type=int, default=FULL["max_new_tokens"])
    parser.add_argument(
        "--rounds", type=int, default=FULL["rounds"], help="interleaved rounds per point (order swapped each)"
    )
    parser.add_argument("--tiny", action="store_true", help="a smoke run: streams 1 2, one 48-token request each")
    parser.add_argument("--output", type=Path, help="also write the tokens/s as JSON (bench/plots.py draws it)")
    args = parser.parse_args()
    sizes = (
        dict(TINY)
        if args.tiny
        else {
            "streams": args.streams,
            "requests_per_stream": args.requests_per_stream,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
        }
    )
    results = run(**sizes, progress=functools.partial(print, flush=True))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
