"""Remove the /dev/shm regions dead Python-backend stubs leave behind. Why by hand: the Python
backend never unlinks a dead stub's region (python_backend PR #431, open), and Triton 2.51 keeps a
dead stub's region mapped until tritonserver exits.

After a server's exit, `remove_unused_regions` removes the regions under its prefix
(`server_shm_prefix`) that no live process maps or holds open: a region in use is never touched.
Under a live server, `DeadStubRegions` unlinks the regions no current stub names, and
`leaked_regions` measures what tritonserver still maps of them, for the supervisor to restart it
past a bound (docs/operations.md, "Stub regions in /dev/shm").

    python -m triton_sampling_mask.ops.shm_cleanup PREFIX [--dry-run]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
# The Python backend's own default prefix (--backend-config=python,shm-region-prefix-name=...).
DEFAULT_STUB_PREFIX = "triton_python_backend_shm_region_"
# The Python backend's stub binary; it is started as `STUB_BINARY <model.py> <region name> ...`.
STUB_BINARY = "triton_python_backend_stub"


def server_shm_prefix(http_port: int) -> str:
    """The stub-region prefix of the server on `http_port`: two live servers on one host never
    share an HTTP port, and a region left with it by an earlier, dead server is garbage."""
    return f"{DEFAULT_STUB_PREFIX}p{http_port}_"


def regions_in_use(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the regions under `shm_dir` that some live process maps or holds open (processes
    we may not inspect are skipped)."""
    base = str(shm_dir).rstrip("/") + "/"
    used: set[str] = set()
    for process in psutil.process_iter():
        # The mappings from /proc/PID/maps: psutil's memory_maps parses smaps (page counts of every
        # mapping), far slower over every process of the host, for the same file names.
        try:
            with open(f"/proc/{process.pid}/maps", errors="replace") as maps:
                for line in maps:
                    at = line.find(base)
                    if at >= 0:
                        used.add(line[at + len(base) :].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            used.update(f.path[len(base) :] for f in process.open_files() if f.path.startswith(base))
        except psutil.Error:
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


@dataclass
class Stub:
    """A live Python-backend stub process: the region it was started with, the model instance it
    serves (e.g. `sampler_0_0`) and when it started (seconds since the epoch)."""

    pid: int
    region: str
    instance: str
    started: float


def stub_process(pid: int) -> Stub | None:
    """The stub `pid` is (it is started as `STUB_BINARY <model.py> <region> <default size>
    <growth size> <parent pid> <library dir> <ipc handle> <instance> ...`), or None when `pid` is
    not a live stub."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            argv, started = process.cmdline(), process.create_time()
    except psutil.Error:
        return None
    if len(argv) < 3 or os.path.basename(argv[0]) != STUB_BINARY:
        return None
    return Stub(pid, argv[2], argv[8] if len(argv) > 8 else str(pid), started)


def current_stubs(stub_pids: Iterable[int]) -> list[Stub]:
    """The live stubs among `stub_pids` that serve their instance now: of two stubs of one
    instance (a reload replaced one that hung or stopped; Triton never ends it), the newer."""
    newest: dict[str, Stub] = {}
    for stub in filter(None, map(stub_process, stub_pids)):
        if stub.instance not in newest or stub.started > newest[stub.instance].started:
            newest[stub.instance] = stub
    return list(newest.values())


@dataclass
class MappedRegion:
    """A stub region as one process maps it: a region that grew is mapped once per size, so its
    largest mapping is its size; `deleted`: its file was unlinked while the process maps it."""

    name: str
    size: int
    deleted: bool


def mapped_regions(pid: int, prefix: str, shm_dir: Path = SHM_DIR) -> dict[int, MappedRegion]:
    """The regions named `prefix*` that process `pid` maps, by inode (from /proc/<pid>/maps:
    psutil's memory maps carry no inode, and an unlinked region and a new one may share a name)."""
    base = str(shm_dir).rstrip("/") + "/" + prefix
    regions: dict[int, MappedRegion] = {}
    try:
        with open(f"/proc/{pid}/maps", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith(base):
                    continue
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                path = fields[5].rstrip("\n")
                deleted = path.endswith(" (deleted)")
                name = path.removesuffix(" (deleted)").rsplit("/", 1)[1]
                inode = int(fields[4])
                size = max(end - start, regions[inode].size if inode in regions else 0)
                regions[inode] = MappedRegion(name, size, deleted)
    except OSError:  # the process is gone
        pass
    return regions


def leaked_regions(server_pid: int, prefix: str, shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """(count, bytes) of the unlinked regions tritonserver `server_pid` still maps: dead stubs'
    regions, whose memory only its exit returns."""
    leaked = [region for region in mapped_regions(server_pid, prefix, shm_dir).values() if region.deleted]
    return len(leaked), sum(region.size for region in leaked)


class DeadStubRegions:
    """Unlinks the regions of stubs that died, or that a reload replaced, under a live tritonserver.

    A region tritonserver maps that no current stub of it names (`current_stubs`) is a dead or
    replaced stub's, unless it is being created for a stub about to start: so only a region seen
    orphaned by two calls of `sweep` in a row (a watchdog interval apart) is unlinked. The
    mappings stay (a replaced stub still works on them); the name is freed and `leaked_regions`
    counts the region. One instance per tritonserver process."""

    def __init__(self, prefix: str, shm_dir: Path = SHM_DIR):
        if not prefix:
            raise ValueError("a prefix is required: never sweep every region")
        self.prefix = prefix
        self.shm_dir = shm_dir
        self._suspects: set[str] = set()

    def sweep(self, server_pid: int, stub_pids: Iterable[int]) -> list[str]:
        """Unlink the regions orphaned now and at the previous sweep; returns their names."""
        named = {stub.region for stub in current_stubs(stub_pids)}
        orphans = {
            region.name
            for region in mapped_regions(server_pid, self.prefix, self.shm_dir).values()
            if not region.deleted and region.name not in named
        }
        dead = sorted(orphans & self._suspects)
        self._suspects = orphans - set(dead)
        for name in dead:
            (self.shm_dir / name).unlink(missing_ok=True)
        return dead


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
