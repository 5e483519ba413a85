"""The sampler's result: per-row outputs by wire name."""

from __future__ import annotations

import numpy as np
import torch

from .outputs import MASK_OUTPUT_NAMES, TOKEN_OUTPUT_NAMES


class SamplingResult:
    """Per-row outputs, named as on the wire (`outputs.TOKEN_OUTPUTS`: output_ids int64 [B],
    output_logprobs float32 [B], sampling_mask int32 [B, W], sampling_mask_len int32 [B],
    sampling_logprobs float32 [B], sampling_mask_logprobs float32 [B, W]) plus row_max [B] (each
    row's largest logit, NaN / +inf propagated as by `amax`, for the logits checks).

    The fused GPU path hands back one packed device tensor instead; `host()` copies it once and
    the fields are read from that copy.
    """

    FIELDS = (*TOKEN_OUTPUT_NAMES, "row_max")
    MASK_FIELDS = MASK_OUTPUT_NAMES  # [B, W]; a group may fill only its first columns

    def __init__(self, packed: torch.Tensor | None = None, **fields):
        self.packed = packed
        self._host: dict[str, np.ndarray] | None = None
        self._fields = {name: fields.get(name) for name in self.FIELDS}

    @classmethod
    def empty(cls, rows: int, mask_width: int, device: torch.device) -> SamplingResult:
        """Outputs to fill group by group (-1 padded masks, zeros elsewhere)."""

        def full(shape, value, dtype):
            if device.type == "cpu":  # numpy allocations, shared with torch: cheaper than torch's own
                return torch.from_numpy(np.full(shape, value, dtype))
            return torch.full(shape, value, dtype=getattr(torch, np.dtype(dtype).name), device=device)

        return cls(
            output_ids=full(rows, 0, np.int64),
            output_logprobs=full(rows, 0, np.float32),
            sampling_mask=full((rows, mask_width), -1, np.int32),
            sampling_mask_len=full(rows, 0, np.int32),
            sampling_logprobs=full(rows, 0, np.float32),
            sampling_mask_logprobs=full((rows, mask_width), -np.inf, np.float32),
            row_max=full(rows, 0, np.float32),
        )

    @classmethod
    def of_host(cls, arrays: dict[str, np.ndarray]) -> SamplingResult:
        """A result made of host numpy arrays (the CPU path): `host()` returns them as they are, and
        each field reads as a tensor sharing their memory."""
        result = cls()
        result._host = {name: arrays[name] for name in cls.FIELDS}
        return result

    def host(self) -> dict[str, np.ndarray]:
        """Every field as numpy, with one device-to-host copy for a packed result."""
        if self._host is None:
            if self.packed is not None:
                from . import fused  # only packed results come from there

                self._host = fused.unpack(self.packed.cpu().numpy())
            else:
                self._host = {name: value.cpu().numpy() for name, value in self._fields.items()}
        return self._host

    def __getattr__(self, name):
        if name in SamplingResult.FIELDS:
            if self.packed is None and self._host is None:
                return self._fields[name]
            return torch.from_numpy(self.host()[name])
        raise AttributeError(name)
