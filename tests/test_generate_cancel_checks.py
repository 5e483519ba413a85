"""How the generate model's request handle notices a cancellation: the engine asks every row every
step, the handle asks tritonserver (an IPC round trip per ask) at most once per
CANCEL_CHECK_INTERVAL_S, the first time at once, and its batch-mates' asks are spread over the
interval. A cancelled request is still noticed within the interval plus one step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from triton_sampling_mask.serving.generate_model import CANCEL_CHECK_INTERVAL_S, _RequestHandle

STEP_S = CANCEL_CHECK_INTERVAL_S / 7  # engine steps well shorter than the interval


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Request:
    """A Triton request whose client cancels it at `cancel_at` (the clock's time); counts the asks."""

    def __init__(self, clock: Clock, cancel_at: float = math.inf):
        self.clock, self.cancel_at, self.asks = clock, cancel_at, 0

    def get_response_sender(self):
        return None

    def is_cancelled(self) -> bool:
        self.asks += 1
        return self.clock.now >= self.cancel_at


def handle(request: Request, clock: Clock, ordinal: int = 0) -> _RequestHandle:
    model = SimpleNamespace(pb_utils=SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1))
    return _RequestHandle(model, request, outbox=None, ordinal=ordinal, clock=clock)


def steps_until_noticed(h: _RequestHandle, clock: Clock, limit: int = 10_000) -> int:
    """Ask once per engine step, as the engine does, until the handle says cancelled."""
    for step in range(limit):
        if h.is_cancelled():
            return step
        clock.now += STEP_S
    raise AssertionError("the cancellation was never noticed")


def test_the_first_ask_goes_to_tritonserver():
    # A request cancelled while it waited is noticed at admission, before its first step.
    clock = Clock()
    request = Request(clock, cancel_at=0.0)
    assert handle(request, clock, ordinal=5).is_cancelled() and request.asks == 1


@pytest.mark.parametrize("ordinal", [0, 1, 2, 31])
@pytest.mark.parametrize("cancel_after_s", [0.0, 0.013, 0.25, 1.0])
def test_a_cancellation_is_noticed_within_the_interval_plus_a_step(ordinal, cancel_after_s):
    clock = Clock()
    request = Request(clock, cancel_at=clock.now + STEP_S / 2 + cancel_after_s)
    h = handle(request, clock, ordinal)
    step = steps_until_noticed(h, clock)
    assert clock.now - request.cancel_at <= CANCEL_CHECK_INTERVAL_S + STEP_S
    # tritonserver was asked once at admission, then at most once per interval
    assert request.asks <= 2 + (step * STEP_S) / CANCEL_CHECK_INTERVAL_S


def test_asks_are_paced_not_one_per_step():
    clock = Clock()
    request = Request(clock)
    h = handle(request, clock)
    steps = 700
    for _ in range(steps):
        assert not h.is_cancelled()
        clock.now += STEP_S
    expected = steps * STEP_S / CANCEL_CHECK_INTERVAL_S  # 100 intervals
    assert expected - 2 <= request.asks <= expected + 2


def test_requests_admitted_together_ask_in_different_steps():
    clock = Clock()
    requests = [Request(clock) for _ in range(32)]
    handles = [handle(r, clock, ordinal=k) for k, r in enumerate(requests)]
    asked_at_step: list[int] = []
    for _ in range(int(CANCEL_CHECK_INTERVAL_S / STEP_S) + 1):
        before = [r.asks for r in requests]
        for h in handles:
            h.is_cancelled()
        asked_at_step.append(sum(r.asks - b for r, b in zip(requests, before)))
        clock.now += STEP_S
    assert asked_at_step[0] == 32  # at admission, every one
    # within the first interval the second asks are spread over the steps, not all in one
    assert sum(asked_at_step[1:]) >= 32 - 5 and max(asked_at_step[1:]) <= 32 // 4


def test_a_broken_sender_counts_as_cancelled_without_asking():
    clock = Clock()
    request = Request(clock)
    h = handle(request, clock)
    h.broken = True
    assert h.is_cancelled() and request.asks == 0
