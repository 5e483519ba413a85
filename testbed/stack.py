"""The full stack `make serve` runs (launcher, supervisor, proxy unless --no-proxy), started on free
ports as a child of its own for the hostile suite and the survival tests, with the small HTTP
helpers they share."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from testbed.server import LoopbackUrls, log_tail
from testbed.startup_wait import StartupFailed, wait_until_ready
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.memory_limit import MemoryCage, make_cage
from triton_sampling_mask.ops.proxy import INTERNAL_PORTS
from triton_sampling_mask.ops.server_process import free_port

from .server import REPO_ROOT, copy_model

ADMIN_KEY = "hostile-suite-admin-key-0123456789abcdef"
CLIENT_KEY = "trainer-burst-client-key-0123456789abcdef"  # a keyed client's (TRITON_CLIENT_KEYS_FILE)
STOP_LIMIT_S = 30.0  # SIGKILL for the launcher's group after this
GREEDY_LOGITS = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 6.0]  # greedy: id 7
GREEDY = json.dumps(
    {
        "inputs": [
            {"name": "logits", "shape": [1, 8], "datatype": "FP32", "data": GREEDY_LOGITS},
            {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [0.0]},
        ],
        "outputs": [{"name": "output_ids"}],
    }
).encode()
# Memory the whole stack may use in its cgroup: room for the models, far below the host's.
STACK_MEMORY_BYTES = 6 * 2**30
# What tritonserver may use inside it (the launcher's own limit, TRITON_MEMORY_LIMIT_BYTES).
SERVER_MEMORY_BYTES = 4 * 2**30
# tritonserver restarts, before the stack was ever ready, that fail its start: a server that cannot
# start (a port taken) is restarted by the supervisor for good, with a backoff, and never ready.
RESTARTS_BEFORE_READY = 3


def request(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout_s: float = 10.0
) -> tuple[int | None, str]:
    """(status, body text) over a fresh connection to 127.0.0.1; (None, error) without an answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as error:
        return None, type(error).__name__
    finally:
        conn.close()


# Blocks handed out by this process: stacks launched side by side (the router bench's replicas)
# have not bound their ports yet when the next block is chosen, so a bind test alone may hand out
# overlapping blocks, and two stacks then fight over a port.
_HANDED_OUT: set[int] = set()
_HANDING_OUT = threading.Lock()


def free_port_block(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on, none of them handed out
    before by this process."""
    with _HANDING_OUT:
        for _ in range(200):
            base = random.randrange(20000, 30000)
            if not _HANDED_OUT.isdisjoint(range(base, base + count)):
                continue
            try:
                sockets = []
                for port in range(base, base + count):
                    sock = socket.socket()
                    sockets.append(sock)
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                for sock in sockets:
                    sock.close()
            _HANDED_OUT.update(range(base, base + count))
            return base
    raise RuntimeError("no block of free ports")


def command_lines() -> list[list[str]]:
    """Every readable process command line (its arguments)."""
    lines = []
    for process in psutil.process_iter():
        try:
            lines.append(process.cmdline())
        except psutil.Error:
            pass
    return lines


def pids_with_argument(argument: str) -> list[int]:
    """Live processes whose command line holds `argument` exactly."""
    found = []
    for process in psutil.process_iter():
        try:
            if argument in process.cmdline():
                found.append(process.pid)
        except psutil.Error:
            pass
    return found


def recover(check, limit_s: float) -> tuple[float | None, Counter]:
    """Poll `check` (returning (ok, why not)) until it passes: (seconds it took or None, failures
    by reason meanwhile)."""
    started = time.monotonic()
    failures: Counter = Counter()
    while time.monotonic() - started < limit_s:
        ok, why = check()
        if ok:
            return time.monotonic() - started, failures
        failures[why] += 1
        time.sleep(0.2)
    return None, failures


@dataclass
class Stack(LoopbackUrls):
    """A launcher on free ports: its public ports, tritonserver's own HTTP port (the internal one
    behind a proxy), its log and the cgroup the stack runs in, if any."""

    launcher: Child
    ports: dict[str, int]
    server_http_port: int
    log_path: Path
    proxied: bool
    cage: MemoryCage | None = None

    @property
    def process(self):
        """The launcher's process."""
        return self.launcher.process

    def server_pid(self) -> int | None:
        """tritonserver's pid (the one serving on `server_http_port`)."""
        pids = pids_with_argument(f"--http-port={self.server_http_port}")
        return pids[0] if pids else None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the launcher's log."""
        return log_tail(self.log_path, chars)

    @property
    def api_internal_port(self) -> int:
        """The HTTP API's own port behind the proxy (loopback)."""
        return self.server_http_port + INTERNAL_PORTS.index("api")

    def api_pid(self) -> int | None:
        """The HTTP API process's pid (the one serving `api_internal_port`)."""
        pids = pids_with_argument(f"--port={self.api_internal_port}")
        return pids[0] if pids else None

    def sampler_check(self) -> tuple[bool, str]:
        """Whether a greedy sampler request through the public port is answered correctly; else
        why not (a short key)."""
        status, text = request(self.ports["http"], "POST", "/v2/models/sampler/infer", GREEDY, timeout_s=5)
        if status == 200:
            ids = json.loads(text)["outputs"][0]["data"]
            return (True, "ok") if ids == [7] else (False, f"wrong answer {ids}")
        return False, f"{status}: {text[:70]}"

    def sampler_answers(self) -> bool:
        """Whether a greedy sampler request through the public port is answered correctly."""
        return self.sampler_check()[0]

    def generate_check(self) -> tuple[bool, str]:
        """Whether `generate` generates one token; else why not."""
        body = json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 1, "ignore_eos": True, "temperature": 0.0})
        status, text = request(self.ports["http"], "POST", "/v2/models/generate/generate", body.encode())
        if status == 200:
            ids = json.loads(text).get("output_ids")
            return (True, "ok") if len(ids if isinstance(ids, list) else [ids]) == 1 else (False, f"wrong answer {ids}")
        return False, f"{status}: {text[:70]}"

    def ready(self) -> bool:
        """Whether the supervisor's /ready answers 200 (every model passed a real inference)."""
        return request(self.ports["probe"], "GET", "/ready")[0] == 200

    def restarts(self) -> int | None:
        """How often the supervisor restarted tritonserver (its /status, always a 200 from it), None
        when unknown."""
        status, text = request(self.ports["probe"], "GET", "/status", timeout_s=2)
        try:
            return int(json.loads(text)["restarts"]) if status == 200 else None
        except (ValueError, KeyError, TypeError):
            return None

    def failing_start(self) -> str | None:
        """Why the stack will not become ready although its launcher runs, or None."""
        restarts = self.restarts()
        if restarts is not None and restarts >= RESTARTS_BEFORE_READY:
            return f"the supervisor restarted tritonserver {restarts} times before it was ready"
        return None

    def stop(self) -> float:
        """SIGTERM the launcher (SIGKILL for its group after STOP_LIMIT_S); seconds until it exited."""
        started = time.monotonic()
        self.launcher.stop(STOP_LIMIT_S)
        if self.cage is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    self.cage.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.2)
        return time.monotonic() - started


