"""What a deployment's config.pbtxt and Triton's instance args set up for a model's sampler: the
device, the backend, the mask policy, the declared outputs. Both models read them here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model_config import config_path, load_model_config, output_width, string_parameter
from ..sampling.backends import load_backend
from ..sampling.batching import BatchSampler
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


def mask_policy(args: dict, model_config: dict, backend, exact_speculative: frozenset[str] = frozenset()) -> MaskPolicy:
    """The mask rules of a deployment: width from the mask output's dims, switches from parameters;
    `exact_speculative` names the speculative algorithms the model verifies exactly."""
    return MaskPolicy(
        mask_width=output_width(model_config, SAMPLING_MASK.name),
        width_source=f"the dims of output '{SAMPLING_MASK.name}' in {config_path(args)}",
        speculative_algorithm=string_parameter(model_config, "speculative_algorithm", "none"),
        backend_name=backend.name,
        backend_builds_support=backend.builds_support,
        exact_speculative=exact_speculative,
    )


# The logits dtypes a deployment may declare (config.pbtxt data_type -> torch dtype).
LOGITS_DATA_TYPES = {"TYPE_FP32": torch.float32, "TYPE_BF16": torch.bfloat16, "TYPE_FP16": torch.float16}


def instance_device(args: dict) -> torch.device:
    """cuda:<model_instance_device_id> for KIND_GPU instances, else the CPU (Triton pins nothing)."""
    if args.get("model_instance_kind") == "GPU":
        return torch.device(f"cuda:{int(args.get('model_instance_device_id', 0))}")
    return torch.device("cpu")


def select_device(args: dict) -> torch.device:
    """The instance's device (cuda:<id> for KIND_GPU, else the CPU), made the stub's current CUDA
    device so that tensors created without one land there too."""
    device = instance_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


@dataclass
class SamplerDeployment:
    """A model instance's sampler as its config.pbtxt sets it up."""

    model_config: dict
    config_file: str  # relative to the model repository, for messages
    device: torch.device
    policy: MaskPolicy
    declared_outputs: set[str]
    sampler: BatchSampler

    def ready_message(self, model: str, *details: str) -> str:
        """The line a model logs once loaded: its own `details`, then the sampler's set-up."""
        sampler = (
            f"backend={self.policy.backend_name}, mask width={self.policy.mask_width}, "
            f"speculative_algorithm={self.policy.speculative_algorithm}, torch threads={torch.get_num_threads()}"
        )
        return f"{model} ready on {self.device}: " + ", ".join([*details, sampler])


def load_deployment(args: dict, exact_speculative: frozenset[str] = frozenset()) -> SamplerDeployment:
    """Read config.pbtxt from `initialize`'s args, pick the device, load the sampling backend and
    build the batch sampler; a bad config fails model load with a message naming the file.
    `exact_speculative`: the speculative algorithms whose tokens and masks the model proves to be
    those of plain decoding (the generate engine's drafters); masks stay refused under any other."""
    model_config = load_model_config(args)
    config_file = config_path(args)
    device = select_device(args)
    backend = load_backend(string_parameter(model_config, "sampling_backend", "torch"))
    policy = mask_policy(args, model_config, backend, exact_speculative)
    return SamplerDeployment(
        model_config=model_config,
        config_file=config_file,
        device=device,
        policy=policy,
        declared_outputs=declared_outputs(model_config, policy.mask_width, config_file),
        sampler=BatchSampler(backend, policy, device),
    )
