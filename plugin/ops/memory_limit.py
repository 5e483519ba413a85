"""A memory limit around tritonserver and its stubs, so a request that blows up the server's
memory kills the server (which the supervisor restarts), never a random process of the host.
Why by hand: tritonserver bounds no memory of its own, and on a bare host nothing else gives one
child a cgroup (in a container, the container's own limit does: ops.workarounds turns this off).
A cgroup of its own (v2, else v1) where a memory controller is writable, else an address-space
limit (none where CUDA devices are visible): docs/operations.md, "Memory limit".

    python -m triton_sampling_mask.ops.memory_limit   # what `make serve` would use here
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import psutil

from . import settings

V1_UNLIMITED = 2**62  # v1 reports "no limit" as a huge page-rounded number


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, options) of every cgroup mount."""
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return []
    return [
        (part.mountpoint, part.fstype, set(part.opts.split(",")))
        for part in partitions
        if part.fstype in ("cgroup", "cgroup2")
    ]


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy: "" for v2, else each v1 controller name."""
    # psutil names no cgroups: /proc/self/cgroup does.
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    except (OSError, ValueError):
        pass
    return own


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _counter(path: Path, key: str) -> int:
    """The value of `key` in a flat keyed file (memory.events, memory.oom_control), 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class MemoryCage:
    """Where the limit is enforced: `kind` is "cgroup v2", "cgroup v1", "address space" or "none"."""

    kind: str
    limit_bytes: int
    path: Path | None = None  # the cgroup's directory

    def enter(self) -> None:
        """In the forked tritonserver before exec: join the cgroup, or take the address-space limit
        (its stubs inherit either). Uses only os calls: it runs between fork and exec."""
        if self.path is not None:
            fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
        elif self.kind == "address space":
            resource.setrlimit(resource.RLIMIT_AS, (self.limit_bytes, self.limit_bytes))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended inside the cgroup so far."""
        if self.kind == "cgroup v2":
            return _counter(self.path / "memory.events", "oom_kill")
        if self.kind == "cgroup v1":
            return _counter(self.path / "memory.oom_control", "oom_kill")
        return 0

    def remove(self) -> None:
        """Remove the cgroup (once nothing runs in it)."""
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass

    def describe(self) -> str:
        """One line for the log."""
        if self.kind == "none":
            return "no memory limit"
        where = f" ({self.path})" if self.path else " on tritonserver and each stub"
        return f"memory limit {self.limit_bytes / 2**30:.1f} GiB by {self.kind}{where}"


def available_memory() -> int:
    """The host's memory, or the limit of the cgroup this process runs in when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    own = _own_cgroups()
    for mount, kind, options in _mounts():
        if kind == "cgroup2" and "" in own:
            limit = _read_int(Path(mount) / own[""].lstrip("/") / "memory.max")
        elif kind == "cgroup" and "memory" in options and "memory" in own:
            limit = _read_int(Path(mount) / own["memory"].lstrip("/") / "memory.limit_in_bytes")
        else:
            continue
        if limit and limit < V1_UNLIMITED:
            total = min(total, limit)
    return total


def default_limit() -> int:
    """TRITON_MEMORY_LIMIT_BYTES, else three quarters of `available_memory()`."""
    given = settings.TRITON_MEMORY_LIMIT_BYTES.value()
    return available_memory() * 3 // 4 if given is None else given


def _try_cgroup(parent: Path, name: str, files: dict[str, int], kind: str, limit: int) -> MemoryCage | None:
    cgroup = parent / name
    try:
        cgroup.mkdir(exist_ok=True)
        for file_name, value in files.items():
            target = cgroup / file_name
            if target.exists():
                target.write_text(str(value))
        if not os.access(cgroup / "cgroup.procs", os.W_OK):
            raise OSError("cgroup.procs not writable")
    except OSError:
        try:
            cgroup.rmdir()
        except OSError:
            pass
        return None
    return MemoryCage(kind, limit, cgroup)


def make_cage(name: str, limit_bytes: int | None = None) -> MemoryCage:
    """A cage for one supervisor's tritonserver: a cgroup `name` under this process's own where a
    memory controller is writable (v2, then v1), else the address-space fallback (none with
    CUDA devices, or when the limit is 0)."""
    limit = default_limit() if limit_bytes is None else limit_bytes
    if limit <= 0:
        return MemoryCage("none", 0)
    own = _own_cgroups()
    mounts = _mounts()
    for mount, kind, _ in mounts:
        if kind != "cgroup2" or "" not in own:
            continue
        parent = Path(mount) / own[""].lstrip("/")
        try:
            controllers = (parent / "cgroup.subtree_control").read_text().split()
            if "memory" not in controllers and "memory" in (parent / "cgroup.controllers").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
                controllers.append("memory")
        except OSError:
            continue
        if "memory" in controllers:
            cage = _try_cgroup(parent, name, {"memory.max": limit, "memory.swap.max": 0}, "cgroup v2", limit)
            if cage:
                return cage
    for mount, kind, options in mounts:
        if kind == "cgroup" and "memory" in options and "memory" in own:
            parent = Path(mount) / own["memory"].lstrip("/")
            files = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
            cage = _try_cgroup(parent, name, files, "cgroup v1", limit)
            if cage:
                return cage
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return MemoryCage("none", 0)
    return MemoryCage("address space", limit)


def main() -> None:
    """Print the cage `make serve` would make here (and remove it)."""
    cage = make_cage(f"triton-memory-limit-probe-{os.getpid()}")
    print(cage.describe())
    cage.remove()


if __name__ == "__main__":
    main()
