"""Real tritonservers for tests and benchmarks: the test model repositories (the shipped one plus
variants on the backends in `backends/`), a server someone else started, a tiny sampler client, and
`TritonServer`, a tritonserver child on free ports built as the launcher builds its own
(`ops.server_process`)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed import startup_wait
from triton_sampling_mask.client.wire import INPUT_DTYPES, NUMPY_DTYPES, sampler_inputs  # noqa: F401 (re-exported to tests)
from triton_sampling_mask.ops import settings
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.server_process import (
    SERVER_UMASK,
    admin_args,
    free_port,
    server_command,
    server_environment,
)
from triton_sampling_mask.ops.shm_cleanup import remove_unused_regions, server_shm_prefix
from triton_sampling_mask.sampling.outputs import SAMPLING_MASK_LOGPROBS, TOKEN_OUTPUT_NAMES

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# The test-only sampling backends, copied into the models that name them.
BACKENDS = Path(__file__).resolve().parent / "backends"

# Variants of the sampler the tests load beside it: name -> `copy_model` overrides (the logits
# input's data_type: the documented one-line change).
SAMPLER_VARIANTS = {
    "sampler_speculative": {"parameters": {"speculative_algorithm": "EAGLE"}},
    "sampler_nosupport": {"backend": "no_support_backend:NoSupportBackend"},
    "sampler_bf16": {"logits_type": "TYPE_BF16"},
}


def set_logits_type(config_text: str, data_type: str) -> str:
    """Declare the logits input as `data_type` (e.g. TYPE_BF16) in config.pbtxt text."""
    pattern = re.compile(r'(name:\s*"logits",\s*data_type:\s*)TYPE_\w+')
    text, count = pattern.subn(lambda m: m.group(1) + data_type, config_text)
    assert count == 1, "logits input not found in config"
    return text


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace a `parameters` string value in config.pbtxt text (the key must be there)."""
    pattern = re.compile(rf'(key:\s*"{re.escape(key)}",\s*value:\s*\{{\s*string_value:\s*)"[^"]*"')
    text, count = pattern.subn(lambda m: f'{m.group(1)}"{value}"', config_text)
    assert count == 1, f"parameter {key} not found in config"
    return text


def copy_model(
    repository: Path,
    source: str,
    name: str | None = None,
    parameters: dict[str, str] | None = None,
    backend: str | None = None,
    logits_type: str | None = None,
    files: tuple[Path, ...] = (),
) -> Path:
    """Copy the shipped model `source` into `repository` as `name` (its own name by default; the
    config says the new one), with its string `parameters` set, the logits input declared as
    `logits_type`, `backend` ("module:Class" of a file in BACKENDS) as its sampling backend and
    `files` beside its model.py; returns the model's folder."""
    name = name or source
    folder = Path(repository) / name
    shutil.copytree(MODEL_REPOSITORY / source, folder, ignore=shutil.ignore_patterns("__pycache__"))
    text = (MODEL_REPOSITORY / source / "config.pbtxt").read_text().replace(f'name: "{source}"', f'name: "{name}"')
    parameters = dict(parameters or {})
    if backend is not None:
        parameters["sampling_backend"] = backend
        files = (*files, BACKENDS / f"{backend.split(':')[0]}.py")
    for key, value in parameters.items():
        text = set_parameter(text, key, value)
    if logits_type is not None:
        text = set_logits_type(text, logits_type)
    (folder / "config.pbtxt").write_text(text)
    for path in files:
        shutil.copy(path, folder / "1")
    return folder


