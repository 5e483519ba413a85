"""What the load tools read from /proc about a server: its process tree, each process's memory
(RSS by kind, PSS, CPU time, /dev/shm mappings) and the /dev/shm regions the tree maps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (tritonserver and its Python stubs), parent first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(sorted(children.get(current, []), reverse=True))
    return found


def process_tree_rss(pid: int) -> int:
    """Resident bytes (VmRSS) of a process and all its descendants (tritonserver and its Python stubs).

    VmRSS counts a shared page once per process, and once per mapping within a process: the
    Python backend's /dev/shm pool is mapped by both tritonserver and its stub, and every time the
    pool grows the backend maps the whole region again and keeps the old mappings
    (`SharedMemoryManager::GrowIfNeeded`, python_backend src/shm_manager.cc), so a pool that grew
    n times can count up to 2n times here. `process_tree_memory` gives PSS beside it."""
    total = 0
    for current in process_tree(pid):
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


@dataclass
class ProcessMemory:
    """One process's memory, in bytes: VmRSS and its kinds (/proc/PID/status), PSS and its
    shared-memory part (/proc/PID/smaps_rollup), and its CPU seconds so far."""

    pid: int
    name: str  # "tritonserver", "stub:<model>" or the executable's name
    rss: int = 0
    anon: int = 0
    file: int = 0
    shmem: int = 0
    pss: int = 0
    pss_shmem: int = 0
    cpu_s: float = 0.0
    shm_mappings: int = 0  # mappings of /dev/shm files (the stub's pool, once per growth)


def _process_name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    executable = Path(argv[0].decode(errors="replace")).name
    if executable == "triton_python_backend_stub" and len(argv) > 1:
        parts = Path(argv[1].decode(errors="replace")).parts  # <repository>/<model>/<version>/model.py
        return f"stub:{parts[-3]}" if len(parts) >= 3 else "stub"
    return executable


def process_memory(pid: int) -> ProcessMemory | None:
    """The memory of one live process (None once it is gone)."""
    kinds = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    rollup = {"Pss": "pss", "Pss_Shmem": "pss_shmem"}
    try:
        memory = ProcessMemory(pid, _process_name(pid))
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in kinds:
                setattr(memory, kinds[key], int(line.split()[1]) * 1024)
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in rollup:
                setattr(memory, rollup[key], int(line.split()[1]) * 1024)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        memory.cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        memory.shm_mappings = sum(" /dev/shm/" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    except (OSError, ValueError, IndexError):
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
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(
            line.split(None, 5)[5]
            for line in maps.splitlines()
            if " /dev/shm/" in line and len(line.split(None, 5)) == 6
        )
    sizes = {}
    for name in names:
        try:
            sizes[Path(name).name] = os.stat(name).st_size
        except OSError:
            pass
    return sizes
