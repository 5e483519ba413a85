"""A typed client for the `sampler` model over tritonclient HTTP or gRPC (sync and asyncio).

    from triton_sampling_mask.client.sampler_client import SamplerClient
    from triton_sampling_mask.client.sampling_params import SamplingParams

    with SamplerClient("localhost:8001", protocol="grpc") as client:
        result = client.sample(logits, SamplingParams(temperature=0.8, top_k=50, return_sampling_mask=True))

Parameters are checked with the server's rules before anything is sent (SamplingRequestError);
whatever the server refuses surfaces as SamplerError, carrying its status and message. Logits may
travel through system shared memory (`use_shared_memory=True`) when client and server share a host.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from ..sampling.batching import OUTPUT_NAMES
from ..model_config import output_width, string_parameter
from ..sampling.params import LOGITS, MIN_P, RETURN_SAMPLING_MASK, SEED, TEMPERATURE, TOP_K, TOP_P, RowParams
from .sampling_params import SamplingParams, check_rows_like_server, rows_to_params
from ..sampling.validation import MaskPolicy, SamplingRequestError

DEFAULT_MODEL = "sampler"
MASK_OUTPUT = "sampling_mask"
_PROTOCOLS = ("http", "grpc")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Failures to reach the server that tritonclient lets through untranslated (HTTP clients)."""
    try:
        import aiohttp

        return (OSError, aiohttp.ClientError)
    except ImportError:
        return (OSError,)


_TRANSPORT_ERRORS = _transport_errors()


class SamplerError(Exception):
    """The server refused or failed a request: `status` as tritonclient reports it ("400" over
    HTTP, "StatusCode.INVALID_ARGUMENT" over gRPC, ...) and the server's `message`. `status` is
    None when an HTTP client never got an answer (connection refused, reset...)."""

    def __init__(self, status: str | None, message: str):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message

    @property
    def is_invalid_argument(self) -> bool:
        """Whether this is a user error (HTTP 400 / gRPC INVALID_ARGUMENT)."""
        return self.status in ("400", "StatusCode.INVALID_ARGUMENT")

    @classmethod
    def from_exception(cls, exc: BaseException) -> "SamplerError":
        """From tritonclient's InferenceServerException, or a transport error (status None)."""
        if isinstance(exc, InferenceServerException):
            return cls(exc.status(), exc.message())
        return cls(None, f"could not reach the server: {type(exc).__name__}: {exc}")


@dataclass
class SampleResult:
    """The sampler's outputs for B rows (numpy): the fixed-width mask is [B, W], padded with -1."""

    token_ids: np.ndarray  # int32 [B]
    logprobs: np.ndarray  # float32 [B], under softmax(logits / T) over the whole vocabulary
    sampling_mask: np.ndarray  # int32 [B, W], most probable first
    sampling_mask_len: np.ndarray  # int32 [B], 0 for rows that did not ask
    sampling_logprobs: np.ndarray  # float32 [B], renormalised over the mask (0 when not asked)

    def masks(self) -> list[np.ndarray]:
        """Each row's mask ids without padding."""
        return [row[:n] for row, n in zip(self.sampling_mask, self.sampling_mask_len)]


def _tritonclient_module(protocol: str, asynchronous: bool):
    if protocol not in _PROTOCOLS:
        raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
    base = importlib.import_module(f"tritonclient.{protocol}")
    return base, (importlib.import_module(f"tritonclient.{protocol}.aio") if asynchronous else base)


def _row_params(params: SamplingParams | Sequence[SamplingParams], rows: int) -> RowParams:
    """RowParams for `rows` rows from one SamplingParams (repeated) or one per row."""
    if isinstance(params, SamplingParams):
        return rows_to_params([params]).take(np.zeros(rows, dtype=np.int64))
    params = list(params)
    if len(params) != rows or not all(isinstance(p, SamplingParams) for p in params):
        raise SamplingRequestError("params", f"params must be one SamplingParams or {rows} of them (one per logits row)")
    return rows_to_params(params)


