"""Wrong admin keys counted per source address, as the front door counts the header's.

The front door refuses an address's keyed requests once it has sent more than
`WRONG_KEYS_PER_MINUTE` wrong keys within a minute (HAProxy's `gpc0_rate(60s)`): the generate
model applies the same rule to the `admin_key` of its control requests, by the address the request
carries (sampling.admin.CLIENT_ADDRESS_PARAMETER), so an address blocked on one path is blocked on
every path that reaches the model (gRPC, HTTP /generate, the HTTP API's weight routes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..sampling.admin import WRONG_KEYS_PER_MINUTE

WINDOW_S = 60.0
# Sources remembered at once (the front door's table holds 100k): past it, those idle longest go.
MAX_SOURCES = 100_000
# Requests that carry no address: counted together (one source for all of them).
UNATTRIBUTED = ""


class WrongKeyLimit:
    """Per source, the wrong keys of the last WINDOW_S seconds; `blocked(source)` once there are
    more than `limit` of them. Thread-safe; `clock` is a monotonic clock in seconds."""

    def __init__(self, limit: int = WRONG_KEYS_PER_MINUTE, clock: Callable[[], float] = time.monotonic):
        self.limit, self.clock = limit, clock
        self._lock = threading.Lock()
        self._wrong: dict[str, deque[float]] = {}

    def _recent(self, source: str, now: float) -> deque[float]:
        times = self._wrong.get(source)
        if times is None:
            return deque()
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        if not times:
            del self._wrong[source]
        return times

    def blocked(self, source: str) -> bool:
        """Whether `source` sent more than `limit` wrong keys within the last minute."""
        with self._lock:
            return len(self._recent(source, self.clock())) > self.limit

    def record(self, source: str) -> None:
        """Count one wrong key from `source`."""
        with self._lock:
            now = self.clock()
            times = self._recent(source, now)
            if source not in self._wrong:
                if len(self._wrong) >= MAX_SOURCES:
                    self._forget_one(now)
                self._wrong[source] = times
            # Memory per source stays bounded: past the limit the count only needs to stay past it.
            if len(times) > self.limit:
                times.popleft()
            times.append(now)

    def _forget_one(self, now: float) -> None:
        for source in list(self._wrong):
            if not self._recent(source, now):
                return
        self._wrong.pop(next(iter(self._wrong)))  # the oldest remembered source
