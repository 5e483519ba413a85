"""A benchmark LM whose outputs repeat: the default tiny Llama with its attention outputs zeroed.

Each next-token distribution then depends on the current token only, so greedy decoding soon
cycles (a map on a finite vocabulary) and prompt lookup drafts well, while every forward pass
costs what the default LM's does (same shapes, same operations). The default LM's random weights
rarely repeat themselves, so this one stands for the repetitive outputs (loops, copied spans) that
real models produce at low temperature. Served through the `lm` config parameter (this file is
copied beside the model's model.py): `looping_lm:factory`.
"""

from __future__ import annotations

import torch

from triton_sampling_mask.generation.lm import HFCausalLM, build_default_model


def factory(model_path: str, device: torch.device) -> HFCausalLM:
    """The `lm` factory: the default tiny Llama, attention outputs zeroed (`model_path` unused)."""
    model = build_default_model()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return HFCausalLM(model, device)
