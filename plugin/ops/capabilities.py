"""What the server and the host it runs on can do, read once: the tritonserver version, the flags
its `--help` lists, and whether it runs in a container. `ops.workarounds` decides from these
which defences run (docs/upstream-issues.md, "Which defences run where");
`python -m triton_sampling_mask.ops.launcher --show-defences` prints both for this host.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The inode numbers the kernel gives its initial IPC and cgroup namespaces (include/linux/proc_ns.h):
# a process whose namespace has another number has one of its own.
INITIAL_NAMESPACE_INODES = {"ipc": 0xEFFFFFFF, "cgroup": 0xEFFFFFFB}
# What container runtimes leave behind: files at the root, and names in /proc/1/cgroup.
CONTAINER_FILES = ("/.dockerenv", "/run/.containerenv")
CONTAINER_CGROUP_HINTS = ("docker", "kubepods", "containerd", "libpod", "lxc")


@dataclass(frozen=True)
class ServerCapabilities:
    """The server's version ("2.51.0"; "" when unknown) and `--help` flags, and where it runs.

    `container`: a container runtime's marker is present and the process has an IPC or cgroup
    namespace of its own (a machine built from a container image but running on the host's
    namespaces is a bare host). `private_ipc` / `private_cgroup`: which of those namespaces is
    its own, i.e. whether /dev/shm is the container's and the cgroup tree is out of reach."""

    version: str
    flags: frozenset[str]
    container: bool = False
    private_ipc: bool = False
    private_cgroup: bool = False

    @property
    def version_tuple(self) -> tuple[int, ...]:
        """The version as numbers, (0,) when unknown: `caps.version_tuple >= (2, 59)`."""
        numbers = re.findall(r"\d+", self.version)
        return tuple(int(number) for number in numbers) if numbers else (0,)

    def has_flag(self, flag: str) -> bool:
        """Whether the server's `--help` lists `flag` (`--http-max-input-size`)."""
        return flag in self.flags

    def describe(self) -> str:
        """One line for the log."""
        where = "in a container" if self.container else "on a bare host"
        return f"tritonserver {self.version or 'of unknown version'} ({len(self.flags)} flags) {where}"


def help_flags(help_text: str) -> frozenset[str]:
    """The long options a `tritonserver --help` text lists (each at the start of an indented line)."""
    return frozenset(re.findall(r"^\s+(--[a-z0-9-]+)", help_text, flags=re.MULTILINE))


def version_from_log(log_text: str) -> str:
    """The version in tritonserver's start-up table (`| server_version | 2.51.0 |`), or ""."""
    found = re.search(r"\|\s*server_version\s*\|\s*([0-9][0-9A-Za-z.+-]*)\s*\|", log_text)
    return found.group(1) if found else ""


def run_help(binary: str, environ: Mapping[str, str]) -> str:
    """What `binary --help` prints (tritonserver prints its usage and exits 1); "" when it cannot run."""
    try:
        done = subprocess.run(
            [binary, "--help"], capture_output=True, text=True, env=dict(environ), timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def run_version(binary: str, environ: Mapping[str, str]) -> str:
    """The version `binary` reports: it prints its start-up table, then stops at once on a model
    repository that does not exist (no port is opened). TRITON_SERVER_VERSION (set by NGC's
    images) when the binary says nothing; "" when neither is known."""
    missing = Path(tempfile.gettempdir()) / f"triton-version-probe-{os.getpid()}-absent"
    command = [
        binary,
        f"--model-repository={missing}",
        "--allow-http=false",
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--pinned-memory-pool-byte-size=0",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=dict(environ), timeout=60, check=False)
        found = version_from_log(done.stdout + done.stderr)
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    return found or environ.get("TRITON_SERVER_VERSION", "")


def own_namespace(name: str, proc: Path = Path("/proc/self")) -> bool:
    """Whether this process's `name` namespace ("ipc", "cgroup") is not the kernel's initial one."""
    try:
        return (proc / "ns" / name).stat().st_ino != INITIAL_NAMESPACE_INODES[name]
    except OSError:
        return False


def container_marker(environ: Mapping[str, str], root: Path = Path("/")) -> bool:
    """Whether a container runtime left its mark: /.dockerenv, /run/.containerenv, the `container`
    variable (systemd's convention, set by podman), or a runtime's name in /proc/1/cgroup."""
    if environ.get("container") or any((root / name.lstrip("/")).exists() for name in CONTAINER_FILES):
        return True
    try:
        cgroups = (root / "proc" / "1" / "cgroup").read_text()
    except OSError:
        return False
    return any(hint in cgroups for hint in CONTAINER_CGROUP_HINTS)


def read(binary: str, environ: Mapping[str, str], flags: frozenset[str] | None = None) -> ServerCapabilities:
    """The capabilities of `binary` (run with `environ`) on this host; the launcher calls it once.
    `flags`: its `--help` flags where the caller has read them already."""
    private_ipc, private_cgroup = own_namespace("ipc"), own_namespace("cgroup")
    return ServerCapabilities(
        version=run_version(binary, environ),
        flags=help_flags(run_help(binary, environ)) if flags is None else flags,
        container=container_marker(environ) and (private_ipc or private_cgroup),
        private_ipc=private_ipc,
        private_cgroup=private_cgroup,
    )
