"""Sampling receipts returned by the real server: both models send each token's `sampling_seed` on
request, the typed clients turn it into receipts, and the receipts re-derive every served token
from the server's own logits (the sampler's: the request's; generate's: the tiny LM's, recomputed
by the trainer) and flag tokens once those logits are perturbed. Seeded and unseeded rows (whose
seed only the server knows), masks on and off, both protocols, streamed and not."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.reference import reference_draw, reference_noise_seed
from triton_sampling_mask.client import GenerateClient, SamplerClient, concatenate_tokens
from triton_sampling_mask.client.receipts import SAMPLER_CALL, SamplingReceipts, rederive_tokens
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.generation.lm import build_default_model

ROWS, VOCAB = 48, 3000
SETTINGS = [
    dict(temperature=0.8, top_k=40, top_p=0.9, return_sampling_mask=True),
    dict(temperature=1.1, top_k=100, min_p=0.02),
    dict(temperature=0.0, top_k=5, return_sampling_mask=True),
    dict(temperature=0.6),  # the whole vocabulary, no mask
]
PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [9], [300, 2, 17]]
MAX_NEW_TOKENS = 10


def url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def sampler_params(seeded) -> list[SamplingParams]:
    """One SamplingParams per row, SETTINGS in turn; row i seeded (high bits set) where seeded(i)."""
    return [
        SamplingParams(**SETTINGS[i % len(SETTINGS)], seed=2**63 + 7919 * i if seeded(i) else None) for i in range(ROWS)
    ]


def assert_flags_are_real(found, logits: np.ndarray, receipts: SamplingReceipts, served: np.ndarray) -> None:
    """Every flagged token really differs: the float64 brute force with the receipt's noise does
    not draw the served token from the perturbed logits."""
    for t in np.flatnonzero(found.flagged):
        p = receipts.params
        draw = reference_draw(
            logits[t], p.temperature[t], p.top_k[t], p.top_p[t], p.min_p[t], int(receipts.noise_seed[t])
        )
        assert draw in (None, int(found.token_ids[t])) and draw != served[t], t


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("seeding", ["every row", "some rows", "no row"])
def test_sampler_receipts_rederive_every_token_and_flag_perturbed_logits(triton_server, protocol, seeding):
    """With no seed the server draws one per row and returns it; with some, the client fills the
    others (the server takes a seed for all rows or none): every row's receipt is what its noise used."""
    seeded = {"every row": lambda i: True, "some rows": lambda i: i % 3 == 0, "no row": lambda i: False}[seeding]
    params = sampler_params(seeded)
    logits = (np.random.default_rng(31).standard_normal((ROWS, VOCAB)) * 3).astype(np.float32)
    with SamplerClient(url(triton_server, protocol), protocol=protocol) as client:
        result = client.sample(logits, params, return_receipts=True)
        assert client.sample(logits[:2], params[:2]).receipts is None  # only on request
    receipts = result.receipts
    assert (receipts.step == SAMPLER_CALL).all() and receipts.seed.dtype == np.uint64
    sent = [i for i, p in enumerate(params) if p.seed is not None]
    assert receipts.seed[sent].tolist() == [params[i].seed for i in sent]  # all 64 bits, on both protocols
    if seeding == "no row":
        assert len(set(receipts.seed.tolist())) == ROWS  # the server's own draws

    exact = rederive_tokens(torch.from_numpy(logits), receipts, result.output_ids)
    assert exact.summary() == {"tokens": ROWS, "rederived": ROWS, "near_ties": 0, "flagged": 0}
    # The same check by the float64 brute force, from the receipt alone.
    for t in range(0, ROWS, 5):
        p = params[t]
        noise_seed = reference_noise_seed(int(receipts.seed[t]), None)
        assert reference_draw(logits[t], p.temperature, p.top_k, p.top_p, p.min_p, noise_seed) in (
            None,
            int(result.output_ids[t]),
        )

    perturbed = logits + np.random.default_rng(32).standard_normal(logits.shape).astype(np.float32)
    found = rederive_tokens(torch.from_numpy(perturbed), receipts, result.output_ids)
    assert found.flagged.sum() >= ROWS // 10, found.summary()
    assert_flags_are_real(found, perturbed, receipts, result.output_ids)


