"""Three steps of an RL loop whose rollout weights follow the trainer, against a running server:

each step pushes the trainer's current weights into the served LM in place (the first and third
step through a checkpoint on disk, the second through a gloo process group between the trainer's
rank 0 and each server instance), rolls out a GRPO batch (examples/rl_rollout.py's), checks that
every token carries the pushed weight version and that the importance ratios train/rollout are 1
over the sampler's masks, then takes an optimizer step.

    TRITON_ADMIN_KEY=... python examples/rl_loop.py --weights-root DIR [--url localhost:8001]
        [--model generate] [--lm-dtype float64]

`--weights-root` is the directory the generate model's `weights_root` parameter names (the
trainer writes its checkpoints there, on the server's host); the admin key is the launcher's
(TRITON_ADMIN_KEY, or the file it wrote). Run against a float64 LM (`lm_dtype` float64) the
ratios are 1 within 1e-5; in float32 within 1e-4 (examples/rl_rollout.py says why).
"""

from __future__ import annotations

import argparse
import os
import runpy
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from triton_sampling_mask.client import GenerateClient, concatenate_tokens
from triton_sampling_mask.client.replay import replay_logprobs
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.generation.lm import build_default_model
from triton_sampling_mask.generation.weight_transfer import broadcast_tensors, manifest_of, open_process_group

ROLLOUT = runpy.run_path(str(Path(__file__).with_name("rl_rollout.py")))  # its helpers, not its main
STEPS = 3
LEARNING_RATE = 1e-3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WeightPusher:
    """Pushes the trainer's weights to every replica: from disk, or over a gloo process group."""

    def __init__(self, client: GenerateClient, weights_root: Path):
        self.client, self.weights_root, self.group = client, weights_root, None
        self.pool = ThreadPoolExecutor(max_workers=1)  # the client's call waits while the trainer sends

    def from_disk(self, policy, version: str) -> None:
        policy.save_pretrained(self.weights_root / version)  # safetensors
        self.client.update_weights_from_disk(version, weight_version=version)

    def from_process_group(self, policy, version: str) -> None:
        tensors = {name: t.detach().contiguous() for name, t in policy.state_dict().items()}
        if self.group is None:
            port, world = free_port(), 1 + len(self.client.urls)
            joined = self.pool.submit(self.client.init_weights_update_group, "127.0.0.1", port, 1, world)
            self.group = open_process_group("127.0.0.1", port, 0, world, "weight_update_group")
            joined.result()
        manifest = manifest_of(tensors)
        received = self.pool.submit(
            self.client.update_weights_from_distributed,
            [m["name"] for m in manifest],
            [m["dtype"] for m in manifest],
            [m["shape"] for m in manifest],
            weight_version=version,
        )
        broadcast_tensors(self.group, list(tensors.values()))
        received.result()

    def close(self) -> None:
        if self.group is not None:
            self.client.destroy_weights_update_group()
        self.pool.shutdown()


def rollout_and_replay(client: GenerateClient, policy, version: str, tolerance: float) -> torch.Tensor:
    """A GRPO batch on the served weights; the trainer's log-probs over its masks give ratios of
    1 (checked); returns the GRPO loss to backpropagate."""
    requests = [prompt for prompt in ROLLOUT["PROMPTS"] for _ in range(ROLLOUT["SAMPLES"])]
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=1000 + i, return_sampling_mask=True)
        for i in range(len(requests))
    ]
    results = client.generate(requests, params, ROLLOUT["MAX_NEW_TOKENS"], ignore_eos=True)
    served = {v for r in results for v in r.weight_version}
    assert served == {version}, f"tokens sampled by {served}, not by the pushed {version!r}"
    tokens = concatenate_tokens(results)
    lengths = [len(r.output_ids) for r in results]
    logits = torch.cat([ROLLOUT["policy_logits"](policy, p, r.output_ids) for p, r in zip(requests, results)])
    temperatures = np.repeat([p.temperature for p in params], lengths)
    logprobs = replay_logprobs(logits, tokens.sampling_mask, tokens.sampling_mask_len, temperatures, tokens.output_ids)
    ratios = torch.exp(logprobs - torch.from_numpy(tokens.sampling_logprobs))
    worst = float((ratios.detach() - 1).abs().max())
    assert worst < tolerance, f"importance ratios off by {worst} on weights {version!r}"
    print(f"weights {version}: {len(tokens.output_ids)} tokens, max |ratio - 1| {worst:.1e}")
    groups = len(ROLLOUT["PROMPTS"]), ROLLOUT["SAMPLES"]
    rewards = torch.tensor([float((r.output_ids < 512).mean()) for r in results]).view(groups)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).flatten()
    return -(ratios * torch.from_numpy(np.repeat(advantages.numpy(), lengths)).to(ratios.dtype)).mean()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001")
    parser.add_argument("--model", default="generate", help="the generate model's name on the server")
    parser.add_argument("--weights-root", type=Path, required=True, help="the server's weights_root directory")
    parser.add_argument("--lm-dtype", default="float64", choices=sorted(ROLLOUT["RATIO_TOLERANCE"]))
    args = parser.parse_args(argv)
    tolerance = ROLLOUT["RATIO_TOLERANCE"][args.lm_dtype]

    policy = build_default_model().to(getattr(torch, args.lm_dtype)).train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=LEARNING_RATE)
    admin_key = os.environ.get("TRITON_ADMIN_KEY")
    with GenerateClient(args.url, model_name=args.model, admin_key=admin_key) as client:
        pusher = WeightPusher(client, args.weights_root)
        try:
            for step in range(1, STEPS + 1):
                version = f"rl-step-{step}"
                # 1. The rollout engine takes the trainer's weights (disk on odd steps, gloo on even).
                (pusher.from_process_group if step % 2 == 0 else pusher.from_disk)(policy, version)
                # 2. Rollout on them, 3. the ratios are 1, 4. a GRPO step moves the policy.
                loss = rollout_and_replay(client, policy, version, tolerance)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        finally:
            pusher.close()


if __name__ == "__main__":
    main()
