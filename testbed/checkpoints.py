"""Checkpoints the tests and benchmarks serve: Hugging Face causal LMs initialised at random."""

from __future__ import annotations

import torch


def random_model(config, seed: int):
    """A causal LM built from a transformers `config`, its weights drawn with torch seed `seed`
    (the global generator is left as it was)."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config)