@functools.lru_cache(maxsize=1)
def trainer_policy():
    """The trainer's copy of the served default LM (same config and seed), float32 as served."""
    return build_default_model().eval()


@torch.inference_mode()
def trainer_logits(prompt, output_ids) -> torch.Tensor:
    """[n, V]: the logits each generated token was sampled from, by one full forward pass."""
    tokens = torch.tensor([list(prompt) + output_ids[:-1].tolist()])
    return trainer_policy()(input_ids=tokens).logits[0, len(prompt) - 1 :]


def generation_params() -> list[SamplingParams]:
    """Different seeds (one request unseeded: its seed is the server's), masks on and off."""
    return [
        SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=2**64 - 1 - i, return_sampling_mask=i % 2 == 0)
        if i < len(PROMPTS) - 1
        else SamplingParams(temperature=0.7, top_k=50)
        for i in range(len(PROMPTS))
    ]


def generate(server, protocol: str, streamed: bool, params, **kwargs) -> list:
    """One result per prompt; a streamed call's chunks joined per request (their receipts too)."""
    with GenerateClient(url(server, protocol), protocol=protocol) as client:
        if not streamed:
            return client.generate(PROMPTS, params, MAX_NEW_TOKENS, ignore_eos=True, **kwargs)
        chunks = {i: [] for i in range(len(PROMPTS))}
        with client.stream(PROMPTS, params, MAX_NEW_TOKENS, ignore_eos=True, **kwargs) as stream:
            for chunk in stream:
                chunks[chunk.index].append(chunk)
    return [concatenate_tokens(chunks[i]) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_receipts_rederive_every_token_from_the_trainers_logits(triton_server, protocol, streamed):
    params = generation_params()
    results = generate(triton_server, protocol, streamed, params, return_receipts=True)
    for i, result in enumerate(results):
        receipts = result.receipts
        assert receipts.step.tolist() == list(range(MAX_NEW_TOKENS))  # token i drawn at step i
        assert len(set(receipts.seed.tolist())) == 1  # the request's one seed
        if params[i].seed is not None:
            assert int(receipts.seed[0]) == params[i].seed
    unseeded = int(results[-1].receipts.seed[0])
    assert unseeded not in {p.seed for p in params}  # the seed the server drew, returned

    tokens = concatenate_tokens(results)
    logits = torch.cat([trainer_logits(p, r.output_ids) for p, r in zip(PROMPTS, results)])
    found = rederive_tokens(logits, tokens.receipts, tokens.output_ids)
    # The server's cached forward and the trainer's full one round differently (~1e-5): a token
    # may differ only inside the documented near-tie band, never by a flag.
    summary = found.summary()
    assert summary["flagged"] == 0 and summary["rederived"] + summary["near_ties"] == summary["tokens"], summary
    assert summary["rederived"] >= summary["tokens"] - 1, summary

    perturbed = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    flagged = rederive_tokens(perturbed, tokens.receipts, tokens.output_ids)
    assert flagged.flagged.sum() >= summary["tokens"] // 10, flagged.summary()
    assert_flags_are_real(flagged, perturbed.double().numpy(), tokens.receipts, tokens.output_ids)


def test_receipts_travel_on_request_only(triton_server):
    """`return_receipts` names the `sampling_seed` output when `outputs` is given; without it the
    result carries neither the seeds nor receipts."""
    params = SamplingParams(temperature=0.9, top_k=20, seed=5)
    with GenerateClient(triton_server.grpc_url) as client:
        plain = client.generate(PROMPTS[:1], params, 4, outputs=["output_ids"])[0]
        asked = client.generate(PROMPTS[:1], params, 4, outputs=["output_ids"], return_receipts=True)[0]
    assert plain.sampling_seed is None and plain.receipts is None
    assert asked.sampling_mask is None and asked.output_ids.tolist() == plain.output_ids.tolist()
    assert asked.receipts.seed.tolist() == [5] * 4 and asked.receipts.step.tolist() == [0, 1, 2, 3]
