"""Hostile clients against the full stack (`make hostile`): what one unauthenticated client, or a
client holding the admin key, can still do to `make serve`.

    python -m bench.hostile [--no-proxy] [--only NAME ...] [--stream-seconds 30]
    HOSTILE_LAUNCHER="/work/main/.venv/bin/python -m triton_sampling_mask.ops.launcher" \\
        HOSTILE_LAUNCHER_CWD=/work/main python -m bench.hostile      # another checkout's launcher

Starts the launcher (supervisor and proxy on) on free ports with the shipped models, inside a
memory-limited cgroup of its own where this host has one (the destructive attacks run only
there), runs each attack and prints whether the service held, what was measured and how long it
took to answer again. Exit status 1 when an attack got through.

Attacks (docs/operations.md, "Threat model"):
- idle-flood: thousands of idle TCP connections from one address (127.0.0.2) while a client on
  127.0.0.1 keeps inferring and health checks keep answering;
- unread-stream: one gRPC ModelStreamInfer stream of tiny sampler requests that name no outputs
  (every response is the full [256, W] set) and never reads: tritonserver's RSS and whether other
  sampler clients are shed;
- json-shape: the ~100-byte JSON body that declares a [1, 2**40] tensor;
- admin-surface: logging and trace settings without the key (HTTP and gRPC), and registering the
  server's own stub region as shared memory with it;
- secrets: the admin key on any command line, the key files' modes;
- memory-blowup (destructive, in a memory-limited cgroup only): the JSON shape body straight to
  tritonserver's loopback port, past the proxy: the memory limit must kill the server, not the
  host, and the supervisor bring it back.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from triton_sampling_mask.ops.memory_limit import MemoryCage, make_cage
from triton_sampling_mask.ops.server_process import LoopbackUrls, free_port

from .load.procfs import process_tree_rss

REPO_ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "hostile-suite-admin-key-0123456789abcdef"
ADMIN_HEADER = "triton-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
START_LIMIT_S = 180.0
RECOVERY_LIMIT_S = 60.0
SHAPE_ATTACK = json.dumps(
    {"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32", "data": [1.0, 2.0]}]}
).encode()
GREEDY = json.dumps(
    {
        "inputs": [
            {"name": "logits", "shape": [1, 8], "datatype": "FP32", "data": [0, 0, 1, 0, 0, 0, 0, 6]},
            {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [0.0]},
        ],
        "outputs": [{"name": "output_ids"}],
    }
).encode()
# Memory the whole stack may use in its cgroup: room for the models, far below the host's.
STACK_MEMORY_BYTES = 6 * 2**30
# What tritonserver may use inside it (the launcher's own limit, TRITON_MEMORY_LIMIT_BYTES).
SERVER_MEMORY_BYTES = 4 * 2**30


@dataclass
class Outcome:
    """One attack: whether the service held, what was measured, how long until it answered again."""

    attack: str
    held: bool
    detail: str
    recovery_s: float | None = None
    numbers: dict = field(default_factory=dict)

    def row(self) -> str:
        recovery = "-" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        return f"| {self.attack} | {'held' if self.held else 'GOT THROUGH'} | {self.detail} | {recovery} |"


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


def free_port_block(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        try:
            sockets = []
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports")


def pids_with_argument(argument: str) -> list[int]:
    """Live processes whose command line holds `argument` exactly."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and argument.encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def command_lines() -> list[bytes]:
    """Every readable process command line."""
    lines = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                lines.append((proc / "cmdline").read_bytes())
        except OSError:
            pass
    return lines


