"""Hostile clients against the full stack (`make hostile`, client_tests/test_front_door.py): what
one unauthenticated client, or a client holding the admin key, can still do to `make serve`.
Each attack takes a running `stack.Stack` and returns an `Outcome`: whether the service held,
what was measured, how long until it answered again (docs/operations.md, "Threat model").
"""

from __future__ import annotations

import json
import socket
import stat
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

from triton_sampling_mask.ops.server_process import ADMIN_HEADER, GRPC_ADMIN_HEADER

from .process_memory import process_tree_rss
from .stack import ADMIN_KEY, CLIENT_KEY, GREEDY, STACK_MEMORY_BYTES, Stack, command_lines, pids_with_argument, request

RECOVERY_LIMIT_S = 60.0
SHAPE_ATTACK = json.dumps(
    {"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32", "data": [1.0, 2.0]}]}
).encode()


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


class MemoryWatch:
    """tritonserver's process-tree RSS before an attack, its peak during it (sampled every half
    second) and after it, in MB."""

    def __init__(self, stack: Stack, interval_s: float = 0.5):
        self.stack, self.interval_s = stack, interval_s
        self.before = self.peak = self.after = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _rss_mb(self) -> float:
        pid = self.stack.server_pid()
        return process_tree_rss(pid) / 2**20 if pid else 0.0

    def _sample(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.peak = max(self.peak, self._rss_mb())

    def __enter__(self) -> MemoryWatch:
        self.before = self.peak = self._rss_mb()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.after = self._rss_mb()

    def summary(self) -> str:
        return f"RSS {self.before:.0f} / {self.peak:.0f} / {self.after:.0f} MB before / peak / after"


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


def tiny_sampler_request() -> service_pb2.ModelInferRequest:
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
    message = tiny_sampler_request()

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


def wait_until_answering(stack: Stack, limit_s: float = RECOVERY_LIMIT_S) -> float | None:
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
    recovery = wait_until_answering(stack)
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
    recovery = wait_until_answering(stack)
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
    in_argv = sum(any(ADMIN_KEY in arg or CLIENT_KEY in arg for arg in line) for line in command_lines())
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
        f"admin or client key on {in_argv} command line(s); front-door files not private: {loose or 'none'}",
    )


ATTACKS = {
    "admin-surface": admin_surface,
    "secrets": secrets_exposed,
    "json-shape": json_shape,
    "idle-flood": idle_flood,
    "unread-stream": unread_stream,
    "memory-blowup": memory_blowup,
}
