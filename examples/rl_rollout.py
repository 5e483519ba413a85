"""One step of an RL loop end to end, against a running server (`make serve`):

1. rollout: a GRPO-style batch (prompts x samples, each sample seeded) goes to the `generate`
   model through GenerateClient, masks on;
2. the masks go to the trainer in its own format (prime-rl's flat ids and counts here) and back;
3. the trainer recomputes logits with its copy of the policy (the served default LM, built here
   the same way: plugin/generation/lm.py's config and seed) and replays every sampled token's
   log-prob over the sampler's mask with `replay_logprobs`;
4. the importance ratios train/rollout are 1 up to rounding (same weights, same truncated
   support), while a replay over the whole vocabulary is off by far more; the GRPO loss
   backpropagates into the policy.

    python examples/rl_rollout.py [--url localhost:8001] [--protocol grpc] [--model generate]
                                  [--lm-dtype float32|float64]

`--lm-dtype` is the served model's `lm_dtype` (the shipped config keeps the LM's float32): the
trainer's copy runs in it too. In float64 on both sides the ratios are 1 within 1e-5; in float32
within 1e-4, because the server's batched, KV-cached forward and the trainer's full forward round
differently.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from triton_sampling_mask.client import GenerateClient, concatenate_tokens
from triton_sampling_mask.client.converters import from_prime_rl, to_prime_rl
from triton_sampling_mask.client.replay import replay_logprobs
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.generation.lm import build_default_model

PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [9], [100, 200, 300, 400, 500]]
SAMPLES = 4  # completions per prompt (a GRPO group)
MAX_NEW_TOKENS = 16
# The server's forward (KV cache, rows batched with other requests' padding) and the trainer's
# full forward round differently in float32: ~1e-5 on this tiny model's large logits; in float64
# only the sampler's float32 logits remain (~1e-6). A token renormalised over another support is
# off by 1e-3 or more.
RATIO_TOLERANCE = {"float32": 1e-4, "float64": 1e-5}


def rollout(url: str, protocol: str, model: str):
    """Every prompt SAMPLES times, each sample with a seed of its own: (requests, params, results)."""
    requests = [prompt for prompt in PROMPTS for _ in range(SAMPLES)]
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=1000 + i, return_sampling_mask=True)
        for i in range(len(requests))
    ]
    with GenerateClient(url, protocol=protocol, model_name=model) as client:
        results = client.generate(requests, params, MAX_NEW_TOKENS, ignore_eos=True)
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
    parser.add_argument("--lm-dtype", default="float32", choices=sorted(RATIO_TOLERANCE), help="the served LM's dtype")
    args = parser.parse_args(argv)
    tolerance = RATIO_TOLERANCE[args.lm_dtype]

    # 1. Rollout.
    requests, params, results = rollout(args.url, args.protocol, args.model)
    tokens = concatenate_tokens(results)  # every generated token of the batch, request after request
    lengths = [len(r.output_ids) for r in results]

    # 2. To the trainer's format and back (what a trainer process would receive).
    batch = to_prime_rl(tokens.sampling_mask, tokens.sampling_mask_len)
    masks = from_prime_rl(batch["ids"], batch["counts"], width=tokens.sampling_mask.shape[1])

    # 3. Replay: the same weights, scored over the same masks at the rollout's temperatures.
    policy = build_default_model().to(getattr(torch, args.lm_dtype)).train()
    logits = torch.cat([policy_logits(policy, p, r.output_ids) for p, r in zip(requests, results)])
    temperatures = np.repeat([p.temperature for p in params], lengths)
    logprobs = replay_logprobs(logits, masks.mask, masks.lengths, temperatures, tokens.output_ids)

    # 4. Importance ratios: 1 over the masks; the whole vocabulary's softmax is not the behaviour.
    behaviour = torch.from_numpy(tokens.sampling_logprobs)
    ratios = torch.exp(logprobs - behaviour)
    worst = float((ratios.detach() - 1).abs().max())
    assert worst < tolerance, f"importance ratios off by {worst}"
    scaled = logits.detach() / torch.from_numpy(temperatures).to(logits.dtype).unsqueeze(1)
    unmasked = torch.log_softmax(scaled, dim=1).gather(1, torch.from_numpy(tokens.output_ids).long().unsqueeze(1))
    unmasked_worst = float((torch.exp(unmasked.squeeze(1) - behaviour) - 1).abs().max())
    assert unmasked_worst > 10 * tolerance, "the masks should matter for these parameters"

    # A GRPO step: a toy reward per completion (its share of ids below 512), advantages within each group.
    rewards = torch.tensor([float((r.output_ids < 512).mean()) for r in results]).view(len(PROMPTS), SAMPLES)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()
    loss = -(ratios * torch.from_numpy(np.repeat(advantages.numpy(), lengths)).to(ratios.dtype)).mean()
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]).norm()
    print(
        f"{len(results)} completions, {len(tokens.output_ids)} tokens, {int(batch['counts'].sum())} mask ids; "
        f"max |ratio - 1| over the masks {worst:.1e}, over the whole vocabulary {unmasked_worst:.1e}; "
        f"policy gradient norm {float(gradient):.3g}"
    )


if __name__ == "__main__":
    main()
