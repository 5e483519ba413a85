"""tritonserver under supervision: restarted when it dies, models reloaded when their stub dies,
readiness that means "a real inference works", a bounded shutdown that leaves nothing behind
(docs/operations.md, "The supervisor", says what each does and why).

Why by hand: tritonserver restarts nothing (a dead stub answers 500 for good while
/v2/health/ready stays 200, in 2.51) and never releases a dead stub's /dev/shm region; a process
manager (systemd, supervisord, a kubelet) restarts a process, but cannot tell a model whose stub
died, reload it, or drain and restart the server when dead stubs' regions pile up.

`Watchdog` probes every model (`ops.probe`) and reloads the ones whose stub died or hung;
`Supervisor` runs tritonserver and the front door's children (`ops.door_commands`), restarts
whichever dies (`ops.child`), sweeps dead stubs' regions (`ops.shm_cleanup`) and serves /ready,
/live, /status and /metrics on the probe port.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import proxy_metrics, settings
from .child import Child, describe_exit, end_process_group, group_members
from .door_commands import door_children
from .memory_limit import MemoryCage
from .probe import ProbeResult, http_request, probe_model
from .proxy import FrontDoor
from .secret_files import remove_secret_file
from .server_process import (
    ADMIN_HEADER,
    SERVER_UMASK,
    hardening_args,
    loopback_args,
    redact,
    server_command,
    server_environment,
)
from .shm_cleanup import DeadStubRegions, leaked_regions, remove_unused_regions, server_shm_prefix

KILL_MARGIN_S = 3.0  # SIGKILL this long after tritonserver's own exit timeout
TIMEOUTS_BEFORE_RELOAD = 2  # consecutive probe timeouts, with no progress between them: a hung stub
RELOAD_TIMEOUT_S = 180.0
RELOAD_BACKOFF_S = (2.0, 5.0, 15.0, 60.0)  # least time between two reloads of one model


def log(message: str) -> None:
    """Print one supervisor line, at once (the container log is read live)."""
    print(f"[supervisor] {message}", flush=True)


@dataclass
class SupervisorConfig:
    """What the supervisor runs and how closely it watches."""

    model_repository: Path
    ports: dict[str, int]
    extra_args: list[str] = field(default_factory=list)
    admin_key: str | None = None
    probe_port: int = settings.TRITON_PROBE_PORT.default  # 0: no probe endpoint
    watchdog_interval_s: float = settings.TRITON_WATCHDOG_INTERVAL_S.default
    probe_timeout_s: float = 5.0
    exit_timeout_s: int = settings.TRITON_EXIT_TIMEOUT_S.default
    admin_key_file: Path | None = None  # a generated key's file, removed at exit
    # dead stubs' regions tritonserver may keep mapped before it is drained and restarted
    shm_leak_limit_bytes: int = field(default_factory=settings.TRITON_SHM_LEAK_LIMIT_BYTES.value)
    # HAProxy and the stream gate on the public ports; `ports` are then tritonserver's loopback
    # ones and `admin_key` the internal key the proxy sets on admin requests.
    front_door: FrontDoor | None = None
    memory_cage: MemoryCage | None = None
    # The defences `ops.workarounds` may turn off where they cannot act or are not needed.
    private_shm: bool = True  # the stubs' regions 0600 (ops.private_shm)
    dead_stub_sweeps: bool = True  # dead stubs' regions unlinked, a server holding too many restarted

    @property
    def http_url(self) -> str:
        """host:port of tritonserver's HTTP endpoint (loopback)."""
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def public_http_port(self) -> int:
        """The HTTP port clients use: the proxy's, or tritonserver's own without one."""
        return self.front_door.public["http"] if self.front_door else self.ports["http"]

    @property
    def public_admin_key(self) -> str | None:
        """The key clients send (the proxy's public one, not its internal key): what the generate
        model's weight operations check."""
        return self.front_door.admin_key if self.front_door else self.admin_key

    @property
    def shm_prefix(self) -> str:
        """The /dev/shm prefix of this server's stub regions."""
        return server_shm_prefix(self.public_http_port)

    def command(self) -> list[str]:
        """The tritonserver command line: hardening flags, then the caller's."""
        args = hardening_args(self.extra_args, self.public_http_port, self.admin_key, self.exit_timeout_s)
        if self.front_door:
            args = loopback_args() + args
        return server_command(self.model_repository, self.ports, args + self.extra_args)


