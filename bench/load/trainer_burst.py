"""A trainer's 1,024-request burst from one host through `make serve`'s front door, with a client key
(docs/api.md, "Sizing for a trainer"): refused, lost and wrong answers per client, the burst's wall
time and its latencies, written to bench/results/trainer_burst.md.

    python -m bench.load.trainer_burst [--requests 1024] [--generate-requests 2000] [--flood 100]
                                       [--max-tokens 4] [--rounds 3] [--out bench/results/trainer_burst.md]

Each round starts a fresh stack (the launcher with TRITON_CLIENT_KEYS_FILE, defaults otherwise) and
runs `testbed.trainer_burst`: the keyed client on 127.0.0.1 sends `--requests` streaming chat
completions through the official `openai` SDK (max_retries=0) and `--generate-requests` through
GenerateClient over gRPC, at once; an unauthenticated flood of `--flood` chats comes from 127.0.0.2
and a keyless client asks from 127.0.0.3. Exit 1 when a keyed or keyless request was refused, lost
or differed from its sequential seeded twin. Run it on an otherwise idle machine: its times are
the machine's as much as the server's.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from testbed import trainer_burst
from testbed.stack import launch_keyed

RESULTS = Path(__file__).resolve().parent.parent / "results" / "trainer_burst.md"


def one_round(args: argparse.Namespace) -> trainer_burst.BurstOutcome:
    """A fresh stack, one burst, the stack stopped."""
    work = Path(tempfile.mkdtemp(prefix="trainer-burst-"))
    stack = launch_keyed(work)
    try:
        return trainer_burst.run(stack, args.requests, args.generate_requests, args.flood, max_tokens=args.max_tokens)
    finally:
        stack.stop()


def report(args: argparse.Namespace, rounds: list[trainer_burst.BurstOutcome]) -> str:
    """The markdown page: the command, the machine, one table row per client and round."""
    lines = [
        "# A trainer's burst through the front door (`python -m bench.load.trainer_burst`)",
        "",
        f"`{' '.join(['python -m bench.load.trainer_burst', *sys.argv[1:]])}` on {platform.node()} "
        f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Every request asks for {args.max_tokens} tokens; "
        "the keyed client holds a client key (TRITON_CLIENT_KEYS_FILE), the others none.",
        "",
        "| round | client | sent | answered as its twin | refused | lost | different | p50 s | p99 s | burst wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for number, outcome in enumerate(rounds, 1):
        for name, client in outcome.clients.items():
            lines.append(
                f"| {number} | {name} | {client.sent} | {client.equal} | {client.refused} | {client.lost} | "
                f"{client.different} | {client.p(0.5):.2f} | {client.p(0.99):.2f} | {outcome.seconds:.1f} |"
            )
    lines += [
        "",
        "`keyed generate` is one GenerateClient call: its latency is the whole call's. The flood is refused past "
        "its address's share (PROXY_REQUESTS_PER_IP), as without keys.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, write the report, exit 1 on a keyed or keyless refusal, loss or difference."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1024, help="keyed streaming chats (default %(default)s)")
    parser.add_argument("--generate-requests", type=int, default=2000, help="keyed GenerateClient requests")
    parser.add_argument("--flood", type=int, default=100, help="unauthenticated chats from another address")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    rounds = [one_round(args) for _ in range(args.rounds)]
    text = report(args, rounds)
    args.out.write_text(text)
    print(text, end="")
    bad = [
        client
        for outcome in rounds
        for name, client in outcome.clients.items()
        if name != "flood" and (client.refused or client.lost or client.different)
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
