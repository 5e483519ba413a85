"""Several replicas of a model behind one client: which replica takes the next request, which
failures eject a replica, and when an ejected one is probed back in.

The choice is the healthy replica with the fewest outstanding requests (ties taken in turn). A
replica that fails (`is_replica_failure`) is ejected for `eject_backoff_s`; once that passes, the
client probes it in the background (server and model ready) and readmits it on success, else
ejects it again for twice as long, up to `max_eject_backoff_s`. A request is never refused on the
client side: with every untried replica ejected, the call is sent to an ejected one anyway, and an
answer from it readmits it at once. `Attempts` is one request's way through them: the next
replica, the pause after a round where all failed, which errors end the request, and the busy
contract (`sampling.refusals`): a refusal that says the server is busy is retried on the same
terms by every client, after a jittered exponential backoff, until `BusyPolicy.timeout_s` has
passed since the request's first such refusal; it neither ejects the replica nor uses up an
attempt. No Triton import beyond what the caller passes in.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..sampling.refusals import is_busy

# The messages of a replica that is up but cannot serve: the Python backend's answer (500 /
# INTERNAL) when a model's stub process died.
_UNHEALTHY_MESSAGES = ("is not healthy",)
# Statuses of a replica that could not take the request: load shed (queue full), unreachable,
# shutting down.
_UNAVAILABLE_STATUSES = ("503", "StatusCode.UNAVAILABLE")

DEFAULT_EJECT_BACKOFF_S = 0.5
DEFAULT_MAX_EJECT_BACKOFF_S = 5.0


def is_replica_failure(status: str | None, message: str) -> bool:
    """Whether a failed request says the replica is unusable right now (so another may answer it):
    no answer at all (status None: refused, reset), 503 / UNAVAILABLE (shedding load, down), or a
    model whose stub died ("... is not healthy"). User errors (400 / INVALID_ARGUMENT) and every
    other server answer are final: another replica would answer the same."""
    if is_busy(message):  # it answered: busy, not broken
        return False
    if status is None or status in _UNAVAILABLE_STATUSES:
        return True
    return any(text in message for text in _UNHEALTHY_MESSAGES)


def split_urls(url: str | Sequence[str]) -> list[str]:
    """One URL or several as a list, refusing an empty list and repeats."""
    urls = [url] if isinstance(url, str) else list(url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"url must be a non-empty string or a non-empty list of them, got {url!r}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"the replica URLs repeat: {urls}")
    return urls


@dataclass(eq=False)
class Replica:
    """One server: its load and health as this client sees them."""

    url: str
    outstanding: int = 0  # requests sent and not yet answered
    served: int = 0  # inference requests it answered
    failures: int = 0  # consecutive failures (sets the ejection backoff)
    ejected_until: float | None = None  # time.monotonic() of the next probe; None: healthy
    probing: bool = False
    # connections: `current` the one in use, `made` every one ever created (closed with the client)
    current: object | None = None
    made: list = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.ejected_until is None


class ReplicaSet:
    """The replicas of one client and their connections, safe to use from several threads.

    `make_client(url)` builds a connection (an asyncio tritonclient, or the generate model's
    own): one per replica serves every concurrent request."""

    def __init__(
        self,
        urls: Sequence[str],
        make_client: Callable[[str], object],
        eject_backoff_s: float = DEFAULT_EJECT_BACKOFF_S,
        max_eject_backoff_s: float = DEFAULT_MAX_EJECT_BACKOFF_S,
    ):
        if eject_backoff_s <= 0 or max_eject_backoff_s < eject_backoff_s:
            raise ValueError("need 0 < eject_backoff_s <= max_eject_backoff_s")
        self.replicas = [Replica(url) for url in urls]
        self._make_client = make_client
        self._eject_backoff_s = eject_backoff_s
        self._max_eject_backoff_s = max_eject_backoff_s
        self._lock = threading.Lock()
        self._turn = 0
        for replica in self.replicas:  # made now, so a bad URL or keyword fails at construction
            replica.current = self._new_client(replica)

    def _new_client(self, replica: Replica):
        client = self._make_client(replica.url)
        replica.made.append(client)
        return client

    def acquire(self, tried: set) -> tuple[Replica, object] | None:
        """The replica for the next request and a tritonclient for it, or None when every replica
        is in `tried`. Healthy ones first, fewest outstanding requests first, ties in turn."""
        with self._lock:
            untried = [r for r in self.replicas if r not in tried]
            if not untried:
                return None
            healthy = [r for r in untried if r.healthy]
            count = len(self.replicas)
            if healthy:
                replica = min(healthy, key=lambda r: (r.outstanding, (self.replicas.index(r) - self._turn) % count))
            else:  # every untried replica is ejected: try the one due back first rather than refuse
                replica = min(untried, key=lambda r: r.ejected_until)
            self._turn += 1
            if replica.current is None:
                replica.current = self._new_client(replica)
            replica.outstanding += 1
            return replica, replica.current

    def release(self, replica: Replica, client, reachable: bool, served: bool = False) -> None:
        """Return a lent tritonclient. `reachable`: the replica answered (even with an error),
        which readmits an ejected one; otherwise it is ejected. `served`: count an inference."""
        with self._lock:
            replica.outstanding -= 1
            if reachable:
                replica.served += served
                replica.failures, replica.ejected_until = 0, None
            elif replica.healthy:  # the first failure ejects; more from requests already in flight add nothing
                replica.failures = 1
                replica.ejected_until = time.monotonic() + self._eject_backoff_s

    def due_for_probe(self) -> list[Replica]:
        """Ejected replicas whose backoff has passed and that nobody probes yet (now marked probing)."""
        now = time.monotonic()
        with self._lock:
            due = [r for r in self.replicas if not r.healthy and not r.probing and r.ejected_until <= now]
            for replica in due:
                replica.probing = True
            return due

    def probed(self, replica: Replica, ready: bool) -> None:
        """Record a probe: readmit the replica (with fresh tritonclients), or eject it for longer."""
        with self._lock:
            replica.probing = False
            if replica.healthy:  # a request answered meanwhile
                return
            if ready:
                replica.failures, replica.ejected_until = 0, None
                # Fresh tritonclients from now on: an old gRPC channel may still sit in its reconnect
                # backoff. The old ones stay in `made`, closed with the client.
                replica.current = None
            else:
                replica.failures += 1
                backoff = min(self._max_eject_backoff_s, self._eject_backoff_s * 2 ** (replica.failures - 1))
                replica.ejected_until = time.monotonic() + backoff

    def served(self) -> dict[str, int]:
        """Inference requests answered by each replica, by URL."""
        with self._lock:
            return {r.url: r.served for r in self.replicas}

    def healthy_urls(self) -> list[str]:
        """The replicas not ejected right now."""
        with self._lock:
            return [r.url for r in self.replicas if r.healthy]

    def all_clients(self) -> list:
        """Every tritonclient made, for closing."""
        with self._lock:
            return [client for r in self.replicas for client in r.made]


def round_pause_s(round_number: int) -> float:
    """The pause before trying every replica again, after a round where all failed."""
    return min(1.0, 0.05 * 2**round_number)


@dataclass(frozen=True)
class BusyPolicy:
    """How a request refused as busy is retried: after `backoff_s` doubling up to `max_backoff_s`
    (each pause half the step plus up to as much again at random, so clients spread out), until
    `timeout_s` has passed since its first busy refusal."""

    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    timeout_s: float = 600.0

    def __post_init__(self):
        if not 0 < self.backoff_s <= self.max_backoff_s or self.timeout_s < 0:
            raise ValueError("need 0 < backoff_s <= max_backoff_s and busy_timeout_s >= 0")

    def pause_s(self, tries: int, rng: random.Random) -> float:
        """The pause before busy retry number `tries` (0 first)."""
        step = min(self.max_backoff_s, self.backoff_s * 2**tries)
        return step / 2 + rng.uniform(0, step / 2)


class BusyCounter:
    """Busy refusals a client met (each retried after a backoff), shared by its requests."""

    def __init__(self):
        self.count = 0
        self.rng = random.Random()


class Attempts:
    """One request's retry policy, shared by every client: which replica next, when a whole round
    failed, and whether an error ends the request or moves it on.

    `start_probes()` probes ejected replicas that are due; `server_error(exc)` is the failure
    (with `status` and `message`) a server or transport exception stands for, or None for any
    other exception, which is raised as it is."""

    def __init__(
        self,
        replicas: ReplicaSet,
        max_attempts: int,
        start_probes: Callable[[], None],
        server_error: Callable[[BaseException], Exception | None],
        busy_policy: BusyPolicy | None = None,
        busy_counter: BusyCounter | None = None,
    ):
        self.replicas, self.max_attempts = replicas, max_attempts
        self.start_probes, self.server_error = start_probes, server_error
        self.busy_policy, self.busy_counter = busy_policy or BusyPolicy(), busy_counter or BusyCounter()
        self.tried: set = set()
        self.attempts = self.rounds = 0
        self.busy_since: float | None = None
        self.busy_tries = 0

    def next_lease(self):
        """(replica, tritonclient) not yet tried this round, or None when every replica failed
        this round (the caller pauses `pause_s()`, then all are tried again)."""
        self.start_probes()
        lease = self.replicas.acquire(self.tried)
        if lease is None:
            self.rounds += 1
            self.tried.clear()
        else:
            self.attempts += 1
        return lease

    def pause_s(self) -> float:
        return round_pause_s(self.rounds)

    def failed(self, lease, exc: BaseException) -> float:
        """Release the replica after `exc`; re-raise it (as its server error for server and
        transport errors) unless it says the server is busy and the busy timeout has not passed,
        or that the replica failed and attempts remain. Returns the pause before the next try."""
        replica, tritonclient = lease
        error = self.server_error(exc)
        if error is None:
            self.replicas.release(replica, tritonclient, reachable=True)
            raise exc
        if is_busy(error.message):
            self.replicas.release(replica, tritonclient, reachable=True)
            now = time.monotonic()
            self.busy_since = self.busy_since or now
            if now - self.busy_since >= self.busy_policy.timeout_s:
                raise error from None
            self.busy_counter.count += 1
            pause = self.busy_policy.pause_s(self.busy_tries, self.busy_counter.rng)
            self.busy_tries += 1
            self.attempts, self.rounds = 0, 0  # a busy refusal is no failed try
            self.tried.clear()
            return pause
        failed = is_replica_failure(error.status, error.message)
        self.replicas.release(replica, tritonclient, reachable=not failed)
        if not failed or self.attempts >= self.max_attempts:
            raise error from None
        self.tried.add(replica)
        return 0.0

    def served(self, lease, result, served: bool):
        """Release the replica after a success and pass the result on."""
        self.replicas.release(*lease, reachable=True, served=served)
        return result

    async def acall(self, work: Callable, served: bool = False):
        """`await work(client)` on a chosen replica, retried on another while `failed` allows;
        after a round where every replica failed, a pause. `served` counts the answer for
        `served()`."""
        while True:
            lease = self.next_lease()
            if lease is None:
                await asyncio.sleep(self.pause_s())
                continue
            try:
                result = await work(lease[1])
            except BaseException as exc:
                pause = self.failed(lease, exc)
                if pause:
                    await asyncio.sleep(pause)
                continue
            return self.served(lease, result, served)


class ReplicaAccounts:
    """What every client tells of its replicas, sync or asyncio: `_replicated()` is the
    ReplicatedClient that holds them (the client itself, or the asyncio twin a sync client runs)."""

    def _replicated(self) -> ReplicatedClient:
        return self  # type: ignore[return-value]

    def replica_shares(self) -> dict[str, int]:
        """Requests each replica answered so far, by URL (the sampler client counts each chunk of
        a split request)."""
        return self._replicated()._replicas.served()

    def healthy_replicas(self) -> list[str]:
        """The URLs of the replicas not ejected right now."""
        return self._replicated()._replicas.healthy_urls()

    @property
    def busy_refusals(self) -> int:
        """Refusals that said the server was busy so far (each retried after a backoff)."""
        return self._replicated()._busy.count


class ReplicatedClient(ReplicaAccounts):
    """What every client does with its replicas: the default number of attempts, the replica
    set, the retry policy of a request, the probes of ejected replicas and closing them all
    (asyncio). A subclass calls `_init_replicas` and defines `_server_error` and `_probe`."""

    def _init_replicas(
        self,
        url: str | Sequence[str],
        make_client: Callable[[str], object],
        max_attempts: int | None,
        eject_backoff_s: float,
        max_eject_backoff_s: float,
        busy_policy: BusyPolicy | None = None,
    ) -> None:
        self.urls = split_urls(url)
        if max_attempts is None:  # one URL: fail at once, as a plain tritonclient would
            max_attempts = 1 if len(self.urls) == 1 else 2 * len(self.urls)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.max_attempts = max_attempts
        self.busy_policy = busy_policy or BusyPolicy()
        self._busy = BusyCounter()
        self._probes: set = set()  # background health probes of ejected replicas (tasks)
        self._calls: set = set()  # tasks of calls in progress (cancelled by close)
        self._replicas = ReplicaSet(self.urls, make_client, eject_backoff_s, max_eject_backoff_s)

    def _attempts(self) -> Attempts:
        """The retry policy of one request over this client's replicas."""
        return Attempts(
            self._replicas, self.max_attempts, self._start_probes, self._server_error, self.busy_policy, self._busy
        )

    def _start_probes(self) -> None:
        """Probe the ejected replicas that are due, each as a task kept until it ends (`close`
        awaits them)."""
        for replica in self._replicas.due_for_probe():
            task = asyncio.ensure_future(self._probe(replica))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _on_a_replica(self, work, served: bool = False):
        """`await work(connection)` on a chosen replica, retried on another when the replica fails."""
        return await self._attempts().acall(work, served)

    async def close(self) -> None:
        """Cancel the calls in progress (and their requests on the server), wait for the health
        probes in flight (each bounded by its timeout), then close every connection."""
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, *self._probes, return_exceptions=True)
        for client in self._replicas.all_clients():
            await client.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
