"""What the load tools read about a server's processes (psutil): its process tree, each process's
memory (RSS and its kinds, USS, PSS), CPU time and /dev/shm mappings, and the /dev/shm regions
the tree maps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

SHM_PREFIX = "/dev/shm/"


def process_tree(pid: int) -> list[psutil.Process]:
    """A live process and all its descendants (tritonserver and its Python stubs), parent first;
    empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def process_tree_rss(pid: int) -> int:
    """Resident bytes (RSS) of a process and all its descendants (tritonserver and its Python stubs).

    RSS counts a shared page once per process, and once per mapping within a process: the
    Python backend's /dev/shm pool is mapped by both tritonserver and its stub, and every time the
    pool grows the backend maps the whole region again and keeps the old mappings
    (`SharedMemoryManager::GrowIfNeeded`, python_backend src/shm_manager.cc), so a pool that grew
    n times can count up to 2n times here. `process_tree_memory` gives PSS beside it."""
    total = 0
    for process in process_tree(pid):
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU seconds of a process, with its live descendants unless told not to."""
    total = 0.0
    for process in process_tree(pid) if descendants else process_tree(pid)[:1]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


@dataclass
class ProcessMemory:
    """One process's memory, in bytes: RSS and its kinds, USS and PSS, its CPU seconds so far and
    its mappings of /dev/shm files."""

    pid: int
    name: str  # "tritonserver", "stub:<model>" or the executable's name
    rss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    uss: int = 0
    pss: int = 0
    cpu_s: float = 0.0
    shm_mappings: int = 0  # mappings of /dev/shm files (the stub's pool, once per growth)


def process_name(process: psutil.Process) -> str:
    """ "tritonserver", "stub:<model>" (a Python-backend stub) or the executable's name."""
    argv = process.cmdline()
    executable = Path(argv[0]).name if argv else process.name()
    if executable == "triton_python_backend_stub" and len(argv) > 1:
        parts = Path(argv[1]).parts  # <repository>/<model>/<version>/model.py
        return f"stub:{parts[-3]}" if len(parts) >= 3 else "stub"
    return executable


def _rss_kinds(pid: int) -> dict[str, int]:
    # psutil has no split of RSS into anonymous, file and shared-memory pages: /proc/PID/status has.
    kinds = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in kinds:
            found[kinds[key]] = int(line.split()[1]) * 1024
    return found


def process_memory(process: psutil.Process) -> ProcessMemory | None:
    """The memory of one live process (None once it is gone)."""
    try:
        with process.oneshot():
            full = process.memory_full_info()
            times = process.cpu_times()
            memory = ProcessMemory(
                process.pid,
                process_name(process),
                rss=full.rss,
                uss=full.uss,
                pss=full.pss,
                cpu_s=times.user + times.system,
                **_rss_kinds(process.pid),
            )
        memory.shm_mappings = sum(m.path.startswith(SHM_PREFIX) for m in process.memory_maps(grouped=False))
    except (psutil.Error, OSError):
        return None
    return memory


def process_tree_memory(pid: int) -> list[ProcessMemory]:
    """`process_memory` of a process and each of its live descendants."""
    return [memory for memory in map(process_memory, process_tree(pid)) if memory is not None]


def mapped_shm_regions(pids: list[int]) -> dict[str, int]:
    """The /dev/shm files these processes map, with their sizes in bytes (each counted once)."""
    names = set()
    for pid in pids:
        try:
            names.update(m.path for m in psutil.Process(pid).memory_maps() if m.path.startswith(SHM_PREFIX))
        except psutil.Error:
            continue
    sizes = {}
    for name in names:
        try:
            sizes[Path(name).name] = os.stat(name).st_size
        except OSError:
            pass
    return sizes
