"""The sampler's result: each row's outputs by wire name, plus its largest logit.

Every result gives its fields as numpy through `host()` and as torch tensors through `tensor(name)`
(or the attribute of the field's name). Each kind holds them one way: `TensorResult` as tensors on
the sampling device, `HostResult` as host arrays (the CPU path), `fused.PackedResult` as the fused
kernels' one packed tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from .outputs import MASK_OUTPUT_NAMES, OUTPUT_IDS, TOKEN_OUTPUT_NAMES, TOKEN_OUTPUTS

ROW_MAX = "row_max"  # each row's largest logit (NaN / +inf propagated as by `amax`), for the logits rules
FIELDS = (*TOKEN_OUTPUT_NAMES, ROW_MAX)
# The wire's dtypes and fills, except that token ids stay int64 (torch's index dtype) until the wire.
_DTYPES = {spec.name: spec.dtype for spec in TOKEN_OUTPUTS} | {OUTPUT_IDS.name: np.int64, ROW_MAX: np.float32}
_FILLS = {spec.name: spec.fill for spec in TOKEN_OUTPUTS} | {ROW_MAX: 0.0}


class SamplingResult:
    """Per-row outputs, named as on the wire (`outputs.TOKEN_OUTPUTS`: output_ids [B],
    output_logprobs [B], sampling_mask [B, W], sampling_mask_len [B], sampling_logprobs [B],
    sampling_mask_logprobs [B, W]) plus `row_max` [B]."""

    FIELDS = FIELDS
    MASK_FIELDS = MASK_OUTPUT_NAMES  # [B, W]; a row group may fill only their first columns

    def host(self) -> dict[str, np.ndarray]:
        """Every field as a numpy array, copied to the host at most once."""
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        """Field `name` as a torch tensor."""
        raise NotImplementedError


def _field(name: str) -> property:
    return property(lambda result: result.tensor(name), doc=f"`{name}` as a torch tensor.")


for _name in FIELDS:  # result.output_ids and the like, one attribute per field of the table
    setattr(SamplingResult, _name, _field(_name))


class TensorResult(SamplingResult):
    """Outputs held as torch tensors on the sampling device, filled row group by row group."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self._host: dict[str, np.ndarray] | None = None

    @classmethod
    def empty(cls, rows: int, mask_width: int, device: torch.device) -> TensorResult:
        """Outputs to fill group by group, every field at its `fill` (-1 padded masks and so on)."""

        def full(name):
            shape = (rows, mask_width) if name in MASK_OUTPUT_NAMES else (rows,)
            if device.type == "cpu":  # numpy allocations, shared with torch: cheaper than torch's own
                return torch.from_numpy(np.full(shape, _FILLS[name], _DTYPES[name]))
            return torch.full(shape, _FILLS[name], dtype=getattr(torch, np.dtype(_DTYPES[name]).name), device=device)

        return cls({name: full(name) for name in FIELDS})

    def host(self) -> dict[str, np.ndarray]:
        if self._host is None:
            self._host = {name: tensor.cpu().numpy() for name, tensor in self.tensors.items()}
        return self._host

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class HostResult(SamplingResult):
    """Outputs held as host numpy arrays: `host()` returns them as they are, and each field reads as
    a tensor sharing their memory."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = {name: arrays[name] for name in FIELDS}

    def host(self) -> dict[str, np.ndarray]:
        return self.arrays

    def tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self.host()[name])
