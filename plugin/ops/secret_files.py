"""Files that hold a secret (the admin key): made by this process, readable by this user only.

A secret is written only into a file this process creates (O_CREAT | O_EXCL | O_NOFOLLOW, mode
0600): a local user who creates the path first, or plants a symbolic link there, makes the write
fail instead of receiving the secret in a file they own. By default the file lies in a fresh
private directory (`private_directory`: mode 0700, a random name); a path the user chooses is
refused when it exists already or its directory is writable by other users (`check_chosen_path`).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

# Names of the private directories made here, so that `remove_secret_file` removes only those.
PRIVATE_DIR_PREFIX = "triton-"


def private_directory(name: str) -> Path:
    """A new directory `<tmp>/triton-<name>-<random>`, mode 0700 (mkdtemp never reuses a path)."""
    return Path(tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{name}-"))


def check_chosen_path(path: Path) -> None:
    """Raise ValueError, saying why, unless a secret may be created at `path`: nothing there yet,
    in an existing directory that only this user (or root) owns and may write."""
    if os.path.lexists(path):
        raise ValueError(f"{path} exists already: a secret is written only to a file created for it")
    directory = path.parent
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        raise ValueError(f"its directory {directory} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{directory} is not a directory")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"its directory {directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
            "choose a directory only you may write"
        )
    if info.st_uid not in (os.geteuid(), 0):
        raise ValueError(f"its directory {directory} belongs to another user (uid {info.st_uid})")


def write_secret_file(path: Path, text: str) -> None:
    """Create `path` (it must not exist; a symbolic link there is refused too), mode 0600, holding `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # whatever the umask
        handle.write(text)


def remove_secret_file(path: Path) -> None:
    """Remove a secret's file, and its directory when `private_directory` made it and it is empty."""
    path.unlink(missing_ok=True)
    directory = path.parent
    if directory.name.startswith(PRIVATE_DIR_PREFIX) and directory.parent == Path(tempfile.gettempdir()):
        try:
            directory.rmdir()
        except OSError:  # not empty, or gone
            pass
