"""What a deployment's config.pbtxt says about its sampler, read the same way by both models."""

from __future__ import annotations

from ..model_config import config_path, output_width, string_parameter
from ..sampling.outputs import SAMPLING_MASK, SAMPLING_MASK_LOGPROBS
from ..sampling.validation import MaskPolicy


def declared_outputs(model_config: dict, mask_width: int, config_file: str) -> set[str]:
    """The outputs config.pbtxt declares. Optional ones (per-support log-probs) may be left out of
    an older config; a declared one must have the mask's width W (one source of truth)."""
    names = {output["name"] for output in model_config.get("output", [])}
    if SAMPLING_MASK_LOGPROBS.name in names and output_width(model_config, SAMPLING_MASK_LOGPROBS.name) != mask_width:
        raise ValueError(
            f"output '{SAMPLING_MASK_LOGPROBS.name}' in {config_file} must have the width of "
            f"'{SAMPLING_MASK.name}' (W={mask_width})"
        )
    return names


def mask_policy(args: dict, model_config: dict, backend) -> MaskPolicy:
    """The mask rules of a deployment: width from the mask output's dims, switches from parameters."""
    return MaskPolicy(
        mask_width=output_width(model_config, SAMPLING_MASK.name),
        width_source=f"the dims of output '{SAMPLING_MASK.name}' in {config_path(args)}",
        speculative_algorithm=string_parameter(model_config, "speculative_algorithm", "none"),
        backend_name=backend.name,
        backend_builds_support=backend.builds_support,
    )
