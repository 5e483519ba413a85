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
    python -m tests.mutation.mutate --rerun-survivors   # after adding tests: only the last run's survivors

A rerun stages afresh beside the run (build/mutation/<package>-rerun, with the test list as it is
now) and runs only the mutants the run left alive; the report takes each mutant's status from the
rerun where it ran there, else from the run. The source must be the run's (mutant names number the
mutations of each function): it refuses to rerun when plugin/ differs from the run's copy.

Not part of the test suite: a full run takes hours on two cores. Run it before a release.
"""

from __future__ import annotations

import argparse
import datetime
import math
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
# Reviewed survivors that do change behaviour, but where no unit test here can see it (same format).
EXPLAINED = Path(__file__).with_name("survivors.txt")
REPORT = ROOT / "bench" / "results" / "mutation.md"
PACKAGES = ("sampling", "generation")
# Never mutated: Triton kernels (mutmut's trampolines would replace the @triton.jit functions it
# compiles from source; the interpreter tests cover them) and package docstrings.
NOT_MUTATED = ("sampling/fused.py", "*/__init__.py")
# The unit tests that can kill each package's mutants, run in-process (tests that import the package in
# a subprocess see the unmutated copy): the sampler against the float64 reference on every path, its
# rules and batcher; the generation loop and speculative decoding. The fused kernels' interpreter
# tests are left out (fused.py is not mutated, and the interpreter is slow).
TESTS = {
    "sampling": (
        "tests/test_sampler.py",
        "tests/test_serving_batches.py",
        "tests/test_gpu_branches_on_cpu.py",
        "tests/test_boundaries.py",
        "tests/test_ranked_candidates_ties.py",
        "tests/test_cross_path_draws.py",
        "tests/test_rng.py",
        "tests/test_validation.py",
        "tests/test_batching.py",
        "tests/test_sampling_params.py",
        "tests/test_output_contract.py",
        "tests/test_generate_retries.py",
        "tests/test_backends.py",
        "tests/test_rejection_labels.py",
        "tests/test_batch_sampler_rows.py",
        "tests/test_wire_values.py",
        "tests/test_host_arrays.py",
        "tests/test_ranked_candidates_layouts.py",
        "tests/test_unranked_draw.py",
        "tests/test_margin_top_k_run_at_k.py",
        "tests/test_input_table.py",
        "tests/test_log_prob_rounding.py",
        "tests/test_normaliser_blocks.py",
        "tests/test_row_plans.py",
    ),
    "generation": (
        "tests/test_generation.py",
        "tests/test_speculative.py",
        "tests/test_speculative_drafts.py",
        "tests/test_weights.py",
        "tests/test_weight_manifests.py",
        "tests/test_weight_groups.py",
        "tests/test_weight_sources.py",
        "tests/test_generation_requests.py",
        "tests/test_cache_layout.py",
        "tests/test_engine_pause.py",
        "tests/test_lm_loading.py",
        "tests/test_engine_bookkeeping.py",
    ),
}
# A test that runs this long under a mutant has hung (a loop that never stops): a failure, so a kill.
TEST_TIMEOUT_S = 90
# Appended to the staged tests' conftest: each mutant's tests run fastest first (by the durations of
# mutmut's traced clean run), so a killed mutant usually fails within its first, cheapest tests; and
# hypothesis tests draw at most MUTATION_MAX_EXAMPLES examples (a surviving mutant runs every test
# that covers it: the float64 reference tests' hundreds of examples would cost minutes per survivor).
ORDER_PLUGIN = """

import pytest as _pytest


@_pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    from mutmut.state import state

    durations = state().duration_by_test
    if durations:
        items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))
    cap = int(os.environ.get("MUTATION_MAX_EXAMPLES", "0"))
    for item in items if cap else ():
        test = getattr(item, "obj", None)
        chosen = getattr(test, "_hypothesis_internal_use_settings", None)
        if chosen is not None and chosen.max_examples > cap:
            test._hypothesis_internal_use_settings = settings(chosen, max_examples=cap)
