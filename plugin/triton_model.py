"""The `sampler` model's lifecycle, kept out of model.py so the repository's file stays thin."""

from __future__ import annotations

import torch

from .backends import load_backend
from .batching import BatchSampler
from .model_config import (
    config_path,
    instance_device,
    int_parameter,
    load_model_config,
    output_width,
    string_parameter,
)
from .triton_io import error_response, parse_request, sampler_response
from .validation import MaskPolicy, SamplingRequestError

MASK_OUTPUT = "sampling_mask"
DEFAULT_MAX_VOCAB_SIZE = 262144


def mask_policy(args: dict, model_config: dict, backend) -> MaskPolicy:
    """The mask rules of a deployment: width from the mask output's dims, switches from parameters."""
    return MaskPolicy(
        mask_width=output_width(model_config, MASK_OUTPUT),
        width_source=f"the dims of output '{MASK_OUTPUT}' in {config_path(args)}",
        speculative_algorithm=string_parameter(model_config, "speculative_algorithm", "none"),
        backend_name=backend.name,
        backend_builds_support=backend.builds_support,
    )


class SamplerModel:
    """Triton glue for the sampler: parse, sample the batch once, answer each request."""

    def __init__(self, args: dict, pb_utils):
        self.pb_utils = pb_utils
        self.logger = pb_utils.Logger
        model_config = load_model_config(args)
        self.device = instance_device(args)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.max_vocab_size = int_parameter(model_config, "max_vocab_size", DEFAULT_MAX_VOCAB_SIZE)
        backend = load_backend(string_parameter(model_config, "sampling_backend", "torch"))
        self.policy = mask_policy(args, model_config, backend)
        self.sampler = BatchSampler(backend, self.policy, self.device)
        self.logger.log_info(
            f"sampler ready on {self.device}: backend={backend.name}, mask width={self.policy.mask_width}, "
            f"speculative_algorithm={self.policy.speculative_algorithm}"
        )

    def execute(self, requests) -> list:
        """One response per request; nothing escapes (a raise here would fail the whole batch)."""
        responses: list = [None] * len(requests)
        try:
            parsed, positions = [], []
            for position, request in enumerate(requests):
                try:
                    item = parse_request(request, self.pb_utils, self.device, self.max_vocab_size)
                except SamplingRequestError as exc:
                    responses[position] = error_response(self.pb_utils, exc.message)
                    continue
                parsed.append((item.logits, item.params))
                positions.append(position)
            for position, outcome in zip(positions, self.sampler.run(parsed)):
                if outcome.error is not None:
                    responses[position] = error_response(self.pb_utils, outcome.error)
                else:
                    responses[position] = sampler_response(self.pb_utils, outcome.outputs)
        except Exception as exc:  # a genuine internal fault: fail only the unanswered requests
            self.logger.log_error(f"sampler internal error: {type(exc).__name__}: {exc}")
            message = f"internal sampler error ({type(exc).__name__}); see the server log"
            responses = [r if r is not None else error_response(self.pb_utils, message, "INTERNAL") for r in responses]
        return responses

    def finalize(self) -> None:
        """Nothing runs in the background: execute returns only when its batch is answered."""
        self.logger.log_info("sampler finalized")
