"""Speculative decoding on an LM that drafts by design (tests/copying_lm.py): most steps draft,
most drafts are accepted, rejected drafts are rolled out of a cache the logits depend on.

Each test asserts how much was drafted and accepted, so a change that stops drafting fails it
instead of passing trivially. The tokens are checked against plain decoding bit for bit, against
greedy decoding of the LM itself, and each step's draw against the documented schedule: step s
of a request is the Gumbel-max over that step's reference support with the noise of
`rng.step_seeds(seed, s)`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.generation.drafting import NgramDrafter
from triton_sampling_mask.generation.engine import ContinuousEngine, EngineLimits
from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler

from .copying_lm import CopyingLM, greedy_continuation
from .reference import reference_row
from .test_generation import WIDTH, RecordingHandle, request
from .test_speculative import SpeculationObserver, assert_same_generation, policy
from .test_speculative import run as run_engine

CYCLE = [20, 21, 22, 23, 24, 25, 26]  # distinct tokens: the LM continues the cycle greedily
DRAFTED = 4  # tokens drafted per step (NgramDrafter's default)


class StepObserver(SpeculationObserver):
    """SpeculationObserver that also keeps each step's (rows drafting, drafted, accepted)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def speculated(self, drafts, drafted, accepted):
        super().speculated(drafts, drafted, accepted)
        self.steps.append((drafts, drafted, accepted))


def run(lm, reqs, drafter=None):
    """The requests through one engine (all admitted in its first step), counting every step."""
    return run_engine(lm, reqs, drafter, observer=StepObserver())


def test_greedy_decoding_of_the_lm_repeats_its_context():
    assert greedy_continuation(CopyingLM(), CYCLE * 2, 20) == (CYCLE * 4)[:20]


def mixed_requests() -> list:
    """Requests of every kind, prompts that repeat (so they draft) and some that do not at first."""
    prompts = [CYCLE * 2, [5, 6, 7, 8] * 3, [40, 41, 42, 40, 41, 42, 40], [9, 30, 31, 9, 30, 31], [50, 51, 52, 50, 51]]
    reqs = []
    for i, prompt in enumerate(prompts):
        reqs += [
            request(prompt, 40, ignore_eos=True, temperature=0.0, return_sampling_mask=True),
            request(
                prompt, 37, stream=True, ignore_eos=True, seed=i, temperature=0.7, top_k=8, return_sampling_mask=True
            ),
            request(prompt, 30, ignore_eos=True, seed=100 + i, temperature=1.0, top_p=0.9, min_p=0.01),
            request(prompt, 33, ignore_eos=True, seed=200 + i, temperature=1.5, top_k=WIDTH, return_sampling_mask=True),
        ]
    return reqs


def test_drafts_are_proposed_accepted_rolled_back_and_change_nothing():
    reqs = mixed_requests()
    plain, _ = run(CopyingLM(copy_bonus=5.0), reqs)
    lm = CopyingLM(copy_bonus=5.0)
    spec, observer = run(lm, reqs, NgramDrafter(num_tokens=DRAFTED))
    for s, p in zip(spec, plain):
        assert_same_generation(s, p)
    generated = sum(r.max_new_tokens for r in reqs)
    assert observer.tokens == generated
    # Most steps draft for most rows, most drafts stand, and the rest left the cache.
    steps_with_rows = len(observer.steps)
    assert sum(1 for drafts, _, _ in observer.steps if drafts) >= 0.8 * steps_with_rows, observer.steps
    assert observer.drafted >= 0.5 * generated, vars(observer)
    assert observer.accepted >= 0.6 * observer.drafted, vars(observer)
    assert lm.rolled_back > 0 and observer.drafted - observer.accepted > 0, "no draft was rejected and rolled back"


