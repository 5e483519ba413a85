"""The order the HTTP API sends sequences to the generate engine in (plugin/api/admission.py),
against a plain model of it: no more sequences in the engine than its rows and KV budget hold; a
request alone fills it; the next freed row goes to the request with the fewest sequences in the
engine (the oldest on a tie); no sequence is overtaken by a later one that would fit sooner; a
waiter that is cancelled leaves no trace."""

from __future__ import annotations

import asyncio

import pytest

from triton_sampling_mask.api.admission import EngineCapacity, FairAdmission


class Held:
    """A sequence holding its slot until `release` is set."""

    def __init__(self, share, tokens: int, log: list, name: str):
        self.release = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(share, tokens, log, name))

    async def _run(self, share, tokens, log, name):
        async with share.slot(tokens):
            log.append(name)
            await self.release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_request_alone_fills_the_engine_and_the_next_row_goes_to_a_newcomer():
    async def scenario():
        admission = FairAdmission(EngineCapacity(rows=4, kv_tokens=10_000))
        big, small = admission.share(), admission.share()
        log: list[str] = []
        bigs = [Held(big, 100, log, f"big{i}") for i in range(8)]
        await settle()
        assert log == ["big0", "big1", "big2", "big3"] and admission.rows_used == 4
        chat = Held(small, 10, log, "chat")
        await settle()
        assert "chat" not in log  # the engine is full: it waits for a row
        bigs[0].release.set()
        await settle()
        assert log[4] == "chat"  # the freed row goes to the request with none in the engine
        bigs[1].release.set()
        await settle()
        assert log[5] == "big4"
        for held in [*bigs, chat]:
            held.release.set()
        await asyncio.gather(*(h.task for h in [*bigs, chat]))
        assert admission.rows_used == 0 and admission.tokens_used == 0

    run(scenario())


def test_the_kv_budget_bounds_and_a_large_sequence_is_not_overtaken():
    async def scenario():
        admission = FairAdmission(EngineCapacity(rows=10, kv_tokens=1_000))
        first, second, third = admission.share(), admission.share(), admission.share()
        log: list[str] = []
        a = Held(first, 600, log, "a")
        await settle()
        b = Held(second, 600, log, "b")  # does not fit beside a
        await settle()
        c = Held(third, 100, log, "c")  # would fit, but b came first
        await settle()
        assert log == ["a"]
        a.release.set()
        await settle()
        assert log == ["a", "b", "c"]
        b.release.set(), c.release.set()
        await asyncio.gather(a.task, b.task, c.task)

    run(scenario())


def test_a_sequence_larger_than_the_whole_budget_still_goes_alone():
    async def scenario():
        admission = FairAdmission(EngineCapacity(rows=4, kv_tokens=1_000))
        log: list[str] = []
        huge = Held(admission.share(), 5_000, log, "huge")  # the engine refuses it, with its own message
        await settle()
        assert log == ["huge"]
        huge.release.set()
        await huge.task

    run(scenario())


def test_a_cancelled_waiter_leaves_no_trace():
    async def scenario():
        admission = FairAdmission(EngineCapacity(rows=1, kv_tokens=1_000))
        first, second = admission.share(), admission.share()
        log: list[str] = []
        holder = Held(first, 10, log, "holder")
        await settle()
        waiter = Held(second, 10, log, "waiter")
        await settle()
        waiter.task.cancel()
        await asyncio.gather(waiter.task, return_exceptions=True)
        admission.leave(second)
        later = Held(first, 10, log, "later")
        holder.release.set()
        await settle()
        assert log == ["holder", "later"] and admission.rows_used == 1
        later.release.set()
        await later.task
        assert admission.rows_used == 0

    run(scenario())


@pytest.mark.parametrize(
    "config, capacity",
    [
        (
            {
                "parameters": {
                    "max_active_sequences": {"string_value": "32"},
                    "kv_budget_tokens": {"string_value": "16384"},
                }
            },
            EngineCapacity(32, 16384),
        ),
        (
            {
                "parameters": {
                    "max_active_sequences": {"string_value": "8"},
                    "kv_budget_tokens": {"string_value": "100"},
                },
                "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
            },
            EngineCapacity(16, 200),
        ),
        ({"parameters": {}}, None),
    ],
)
def test_the_engine_capacity_is_read_from_the_model_config(config, capacity):
    assert EngineCapacity.from_model_config(config) == capacity
