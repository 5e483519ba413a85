"""Checkpoints for the weight-update tests: the default tiny Llama moved to new weights, saved as
a trainer would save it, and float64 replays of either weights."""

from __future__ import annotations

import functools

import numpy as np
import torch

from triton_sampling_mask.generation.lm import build_default_model


def moved_model(seed: int, scale: float = 0.1):
    """The default tiny Llama with every weight moved by seeded noise (a 'training step')."""
    model = build_default_model()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return model


@functools.lru_cache(maxsize=4)
def replay_model(seed: int | None):
    """float64 copy of the default LM (seed None) or of `moved_model(seed)`."""
    model = build_default_model() if seed is None else moved_model(seed)
    return model.double().eval()


@torch.inference_mode()
def replay_logits(model, prompt, output_ids, upto: int) -> np.ndarray:
    """float64 logits the token `upto` of `output_ids` was sampled from (full forward, no cache)."""
    tokens = np.concatenate([np.asarray(prompt), np.asarray(output_ids[:upto])]).astype(np.int64)
    return model(input_ids=torch.from_numpy(tokens[None])).logits[0, -1].numpy()