def _as_logits(logits) -> np.ndarray:
    """Logits as a C-contiguous float32 [B, V] numpy array (torch tensors are moved to the CPU)."""
    if hasattr(logits, "detach"):
        logits = logits.detach()
        if logits.is_floating_point():  # bf16 / fp16 have no numpy dtype; float32 holds them exactly
            logits = logits.float()
        logits = logits.cpu().numpy()
    array = np.asarray(logits)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise SamplingRequestError(LOGITS, f"logits must have shape [rows, vocab] with both > 0, got {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.floating):
        raise SamplingRequestError(LOGITS, f"logits must be floating point, got {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float32)


@dataclass(frozen=True)
class ServerLimits:
    """What the client needs from the model config: the mask rules (W, speculative switch) and
    the most rows one request may carry (larger calls are split into several requests)."""

    policy: MaskPolicy
    max_batch_size: int  # 0: the model takes any batch size


def _limits_from_config(config: dict, mask_width: int | None, max_batch_size: int | None) -> ServerLimits:
    """ServerLimits from a model config (HTTP or gRPC JSON), with the caller's overrides."""
    config = config.get("config", config)  # gRPC's JSON wraps the config
    policy = MaskPolicy(
        mask_width=mask_width or output_width(config, MASK_OUTPUT),
        width_source=f"the dims of output '{MASK_OUTPUT}' in the model's config.pbtxt",
        speculative_algorithm=string_parameter(config, "speculative_algorithm", "none"),
    )
    return ServerLimits(policy, int(max_batch_size if max_batch_size is not None else config.get("max_batch_size", 0)))


def _wire_arrays(logits: np.ndarray, params: RowParams) -> dict[str, tuple[np.ndarray, str]]:
    """Every input as (array [B, ...], Triton datatype). A batch mixing seeded and unseeded rows
    gives the unseeded ones fresh random seeds: the server takes a seed for all rows or none."""
    rows = logits.shape[0]
    arrays = {LOGITS: (logits, "FP32")}
    for spec in (TEMPERATURE, TOP_K, TOP_P, MIN_P, RETURN_SAMPLING_MASK):
        arrays[spec.name] = (getattr(params, spec.name).reshape(rows, 1).astype(spec.dtype), np_to_triton_dtype(np.dtype(spec.dtype)))
    if params.has_seed.any():
        fresh = np.frombuffer(os.urandom(8 * rows), dtype=np.uint64)
        seed = np.where(params.has_seed, params.seed, fresh).astype(SEED.dtype)
        arrays[SEED.name] = (seed.reshape(rows, 1), np_to_triton_dtype(np.dtype(SEED.dtype)))
    return arrays


def _parse(result) -> SampleResult:
    # tritonclient may hand read-only views of its buffers; own copies are safe to use with torch.
    out = {name: np.array(result.as_numpy(name)) for name in OUTPUT_NAMES}
    return SampleResult(
        token_ids=out["output_ids"].reshape(-1),
        logprobs=out["output_logprobs"].reshape(-1),
        sampling_mask=out["sampling_mask"],
        sampling_mask_len=out["sampling_mask_len"].reshape(-1),
        sampling_logprobs=out["sampling_logprobs"].reshape(-1),
    )


class _Prepared:
    """A validated call: its wire arrays, split into requests of at most `chunk` rows, and the
    shared-memory region holding all the logits when asked for."""

    def __init__(self, base_module, arrays: dict, chunk: int, use_shared_memory: bool):
        self._base = base_module
        self.arrays = arrays
        rows = arrays[LOGITS][0].shape[0]
        chunk = chunk if chunk > 0 else rows
        self.bounds = [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]
        self.region = _ShmRegion(arrays[LOGITS][0]) if use_shared_memory else None

    def inputs(self, start: int, stop: int) -> list:
        """The InferInputs of rows [start, stop)."""
        inputs = []
        for name, (array, datatype) in self.arrays.items():
            part = array[start:stop]
            infer_input = self._base.InferInput(name, list(part.shape), datatype)
            if name == LOGITS and self.region is not None:
                row_bytes = array[0].nbytes
                infer_input.set_shared_memory(self.region.name, part.nbytes, offset=start * row_bytes)
            else:
                infer_input.set_data_from_numpy(np.ascontiguousarray(part))
            inputs.append(infer_input)
        return inputs


def _concatenate(parts: list[SampleResult]) -> SampleResult:
    if len(parts) == 1:
        return parts[0]
    return SampleResult(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in SampleResult.__dataclass_fields__})


# Triton may still hold a region for a moment after answering the last request that used it
# ("currently in use"), so unregistering retries for up to this long.
_UNREGISTER_RETRY_S = 5.0


def _unregister_failed(exc: BaseException, deadline: float) -> bool:
    """True when an unregister error is final: not "in use", or the retry time is over."""
    if "in use" in str(exc) and time.monotonic() < deadline:
        return False
    # A cleanup failure must not replace the call's result (or its real error): warn instead.
    warnings.warn(f"could not unregister a shared-memory region from the server: {exc}", RuntimeWarning, stacklevel=3)
    return True


def unregister_shared_memory(client, name: str, timeout_s: float = _UNREGISTER_RETRY_S) -> bool:
    """Unregister a system shared-memory region from a sync tritonclient, retrying while the server
    still holds it; warns (never raises) on a final failure, so it cannot mask a call's result."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.unregister_system_shared_memory(name)
            return True
        except Exception as exc:  # tritonclient raises InferenceServerException
            if _unregister_failed(exc, deadline):
                return False
            time.sleep(0.01)


class _ShmRegion:
    """A system shared-memory region holding one array (created here, destroyed by `close`)."""

    def __init__(self, array: np.ndarray):
        import tritonclient.utils.shared_memory as shm

        self._shm = shm
        self.name = f"tsm-{uuid.uuid4().hex[:16]}"
        self.key = f"/{self.name}-{os.getpid()}"
        self.byte_size = array.nbytes
        self.handle = shm.create_shared_memory_region(self.name, self.key, self.byte_size)
        shm.set_shared_memory_region(self.handle, [array])

    def close(self) -> None:
        self._shm.destroy_shared_memory_region(self.handle)


class _SamplerClientBase:
    def __init__(self, url, protocol, model_name, mask_width, max_batch_size, asynchronous, **kwargs):
        self.protocol = protocol
        self.model_name = model_name
        self._base, module = _tritonclient_module(protocol, asynchronous)
        self._mask_width = mask_width
        self._max_batch_size = max_batch_size
        self._limits: ServerLimits | None = None
        self._client = module.InferenceServerClient(url, **kwargs)

    def _config_kwargs(self) -> dict:
        return {"as_json": True} if self.protocol == "grpc" else {}

    def _validated(self, logits, params) -> tuple[np.ndarray, RowParams]:
        """Logits and row parameters checked by every rule that needs no server round trip."""
        array = _as_logits(logits)
        row_params = _row_params(params, array.shape[0])
        # One pass of the server's row rules; the deployment's mask rules need its config, so
        # they run here only when the caller gave the mask width (else in _prepare).
        given = MaskPolicy(self._mask_width, "the mask_width given to the client") if self._mask_width is not None else None
        check_rows_like_server(row_params, array.shape[1], given, row_max=array.max(axis=1))  # NaN propagates through max
        return array, row_params

    def _prepare(self, array: np.ndarray, row_params: RowParams, limits: ServerLimits, use_shared_memory: bool) -> _Prepared:
        """Apply the deployment's mask rules, then lay out the requests."""
        if row_params.return_sampling_mask.any():
            check_rows_like_server(row_params, array.shape[1], limits.policy)
        return _Prepared(self._base, _wire_arrays(array, row_params), limits.max_batch_size, use_shared_memory)


class SamplerClient(_SamplerClientBase):
    """Synchronous client for the sampler model over tritonclient HTTP ("host:8000") or gRPC
    ("host:8001"). The mask width W and max_batch_size are read once from the model config;
    passing both `mask_width` and `max_batch_size` skips that call. Extra keyword arguments go
    to tritonclient's InferenceServerClient."""

    def __init__(self, url: str, protocol: str = "http", model_name: str = DEFAULT_MODEL,
                 mask_width: int | None = None, max_batch_size: int | None = None, **kwargs):
        super().__init__(url, protocol, model_name, mask_width, max_batch_size, False, **kwargs)

    def server_limits(self) -> ServerLimits:
        """The deployment's mask rules and batch limit, read once from the model config."""
        if self._limits is None:
            config = {}
            if self._mask_width is None or self._max_batch_size is None:
                config = self._call(self._client.get_model_config, self.model_name, **self._config_kwargs())
            self._limits = _limits_from_config(config, self._mask_width, self._max_batch_size)
        return self._limits

    def mask_policy(self) -> MaskPolicy:
        """The server's mask rules: the mask width W and its speculative switch."""
        return self.server_limits().policy

    def sample(self, logits, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
               use_shared_memory: bool = False) -> SampleResult:
        """Sample one token per row of `logits` [B, V] with one SamplingParams for all rows or one
        per row; more rows than max_batch_size go as several requests, answered in order."""
        array, row_params = self._validated(logits, params)
        prepared = self._prepare(array, row_params, self.server_limits(), use_shared_memory)
        with self._registered(prepared.region):
            return _concatenate([
                _parse(self._call(self._client.infer, self.model_name, prepared.inputs(start, stop)))
                for start, stop in prepared.bounds
            ])

    @contextmanager
    def _registered(self, region: _ShmRegion | None):
        if region is None:
            yield
            return
        try:
            self._call(self._client.register_system_shared_memory, region.name, region.key, region.byte_size)
            try:
                yield
            finally:
                unregister_shared_memory(self._client, region.name)
        finally:
            region.close()

    @staticmethod
    def _call(method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except (InferenceServerException, *_TRANSPORT_ERRORS) as exc:
            raise SamplerError.from_exception(exc) from None

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "SamplerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSamplerClient(_SamplerClientBase):
    """The asyncio twin of SamplerClient (tritonclient.http.aio / tritonclient.grpc.aio); the
    requests of a call larger than max_batch_size are sent concurrently."""

    def __init__(self, url: str, protocol: str = "http", model_name: str = DEFAULT_MODEL,
                 mask_width: int | None = None, max_batch_size: int | None = None, **kwargs):
        super().__init__(url, protocol, model_name, mask_width, max_batch_size, True, **kwargs)

    async def server_limits(self) -> ServerLimits:
        """The deployment's mask rules and batch limit, read once from the model config."""
        if self._limits is None:
            config = {}
            if self._mask_width is None or self._max_batch_size is None:
                config = await self._call(self._client.get_model_config(self.model_name, **self._config_kwargs()))
            self._limits = _limits_from_config(config, self._mask_width, self._max_batch_size)
        return self._limits

    async def mask_policy(self) -> MaskPolicy:
        """The server's mask rules: the mask width W and its speculative switch."""
        return (await self.server_limits()).policy

    async def sample(self, logits, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                     use_shared_memory: bool = False) -> SampleResult:
        """As SamplerClient.sample, awaited."""
        array, row_params = self._validated(logits, params)
        prepared = self._prepare(array, row_params, await self.server_limits(), use_shared_memory)
        region = prepared.region
        try:
            if region is not None:
                await self._call(self._client.register_system_shared_memory(region.name, region.key, region.byte_size))
            try:
                # Every chunk finishes before the region is torn down, even when one fails.
                results = await asyncio.gather(*(
                    self._call(self._client.infer(self.model_name, prepared.inputs(start, stop)))
                    for start, stop in prepared.bounds
                ), return_exceptions=True)
                failures = [r for r in results if isinstance(r, BaseException)]
                if failures:
                    raise failures[0]
                return _concatenate([_parse(r) for r in results])
            finally:
                if region is not None:
                    deadline = time.monotonic() + _UNREGISTER_RETRY_S
                    while True:
                        try:
                            await self._client.unregister_system_shared_memory(region.name)
                            break
                        except Exception as exc:
                            if _unregister_failed(exc, deadline):
                                break
                            await asyncio.sleep(0.01)
        finally:
            if region is not None:
                region.close()

    @staticmethod
    async def _call(awaitable):
        try:
            return await awaitable
        except (InferenceServerException, *_TRANSPORT_ERRORS) as exc:
            raise SamplerError.from_exception(exc) from None

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "AsyncSamplerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