@dataclass
class RoundReport:
    """One watchdog round: each expected model's probe, or why there was none."""

    finished: float  # time.monotonic()
    results: dict[str, dict]
    note: str = ""

    @property
    def passed(self) -> bool:
        """Whether every expected model answered correctly."""
        return bool(self.results) and all(result["ok"] for result in self.results.values())

    def as_json(self, max_age_s: float) -> dict:
        """The round for /ready and /status, with its age and whether it is fresh enough."""
        age = time.monotonic() - self.finished
        return {
            "passed": self.passed,
            "age_s": round(age, 3),
            "fresh": age <= max_age_s,
            "note": self.note,
            "models": self.results,
        }


class Watchdog:
    """Probes every model tritonserver has loaded and reloads the ones whose stub died."""

    def __init__(self, config: SupervisorConfig):
        self.config = config
        self.headers = {ADMIN_HEADER: config.admin_key} if config.admin_key else {}
        self.lock = threading.Lock()
        self.last: RoundReport | None = None
        self.reloads_done = 0
        self._expected: set[str] = set()  # models that should answer: loaded once, not unloaded by an admin
        self._configs: dict[str, dict] = {}
        self._timeouts: Counter = Counter()
        self._progress_seen: dict[str, tuple | None] = {}
        self._reloading: dict[str, threading.Thread] = {}
        self._reload_failures: Counter = Counter()
        self._next_reload: dict[str, float] = {}
        self._generation = 0  # which tritonserver process the state belongs to
        self._stalled: dict[str, dict] = {}  # models of the round under way that stopped answering

    @property
    def max_age_s(self) -> float:
        """How old the last round may be for /ready to trust it."""
        return 3 * self.config.watchdog_interval_s + 2 * self.config.probe_timeout_s

    def reset(self) -> None:
        """A new tritonserver process: forget what the old one had loaded."""
        with self.lock:
            self._generation += 1
            self._expected.clear()
            self._configs.clear()
            self._timeouts.clear()
            self._progress_seen.clear()
            self._next_reload.clear()
            self._reload_failures.clear()
            self._stalled.clear()
            self.last = None

    def ready(self) -> tuple[bool, dict]:
        """(whether the last round passed, is fresh and no model of the round under way stopped
        answering, its report)."""
        with self.lock:
            last, stalled = self.last, dict(self._stalled)
        if last is None:
            return False, {"passed": False, "note": "no watchdog round yet (tritonserver starting)", "models": {}}
        report = last.as_json(self.max_age_s)
        if stalled:
            report.update(passed=False, note=f"stopped answering: {', '.join(sorted(stalled))}")
            report["models"] = {**report["models"], **stalled}
        return report["passed"] and report["fresh"], report

    def _call(self, path: str, post: bool = False, timeout_s: float | None = None) -> bytes:
        """tritonserver's answer to GET `path`, or to POST `{}` with the admin key; raises
        ConnectionError (saying the status) unless it is 200, or TimeoutError."""
        method, body, headers = ("POST", b"{}", self.headers) if post else ("GET", None, None)
        url = f"http://{self.config.http_url}{path}"
        status, answer = http_request(method, url, body, headers, timeout_s or self.config.probe_timeout_s)
        if status != 200:
            raise ConnectionError(f"HTTP {status} {answer[:200].decode(errors='replace')}")
        return answer

    def run_round(self) -> RoundReport:
        """Probe every expected model once; start reloads where a stub is dead or hung."""
        generation = self._generation
        started = time.monotonic()
        try:
            index = json.loads(self._call("/v2/repository/index", post=True))
        except (ConnectionError, TimeoutError, ValueError) as error:
            report = RoundReport(time.monotonic(), {}, f"tritonserver not answering: {error}")
            self._publish(report, generation)
            return report
        states = {entry["name"]: (entry.get("state", ""), entry.get("reason", "")) for entry in index}
        with self.lock:
            for name, (state, reason) in states.items():
                if state == "READY":
                    self._expected.add(name)
                elif state == "UNAVAILABLE" and reason == "unloaded" and name not in self._reloading:
                    self._expected.discard(name)  # an admin unloaded it: not ours to bring back
            expected = sorted(self._expected)
        results: dict[str, dict] = {}
        ready_models = []
        for name in expected:
            if name not in states:  # gone from the repository
                with self.lock:
                    self._expected.discard(name)
                continue
            state, reason = states[name]
            if name in self._reloading:
                results[name] = {"ok": False, "detail": "reloading (its stub died)"}
            elif state != "READY":
                results[name] = {"ok": False, "detail": f"state {state or 'unknown'}: {reason}"}
                if state == "UNAVAILABLE":  # a failed (re)load: try again, with backoff
                    self._start_reload(name, f"it is unavailable ({reason})", generation)
            else:
                ready_models.append(name)
        for name, probe in self._probe_all(ready_models, started, generation).items():
            results[name] = self._judge(name, probe, generation)
        report = RoundReport(time.monotonic(), results, "" if expected else "no model loaded")
        self._publish(report, generation)
        return report

    def _probe_all(self, names: list[str], round_started: float, generation: int) -> dict[str, ProbeResult]:
        """Probe the models at once, so a hung one delays no other. A model that finished no request
        since the round began is stuck, not busy: one interval into the round, its unanswered probe
        makes /ready 503 at once (before the probe times out), and a probe a full queue shed
        counts as unanswered (a hung stub's queue sheds every request)."""
        if not names:
            return {}
        before = {name: self._progress(name) for name in names}
        interval = self.config.watchdog_interval_s

        def stuck(name: str) -> bool:
            progress = self._progress(name, interval)
            return progress is None or progress == before[name]

        with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="probe") as pool:
            futures = {
                name: pool.submit(
                    probe_model, self.config.http_url, name, self.config.probe_timeout_s, self._config_of(name)
                )
                for name in names
            }
            _, pending = wait(futures.values(), timeout=max(0.0, round_started + interval - time.monotonic()))
            detail = f"no answer within {interval:g} s and no request finished meanwhile"
            stalled = {
                name: {"ok": False, "detail": detail} for name, f in futures.items() if f in pending and stuck(name)
            }
            if stalled:
                with self.lock:
                    if generation == self._generation:
                        self._stalled = stalled
                log(f"watchdog: not ready: {', '.join(stalled)}: {detail}")
        probes = {name: future.result() for name, future in futures.items()}
        shed = [name for name, probe in probes.items() if probe.shed]
        if shed:  # a full queue sheds at once: judge over an interval, in which a busy model finishes something
            time.sleep(max(0.0, round_started + interval - time.monotonic()))
        for name in shed:
            if stuck(name):
                probes[name] = replace(
                    probes[name],
                    ok=False,
                    shed=False,
                    timed_out=True,
                    detail=f"{probes[name].detail}; no request finished meanwhile",
                )
        return probes

    def _config_of(self, name: str) -> dict | None:
        if name not in self._configs:
            try:
                self._configs[name] = json.loads(self._call(f"/v2/models/{name}/config"))
            except (ConnectionError, TimeoutError, ValueError):
                pass
        return self._configs.get(name)

    def _progress(self, name: str, timeout_s: float | None = None) -> tuple | None:
        """(requests inferred, executions) of a model from its statistics, None if unreadable. Not
        failures: a hung model's queue still rejects requests (a request that fails inside an
        execution moves the executions)."""
        try:
            stats = json.loads(self._call(f"/v2/models/{name}/stats", timeout_s=timeout_s)).get("model_stats", [])
            return (
                sum(int(s.get("inference_count", 0)) for s in stats),
                sum(int(s.get("execution_count", 0)) for s in stats),
            )
        except (ConnectionError, TimeoutError, ValueError, TypeError):
            return None

    def _judge(self, name: str, probe: ProbeResult, generation: int) -> dict:
        if probe.timed_out and probe.kind == "sampler":
            progress = self._progress(name)
            stuck = self._timeouts[name] > 0 and progress is not None and progress == self._progress_seen.get(name)
            self._timeouts[name] = self._timeouts[name] + 1 if stuck else 1
            self._progress_seen[name] = progress
        else:
            self._timeouts[name] = 0
        if probe.unhealthy:
            self._start_reload(name, f"its stub is dead ({probe.detail})", generation)
        elif self._timeouts[name] >= TIMEOUTS_BEFORE_RELOAD:
            self._start_reload(
                name,
                f"{self._timeouts[name]} probes in a row got no answer and it finished no request meanwhile",
                generation,
            )
        return {"ok": probe.ok, "detail": probe.detail, "kind": probe.kind, "ms": round(probe.seconds * 1000, 1)}

    def _publish(self, report: RoundReport, generation: int) -> None:
        with self.lock:
            if generation != self._generation:
                return  # the server this round talked to is gone
            was_ready = self.last is not None and self.last.passed and not self._stalled
            self.last = report
            self._stalled = {}
        if report.passed and not was_ready:
            log(f"watchdog: every model answers ({', '.join(sorted(report.results))}): ready")
        elif was_ready and not report.passed:
            failed = {name: r["detail"] for name, r in report.results.items() if not r["ok"]}
            log(f"watchdog: not ready: {report.note or failed}")

    def _start_reload(self, name: str, why: str, generation: int) -> None:
        now = time.monotonic()
        with self.lock:
            if name in self._reloading or now < self._next_reload.get(name, 0.0):
                return
            thread = threading.Thread(
                target=self._reload, args=(name, why, generation), daemon=True, name=f"reload-{name}"
            )
            self._reloading[name] = thread
        thread.start()

    def _reload(self, name: str, why: str, generation: int) -> None:
        """Unload the model and load it again: a fresh instance with a new stub. (A plain load of
        a loaded model whose files did not change is a no-op in Triton 2.51.) The dead instance
        is never released by the backend; it holds Triton's shutdown until the exit timeout."""
        started = time.monotonic()
        log(f"watchdog: reloading '{name}': {why}")
        ok, detail = False, ""
        try:
            for action in ("unload", "load"):
                self._call(f"/v2/repository/models/{name}/{action}", post=True, timeout_s=RELOAD_TIMEOUT_S)
            ok = True
        except (ConnectionError, TimeoutError) as error:
            detail = str(error)
        seconds = time.monotonic() - started
        with self.lock:
            self._reloading.pop(name, None)
            if generation != self._generation:
                return
            self._configs.pop(name, None)
            self._timeouts[name] = 0
            failures = 0 if ok else self._reload_failures[name] + 1
            self._reload_failures[name] = failures
            self._next_reload[name] = time.monotonic() + RELOAD_BACKOFF_S[min(failures, len(RELOAD_BACKOFF_S) - 1)]
            if ok:
                self.reloads_done += 1
        if ok:
            log(f"watchdog: reloaded '{name}' in {seconds:.1f} s")
        else:
            log(f"watchdog: reloading '{name}' failed after {seconds:.1f} s: {detail}")
        removed = remove_unused_regions(self.config.shm_prefix)
        if removed:
            log(f"removed {len(removed)} unused /dev/shm stub region(s)")

    def loop(self, stopping: threading.Event, server_running) -> None:
        """Rounds every interval while the supervisor runs (none while tritonserver is down)."""
        while not stopping.is_set():
            started = time.monotonic()
            if server_running():
                try:
                    self.run_round()
                except Exception as error:  # the watchdog must outlive any surprise
                    log(f"watchdog: round failed: {type(error).__name__}: {error}")
            stopping.wait(max(0.0, self.config.watchdog_interval_s - (time.monotonic() - started)))


