"""A typed client for the `sampler` model over tritonclient HTTP or gRPC (sync and asyncio).

    from triton_sampling_mask.client.sampler_client import SamplerClient
    from triton_sampling_mask.client.sampling_params import SamplingParams

    with SamplerClient("localhost:8001", protocol="grpc") as client:
        result = client.sample(logits, SamplingParams(temperature=0.8, top_k=50, return_sampling_mask=True))

Parameters are checked with the server's rules before anything is sent (SamplingRequestError);
whatever the server refuses surfaces as SamplerError, carrying its status and message. Logits may
travel through system shared memory (`use_shared_memory=True`) when client and server share a host;
a server started by the launcher locks shared-memory registration behind its admin key, which
the client then needs (`admin_key=`; inference itself needs none).

Past one machine, give several replicas (`replicas` holds the policy):

    with SamplerClient(["h1:8001", "h2:8001", "h3:8001"], protocol="grpc") as client:
        result = client.sample(logits, params)  # least outstanding requests; a failed replica is
        client.replica_shares()                 # ejected, probed back in, the request retried elsewhere
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tritonclient.utils import InferenceServerException

from ..model_config import output_width, string_parameter
from ..sampling.admin import ADMIN_HEADER, GRPC_RESTRICTED_PREFIX
from ..sampling.inputs import triton_datatype
from ..sampling.outputs import SAMPLED_OUTPUTS, SAMPLING_MASK, TOKEN, from_wire_values
from ..sampling.params import LOGITS, PARAM_SPECS, SEED, RowParams
from ..sampling.validation import MaskPolicy, SamplingRequestError
from .loop_thread import LoopClient, LoopThread
from .receipts import SamplingReceipts
from .replicas import (
    DEFAULT_EJECT_BACKOFF_S,
    DEFAULT_MAX_EJECT_BACKOFF_S,
    BusyPolicy,
    ReplicatedClient,
)
from .sampling_params import SamplingParams, check_rows_like_server, rows_to_params

# Sampler calls are short: a busy server is retried for this long before the refusal is raised.
DEFAULT_BUSY_TIMEOUT_S = 30.0
DEFAULT_MODEL = "sampler"
_PROTOCOLS = ("http", "grpc")
# Seconds a health probe of an ejected replica may take.
_PROBE_TIMEOUT_S = 2.0


def admin_headers(protocol: str, admin_key: str | None, header: str = ADMIN_HEADER) -> dict[str, str] | None:
    """The headers that unlock a restricted Triton API for `protocol`, or None without a key."""
    if admin_key is None:
        return None
    return {(GRPC_RESTRICTED_PREFIX + header if protocol == "grpc" else header): admin_key}


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Failures to reach the server that tritonclient lets through untranslated (HTTP clients;
    geventhttpclient's "connection closed" when a server dies mid-answer is an HTTPException)."""
    from http.client import HTTPException

    try:
        import aiohttp

        return (OSError, HTTPException, aiohttp.ClientError)
    except ImportError:
        return (OSError, HTTPException)


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
    def from_exception(cls, exc: BaseException) -> SamplerError:
        """From tritonclient's InferenceServerException, or a transport error (status None)."""
        if isinstance(exc, InferenceServerException):
            return cls(exc.status(), exc.message())
        return cls(None, f"could not reach the server: {type(exc).__name__}: {exc}")


