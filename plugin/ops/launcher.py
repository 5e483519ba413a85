"""Start a real tritonserver (2.51, shipped in the `nvidia-pytriton` wheel) on a model repository.

The wheel carries the server binary, the Python backend and one stub per Python version. The stub
embeds the system libpython, ignores PYTHONPATH and finds packages through the `python3` first on
PATH, so the server runs with this virtual environment's bin/ first on PATH.

    python -m triton_sampling_mask.ops.launcher [--model-repository DIR] [-- extra tritonserver flags]

Ports come from TRITON_HTTP_PORT / TRITON_GRPC_PORT / TRITON_METRICS_PORT (8000/8001/8002).
The launcher execs the server, so SIGTERM reaches tritonserver itself and stops it cleanly.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
PORT_VARIABLES = {"http": "TRITON_HTTP_PORT", "grpc": "TRITON_GRPC_PORT", "metrics": "TRITON_METRICS_PORT"}


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
    stub = server_dir / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {sys.version_info[:2]}")
    sources = [stub, *(server_dir / "backends" / "python").glob("*.*")]
    for source in sources:
        target = python_dir / source.name
        if not target.exists() or target.stat().st_size != source.stat().st_size:
            shutil.copy2(source, target)
    return dest


def server_environment() -> dict[str, str]:
    """The environment tritonserver needs: this venv's bin/ first, the wheel's shared libraries."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    libs = pytriton_root().parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(libs), env.get("LD_LIBRARY_PATH", "")] if p)
    return env


def server_command(model_repository: Path, ports: dict[str, int], extra_args: list[str] = ()) -> list[str]:
    """The tritonserver command line for a repository and ports."""
    return [
        str(pytriton_root() / "tritonserver" / "bin" / "tritonserver"),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={prepare_backends()}",
        f"--http-port={ports['http']}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-port={ports['metrics']}",
        *extra_args,
    ]


def ports_from_environment() -> dict[str, int]:
    """Ports from TRITON_*_PORT variables, defaulting to Triton's 8000/8001/8002."""
    return {name: int(os.environ.get(var, DEFAULT_PORTS[name])) for name, var in PORT_VARIABLES.items()}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TritonServer:
    """A tritonserver child process on free ports, for tests and benchmarks (a context manager)."""

    def __init__(self, model_repository: Path, extra_args: list[str] = (), log_path: Path | None = None):
        self.model_repository = Path(model_repository)
        self.extra_args = list(extra_args)
        self.ports = {name: free_port() for name in DEFAULT_PORTS}
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"tritonserver-{self.ports['http']}.log"
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        """Start the server and wait until every model is ready; raises with the log tail if not."""
        command = server_command(self.model_repository, self.ports, self.extra_args)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=server_environment(), start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver not ready within {timeout_s}s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        """Whether /v2/health/ready answers 200."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (Triton's clean shutdown), then SIGKILL if it lingers; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Exec tritonserver in the foreground on a model repository (used by `make serve`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=os.environ.get("MODEL_REPOSITORY", "model_repository"))
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to tritonserver after --")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    command = server_command(Path(args.model_repository), ports_from_environment(), extra)
    print("+ " + " ".join(command), flush=True)
    os.execve(command[0], command, server_environment())


if __name__ == "__main__":
    main()