def write_client_keys(directory: Path) -> Path:
    """A client key file naming CLIENT_KEY "trainer" (mode 0600), for TRITON_CLIENT_KEYS_FILE."""
    path = directory / "client.keys"
    path.write_text(f"trainer {CLIENT_KEY}\n")
    path.chmod(0o600)
    return path


def shipped_repository(dest: Path, models: tuple[str, ...] = ("sampler", "generate")) -> Path:
    """A copy of the shipped `models` (sampler and generate) in `dest` (created)."""
    for model in models:
        copy_model(dest, model)
    return dest


def launch_keyed(work: Path) -> Stack:
    """`make serve`'s stack on the shipped models in `work`, with a client key file naming
    CLIENT_KEY (keyed clients' capacity of their own) and no cgroup of its own."""
    return launch(
        shipped_repository(work / "model_repository"),
        work / "launcher.log",
        env={"TRITON_CLIENT_KEYS_FILE": write_client_keys(work)},
        stack_memory_bytes=None,
    )


def launch(
    repository: Path,
    log_path: Path,
    proxied: bool = True,
    env: dict | None = None,
    launcher: list[str] | None = None,
    cwd: Path | None = None,
    nofile: int | None = None,
    stack_memory_bytes: int | None = STACK_MEMORY_BYTES,
    legacy: bool = False,
    args: list[str] = (),
    umask: int = -1,
    api: bool = True,
    wait_ready: bool = True,
) -> Stack:
    """Start a launcher on free ports; wait until the sampler answers through the public port and
    (with `wait_ready`) the supervisor's /ready says every model passed a real inference.

    `launcher` replaces `python -m triton_sampling_mask.ops.launcher` (e.g. another checkout's,
    with `cwd`; `legacy`: one from before the front door, serving the public ports itself);
    `args` go on its command line, `env` (TRITON_... settings) over the ports and keys set here;
    `nofile` is a soft descriptor limit for it (its server inherits it), `umask` its umask; with
    `stack_memory_bytes` the whole stack runs in a memory cgroup of that size when one can be
    made; without `api` no HTTP API runs."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "probe", *(("api",) if api else ()))}
    internal_base = free_port_block(len(INTERNAL_PORTS))
    environment = {
        **os.environ,
        **{f"TRITON_{name.upper()}_PORT": str(port) for name, port in ports.items()},
        "TRITON_API_PORT": str(ports.get("api", 0)),  # 0: none
        "TRITON_INTERNAL_PORT_BASE": str(internal_base),
        "TRITON_ADMIN_KEY": ADMIN_KEY,
        "TRITON_MEMORY_LIMIT_BYTES": str(SERVER_MEMORY_BYTES),
        **{name: str(value) for name, value in (env or {}).items()},
    }
    command = list(launcher or [sys.executable, "-m", "triton_sampling_mask.ops.launcher"])
    proxied = proxied and not legacy
    command += ["--model-repository", str(repository), *args] + ([] if proxied or legacy else ["--no-proxy"])
    cage = None
    if stack_memory_bytes:
        cage = make_cage(f"hostile-stack-{os.getpid()}-{ports['http']}", stack_memory_bytes)
        if cage.path is None:
            cage = None  # only a cgroup holds the stack's children too
    child = Child(
        "launcher",
        command,
        env=environment,
        cwd=cwd or REPO_ROOT,
        umask=umask,
        log_path=log_path,
        append_log=False,
        nofile=nofile,
        setup=cage.enter if cage else None,
    ).start()
    stack = Stack(child, ports, internal_base if proxied else ports["http"], log_path, proxied, cage)
    try:
        wait_until_ready(
            f"the launched stack on port {ports['http']}",
            lambda: stack.sampler_answers() and (not wait_ready or stack.ready()),
            [child],
            poll_s=0.5,
            failed=stack.failing_start,
        )
    except StartupFailed as failed:
        stack.stop()
        raise StartupFailed(f"{failed}:\n{stack.log_tail()}") from None
    return stack
