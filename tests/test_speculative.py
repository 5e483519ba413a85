"""Speculative decoding in-process: prompt-lookup drafts, the LM's multi-token pass and rollback,
and the engine's exactness: with drafting on, every request gets the tokens, masks and
log-probs it gets without.

The drafter is checked against a plain-Python lookup, the LM's cache against float64 full
forward passes, and the engine against itself with drafting off: on the bigram LM (whose logits
do not depend on how they are computed) bit for bit, on the default tiny Llama in float64 (so a
one-token and a multi-token pass round alike) token for token and mask for mask.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.generation.drafting import PAD, NgramDrafter, TokenHistory
from triton_sampling_mask.generation.engine import ContinuousEngine, EngineLimits
from triton_sampling_mask.generation.lm import can_speculate, load_lm
from triton_sampling_mask.generation.request import step_params
from triton_sampling_mask.sampling import rng
from triton_sampling_mask.sampling.backends import load_backend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams

from .lm_reference import replica
from .test_generation import EOS, MASKED, BigramLM, RecordingHandle, policy, request, run_to_end

COMPARED_EXACTLY = ("output_ids", "sampling_mask", "sampling_mask_len")
COMPARED_CLOSELY = ("output_logprobs", "sampling_logprobs", "sampling_mask_logprobs")


class SpeculativeBigramLM(BigramLM):
    """The bigram LM with the multi-token pass: each position's logits are its token's table row."""

    def decode_many(self, state, tokens, lengths):
        self.steps += 1
        fed = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
        return self._logits(tokens[fed])

    def rollback(self, state, counts):
        return state  # no cache: the logits depend on the fed token only


class PoisonedBigramLM(BigramLM):
    """Feeding POISON yields NaN logits: plain decoding fails at the step after it is emitted."""

    POISON = 17

    def _logits(self, last):
        logits = super()._logits(last)
        logits[last == self.POISON] = float("nan")
        return logits


class SpeculativePoisonedBigramLM(PoisonedBigramLM, SpeculativeBigramLM):
    pass


class SpeculationObserver:
    """Counts tokens and the engine's speculation (drafting rows, drafted and accepted tokens)."""

    def __init__(self):
        self.tokens, self.drafts, self.drafted, self.accepted = 0, 0, 0, 0
        self.kept_masses = []

    def generated(self, tokens):
        self.tokens += tokens

    def admitted(self, queue_seconds, prompt_tokens):
        pass

    def stepped(self, step):
        self.kept_masses.append(step.log_kept_mass)

    def occupancy(self, active, waiting, kv_tokens):
        pass

    def speculated(self, drafts, drafted, accepted):
        self.drafts += drafts
        self.drafted += drafted
        self.accepted += accepted


def run(lm, reqs, drafter=None, timeout_s: float = 120, observer=None, **limits):
    """The requests through an engine of their own (all admitted in its first step when it can
    merge); their handles and the engine's observer (a SpeculationObserver unless given)."""
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    observer = observer or SpeculationObserver()
    engine = ContinuousEngine(lm, sampler, EngineLimits(**limits), observer, drafter=drafter)
    return run_to_end(engine, reqs, timeout_s), observer


def assert_same_generation(spec, plain, logprob_atol: float = 0.0) -> None:
    """The same chunks' worth of outputs, finish reason, errors and cancellation point."""
    assert spec.errors == plain.errors and spec.finals == plain.finals
    assert spec.cancelled_at == plain.cancelled_at
    if not plain.chunks:
        assert not spec.chunks
        return
    assert [c.finish_reason for c in spec.chunks][-1:] == [c.finish_reason for c in plain.chunks][-1:]
    for name in COMPARED_EXACTLY:
        np.testing.assert_array_equal(spec.output(name), plain.output(name), err_msg=name)
    for name in COMPARED_CLOSELY:
        np.testing.assert_allclose(spec.output(name), plain.output(name), rtol=0, atol=logprob_atol, err_msg=name)


# The drafter.


def naive_draft(sequence: list[int], drafter: NgramDrafter, limit: int) -> list[int]:
    """Prompt lookup spelled out: the latest earlier occurrence of the longest suffix n-gram, and
    the tokens after it, copied one by one (so a close occurrence repeats itself)."""
    for n in range(drafter.max_n, drafter.min_n - 1, -1):
        suffix = sequence[len(sequence) - n :]
        for start in range(len(sequence) - n - 1, -1, -1):
            if len(sequence) > n and sequence[start : start + n] == suffix:
                extended = list(sequence)
                for j in range(min(limit, drafter.num_tokens)):
                    extended.append(extended[start + n + j])
                return extended[len(sequence) :]
    return []