"""


def stage(package: str, modules: list[str], where: Path | None = None) -> Path:
    """A fresh build/mutation/<package>/ (or `where`): the package as src/triton_sampling_mask, the
    tests and the settings that mutate `modules` (paths under plugin/) against that package's tests."""
    where = where or STAGE / package
    shutil.rmtree(where, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "plugin", where / "src" / PACKAGE, ignore=ignore)
    shutil.copytree(ROOT / "tests", where / "tests", ignore=ignore)
    conftest = where / "tests" / "conftest.py"
    conftest.write_text(conftest.read_text() + ORDER_PLUGIN)
    shutil.copytree(ROOT / "model_repository", where / "model_repository", ignore=ignore)  # the contract tests read it
    paths = [f"src/{PACKAGE}/{module}" for module in modules]
    only = [path if path.endswith(".py") else f"{path.rstrip('/')}/*" for path in paths]
    settings = f"""[tool.mutmut]
source_paths = ["src"]
only_mutate = {_toml_list(only)}
do_not_mutate = {_toml_list([f"src/{PACKAGE}/{p}" for p in NOT_MUTATED])}
pytest_add_cli_args_test_selection = {_toml_list(list(TESTS[package]))}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not gpu"]
use_git_change_detection = false
also_copy = ["model_repository"]

[tool.pytest.ini_options]
markers = ["gpu: needs a CUDA device", "slow: minutes each"]
timeout = {TEST_TIMEOUT_S}
"""
    (where / "pyproject.toml").write_text(settings)
    return where


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(f'"{value}"' for value in values) + "]"


def rerun_stage(package: str) -> Path:
    return STAGE / f"{package}-rerun"


def alive(found: dict[str, tuple[str, Path]]) -> list[str]:
    """The mutants of a run that no test killed (survived, no tests, ...), not counting unrun ones."""
    return sorted(name for name, (status, _) in found.items() if status not in KILLED and status not in NOT_RUN)


def same_source(package: str) -> bool:
    """Whether plugin/<package> is still the source the staged run mutated."""
    staged = STAGE / package / "src" / PACKAGE / package
    here = ROOT / "plugin" / package
    files = sorted(p.relative_to(here) for p in here.rglob("*.py"))
    return all((staged / f).exists() and (staged / f).read_bytes() == (here / f).read_bytes() for f in files)


def run_mutmut(where: Path, children: int, names: list[str], max_examples: int) -> int:
    """mutmut run in the stage (its exit status), over `names` (mutant names or globs; none: every
    mutant); the mutated package is found first on sys.path there, ahead of the editable install's
    plugin/."""
    # One intra-op thread: mutmut forks a child per mutant from a process that has run torch, and an
    # OpenMP pool started before a fork hangs in the child.
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    # CI=1: hypothesis draws the same examples in the clean run and under every mutant (tests/conftest.py).
    env = {**os.environ, **threads, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1", "CI": "1"}
    env["MUTATION_MAX_EXAMPLES"] = str(max_examples)
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *names]
    return subprocess.run(command, cwd=where, env=env).returncode


