"""The tritonserver process: which binary, with which environment and flags.

Finds the `tritonserver` shipped in the `nvidia-pytriton` wheel (or a Triton image's own), prepares
the Python backend's folder for this interpreter, builds the server's environment and command line
(sizing, hardening, the admin APIs locked behind a key). The CLI (`ops.launcher`), the supervisor
(`ops.supervisor`) and the tests' `testbed.server.TritonServer` all build their servers from here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import socket
import sys
from pathlib import Path

from ..sampling.admin import ADMIN_HEADER, CLIENT_ADDRESS_PARAMETER, GRPC_ADMIN_HEADER  # noqa: F401 (the launcher's names)
from ..serving.admin_key import ADMIN_KEY_DIGEST_ENV, key_digest
from . import settings
from .allocator import with_allocator
from .capabilities import ServerCapabilities, help_flags, run_help
from .private_shm import with_private_shm
from .shm_cleanup import server_shm_prefix
from .workarounds import BY_NAME

# The admin surfaces: anyone who reaches them can map host shared memory into the server, load
# and unload models, or change what the server logs and traces (verbosity costs throughput).
# Requests to them must carry ADMIN_HEADER: <key>; over gRPC Triton expects the header as
# GRPC_ADMIN_HEADER (both from sampling.admin).
ADMIN_APIS = ("shared-memory", "model-repository", "logging", "trace")
# The characters tritonserver's restricted-API flags can carry in a key, and the shortest key a
# user may choose (a short one is guessed; generated keys are 43 characters).
ADMIN_KEY_CHARACTERS = "[A-Za-z0-9._~+/-]"
MIN_ADMIN_KEY_CHARS = 32
# tritonserver and its stubs create files for this user only (their /dev/shm regions need more:
# the Python backend sets their mode explicitly, see ops.private_shm).
SERVER_UMASK = 0o077


def pytriton_root() -> Path:
    """site-packages/pytriton, located without importing it (its import is slow and noisy)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed in this environment; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_backends(dest: Path | None = None) -> Path:
    """A backends/ folder whose python/ holds the backend library, its utils and our Python's stub."""
    server_dir = pytriton_root() / "tritonserver"
    dest = dest or Path(sys.prefix) / "triton-backends"
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    stub = (
        server_dir
        / "python_backend_stubs"
        / f"{sys.version_info.major}.{sys.version_info.minor}"
        / "triton_python_backend_stub"
    )
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {sys.version_info[:2]}")
    sources = [stub, *(server_dir / "backends" / "python").glob("*.*")]
    for source in sources:
        target = python_dir / source.name
        if not target.exists() or target.stat().st_size != source.stat().st_size:
            shutil.copy2(source, target)
    return dest


# Where NGC's tritonserver images install the server (used when nvidia-pytriton is absent).
SYSTEM_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")


def has_pytriton() -> bool:
    """Whether the nvidia-pytriton wheel (and so its tritonserver) is installed here."""
    return importlib.util.find_spec("pytriton") is not None


def system_tritonserver() -> str:
    """The image's own tritonserver (NGC containers), for environments without nvidia-pytriton."""
    found = shutil.which("tritonserver") or (str(SYSTEM_TRITONSERVER) if SYSTEM_TRITONSERVER.exists() else None)
    if found is None:
        raise RuntimeError("no tritonserver: install nvidia-pytriton (`make setup`) or run in a Triton image")
    return found


def server_environment(admin_key: str | None = None, private_shm: bool = True) -> dict[str, str]:
    """The environment tritonserver needs: this venv's bin/ first, the wheel's shared libraries
    (a Triton image's own server needs neither, and gets the environment unchanged but PATH).
    With `admin_key`, the stubs get its SHA-256 (never the key), which the generate model's
    weight operations check (serving.weight_control); with `private_shm`, the library that keeps
    the stubs' regions 0600 (off where `ops.workarounds` says it cannot act)."""
    env = dict(os.environ)
    env.pop(ADMIN_KEY_DIGEST_ENV, None)
    if admin_key:
        env[ADMIN_KEY_DIGEST_ENV] = key_digest(admin_key)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if has_pytriton():
        libs = pytriton_root().parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(libs), env.get("LD_LIBRARY_PATH", "")] if p)
    # A short OpenMP spin in the stubs (settings.GOMP_SPINCOUNT); a user's wait policy or spin wins.
    if "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = settings.GOMP_SPINCOUNT.value(env)
    env.pop(settings.TRITON_ADMIN_KEY.name, None)  # a secret neither tritonserver nor a stub reads
    env = with_allocator(env)  # jemalloc where installed: glibc's malloc fragments under load
    return with_private_shm(env) if private_shm else env  # the stubs' /dev/shm regions 0600


