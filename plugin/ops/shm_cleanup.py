"""Remove the /dev/shm regions a dead tritonserver's Python stubs leave behind.

Each Python-backend stub talks to tritonserver through a region `/dev/shm/<prefix><uuid>`. A
clean exit unlinks it; a crashed stub, a killed server or an exit that hits the exit timeout
leaves it there for good (1 MiB and up each; a full /dev/shm breaks every later model load).
The launcher gives each server a prefix of its own (`server_shm_prefix`) and, after any exit,
removes the regions with that prefix that no live process maps or holds open; a region some
process still uses is never touched, so another server's regions are safe even under a shared
prefix.

    python -m triton_sampling_mask.ops.shm_cleanup PREFIX [--dry-run]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# The Python backend's own default prefix (--backend-config=python,shm-region-prefix-name=...).
DEFAULT_STUB_PREFIX = "triton_python_backend_shm_region_"


def server_shm_prefix(http_port: int) -> str:
    """The stub-region prefix of the server on `http_port`: two live servers on one host never
    share an HTTP port, and a region left with it by an earlier, dead server is garbage."""
    return f"{DEFAULT_STUB_PREFIX}p{http_port}_"


def regions_in_use(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the regions under `shm_dir` that some live process maps or holds open
    (from /proc/*/maps and /proc/*/fd; processes we may not inspect are skipped)."""
    base = str(shm_dir).rstrip("/") + "/"
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps", errors="replace") as maps:
                for line in maps:
                    at = line.find(base)
                    if at >= 0:
                        used.add(line[at + len(base) :].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in os.scandir(proc / "fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith(base):
                    used.add(target[len(base) :].removesuffix(" (deleted)"))
        except OSError:
            pass
    return used


def unused_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Regions named `prefix*` that no live process uses."""
    if not prefix:
        raise ValueError("a prefix is required: never sweep every region")
    candidates = sorted(p for p in shm_dir.glob(prefix + "*") if p.is_file())
    if not candidates:
        return []
    used = regions_in_use(shm_dir)
    return [p for p in candidates if p.name not in used]


def remove_unused_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the regions named `prefix*` that no live process uses; returns their names."""
    removed = []
    for path in unused_regions(prefix, shm_dir):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:  # its server unlinked it meanwhile
            pass
    return removed


def main(argv: list[str] | None = None) -> int:
    """Remove (or with --dry-run list) the unused regions under a prefix."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help=f"region name prefix, e.g. {server_shm_prefix(8000)}")
    parser.add_argument("--dry-run", action="store_true", help="list, do not remove")
    args = parser.parse_args(argv)
    if args.dry_run:
        names = [p.name for p in unused_regions(args.prefix)]
    else:
        names = remove_unused_regions(args.prefix)
    for name in names:
        print(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
