"""The `generate` model of this tree against the same model at a baseline revision, side by side.

    .venv/bin/python -m bench.load.generate_baseline [--rev 492b70f] [--quick] [--rounds N] [--door]

The baseline revision is checked out into a temporary git worktree (removed after) and its
`generate` model served by a second tritonserver whose stub imports that revision's package
(its model.py puts a folder holding `triton_sampling_mask` -> <worktree>/plugin first on
sys.path); this tree's model is served as `make bench` serves it. Both servers run at once, on
the same tritonserver, the same environment and the same client code (this tree's
GenerateClient, every output decoded, `bench.load.generate`'s closed loop): only the model's
code differs. Rounds alternate between the two (the first side alternating too), each round the
same streaming workload (32 clients x 3 requests, max_new_tokens drawn once from [16, 256], masks
on); per side the medians over rounds of tokens/s and TTFT p50 / p99, and the ratios this tree /
baseline. With `--door` each side is a whole `make serve` stack of this tree (supervisor, HAProxy,
stream gate; the clients through its public gRPC port, as users reach it) whose repository holds
this tree's sampler and the side's generate. `--rev baed6d0` compares with the first release's
generate (static batching: each dynamic batch generated to its end). Nothing is asserted: the
ratios say whether a change made generate slower than the revision it is compared with, on the
machine of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from testbed.server import REPO_ROOT, TritonServer, copy_model

from .generate import BUDGET_RANGE, MODEL, build_repository, closed_loop

# What `make bench` compares with unless told otherwise: main before the weight updates, the
# per-token receipts and versions, the histograms and the spans reached the generate model.
DEFAULT_REV = "492b70f"
# The first release's generate: static batching, the baseline continuous batching is judged by.
FIRST_RELEASE_REV = "baed6d0"
SIZES = {
    "full": {"clients": 32, "requests": 3, "rounds": 6},
    "quick": {"clients": 2, "requests": 1, "rounds": 1},
}
QUICK_BUDGET = (4, 8)

PREAMBLE = """import sys

sys.path.insert(0, {path!r})  # the baseline revision's package, ahead of this environment's
import triton_sampling_mask as _baseline  # noqa: E402

assert _baseline.__file__.startswith({path!r}), f"baseline package not imported: {{_baseline.__file__}}"
"""


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A detached git worktree of `rev` of this repository, removed on exit; raises
    RuntimeError naming the revision when git cannot check it out."""
    folder = Path(tempfile.mkdtemp(prefix="generate-baseline-"))
    tree = folder / "tree"
    done = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(tree), rev],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git cannot check out {rev!r}: {done.stderr.strip()[-300:]}")
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True, check=False
        )
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def build_baseline_repository(tree: Path, dest: Path) -> Path:
    """A repository holding `tree`'s generate model (its config and model.py), whose stub
    imports `tree`'s package."""
    package_dir = dest.parent / "baseline_package"
    package_dir.mkdir(parents=True, exist_ok=True)
    (package_dir / "triton_sampling_mask").symlink_to(tree / "plugin")
    model = dest / MODEL
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text((tree / "model_repository" / MODEL / "config.pbtxt").read_text())
    source = (tree / "model_repository" / MODEL / "1" / "model.py").read_text()
    (model / "1" / "model.py").write_text(PREAMBLE.format(path=str(package_dir)) + source)
    return dest


@contextlib.contextmanager
def serving(repository: Path, door: bool, log_path: Path) -> Iterator[TritonServer]:
    """tritonserver on `repository`; with `door`, this tree's whole stack in front of it (the
    repository gains this tree's sampler, which the stack's readiness checks call)."""
    if not door:
        with TritonServer(repository) as server:
            yield server
        return
    from testbed.stack import launch

    copy_model(repository, "sampler")
    stack = launch(repository, log_path, api=False)
    try:
        yield stack
    finally:
        stack.stop()