def build_test_repository(dest: Path) -> Path:
    """The shipped model repository plus the sampler variants the tests need."""
    shutil.copytree(MODEL_REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name, overrides in SAMPLER_VARIANTS.items():
        copy_model(dest, "sampler", name, files=(BACKENDS / "no_support_backend.py",), **overrides)
    return dest


# A sampler whose backend raises inside execute; test_reload loads it on request only.
FAULTY_SAMPLER = "sampler_faulty"


def add_faulty_sampler(repository: Path) -> Path:
    """Add FAULTY_SAMPLER to a test repository (served in explicit model-control mode)."""
    copy_model(repository, "sampler", FAULTY_SAMPLER, backend="faulty_backend:FaultyBackend")
    return repository


def build_external_repository(dest: Path, gpu: bool = False) -> list[str]:
    """The repository an external server serves for the client tests (the test repository plus
    FAULTY_SAMPLER, rewritten for GPUs with `gpu`), and the tritonserver flags that serve it as the
    tests expect: explicit model control, every model loaded but FAULTY_SAMPLER."""
    dest = Path(dest)
    cpu = dest.with_name(dest.name + "-cpu") if gpu else dest
    add_faulty_sampler(build_test_repository(cpu))
    if gpu:
        from triton_sampling_mask.ops.gpu_repository import build_gpu_repository

        build_gpu_repository(cpu, dest)
        shutil.rmtree(cpu)
    models = sorted(config.parent.name for config in dest.glob("*/config.pbtxt"))
    return ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models if m != FAULTY_SAMPLER)]


def main(argv: list[str] | None = None) -> None:
    """python -m testbed.server DEST [--gpu]: write the external server's repository to DEST
    and print its tritonserver flags, one a line (docker/run-gpu-tests.sh, bench/gpu-check.sh)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--gpu", action="store_true", help="KIND_GPU instances (ops.gpu_repository)")
    args = parser.parse_args(argv)
    print("\n".join(build_external_repository(args.dest, args.gpu)))


class RemoteProcess:
    """Stands in for the Popen of a server this test run did not start: poll() is None while the
    server answers /v2/health/live, as Popen.poll() is None while the process runs."""

    def __init__(self, http_url: str):
        self.http_url = http_url

    def poll(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/live", timeout=5) as response:
                return None if response.status == 200 else 1
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 1


@dataclass
class ExternalTritonServer:
    """A server someone else started (docker/run-gpu-tests.sh, bench/gpu-check.sh), named by
    TRITON_EXTERNAL_{HTTP,GRPC,METRICS}_URL; TRITON_EXTERNAL_LOG is a file its log streams to and
    TRITON_EXTERNAL_MODEL_CONTROL its --model-control-mode ("explicit" lets test_reload use it)."""

    http_url: str
    grpc_url: str
    metrics_url: str
    admin_key: str | None = None  # the container's TRITON_ADMIN_KEY (model control needs it)
    log_path: Path | None = None
    model_control: str = "none"

    @classmethod
    def from_environment(cls) -> ExternalTritonServer | None:
        """The server named by the TRITON_EXTERNAL_* variables, or None when they are unset."""
        if not os.environ.get("TRITON_EXTERNAL_HTTP_URL"):
            return None
        log = os.environ.get("TRITON_EXTERNAL_LOG")
        return cls(
            http_url=os.environ["TRITON_EXTERNAL_HTTP_URL"],
            grpc_url=os.environ["TRITON_EXTERNAL_GRPC_URL"],
            metrics_url=os.environ.get("TRITON_EXTERNAL_METRICS_URL", ""),
            admin_key=os.environ.get("TRITON_EXTERNAL_ADMIN_KEY"),
            log_path=Path(log) if log else None,
            model_control=os.environ.get("TRITON_EXTERNAL_MODEL_CONTROL", "none"),
        )

    @property
    def process(self) -> RemoteProcess:
        return RemoteProcess(self.http_url)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log, read from TRITON_EXTERNAL_LOG."""
        if self.log_path is None or not self.log_path.exists():
            return "(external server: its log is not available here; set TRITON_EXTERNAL_LOG)"
        return self.log_path.read_text(errors="replace")[-chars:]


# Every output but the [rows, W] per-support log-probs.
OUTPUTS = tuple(name for name in TOKEN_OUTPUT_NAMES if name != SAMPLING_MASK_LOGPROBS.name)


def infer(client, module, model: str, logits, **params) -> dict[str, np.ndarray]:
    """Run the sampler and return every output as numpy."""
    result = client.infer(model, sampler_inputs(module, logits, **params))
    return {name: result.as_numpy(name) for name in OUTPUTS}