@settings(max_examples=60, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=6),
    limits=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    shape=st.sampled_from([(4, 3, 2), (4, 3, 1), (2, 2, 2), (6, 4, 1), (1, 1, 1)]),
)
def test_ngram_drafts_match_a_plain_lookup(sequences, limits, shape):
    drafter = NgramDrafter(*shape)
    history = TokenHistory()
    history.join([np.array(s, np.int64) for s in sequences], [len(s) + 3 for s in sequences])
    with np.errstate(all="raise"):  # no division by a zero period, no overflow
        drafts = drafter.propose(history.tokens, history.lengths, np.array(limits[: len(sequences)]))
    assert drafts.shape == (len(sequences), drafter.num_tokens) and drafts.dtype == np.int64  # token ids
    for row, sequence, limit in zip(drafts, sequences, limits):
        expected = naive_draft(sequence, drafter, limit)
        assert row[: len(expected)].tolist() == expected and (row[len(expected) :] == PAD).all(), sequence


@pytest.mark.parametrize(
    "sequence, drafted",
    [
        ([1, 2, 3, 1, 2], [3, 1, 2, 3]),  # the 2-gram that starts the sequence
        ([1, 2, 3, 4, 2, 3], [4, 2, 3, 4]),  # a 2-gram; the close repeat continues with its period
        ([5, 1, 2, 3, 9, 1, 2, 3], [9, 1, 2, 3]),  # a 3-gram match, its continuation
        ([1, 2, 1, 3, 1], []),  # no 2-gram recurs
    ],
)
def test_ngram_drafts_of_known_sequences(sequence, drafted):
    history = TokenHistory()
    history.join([np.array(sequence)], [len(sequence) + 4])
    drafts = NgramDrafter(num_tokens=4, max_n=3, min_n=2).propose(history.tokens, history.lengths, np.array([4]))
    assert drafts[0, : len(drafted)].tolist() == drafted and (drafts[0, len(drafted) :] == PAD).all()


def test_token_history_grows_and_drops_rows():
    history = TokenHistory()
    history.join([np.array([1, 2]), np.array([3])], [4, 2])
    history.append(np.array([[7, 8, 9], [5, 6, 6]]), np.array([2, 1]))
    history.join([np.array([4, 4, 4, 4, 4])], [6])
    assert history.lengths.tolist() == [4, 2, 5] and history.tokens.dtype == history.lengths.dtype == np.int64
    assert history.tokens[:, :5].tolist() == [[1, 2, 7, 8, PAD], [3, 5, PAD, PAD, PAD], [4, 4, 4, 4, 4]]
    history.keep(np.array([True, False, True]))
    assert history.lengths.tolist() == [4, 5] and history.tokens[1, :5].tolist() == [4] * 5


@pytest.mark.parametrize(
    "values", [dict(num_tokens=0), dict(min_n=0), dict(max_n=2, min_n=3), dict(disable_at_rows=-1)]
)
def test_drafter_parameters_are_checked(values):
    with pytest.raises(
        ValueError,
        match=r"num_speculative_tokens must be >= 1|1 <= prompt_lookup_min <= prompt_lookup_max$|speculative_disable_by",
    ):
        NgramDrafter(**values)


def test_step_params_seed_each_seeded_row_at_its_own_step():
    seeds = torch.tensor([0, 1, -1, 2**62, 12345, -(2**63)] * 3)
    steps = torch.tensor([0, 1, 2, 3, 511, 10**6, 2**40, 7, 7, 7, 0, 1, 5, 5, 5, 99, 98, 97])
    expected = torch.stack([rng.step_seeds(seeds[i : i + 1], int(steps[i]))[0] for i in range(len(seeds))])
    params = replace(RowParams.defaults(len(seeds)), seed=seeds.numpy().view(np.uint64).copy())
    params.has_seed[::2] = True
    stepped = step_params(params, steps.numpy())
    np.testing.assert_array_equal(stepped.seed.view(np.int64)[::2], expected.numpy()[::2])
    np.testing.assert_array_equal(stepped.seed[1::2], params.seed[1::2])  # unseeded rows untouched


