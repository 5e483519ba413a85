"""The engine's pause and weight-update controls (engine.ContinuousEngine): a bad mode refused with
its message, an abort's message naming the default reason, an update leaving a paused engine
paused, and the version tag each later token carries (the object dtype of the output)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from triton_sampling_mask.generation.engine import ABORT, IN_PLACE
from triton_sampling_mask.sampling.outputs import WEIGHT_VERSION
from triton_sampling_mask.sampling.refusals import RETRY_MARKER

from .test_generation import MASKED, RecordingHandle, engine, request
from .test_weights import PROMPT, served


@pytest.fixture(scope="module")
def lm():
    return served()


def test_an_unknown_pause_mode_is_refused_listing_the_modes(lm):
    running = engine(lm, start=False)
    with pytest.raises(ValueError) as caught:
        running.pause("drain")
    assert str(caught.value) == "pause mode must be one of ['abort', 'finish', 'in_place'], got 'drain'"
    assert not running.paused


class GatedHandle(RecordingHandle):
    """Holds the engine's loop in its first `send` until `gate` opens: the row is then in flight."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def send(self, chunk, final):
        super().send(chunk, final)
        assert self.gate.wait(30)


def test_an_abort_pause_fails_the_rows_in_flight_naming_the_pause(lm):
    running = engine(lm)
    try:
        handle = GatedHandle()
        running.submit(request(PROMPT, 50, stream=True, ignore_eos=True, **MASKED), handle)
        assert handle.first.wait(30)
        threading.Timer(0.3, handle.gate.set).start()  # opens once the pause below is asked for
        running.pause(ABORT)
        assert handle.done.wait(30)
        assert handle.errors == [("UNAVAILABLE", f"generation aborted by pause_generation; {RETRY_MARKER}")]
        assert running.paused
    finally:
        running.stop()


def test_an_update_leaves_a_paused_engine_paused_and_resumes_a_running_one(lm):
    running = engine(lm)
    try:
        running.pause(IN_PLACE)
        assert running.update_weights(lambda: "written", "v2") == "written"
        assert running.paused and running.weight_version == "v2"
        running.resume()
        assert running.update_weights(lambda: None, "v3") is None
        assert not running.paused and running.weight_version == "v3"
    finally:
        running.stop()


def test_tokens_after_an_update_carry_its_version_as_python_bytes(lm):
    running = engine(lm)
    try:
        running.update_weights(lambda: None, "step-7")
        handle = RecordingHandle()
        running.submit(request(PROMPT, 3, ignore_eos=True, **MASKED), handle)
        assert handle.done.wait(30) and not handle.errors
        versions = handle.output("weight_version")
        assert versions.dtype == WEIGHT_VERSION.dtype == np.object_
        assert versions.tolist() == [b"step-7"] * 3
    finally:
        running.stop()


def test_an_abort_empties_the_waiting_prompt_tokens_it_ends(lm):
    # Requests that wait while the engine is paused are ended by an abort, and their prompt tokens
    # no longer count against max_waiting_tokens: the next requests may fill it exactly.
    running = engine(lm, max_waiting_tokens=2 * len(PROMPT))
    try:
        running.pause(IN_PLACE)
        waiting = [RecordingHandle() for _ in range(2)]
        for handle in waiting:
            running.submit(request(PROMPT, 4, ignore_eos=True, **MASKED), handle)
        running.resume()
        running.pause(ABORT)  # may end them in flight or still waiting: either way they are gone
        assert all(handle.done.wait(30) for handle in waiting)
        for _ in range(2):  # exactly max_waiting_tokens: both are taken while the engine holds
            running.submit(request(PROMPT, 4, ignore_eos=True, **MASKED), RecordingHandle())
    finally:
        running.stop()