@pytest.mark.parametrize("budget", [6, 7, 9])
def test_drafts_stay_within_the_request_budget(budget):
    # Plain decoding computes logits after at most prompt + budget - 1 tokens; drafting near the end
    # of the budget must not feed tokens past it (the KV positions a request reserves).
    prompt = CYCLE * 2
    req = request(prompt, budget, ignore_eos=True, temperature=0.0)
    lm = CopyingLM()
    (spec,), observer = run(lm, [req], NgramDrafter(num_tokens=DRAFTED))
    assert spec.ids().tolist() == (CYCLE * 3)[:budget]
    # Each step drafts what the budget leaves after its sure token, up to DRAFTED, and all stand.
    expected, emitted = [], 1
    while emitted < budget:
        room = min(DRAFTED, budget - emitted - 1)
        if room:
            expected.append((1, room, room))
        emitted += room + 1
    assert observer.steps == expected
    assert lm.longest_context == len(prompt) + budget - 1


def reference_draw(logits: np.ndarray, req, step_seed: np.ndarray) -> tuple[int, np.ndarray]:
    """The documented draw: the Gumbel-max over the float64 reference support, with the noise of
    (step seed, token id); the token and the support."""
    params = req.params
    temperature = float(params.temperature[0]) or 1.0
    ref = reference_row(
        logits,
        float(params.temperature[0]),
        int(params.top_k[0]),
        float(params.top_p[0]),
        float(params.min_p[0]),
        tolerance=1e-9,
    )
    support = ref.support
    scaled = (logits[support].astype(np.float64) - logits[support[0]]) / temperature
    noise = rng.gumbel_numpy(rng.seed_state_numpy(step_seed)[:, None], support[None, :].astype(np.int64))[0]
    return int(support[np.argmax(scaled + noise)]), support


def test_each_step_draws_with_its_own_step_seed():
    # A copy bonus the noise can beat: many steps' tokens depend on their seed, most still draft.
    lm = CopyingLM(copy_bonus=5.0)
    seed = 0x5EED_1234_ABCD
    req = request(CYCLE * 2, 48, ignore_eos=True, seed=seed, temperature=0.8, top_k=12, return_sampling_mask=True)
    (spec,), observer = run(lm, [req], NgramDrafter(num_tokens=DRAFTED))
    assert not spec.errors
    ids, masks, lengths = spec.ids(), spec.output("sampling_mask"), spec.output("sampling_mask_len")
    context = list(req.prompt)
    seed_decides = 0
    for step, token in enumerate(ids.tolist()):
        logits = lm.logits_after(context)
        step_seed = rng.step_seeds_numpy(np.array([seed], np.uint64), np.array([step]))
        expected, support = reference_draw(logits, req, step_seed)
        assert token == expected, f"step {step}: drew {token}, its step seed draws {expected}"
        assert lengths[step] == support.size and masks[step, : support.size].tolist() == support.tolist()
        next_seed = rng.step_seeds_numpy(np.array([seed], np.uint64), np.array([step + 1]))
        seed_decides += reference_draw(logits, req, next_seed)[0] != expected
        context.append(token)
    assert seed_decides >= 5, "the steps' tokens barely depend on their seeds: this checks no schedule"
    assert observer.drafted >= len(ids) // 2 and observer.accepted >= len(ids) // 4, vars(observer)


@pytest.mark.parametrize("position", range(DRAFTED + 1))
@pytest.mark.parametrize("kind", ["stop_id", "eos"])
def test_a_stop_at_each_position_of_an_accepted_block_ends_there(kind, position):
    # Greedy from CYCLE * 2: step 0 emits CYCLE[0] (nothing to draft from yet), step 1 drafts
    # CYCLE[1:5], all accepted, and emits them with CYCLE[5]: a stop at `position` of that block.
    stop = CYCLE[1 + position]
    lm_options = dict(eos=(stop,)) if kind == "eos" else {}
    req = request(CYCLE * 2, 30, stop=[stop] if kind == "stop_id" else (), temperature=0.0, return_sampling_mask=True)
    (plain,), _ = run(CopyingLM(**lm_options), [req])
    (spec,), observer = run(CopyingLM(**lm_options), [req], NgramDrafter(num_tokens=DRAFTED))
    assert plain.ids().tolist() == CYCLE[: 2 + position] and plain.chunks[-1].finish_reason == "stop"
    assert_same_generation(spec, plain)
    # The stopping step drafted a whole block and its drafts stood up to the stop.
    assert observer.steps and observer.steps[-1][1] == DRAFTED, observer.steps
    assert observer.steps[-1][2] == min(position + 1, DRAFTED), observer.steps