# The LM: several tokens per row in one pass, and the rollback.


@pytest.mark.parametrize("dtype, atol", [("float64", 1e-5), ("", 1e-4)])
@torch.inference_mode()
def test_multi_token_pass_and_rollback_match_full_forward_passes(dtype, atol):
    lm = load_lm(dtype=dtype)
    assert can_speculate(lm)
    generator = np.random.default_rng(0)
    histories = [[5, 6, 7], [9], [40, 41, 42, 43, 44]]

    def check(logits, rows):
        for row_logits, history in zip(logits, rows):
            expected = replica()(input_ids=torch.tensor([history])).logits[0, -1]
            torch.testing.assert_close(row_logits.double(), expected, atol=atol, rtol=0)

    logits, state = lm.prefill([torch.tensor(h) for h in histories])
    check(logits, histories)
    for step in range(10):
        lengths = generator.integers(1, 5, len(histories))
        tokens = generator.integers(3, 1000, (len(histories), int(lengths.max())))
        logits = lm.decode_many(state, torch.from_numpy(tokens), torch.from_numpy(lengths))
        assert logits.shape == (lengths.sum(), lm.vocab_size)
        fed = []
        for history, row, length in zip(histories, tokens, lengths):
            for token in row[:length]:
                history.append(int(token))
                fed.append(list(history))
        check(logits, fed)
        dropped = np.array([generator.integers(0, n) for n in lengths])
        state = lm.rollback(state, torch.from_numpy(dropped))
        for history, count in zip(histories, dropped):
            del history[len(history) - count :]
        if step == 4:  # a row leaves, as a finished request does
            state = lm.keep(state, torch.tensor([0, 2]))
            histories = [histories[0], histories[2]]
        if step == 6:  # a longer prompt joins
            joined, other = lm.prefill([torch.arange(100, 130)])
            state = lm.merge([state, other])
            histories.append(list(range(100, 130)))
        last = generator.integers(3, 1000, len(histories))
        logits = lm.decode(state, torch.from_numpy(last))
        for history, token in zip(histories, last):
            history.append(int(token))
        check(logits, histories)
        # No gap is left inside the cache: each row's positions are packed at its right end.
        mask = state.attention_mask
        assert mask.shape[1] == max(len(h) for h in histories)
        assert mask.sum(1).tolist() == [len(h) for h in histories]
        assert (mask.flip(1).cumprod(1).sum(1) == mask.sum(1)).all()


def test_lm_dtype_is_checked():
    with pytest.raises(ValueError, match="lm_dtype"):
        load_lm(dtype="float8")
    with pytest.raises(ValueError, match="lm_dtype"):
        load_lm(lm_factory="tests.test_generation:bigram_factory", dtype="float64")


def test_an_lm_without_the_multi_token_pass_decodes_plainly():
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    engine = ContinuousEngine(BigramLM(), sampler, EngineLimits(), SpeculationObserver(), drafter=NgramDrafter())
    assert not can_speculate(BigramLM()) and engine.drafter is None


# The engine: drafting never changes a request's outputs.

