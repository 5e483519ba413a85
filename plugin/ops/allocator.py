"""The memory allocator tritonserver runs with.

Under many concurrent large requests glibc's malloc fragments tritonserver's heap across its
threads and never returns the memory. Triton's docs recommend preloading tcmalloc or jemalloc;
jemalloc, with its background purging thread (settings.MALLOC_CONF), keeps RSS flat under the
same load. `make setup` installs Debian's libjemalloc2 where it can; TRITON_MALLOC=system opts out.
"""

from __future__ import annotations

from pathlib import Path

from . import settings

# Where Debian/Ubuntu (and the NGC images) put the libraries, by preference.
CANDIDATES = {
    "jemalloc": [
        "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
        "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
        "/usr/lib64/libjemalloc.so.2",
    ],
    "tcmalloc": [
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    ],
}


def find_allocator(preference: str | None = None) -> tuple[str, str | None]:
    """(name, library path) of the allocator to preload: TRITON_MALLOC (jemalloc, tcmalloc or
    system) or the first one installed; ("system", None) when none is."""
    preference = (preference or settings.TRITON_MALLOC.value()).strip().lower()
    if preference == "system":
        return "system", None
    names = [preference] if preference in CANDIDATES else list(CANDIDATES)
    for name in names:
        for path in CANDIDATES[name]:
            if Path(path).exists():
                return name, path
    return "system", None


def with_allocator(env: dict[str, str], preference: str | None = None) -> dict[str, str]:
    """`env` with the chosen allocator preloaded (a copy; `env` itself is not changed)."""
    name, library = find_allocator(preference)
    env = dict(env)
    if library is None:
        return env
    preloaded = [entry for entry in env.get("LD_PRELOAD", "").split(":") if entry]
    if library not in preloaded:
        env["LD_PRELOAD"] = ":".join([library, *preloaded])
    if name == "jemalloc":
        env["MALLOC_CONF"] = settings.MALLOC_CONF.value(env)
    return env