class _ProbeHandler(BaseHTTPRequestHandler):
    supervisor: Supervisor  # set on the subclass made per server
    timeout = 10.0  # a client that sends nothing holds a thread this long, not for good

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/live":
            self._answer(200, {"live": True, "restarts": self.supervisor.restarts})
        elif path in ("/ready", "/status"):
            ready, report = self.supervisor.watchdog.ready()
            report = {
                **report,
                "ready": ready,
                "server_running": self.supervisor.server_running(),
                "restarts": self.supervisor.restarts,
                "drain_restarts": self.supervisor.drain_restarts,
                "reloads": self.supervisor.watchdog.reloads_done,
            }
            ready = ready and report["server_running"]
            self._answer(200 if ready or path == "/status" else 503, report)
        elif path == "/metrics":
            self._answer_metrics()
        else:
            self._answer(404, {"error": "try /ready, /live, /status or /metrics"})

    do_HEAD = do_GET  # noqa: N815 (http.server's name); `_answer` sends a HEAD the head alone

    def _answer_metrics(self) -> None:
        """The front door's refusals (ops.proxy_metrics), 503 while HAProxy's exporter is not there."""
        door = self.supervisor.config.front_door
        try:
            if door is None or door.stats_socket is None:
                raise OSError("no front door with HAProxy's Prometheus exporter")
            body = proxy_metrics.render(door.stats_socket, door.gate_socket).encode()
        except (OSError, ValueError) as error:
            self._answer(503, {"error": f"the front door's metrics are not available: {error}"})
            return
        self._answer(200, body, "text/plain; version=0.0.4")

    def _answer(self, status: int, payload: dict | bytes, content_type: str = "application/json") -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args) -> None:  # probes every few seconds: no access log
        pass