LOOPING = [10, 11, 12, 10, 11, 12, 10, 11]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.0, 0.2, 0.7, 1.3]),
    top_k=st.integers(1, 16),
    top_p=st.floats(0.3, 1.0),
    min_p=st.floats(0.0, 0.3),
    prompt=st.sampled_from([LOOPING, [30], [5, 6, 5, 6, 5]]),
    budget=st.integers(1, 40),
    stop=st.sampled_from([(), (EOS,), (11, 40)]),
    num_tokens=st.integers(1, 6),
)
def test_drafting_changes_no_output_on_the_bigram_lm(
    seed, temperature, top_k, top_p, min_p, prompt, budget, stop, num_tokens
):
    params = dict(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    reqs = [
        request(prompt, budget, stop=stop, ignore_eos=True, return_sampling_mask=True, **params),
        request(prompt, budget, stop=stop, stream=True, return_sampling_mask=True, **params),
        request(prompt[::-1], budget, stop=stop, **params),
    ]
    drafter = NgramDrafter(num_tokens=num_tokens, max_n=3, min_n=1)
    for req in reqs:  # the bigram LM cannot merge: one request per engine
        (plain,), _ = run(BigramLM(), [req])
        (spec,), _ = run(SpeculativeBigramLM(), [req], drafter)
        assert_same_generation(spec, plain)
        if req.stream:  # one response per token, the last one final
            assert all(len(c["output_ids"]) == 1 for c in spec.chunks)
            assert [c.finish_reason == "" for c in spec.chunks] == [True] * (len(spec.chunks) - 1) + [False]


def test_greedy_loops_are_drafted_and_accepted():
    req = request([30], 60, ignore_eos=True, temperature=0.0, return_sampling_mask=True)
    (plain,), _ = run(BigramLM(), [req])
    (spec,), observer = run(SpeculativeBigramLM(), [req], NgramDrafter())
    assert_same_generation(spec, plain)
    assert observer.tokens == 60 and observer.accepted > 30 and observer.drafted >= observer.accepted > 0
    # One kept mass per emitted token, none for rejected drafts; greedy keeps the top token alone,
    # so log(kept mass) is the token's own log-prob.
    kept = np.concatenate(observer.kept_masses)
    assert kept.size == observer.tokens == 60
    np.testing.assert_allclose(np.sort(kept), np.sort(spec.output("output_logprobs").astype(np.float64)), atol=1e-6)


def test_a_batch_at_the_disable_size_drafts_nothing_and_a_smaller_one_drafts():
    reqs = [request([30 + i], 40, ignore_eos=True, temperature=0.0, return_sampling_mask=True) for i in range(3)]
    plain, _ = run(BigramLM(), reqs)
    for disable_at_rows, drafting in ((3, False), (4, True)):
        spec, observer = run(SpeculativeBigramLM(), reqs, NgramDrafter(disable_at_rows=disable_at_rows))
        for s, p in zip(spec, plain):
            assert_same_generation(s, p)
        assert (observer.drafts > 0) == drafting, disable_at_rows


def test_a_stop_token_inside_an_accepted_draft_ends_generation_there():
    (plain,), _ = run(BigramLM(), [request([30], 60, ignore_eos=True, temperature=0.0)])
    ids = plain.ids()
    # The greedy chain loops; a token that recurs in the loop ends it the second time round only
    # if it is a stop id when it first comes back inside a draft.
    loop_token = next(int(t) for i, t in enumerate(ids) if t in ids[:i])
    first = int(np.flatnonzero(ids == loop_token)[0])
    req = request([30], 60, stop=[loop_token], ignore_eos=True, temperature=0.0, return_sampling_mask=True)
    (plain,), _ = run(BigramLM(), [req])
    (spec,), observer = run(SpeculativeBigramLM(), [req], NgramDrafter(min_n=1))
    assert_same_generation(spec, plain)
    assert len(spec.ids()) == first + 1 and spec.chunks[-1].finish_reason == "stop"
    # The tokens sampled after the stop inside the draft were never emitted: no kept mass for them.
    assert np.concatenate(observer.kept_masses).size == first + 1


def test_broken_logits_fail_at_the_step_plain_decoding_fails():
    # Greedy: 30 -> 20 -> 21 -> POISON, whose logits are NaN. The prompt holds 20, 21, POISON, so
    # after 20 the draft is 21, POISON, ...: both accepted, then the position after POISON breaks.
    poison = PoisonedBigramLM.POISON
    table = BigramLM.TABLE.copy()
    for token, following in ((30, 20), (20, 21), (21, poison)):
        table[token, following] = 50.0
    req = request([20, 21, poison, 8, 30], 20, stream=True, ignore_eos=True, temperature=0.0)
    results = []
    for lm, drafter in ((PoisonedBigramLM(), None), (SpeculativePoisonedBigramLM(), NgramDrafter(min_n=1))):
        lm.TABLE = table
        (handle,), observer = run(lm, [req], drafter)
        results.append(handle)
    plain, spec = results
    assert plain.ids().tolist() == [20, 21, poison] and "unusable logits at step 3" in plain.errors[0][1]
    assert_same_generation(spec, plain)
    assert observer.accepted == 2, "the poisoned position should sit inside an accepted draft"


def test_cancellation_mid_block_keeps_a_prefix():
    req = request([30], 200, stream=True, ignore_eos=True, temperature=0.0)
    (whole,), _ = run(BigramLM(), [replace(req, stream=False)])
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    engine = ContinuousEngine(
        SpeculativeBigramLM(), sampler, EngineLimits(), SpeculationObserver(), drafter=NgramDrafter()
    )
    cancelled = RecordingHandle(cancel_after=5)
    engine.start()
    try:
        engine.submit(req, cancelled)
        assert cancelled.done.wait(60)
    finally:
        engine.stop()
    assert cancelled.finals == 0 and cancelled.cancelled_at == len(cancelled.ids()) >= 5
    np.testing.assert_array_equal(cancelled.ids(), whole.ids()[: len(cancelled.ids())])


REPETITIVE = [[5, 6, 7, 8] * 6, [100, 200] * 8, [9, 9, 9, 9, 9, 9], [40, 41, 42, 43, 44, 40, 41, 42]]


def test_drafting_changes_no_output_on_the_tiny_llama_in_float64():
    lm = load_lm(dtype="float64")
    reqs = []
    for i, prompt in enumerate(REPETITIVE + [[11, 12, 13], [700]]):
        reqs += [
            request(prompt, 40, ignore_eos=True, temperature=0.0, return_sampling_mask=True),
            request(prompt, 33, stream=True, **dict(MASKED, seed=i, temperature=0.3)),
            request(prompt, 25, stop=[prompt[-1]], **dict(MASKED, seed=100 + i)),
            request(prompt, 30, ignore_eos=True, temperature=0.6, top_k=5, seed=200 + i),
        ]
    plain, _ = run(lm, reqs)
    spec, observer = run(load_lm(dtype="float64"), reqs, NgramDrafter())
    for s, p in zip(spec, plain):
        assert_same_generation(s, p, logprob_atol=1e-5)
    assert observer.accepted > 0 and observer.drafted > observer.accepted, vars(observer)


def test_requests_joining_a_speculating_batch_equal_them_alone():
    lm = load_lm(dtype="float64")
    sampler = BatchSampler(load_backend("torch"), policy(), torch.device("cpu"))
    engine = ContinuousEngine(lm, sampler, EngineLimits(), SpeculationObserver(), drafter=NgramDrafter())
    long = request([5, 6, 7, 8] * 3, 150, stream=True, ignore_eos=True, temperature=0.0, return_sampling_mask=True)
    late = [request(p, 20, ignore_eos=True, **dict(MASKED, seed=i)) for i, p in enumerate(REPETITIVE)]
    handles = [RecordingHandle() for _ in range(1 + len(late))]
    engine.start()
    try:
        engine.submit(long, handles[0])
        assert handles[0].first.wait(60)
        for handle, req in zip(handles[1:], late):
            engine.submit(req, handle)
        for handle in handles:
            assert handle.done.wait(120)
    finally:
        engine.stop()
    alone, _ = run(load_lm(dtype="float64"), [replace(long, stream=False), *late])
    for joined, by_itself in zip(handles, alone):
        assert_same_generation(joined, by_itself, logprob_atol=1e-5)


def test_the_config_builds_the_drafter_and_the_load_line_says_how_it_decodes():
    from triton_sampling_mask.serving.generate_model import build_drafter, speculation_summary

    def config(**parameters):
        return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}

    assert build_drafter(config(), "generate/config.pbtxt") is None
    assert build_drafter(config(speculative_algorithm="eagle"), "generate/config.pbtxt") is None
    drafter = build_drafter(
        config(
            speculative_algorithm=" NGram ", num_speculative_tokens="6", prompt_lookup_max="4", prompt_lookup_min="1"
        ),
        "generate/config.pbtxt",
    )
    assert drafter == NgramDrafter(num_tokens=6, max_n=4, min_n=1)
    assert build_drafter(config(speculative_algorithm="ngram"), "generate/config.pbtxt") == NgramDrafter()
    assert build_drafter(
        config(speculative_algorithm="ngram", speculative_disable_by_batch_size="16"), "generate/config.pbtxt"
    ) == NgramDrafter(disable_at_rows=16)
    with pytest.raises(ValueError, match=r"prompt_lookup_min.*\(config parameters in generate/config.pbtxt\)"):
        build_drafter(config(speculative_algorithm="ngram", prompt_lookup_min="5"), "generate/config.pbtxt")
    assert "ngram (up to 4 drafted tokens" in speculation_summary("ngram", NgramDrafter(), load_lm())
    assert "falls back to plain decoding" in speculation_summary("ngram", NgramDrafter(), BigramLM())
    assert "'eagle' is not drafted here" in speculation_summary("eagle", None, load_lm())
    assert speculation_summary("none", None, load_lm()).endswith("none")
