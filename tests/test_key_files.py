"""The generated admin key reaches no one else: it is written only into a file the launcher creates
(mode 0600) in a private directory, never into a file or link another local user prepared, and a
chosen TRITON_ADMIN_KEY_FILE in a directory others may write is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from triton_sampling_mask.ops.launcher import resolve_admin_key
from triton_sampling_mask.ops.secret_files import process_directory, remove_secret_file

PORT = 18000


@pytest.fixture
def tmp_dir(tmp_path, monkeypatch):
    """A temporary directory of the test's own as <tmp>, no key set, no key file chosen."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TRITON_ADMIN_KEY", raising=False)
    monkeypatch.delenv("TRITON_ADMIN_KEY_FILE", raising=False)
    return tmp_path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_generated_key_lies_in_a_new_private_directory_and_leaves_with_it(tmp_dir):
    key, where, path = resolve_admin_key(PORT)
    assert path.read_text() == key + "\n" and str(path) in where and key not in where
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert path.parent.parent == tmp_dir and path.parent.name.startswith(f"triton-admin-key-{PORT}-")
    _, _, second = resolve_admin_key(PORT)  # a second server on the same port gets its own directory
    assert second.parent != path.parent
    remove_secret_file(path)
    assert not path.parent.exists() and second.exists()


def test_a_file_another_user_created_at_the_old_path_never_receives_the_key(tmp_dir):
    planted = tmp_dir / f"triton-admin-key-{PORT}"  # the predictable default before
    planted.write_text("")
    planted.chmod(0o666)
    key, _, path = resolve_admin_key(PORT)
    assert path != planted and planted.read_text() == ""
    assert key in path.read_text()


@pytest.mark.parametrize("prepared", ["file", "symlink"])
def test_a_chosen_key_file_that_exists_already_is_refused(tmp_dir, monkeypatch, prepared):
    chosen, target = tmp_dir / "key", tmp_dir / "elsewhere"
    target.write_text("")
    if prepared == "file":
        chosen.write_text("")
    else:
        chosen.symlink_to(target)
    monkeypatch.setenv("TRITON_ADMIN_KEY_FILE", str(chosen))
    with pytest.raises(SystemExit) as refusal:
        resolve_admin_key(PORT)
    assert f"TRITON_ADMIN_KEY_FILE={chosen}" in str(refusal.value) and "exists already" in str(refusal.value)
    assert target.read_text() == "" and os.path.lexists(chosen)


@pytest.mark.parametrize("directory_mode", [0o777, 0o1777, 0o770])
def test_a_chosen_key_file_in_a_directory_others_may_write_is_refused(tmp_dir, monkeypatch, directory_mode):
    shared = tmp_dir / "shared"
    shared.mkdir()
    shared.chmod(directory_mode)
    monkeypatch.setenv("TRITON_ADMIN_KEY_FILE", str(shared / "key"))
    with pytest.raises(SystemExit) as refusal:
        resolve_admin_key(PORT)
    assert "writable by other users" in str(refusal.value)
    assert not (shared / "key").exists()


def test_a_chosen_key_file_in_a_private_directory_is_written_and_kept_there(tmp_dir, monkeypatch):
    private = tmp_dir / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TRITON_ADMIN_KEY_FILE", str(private / "key"))
    key, _, path = resolve_admin_key(PORT)
    assert path == private / "key" and path.read_text() == key + "\n" and mode(path) == 0o600
    remove_secret_file(path)
    assert not path.exists() and private.is_dir()  # the user's directory stays


def test_a_key_given_in_the_environment_writes_no_file(tmp_dir, monkeypatch):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "given-key-0123456789abcdef-0123456789")
    assert resolve_admin_key(PORT) == ("given-key-0123456789abcdef-0123456789", "from TRITON_ADMIN_KEY", None)
    assert list(tmp_dir.iterdir()) == []


@pytest.mark.parametrize("key", ["a", "x" * 31, "y" * 513, "k" * 40 + "==", "k" * 40 + " space"])
def test_a_short_or_malformed_chosen_key_stops_the_start(tmp_dir, monkeypatch, key):
    """A one-character key is guessed in a few tries: a chosen key is 32 to 512 characters that
    tritonserver's flags can carry, else the launcher stops before anything starts."""
    monkeypatch.setenv("TRITON_ADMIN_KEY", key)
    with pytest.raises(SystemExit) as refusal:
        resolve_admin_key(PORT)
    assert "TRITON_ADMIN_KEY" in str(refusal.value) and (len(key) < 8 or key not in str(refusal.value))


def test_a_long_chosen_key_is_taken_and_a_generated_one_is_long(tmp_dir, monkeypatch):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "k" * 32)
    assert resolve_admin_key(PORT)[0] == "k" * 32
    monkeypatch.delenv("TRITON_ADMIN_KEY")
    key, _, path = resolve_admin_key(PORT)
    assert len(key) >= 32
    remove_secret_file(path)


def test_a_start_removes_what_a_killed_process_left_and_only_that(tmp_dir):
    """A launcher killed before it could clean up (SIGKILL, the OOM killer) left its admin key, or
    its front door's key and maps, in <tmp>; the next start removes them, never a live process's
    directory, another kind of file, or one from before directories named their process."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names a process that no longer exists (a pid reused since is left alone)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = tmp_dir / f"triton-front-door-pid{gone.pid}-abc123"
        running = tmp_dir / f"triton-front-door-pid{live.pid}-def456"
        unnamed = tmp_dir / "triton-front-door-ghi789"
        other = tmp_dir / f"someone-else-pid{gone.pid}-jkl012"
        for directory in (left, running, unnamed, other):
            directory.mkdir()
            (directory / "admin.key").write_text("k\n")
        made = process_directory("admin-key-18000")
        assert not left.exists() and running.exists() and unnamed.exists() and other.exists()
        assert made.name.startswith(f"triton-admin-key-18000-pid{os.getpid()}-") and mode(made) == 0o700
    finally:
        live.kill()
        live.wait()
