"""Stub regions only this user may read: a small preloaded library keeps an fchmod of a /dev/shm
file to the owner's bits (private_shm.c).

The Python backend creates each stub's /dev/shm region, through which every client's tensors
pass, with boost.interprocess, which fchmods it to 0644 right after creating it, so a umask
cannot help. The library is built from its C source with the system C compiler on first use
(into <prefix>/lib/triton-sampling-mask/, rebuilt when the source changes) and preloaded into
tritonserver, whose stubs inherit it. Where no compiler is found the regions stay 0644 and the
server's start says so once. An image builds it ahead, where its root filesystem is writable:

    python -m triton_sampling_mask.ops.private_shm
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("private_shm.c")
_warned = False


def library_path() -> Path:
    """Where the built library lives: beside this interpreter's environment."""
    return Path(sys.prefix) / "lib" / "triton-sampling-mask" / "libprivate_shm.so"


def build(dest: Path | None = None) -> Path:
    """The library at `dest` (default `library_path()`), compiled when missing or older than its
    source. Raises RuntimeError, saying why, when it cannot be built."""
    dest = dest or library_path()
    if dest.exists() and dest.stat().st_mtime >= SOURCE.stat().st_mtime:
        return dest
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build it")
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, dest)  # atomic: a server starting meanwhile never preloads half a file
    except OSError as error:
        raise RuntimeError(f"cannot write {dest}: {error}") from None
    finally:
        partial.unlink(missing_ok=True)
    return dest


def with_private_shm(env: dict[str, str]) -> dict[str, str]:
    """`env` with the library preloaded (a copy); unchanged, with a warning once, where it cannot be built."""
    global _warned
    try:
        library = str(build())
    except RuntimeError as error:
        if not _warned:
            _warned = True
            print(
                f"[private_shm] WARNING: the stubs' /dev/shm regions stay readable by every local user "
                f"(mode 0644): {error}",
                file=sys.stderr,
                flush=True,
            )
        return dict(env)
    env = dict(env)
    preloaded = [entry for entry in env.get("LD_PRELOAD", "").split(":") if entry]
    if library not in preloaded:
        env["LD_PRELOAD"] = ":".join([library, *preloaded])
    return env


def main() -> None:
    """Build the library ahead (an image's build step); exit 1 where it cannot be built."""
    try:
        print(build())
    except RuntimeError as error:
        raise SystemExit(f"private_shm: {error}") from None


if __name__ == "__main__":
    main()