@dataclass
class SampleResult:
    """The sampler's outputs for B rows (numpy), named as on the wire (`sampling.outputs`): one
    value per row, or [B, W] for the fixed-width mask and its log-probs."""

    output_ids: np.ndarray  # int32 [B]
    output_logprobs: np.ndarray  # float32 [B], under softmax(logits / T) over the whole vocabulary
    sampling_mask: np.ndarray  # int32 [B, W], most probable first
    sampling_mask_len: np.ndarray  # int32 [B], 0 for rows that did not ask
    sampling_logprobs: np.ndarray  # float32 [B], renormalised over the mask (0 when not asked)
    # float32 [B, W]: each mask id's log-prob renormalised over the mask, -inf padded (None from a
    # server whose config declares no sampling_mask_logprobs output)
    sampling_mask_logprobs: np.ndarray | None = None
    sampling_seed: np.ndarray | None = None  # uint64 [B]: the seed of each row's noise (the receipt)
    # Each token's receipt (client.receipts), when the call asked for them (return_receipts=True)
    receipts: SamplingReceipts | None = None

    def masks(self) -> list[np.ndarray]:
        """Each row's mask ids without padding."""
        return [row[:n] for row, n in zip(self.sampling_mask, self.sampling_mask_len)]


def _tritonclient_modules(protocol: str):
    """tritonclient.<protocol> (its InferInput) and tritonclient.<protocol>.aio (its client)."""
    if protocol not in _PROTOCOLS:
        raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
    return importlib.import_module(f"tritonclient.{protocol}"), importlib.import_module(f"tritonclient.{protocol}.aio")


