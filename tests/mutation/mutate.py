"""Mutation testing of plugin/sampling/ and plugin/generation/ with mutmut (`make mutate`).

mutmut imports the mutated code under the package's own name, which it derives from the file's
path; the package lives in plugin/ but imports as triton_sampling_mask, so the run is staged in
build/mutation/: the package copied to src/triton_sampling_mask/, the tests beside it and a
pyproject.toml holding the mutmut settings below. Every mutant is then run against the unit tests
that cover its function (mutmut's own selection from a first traced run), and the result is
written as a Markdown report: the kill rate per module, and each surviving mutant's diff, minus
the reviewed equivalent mutants of tests/mutation/equivalent.txt (each with why it is one).

    python -m tests.mutation.mutate                     # both packages
    python -m tests.mutation.mutate --modules sampling/sampler.py generation/engine.py
    python -m tests.mutation.mutate --report-only       # the report of the last staged run

Not part of the test suite: a full run takes hours on two cores. Run it before a release.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "build" / "mutation"
PACKAGE = "triton_sampling_mask"
EQUIVALENT = Path(__file__).with_name("equivalent.txt")
REPORT = ROOT / "bench" / "results" / "mutation.md"
PACKAGES = ("sampling", "generation")
# Never mutated: Triton kernels (mutmut's trampolines would replace the @triton.jit functions it
# compiles from source; the interpreter tests cover them) and package docstrings.
NOT_MUTATED = ("sampling/fused.py", "*/__init__.py")
# The unit tests of the two packages: the sampler against the float64 reference on every path,
# its rules and its batcher, the generation loop and speculative decoding. Tests of the server,
# the client's wire, the container and the bench tools are left out (they test neither package).
TESTS = (
    "tests/test_sampler.py",
    "tests/test_serving_batches.py",
    "tests/test_gpu_branches_on_cpu.py",
    "tests/test_boundaries.py",
    "tests/test_ranked_candidates_ties.py",
    "tests/test_cross_path_draws.py",
    "tests/test_rng.py",
    "tests/test_validation.py",
    "tests/test_batching.py",
    "tests/test_hot_path.py",
    "tests/test_sampler_memory.py",
    "tests/test_sampling_params.py",
    "tests/test_output_contract.py",
    "tests/test_generation.py",
    "tests/test_speculative.py",
    "tests/test_speculative_drafts.py",
)


def stage(modules: list[str]) -> None:
    """A fresh build/mutation/: the package as src/triton_sampling_mask, the tests, the settings."""
    shutil.rmtree(STAGE, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "plugin", STAGE / "src" / PACKAGE, ignore=ignore)
    shutil.copytree(ROOT / "tests", STAGE / "tests", ignore=ignore)
    paths = [f"src/{PACKAGE}/{module}" for module in modules]
    only = [path if path.endswith(".py") else f"{path.rstrip('/')}/*" for path in paths]
    settings = f"""[tool.mutmut]
source_paths = ["src"]
only_mutate = {_toml_list(only)}
do_not_mutate = {_toml_list([f"src/{PACKAGE}/{p}" for p in NOT_MUTATED])}
pytest_add_cli_args_test_selection = {_toml_list(list(TESTS))}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not gpu"]
use_git_change_detection = false

[tool.pytest.ini_options]
markers = ["gpu: needs a CUDA device", "slow: minutes each"]
timeout = 600
"""
    (STAGE / "pyproject.toml").write_text(settings)


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(f'"{value}"' for value in values) + "]"


def run_mutmut(children: int) -> int:
    """mutmut run in the stage (its exit status); the mutated package is found first on sys.path
    there, ahead of the editable install's plugin/."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(children)]
    return subprocess.run(command, cwd=STAGE, env=env).returncode


def mutmut(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=STAGE, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"mutmut {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def results() -> dict[str, str]:
    """Every mutant's status by name (killed, survived, no tests, timeout, ...)."""
    found = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, separator, status = line.strip().rpartition(": ")
        if separator and "__mutmut_" in name:
            found[name] = status
    return found


def mutated_lines(diff: str) -> list[str]:
    """The lines a mutant's diff adds, stripped."""
    return [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def function_of(name: str) -> str:
    """A mutant's function, as mutmut names it (`module.x_function`, `module.xǁClassǁmethod`)."""
    return name.partition("__mutmut_")[0]


def module_of(name: str) -> str:
    return re.split(r"\.x[_ǁ]", function_of(name), maxsplit=1)[0]


def read_equivalent(path: Path = EQUIVALENT) -> dict[tuple[str, str], str]:
    """The reviewed equivalent mutants: (function, mutated line) -> why it changes no behaviour."""
    equivalent = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            function, mutated, reason = (part.strip() for part in line.split(" | ", 2))
            equivalent[function, mutated] = reason
    return equivalent


def report(statuses: dict[str, str], modules: list[str]) -> str:
    """The Markdown report: kill rate per module and overall, then every survivor's diff."""
    equivalent = read_equivalent()
    survivors, matched = {}, {}
    for name, status in sorted(statuses.items()):
        if status in ("survived", "no tests", "suspicious", "timeout", "skipped"):
            diff = mutmut("show", name).split("\n", 1)[1]
            key = next(((function_of(name), line) for line in mutated_lines(diff)), None)
            if status != "timeout" and key in equivalent:
                matched[name] = equivalent[key]
            else:
                survivors[name] = (status, diff)
    rows = []
    for module in sorted({module_of(name) for name in statuses}):
        names = [n for n in statuses if module_of(n) == module]
        counts = Counter(statuses[n] for n in names)
        equivalents = sum(1 for n in names if n in matched)
        rows.append((module, len(names), counts["killed"] + counts["timeout"], equivalents))
    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    equivalents = sum(r[3] for r in rows)
    rate = 100.0 * killed / max(1, total - equivalents)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    lines = [
        "# Mutation testing (`make mutate`)",
        "",
        f"mutmut over {', '.join(modules)} (plugin/), against the unit tests listed in tests/mutation/mutate.py; "
        f"run {when} at commit {commit.stdout.strip() or '?'}.",
        "A mutant is killed when a test fails (or times out) with it; the equivalent ones (reviewed, in "
        "tests/mutation/equivalent.txt with why) change no behaviour and are left out of the rate.",
        "",
        f"**{killed} of {total - equivalents} non-equivalent mutants killed: {rate:.1f}%** "
        f"({total} mutants, {equivalents} equivalent, {len(survivors)} surviving).",
        "",
        "| module | mutants | killed | equivalent | survived | kill rate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for module, count, dead, same in rows:
        alive = count - dead - same
        lines.append(f"| {module} | {count} | {dead} | {same} | {alive} | {100.0 * dead / max(1, count - same):.1f}% |")
    lines += ["", "## Surviving mutants", ""]
    if not survivors:
        lines.append("None.")
    for name, (status, diff) in survivors.items():
        lines += [f"### `{name}` ({status})", "", "```diff", *diff.splitlines()[2:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modules", nargs="+", default=list(PACKAGES), help="packages or modules under plugin/ (sampling/rng.py)"
    )
    parser.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--report-only", action="store_true", help="report the last staged run, run nothing")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    if not args.report_only:
        stage(args.modules)
        status = run_mutmut(args.max_children)
        if status:
            print(f"mutmut run exited with {status}", file=sys.stderr)
    text = report(results(), args.modules)
    args.report.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
