"""Which request's sequence the API sends to the generate engine next, so that one request asking
for many long sequences does not make every later request wait for all of them.

The engine admits what it is sent first come, first served, up to its rows
(`max_active_sequences`) and KV budget (`kv_budget_tokens`, each sequence reserving its prompt and
its budget), and a running sequence keeps its row to its end. Were the API to send a request's
sequences all at once (`n` 256 of 511 tokens), a chat sent a moment later would queue behind every
one of them. Instead the API keeps no more sequences in the engine than its rows and budget hold,
and when one ends, the next goes to the request with the fewest sequences in the engine (the
oldest request on a tie): a request alone fills the engine, and another one arriving gets the next
row that frees, so it waits for at most one running sequence, however many others asked for. A
sequence is never overtaken by a smaller one that would fit sooner (as in the engine, so a large
one is never starved).

The engine's rows and budget are read from the generate model's config (`EngineCapacity`);
clients calling the model directly share the engine without this order.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ..model_config import int_parameter

ROWS_PARAMETER, KV_PARAMETER = "max_active_sequences", "kv_budget_tokens"


@dataclass(frozen=True)
class EngineCapacity:
    """What the generate model's engines hold at once: rows and KV positions, over its instances."""

    rows: int
    kv_tokens: int

    @classmethod
    def from_model_config(cls, config: dict) -> EngineCapacity | None:
        """From the model config's parameters; None when it names neither bound."""
        parameters = config.get("parameters") or {}
        if ROWS_PARAMETER not in parameters or KV_PARAMETER not in parameters:
            return None
        groups = config.get("instance_group") or [{}]
        instances = sum(int(group.get("count", 1)) for group in groups) or 1
        rows, kv = int_parameter(config, ROWS_PARAMETER, 1), int_parameter(config, KV_PARAMETER, 1)
        return cls(max(rows, 1) * instances, max(kv, 1) * instances)


class RequestShare:
    """One request's place in the admission: its sequences in the engine and those waiting."""

    def __init__(self, admission: FairAdmission, arrival: int):
        self.admission, self.arrival = admission, arrival
        self.in_engine = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    @asynccontextmanager
    async def slot(self, tokens: int):
        """Wait for this sequence's turn (`tokens`: its prompt and budget), hold it inside."""
        need = min(tokens, self.admission.capacity.kv_tokens)
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((need, future))
        self.admission._dispatch()
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.admission._release(self, need)  # granted as it was cancelled
            else:
                if (need, future) in self.waiting:
                    self.waiting.remove((need, future))
                self.admission._dispatch()
            raise
        try:
            yield
        finally:
            self.admission._release(self, need)


class FairAdmission:
    """The order sequences enter the engine in (see the module docstring)."""

    def __init__(self, capacity: EngineCapacity):
        self.capacity = capacity
        self.rows_used = self.tokens_used = 0
        self._shares: list[RequestShare] = []
        self._arrivals = itertools.count()

    def share(self) -> RequestShare:
        """A new request's share (drop it with `leave` when the request ends)."""
        share = RequestShare(self, next(self._arrivals))
        self._shares.append(share)
        return share

    def leave(self, share: RequestShare) -> None:
        if share in self._shares:
            self._shares.remove(share)

    def _dispatch(self) -> None:
        while True:
            candidates = [s for s in self._shares if s.waiting]
            if not candidates:
                return
            share = min(candidates, key=lambda s: (s.in_engine, s.arrival))
            need, future = share.waiting[0]
            if future.done():  # cancelled, its waiter not yet gone
                share.waiting.popleft()
                continue
            fits = self.rows_used < self.capacity.rows and self.tokens_used + need <= self.capacity.kv_tokens
            if not fits and self.rows_used:
                return
            share.waiting.popleft()
            self.rows_used += 1
            self.tokens_used += need
            share.in_engine += 1
            future.set_result(None)

    def _release(self, share: RequestShare, need: int) -> None:
        self.rows_used -= 1
        self.tokens_used -= need
        share.in_engine -= 1
        self._dispatch()
