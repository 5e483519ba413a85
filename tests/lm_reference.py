"""Float64 replays of the default LM, for tests only: full forward passes, no KV cache, no padding.

The weights come from the same config and seed as the server's; the logits of every step are
recomputed from scratch in float64, so they share nothing with the server's cached float32 path.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from triton_sampling_mask.generation.lm import build_default_model


@functools.lru_cache(maxsize=1)
def replica():
    """The default tiny Llama in float64."""
    return build_default_model().double().eval()


@torch.inference_mode()
def step_logits(prompt, output_ids, model=None) -> np.ndarray:
    """float64 [n, V]: the logits each output token was sampled from (prompt + earlier outputs),
    by `model` (a float64 causal LM; default the default LM's replica)."""
    model = model if model is not None else replica()
    tokens = np.concatenate([np.asarray(prompt), np.asarray(output_ids)]).astype(np.int64)
    n = len(output_ids)
    if n == 0:
        return np.zeros((0, model.config.vocab_size))
    logits = model(input_ids=torch.from_numpy(tokens[None, :-1])).logits[0]
    return logits[len(prompt) - 1 :].numpy()


@torch.inference_mode()
def greedy_continuations(prompts: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuations of equal-length prompts [B, L]: tokens [B, steps] and the smallest
    top-1 / top-2 logit gap met on the way [B] (how safely argmax is decided)."""
    tokens = torch.from_numpy(np.asarray(prompts, np.int64))
    gaps = torch.full((tokens.shape[0],), float("inf"), dtype=torch.float64)
    out = []
    for _ in range(steps):
        logits = replica()(input_ids=tokens).logits[:, -1]
        top2 = logits.topk(2, dim=-1).values
        gaps = torch.minimum(gaps, top2[:, 0] - top2[:, 1])
        nxt = logits.argmax(dim=-1, keepdim=True)
        out.append(nxt)
        tokens = torch.cat([tokens, nxt], dim=1)
    return torch.cat(out, dim=1).numpy(), gaps.numpy()