class _ProbeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits to be accepted (the default 5 drops SYNs)

    def handle_error(self, request, client_address) -> None:
        """One line for a connection that failed, none for a client that reset or left (the
        default prints a traceback for each)."""
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):
            log(f"probe port: connection from {client_address[0]} failed: {type(error).__name__}: {error}")


class Supervisor:
    """Runs tritonserver as a child until SIGTERM/SIGINT (docs/operations.md, "The supervisor")."""

    def __init__(self, config: SupervisorConfig):
        self.config = config
        self.watchdog = Watchdog(config)
        self.stopping = threading.Event()
        self.stop_requested_at: float | None = None
        self.child: Child | None = None
        self.restarts = 0
        self._probe_server: ThreadingHTTPServer | None = None
        self.draining = False  # a planned restart is under way: /ready answers 503
        self.drain_restarts = 0
        self._dead_regions: DeadStubRegions | None = None
        self._next_region_sweep = 0.0
        self.helpers = door_children(config.front_door) if config.front_door else []

    def server_running(self) -> bool:
        """Whether tritonserver runs and no stop was asked for."""
        child = self.child
        return child is not None and child.running() and not self.stopping.is_set() and not self.draining

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            log(f"{signal.Signals(signum).name} received: stopping tritonserver")
        self.stopping.set()

    def _start_probe_server(self) -> None:
        if not self.config.probe_port:
            return
        handler = type("ProbeHandler", (_ProbeHandler,), {"supervisor": self})
        # Behind the proxy, which owns the public probe port, it listens on loopback.
        address = ("127.0.0.1", front_door.internal["probe"]) if (front_door := self.config.front_door) else None
        self._probe_server = _ProbeServer(address or ("0.0.0.0", self.config.probe_port), handler)
        # A short poll: shutdown() waits up to one for the serving loop, at every stop.
        threading.Thread(
            target=self._probe_server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True, name="probe-http"
        ).start()
        host, port = self._probe_server.server_address[:2]
        log(f"readiness on http://{host}:{port}/ready (a real inference per model), liveness on /live")

    def _start_child(self) -> None:
        command = self.config.command()
        log("+ " + " ".join(redact(command, self.config.admin_key)))
        self.watchdog.reset()
        # The same Child across restarts: it keeps the restart backoff. It dies with the supervisor
        # and enters the memory limit before exec (the stubs tritonserver forks inherit both).
        cage = self.config.memory_cage
        if self.child is None:
            self.child = Child(
                "tritonserver", command, die_with_parent=True, umask=SERVER_UMASK, nice=settings.TRITON_NICE.value()
            )
        self.child.command = command
        self.child.env = server_environment(self.config.public_admin_key, private_shm=self.config.private_shm)
        self.child.setup = cage.enter if cage else None
        self.child.start()
        self._dead_regions = DeadStubRegions(self.config.shm_prefix)

    def _sweep_dead_regions(self) -> bool:
        """Every watchdog interval: unlink dead stubs' regions; whether what tritonserver still
        maps of them is above the bound (it releases them only when it exits)."""
        now = time.monotonic()
        if now < self._next_region_sweep:
            return False
        self._next_region_sweep = now + self.config.watchdog_interval_s
        pid = self.child.pid
        removed = self._dead_regions.sweep(pid, [member for member in group_members(pid) if member != pid])
        if removed:
            log(f"removed the /dev/shm region(s) of {len(removed)} dead stub(s): {', '.join(removed)}")
        count, size = leaked_regions(pid, self.config.shm_prefix)
        if size <= self.config.shm_leak_limit_bytes:
            return False
        log(
            f"tritonserver still maps {count} dead stub region(s), {size / 2**20:.0f} MiB, above "
            f"{settings.TRITON_SHM_LEAK_LIMIT_BYTES.name} ({self.config.shm_leak_limit_bytes / 2**20:.0f} MiB): "
            "draining and restarting it"
        )
        return True

    def _drain_and_stop(self) -> None:
        """A planned restart: /ready answers 503 for one watchdog interval, so load balancers stop
        sending, then tritonserver stops cleanly (in-flight requests finish within its exit timeout)."""
        self.draining = True
        self.stopping.wait(self.config.watchdog_interval_s)
        if self.stopping.is_set():
            return  # a stop request: the supervisor's own stop follows
        self._stop_child()
        self.draining = False
        self.drain_restarts += 1
        log(f"restarting tritonserver (planned restart #{self.drain_restarts}, to release dead stubs' regions)")

    def _clean_up_after(self, child: Child) -> None:
        end_process_group(child.pid)  # stubs a dead or timed-out server left running
        removed = remove_unused_regions(self.config.shm_prefix)
        if removed:
            log(f"removed {len(removed)} /dev/shm stub region(s) left by tritonserver (pid {child.pid})")

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.process is None:
            return
        asked = self.stop_requested_at or time.monotonic()
        for helper in self.helpers:  # the proxy stops accepting; what is in flight goes on
            if helper.soft_stop != signal.SIGTERM:
                helper.signal(helper.soft_stop)
        child.stop(
            asked + self.config.exit_timeout_s + KILL_MARGIN_S - time.monotonic(),
            on_kill=lambda: log(f"tritonserver still running {time.monotonic() - asked:.1f} s after SIGTERM: SIGKILL"),
        )
        self._clean_up_after(child)
        log(
            f"tritonserver stopped ({describe_exit(child.process.returncode)}) {time.monotonic() - asked:.1f} s after the stop request"
        )

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status (0 after a requested stop)."""
        try:
            return self._run()
        finally:
            for helper in self.helpers:
                helper.stop()
            if self.config.front_door is not None:
                self.config.front_door.clean_up()
            if self.config.memory_cage is not None:
                self.config.memory_cage.remove()
            if self.config.admin_key_file is not None:
                remove_secret_file(self.config.admin_key_file)

    def _tend_helpers(self) -> None:
        """Start the proxy and the gate, or restart whichever died."""
        for helper in self.helpers:
            if helper.running() or not helper.restart_due():
                continue
            if helper.process is not None:
                helper.restarts += 1
                log(f"{helper.name} died ({describe_exit(helper.process.returncode)}): restart #{helper.restarts}")
            helper.start()

    def _run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        removed = remove_unused_regions(self.config.shm_prefix)
        if removed:
            log(f"removed {len(removed)} /dev/shm stub region(s) an earlier server on this port left")
        try:
            self._start_probe_server()
        except OSError as error:
            log(
                f"cannot serve the probe endpoint on port {self.config.probe_port}: {error} "
                f"(set TRITON_PROBE_PORT, 0 for none)"
            )
            return 2
        watchdog = threading.Thread(
            target=self.watchdog.loop, args=(self.stopping, self.server_running), daemon=True, name="watchdog"
        )
        watchdog.start()
        if self.config.memory_cage is not None:
            log(self.config.memory_cage.describe())
        self._tend_helpers()  # the proxy answers 503 until tritonserver is up
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                oom_kills = self.config.memory_cage.oom_kills() if self.config.memory_cage else 0
                self._start_child()  # in the main thread: the parent-death signal follows this thread
                served = leaking = False
                while not self.stopping.is_set() and self.child.running() and not leaking:
                    self.stopping.wait(0.2)
                    served = served or self.watchdog.ready()[0]
                    self._tend_helpers()
                    leaking = self.config.dead_stub_sweeps and not self.stopping.is_set() and self._sweep_dead_regions()
                if leaking:
                    self._drain_and_stop()
                    continue
                if self.stopping.is_set():
                    break
                ran = time.monotonic() - started
                self._clean_up_after(self.child)
                out_of_memory = self.config.memory_cage is not None and self.config.memory_cage.oom_kills() > oom_kills
                delay = self.child.restart_delay(served)  # a request killed a server that served: no escalation
                self.restarts += 1
                log(
                    f"tritonserver died ({describe_exit(self.child.process.returncode)}"
                    f"{', killed by its memory limit' if out_of_memory else ''}) after {ran:.1f} s"
                    f"{' of serving' if served else ', before it served'}; restart #{self.restarts} in {delay:g} s"
                )
                self.stopping.wait(delay)
        finally:
            self.stopping.set()
            self._stop_child()
            for helper in self.helpers:
                helper.stop()
            if self._probe_server is not None:
                self._probe_server.shutdown()
                self._probe_server.server_close()
        return 0
