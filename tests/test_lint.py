"""Lint the container files: hadolint on the Dockerfile, shellcheck on the shell scripts (docker/,
bench/, .ci/run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHELL_SCRIPTS = (
    sorted(REPO_ROOT.glob("docker/*.sh")) + sorted(REPO_ROOT.glob("bench/*.sh")) + [REPO_ROOT / ".ci" / "run"]
)


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


def test_dockerfile_copies_only_files_that_exist():
    lines = (REPO_ROOT / "docker" / "Dockerfile").read_text().splitlines()
    sources = [part for line in lines if line.startswith("COPY ") for part in line.split()[1:-1]]
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (REPO_ROOT / source).exists(), source


def test_compose_reserves_gpus_and_shared_memory():
    import yaml

    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    service = compose["services"]["sampler"]
    context = (REPO_ROOT / "docker" / service["build"]["context"]).resolve()
    assert (context / service["build"]["dockerfile"]).is_file()
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert service["shm_size"]
    assert {p.split(":")[1] for p in service["ports"]} == {"8000", "8001", "8002"}
