"""Generation without Triton: per-step seeds, request checks, the padded LM batch, the engine.

The engine runs in-process on a bigram LM (logits = a fixed row per previous token) plugged in
through the `lm` factory hook, so every step's support can be recomputed by the float64 numpy
reference, and on the default tiny Llama for joins, cancellation and bounds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.generation.engine import ContinuousEngine, EngineFull, EngineLimits
from triton_sampling_mask.generation.lm import load_lm
from triton_sampling_mask.generation.request import (
    GenerationRequest,
    admission_errors,
    check_generation_request,
    stop_ids,
)
from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import MaskPolicy, SamplingRequestError

from .lm_reference import replica
from .reference import reference_row

VOCAB = 64
WIDTH = 16
EOS = 3


class BigramLM:
    """next-token logits = TABLE[previous token]; the 'cache' is just the last token of each row."""

    TABLE = np.random.default_rng(7).normal(0, 2.5, (VOCAB, VOCAB)).astype(np.float32)

    def __init__(self, nan_after: int | None = None):
        self.vocab_size, self.context_length, self.eos_token_ids = VOCAB, 100, (EOS,)
        self.nan_after, self.steps = nan_after, 0

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        logits = torch.from_numpy(self.TABLE)[last.long()].clone()
        if self.nan_after is not None and self.steps >= self.nan_after:
            logits[0] = float("nan")  # the first row of the batch breaks, once
            self.nan_after = None
        return logits

    def prefill(self, prompts):
        last = torch.stack([p[-1] for p in prompts])
        return self._logits(last), last

    def decode(self, state, tokens):
        self.steps += 1
        return self._logits(tokens)

    def keep(self, state, rows):
        return state[rows]


def bigram_factory(model_path, device):
    return BigramLM()


class RecordingHandle:
    """A request handle that records chunks; `cancel_after` tokens flips its cancellation flag."""

    def __init__(self, cancel_after: int | None = None):
        self.chunks, self.finals, self.errors, self.cancelled_at = [], 0, [], None
        self.cancel_after, self.done = cancel_after, threading.Event()
        self.first = threading.Event()

    def is_cancelled(self):
        return self.cancel_after is not None and sum(len(c["output_ids"]) for c in self.chunks) >= self.cancel_after

    def send(self, chunk, final):
        self.chunks.append(chunk)
        self.first.set()
        if final:
            self.finals += 1
            self.done.set()

    def cancelled(self, tokens):
        self.cancelled_at = tokens
        self.done.set()

    def fail(self, message, code_name="INTERNAL"):
        self.errors.append((code_name, message))
        self.done.set()

    def output(self, name):
        """One output over every chunk received, in order."""
        return np.concatenate([c[name] for c in self.chunks])

    def ids(self):
        return self.output("output_ids")


class RecordingObserver:
    def __init__(self):
        self.tokens, self.peak_active, self.prompt_tokens, self.steps = 0, 0, 0, []
        self.queue_s: list[float] = []

    def generated(self, tokens):
        self.tokens += tokens

    def admitted(self, queue_seconds, prompt_tokens):
        self.queue_s.extend(queue_seconds.tolist())
        self.prompt_tokens += prompt_tokens

    def stepped(self, step):
        self.steps.append(step)

    def series(self, field):
        """One StepRecord field over every step, concatenated."""
        return np.concatenate([getattr(step, field) for step in self.steps])

    def occupancy(self, active, waiting, kv_tokens):
        self.peak_active = max(self.peak_active, active)


def request(prompt, max_new_tokens, stream=False, stop=(), ignore_eos=False, **params) -> GenerationRequest:
    row = RowParams.defaults(1)
    for name, value in params.items():
        setattr(row, name, np.array([value], dtype=getattr(row, name).dtype))
        if name == "seed":
            row.has_seed = np.ones(1, np.bool_)
    return GenerationRequest(
        np.array(prompt, np.int64), max_new_tokens, np.array(stop, np.int64), ignore_eos, stream, row
    )


def policy() -> MaskPolicy:
    return MaskPolicy(WIDTH, "test")


def engine(lm, start: bool = True, **limits) -> ContinuousEngine:
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    running = ContinuousEngine(lm, sampler, EngineLimits(**limits), RecordingObserver())
    return running.start() if start else running


def submit_and_finish(running, handles, reqs, timeout_s: float) -> None:
    """Submit each request with its handle, wait until every one is done, then stop the engine."""
    try:
        for handle, req in zip(handles, reqs):
            running.submit(req, handle)
        for handle in handles:
            assert handle.done.wait(timeout_s)
    finally:
        running.stop()


def generate(lm, reqs, timeout_s: float = 60) -> list[RecordingHandle]:
    """The requests run to their ends through an engine of their own, one handle each; queued
    before the loop starts, so they are admitted together in its first step."""
    return run_to_end(engine(lm, start=False), reqs, timeout_s)


def run_to_end(running, reqs, timeout_s: float, handles=None) -> list[RecordingHandle]:
    """Submit every request to a stopped engine, start it, wait for each to end, stop it
    (`handles`: one per request, by default a RecordingHandle each)."""
    handles = [RecordingHandle() for _ in reqs] if handles is None else list(handles)
    for handle, req in zip(handles, reqs):
        running.submit(req, handle)
    running.start()
    try:
        for handle in handles:
            assert handle.done.wait(timeout_s)
    finally:
        running.stop()
    return handles


def alone(lm, req) -> RecordingHandle:
    """The request run alone (non-streamed), through an engine of its own."""
    return generate(lm, [replace(req, stream=False)])[0]


TIMING_NAMES = ("queue_time_s", "time_to_first_token_s", "generation_time_s")
MASKED = dict(temperature=0.9, top_k=12, top_p=0.85, min_p=0.02, seed=5, return_sampling_mask=True)


def test_step_seeds_are_deterministic_and_distinct():
    seeds = torch.tensor([0, 1, -1, 2**62, 12345], dtype=torch.int64)
    per_step = torch.stack([rng.step_seeds(seeds, s) for s in range(50)])
    assert torch.equal(per_step, torch.stack([rng.step_seeds(seeds, s) for s in range(50)]))
    assert len(set(per_step.flatten().tolist())) == per_step.numel()


@pytest.mark.parametrize(
    "prompt, budget, stops, field",
    [
        ([], 4, [], "input_ids"),
        ([1, 64], 4, [], "input_ids"),
        ([-1], 4, [], "input_ids"),
        ([1], 4, [64], "stop_token_ids"),
        ([1], -1, [], "max_new_tokens"),
        ([1] * 90, 11, [], "max_new_tokens"),
    ],
)
def test_generation_request_checks_name_the_field(prompt, budget, stops, field):
    with pytest.raises(SamplingRequestError) as error:
        check_generation_request(np.array(prompt, np.int64), budget, np.array(stops, np.int64), VOCAB, 100)
    assert error.value.field == field and field in error.value.message
    check_generation_request(np.array([1] * 90, np.int64), 10, np.array([63]), VOCAB, 100)  # the limit itself is fine


def test_every_step_matches_the_reference_and_rows_align():
    lm = load_lm(lm_factory="tests.test_generation:bigram_factory")
    running = engine(lm)
    handle = RecordingHandle()
    submit_and_finish(running, [handle], [request([10], 30, ignore_eos=True, **MASKED)], 60)
    assert handle.finals == 1 and len(handle.chunks) == 1
    chunk = handle.chunks[0]
    ids = chunk["output_ids"]
    assert len(ids) == 30 and chunk["sampling_mask"].shape == (30, WIDTH) and chunk.finish_reason == "length"
    previous = np.concatenate([[10], ids[:-1]])
    for i, token in enumerate(ids):
        ref = reference_row(BigramLM.TABLE[previous[i]], 0.9, 12, 0.85, 0.02)
        np.testing.assert_array_equal(chunk["sampling_mask"][i, : chunk["sampling_mask_len"][i]], ref.support)
        assert (chunk["sampling_mask"][i, chunk["sampling_mask_len"][i] :] == -1).all()
        assert token in ref.support
        assert chunk["sampling_logprobs"][i] == pytest.approx(
            ref.renormalised_logprob(token, len(ref.support)), abs=1e-4
        )
    assert running.observer.tokens == 30


def test_step_records_time_each_request_and_the_kept_mass_of_masked_tokens():
    lm = BigramLM()
    budgets = [7, 3, 5]
    reqs = [
        request([10], budgets[0], ignore_eos=True, **MASKED),
        request([11, 12], budgets[1], ignore_eos=True, temperature=0.8, seed=3),  # no mask: no kept mass
        request([13], budgets[2], ignore_eos=True, stream=True, **MASKED),
    ]
    handles = [RecordingHandle() for _ in reqs]
    running = engine(lm, start=False)
    started = time.monotonic()
    for handle, req in zip(handles, reqs):
        running.submit(req, handle)
    running.start()
    try:
        for handle in handles:
            assert handle.done.wait(60)
        elapsed = time.monotonic() - started
    finally:
        running.stop()
    observer = running.observer
    # One observation per request (queue, TTFT, end to end), one per later step (one token each).
    assert len(observer.queue_s) == len(reqs) and observer.prompt_tokens == 4
    ttft, itl, e2e = observer.series("first_token_s"), observer.series("inter_token_s"), observer.series("e2e_s")
    assert len(ttft) == len(reqs) and len(e2e) == len(reqs) and len(itl) == sum(budgets) - len(reqs)
    assert ((ttft > 0) & (ttft <= elapsed)).all() and ((e2e > 0) & (e2e <= elapsed)).all() and (itl > 0).all()
    # A request's end-to-end time is its first token's time plus the gaps after it.
    assert e2e.sum() == pytest.approx(ttft.sum() + itl.sum(), rel=1e-6)
    assert max(observer.queue_s) <= ttft.min()
    assert sum(step.finished["length"] for step in observer.steps) == len(reqs)
    # Each request's last response carries its own timings: the same clock as the records.
    finals = [handle.chunks[-1] for handle in handles]
    timing = {name: np.array([chunk[name][0] for chunk in finals], np.float64) for name in TIMING_NAMES}
    np.testing.assert_allclose(np.sort(timing["queue_time_s"]), np.sort(observer.queue_s), rtol=1e-6)
    np.testing.assert_allclose(np.sort(timing["time_to_first_token_s"]), np.sort(ttft), rtol=1e-6)
    total = timing["queue_time_s"] + timing["generation_time_s"]
    np.testing.assert_allclose(np.sort(total), np.sort(e2e), rtol=1e-5)
    assert all(name not in chunk.outputs for name in TIMING_NAMES for chunk in handles[2].chunks[:-1])
    # each as its output declares it: one float32 of seconds (the wire sends the array's own dtype)
    assert all(
        chunk[name].dtype == np.float32 and chunk[name].shape == (1,) for chunk in finals for name in TIMING_NAMES
    )
    assert sum(step.finished["stop"] for step in observer.steps) == 0
    # log(kept mass) of every token of the masked requests, against the float64 reference.
    expected = []
    for req, handle in zip(reqs, handles):
        if not req.params.return_sampling_mask[0]:
            continue
        ids = handle.ids()
        for previous in np.concatenate([req.prompt[-1:], ids[:-1]]):
            ref = reference_row(BigramLM.TABLE[previous], 0.9, 12, 0.85, 0.02)
            expected.append(np.logaddexp.reduce(ref.logprobs[ref.support]))
    kept = observer.series("log_kept_mass")
    np.testing.assert_allclose(np.sort(kept), np.sort(expected), atol=1e-4)
    assert (kept <= 1e-6).all()


def test_stops_streaming_zero_budget_and_batching():
    lm = BigramLM()
    ids = generate(lm, [request([10], 12, ignore_eos=True, temperature=0.0)])[0].ids()
    j = next(i for i in range(1, 12) if ids[i] not in ids[:i])
    batch = [
        request([10], 12, stream=True, ignore_eos=True, stop=[ids[j]], temperature=0.0, return_sampling_mask=True),
        request([10], 0, **MASKED),
        request([20, 21], 9, ignore_eos=True, **MASKED),
        request([10], 12, ignore_eos=True, temperature=0.0),
    ]
    handles = generate(lm, batch)
    assert [h.finals for h in handles] == [1, 1, 1, 1] and not any(h.errors for h in handles)  # one final each
    streamed = handles[0]
    assert [len(c["output_ids"]) for c in streamed.chunks] == [1] * (j + 1)  # streamed token by token
    np.testing.assert_array_equal(streamed.ids(), ids[: j + 1])
    assert streamed.chunks[-1].finish_reason == "stop" and streamed.chunks[-1]["sampling_mask_len"][0] == 1
    assert all(c.finish_reason == "" for c in streamed.chunks[:-1])
    zero = handles[1].chunks[0]
    assert len(zero["output_ids"]) == 0 and zero["sampling_mask"].shape == (0, WIDTH) and zero.finish_reason == "length"
    np.testing.assert_array_equal(handles[3].ids(), ids)
    np.testing.assert_array_equal(handles[2].ids(), alone(lm, batch[2]).ids())  # batch-mates change nothing


def test_eos_stops_and_keeps_its_row_unless_ignored():
    table = BigramLM.TABLE.copy()
    first = int(np.argmax(table[30]))
    table[first, EOS] = table[first].max() + 10  # greedy from [30]: first, EOS, ...
    lm = BigramLM()
    lm.TABLE = table
    stopped, ignored = generate(
        lm,
        [
            request([30], 5, temperature=0.0, return_sampling_mask=True),
            request([30], 5, ignore_eos=True, temperature=0.0),
        ],
    )
    chunk = stopped.chunks[0]
    assert chunk["output_ids"].tolist() == [first, EOS] and chunk.finish_reason == "stop"
    assert chunk["sampling_mask"][1, : chunk["sampling_mask_len"][1]].tolist() == [EOS]
    assert ignored.ids()[:2].tolist() == [first, EOS] and len(ignored.ids()) == 5
    assert ignored.chunks[0].finish_reason == "length"


def test_stop_ids_hold_eos_unless_ignored():
    assert stop_ids(request([1], 4, stop=[9, 3, 9]), (3, 7)).tolist() == [3, 7, 9]
    assert stop_ids(request([1], 4, stop=[9], ignore_eos=True), (3, 7)).tolist() == [9]
    assert stop_ids(request([1], 4, ignore_eos=True), (3,)).size == 0


def test_sampler_rules_refuse_only_their_request_before_any_token():
    reqs = [request([1], 4, **MASKED), request([1], 4, top_k=WIDTH + 1, return_sampling_mask=True), request([1], 4)]
    errors = admission_errors(reqs, VOCAB, policy())
    assert errors[0] is None and errors[2] is None
    assert "top_k" in errors[1]
    assert admission_errors([], VOCAB, policy()) == []


@torch.inference_mode()
def test_padded_batch_with_cache_matches_full_forward():
    lm = load_lm()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9]), torch.tensor([40, 41, 42, 43, 44])]
    logits, state = lm.prefill(prompts)
    steps = [torch.tensor([100, 200, 300]), torch.tensor([101, 201, 301])]
    histories = [p.tolist() for p in prompts]
    for step, tokens in enumerate(steps):
        for history, row_logits in zip(histories, logits):
            expected = replica()(input_ids=torch.tensor([history])).logits[0, -1]
            torch.testing.assert_close(row_logits.double(), expected, atol=1e-4, rtol=1e-4)
        if step == 1:  # drop the middle row, as a finished request leaves the batch
            state = lm.keep(state, torch.tensor([0, 2]))
            tokens, histories = tokens[[0, 2]], [histories[0], histories[2]]
        for history, token in zip(histories, tokens):
            history.append(int(token))
        logits = lm.decode(state, tokens)
    for history, row_logits in zip(histories, logits):
        expected = replica()(input_ids=torch.tensor([history])).logits[0, -1]
        torch.testing.assert_close(row_logits.double(), expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_a_local_hugging_face_directory_loads_through_model_path(tmp_path):
    from triton_sampling_mask.generation.lm import build_default_model

    build_default_model().save_pretrained(tmp_path)
    lm = load_lm(model_path=str(tmp_path))
    assert (lm.vocab_size, lm.context_length, lm.eos_token_ids) == (1024, 512, (2,))
    logits, _ = lm.prefill([torch.tensor([5, 6, 7])])
    expected = replica()(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(logits[0].double(), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="model_path"):
        load_lm(model_path=str(tmp_path / "missing"))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.integers(1, WIDTH),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    first=st.integers(0, VOCAB - 1),
    budget=st.integers(1, 12),
)
def test_streaming_and_masks_never_change_the_tokens(seed, temperature, top_k, top_p, min_p, first, budget):
    params = dict(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    whole, streamed, unmasked = generate(
        BigramLM(),
        [
            request([first], budget, ignore_eos=True, return_sampling_mask=True, **params),
            request([first], budget, ignore_eos=True, stream=True, return_sampling_mask=True, **params),
            request([first], budget, ignore_eos=True, **params),
        ],
    )
    assert len(whole.chunks) == 1 and len(streamed.chunks) == budget
    np.testing.assert_array_equal(streamed.ids(), whole.ids())
    np.testing.assert_array_equal(streamed.output("sampling_mask"), whole.output("sampling_mask"))
    np.testing.assert_array_equal(unmasked.ids(), whole.ids())
    assert (unmasked.output("sampling_mask_len") == 0).all()


# Joins, cancellation, bounds, stop.


def test_a_seeded_request_joining_mid_flight_equals_running_alone():
    lm = load_lm()
    running = engine(lm)
    try:
        long = RecordingHandle()
        running.submit(request([5, 6, 7, 8, 9], 120, stream=True, ignore_eos=True, **MASKED), long)
        while len(long.chunks) < 5:
            time.sleep(0.001)
        joined = [RecordingHandle() for _ in range(2)]
        short = [
            request([40, 41], 12, ignore_eos=True, **MASKED),
            request([9], 10, stream=True, ignore_eos=True, **dict(MASKED, seed=9)),
        ]
        for handle, req in zip(joined, short):
            running.submit(req, handle)
        for handle in [long, *joined]:
            assert handle.done.wait(60)
    finally:
        running.stop()
    assert running.observer.peak_active == 3, "the newcomers should have joined the running batch"
    for handle, req in [(long, request([5, 6, 7, 8, 9], 120, ignore_eos=True, **MASKED)), *zip(joined, short)]:
        by_itself = alone(lm, req)
        assert handle.finals == 1 and not handle.errors
        np.testing.assert_array_equal(handle.ids(), by_itself.ids())
        np.testing.assert_array_equal(handle.output("sampling_mask"), by_itself.output("sampling_mask"))


def test_an_lm_without_merge_still_generates_through_the_engine():
    lm = BigramLM()
    running = engine(lm)
    handles = [RecordingHandle() for _ in range(3)]
    reqs = [request([10 + i], 8 + i, ignore_eos=True, **dict(MASKED, seed=i)) for i in range(3)]
    submit_and_finish(running, handles, reqs, 30)
    for handle, req in zip(handles, reqs):
        np.testing.assert_array_equal(handle.ids(), alone(BigramLM(), req).ids())


def test_cancellation_frees_the_slot_and_others_continue():
    running = engine(load_lm(), max_active_sequences=2)
    cancelled, other, waiting = RecordingHandle(cancel_after=3), RecordingHandle(), RecordingHandle()
    try:
        running.submit(request([5], 400, stream=True, ignore_eos=True), cancelled)
        running.submit(request([6], 60, ignore_eos=True), other)
        running.submit(request([7], 4, ignore_eos=True), waiting)  # needs the cancelled one's slot
        assert waiting.done.wait(60) and other.done.wait(60)
    finally:
        running.stop()
    assert cancelled.cancelled_at == 3 and cancelled.finals == 0 and len(cancelled.ids()) == 3
    assert len(other.ids()) == 60 and other.finals == 1
    assert waiting.finals == 1 and len(waiting.ids()) == 4


def test_bounds_refuse_with_engine_full_and_stop_ends_every_request():
    running = engine(load_lm(), max_active_sequences=1, max_waiting=1, kv_budget_tokens=600)
    first, second = RecordingHandle(), RecordingHandle()
    try:
        running.submit(request([5], 500, stream=True, ignore_eos=True), first)
        assert first.first.wait(30)
        running.submit(request([6], 500, ignore_eos=True), second)  # waits: one slot, budget 600
        with pytest.raises(EngineFull, match="max_waiting"):
            running.submit(request([7], 4), RecordingHandle())
        with pytest.raises(SamplingRequestError, match="kv_budget_tokens") as never:  # no retry would fit
            running.submit(request([7] * 10, 600), RecordingHandle())
        assert never.value.field == "max_new_tokens"
        zero = RecordingHandle()
        running.submit(request([7], 0), zero)  # nothing to generate: answered at once
        assert zero.finals == 1 and len(zero.ids()) == 0
    finally:
        running.stop()
    for handle in (first, second):
        assert handle.done.is_set() and handle.errors and handle.errors[0][0] == "UNAVAILABLE"
        assert handle.finals + len(handle.errors) == 1
    with pytest.raises(EngineFull, match="shutting down"):
        running.submit(request([5], 4), RecordingHandle())


def test_many_short_prompts_wait_within_the_token_budget_and_all_complete():
    # One slot and a budget of 64 waiting prompt tokens: 60 one-token prompts all wait, then run.
    running = engine(BigramLM(), max_active_sequences=1, max_waiting_tokens=64)
    reqs = [request([10 + i % 40], 3, ignore_eos=True, seed=i) for i in range(60)]
    handles = [RecordingHandle() for _ in reqs]
    submit_and_finish(running, handles, reqs, timeout_s=60)
    for handle, req in zip(handles, reqs):
        assert handle.finals == 1 and not handle.errors
        np.testing.assert_array_equal(handle.ids(), alone(BigramLM(), req).ids())


def test_huge_prompts_beyond_the_token_budget_are_refused_naming_it():
    running = engine(load_lm(), max_active_sequences=1, max_waiting_tokens=100)
    first, waiting = RecordingHandle(), RecordingHandle()
    try:
        running.submit(request([5], 400, stream=True, ignore_eos=True), first)
        assert first.first.wait(30)  # it holds the slot: what follows waits
        running.submit(request([6] * 60, 4, ignore_eos=True), waiting)  # 60 tokens wait
        with pytest.raises(EngineFull, match="max_waiting_tokens 100") as refused:
            running.submit(request([7] * 41, 4), RecordingHandle())  # 60 + 41 > 100
        assert "retry with backoff" in refused.value.message
        small = RecordingHandle()
        running.submit(request([7] * 40, 4, ignore_eos=True), small)  # 60 + 40 fits
    finally:
        running.stop()
    assert small.errors and small.errors[0][0] == "UNAVAILABLE" and "retry with backoff" in small.errors[0][1]


class FaultyBigramLM(BigramLM):
    """Its second decode raises, once: an internal fault in the middle of a step."""

    def decode(self, state, tokens):
        if self.steps == 1 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("boom")
        return super().decode(state, tokens)


class FlakyObserver(RecordingObserver):
    """Its first occupancy update raises: a metric that cannot be set."""

    def occupancy(self, active, waiting, kv_tokens):
        if not getattr(self, "failed", False):
            self.failed = True
            raise ValueError("gauge")
        super().occupancy(active, waiting, kv_tokens)


def test_a_failing_step_fails_its_whole_batch_logs_why_and_the_engine_serves_on():
    logged = []
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    running = ContinuousEngine(FaultyBigramLM(), sampler, EngineLimits(), FlakyObserver(), log_error=logged.append)
    batch = [RecordingHandle(), RecordingHandle()]
    for handle in batch:  # both admitted in the first step, together
        running.submit(request([10], 5, ignore_eos=True), handle)
    running.start()
    try:
        for handle in batch:
            assert handle.done.wait(60)
            assert handle.errors == [("INTERNAL", "internal generate error (RuntimeError); see the server log")]
        later = RecordingHandle()
        running.submit(request([10], 3, ignore_eos=True), later)
        assert later.done.wait(60) and later.finals == 1 and not later.errors
    finally:
        running.stop()
    step = [line for line in logged if line.startswith("generate engine step failed: RuntimeError: boom\n")]
    assert len(step) == 1 and "Traceback" in step[0] and 'raise RuntimeError("boom")' in step[0]
    assert "generate engine metrics not updated: ValueError: gauge" in logged


@pytest.mark.parametrize("slots, kv_budget", [(3, 20), (2, 1000)], ids=["kv-budget", "slots"])
def test_admission_fills_the_kv_budget_or_the_slots_exactly(slots, kv_budget):
    # Three requests of 10 positions each wait before the first step: either bound admits two.
    observer = RecordingObserver()
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    limits = EngineLimits(max_active_sequences=slots, kv_budget_tokens=kv_budget)
    running = ContinuousEngine(BigramLM(), sampler, limits, observer)
    handles = [RecordingHandle() for _ in range(3)]
    for i, handle in enumerate(handles):
        running.submit(request([10 + i, 11], 8, ignore_eos=True), handle)
    running.start()
    try:
        for handle in handles:
            assert handle.done.wait(60) and handle.finals == 1 and not handle.errors
    finally:
        running.stop()
    assert observer.peak_active == 2


def test_a_request_cancelled_before_its_first_step_is_cancelled_at_zero_tokens():
    handle = RecordingHandle(cancel_after=0)
    running = engine(BigramLM(), start=False)
    running.submit(request([10], 5, ignore_eos=True), handle)
    running.start()
    try:
        assert handle.done.wait(60)
    finally:
        running.stop()
    assert handle.cancelled_at == 0 and not handle.chunks and not handle.errors


def test_stopping_mid_request_reports_an_empty_engine_last():
    class LastOccupancy(RecordingObserver):
        def occupancy(self, active, waiting, kv_tokens):
            super().occupancy(active, waiting, kv_tokens)
            self.last = (active, waiting, kv_tokens)

    class SlowBigramLM(BigramLM):  # still decoding when stop comes
        def decode(self, state, tokens):
            time.sleep(0.01)
            return super().decode(state, tokens)

    observer = LastOccupancy()
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    running = ContinuousEngine(SlowBigramLM(), sampler, EngineLimits(), observer).start()
    handle = RecordingHandle()
    running.submit(request([10], 90, stream=True, ignore_eos=True), handle)
    assert handle.first.wait(60)
    running.stop()
    assert handle.errors and observer.last == (0, 0, 0)


def test_waiting_prompt_tokens_add_up_and_a_request_of_the_whole_kv_budget_fits():
    running = engine(BigramLM(), start=False, max_waiting_tokens=10, kv_budget_tokens=10)  # all stay waiting
    for _ in range(2):
        running.submit(request([5] * 4, 6), RecordingHandle())  # 4 + 6 positions: the whole KV budget
    with pytest.raises(EngineFull, match="8 prompt tokens already wait and this prompt has 4"):
        running.submit(request([5] * 4, 2), RecordingHandle())


def test_a_prompt_larger_than_the_token_budget_is_taken_at_the_head_of_an_empty_queue():
    # Never refused for good: alone in the queue, a prompt above max_waiting_tokens still runs.
    running = engine(BigramLM(), max_waiting_tokens=4)
    handle = RecordingHandle()
    submit_and_finish(running, [handle], [request(list(range(10, 30)), 3, ignore_eos=True)], timeout_s=60)
    assert handle.finals == 1 and len(handle.ids()) == 3


def test_the_engine_fails_only_the_row_whose_logits_broke():
    # Both requests start together (BigramLM cannot merge); at its second decode the LM returns
    # NaN logits for the first row: that request fails naming the step, the other one finishes
    # with the tokens it gets alone.
    reqs = [request([10], 6, ignore_eos=True, **MASKED), request([11], 6, ignore_eos=True, **dict(MASKED, seed=6))]
    handles = generate(BigramLM(nan_after=2), reqs)
    assert handles[0].errors and "unusable logits at step 2" in handles[0].errors[0][1] and handles[0].finals == 0
    assert not handles[1].errors and handles[1].finals == 1
    np.testing.assert_array_equal(handles[1].ids(), alone(BigramLM(), reqs[1]).ids())