def _row_params(params: SamplingParams | Sequence[SamplingParams], rows: int) -> RowParams:
    """RowParams for `rows` rows from one SamplingParams (repeated) or one per row."""
    if isinstance(params, SamplingParams):
        return rows_to_params([params]).take(np.zeros(rows, dtype=np.int64))
    params = list(params)
    if len(params) != rows or not all(isinstance(p, SamplingParams) for p in params):
        raise SamplingRequestError(
            "params", f"params must be one SamplingParams or {rows} of them (one per logits row)"
        )
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
        raise SamplingRequestError(
            LOGITS, f"logits must have shape [rows, vocab] with both > 0, got {list(array.shape)}"
        )
    if not np.issubdtype(array.dtype, np.floating):
        raise SamplingRequestError(LOGITS, f"logits must be floating point, got {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float32)


@dataclass(frozen=True)
class ServerLimits:
    """What the client needs from the model config: the mask rules (W, speculative switch) and
    the most rows one request may carry (larger calls are split into several requests)."""

    policy: MaskPolicy
    max_batch_size: int  # 0: the model takes any batch size
    logits_datatype: str = "FP32"  # the deployment's logits input: FP32, BF16 or FP16


def _limits_from_config(config: dict, mask_width: int | None, max_batch_size: int | None) -> ServerLimits:
    """ServerLimits from a model config (HTTP or gRPC JSON), with the caller's overrides."""
    config = config.get("config", config)  # gRPC's JSON wraps the config
    policy = MaskPolicy(
        mask_width=mask_width or output_width(config, SAMPLING_MASK.name),
        width_source=f"the dims of output '{SAMPLING_MASK.name}' in the model's config.pbtxt",
        speculative_algorithm=string_parameter(config, "speculative_algorithm", "none"),
    )
    logits_type = next(
        (i.get("data_type", "TYPE_FP32") for i in config.get("input", []) if i.get("name") == LOGITS), "TYPE_FP32"
    )
    return ServerLimits(
        policy,
        int(max_batch_size if max_batch_size is not None else config.get("max_batch_size", 0)),
        logits_type.removeprefix("TYPE_"),
    )


# The numpy dtype each logits datatype travels as (tritonclient takes BF16 as ml_dtypes.bfloat16).
def _logits_numpy_dtype(datatype: str):
    if datatype == "BF16":
        import ml_dtypes  # a tritonclient dependency

        return ml_dtypes.bfloat16
    return {"FP32": np.float32, "FP16": np.float16}[datatype]


def _wire_arrays(
    logits: np.ndarray, params: RowParams, logits_datatype: str = "FP32"
) -> dict[str, tuple[np.ndarray, str]]:
    """Every input as (array [B, ...], Triton datatype), the logits in the deployment's dtype
    (half the bytes for BF16 / FP16). A batch mixing seeded and unseeded rows gives the unseeded
    ones fresh random seeds: the server takes a seed for all rows or none."""
    rows = logits.shape[0]
    arrays = {
        LOGITS: (np.ascontiguousarray(logits.astype(_logits_numpy_dtype(logits_datatype), copy=False)), logits_datatype)
    }
    for spec in PARAM_SPECS:
        values = getattr(params, spec.name)
        if spec is SEED:
            if not params.has_seed.any():
                continue
            values = np.where(params.has_seed, values, np.frombuffer(os.urandom(8 * rows), dtype=np.uint64))
        arrays[spec.name] = (values.reshape(rows, 1).astype(spec.dtype), triton_datatype(spec.dtype))
    return arrays


def _parse(result) -> SampleResult:
    """A response as a SampleResult; an output the server did not send (one its config does not
    declare) is None."""
    outputs = {}
    for spec in SAMPLED_OUTPUTS:
        value = from_wire_values(spec.name, result.as_numpy(spec.name))
        if value is not None:  # tritonclient may hand read-only views of its buffers: own copies
            value = np.array(value).reshape(-1) if spec.per == TOKEN else np.array(value)
        outputs[spec.name] = value
    return SampleResult(**outputs)


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

    def joined(field: str):
        values = [getattr(p, field) for p in parts]
        return None if any(v is None for v in values) else np.concatenate(values)

    return SampleResult(**{f: joined(f) for f in SampleResult.__dataclass_fields__})


def _receipted(result: SampleResult, row_params: RowParams, wanted: bool) -> SampleResult:
    """The result with its receipts when the call asked for them (and the server sent the seeds)."""
    if wanted and result.sampling_seed is not None:
        result.receipts = SamplingReceipts.served(result.sampling_seed, row_params)
    return result


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


def unregister_shared_memory(
    client, name: str, timeout_s: float = _UNREGISTER_RETRY_S, headers: dict | None = None
) -> bool:
    """Unregister a system shared-memory region from a sync tritonclient, retrying while the server
    still holds it; warns (never raises) on a final failure, so it cannot mask a call's result.
    `headers`: see `admin_headers` (servers that lock the shared-memory API)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.unregister_system_shared_memory(name, headers=headers)
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


_CLIENT_ARGS_DOC = """`url` is one "host:port" or a list of them, replicas serving the same model repository:
    each request goes to the healthy replica with the fewest outstanding requests; one that fails
    (unreachable, 503 / UNAVAILABLE when it is down, a model whose stub died) is ejected, probed
    in the background after `eject_backoff_s` (doubling up to `max_eject_backoff_s`) and readmitted
    once ready, and the request is retried on another replica, up to `max_attempts` tries in all
    (default: 1 with one URL, so errors surface at once; 2 per replica with several).
    A refusal that says the server is busy (the front door shedding load, `sampling.refusals`)
    is retried after a jittered backoff on the same terms as GenerateClient's, for up to
    `busy_timeout_s` (default 30 s), without ejecting the replica or using up a try.
    A seeded row gives the same draw on every replica, so a retry changes nothing; an unseeded
    request that is retried is a fresh draw. User errors (400 / INVALID_ARGUMENT) are never
    retried. With `use_shared_memory=True` the region is registered on the replica that serves
    the call, which answers all of its chunks (retried whole elsewhere on failure): it needs every
    replica on the client's host. The model config (W, max_batch_size) is read from the first
    replica that answers: replicas must share it."""


class AsyncSamplerClient(ReplicatedClient):
    """asyncio client for the sampler model over tritonclient HTTP ("host:8000",
    tritonclient.http.aio) or gRPC ("host:8001", tritonclient.grpc.aio). The mask width W and
    max_batch_size are read once from the model config; passing both `mask_width` and
    `max_batch_size` skips that call. `admin_key` is sent (as ADMIN_HEADER) when registering
    shared memory, for servers that lock that API. Extra keyword arguments go to tritonclient's
    asyncio InferenceServerClient. The requests of a call larger than max_batch_size are sent
    concurrently, each to its own choice of replica.

    """

    __doc__ += _CLIENT_ARGS_DOC

    def __init__(
        self,
        url: str | Sequence[str],
        protocol: str = "http",
        model_name: str = DEFAULT_MODEL,
        mask_width: int | None = None,
        max_batch_size: int | None = None,
        *,
        admin_key: str | None = None,
        max_attempts: int | None = None,
        eject_backoff_s: float = DEFAULT_EJECT_BACKOFF_S,
        max_eject_backoff_s: float = DEFAULT_MAX_EJECT_BACKOFF_S,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        **kwargs,
    ):
        self.protocol = protocol
        self.model_name = model_name
        self._admin_headers = admin_headers(protocol, admin_key)
        self._base, self._module = _tritonclient_modules(protocol)
        self._mask_width = mask_width
        self._max_batch_size = max_batch_size
        self._limits: ServerLimits | None = None
        self._client_kwargs = kwargs
        make_client = lambda u: self._module.InferenceServerClient(u, **kwargs)  # noqa: E731
        busy_policy = BusyPolicy(timeout_s=busy_timeout_s)
        self._init_replicas(url, make_client, max_attempts, eject_backoff_s, max_eject_backoff_s, busy_policy)

    def _server_error(self, exc: BaseException) -> SamplerError | None:
        """A server or transport failure as SamplerError; None for anything else (raised as it is)."""
        if isinstance(exc, SamplerError):
            return exc
        if isinstance(exc, (InferenceServerException, *_TRANSPORT_ERRORS)):
            return SamplerError.from_exception(exc)
        return None

    def _validated(self, logits, params) -> tuple[np.ndarray, RowParams]:
        """Logits and row parameters checked by every rule that needs no server round trip."""
        array = _as_logits(logits)
        row_params = _row_params(params, array.shape[0])
        # One pass of the server's row rules; the deployment's mask rules need its config, so
        # they run here only when the caller gave the mask width (else in _prepare).
        given = (
            MaskPolicy(self._mask_width, "the mask_width given to the client") if self._mask_width is not None else None
        )
        check_rows_like_server(
            row_params, array.shape[1], given, row_max=array.max(axis=1)
        )  # NaN propagates through max
        return array, row_params

    def _prepare(
        self, array: np.ndarray, row_params: RowParams, limits: ServerLimits, use_shared_memory: bool
    ) -> _Prepared:
        """Apply the deployment's mask rules, then lay out the requests."""
        if row_params.return_sampling_mask.any():
            check_rows_like_server(row_params, array.shape[1], limits.policy)
        return _Prepared(
            self._base,
            _wire_arrays(array, row_params, limits.logits_datatype),
            limits.max_batch_size,
            use_shared_memory,
        )

    async def server_limits(self) -> ServerLimits:
        """The deployment's mask rules and batch limit, read once from the model config."""
        if self._limits is None:
            config = {}
            if self._mask_width is None or self._max_batch_size is None:
                as_json = {"as_json": True} if self.protocol == "grpc" else {}
                config = await self._on_a_replica(lambda client: client.get_model_config(self.model_name, **as_json))
            self._limits = _limits_from_config(config, self._mask_width, self._max_batch_size)
        return self._limits

    async def mask_policy(self) -> MaskPolicy:
        """The server's mask rules: the mask width W and its speculative switch."""
        return (await self.server_limits()).policy

    async def sample(
        self,
        logits,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        use_shared_memory: bool = False,
        return_receipts: bool = False,
    ) -> SampleResult:
        """Sample one token per row of `logits` [B, V] with one SamplingParams for all rows or one
        per row; more rows than max_batch_size go as several requests, answered in order.
        `return_receipts`: the result carries each row's receipt (`result.receipts`, from the
        server's `sampling_seed`) for `receipts.rederive_tokens`."""
        array, row_params = self._validated(logits, params)
        return _receipted(await self._sample(array, row_params, use_shared_memory), row_params, return_receipts)

    async def _sample(self, array: np.ndarray, row_params: RowParams, use_shared_memory: bool) -> SampleResult:
        prepared = self._prepare(array, row_params, await self.server_limits(), use_shared_memory)
        if prepared.region is None:
            return await self._gather_chunks(
                prepared,
                lambda start, stop: self._on_a_replica(
                    lambda client: client.infer(self.model_name, prepared.inputs(start, stop)), served=True
                ),
            )
        try:
            return await self._on_a_replica(lambda client: self._sample_registered(client, prepared), served=True)
        finally:
            prepared.region.close()

    @staticmethod
    async def _gather_chunks(prepared: _Prepared, send) -> SampleResult:
        # Every chunk finishes before the call returns (or a shared-memory region is torn down),
        # even when one fails.
        results = await asyncio.gather(*(send(start, stop) for start, stop in prepared.bounds), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return _concatenate([_parse(r) for r in results])

    async def _sample_registered(self, client, prepared: _Prepared) -> SampleResult:
        """Every chunk of a shared-memory call on one replica, the region registered there."""
        region = prepared.region
        await client.register_system_shared_memory(
            region.name, region.key, region.byte_size, headers=self._admin_headers
        )
        try:
            return await self._gather_chunks(
                prepared, lambda start, stop: client.infer(self.model_name, prepared.inputs(start, stop))
            )
        finally:
            deadline = time.monotonic() + _UNREGISTER_RETRY_S
            while True:
                try:
                    await client.unregister_system_shared_memory(region.name, headers=self._admin_headers)
                    break
                except Exception as exc:
                    if _unregister_failed(exc, deadline):
                        break
                    await asyncio.sleep(0.01)

    async def _probe(self, replica) -> None:
        """Whether the replica's server and model are ready, on a short-lived tritonclient."""
        ready = False
        try:
            probe = self._module.InferenceServerClient(replica.url, **self._client_kwargs)
            try:
                ready = await asyncio.wait_for(probe.is_server_ready(), _PROBE_TIMEOUT_S) and await asyncio.wait_for(
                    probe.is_model_ready(self.model_name), _PROBE_TIMEOUT_S
                )
            finally:
                await probe.close()
        except Exception:  # unreachable, or any answer but ready
            ready = False
        self._replicas.probed(replica, ready)


class SamplerClient(LoopClient):
    """Synchronous client for the sampler model: an AsyncSamplerClient (same arguments) run on an
    event loop of its own (a daemon thread), safe to share between threads.

    """

    __doc__ += _CLIENT_ARGS_DOC

    def __init__(self, url: str | Sequence[str], protocol: str = "http", model_name: str = DEFAULT_MODEL, **kwargs):
        self._loop = LoopThread("sampler-client")

        async def build() -> AsyncSamplerClient:  # on the loop: asyncio clients bind to the loop they are made on
            return AsyncSamplerClient(url, protocol, model_name, **kwargs)

        try:
            self._client = self._loop.run(build())
        except BaseException:
            self._loop.close(asyncio.sleep(0))
            raise
        self.protocol, self.model_name, self.urls = protocol, model_name, self._client.urls
        self.max_attempts, self.busy_policy = self._client.max_attempts, self._client.busy_policy

    def server_limits(self) -> ServerLimits:
        """The deployment's mask rules and batch limit, read once from the model config."""
        return self._loop.run(self._client.server_limits())

    def mask_policy(self) -> MaskPolicy:
        """The server's mask rules: the mask width W and its speculative switch."""
        return self.server_limits().policy

    def sample(self, logits, *args, **kwargs) -> SampleResult:
        """As AsyncSamplerClient.sample (same arguments), waited for."""
        return self._loop.run(self._client.sample(logits, *args, **kwargs))
