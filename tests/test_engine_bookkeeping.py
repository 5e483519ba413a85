"""The engine's bookkeeping (engine.ContinuousEngine and its helpers): construction and limits
checks, the KV reservations of rows that join and leave, the drafter's history across a reset,
accepted-draft counting, step records, stop ids and step params.

Each expectation is written out by hand from the documented rules (FIFO admission within the KV
budget, one draft accepted per matching sampled token, ...), on the in-process test LMs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from triton_sampling_mask.generation.drafting import PAD, NgramDrafter, TokenHistory
from triton_sampling_mask.generation.engine import ContinuousEngine, EngineLimits, _accepted, _step_record
from triton_sampling_mask.generation.request import FINISH_LENGTH, FINISH_STOP, step_params, stop_ids
from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.outputs import OUTPUT_LOGPROBS, SAMPLING_LOGPROBS
from triton_sampling_mask.sampling.params import RowParams

from .copying_lm import CopyingLM
from .test_generation import BigramLM, RecordingHandle, engine, generate, policy, request, run_to_end

CYCLE = [20, 21, 22, 23, 24, 25, 26]  # CopyingLM continues a repeated cycle greedily: it drafts


class EventObserver:
    """Keeps, in order, what the engine thread reported: admissions (their prompt tokens), every
    occupancy report and each step's speculation (rows drafting, drafted, accepted)."""

    def __init__(self, log: list | None = None):
        self.log = [] if log is None else log
        self.reports, self.speculation, self.steps = 0, [], []

    def generated(self, tokens):
        pass

    def admitted(self, queue_seconds, prompt_tokens):
        self.log.append(("admitted", prompt_tokens))

    def stepped(self, step):
        self.steps.append(step)

    def occupancy(self, active, waiting, kv_tokens):
        self.reports += 1

    def speculated(self, drafts, drafted, accepted):
        self.speculation.append((drafts, drafted, accepted))


