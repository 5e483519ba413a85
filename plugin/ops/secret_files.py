"""Files that hold a secret (the admin key, client keys): made by this process, or the user's own
and readable by this user only.

A secret is written only into a file this process creates (O_CREAT | O_EXCL | O_NOFOLLOW, mode
0600): a local user who creates the path first, or plants a symbolic link there, makes the write
fail instead of receiving the secret in a file they own. By default the file lies in a fresh
private directory (`private_directory`: mode 0700, a random name); a path the user chooses is
refused when it exists already or its directory is writable by other users (`check_chosen_path`).
A client key file the user writes (`read_client_keys`) must be this user's, readable by no one else.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

from .server_process import ADMIN_KEY_CHARACTERS, MIN_ADMIN_KEY_CHARS

# Names of the private directories made here, so that `remove_secret_file` removes only those;
# `process_directory`'s name the process that made them.
PRIVATE_DIR_PREFIX = "triton-"
OWNER_PID = re.compile(r"-pid([0-9]{1,10})-[^-]+$")
# A client key has the admin key's shape (no space, nothing HAProxy's map files or headers read
# apart); a client's name is a short word, as logged.
KEY_PATTERN = re.compile(f"{ADMIN_KEY_CHARACTERS}{{{MIN_ADMIN_KEY_CHARS},512}}")
CLIENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
API_KEY_CLIENT = "api-key"  # TRITON_API_KEY's name as a client key


def private_directory(name: str) -> Path:
    """A new directory `<tmp>/triton-<name>-<random>`, mode 0700 (mkdtemp never reuses a path)."""
    return Path(tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{name}-"))


def process_directory(name: str) -> Path:
    """A private directory whose name carries this process's pid, made after removing this user's
    earlier ones whose process is gone: a process killed before it could clean up (SIGKILL, the
    OOM killer) left its secrets there. A pid reused since is left alone (the safe side)."""
    for stale in Path(tempfile.gettempdir()).glob(f"{PRIVATE_DIR_PREFIX}*"):
        owner = OWNER_PID.search(stale.name)
        if owner is None or psutil.pid_exists(int(owner[1])):
            continue
        try:  # another start may be removing it too
            if stat.S_ISDIR((info := os.lstat(stale)).st_mode) and info.st_uid == os.geteuid():
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    return private_directory(f"{name}-pid{os.getpid()}")


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


def read_client_keys(path: Path | None, api_key: str = "") -> dict[str, str]:
    """Client name -> key: each `<name> <key>` line of `path` (blank lines and `#` comments
    skipped), and `api_key` (TRITON_API_KEY) as API_KEY_CLIENT when it has a key's shape (it must,
    beside a file). Raises ValueError saying which line is wrong and why, never what it holds."""
    keys = {API_KEY_CLIENT: api_key} if api_key and KEY_PATTERN.fullmatch(api_key) else {}
    if path is None:
        return keys
    if api_key and not keys:
        raise ValueError("TRITON_API_KEY must have a client key's shape (32 to 512 of A-Z a-z 0-9 . _ ~ + / -)")
    info = os.stat(path)
    if info.st_uid not in (os.geteuid(), 0) or info.st_mode & 0o077:
        raise ValueError(
            f"{path} must be yours (or root's) and readable by its owner only (mode {stat.S_IMODE(info.st_mode):o}: "
            "chmod 600)"
        )
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2 or not CLIENT_NAME_PATTERN.fullmatch(fields[0]) or not KEY_PATTERN.fullmatch(fields[1]):
            raise ValueError(
                f"{path}, line {number}: expected `<name> <key>`, a name of up to 64 of A-Z a-z 0-9 . _ - and a "
                "key of 32 to 512 of A-Z a-z 0-9 . _ ~ + / -"
            )
        if fields[0] in (*keys, API_KEY_CLIENT) or fields[1] in keys.values():
            raise ValueError(
                f"{path}, line {number}: a name or key given twice, or TRITON_API_KEY's ({API_KEY_CLIENT})"
            )
        keys[fields[0]] = fields[1]
    return keys