@pytest.mark.parametrize("position", [1, 2, 3])
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_unusable_logits_at_a_drafted_position_fail_as_plain_decoding_does(kind, position):
    # Step 1 feeds CYCLE[0] and drafts CYCLE[1:5]; its position `position` (the logits after the
    # drafted CYCLE[position]) is broken, yet greedy still draws the next draft there.
    prompt = CYCLE * 2
    poison = {len(prompt) + 1 + position: kind}
    req = request(prompt, 30, stream=True, ignore_eos=True, temperature=0.0, return_sampling_mask=True)
    (plain,), _ = run(CopyingLM(poison=poison), [req])
    lm = CopyingLM(poison=poison)
    (spec,), observer = run(lm, [req], NgramDrafter(num_tokens=DRAFTED))
    assert plain.ids().tolist() == CYCLE[: 1 + position]
    assert f"unusable logits at step {1 + position}" in plain.errors[0][1]
    assert greedy_continuation(lm, prompt + CYCLE[: 1 + position], 1) == [CYCLE[1 + position]]  # the draft
    assert_same_generation(spec, plain)
    assert observer.steps == [(1, DRAFTED, position)], observer.steps


class TracedHandle(RecordingHandle):
    """A handle whose request is traced: the engine hands it the request's steps on its final chunk."""

    traces_steps = True


def run_traced(reqs, traced: list[bool]) -> tuple[list[RecordingHandle], StepObserver]:
    """The requests through one drafting engine, those where `traced` is true with TracedHandles."""
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    observer = StepObserver()
    drafter = NgramDrafter(num_tokens=DRAFTED)
    engine = ContinuousEngine(CopyingLM(copy_bonus=5.0), sampler, EngineLimits(), observer, drafter=drafter)
    handles = [TracedHandle() if on else RecordingHandle() for on in traced]
    for handle, req in zip(handles, reqs):
        engine.submit(req, handle)
    engine.start()
    try:
        assert all(handle.done.wait(120) for handle in handles)
    finally:
        engine.stop()
    return handles, observer


def test_a_traced_request_gets_every_step_it_took_with_its_drafts():
    reqs = mixed_requests()
    handles, observer = run_traced(reqs, [True] * len(reqs))
    for handle, req in zip(handles, reqs):
        steps = handle.chunks[-1].steps
        assert all(c.steps is None for c in handle.chunks[:-1])  # only the final chunk carries them
        assert sum(s.emitted for s in steps) == req.max_new_tokens == len(handle.ids())
        # every step but the last emits its accepted drafts and one sampled token
        assert all(s.emitted == 1 + s.accepted and s.accepted <= s.drafted for s in steps[:-1])
        assert all(s.start_ns <= s.end_ns for s in steps)
        assert all(a.end_ns <= b.start_ns for a, b in zip(steps, steps[1:])), "steps overlap"
        assert steps[0].batch_rows == len(reqs)  # every request joined the first step
        assert [s.batch_rows for s in steps] == sorted((s.batch_rows for s in steps), reverse=True)
    # Summed over every request, the steps' drafts are the engine's own counts of those steps.
    every = [s for handle in handles for s in handle.chunks[-1].steps]
    assert sum(s.drafted for s in every) == observer.drafted > 0
    assert sum(s.accepted for s in every) == observer.accepted > 0
    # the last request to finish took part in every step the engine ran (all joined its first)
    assert max(len(handle.chunks[-1].steps) for handle in handles) == len(observer.kept_masses)


def test_only_traced_requests_get_their_steps():
    reqs = mixed_requests()[:4]
    handles, _ = run_traced(reqs, [True, False, False, True])
    assert [h.chunks[-1].steps is not None for h in handles] == [True, False, False, True]
