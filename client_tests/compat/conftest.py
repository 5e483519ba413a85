"""The compat suite: each RL framework's published client, from .venv/compat (`make compat` builds it),
driven against the stack `make serve` runs (front door included). Without that venv every test here
skips: the main suite does not install the frameworks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from testbed.stack import launch, shipped_repository

from . import venv

DRIVERS = Path(__file__).resolve().parent / "drivers"
DRIVER_TIMEOUT_S = 240
# Keyless trainers (AReaL, skyrl-train, slime, Miles send no header on their weight calls) are let in by
# source network, as docs/api.md tells their users to; the tests reach the front door from loopback.
TRUSTED = "127.0.0.1/32"


def pytest_collection_modifyitems(config, items):
    if venv.ready():
        return
    skip = pytest.mark.skip(reason=f"the compat venv ({venv.VENV}) is absent or stale: `make compat` builds it")
    here = str(Path(__file__).resolve().parent)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """`make serve`'s stack on free ports: launcher, supervisor, tritonserver, the API behind HAProxy."""
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        pytest.skip("haproxy is not installed: the front door cannot run")
    root = tmp_path_factory.mktemp("compat_stack")
    env = {"TRITON_API_TRUSTED_NETWORKS": TRUSTED}
    running = launch(shipped_repository(root / "models"), root / "launcher.log", env=env)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def api_url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports['api']}"


def run_driver(name: str, **arguments) -> dict:
    """Run drivers/<name>.py with the compat venv's python: it drives the framework's own client and
    prints one JSON object (what the client handed back) as its last stdout line."""
    completed = subprocess.run(
        [str(venv.PYTHON), str(DRIVERS / f"{name}.py"), json.dumps(arguments)],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(DRIVERS), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    )
    lines = completed.stdout.strip().splitlines()
    if completed.returncode != 0 or not lines:
        raise AssertionError(f"driver {name} failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1])
