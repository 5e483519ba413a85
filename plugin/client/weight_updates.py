"""The generate model's weight operations, as a trainer sends them: control requests (JSON in the
`control` input, the admin key as the request parameter `admin_key`) to every replica at once.

The server side is `serving.weight_control`; the operations and their fields are SGLang's. For
`update_weights_from_tensor` the tensors go through one POSIX shared-memory region the client
writes (`SharedTensors`), never through JSON: the servers on this host map it and copy from it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence

import numpy as np

from ..sampling.admin import ADMIN_KEY_PARAMETER
from ..sampling.inputs import CONTROL_INPUT, INPUTS_BY_NAME
from .generate_transport import GenerateError, WireRequest

# The server's names (serving.weight_control, generation.engine); tests/test_weight_control.py
# checks that they agree.
CONTROL = CONTROL_INPUT
PAUSE_MODES = ("abort", "finish", "in_place")
_ALIGN = 64  # each tensor starts on a cache line


def control_request(command: dict, admin_key: str | None, extra_parameters: Mapping[str, str] = {}) -> WireRequest:
    """The wire request of one control command (`extra_parameters`: e.g. the HTTP API's client
    address, sampling.admin.CLIENT_ADDRESS_PARAMETER)."""
    payload = np.array([[json.dumps(command).encode()]], dtype=object)
    parameters = {**extra_parameters, **({ADMIN_KEY_PARAMETER: admin_key} if admin_key is not None else {})}
    return WireRequest(
        f"control-{uuid.uuid4().hex}", False, {CONTROL: (payload, INPUTS_BY_NAME[CONTROL].datatype)}, None, parameters
    )


def check_pause_mode(mode: str, field: str = "pause_mode") -> str:
    """`mode` when it is one of PAUSE_MODES; ValueError naming `field` otherwise."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"{field} must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


async def on_every_replica(
    connect,
    urls: Sequence[str],
    commands: Sequence[dict],
    admin_key: str | None,
    extra_parameters: Mapping[str, str] = {},
) -> dict:
    """Send `commands[i]` to replica `urls[i]`, all at once; {url: control_result}. Raises the
    first replica's GenerateError (naming the replica) after every one has answered."""

    async def one(url: str, command: dict):
        connection = connect(url)
        try:
            return await connection.control(control_request(command, admin_key, extra_parameters))
        finally:
            await connection.close()

    outcomes = await asyncio.gather(*(one(u, c) for u, c in zip(urls, commands)), return_exceptions=True)
    for url, outcome in zip(urls, outcomes):
        if isinstance(outcome, GenerateError):
            raise GenerateError(outcome.status, f"replica {url}: {outcome.message}") from None
        if isinstance(outcome, BaseException):
            raise outcome
    return dict(zip(urls, outcomes))


class SharedTensors:
    """Named tensors (torch or numpy) copied into one new POSIX shared-memory region (mode 0600),
    with the manifest the servers read them by; a context manager that unlinks the region."""

    def __init__(self, tensors: Mapping[str, object]):
        from multiprocessing import shared_memory

        arrays = {name: _host_bytes(value) for name, value in tensors.items()}
        self.manifest, offset = [], 0
        for name, (raw, dtype, shape) in arrays.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            self.manifest.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset})
            offset += raw.size
        self._region = shared_memory.SharedMemory(create=True, size=max(offset, 1))
        self.name = self._region.name.lstrip("/")
        for entry, (raw, _, _) in zip(self.manifest, arrays.values()):
            self._region.buf[entry["offset"] : entry["offset"] + raw.size] = raw

    def close(self) -> None:
        """Unmap and remove the region."""
        self._region.close()
        try:
            self._region.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_bytes(value) -> tuple[np.ndarray, str, list[int]]:
    """A tensor's bytes (uint8, host), its dtype name as torch spells it and its shape."""
    if hasattr(value, "detach"):  # torch: bfloat16 has no numpy dtype, so go through bytes
        import torch

        tensor = value.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        return tensor.reshape(-1).view(torch.uint8).numpy(), dtype, list(tensor.shape)
    array = np.ascontiguousarray(value)
    return array.reshape(-1).view(np.uint8), array.dtype.name, list(array.shape)