def mutmut(where: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=where, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"mutmut {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def results(where: Path) -> dict[str, tuple[str, Path]]:
    """Every mutant of a staged run: its status (killed, survived, no tests, timeout, ...) and stage."""
    found = {}
    if (where / "mutants").is_dir():
        for line in mutmut(where, "results", "--all", "true").splitlines():
            name, separator, status = line.strip().rpartition(": ")
            if separator and "__mutmut_" in name:
                found[name] = (status, where)
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
    """The reviewed mutants of `path`: (function, mutated line) -> why it changes no behaviour
    (equivalent.txt) or why no test here catches it (survivors.txt)."""
    equivalent = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            function, mutated, reason = (part.strip() for part in line.split("\t", 2))
            equivalent[function, mutated] = reason
    return equivalent


# Statuses that kill a mutant: a test failed, hung or crashed with it.
KILLED = ("killed", "timeout", "segfault", "caught by type check")
# Statuses of mutants the run never got to (stopped early): left out of every count but their own.
NOT_RUN = ("not checked", "check was interrupted by user")


def _percent(part: int, whole: int) -> float:
    """part / whole in percent, rounded down to 0.1 (a rate short of 100% never reads 100.0%)."""
    return math.floor(1000 * part / max(1, whole)) / 10


def report(found: dict[str, tuple[str, Path]], modules: list[str]) -> str:
    """The Markdown report: kill rate per module and overall, then every survivor's diff."""
    equivalent, explained = read_equivalent(), read_equivalent(EXPLAINED)
    statuses = {name: status for name, (status, _) in found.items()}
    survivors, matched = {}, {}
    for name, status in sorted(statuses.items()):
        if status not in KILLED and status not in NOT_RUN:
            diff = mutmut(found[name][1], "show", name).split("\n", 1)[1]
            key = next(((function_of(name), line) for line in mutated_lines(diff)), None)
            if key in equivalent:
                matched[name] = equivalent[key]
            else:
                survivors[name] = (status, diff, explained.get(key))
    unchecked = {n for n, status in statuses.items() if status in NOT_RUN}
    rows = []
    for module in sorted({module_of(name) for name in statuses}):
        names = [n for n in statuses if module_of(n) == module and n not in unchecked]
        counts = Counter(statuses[n] for n in names)
        equivalents = sum(1 for n in names if n in matched)
        not_run = sum(1 for n in unchecked if module_of(n) == module)
        rows.append((module, len(names), sum(counts[status] for status in KILLED), equivalents, not_run))
    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    equivalents = sum(r[3] for r in rows)
    rate = _percent(killed, total - equivalents)
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
        f"({total} mutants run, {equivalents} equivalent, {len(survivors)} surviving"
        + (f"; {len(unchecked)} not run: the run was stopped before them" if unchecked else "")
        + ").",
        "",
        "| module | mutants run | killed | equivalent | survived | kill rate | not run |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for module, count, dead, same, not_run in rows:
        alive = count - dead - same
        rate = _percent(dead, count - same)
        lines.append(f"| {module} | {count} | {dead} | {same} | {alive} | {rate:.1f}% | {not_run} |")
    lines += ["", "## Surviving mutants", ""]
    if not survivors:
        lines.append("None.")
    for name, (status, diff, why) in survivors.items():
        lines += [f"### `{name}` ({status})", ""]
        lines += [f"Why it survives (tests/mutation/survivors.txt): {why}", ""] if why else []
        lines += ["```diff", *diff.splitlines()[2:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modules", nargs="+", default=list(PACKAGES), help="packages or modules under plugin/ (sampling/rng.py)"
    )
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (one: the machine is shared)")
    parser.add_argument("--mutants", nargs="+", default=[], help="mutmut names or globs to run (default: all)")
    parser.add_argument(
        "--max-examples", type=int, default=25, help="cap on each hypothesis test's examples (0: the tests' own)"
    )
    parser.add_argument("--keep-stage", action="store_true", help="resume the last staged run, do not restage")
    parser.add_argument("--report-only", action="store_true", help="report the last staged run, run nothing")
    parser.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="run only the last run's survivors, with the tests as they are now",
    )
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    by_package = {package: [m for m in args.modules if m.split("/")[0] == package] for package in PACKAGES}
    unknown = [m for m in args.modules if m.split("/")[0] not in PACKAGES]
    if unknown:
        parser.error(f"not under plugin/sampling or plugin/generation: {unknown}")
    if args.rerun_survivors:
        for package, modules in by_package.items():
            if not modules:
                continue
            if not same_source(package):
                parser.error(f"plugin/{package} changed since its staged run: run it again instead")
            names = alive(results(STAGE / package))
            if names:
                where = stage(package, modules, rerun_stage(package))
                status = run_mutmut(where, args.max_children, names, args.max_examples)
                if status:
                    print(f"mutmut rerun over {package} exited with {status}", file=sys.stderr)
    elif not args.report_only:
        for package, modules in by_package.items():
            if modules:
                if not args.keep_stage:  # a new run: an earlier run's rerun no longer applies
                    shutil.rmtree(rerun_stage(package), ignore_errors=True)
                where = STAGE / package if args.keep_stage else stage(package, modules)
                names = [name for name in args.mutants if f".{package}." in name]
                if args.mutants and not names:
                    continue
                status = run_mutmut(where, args.max_children, names, args.max_examples)
                if status:
                    print(f"mutmut run over {package} exited with {status}", file=sys.stderr)
    found = {}
    for package, modules in by_package.items():
        if modules:
            found |= results(STAGE / package)
            rerun = {name: got for name, got in results(rerun_stage(package)).items() if got[0] not in NOT_RUN}
            found |= {name: got for name, got in rerun.items() if name in found}
    text = report(found, args.modules)
    args.report.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
