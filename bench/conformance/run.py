"""The conformance run (`make conformance`): a fresh `make serve` stack on free loopback ports,
then route probes, schemathesis over openapi_v2.yaml and a raw request-head fuzz, each bounded in
count and time; prints the report (requests and statuses per operation, failures per class with
one reproducer each) and exits 1 on any failure.

    python -m bench.conformance.run [--examples 30] [--budget-s 150] [--raw-requests 300]
                                    [--report bench/results/conformance-run.md] [--title TEXT]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.stack import ADMIN_KEY, launch, shipped_repository
from triton_sampling_mask.ops.server_process import ADMIN_HEADER

from .probes import run_probes
from .request_line import run_request_fuzz
from .schema_fuzz import SPEC, run_schema_fuzz
from .tally import Tally

REPO_ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %s"], capture_output=True, text=True, timeout=10
        ).stdout.strip()[:100]
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Start the stack, run the three parts, print (and optionally write) the report; 1 on any failure."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=30, help="cases per operation and generation mode")
    parser.add_argument(
        "--budget-s", type=float, default=150.0, help="seconds for the schemathesis part, all operations"
    )
    parser.add_argument("--raw-requests", type=int, default=300, help="malformed request heads sent")
    parser.add_argument("--raw-budget-s", type=float, default=40.0, help="seconds for the request-head fuzz")
    parser.add_argument("--seed", type=int, default=20261203, help="seed of the request-head fuzz")
    parser.add_argument("--spec", type=Path, default=SPEC, help="the OpenAPI description fuzzed")
    parser.add_argument("--report", type=Path, help="also write the report (markdown) here")
    parser.add_argument("--title", default="Conformance run", help="the report's heading")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="conformance-"))
    started = time.monotonic()
    stack = launch(shipped_repository(work / "model_repository"), work / "launcher.log")
    print(f"stack up in {time.monotonic() - started:.0f} s: public {stack.ports}, log {stack.log_path}", flush=True)
    port = stack.ports["http"]
    parts = {
        "Route probes": lambda tally: run_probes(port, ADMIN_HEADER, ADMIN_KEY, tally),
        "Schemathesis (openapi_v2.yaml)": lambda tally: run_schema_fuzz(
            port, ADMIN_HEADER, ADMIN_KEY, tally, args.examples, args.budget_s, args.spec
        ),
        "Request-head fuzz": lambda tally: run_request_fuzz(
            port, tally, args.raw_requests, args.seed, args.raw_budget_s
        ),
    }
    tallies = {name: Tally() for name in parts}
    seconds = {}
    try:
        for name, action in parts.items():
            begun = time.monotonic()
            print(f"-- {name}", flush=True)
            action(tallies[name])
            seconds[name] = time.monotonic() - begun
            found = tallies[name]
            print(
                f"   {found.total} requests in {seconds[name]:.0f} s, {len(found.failures)} failure classes", flush=True
            )
        still_answering = stack.sampler_answers()
    finally:
        stopped = stack.stop()
        print(f"stack stopped in {stopped:.1f} s", flush=True)

    failed = sum(len(tally.failures) for tally in tallies.values()) + (0 if still_answering else 1)
    header = [
        f"## {args.title}",
        "",
        f"Code: `{_commit()}`. {sum(t.total for t in tallies.values())} requests against a fresh `make serve` "
        f"stack (front door on) in {sum(seconds.values()):.0f} s; the sampler "
        + ("still answered correctly afterwards." if still_answering else "**no longer answered** afterwards."),
        f"Bounds: {args.examples} cases per operation and mode, {args.budget_s:.0f} s for schemathesis, "
        f"{args.raw_requests} request heads (seed {args.seed}). Reproducers target `make serve` on localhost:8000; "
        "`$TRITON_ADMIN_KEY` stands for the admin key.",
        "",
        f"**Verdict: {'FAIL' if failed else 'pass'}** — "
        + ", ".join(f"{name}: {len(tally.failures)} failure classes" for name, tally in tallies.items()),
        "",
    ]
    report = "\n".join(header) + "\n" + "\n".join(tally.markdown(name) for name, tally in tallies.items())
    print(report)
    if args.report:
        args.report.write_text(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