@dataclass
class Stack(LoopbackUrls):
    """A launcher (supervisor, proxy unless --no-proxy) on free ports: public ports, tritonserver's
    own HTTP port (the internal one behind a proxy) and the cgroup the stack runs in, if any."""

    process: subprocess.Popen
    ports: dict[str, int]
    server_http_port: int
    log_path: Path
    proxied: bool
    cage: MemoryCage | None = None

    def server_pid(self) -> int | None:
        """tritonserver's pid (the one serving on `server_http_port`)."""
        pids = pids_with_argument(f"--http-port={self.server_http_port}")
        return pids[0] if pids else None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def sampler_answers(self) -> bool:
        """Whether a greedy sampler request through the public port is answered correctly."""
        status, text = request(self.ports["http"], "POST", "/v2/models/sampler/infer", GREEDY, timeout_s=5)
        return status == 200 and json.loads(text)["outputs"][0]["data"] == [7]

    def stop(self) -> float:
        """SIGTERM the launcher; seconds until it exited."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.cage is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    self.cage.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.2)
        return time.monotonic() - started


def shipped_repository(dest: Path) -> Path:
    """A copy of the shipped sampler and generate models."""
    for model in ("sampler", "generate"):
        shutil.copytree(
            REPO_ROOT / "model_repository" / model, dest / model, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


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
) -> Stack:
    """Start a launcher on free ports; wait until the sampler answers through the public port and
    the supervisor's watchdog says ready.

    `launcher` replaces `python -m triton_sampling_mask.ops.launcher` (e.g. another checkout's,
    with `cwd`; `legacy`: one from before the front door, serving the public ports itself);
    `nofile` is a soft descriptor limit for it (its server inherits it); with `stack_memory_bytes`
    the whole stack runs in a memory cgroup of that size when one can be made."""
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "probe")}
    internal_base = free_port_block(5)
    environment = {
        **os.environ,
        "TRITON_HTTP_PORT": str(ports["http"]),
        "TRITON_GRPC_PORT": str(ports["grpc"]),
        "TRITON_METRICS_PORT": str(ports["metrics"]),
        "TRITON_PROBE_PORT": str(ports["probe"]),
        "TRITON_INTERNAL_PORT_BASE": str(internal_base),
        "TRITON_ADMIN_KEY": ADMIN_KEY,
        "TRITON_MEMORY_LIMIT_BYTES": str(SERVER_MEMORY_BYTES),
        **(env or {}),
    }
    command = list(launcher or [sys.executable, "-m", "triton_sampling_mask.ops.launcher"])
    proxied = proxied and not legacy
    command += ["--model-repository", str(repository)] + ([] if proxied or legacy else ["--no-proxy"])
    cage = None
    if stack_memory_bytes:
        cage = make_cage(f"hostile-stack-{os.getpid()}-{ports['http']}", stack_memory_bytes)
        if cage.path is None:
            cage = None  # only a cgroup holds the stack's children too

    def setup() -> None:
        if cage is not None:
            cage.enter()
        if nofile:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            cwd=cwd or REPO_ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=setup,
        )
    stack = Stack(process, ports, internal_base if proxied else ports["http"], log_path, proxied, cage)
    deadline = time.monotonic() + START_LIMIT_S
    while not (stack.sampler_answers() and request(ports["probe"], "GET", "/ready")[0] == 200):
        if process.poll() is not None or time.monotonic() > deadline:
            stack.stop()
            raise RuntimeError(f"the stack did not come up:\n{stack.log_tail()}")
        time.sleep(0.5)
    return stack


class Prober:
    """A well-behaved client on 127.0.0.1 while an attack runs: sampler requests over HTTP and
    gRPC, and health checks (tritonserver's and the supervisor's), counted by outcome."""

    def __init__(self, stack: Stack, grpc_clients: int = 1, pause_s: float = 0.1, timeout_s: float = 5.0):
        self.stack = stack
        self.pause_s = pause_s
        self.timeout_s = timeout_s
        self.outcomes: dict[str, Counter] = {"http": Counter(), "grpc": Counter(), "health": Counter()}
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._http, daemon=True),
            threading.Thread(target=self._health, daemon=True),
        ]
        self.threads += [threading.Thread(target=self._grpc, daemon=True) for _ in range(grpc_clients)]

    def _http(self) -> None:
        while not self.stopping.is_set():
            status, text = request(
                self.stack.ports["http"], "POST", "/v2/models/sampler/infer", GREEDY, timeout_s=self.timeout_s
            )
            ok = status == 200 and json.loads(text)["outputs"][0]["data"] == [7]
            self.outcomes["http"]["ok" if ok else str(status)] += 1
            self.stopping.wait(self.pause_s)

    def _grpc(self) -> None:
        client = grpcclient.InferenceServerClient(self.stack.grpc_url)
        logits = grpcclient.InferInput("logits", [1, 8], "FP32")
        logits.set_data_from_numpy(np.array([[0, 0, 1, 0, 0, 0, 0, 6]], np.float32))
        try:
            while not self.stopping.is_set():
                try:
                    ids = client.infer("sampler", [logits], client_timeout=self.timeout_s).as_numpy("output_ids")
                    self.outcomes["grpc"]["ok" if ids is not None else "no output"] += 1
                except InferenceServerException as error:
                    self.outcomes["grpc"][str(error.status())] += 1
                self.stopping.wait(self.pause_s)
        finally:
            client.close()

    def _health(self) -> None:
        while not self.stopping.is_set():
            for port, path in ((self.stack.ports["http"], "/v2/health/ready"), (self.stack.ports["probe"], "/ready")):
                status, _ = request(port, "GET", path, timeout_s=self.timeout_s)
                self.outcomes["health"]["ok" if status == 200 else str(status)] += 1
            self.stopping.wait(self.pause_s)

    def __enter__(self) -> Prober:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def failures(self) -> dict[str, int]:
        """Requests of the well-behaved client that did not get a correct answer, by kind."""
        return {kind: sum(n for k, n in counts.items() if k != "ok") for kind, counts in self.outcomes.items()}

    def summary(self) -> str:
        return "; ".join(f"{kind} {dict(counts)}" for kind, counts in self.outcomes.items())


def _still_open(sock: socket.socket) -> bool:
    """Whether the peer has neither closed nor reset a connection that never sent anything."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def idle_flood(stack: Stack, connections: int = 1500, source: str = "127.0.0.2", hold_s: float = 8.0) -> Outcome:
    """Attack 1: `connections` TCP connections from `source` that send nothing, spread over the
    HTTP and gRPC ports, held `hold_s` while a client on 127.0.0.1 keeps inferring."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < connections + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 256), hard))
    sockets, refused = [], 0
    targets = [stack.ports["http"], stack.ports["grpc"]]
    with Prober(stack) as prober:
        for i in range(connections):
            sock = socket.socket()
            try:
                sock.bind((source, 0))
                sock.settimeout(2)
                sock.connect(("127.0.0.1", targets[i % 2]))
                sockets.append(sock)
            except OSError:
                refused += 1
                sock.close()
        time.sleep(hold_s)
        still_open = sum(_still_open(sock) for sock in sockets)  # the rest the server side has closed
    for sock in sockets:
        sock.close()
    failures = prober.failures()
    held = not any(failures.values()) and sum(prober.outcomes["http"].values()) > 0
    return Outcome(
        "idle-flood",
        held,
        f"{connections} idle connections from {source}: {len(sockets)} accepted, {refused} refused, "
        f"{still_open} still open after {hold_s:g} s; meanwhile from 127.0.0.1: {prober.summary()}",
        numbers={"accepted": len(sockets), "still_open": still_open, **{f"{k}_failed": v for k, v in failures.items()}},
    )


def _tiny_sampler_request() -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="sampler")
    tensor = message.inputs.add()
    tensor.name, tensor.datatype = "logits", "FP32"
    tensor.shape.extend([256, 1])
    message.raw_input_contents.append(np.zeros(256, np.float32).tobytes())
    return message


def unread_stream(stack: Stack, seconds: float = 30.0, rss_limit_mb: float = 300.0) -> Outcome:
    """Attack 2: one ModelStreamInfer stream of `logits [256, 1]` sampler requests naming no
    outputs (each answer ~1 MB), never read, for `seconds`, reopened whenever it ends; RSS of
    tritonserver and its stubs, and whether sampler clients meanwhile get shed (503)."""
    pid = stack.server_pid()
    base = process_tree_rss(pid)
    stopping = threading.Event()
    sent = Counter()
    message = _tiny_sampler_request()

    def requests():
        while not stopping.is_set():
            sent["requests"] += 1
            yield message

    channel = grpc.insecure_channel(stack.grpc_url)
    stream = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=lambda raw: raw,
    )
    calls = []

    def attacker() -> None:
        while not stopping.is_set():
            call = stream(requests())
            calls.append(call)
            sent["streams"] += 1
            while not stopping.is_set() and not call.done():
                time.sleep(0.05)

    peak = base
    with Prober(stack, grpc_clients=1, pause_s=0.05, timeout_s=10) as prober:
        thread = threading.Thread(target=attacker, daemon=True)
        thread.start()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            time.sleep(1)
            peak = max(peak, process_tree_rss(pid))
        stopping.set()
        for call in calls:
            call.cancel()
        thread.join(10)
    channel.close()
    time.sleep(5)
    after = process_tree_rss(pid)
    growth_mb, kept_mb = (peak - base) / 2**20, (after - base) / 2**20
    shed = sum(
        n
        for kind in ("http", "grpc")
        for k, n in prober.outcomes[kind].items()
        if k in ("503", "StatusCode.UNAVAILABLE")
    )
    failed = sum(prober.failures()[kind] for kind in ("http", "grpc"))
    held = growth_mb <= rss_limit_mb and failed == 0
    return Outcome(
        "unread-stream",
        held,
        f"{seconds:g} s, {sent['streams']} stream(s), {sent['requests']} requests taken by the client library: "
        f"tritonserver tree RSS +{growth_mb:.0f} MB at peak, +{kept_mb:.0f} MB 5 s after cancel; "
        f"other sampler clients: {shed} shed, {failed} failed ({prober.summary()})",
        numbers={"rss_growth_mb": growth_mb, "rss_kept_mb": kept_mb, "others_shed": shed, "others_failed": failed},
    )


def _wait_until_answering(stack: Stack, limit_s: float = RECOVERY_LIMIT_S) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if stack.sampler_answers():
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def json_shape(stack: Stack) -> Outcome:
    """Attack 3 at the front door: the [1, 2**40] JSON body on the public port must be refused
    with 400 and the server keep answering. Run it without a proxy only inside a memory cgroup."""
    if not stack.proxied and stack.cage is None:
        return Outcome("json-shape", False, "not run: without a proxy it would take the host's memory (no cgroup here)")
    pid = stack.server_pid()
    started = time.monotonic()
    status, text = request(stack.ports["http"], "POST", "/v2/models/sampler/infer", SHAPE_ATTACK, timeout_s=60)
    recovery = _wait_until_answering(stack)
    same_server = stack.server_pid() == pid
    held = status == 400 and same_server
    return Outcome(
        "json-shape",
        held,
        f"answered {status} {text[:100]!r} after {time.monotonic() - started:.1f} s; "
        f"tritonserver {'kept running' if same_server else 'died and was restarted'}",
        recovery_s=None if same_server else recovery,
    )


def memory_blowup(stack: Stack) -> Outcome:
    """Attack 3 past the proxy (destructive): the [1, 2**40] JSON body straight to tritonserver's
    own port must end in the server's death under its memory limit, not the host's, and the
    supervisor must bring it back. Only inside a memory cgroup."""
    if stack.cage is None:
        return Outcome("memory-blowup", True, "skipped: no memory cgroup can be made here to hold the stack")
    pid = stack.server_pid()
    started = time.monotonic()
    status, _ = request(stack.server_http_port, "POST", "/v2/models/sampler/infer", SHAPE_ATTACK, timeout_s=120)
    while pids_with_argument(f"--http-port={stack.server_http_port}") == [pid] and time.monotonic() - started < 120:
        time.sleep(0.1)
    died = time.monotonic()
    recovery = _wait_until_answering(stack)
    killed_by_limit = "killed by its memory limit" in stack.log_tail(20000)
    held = recovery is not None and recovery <= 15 and stack.process.poll() is None
    return Outcome(
        "memory-blowup",
        held,
        f"tritonserver answered {status} and died {died - started:.1f} s after the request "
        f"({'killed by its memory limit' if killed_by_limit else 'no OOM kill logged'}), pid {pid} -> "
        f"{stack.server_pid()}; the stack's cgroup holds at most {STACK_MEMORY_BYTES / 2**30:.0f} GiB",
        recovery_s=recovery,
        numbers={"killed_by_limit": killed_by_limit, "died_after_s": died - started},
    )


def admin_surface(stack: Stack) -> Outcome:
    """Attack 5: logging and trace settings without the key (HTTP and gRPC), and registering the
    server's own stub region as shared memory with the key (HTTP and gRPC)."""
    results = {}
    results["http logging, no key"] = request(
        stack.ports["http"], "POST", "/v2/logging", json.dumps({"log_verbose_level": 1}).encode()
    )[0]
    results["http trace, no key"] = request(
        stack.ports["http"], "POST", "/v2/trace/setting", json.dumps({"trace_level": ["TIMESTAMPS"]}).encode()
    )[0]
    regions = sorted(p.name for p in Path("/dev/shm").glob("triton_python_backend_shm_region_*"))
    region = next((name for name in regions if f"_p{stack.ports['http']}_" in name), regions[0] if regions else None)
    body = json.dumps({"key": f"/{region}", "offset": 0, "byte_size": 4096}).encode()
    results["http register stub region, with key"] = request(
        stack.ports["http"], "POST", "/v2/systemsharedmemory/region/own/register", body, {ADMIN_HEADER: ADMIN_KEY}
    )[0]
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        for name, call in (
            ("grpc logging, no key", lambda: client.update_log_settings({"log_verbose_level": 1})),
            ("grpc trace, no key", lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})),
            (
                "grpc register stub region, with key",
                lambda: client.register_system_shared_memory(
                    "own", f"/{region}", 4096, headers={GRPC_ADMIN_HEADER: ADMIN_KEY}
                ),
            ),
        ):
            try:
                call()
                results[name] = "accepted"
            except InferenceServerException as error:
                results[name] = str(error.status())
        # undo anything that got through, so the server keeps running
        for undo in (
            lambda: client.update_log_settings({"log_verbose_level": 0}, headers={GRPC_ADMIN_HEADER: ADMIN_KEY}),
            lambda: client.unregister_system_shared_memory("own", headers={GRPC_ADMIN_HEADER: ADMIN_KEY}),
        ):
            try:
                undo()
            except InferenceServerException:
                pass
    finally:
        client.close()
    accepted = [name for name, result in results.items() if result in (200, "accepted")]
    return Outcome(
        "admin-surface",
        not accepted and region is not None,
        ", ".join(f"{name}: {result}" for name, result in results.items())
        + ("" if region else " (no stub region found)"),
        numbers={"accepted": accepted},
    )


