"""The HAProxy each image line installs, unpacked here so that the front door's config is checked
with it: 2.4 (the 24.10 line's Ubuntu 22.04) and 2.8 (the 26.09 line's Ubuntu 24.04).

    python scripts/haproxy_lines.py [--dest .venv/haproxy-lines]     # prints what it unpacked

Each line's packages come from the Ubuntu archive (its index names the current build), unpacked
with `dpkg-deb -x`, never installed. 2.8 needs the glibc of 24.04, newer than this host's, so its
glibc, Lua and OpenSSL are unpacked beside it and it runs through that glibc's loader
(`command()`); the other libraries come from the host.
"""

from __future__ import annotations

import argparse
import lzma
import subprocess
import sys
import urllib.request
from pathlib import Path

ARCHIVE = "http://archive.ubuntu.com/ubuntu"
# line -> (Ubuntu release, packages to unpack beside haproxy, whether it runs through its own loader)
LINES = {
    "2.4": ("jammy", (), False),
    "2.8": ("noble", ("libc6", "liblua5.4-0", "libssl3t64"), True),
}
DEFAULT_DEST = Path(__file__).resolve().parent.parent / ".venv" / "haproxy-lines"
LIBRARIES = "usr/lib/x86_64-linux-gnu"


def _index(release: str) -> dict[str, str]:
    """Package name -> its file in the archive, the updates pocket first."""
    files: dict[str, str] = {}
    for pocket in (f"{release}-updates", release):
        url = f"{ARCHIVE}/dists/{pocket}/main/binary-amd64/Packages.xz"
        with urllib.request.urlopen(url, timeout=60) as answer:
            text = lzma.decompress(answer.read()).decode()
        for block in text.split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and line[0] != " ")
            if "Package" in fields and "Filename" in fields:
                files.setdefault(fields["Package"], fields["Filename"])
    return files


def unpack(line: str, dest: Path = DEFAULT_DEST) -> Path:
    """Unpack `line`'s haproxy (and what it needs) under dest/line, once; the folder."""
    release, extra, _ = LINES[line]
    root = dest / line
    if (root / "usr/sbin/haproxy").exists():
        return root
    files = _index(release)
    root.mkdir(parents=True, exist_ok=True)
    for package in ("haproxy", *extra):
        deb = dest / Path(files[package]).name
        urllib.request.urlretrieve(f"{ARCHIVE}/{files[package]}", deb)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        deb.unlink()
    return root


def command(line: str, dest: Path = DEFAULT_DEST) -> list[str] | None:
    """The command that runs `line`'s haproxy, or None when it is not unpacked."""
    root = dest / line
    binary = root / "usr/sbin/haproxy"
    if not binary.exists():
        return None
    if not LINES[line][2]:
        return [str(binary)]
    libraries = root / LIBRARIES
    return [str(libraries / "ld-linux-x86-64.so.2"), "--library-path", f"{libraries}:/{LIBRARIES}", str(binary)]


def main(argv: list[str] | None = None) -> int:
    """Unpack every line's haproxy and print its version."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args(argv)
    for line in LINES:
        unpack(line, args.dest)
        version = subprocess.run([*command(line, args.dest), "-v"], capture_output=True, text=True, check=True)
        print(f"{line}: {version.stdout.splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
