"""Lint the container files: hadolint on the Dockerfile, shellcheck on the shell scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHELL_SCRIPTS = sorted(REPO_ROOT.glob("docker/*.sh")) + [REPO_ROOT / ".ci" / "run"]


def tool(name: str) -> str:
    """A linter installed by `make setup` (the `lint` extra) beside this interpreter."""
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is missing: run `make setup` (it installs the lint extra)"
    return str(path)


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_passes_hadolint():
    run([tool("hadolint"), "--no-color", "docker/Dockerfile"])


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shell_scripts_pass_shellcheck(script):
    run([tool("shellcheck"), str(script)])