if __name__ == "__main__":
    main()


def log_tail(path: Path | None, chars: int = 4000) -> str:
    """The last `chars` characters of a log file ("" when there is none to read)."""
    try:
        return Path(path).read_text(errors="replace")[-chars:] if path else ""
    except OSError:
        return ""


class LoopbackUrls:
    """The URLs of a server listening on loopback at `self.ports` (http, grpc, metrics)."""

    ports: dict[str, int]

    @property
    def http_url(self) -> str:
        """host:port of the HTTP endpoint."""
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        """host:port of the gRPC endpoint."""
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        """The full URL of the Prometheus metrics."""
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def is_ready(self) -> bool:
        """Whether /v2/health/ready answers 200 on the HTTP endpoint."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


# The three endpoints a test server listens on, each on a free port.
PORT_NAMES = ("http", "grpc", "metrics")
PORT_ATTEMPTS = 3  # starts on fresh ports when one was taken before tritonserver bound it


class TritonServer(LoopbackUrls):
    """A tritonserver child process on free ports, for tests and benchmarks (a context manager).

    With `admin_key` the shared-memory and model-repository APIs need that key (`admin_args`);
    None leaves them open. The stubs' /dev/shm regions carry this server's own prefix
    and `stop` removes the ones left behind."""

    def __init__(
        self,
        model_repository: Path,
        extra_args: list[str] = (),
        log_path: Path | None = None,
        admin_key: str | None = None,
    ):
        self.model_repository = Path(model_repository)
        self.extra_args = list(extra_args)
        self.admin_key = admin_key
        self.ports = {name: free_port() for name in PORT_NAMES}
        self.shm_prefix = server_shm_prefix(self.ports["http"])
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"tritonserver-{self.ports['http']}.log"
        self.child: Child | None = None

    @property
    def process(self) -> subprocess.Popen | None:
        """tritonserver's process (None before `start`)."""
        return self.child.process if self.child else None

    def command(self) -> list[str]:
        """The tritonserver command line this server runs."""
        extra = [f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", *self.extra_args]
        if self.admin_key is not None:
            extra = admin_args(self.admin_key) + extra
        return server_command(self.model_repository, self.ports, extra)

    def start(self, timeout_s: float = startup_wait.CAP_S) -> TritonServer:
        """Start the server and wait until every model is ready, for as long as it makes progress
        (startup_wait; `timeout_s` is the last-resort cap); raises with the log tail if not. A port
        taken between `free_port` and tritonserver's bind (by any connection's ephemeral port) is
        retried on fresh ports."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.child = Child(
                "tritonserver",
                self.command(),
                env=server_environment(self.admin_key),
                umask=SERVER_UMASK,
                log_path=self.log_path,
                append_log=False,
                nice=settings.TRITON_NICE.value(),
            ).start()
            try:
                startup_wait.wait_until_ready(
                    f"tritonserver on port {self.ports['http']}",
                    lambda: self.is_ready() and self.metrics_listening(),
                    [self.child],
                    cap_s=timeout_s,
                )
                return self
            except startup_wait.StartupFailed as failed:
                tail = self.log_tail()
                self.stop()
                if attempt == PORT_ATTEMPTS or "already in use" not in tail:
                    raise startup_wait.StartupFailed(f"{failed}:\n{tail}") from None
                self.ports = {name: free_port() for name in PORT_NAMES}
        raise AssertionError("unreachable")

    def metrics_listening(self) -> bool:
        """Whether the metrics port accepts connections (it opens a moment after HTTP is ready)."""
        try:
            with socket.create_connection(("127.0.0.1", self.ports["metrics"]), timeout=1):
                return True
        except OSError:
            return False

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to its process group (Triton's clean shutdown), then SIGKILL if it lingers;
        returns the exit code. Stubs the server left behind are killed and their /dev/shm regions
        removed."""
        if self.child is None:
            return None
        code = self.child.stop(timeout_s, group=True)
        remove_unused_regions(self.shm_prefix)
        return code

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server log."""
        return log_tail(self.log_path, chars)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
