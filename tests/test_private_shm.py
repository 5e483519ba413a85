"""The library preloaded into tritonserver (ops/private_shm.py): an fchmod of a /dev/shm file keeps
the owner's bits only, as the Python backend's fchmod to 0644 of each stub region needs; any other
file keeps the mode asked for."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from triton_sampling_mask.ops import private_shm

# Create a file (mode 0600 asked) and fchmod it to 0644, as boost.interprocess does with a region.
CREATE_AND_FCHMOD = (
    "import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600); os.fchmod(fd, 0o644)"
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the library cannot be built (the launcher warns and goes on)")
    return private_shm.build(tmp_path_factory.mktemp("private-shm") / "libprivate_shm.so")


def mode_after_fchmod(path: Path, preload: Path | None) -> str:
    env = {**os.environ, "LD_PRELOAD": str(preload)} if preload else dict(os.environ)
    try:
        subprocess.run([sys.executable, "-c", CREATE_AND_FCHMOD, str(path)], env=env, check=True, timeout=60)
        return oct(stat.S_IMODE(path.stat().st_mode))
    finally:
        path.unlink(missing_ok=True)


def test_an_fchmod_under_dev_shm_keeps_the_owners_bits_only(library, tmp_path):
    region = Path("/dev/shm") / f"tsm_private_shm_test_{os.getpid()}"
    assert mode_after_fchmod(region, None) == "0o644"  # what the stubs' regions get without it
    assert mode_after_fchmod(region, library) == "0o600"
    assert mode_after_fchmod(tmp_path / "elsewhere", library) == "0o644"  # other files: as asked


def test_it_is_preloaded_beside_what_is_there(library, monkeypatch):
    monkeypatch.setattr(private_shm, "library_path", lambda: library)
    env = private_shm.with_private_shm({"LD_PRELOAD": "/lib/other.so"})
    assert env["LD_PRELOAD"] == f"{library}:/lib/other.so"
    assert private_shm.with_private_shm(env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # once
