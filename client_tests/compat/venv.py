"""The compat suite's venv (.venv/compat): the frameworks' published clients at the versions the
suite is about, apart from the project's venv.

The clients install with --no-deps (clients.txt), then what their modules import (imports.txt) with
its dependencies under constraints taken from the project's venv. The project's venv stays
visible behind the venv's own packages (a .pth file), so torch and transformers are shared, not
installed twice. `python -m client_tests.compat.venv` (re)builds it when a requirement file changed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
VENV = REPO_ROOT / ".venv" / "compat"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".installed"
REQUIREMENT_FILES = (HERE / "clients.txt", HERE / "imports.txt", Path(__file__).resolve())
# Requires-Python ==3.12.* in its metadata, pure Python in fact.
IGNORE_REQUIRES_PYTHON = {"skyrl-train"}
SYSTEM_PYTHON = "/usr/bin/python3"


def requirements(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def fingerprint() -> str:
    digest = hashlib.sha256()
    for path in REQUIREMENT_FILES:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def ready() -> bool:
    """Whether the venv is built from the current requirement files."""
    return PYTHON.exists() and STAMP.exists() and STAMP.read_text() == fingerprint()


def pip(*args: str) -> None:
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True)


def build() -> None:
    if VENV.exists():
        shutil.rmtree(VENV)
    base = SYSTEM_PYTHON if Path(SYSTEM_PYTHON).exists() else sys.executable
    subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    own = Path(
        subprocess.check_output(
            [str(PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # The project's packages after the venv's own: a client's pinned copy wins, the rest is shared.
    (own / "zz_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clients = requirements(HERE / "clients.txt")
    plain = [c for c in clients if c.split("==")[0] not in IGNORE_REQUIRES_PYTHON]
    pip("--no-deps", *plain)
    for client in clients:
        if client.split("==")[0] in IGNORE_REQUIRES_PYTHON:
            pip("--no-deps", "--ignore-requires-python", client)
    frozen = subprocess.check_output([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], text=True)
    shared = [line for line in frozen.splitlines() if "==" in line and not line.startswith(("openai==", "httpx=="))]
    constraints = VENV / "project-constraints.txt"
    constraints.write_text("\n".join(shared) + "\n")
    pip("-c", str(constraints), "-r", str(HERE / "imports.txt"))
    STAMP.write_text(fingerprint())


def main() -> int:
    if ready():
        print(f"{VENV.relative_to(REPO_ROOT)} is up to date")
        return 0
    build()
    print(f"built {VENV.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