def secrets_exposed(stack: Stack) -> Outcome:
    """Attack 4's share here: the admin key on any process's command line (what `ps` shows every
    local user), and the modes of the front door's key and config files."""
    in_argv = sum(ADMIN_KEY.encode() in line for line in command_lines())
    loose = []
    for directory in Path(tempfile.gettempdir()).glob("triton-front-door-*"):
        if stat.S_IMODE(directory.stat().st_mode) != 0o700:
            loose.append(f"{directory.name} {oct(stat.S_IMODE(directory.stat().st_mode))}")
        for path in directory.iterdir():
            if stat.S_IMODE(path.stat().st_mode) != 0o600:
                loose.append(f"{path.name} {oct(stat.S_IMODE(path.stat().st_mode))}")
    return Outcome(
        "secrets",
        in_argv == 0 and not loose,
        f"admin key on {in_argv} command line(s); front-door files not private: {loose or 'none'}",
    )


ATTACKS = {
    "admin-surface": admin_surface,
    "secrets": secrets_exposed,
    "json-shape": json_shape,
    "idle-flood": idle_flood,
    "unread-stream": unread_stream,
    "memory-blowup": memory_blowup,
}


def main(argv: list[str] | None = None) -> int:
    """Run the attacks against a fresh stack and print a table; 1 if any got through."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-proxy", action="store_true", help="the launcher without its proxy (--no-proxy)")
    parser.add_argument(
        "--legacy", action="store_true", help="HOSTILE_LAUNCHER predates the front door (no --no-proxy flag)"
    )
    parser.add_argument("--only", nargs="+", choices=list(ATTACKS), help="these attacks only")
    parser.add_argument("--stream-seconds", type=float, default=30.0, help="how long the unread stream runs")
    parser.add_argument("--connections", type=int, default=1500, help="idle connections of the flood")
    parser.add_argument(
        "--nofile", type=int, default=1024, help="soft descriptor limit of the launcher (a container default)"
    )
    args = parser.parse_args(argv)
    launcher = shlex.split(os.environ.get("HOSTILE_LAUNCHER", "")) or None
    cwd = Path(os.environ["HOSTILE_LAUNCHER_CWD"]) if os.environ.get("HOSTILE_LAUNCHER_CWD") else None
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    stack = launch(
        shipped_repository(work / "model_repository"),
        work / "launcher.log",
        proxied=not args.no_proxy,
        launcher=launcher,
        cwd=cwd,
        nofile=args.nofile,
        legacy=args.legacy,
    )
    print(
        f"stack up: public {stack.ports}, tritonserver HTTP {stack.server_http_port}, log {stack.log_path}", flush=True
    )
    outcomes = []
    try:
        for name, attack in ATTACKS.items():
            if args.only and name not in args.only:
                continue
            kwargs = {
                "unread-stream": {"seconds": args.stream_seconds},
                "idle-flood": {"connections": args.connections},
            }
            print(f"-- {name}", flush=True)
            outcome = attack(stack, **kwargs.get(name, {}))
            print(outcome.row(), flush=True)
            outcomes.append(outcome)
            if not stack.sampler_answers():  # let a struck server come back before the next attack
                outcome.recovery_s = outcome.recovery_s or _wait_until_answering(stack)
    finally:
        seconds = stack.stop()
        print(f"stack stopped in {seconds:.1f} s")
    print("\n| attack | outcome | measured | back after |\n|---|---|---|---|")
    for outcome in outcomes:
        print(outcome.row())
    return 0 if all(outcome.held for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