# Half the cores for Triton's HTTP threads, within these bounds (why: settings.TRITON_HTTP_THREAD_COUNT).
MIN_HTTP_THREADS, MAX_HTTP_THREADS = 2, 8


def http_thread_count(cores: int | None = None) -> int:
    """Triton HTTP threads: TRITON_HTTP_THREAD_COUNT, else half of `cores` (default: the cores this
    process may use), MIN_HTTP_THREADS to MAX_HTTP_THREADS."""
    given = settings.TRITON_HTTP_THREAD_COUNT.value()
    if given is not None:
        return max(1, given)
    cores = cores or len(os.sched_getaffinity(0))
    return max(MIN_HTTP_THREADS, min(MAX_HTTP_THREADS, cores // 2))


def _backend_settings(args: list[str], backend: str = "python") -> set[str]:
    """The setting names given as --backend-config=<backend>,<name>=<value> in `args`."""
    prefix = f"--backend-config={backend},"
    return {arg[len(prefix) :].split("=", 1)[0] for arg in args if arg.startswith(prefix)}


def resource_args(extra_args: list[str] = ()) -> list[str]:
    """The sizing flags every server started here gets unless `extra_args` sets them: the Python
    backend's /dev/shm pool (SHM_DEFAULT_BYTES, growing SHM_GROWTH_BYTES) and the HTTP threads."""
    given = {arg.split("=", 1)[0] for arg in extra_args}
    backend = _backend_settings(list(extra_args))
    args = []
    if "shm-default-byte-size" not in backend:
        args.append(f"--backend-config=python,shm-default-byte-size={settings.SHM_DEFAULT_BYTES.value()}")
    if "shm-growth-byte-size" not in backend:
        args.append(f"--backend-config=python,shm-growth-byte-size={settings.SHM_GROWTH_BYTES.value()}")
    if "--http-thread-count" not in given:
        args.append(f"--http-thread-count={http_thread_count()}")
    return args


# Newer tritonservers refuse what the models admit unless told otherwise: since 2.59 each HTTP input,
# and the whole body, is capped at 64 MiB (the largest request is 256 MiB), and since 2.69 client
# shared memory is off (the admin key still locks those APIs). The flags go only to a server that
# lists them: the nvidia-pytriton wheel's 2.51 refuses to start on an unknown flag.
HTTP_MAX_INPUT_BYTES = 2 * settings.LARGEST_REQUEST_BYTES


@functools.cache
def server_flags(binary: str) -> frozenset[str]:
    """The long options `binary --help` lists; empty when it cannot run."""
    return help_flags(run_help(binary, server_environment()))


def compatibility_args(binary: str, extra_args: list[str] = ()) -> list[str]:
    """The flags a newer `binary` needs to hold the largest request and serve client shared
    memory, where it lists them and `extra_args` does not set them."""
    given = {arg.split("=", 1)[0] for arg in extra_args}
    caps = ServerCapabilities(version="", flags=server_flags(binary))
    args = []
    if BY_NAME["http_max_input_size"].runs(caps) and "--http-max-input-size" not in given:
        args.append(f"--http-max-input-size={HTTP_MAX_INPUT_BYTES}")
    if BY_NAME["allow_client_shm"].runs(caps) and "--allow-client-shm" not in given:
        args.append("--allow-client-shm=true")
    return args


def server_binary() -> str:
    """The tritonserver to run: the nvidia-pytriton wheel's, else the Triton image's own."""
    return str(pytriton_root() / "tritonserver" / "bin" / "tritonserver") if has_pytriton() else system_tritonserver()


def server_command(model_repository: Path, ports: dict[str, int], extra_args: list[str] = ()) -> list[str]:
    """The tritonserver command line for a repository and ports: the nvidia-pytriton wheel's server
    with the backends prepared for this Python, or else the Triton image's own with its backends;
    `resource_args` and `compatibility_args` first, then `extra_args`."""
    binary = [server_binary()]
    if has_pytriton():
        binary.append(f"--backend-directory={prepare_backends()}")
    return [
        binary[0],
        f"--model-repository={Path(model_repository).resolve()}",
        *binary[1:],
        f"--http-port={ports['http']}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-port={ports['metrics']}",
        *resource_args(extra_args),
        *compatibility_args(binary[0], extra_args),
        *extra_args,
    ]


def admin_args(admin_key: str, header: str = ADMIN_HEADER) -> list[str]:
    """The tritonserver flags that lock ADMIN_APIS behind `header: admin_key` (HTTP and gRPC)."""
    if not admin_key or not re.fullmatch(ADMIN_KEY_CHARACTERS + "+", admin_key):
        raise ValueError("the admin key must be non-empty and made of letters, digits and _.~+/- only")
    apis = ",".join(ADMIN_APIS)
    return [
        f"--http-restricted-api={apis}:{header}={admin_key}",
        f"--grpc-restricted-protocol={apis}:{header}={admin_key}",
    ]


def check_user_admin_key(admin_key: str) -> None:
    """Refuse a user-chosen admin key that is short or carries characters the flags cannot."""
    if len(admin_key) < MIN_ADMIN_KEY_CHARS or len(admin_key) > 512:
        raise ValueError(
            f"the admin key must be {MIN_ADMIN_KEY_CHARS} to 512 characters long (got {len(admin_key)}): "
            "a short key is guessed"
        )
    admin_args(admin_key)


def hardening_args(
    extra_args: list[str],
    http_port: int,
    admin_key: str | None,
    exit_timeout_s: int = settings.TRITON_EXIT_TIMEOUT_S.default,
) -> list[str]:
    """The flags `make serve` adds before the caller's: every model loaded at start in explicit
    model-control mode (so a model whose stub died can be reloaded), no auto-complete stub launch
    (halves a model's load time; our configs are complete), a bounded exit timeout, the stub
    regions under this server's own /dev/shm prefix, and the admin APIs locked when a key is given.
    A flag the caller passes in `extra_args` wins over the one here."""
    given = {arg.split("=", 1)[0] for arg in extra_args}
    args = []
    if "--model-control-mode" not in given:
        args += ["--model-control-mode=explicit"]
        if "--load-model" not in given:
            args += ["--load-model=*"]
    if not given & {"--disable-auto-complete-config", "--strict-model-config"}:
        args.append("--disable-auto-complete-config")
    if "--exit-timeout-secs" not in given:
        args.append(f"--exit-timeout-secs={exit_timeout_s}")
    args.append(f"--backend-config=python,shm-region-prefix-name={server_shm_prefix(http_port)}")
    if admin_key is not None:
        args += admin_args(admin_key)
    return args


_ON_LOOPBACK = "the front door binds the public ports and keeps tritonserver on loopback behind it"
_ADMIN_LOCK = "the admin APIs are locked with TRITON_ADMIN_KEY (--open-admin-apis opens them)"


def check_caller_flags(extra_args: list[str], proxied: bool, admin_locked: bool) -> None:
    """Raise ValueError naming a flag in `extra_args` that `make serve` sets itself, and what to
    use instead: tritonserver reads a flag's last copy, so the caller's would move a port away
    from where the supervisor and the door look, open tritonserver past the door, or unlock the
    admin APIs."""
    owned = {f"--{name}-port": f"set TRITON_{name.upper()}_PORT" for name in ("http", "grpc", "metrics")}
    if proxied:
        owned |= {f"--{name}-address": _ON_LOOPBACK for name in ("http", "grpc", "metrics")}
    if admin_locked:
        owned |= {"--http-restricted-api": _ADMIN_LOCK, "--grpc-restricted-protocol": _ADMIN_LOCK}
    for arg in extra_args:
        name = arg.split("=", 1)[0]
        if name in owned:
            raise ValueError(f"{name} is the launcher's: {owned[name]}")
        if "shm-region-prefix-name" in arg:
            raise ValueError(
                "--backend-config python,shm-region-prefix-name is the launcher's: stub regions are swept by it"
            )


def loopback_args() -> list[str]:
    """The flags that keep tritonserver's HTTP, gRPC and metrics endpoints on loopback (behind the
    proxy), and forward the client-address header the proxy sets on gRPC calls to the models as a
    request parameter (the generate model limits wrong admin keys per address: docs/weights.md)."""
    return [
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--grpc-header-forward-pattern={CLIENT_ADDRESS_PARAMETER}",
    ]


def redact(command: list[str], secret: str | None) -> list[str]:
    """`command` with `secret` replaced, for printing."""
    return [arg.replace(secret, "<admin key>") for arg in command] if secret else list(command)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
