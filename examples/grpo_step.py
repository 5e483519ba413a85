"""One GRPO step with exact-support score centring, against a running server (`make serve`):

1. rollout: prompts x samples through the `generate` model, each sample seeded, masks on, with
   the sampler's per-support log-probs (`sampling_mask_logprobs`, the behaviour q over S);
2. the masks reach the trainer in prime-rl's flat form, log-probs beside the ids;
3. the trainer recomputes logits with its copy of the policy (the served default LM) and scores
   them over the supports (`score_support`);
4. diagnostics: exact-support ratios (1 up to rounding), the kept mass the truncation left (the
   trainer's and the server's `output_logprobs - sampling_logprobs`) and the full-vocabulary ratio
   a trainer ignoring the masks would use, KL(q || p_S) over the supports;
5. receipts: the server's (`return_receipts=True`: each token's seed and step), every token
   re-derived from the trainer's logits with them; logits perturbed on purpose are flagged;
6. the loss: PPO-clipped policy gradient with the exact-support centred score plus a KL(q || p_S)
   penalty, backpropagated into the policy.

    python examples/grpo_step.py [--url localhost:8001] [--protocol grpc] [--model generate]
                                 [--lm-dtype float32|float64]

As in examples/rl_rollout.py, the trainer's copy runs in the served model's `lm_dtype`; the
server's batched, KV-cached forward and the trainer's full forward round differently (float32:
~1e-5 on this tiny model's large logits), which the tolerances below allow for.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from triton_sampling_mask.client import GenerateClient, concatenate_tokens
from triton_sampling_mask.client.converters import to_prime_rl
from triton_sampling_mask.client.corrections import (
    centered_policy_loss,
    ratio_diagnostics,
    server_kept_log_mass,
    support_divergences,
)
from triton_sampling_mask.client.receipts import SamplingReceipts, rederive_tokens
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.client.support import FlatSupport, score_support
from triton_sampling_mask.generation.lm import build_default_model

PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [9]]
SAMPLES = 4  # completions per prompt (a GRPO group)
MAX_NEW_TOKENS = 12
KL_COEFFICIENT = 0.01
CLIP = 0.2
TOLERANCE = {"float32": 1e-4, "float64": 1e-5}  # on log-ratios, kept mass and KL


def rollout(url: str, protocol: str, model: str):
    """Every prompt SAMPLES times, each sample seeded: (requests, params, results)."""
    requests = [prompt for prompt in PROMPTS for _ in range(SAMPLES)]
    params = [
        SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=7000 + i, return_sampling_mask=True)
        for i in range(len(requests))
    ]
    with GenerateClient(url, protocol=protocol, model_name=model) as client:
        results = client.generate(requests, params, MAX_NEW_TOKENS, ignore_eos=True, return_receipts=True)
    return requests, params, results


def policy_logits(policy, prompt: list[int], output_ids: np.ndarray) -> torch.Tensor:
    """[n, V]: the policy's logits for each generated token (one full forward pass, with grad)."""
    tokens = torch.tensor([list(prompt) + output_ids[:-1].tolist()])
    return policy(input_ids=tokens).logits[0, len(prompt) - 1 :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    parser.add_argument("--model", default="generate", help="the generate model's name on the server")
    parser.add_argument("--lm-dtype", default="float32", choices=sorted(TOLERANCE), help="the served LM's dtype")
    args = parser.parse_args(argv)
    tolerance = TOLERANCE[args.lm_dtype]

    # 1. Rollout.
    requests, params, results = rollout(args.url, args.protocol, args.model)
    tokens = concatenate_tokens(results)
    lengths = [len(r.output_ids) for r in results]

    # 2. The trainer's format: flat ids, counts and the behaviour's log-probs beside the ids.
    batch = to_prime_rl(tokens.sampling_mask, tokens.sampling_mask_len, tokens.sampling_mask_logprobs)
    support = FlatSupport.from_flat(batch["ids"], batch["counts"], batch["logprobs"])

    # 3. Score the trainer's logits over the supports, at the rollout's temperatures.
    policy = build_default_model().to(getattr(torch, args.lm_dtype)).train()
    logits = torch.cat([policy_logits(policy, p, r.output_ids) for p, r in zip(requests, results)])
    temperatures = np.repeat([p.temperature for p in params], lengths)
    scores = score_support(logits, support, temperatures)

    # 4. Diagnostics: the exact-support ratio is 1; the full-vocabulary one is off by the kept mass.
    diagnostics = ratio_diagnostics(logits, scores, tokens.output_ids, tokens.sampling_logprobs)
    stats = diagnostics.statistics()
    worst_ratio = float(diagnostics.support_log_ratio.abs().max())
    assert worst_ratio < tolerance, f"exact-support log-ratios off by {worst_ratio}"
    served_kept = server_kept_log_mass(tokens.output_logprobs, tokens.sampling_logprobs)
    kept_gap = float(np.abs(diagnostics.kept_log_mass.numpy() - served_kept).max())
    assert kept_gap < tolerance, f"the trainer's kept mass differs from the server's by {kept_gap}"
    assert stats["truncation_bias"] > 10 * tolerance, "top_p 0.9 should leave mass out of the supports"
    divergences = support_divergences(scores)
    worst_kl = float(divergences.kl_behaviour_trainer.detach().abs().max())
    assert worst_kl < tolerance, f"KL(q || p_S) is {worst_kl} with the same weights"

    # 5. Receipts: the trainer's logits re-draw every token; perturbed ones do not.
    receipts = tokens.receipts  # the server's; for seeded requests, what the requests alone give
    assert (receipts.seed == SamplingReceipts.for_generation(params, lengths).seed).all()
    rederived = rederive_tokens(logits.detach(), receipts, tokens.output_ids)
    assert not rederived.flagged.any(), f"train-inference mismatch: {rederived.summary()}"
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype)
    perturbed = rederive_tokens(logits.detach() + noise, receipts, tokens.output_ids)
    assert perturbed.flagged.any(), "perturbed logits should draw other tokens"

    # 6. GRPO: a toy reward per completion (its share of ids below 512), advantages within each group.
    rewards = torch.tensor([float((r.output_ids < 512).mean()) for r in results]).view(len(PROMPTS), SAMPLES)
    advantages = np.repeat((rewards - rewards.mean(dim=1, keepdim=True)).flatten().numpy(), lengths)
    policy_loss = centered_policy_loss(
        scores, tokens.output_ids, advantages, tokens.sampling_logprobs, "clipped", CLIP, CLIP
    )
    loss = policy_loss.mean() + KL_COEFFICIENT * divergences.kl_behaviour_trainer.mean()
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]).norm()
    assert torch.isfinite(gradient) and gradient > 0
    print(
        f"{len(results)} completions, {len(tokens.output_ids)} tokens, {int(batch['counts'].sum())} mask ids; "
        f"exact-support ratio mean {stats['support_ratio_mean']:.6f} (max |log| {worst_ratio:.1e}), "
        f"full-vocabulary ratio mean {stats['full_vocab_ratio_mean']:.4f}, kept mass mean "
        f"{stats['kept_mass_mean']:.4f} (server's within {kept_gap:.1e}), max KL(q||p_S) {worst_kl:.1e}; "
        f"receipts: {rederived.summary()}, perturbed logits flagged {int(perturbed.flagged.sum())}; "
        f"policy gradient norm {float(gradient):.3g}"
    )


if __name__ == "__main__":
    main()
