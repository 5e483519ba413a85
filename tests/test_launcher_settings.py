"""The launcher's server settings: the sizing flags every server gets unless the caller sets them,
and the environment its stubs inherit."""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_sampling_mask.ops import allocator, launcher, server_process, settings


def test_resource_args_default_the_pool_and_the_http_threads(monkeypatch):
    monkeypatch.delenv("TRITON_HTTP_THREAD_COUNT", raising=False)
    args = server_process.resource_args([])
    assert f"--backend-config=python,shm-default-byte-size={64 * 2**20}" in args
    assert f"--backend-config=python,shm-growth-byte-size={64 * 2**20}" in args
    assert sum(arg.startswith("--http-thread-count=") for arg in args) == 1


def test_a_callers_flags_win_over_the_defaults():
    given = ["--backend-config=python,shm-default-byte-size=1048576", "--http-thread-count=5"]
    args = server_process.resource_args(given)
    assert not any("shm-default-byte-size" in arg or arg.startswith("--http-thread-count") for arg in args)
    assert any("shm-growth-byte-size" in arg for arg in args)  # the one not given keeps its default


def test_http_threads_are_half_the_cores_within_bounds(monkeypatch):
    monkeypatch.delenv("TRITON_HTTP_THREAD_COUNT", raising=False)
    assert [server_process.http_thread_count(cores) for cores in (1, 2, 6, 64)] == [2, 2, 3, 8]
    monkeypatch.setenv("TRITON_HTTP_THREAD_COUNT", "1")
    assert server_process.http_thread_count(16) == 1


def test_stub_openmp_threads_spin_briefly_unless_the_user_chose(monkeypatch):
    """libgomp's default ~3 ms spin made Triton's batcher miss wake-ups (500 ms queue stalls);
    passive waits cost a futex wake-up per parallel region. A user's own setting stays."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = server_process.server_environment()
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert server_process.server_environment()["GOMP_SPINCOUNT"] == "500"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    env = server_process.server_environment()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env


def test_the_pool_sizes_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHM_DEFAULT_BYTES", str(8 * 2**20))
    monkeypatch.setenv("SHM_GROWTH_BYTES", "")  # empty: the default
    args = server_process.resource_args([])
    assert f"--backend-config=python,shm-default-byte-size={8 * 2**20}" in args
    assert f"--backend-config=python,shm-growth-byte-size={64 * 2**20}" in args


def test_jemalloc_gets_its_purge_options_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    name, library = allocator.find_allocator("jemalloc")
    if name != "jemalloc":
        pytest.skip("libjemalloc2 is not installed here")
    env = allocator.with_allocator({}, "jemalloc")
    assert env["LD_PRELOAD"] == library and "background_thread:true" in env["MALLOC_CONF"]
    assert allocator.with_allocator({"MALLOC_CONF": "narenas:2"}, "jemalloc")["MALLOC_CONF"] == "narenas:2"
    assert "LD_PRELOAD" not in allocator.with_allocator({}, "system")


def fake_server(tmp_path: Path, *options: str) -> str:
    """An executable that answers --help as tritonserver does (usage on stderr, exit 1)."""
    script = tmp_path / "tritonserver"
    usage = "\\n".join(f"  {option} <integer>" for option in ("--http-port", *options))
    script.write_text(f"#!/bin/sh\nprintf 'Usage: tritonserver [options]\\n{usage}\\n' >&2\nexit 1\n")
    script.chmod(0o755)
    return str(script)


def test_the_2_51_server_gets_no_flag_it_does_not_know():
    """The nvidia-pytriton wheel's 2.51 lists neither flag; it refuses unknown ones at start."""
    binary = str(server_process.pytriton_root() / "tritonserver" / "bin" / "tritonserver")
    known = server_process.server_flags(binary)
    assert {"--http-restricted-api", "--exit-timeout-secs", "--model-control-mode"} <= known, sorted(known)
    assert not {"--http-max-input-size", "--allow-client-shm"} & known
    assert server_process.compatibility_args(binary) == []


def test_a_newer_server_holds_the_largest_request_and_allows_client_shm(tmp_path):
    binary = fake_server(tmp_path, "--http-max-input-size", "--allow-client-shm")
    assert server_process.compatibility_args(binary) == [
        f"--http-max-input-size={server_process.HTTP_MAX_INPUT_BYTES}",
        "--allow-client-shm=true",
    ]
    given = ["--http-max-input-size=1024", "--allow-client-shm=false"]
    assert server_process.compatibility_args(binary, given) == []  # the caller's flags win
    assert server_process.HTTP_MAX_INPUT_BYTES > settings.LARGEST_REQUEST_BYTES + 2**20  # a binary header fits too
    assert server_process.server_flags(str(tmp_path / "missing")) == frozenset()


def test_a_server_that_lists_only_old_flags_gets_none(tmp_path):
    assert server_process.compatibility_args(fake_server(tmp_path, "--grpc-port")) == []


def test_the_admin_key_stays_out_of_the_servers_and_stubs_environment(monkeypatch):
    monkeypatch.setenv("TRITON_ADMIN_KEY", "secret-key")
    env = server_process.server_environment()
    assert "TRITON_ADMIN_KEY" not in env and "secret-key" not in env.values()


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--http-port=8000"], "TRITON_HTTP_PORT"),  # a Triton command line's habit: the door's port
        (["--grpc-port", "8001"], "TRITON_GRPC_PORT"),
        (["--http-address=0.0.0.0"], "loopback"),  # tritonserver in front of the door
        (["--http-restricted-api=model-repository:k=v"], "TRITON_ADMIN_KEY"),
        (["--backend-config=python,shm-region-prefix-name=mine"], "swept"),
    ],
)
def test_the_launcher_refuses_a_flag_it_sets_itself_before_anything_starts(flags, says, capsys):
    """tritonserver reads a flag's last copy, and the caller's come last: one of these moved a
    port from where the supervisor and the door look, or opened what the door guards."""
    with pytest.raises(SystemExit) as refusal:  # --check-door: without the check, it checks the door and exits
        launcher.main(["--model-repository", "model_repository", "--check-door", "--", *flags])
    assert says in str(refusal.value) and flags[0].split("=")[0] in str(refusal.value)
    assert "[launcher]" not in capsys.readouterr().out  # refused before the launcher printed anything


def test_flags_the_launcher_leaves_to_the_caller_pass():
    server_process.check_caller_flags(["--log-verbose=1", "--http-thread-count=4"], proxied=True, admin_locked=True)
    # without the door tritonserver faces clients itself, and with the admin APIs open the lock is the caller's
    server_process.check_caller_flags(["--http-address=127.0.0.1"], proxied=False, admin_locked=True)
    server_process.check_caller_flags(["--http-restricted-api=model-repository:k=v"], proxied=True, admin_locked=False)
