"""Files under the weights root, opened so that nothing outside the root is ever opened.

A path is walked one component at a time from a descriptor of the root: each component is opened
with O_PATH | O_NOFOLLOW relative to its parent's descriptor, so the kernel follows no symbolic
link and opens no device or FIFO on the way. A link met on the way is read and its target walked
the same way (a relative target from the link's directory, an absolute one only when it names a
path under the root); `..` never climbs above the root. Links that stay under the root (a
`latest` link, Hugging Face's cache of `snapshots/<rev>/` links into `blobs/`) are followed;
links that leave it are refused. This is openat2's RESOLVE_BENEATH done in user space (Python's
os module has no openat2; Go's os.Root works the same way).

What a walk ends on is held open, and every later read goes through that descriptor (through
/proc/self/fd/N for a library that takes a path: that reopens the very file, not a name), so a
file or directory swapped for a link after the check is never read. As a last guard, the
kernel's own name for each descriptor opened must lie under the root's.

A hard link is the file itself: one under the root is read like any other file there (making one
needs write access to the root and, under fs.protected_hardlinks, to own or be able to write the
file it links to).
"""

from __future__ import annotations

import os
import stat

MAX_LINKS = 40  # links followed in one walk: the kernel's own limit for one path
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
OUTSIDE = "is outside the allowed weights root"


class PathRefused(ValueError):
    """A path that cannot be opened under the root; `reason` names no path (the caller does)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _proc_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


class _Root:
    """What an absolute path must start with to be under the root, and the kernel's name for it."""

    def __init__(self, path: str, fd: int):
        self.kernel_name = os.readlink(_proc_path(fd))
        # The root as configured and as the kernel names it (a link above the root resolved).
        spellings = {tuple(_components(os.path.abspath(path))), tuple(_components(self.kernel_name))}
        self.prefixes = [list(spelling) for spelling in spellings]

    def parts(self, path: str) -> tuple[bool, list[str]]:
        """(absolute, components): an absolute `path`'s components relative to the root."""
        parts = _components(path)
        if not path.startswith("/"):
            return False, parts
        for prefix in self.prefixes:
            if parts[: len(prefix)] == prefix:
                return True, parts[len(prefix) :]
        raise PathRefused(OUTSIDE)

    def check_inside(self, fd: int) -> None:
        """The kernel's name for `fd` must be under the root's (a directory moved out of the root
        while it was walked is caught here)."""
        name = os.readlink(_proc_path(fd))
        if name != self.kernel_name and not name.startswith(self.kernel_name.rstrip("/") + "/"):
            raise PathRefused(OUTSIDE)


class _Walk:
    """The descriptors of the directories from the root down to where a walk stands (the first
    `borrowed` belong to the directory it started from and are never closed here)."""

    def __init__(self, fds: list[int], names: list[str]):
        self.fds, self.names, self.borrowed = list(fds), list(names), len(fds)

    @property
    def top(self) -> int:
        return self.fds[-1]

    def push(self, fd: int, name: str) -> None:
        self.fds.append(fd)
        self.names.append(name)

    def pop(self) -> None:
        if not self.names:
            raise PathRefused(OUTSIDE)
        fd = self.fds.pop()
        self.names.pop()
        if len(self.fds) >= self.borrowed:
            os.close(fd)
        else:
            self.borrowed = len(self.fds)

    def close(self) -> None:
        for fd in self.fds[self.borrowed :]:
            os.close(fd)
        self.fds = self.fds[: self.borrowed]

    def owned(self) -> list[int]:
        """Every descriptor of the walk, the borrowed ones duplicated: the caller owns them all."""
        fds = [os.dup(fd) for fd in self.fds[: self.borrowed]] + self.fds[self.borrowed :]
        self.fds, self.borrowed = [], 0
        return fds


class RootedDirectory:
    """A directory under the root, held open with the descriptors of the directories from the
    root down to it (a link's `..` steps back through them). `label` is its path under the root
    ("." for the root itself). Close it, or use it as a context manager."""

    def __init__(self, root: _Root, fds: list[int], names: list[str]):
        self._root, self._fds, self._names = root, fds, names
        self.label = "/".join(names) or "."

    def __enter__(self) -> RootedDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def entries(self) -> list[str]:
        """The names in this directory, sorted."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._fds[-1])
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def has_entry(self, name: str) -> bool:
        """Whether `name` is in this directory (a link counts, wherever it points)."""
        try:
            os.stat(name, dir_fd=self._fds[-1], follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def open_directory(self, path: str) -> RootedDirectory:
        """The directory `path` names: relative to this one, or absolute and under the root."""
        walk = self._walk(path)
        try:
            if not stat.S_ISDIR(os.fstat(walk.top).st_mode):
                raise PathRefused("is not a directory")
        except BaseException:
            walk.close()
            raise
        return RootedDirectory(self._root, walk.owned(), walk.names)

    def open_file(self, path: str) -> RootedFile:
        """The regular file `path` names (as for open_directory), opened for reading."""
        walk = self._walk(path)
        try:
            if not stat.S_ISREG(os.fstat(walk.top).st_mode):
                raise PathRefused("is not a regular file")
            return RootedFile(os.open(_proc_path(walk.top), os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            raise PathRefused(f"cannot be opened ({_reason(exc)})") from None
        finally:
            walk.close()

    def _walk(self, path: str) -> _Walk:
        """Walk `path` from this directory, following links that stay under the root: the walk
        stands on what it names, opened (with O_PATH) and checked to be under the root."""
        walk = _Walk(self._fds, self._names)
        try:
            absolute, pending = self._root.parts(path)
            if absolute:
                while walk.names:
                    walk.pop()
            links = 0
            while pending:
                if not stat.S_ISDIR(os.fstat(walk.top).st_mode):
                    raise PathRefused("is not a directory")
                part = pending.pop(0)
                if part == "..":
                    walk.pop()
                    continue
                fd = os.open(part, _PATH_FLAGS, dir_fd=walk.top)
                if not stat.S_ISLNK(os.fstat(fd).st_mode):
                    walk.push(fd, part)
                    continue
                os.close(fd)
                links += 1
                if links > MAX_LINKS:
                    raise PathRefused("has too many levels of symbolic links")
                absolute, target = self._root.parts(os.readlink(part, dir_fd=walk.top))
                if absolute:
                    while walk.names:
                        walk.pop()
                pending[:0] = target
            self._root.check_inside(walk.top)
            return walk
        except BaseException as exc:
            walk.close()
            if isinstance(exc, FileNotFoundError):
                raise PathRefused("does not exist") from None
            if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, PathRefused):
                # a name too long or holding a NUL, no permission: the reason, never the path
                raise PathRefused(f"cannot be opened ({_reason(exc)})") from None
            raise


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return type(exc).__name__


class RootedFile:
    """A regular file under the root, open for reading. `path` (/proc/self/fd/N) reopens this very
    file for a library that takes a path, whatever its name points to by then."""

    def __init__(self, fd: int):
        self.fd = fd
        self.path = _proc_path(fd)

    def __enter__(self) -> RootedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, limit: int) -> bytes:
        """The file's bytes; PathRefused when it holds more than `limit`."""
        data = bytearray()
        while len(data) <= limit:
            chunk = os.pread(self.fd, limit + 1 - len(data), len(data))
            if not chunk:
                return bytes(data)
            data += chunk
        raise PathRefused(f"is larger than {limit} bytes")


def open_root(path: str) -> RootedDirectory:
    """The weights root itself, held open (the operator's path: a link in it is followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return RootedDirectory(_Root(path, fd), [fd], [])
    except BaseException:
        os.close(fd)
        raise