def _round(url: str, budgets: np.ndarray) -> dict:
    stats = closed_loop(url, MODEL, budgets, stream=True)
    if stats.errors:
        raise RuntimeError(f"{len(stats.errors)} requests failed, e.g. {stats.errors[0]}")
    return {
        "tokens_per_s": stats.tokens / stats.seconds,
        "ttft_p50_ms": 1000 * float(np.percentile(stats.ttft, 50)),
        "ttft_p99_ms": 1000 * float(np.percentile(stats.ttft, 99)),
    }


def run(
    rev: str = DEFAULT_REV, quick: bool = False, rounds: int | None = None, progress=print, door: bool = False
) -> dict:
    """Interleaved rounds on both servers; per side the medians over rounds, and the ratios."""
    size = SIZES["quick" if quick else "full"]
    rounds = rounds or size["rounds"]
    low, high = QUICK_BUDGET if quick else BUDGET_RANGE
    budgets = np.random.default_rng(0).integers(low, high + 1, size=(size["clients"], size["requests"]))
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(checkout(rev))
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        repositories = {
            "current": build_repository(work / "current"),
            "baseline": build_baseline_repository(tree, work / "baseline"),
        }
        servers = {
            side: stack.enter_context(serving(repository, door, work / f"{side}.log"))
            for side, repository in repositories.items()
        }
        for server in servers.values():  # warm-up: first requests load code paths
            closed_loop(server.grpc_url, MODEL, np.full((2, 1), 8), stream=True)
        sides: dict[str, list[dict]] = {"current": [], "baseline": []}
        for index in range(rounds):
            order = ("current", "baseline") if index % 2 == 0 else ("baseline", "current")
            for side in order:
                sides[side].append(_round(servers[side].grpc_url, budgets))
            last = {side: sides[side][-1] for side in sides}
            progress(
                f"  round {index + 1}/{rounds}: tokens/s {last['current']['tokens_per_s']:.0f} (this tree) / "
                f"{last['baseline']['tokens_per_s']:.0f} ({rev})"
            )
    medians = {side: {key: statistics.median(r[key] for r in sides[side]) for key in sides[side][0]} for side in sides}
    return {
        "baseline_rev": rev,
        "baseline_commit": head,
        "door": door,
        "workload": {
            "clients": size["clients"],
            "requests_per_client": size["requests"],
            "max_new_tokens": [low, high],
            "tokens_per_round": int(budgets.sum()),
        },
        "rounds": rounds,
        "sides": sides,
        "medians": medians,
        "ratios": {key: medians["current"][key] / medians["baseline"][key] for key in medians["current"]},
        "wall_s": time.perf_counter() - started,
    }


def table(result: dict) -> str:
    """The comparison as a Markdown table (medians over rounds, ratios this tree / baseline)."""
    rev = f"{result['baseline_rev']} ({result['baseline_commit']})"
    through = ", through the front door" if result.get("door") else ""
    lines = [
        f"| generate, {result['workload']['clients']} streams{through} | tokens/s | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---|---|",
    ]
    for side, label in (("current", "this tree"), ("baseline", rev)):
        m = result["medians"][side]
        lines.append(f"| {label} | {m['tokens_per_s']:.0f} | {m['ttft_p50_ms']:.1f} | {m['ttft_p99_ms']:.1f} |")
    r = result["ratios"]
    lines.append(
        f"| this tree / baseline | {r['tokens_per_s']:.2f}x | {r['ttft_p50_ms']:.2f}x | {r['ttft_p99_ms']:.2f}x |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default=DEFAULT_REV, help=f"the baseline revision (default {DEFAULT_REV})")
    parser.add_argument("--quick", action="store_true", help="2 clients, 1 request of 4-8 tokens, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="round pairs (default 6; 1 with --quick)")
    parser.add_argument("--door", action="store_true", help="each side behind this tree's front door")
    args = parser.parse_args()
    result = run(args.rev, args.quick, args.rounds, door=args.door)
    print(table(result))
    print(f"({result['rounds']} rounds per side, {result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