class LoggedHandle(RecordingHandle):
    """A RecordingHandle that also writes its final into a log shared with an EventObserver."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def send(self, chunk, final):
        if final:
            self.log.append(("final", self.name))
        super().send(chunk, final)


def build(lm, observer, drafter=None, **limits) -> ContinuousEngine:
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    return ContinuousEngine(lm, sampler, EngineLimits(**limits), observer, drafter=drafter)


# Construction and limits.


@pytest.mark.parametrize("name", ["max_active_sequences", "max_waiting", "kv_budget_tokens", "max_waiting_tokens"])
def test_each_engine_limit_below_one_is_refused_naming_it_and_its_value(name):
    with pytest.raises(ValueError) as caught:
        EngineLimits(**{name: 0})
    assert str(caught.value) == f"config parameter {name!r} must be >= 1, got 0"


def test_a_fresh_engine_is_not_paused_and_tags_tokens_with_the_default_version_as_bytes_objects():
    running = engine(BigramLM(), start=False)
    assert running.paused is False  # a bool, as the property says, not merely falsy
    (handle,) = generate(BigramLM(), [request([10], 3, ignore_eos=True)])
    versions = handle.output("weight_version")
    # The wire dtype of weight_version is object (Python bytes), before any update too.
    assert versions.dtype == np.object_ and [type(v) for v in versions] == [bytes] * 3
    assert versions.tolist() == [b"default"] * 3


class ThreadRecordingHandle(RecordingHandle):
    """Notes which thread delivers each chunk (the handle is called from the engine thread)."""

    def send(self, chunk, final):
        self.thread = threading.current_thread()
        super().send(chunk, final)


def test_the_loop_runs_on_a_daemon_thread_named_generate_engine():
    # Named for thread dumps; a daemon, so an engine never stopped does not hold the process open.
    handle = ThreadRecordingHandle()
    running = engine(BigramLM())
    try:
        running.submit(request([10], 2, ignore_eos=True), handle)
        assert handle.done.wait(30)
    finally:
        running.stop()
    assert handle.thread.name == "generate-engine" and handle.thread.daemon is True


def test_an_idle_engine_runs_no_steps_until_a_request_comes():
    observer = EventObserver()
    running = build(BigramLM(), observer).start()
    try:
        time.sleep(0.2)
        assert observer.reports == 0 and not observer.steps  # it waits instead of spinning
        handle = RecordingHandle()
        running.submit(request([10], 2, ignore_eos=True), handle)
        assert handle.done.wait(30)
    finally:
        running.stop()
    assert observer.reports >= 2  # one report per step: the two steps of the two tokens


# KV reservations of rows that join and leave.


def test_requests_of_the_whole_kv_budget_run_on_a_fresh_engine_and_again_once_it_emptied():
    # Nothing is reserved before the first request nor once the last row left: each fits alone.
    running = engine(CopyingLM(), kv_budget_tokens=10)
    try:
        for _ in range(2):
            handle = RecordingHandle()
            running.submit(request([5, 6], 8), handle)  # 2 + 8 positions: the whole budget
            assert handle.done.wait(10) and len(handle.ids()) == 8 and not handle.errors
    finally:
        running.stop()


def test_a_waiting_request_is_admitted_exactly_when_the_rows_that_left_free_its_reservation():
    # Reservations (prompt + max_new_tokens) against a budget of 27, admitted FIFO:
    # A 1 + 2 = 3 and B 2 + 19 = 21 start together (24); C 4 + 2 = 6 fits once A left (21 + 6 = 27);
    # D 8 + 2 = 10 does not fit beside B (21 + 10 = 31), so it waits for B to finish (C left earlier).
    # Admissions are told apart by their prompt tokens (3 for A and B, 4 for C, 8 for D).
    log: list = []
    observer = EventObserver(log)
    running = build(CopyingLM(), observer, kv_budget_tokens=27)
    prompts = {"A": ([1], 2), "B": ([2, 3], 19), "C": ([4, 5, 6, 7], 2), "D": ([8, 9, 10, 11, 12, 13, 14, 15], 2)}
    reqs = [request(prompt, budget) for prompt, budget in prompts.values()]
    handles = dict(zip(prompts, run_to_end(running, reqs, 10, [LoggedHandle(name, log) for name in prompts])))
    assert log == [
        ("admitted", 3),
        ("final", "A"),
        ("admitted", 4),
        ("final", "C"),
        ("final", "B"),
        ("admitted", 8),
        ("final", "D"),
    ]
    for name, handle in handles.items():
        # Finishing is not cancelling: a finished row is retired without a cancellation notice.
        assert not handle.errors and handle.cancelled_at is None and handle.finals == 1, name
        assert len(handle.ids()) == prompts[name][1], name


# Speculation: the drafter's history, accepted drafts, rows that drafted.


def test_a_drafting_engine_drafts_again_after_it_emptied():
    # Once its last row left, the engine starts a fresh history: the next request drafts from it.
    observer = EventObserver()
    running = build(CopyingLM(), observer, NgramDrafter(num_tokens=2)).start()
    try:
        for _ in range(2):
            before = len(observer.speculation)
            handle = RecordingHandle()
            running.submit(request(CYCLE * 2, 12, temperature=0.0), handle)
            assert handle.done.wait(10) and not handle.errors and len(handle.ids()) == 12
            assert handle.ids().tolist() == (CYCLE * 3)[:12]  # greedy decoding continues the cycle
            assert sum(drafted for _, drafted, _ in observer.speculation[before:]) > 0
    finally:
        running.stop()


def test_each_step_counts_the_rows_that_drafted_one_token_each():
    # With one draft token per row, the rows that drafted equal the tokens drafted. The short
    # request's last step leaves it no room to draft (its last token is the sure one) while the
    # long one still drafts: that step has one row drafting of two.
    observer = EventObserver()
    running = build(CopyingLM(), observer, NgramDrafter(num_tokens=1))
    reqs = [request(CYCLE * 2, 4, temperature=0.0), request(CYCLE * 2, 14, temperature=0.0)]
    handles = run_to_end(running, reqs, 10)
    assert not any(handle.errors for handle in handles)
    assert observer.speculation and all(drafts == drafted for drafts, drafted, _ in observer.speculation)
    assert (1, 1, 1) in observer.speculation  # the step where only the long request drafted
    assert sum(accepted for _, _, accepted in observer.speculation) > 0


class JoiningHandle(RecordingHandle):
    """Streams; at its `at`-th token (on the engine thread, mid-step) submits `other` to `running`."""

    def __init__(self, running, other, other_handle, at: int):
        super().__init__()
        self.running, self.other, self.other_handle, self.at = running, other, other_handle, at

    def send(self, chunk, final):
        super().send(chunk, final)
        if len(self.chunks) == self.at:
            self.running.submit(self.other, self.other_handle)


def test_a_request_joining_a_drafting_row_drafts_nothing_in_its_first_step():
    # A is drafting when B joins: B's first step samples one position; both continue the cycle.
    observer = EventObserver()
    running = build(CopyingLM(), observer, NgramDrafter(num_tokens=3))
    late = RecordingHandle()
    b = request([30, 31, 32, 30, 31, 32, 30], 9, temperature=0.0)
    first = JoiningHandle(running, b, late, at=3)
    running.submit(request(CYCLE * 2, 20, stream=True, temperature=0.0), first)
    running.start()
    try:
        assert first.done.wait(10) and late.done.wait(10)
    finally:
        running.stop()
    assert not first.errors and not late.errors
    assert first.ids().tolist() == (CYCLE * 3)[:20]
    assert late.ids().tolist() == [31, 32, 30, 31, 32, 30, 31, 32, 30]


def test_accepted_drafts_are_the_leading_ones_each_position_sampled():
    # Row 0 drafted [5, 7], sampled [5, 9, 4]: one accepted. Row 1 drafted [6], sampled [6, 2]:
    # one. Row 2 (fresh) drafted nothing. Row 3 drafted [8, 8] but position 0 broke: none.
    sampled = np.array([[5, 9, 4], [6, 2, PAD], [1, PAD, PAD], [8, 8, 3]])
    drafts = np.array([[5, 7], [6, PAD], [PAD, PAD], [8, 8]])
    unusable = np.zeros(sampled.shape, bool)
    unusable[3, 0] = True
    assert _accepted(sampled, drafts, unusable).tolist() == [1, 1, 0, 0]
    # One draft position: the single draft stands when sampled.
    one = np.array([[5, 6], [7, 8]])
    assert _accepted(one, np.array([[5], [9]]), np.zeros((2, 2), bool)).tolist() == [1, 0]
    # No drafts at all: nothing accepted, whatever the width.
    assert _accepted(one, None, np.zeros((2, 2), bool)).tolist() == [0, 0]
    assert _accepted(one[:, :1], None, np.zeros((2, 1), bool)).tolist() == [0, 0]


# Step records.


def test_a_step_record_counts_only_emitted_tokens_and_rows_that_spoke():
    # Row 0: first step, its only position broke (emitted nothing). Row 1: first step, 3 positions
    # (2 drafts), emitted 2, masked. Row 2: step 5, 1 token, masked, stopped. Row 3: step 2, 1 token,
    # no mask, finished by length.
    now = 10.0
    steps = np.array([0, 0, 5, 2])
    enqueued = np.array([1.0, 2.0, 3.0, 4.0])
    last_at = np.array([0.0, 0.0, 9.5, 9.0])
    emitted = np.array([0, 2, 1, 1])
    ended = np.array([False, False, True, True])
    stopped = np.array([False, False, True, False])
    owner = np.array([0, 1, 1, 1, 2, 3])
    within = np.array([0, 0, 1, 2, 0, 0])
    arrays = {
        OUTPUT_LOGPROBS.name: np.array([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], np.float32),
        SAMPLING_LOGPROBS.name: np.array([-0.5, -0.25, -1.0, -0.5, -0.125, -1.0], np.float32),
    }
    params = RowParams.defaults(4)
    params.return_sampling_mask = np.array([True, True, True, False])
    record = _step_record(now, steps, enqueued, last_at, emitted, ended, stopped, arrays, owner, within, params)
    assert record.first_token_s.tolist() == [8.0]  # row 1 only: row 0 emitted nothing
    assert record.inter_token_s.tolist() == [0.5, 1.0]
    assert record.e2e_s.tolist() == [7.0, 6.0]
    assert record.finished == {FINISH_STOP: 1, FINISH_LENGTH: 1}
    # Row 1's two emitted positions and row 2's: not row 1's rejected draft, not row 3 (no mask).
    assert record.log_kept_mass.tolist() == [-1.75, -2.0, -4.875]


# Stop ids, step params, drafts of a run.


def test_stop_ids_are_int64_even_when_there_are_none():
    assert stop_ids(request([1], 2, stop=[9, 4, 9]), (4, 2)).tolist() == [2, 4, 9]
    for req, eos in ((request([1], 2, ignore_eos=True), (3,)), (request([1], 2), ())):
        ids = stop_ids(req, eos)
        assert ids.dtype == np.int64 and ids.size == 0


def test_step_params_keep_the_seeds_uint64():
    seeds = np.array([7, 2**63 + 5], np.uint64)
    params = replace(RowParams.defaults(2), seed=seeds.copy(), has_seed=np.ones(2, bool))
    stepped = step_params(params, np.array([0, 3]))
    assert stepped.seed.dtype == np.uint64
    expected = [
        int(rng.step_seeds(torch.from_numpy(seeds.view(np.int64))[i : i + 1], s)[0]) for i, s in ((0, 0), (1, 3))
    ]
    assert stepped.seed.view(np.int64).tolist() == expected


def test_a_run_of_three_equal_tokens_drafts_that_token():
    # [9, 9, 9]: its last two tokens match the two before them (period 1): the draft repeats 9.
    history = TokenHistory()
    history.join([np.array([9, 9, 9])], [8])
    drafts = NgramDrafter(num_tokens=4, max_n=3, min_n=2).propose(history.tokens, history.lengths, np.array([4]))
    assert drafts.tolist() == [[9, 9, 9, 9]]


def test_unseeded_requests_admitted_together_draw_distinct_seeds_over_the_whole_range():
    handles = generate(CopyingLM(), [request([5, 6], 2) for _ in range(3)])
    seeds = [h.output("sampling_seed") for h in handles]
    assert all(s.dtype == np.uint64 and len(set(s.tolist())) == 1 for s in seeds)  # one seed per request
    drawn = [int(s[0]) for s in seeds]
    assert len(set(drawn)) == 3
    # Drawn from all 2**64 seeds: three below 2**32 would happen once in 2**96 runs.
    assert max(drawn) >= 2**32
