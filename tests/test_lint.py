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


def copy_sources() -> list[str]:
    """The sources of every COPY in docker/Dockerfile (flags such as --chmod left out)."""
    lines = (REPO_ROOT / "docker" / "Dockerfile").read_text().splitlines()
    words = [line.split()[1:] for line in lines if line.startswith("COPY ")]
    return [word for copy in words for word in [w for w in copy if not w.startswith("--")][:-1]]


def test_dockerfile_copies_only_files_that_exist():
    sources = copy_sources()
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (REPO_ROOT / source).exists(), source


def test_build_context_holds_exactly_what_the_dockerfile_copies():
    """docker/Dockerfile.dockerignore excludes everything (`*`), then lets in each COPY source."""
    ignore = REPO_ROOT / "docker" / "Dockerfile.dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", patterns
    allowed = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    assert allowed == {source.rstrip("/") for source in copy_sources()}, (allowed, copy_sources())


def test_compose_reserves_gpus_and_shared_memory():
    import yaml

    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    service = compose["services"]["sampler"]
    context = (REPO_ROOT / "docker" / service["build"]["context"]).resolve()
    assert (context / service["build"]["dockerfile"]).is_file()
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert service["shm_size"]
    # HTTP, gRPC, metrics, and the probe port (its /metrics: the front door's refusals)
    assert {p.split(":")[1] for p in service["ports"]} == {"8000", "8001", "8002", "8003"}
