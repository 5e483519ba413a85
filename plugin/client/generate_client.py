"""A typed client for the `generate` model: a batch of token-id prompts in, one result per
prompt out (ids, log-probs and sampling masks, named as on the wire), over gRPC streams or HTTP.

    from triton_sampling_mask.client import GenerateClient
    from triton_sampling_mask.client.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=50, seed=1, return_sampling_mask=True)
    with GenerateClient("localhost:8001") as client:
        results = client.generate([[5, 6, 7], [8, 9]], params, max_new_tokens=32)
        with client.stream([[5, 6, 7]], params, max_new_tokens=32) as chunks:
            for chunk in chunks:  # one GenerateResult per new token, `index` says whose
                ...

Parameters are checked with the server's rules before anything is sent (SamplingRequestError).
A call sends its requests on one gRPC stream per replica (or one HTTP request each), at most
`max_in_flight` at a time over the whole client. A request the server cannot take now (503 /
UNAVAILABLE: its queue or the engine's bounds are full, the model is unloading) is sent again
after a jittered exponential backoff, for up to `busy_timeout_s`; a replica that fails is ejected
and the request retried on another, with SamplerClient's policy (`replicas.Attempts`). A seeded
request gives the same tokens on every try; a streamed one that is retried after some of its
tokens were yielded resumes after them when seeded, and fails otherwise. Cancelling a call
(its task, `stream(...).close()`, or the Future of `submit`) cancels its streams, so the server
stops its requests. `GenerateClient` runs `AsyncGenerateClient` on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import queue
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..model_config import output_width, string_parameter
from ..sampling.inputs import IGNORE_EOS, INPUT_IDS, MAX_NEW_TOKENS, STOP_TOKEN_IDS, STREAM, generate_wire_inputs
from ..sampling.outputs import (
    BY_NAME,
    CONTROL_RESULT,
    FINISH_REASON,
    GENERATION_TIME,
    NEG_INF_FILLED,
    QUEUE_TIME,
    SAMPLED_OUTPUTS,
    SAMPLING_MASK,
    SAMPLING_SEED,
    SHARED_TOKEN_OUTPUT_NAMES,
    TIME_TO_FIRST_TOKEN,
    TIMING_OUTPUTS,
    WEIGHT_VERSION,
    WIRE_NEG_INF,
    expand_shared,
)
from ..sampling.params import PARAM_SPECS, RowParams
from ..sampling.refusals import DEFAULT_ROUTE_CAPACITY
from ..sampling.validation import SPECULATIVE_ALGORITHMS, MaskPolicy, SamplingRequestError
from .generate_transport import GenerateError, GrpcConnection, HttpConnection, WireRequest
from .loop_thread import LoopClient, LoopThread
from .receipts import SamplingReceipts
from .replicas import (
    DEFAULT_EJECT_BACKOFF_S,
    DEFAULT_MAX_EJECT_BACKOFF_S,
    BusyPolicy,
    ReplicatedClient,
    split_urls,
)
from .sampler_client import SampleResult
from .sampling_params import SamplingParams, check_rows_like_server, rows_to_params
from .weight_updates import SharedTensors, check_pause_mode, on_every_replica

__all__ = [
    "AsyncGenerateClient",
    "AsyncGenerateStream",
    "GenerateClient",
    "GenerateError",
    "GenerateResult",
    "GenerateStream",
    "RequestTimings",
    "concatenate_tokens",
]

DEFAULT_MODEL = "generate"
_PROTOCOLS = ("grpc", "http")
# Requests on the wire per replica at most: what the front door lets into one model route at once
# (twice the engine's 32 active rows, so its queue stays fed), so one client is not shed by its own
# load; the others wait in the client.
DEFAULT_MAX_IN_FLIGHT_PER_REPLICA = DEFAULT_ROUTE_CAPACITY
DEFAULT_BACKOFF_S = BusyPolicy.backoff_s
DEFAULT_MAX_BACKOFF_S = BusyPolicy.max_backoff_s
DEFAULT_BUSY_TIMEOUT_S = BusyPolicy.timeout_s
_PROBE_TIMEOUT_S = 2.0
_INT32_MAX = 2**31 - 1


@dataclass
class GenerateResult(SampleResult):
    """One request's outputs (numpy, named as on the wire, `sampling.outputs`), one entry or mask
    row per generated token: output_ids [n], output_logprobs [n], sampling_mask [n, W],
    sampling_mask_len [n], sampling_logprobs [n], sampling_mask_logprobs [n, W] (an output left
    out of `outputs=` is None). `finish_reason` is "length" or "stop" ("" on a streamed chunk
    before the last); `index` is the request's position in the call's prompts. The mask fields
    are what the converters take: `to_vllm_csr(r.sampling_mask, r.sampling_mask_len)`.
    `weight_version` [n] (str) names the weights that sampled each token: a request that straddles
    a weight update has the old version on its first tokens and the new one after. `sampling_seed`
    [n] is the request's noise seed; with `return_receipts=True`, `receipts` holds each token's
    receipt (seed, step, parameters) for `receipts.rederive_tokens`. With `return_timings=True`,
    `timings` holds the request's timings on its whole result (streamed: on its last chunk)."""

    finish_reason: str = ""
    index: int = 0
    weight_version: np.ndarray | None = None
    timings: RequestTimings | None = None


@dataclass(frozen=True)
class RequestTimings:
    """One request's timings in seconds, from the engine's clock (vLLM's per-request metrics):
    `queue_s` from submission to admission into the decode batch, `time_to_first_token_s` from
    submission to the first token, `generation_s` from admission to the last token; `tokens`, how
    many it generated."""

    queue_s: float
    time_to_first_token_s: float
    generation_s: float
    tokens: int

    @classmethod
    def from_outputs(cls, outputs: dict, tokens: int) -> RequestTimings | None:
        """From a request's last response (None when it carries no timings)."""
        if any(outputs.get(spec.name) is None for spec in TIMING_OUTPUTS):
            return None
        return cls(outputs[QUEUE_TIME.name], outputs[TIME_TO_FIRST_TOKEN.name], outputs[GENERATION_TIME.name], tokens)

    @property
    def e2e_s(self) -> float:
        """From submission to the last token."""
        return self.queue_s + self.generation_s

    @property
    def decode_s(self) -> float:
        """From the first token to the last."""
        return self.queue_s + self.generation_s - self.time_to_first_token_s

    @property
    def mean_inter_token_s(self) -> float | None:
        """The mean time between two consecutive tokens, decode_s / (tokens - 1) (None for fewer
        than two tokens)."""
        return self.decode_s / (self.tokens - 1) if self.tokens > 1 else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens generated per second of generation (admission to last token; None when no time
        passed or no token was generated)."""
        return self.tokens / self.generation_s if self.tokens and self.generation_s > 0 else None


def concatenate_tokens(results: Sequence[SampleResult]) -> SampleResult:
    """The tokens of several results, request after request, as one SampleResult ([N], [N, W]):
    a whole batch in the layout the converters and `replay_logprobs` take."""
    fields = SampleResult.__dataclass_fields__

    def joined(name: str):
        values = [getattr(r, name) for r in results]
        if not values or any(v is None for v in values):
            return None
        return SamplingReceipts.concatenate(values) if name == "receipts" else np.concatenate(values)

    return SampleResult(**{name: joined(name) for name in fields})


@dataclass(frozen=True)
class GenerateLimits:
    """What the client reads from the model config: the mask rules (W, speculative switch)."""

    policy: MaskPolicy


def _limits_from_config(config: dict, mask_width: int | None) -> GenerateLimits:
    config = config.get("config", config)
    return GenerateLimits(
        MaskPolicy(
            mask_width=mask_width or output_width(config, SAMPLING_MASK.name),
            width_source=f"the dims of output '{SAMPLING_MASK.name}' in the generate model's config.pbtxt",
            speculative_algorithm=string_parameter(config, "speculative_algorithm", "none"),
            exact_speculative=SPECULATIVE_ALGORITHMS,  # as the generate model: drafts it verifies allow masks
        )
    )


def _int_list(values, field: str, index: int | None = None) -> np.ndarray:
    """Token ids as int32 [n] (each in [0, 2**31)); raises SamplingRequestError naming the field."""
    where = f"{field}[{index}]" if index is not None else field
    array = np.asarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise SamplingRequestError(field, f"{where} must be a 1-D sequence of token ids, got shape {list(array.shape)}")
    if array.size and (array.min() < 0 or array.max() > _INT32_MAX):
        raise SamplingRequestError(field, f"{where} must hold token ids in [0, 2**31), got {int(array.min())}")
    return array.astype(np.int32)


def _per_request(value, count: int, field: str) -> list:
    """One value for every request, or a sequence with one per request."""
    if isinstance(value, (SamplingParams, int, np.integer)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise SamplingRequestError(field, f"{field} must be one value or {count} of them (one per prompt)")
    return values


class _Job:
    """One prompt's request in a call: its wire inputs, and the outputs received for it so far.
    `receipts` holds its parameters (one row) when the call asked for receipts, else None."""

    def __init__(
        self,
        index: int,
        inputs: dict,
        stream: bool,
        seeded: bool,
        outputs: tuple[str, ...] | None,
        receipts: RowParams | None = None,
        timings: bool = False,
    ):
        self.index, self.inputs, self.stream, self.seeded, self.outputs = index, inputs, stream, seeded, outputs
        self.receipts = receipts
        # asked for by return_timings, or by naming the timing outputs
        self.timings = timings or (outputs is not None and all(spec.name in outputs for spec in TIMING_OUTPUTS))
        self.parts: list[dict] = []
        # streamed tokens handed to the caller, over every try: their count, and a seeded
        # request's ids as received (one array per chunk, read back only when a retry replays them)
        self.yielded = 0
        self._yielded_ids: list[np.ndarray] = []
        self._replayed_ids: list[int] = []  # on a retried stream: the ids its first tokens must repeat
        self.resume_at = 0  # on a retried stream: tokens of this try that were already yielded
        self.position = 0
        self._held: dict = {}  # this try's shared outputs' latest values (outputs.expand_shared)

    def wire(self, request_id: str) -> WireRequest:
        return WireRequest(request_id, self.stream, self.inputs, self.outputs)

    def retry(self, error: GenerateError) -> None:
        """Prepare another try: a streamed request resumes after what it yielded, when seeded."""
        self.parts.clear()
        if self.yielded and not self.seeded:
            raise GenerateError(
                error.status,
                f"{error.message} (after {self.yielded} streamed tokens; an unseeded request "
                "cannot resume on another try)",
                self.index,
            ) from None
        self.resume_at, self.position = self.yielded, 0
        self._held.clear()
        self._replayed_ids = np.concatenate(self._yielded_ids).tolist() if self._yielded_ids else []

    def accept(self, outputs: dict) -> GenerateResult | None:
        """Take one response (the transports' outputs, only those asked for); a streamed request
        returns the chunk to yield (None when a retried try is still replaying tokens already yielded)."""
        ids = outputs["output_ids"]
        if ids is not None:  # the shared outputs, sent compactly, one per token again
            for name in SHARED_TOKEN_OUTPUT_NAMES:
                outputs[name], self._held[name] = expand_shared(outputs.get(name), len(ids), self._held.get(name))
        if self.stream and self.resume_at and ids is not None:
            skip = min(max(self.resume_at - self.position, 0), len(ids))
            replayed = ids[:skip].tolist()
            expected = self._replayed_ids[self.position : self.position + skip]
            if replayed != expected:
                raise GenerateError(  # final: no replica failure, so never retried again
                    "StatusCode.ABORTED",
                    f"a retried seeded stream diverged from its first try: {replayed} != {expected}",
                    self.index,
                )
            self.position += len(ids)
            if skip == len(ids) and not outputs[FINISH_REASON.name]:
                return None
            outputs = {name: (v[skip:] if isinstance(v, np.ndarray) else v) for name, v in outputs.items()}
            ids = outputs["output_ids"]
        if not self.stream:
            self.parts.append(outputs)
            return None
        first_step = self.yielded  # the tokens streamed before this chunk, over every try
        if ids is not None:
            if self.seeded:  # only a seeded stream resumes on another try
                self._yielded_ids.append(ids)  # the transport's array: the chunk holds its own copy
            self.yielded += len(ids)
        return self._result([outputs], first_step, self.yielded)

    def result(self) -> GenerateResult | None:
        """The whole result (None for a streamed request: its chunks were handed out)."""
        if self.stream:
            return None
        return self._result(self.parts, 0, sum(len(p["output_ids"]) for p in self.parts if p["output_ids"] is not None))

    def _result(self, parts: list[dict], first_step: int, tokens: int) -> GenerateResult:
        """A result from responses in order, the first of its tokens drawn at `first_step` and
        `tokens` generated by the request so far, with the receipts and timings the call asked for."""
        result = _result(self.index, parts)
        if self.receipts is not None and result.sampling_seed is not None:
            rows = self.receipts.take(np.zeros(len(result.sampling_seed), np.int64))
            result.receipts = SamplingReceipts.served(result.sampling_seed, rows, first_step)
        if self.timings and parts and parts[-1].get(QUEUE_TIME.name) is not None:  # on a request's last response
            result.timings = RequestTimings.from_outputs(parts[-1], tokens)
        return result


# Each sampled output: its name, dtype, and whether its -inf padding travels as WIRE_NEG_INF.
_SAMPLED = tuple((spec.name, np.dtype(spec.dtype), spec.name in NEG_INF_FILLED) for spec in SAMPLED_OUTPUTS)


def _result(index: int, parts: list[dict]) -> GenerateResult:
    """A result from one request's responses in order: own copies (the wire buffers are read-only),
    made once per output (a streamed chunk's one response copied, several concatenated), with
    the padding sent as WIRE_NEG_INF back to -inf."""
    arrays = {}
    if len(parts) == 1:  # a streamed chunk, or a whole result in one response
        part = parts[0]
        for name, dtype, neg_inf_filled in _SAMPLED:
            value = part.get(name)
            if value is not None:
                value = np.array(value, dtype)
                if neg_inf_filled:
                    value[value <= WIRE_NEG_INF] = -np.inf
            arrays[name] = value
        version = part.get(WEIGHT_VERSION.name)
        if version is not None and version.base is not None:  # a view (a replayed chunk's rest)
            version = version.copy()
    else:
        for name, dtype, neg_inf_filled in _SAMPLED:
            values = [p.get(name) for p in parts]
            value = None if any(v is None for v in values) else np.concatenate(values).astype(dtype, copy=False)
            if neg_inf_filled and value is not None:
                value[value <= WIRE_NEG_INF] = -np.inf
            arrays[name] = value
        versions = [p.get(WEIGHT_VERSION.name) for p in parts]
        version = None if not parts or any(v is None for v in versions) else np.concatenate(versions)
    finish = parts[-1][FINISH_REASON.name] if parts else ""
    return GenerateResult(**arrays, finish_reason=finish, index=index, weight_version=version)


class _Call:
    """One generate/stream call: its requests run concurrently, on one gRPC stream per replica."""

    def __init__(self, client: AsyncGenerateClient):
        self.client = client
        self._streams: dict[int, object] = {}  # id(connection) -> GrpcStream
        self._ids = itertools.count()

    def request_id(self, job: _Job) -> str:
        return f"{job.index}.{next(self._ids)}"  # unique per try: a stale answer never matches

    async def exchange(self, connection, job: _Job, take) -> None:
        """One try of `job` on `connection`: each response's outputs handed to `take` as they
        come, to the last (raises GenerateError)."""
        request = job.wire(self.request_id(job))
        if isinstance(connection, HttpConnection):
            async for outputs in connection.exchange(request, self.client._limits.policy.mask_width):
                take(outputs)
            return
        stream = self._streams.get(id(connection))
        if stream is None or stream.ended is not None:
            stream = self._streams[id(connection)] = connection.open_stream()
        await stream.receive(request, take)

    async def run(self, jobs: list[_Job], deliver=None, return_exceptions: bool = False) -> list:
        tasks = [asyncio.ensure_future(self.client._run_job(self, job, deliver)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self, cancel: bool) -> None:
        """End the call's streams; `cancel` stops the requests still running on the server."""
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close(cancel) for s in streams), return_exceptions=True)


_CLIENT_ARGS_DOC = """
    `url` is one "host:port" (gRPC 8001, HTTP 8000) or a list of replicas serving the same model
    repository, balanced, ejected and probed back in as SamplerClient does (`max_attempts`,
    `eject_backoff_s`, `max_eject_backoff_s`; see its docstring). `max_in_flight` bounds the
    requests on the wire over the whole client (default 64 per replica, a front door route's capacity); the others wait in the
    client. A refusal that says the server is busy is retried after `backoff_s` doubling up to
    `max_backoff_s` (each pause jittered), until `busy_timeout_s` has passed since the request's
    first refusal. `mask_width` skips reading W from the model config. `channel_options` go to
    each gRPC channel. `admin_key` is sent with the weight operations (update_weights_from_*,
    pause_generation, continue_generation), which every replica gets, each answering for itself.
    `api_key` goes with every request as `Authorization: Bearer`: a front door's client key (its
    keyed clients wait for capacity where others are refused, docs/api.md)."""


class AsyncGenerateClient(ReplicatedClient):
    """asyncio client for the generate model over gRPC streams (default) or HTTP /generate."""

    __doc__ += _CLIENT_ARGS_DOC

    def __init__(
        self,
        url: str | Sequence[str],
        protocol: str = "grpc",
        model_name: str = DEFAULT_MODEL,
        *,
        mask_width: int | None = None,
        max_in_flight: int | None = None,
        max_attempts: int | None = None,
        backoff_s: float = DEFAULT_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        eject_backoff_s: float = DEFAULT_EJECT_BACKOFF_S,
        max_eject_backoff_s: float = DEFAULT_MAX_EJECT_BACKOFF_S,
        channel_options: Sequence[tuple] = (),
        admin_key: str | None = None,
        api_key: str | None = None,
    ):
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        self.protocol, self.model_name = protocol, model_name
        urls = split_urls(url)
        self.max_in_flight = max_in_flight or DEFAULT_MAX_IN_FLIGHT_PER_REPLICA * len(urls)
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        busy_policy = BusyPolicy(backoff_s, max_backoff_s, busy_timeout_s)
        self._mask_width = mask_width
        self._limits: GenerateLimits | None = None
        self._channel_options = tuple(channel_options)
        self._admin_key, self._api_key = admin_key, api_key
        self._init_replicas(urls, self._connect, max_attempts, eject_backoff_s, max_eject_backoff_s, busy_policy)
        self._in_flight = asyncio.Semaphore(self.max_in_flight)

    def _connect(self, url: str):
        if self.protocol == "grpc":
            return GrpcConnection(url, self.model_name, self._channel_options, self._api_key)
        return HttpConnection(url, self.model_name, self.max_in_flight, self._api_key)

    async def server_limits(self) -> GenerateLimits:
        """The deployment's mask rules, read once from the model config."""
        if self._limits is None:
            config = {}
            if self._mask_width is None:
                config = await self._on_a_replica(lambda connection: connection.model_config())
            self._limits = _limits_from_config(config, self._mask_width)
        return self._limits

    async def generate(
        self,
        prompts: Sequence,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        max_new_tokens: int | Sequence[int] = 16,
        *,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        outputs: Sequence[str] | None = None,
        return_receipts: bool = False,
        return_timings: bool = False,
        return_exceptions: bool = False,
    ) -> list:
        """Generate a continuation of every prompt (token ids; one SamplingParams for all or one
        per prompt, the same for `max_new_tokens`); one GenerateResult per prompt, in order.
        `stop_token_ids` end every request (the token is kept), `ignore_eos` skips the LM's EOS,
        `outputs` names the outputs to receive (default every one). `return_receipts`: each result
        carries its tokens' receipts (`result.receipts`, from the `sampling_seed` output);
        `return_timings`: each request's timings (`result.timings`, a RequestTimings, from its
        timing outputs); either adds its outputs to `outputs` when that is given. The first failed
        request raises its GenerateError and cancels the others, unless `return_exceptions`, which
        puts the error in its place instead."""
        jobs = await self._jobs(**{name: value for name, value in locals().items() if name in _JOB_ARGUMENTS})
        return await self._tracked(self._call(jobs, None, return_exceptions))

    def stream(self, prompts: Sequence, *args, **kwargs) -> AsyncGenerateStream:
        """As `generate` (its arguments but `return_exceptions`), streamed: an async iterator of
        GenerateResult chunks (a token each, `index` saying whose, `finish_reason` set on a
        request's last) in arrival order. Every request's last chunk carries its finish reason: a
        stream the server or a proxy ends before it is a cut, retried on another replica like any
        replica failure (a seeded request resumes after what it yielded) or raised, never a short
        result. Use it as `async with`: leaving it early cancels the requests still running."""
        request = _STREAM_SIGNATURE.bind(self, prompts, *args, **kwargs)  # a TypeError here, not at first chunk
        request.apply_defaults()
        del request.arguments["self"]
        arguments = request.arguments
        return AsyncGenerateStream(self._stream_chunks(arguments), functools.partial(self._stream_into, arguments))

    async def _stream_into(self, request: dict, deliver) -> None:
        """A streamed call run to its end, each chunk handed to `deliver` as it arrives (raises
        the call's error): GenerateStream's path, no queue on the loop between them."""
        jobs = await self._jobs(**request, stream=True)
        await self._tracked(self._call(jobs, deliver, False))

    async def _stream_chunks(self, request: dict):
        jobs = await self._jobs(**request, stream=True)
        chunks: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run():
            try:
                await self._call(jobs, chunks.put_nowait, False)
            finally:
                chunks.put_nowait(done)

        runner = asyncio.ensure_future(self._tracked(run()))
        try:
            while (chunk := await chunks.get()) is not done:
                yield chunk
            await runner  # raises the call's error, if any
        finally:
            if not runner.done():
                runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    async def _tracked(self, coroutine):
        """Run a call as a task `close` can cancel."""
        task = asyncio.ensure_future(coroutine)
        self._calls.add(task)
        try:
            return await task
        finally:
            self._calls.discard(task)

    async def _call(self, jobs: list[_Job], deliver, return_exceptions: bool) -> list:
        call = _Call(self)
        finished = False
        try:
            results = await call.run(jobs, deliver, return_exceptions)
            finished = True
            return results
        finally:
            await call.close(cancel=not finished)

    async def _jobs(
        self,
        prompts,
        params,
        max_new_tokens,
        stop_token_ids,
        ignore_eos,
        outputs,
        return_receipts,
        return_timings,
        stream=False,
    ) -> list[_Job]:
        """Every request of a call, checked with the server's rules before anything is sent."""
        prompts = list(prompts)
        if not prompts:
            raise SamplingRequestError("input_ids", "prompts must hold at least one prompt")
        ids = [_int_list(p, "input_ids", i) for i, p in enumerate(prompts)]
        for i, prompt in enumerate(ids):
            if prompt.size == 0:
                raise SamplingRequestError("input_ids", f"input_ids[{i}] must hold at least one token id")
        budgets = [int(b) for b in _per_request(max_new_tokens, len(ids), "max_new_tokens")]
        if any(not 0 <= b <= _INT32_MAX for b in budgets):
            raise SamplingRequestError("max_new_tokens", f"max_new_tokens must be >= 0, got {min(budgets)}")
        row_params = _per_request(params, len(ids), "params")
        if not all(isinstance(p, SamplingParams) for p in row_params):
            raise SamplingRequestError("params", "params must be one SamplingParams or one per prompt")
        rows = rows_to_params(row_params)
        stops = _int_list(list(stop_token_ids), "stop_token_ids")
        wanted = None
        if outputs is not None:
            wanted = tuple(outputs)
            unknown = [name for name in wanted if name not in BY_NAME or name == CONTROL_RESULT.name]
            if unknown:
                raise ValueError(f"unknown outputs {unknown}; the generate model sends {sorted(BY_NAME)}")
            receipts = [SAMPLING_SEED.name] if return_receipts else []
            timings = [spec.name for spec in TIMING_OUTPUTS] if return_timings else []
            wanted = tuple(dict.fromkeys((*wanted, FINISH_REASON.name, "output_ids", *receipts, *timings)))
        limits = await self.server_limits()
        if rows.return_sampling_mask.any():
            check_rows_like_server(rows, None, limits.policy)
        return [
            _Job(
                i,
                _wire_inputs(prompt, budget, rows, i, stops, ignore_eos, stream),
                stream,
                bool(rows.has_seed[i]),
                wanted,
                rows.take(np.array([i])) if return_receipts else None,
                return_timings,
            )
            for i, (prompt, budget) in enumerate(zip(ids, budgets))
        ]

    async def _run_job(self, call: _Call, job: _Job, deliver):
        """One request to its end: busy refusals retried after a backoff, failed replicas left."""

        def take(outputs: dict) -> None:
            chunk = job.accept(outputs)
            if chunk is not None:
                deliver(chunk)

        async with self._in_flight:
            attempts = self._attempts()
            while True:
                lease = attempts.next_lease()
                if lease is None:  # every replica failed this round: pause, then try them all again
                    await asyncio.sleep(attempts.pause_s())
                    continue
                try:
                    await call.exchange(lease[1], job, take)
                except GenerateError as error:
                    error.index = job.index
                    pause = attempts.failed(lease, error)  # raises unless a retry is due
                    job.retry(error)
                    if pause:
                        await asyncio.sleep(pause)
                    continue
                except BaseException as exc:  # cancelled, or a bug: released, raised as it is
                    attempts.failed(lease, exc)
                return attempts.served(lease, job.result(), served=True)

    @staticmethod
    def _server_error(exc: BaseException) -> GenerateError | None:
        return exc if isinstance(exc, GenerateError) else None

    async def _probe(self, replica) -> None:
        """Whether the replica's server and model are ready, on a short-lived connection."""
        connection = self._connect(replica.url)
        try:
            ready = await asyncio.wait_for(connection.ready(_PROBE_TIMEOUT_S), 2 * _PROBE_TIMEOUT_S)
        except Exception:  # unreachable, or any answer but ready
            ready = False
        finally:
            await connection.close()
        self._replicas.probed(replica, ready)

    # Weight operations: one control request to every replica (serving.weight_control), each
    # replica's answer by URL: {"weight_version", "paused", ...}.

    async def _control(self, commands: dict | Sequence[dict], admin_key: str | None) -> dict[str, dict]:
        commands = [commands] * len(self.urls) if isinstance(commands, dict) else list(commands)
        key = admin_key if admin_key is not None else self._admin_key
        return await on_every_replica(self._connect, self.urls, commands, key)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        pause_mode: str = "in_place",
        admin_key: str | None = None,
    ) -> dict[str, dict]:
        """Load the Hugging Face checkpoint `model_path` (a directory relative to the servers'
        weights root) into every replica's running LM, in place; tokens sampled after it carry
        `weight_version` (default: the update's count). `pause_mode`: "abort" (requests in flight
        end with a retryable error and are resent), "finish" (they finish on the old weights
        first) or "in_place" (they go on, on the new weights). A refused checkpoint raises
        GenerateError naming the replica and the first bad tensor; the old weights keep serving."""
        command = {
            "op": "update_weights_from_disk",
            "model_path": model_path,
            "pause_mode": check_pause_mode(pause_mode),
        }
        return await self._control(_versioned(command, weight_version), admin_key)

    async def update_weights_from_tensor(
        self,
        tensors: dict,
        *,
        weight_version: str | None = None,
        pause_mode: str = "in_place",
        admin_key: str | None = None,
    ) -> dict[str, dict]:
        """Copy named tensors (torch or numpy; some or all of the LM's weights, named as in its
        state dict) into every replica on this host, through one shared-memory region (removed
        afterwards); as update_weights_from_disk otherwise."""
        check_pause_mode(pause_mode)
        with SharedTensors(tensors) as shared:
            command = {
                "op": "update_weights_from_tensor",
                "shm_name": shared.name,
                "tensors": shared.manifest,
                "pause_mode": pause_mode,
            }
            return await self._control(_versioned(command, weight_version), admin_key)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        admin_key: str | None = None,
    ) -> dict[str, dict]:
        """Have replica i join a torch.distributed process group as rank `rank_offset + i` (the
        trainer is rank 0, `generation.weight_transfer.open_process_group`); returns once every
        rank has joined, so the trainer opens its end meanwhile (another thread or task)."""
        commands = [
            {
                "op": "init_weights_update_group",
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offset) + i,
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            for i in range(len(self.urls))
        ]
        return await self._control(commands, admin_key)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        weight_version: str | None = None,
        pause_mode: str = "in_place",
        admin_key: str | None = None,
    ) -> dict[str, dict]:
        """Receive these tensors (torch dtype names, e.g. "float32") from the trainer's rank 0 over
        the weights update group, in this order, and copy them in once all are checked; the
        trainer broadcasts them meanwhile (`weight_transfer.broadcast_tensors`)."""
        manifest = [
            {"name": name, "dtype": dtype, "shape": list(shape)} for name, dtype, shape in zip(names, dtypes, shapes)
        ]
        command = {
            "op": "update_weights_from_distributed",
            "tensors": manifest,
            "pause_mode": check_pause_mode(pause_mode),
        }
        return await self._control(_versioned(command, weight_version), admin_key)

    async def destroy_weights_update_group(self, *, admin_key: str | None = None) -> dict[str, dict]:
        """Leave the weights update group on every replica."""
        return await self._control({"op": "destroy_weights_update_group"}, admin_key)

    async def pause_generation(self, mode: str = "abort", *, admin_key: str | None = None) -> dict[str, dict]:
        """Hold every replica's generation between two steps (requests in flight treated as `mode`
        says, as for an update); new requests wait until continue_generation."""
        return await self._control({"op": "pause_generation", "mode": check_pause_mode(mode, "mode")}, admin_key)

    async def continue_generation(self, *, admin_key: str | None = None) -> dict[str, dict]:
        """Let every paused replica generate again."""
        return await self._control({"op": "continue_generation"}, admin_key)

    async def get_weight_version(self) -> dict[str, str]:
        """Each replica's weight version, by URL (no admin key needed)."""
        answers = await self._control({"op": "get_weight_version"}, None)
        return {url: answer["weight_version"] for url, answer in answers.items()}


# stream takes generate's arguments, but return_exceptions: one signature for both (shown by help()).
_STREAM_SIGNATURE = inspect.signature(AsyncGenerateClient.generate).replace(return_annotation="AsyncGenerateStream")
_STREAM_SIGNATURE = _STREAM_SIGNATURE.replace(
    parameters=[p for p in _STREAM_SIGNATURE.parameters.values() if p.name != "return_exceptions"]
)
AsyncGenerateClient.stream.__signature__ = _STREAM_SIGNATURE


def _versioned(command: dict, weight_version: str | None) -> dict:
    return command if weight_version is None else {**command, "weight_version": str(weight_version)}


def _wire_inputs(prompt, budget: int, rows: RowParams, row: int, stops, ignore_eos: bool, stream: bool) -> dict:
    """One request's inputs as (array [1, ...], Triton datatype); defaults left to the server."""
    values = {INPUT_IDS.name: prompt, MAX_NEW_TOKENS.name: budget}
    if stops.size:
        values[STOP_TOKEN_IDS.name] = stops
    if ignore_eos:
        values[IGNORE_EOS.name] = True
    if stream:
        values[STREAM.name] = True
    for spec in PARAM_SPECS:
        if spec.presence is None or getattr(rows, spec.presence)[row]:
            values[spec.name] = getattr(rows, spec.name)[row]
    return generate_wire_inputs(values)


class AsyncGenerateStream:
    """The chunks of a streamed call (an async iterator); `aclose` (or leaving `async with`)
    cancels its requests still running."""

    def __init__(self, chunks, deliver_to=None):
        self._chunks = chunks
        # `deliver_to(callback)` runs the same call handing each chunk to `callback` instead
        # (GenerateStream's path); None: GenerateStream iterates this stream
        self._deliver_to = deliver_to

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> GenerateResult:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class GenerateClient(LoopClient):
    """Synchronous client for the generate model: an AsyncGenerateClient run on an event loop of
    its own (a daemon thread), safe to call from several threads.
    """

    __doc__ += _CLIENT_ARGS_DOC

    def __init__(self, url: str | Sequence[str], protocol: str = "grpc", model_name: str = DEFAULT_MODEL, **kwargs):
        self._client = AsyncGenerateClient(url, protocol, model_name, **kwargs)
        self._loop = LoopThread("generate-client")
        self._run = self._loop.run  # an interrupted wait cancels the call and its requests
        self.protocol, self.model_name, self.urls = protocol, model_name, self._client.urls

    def server_limits(self) -> GenerateLimits:
        """The deployment's mask rules, read once from the model config."""
        return self._run(self._client.server_limits())

    def generate(self, prompts: Sequence, *args, **kwargs) -> list:
        """As AsyncGenerateClient.generate (same arguments), waited for."""
        return self._run(self._client.generate(prompts, *args, **kwargs))

    def submit(self, prompts: Sequence, *args, **kwargs) -> concurrent.futures.Future:
        """`generate` without waiting: a Future of its results; `Future.cancel()` cancels the
        call's requests on the server."""
        return self._loop.submit(self._client.generate(prompts, *args, **kwargs))

    def stream(self, prompts: Sequence, *args, **kwargs) -> GenerateStream:
        """As AsyncGenerateClient.stream: an iterator of chunks; use it as `with` (leaving it
        early cancels the requests still running)."""
        return GenerateStream(self, self._client.stream(prompts, *args, **kwargs))

    def update_weights_from_disk(self, model_path: str, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.update_weights_from_disk, waited for."""
        return self._run(self._client.update_weights_from_disk(model_path, **kwargs))

    def update_weights_from_tensor(self, tensors: dict, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.update_weights_from_tensor, waited for."""
        return self._run(self._client.update_weights_from_tensor(tensors, **kwargs))

    def init_weights_update_group(self, *args, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.init_weights_update_group, waited for (call it from another
        thread than the one that opens the trainer's end of the group)."""
        return self._run(self._client.init_weights_update_group(*args, **kwargs))

    def update_weights_from_distributed(self, *args, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.update_weights_from_distributed, waited for (the trainer
        broadcasts from another thread meanwhile)."""
        return self._run(self._client.update_weights_from_distributed(*args, **kwargs))

    def destroy_weights_update_group(self, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.destroy_weights_update_group, waited for."""
        return self._run(self._client.destroy_weights_update_group(**kwargs))

    def pause_generation(self, mode: str = "abort", **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.pause_generation, waited for."""
        return self._run(self._client.pause_generation(mode, **kwargs))

    def continue_generation(self, **kwargs) -> dict[str, dict]:
        """As AsyncGenerateClient.continue_generation, waited for."""
        return self._run(self._client.continue_generation(**kwargs))

    def get_weight_version(self) -> dict[str, str]:
        """Each replica's weight version, by URL."""
        return self._run(self._client.get_weight_version())


class _Ended:
    """What a GenerateStream receives after its last chunk: the call's error (None when it ended well)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None):
        self.error = error


async def _deliver(chunks: AsyncGenerateStream, arrived: queue.SimpleQueue) -> None:
    """Run a streamed call on the loop, its chunks put in `arrived` as they come, then an _Ended.
    A cancelled call ends with concurrent.futures' CancelledError, as a cancelled wait for a
    chunk raised it."""
    ended = _Ended(concurrent.futures.CancelledError())
    try:
        if chunks._deliver_to is not None:
            await chunks._deliver_to(arrived.put)
        else:
            async for chunk in chunks:
                arrived.put(chunk)
        ended = _Ended(None)
    except Exception as error:
        ended = _Ended(error)
    finally:
        arrived.put(ended)


class GenerateStream:
    """The chunks of a streamed call (an iterator); `close` (or leaving `with`) cancels its
    requests still running. Its first chunk asked for starts the call on the client's loop,
    which hands each chunk over through a thread-safe queue (one hop per chunk, not a coroutine
    run per chunk); an interrupted wait, or dropping the stream unclosed, cancels the call."""

    def __init__(self, client: GenerateClient, chunks: AsyncGenerateStream):
        self._client, self._chunks = client, chunks
        self._arrived: queue.SimpleQueue | None = None  # from the first chunk asked for to the end
        self._task: asyncio.Task | None = None  # the call's, on the loop
        self._ended = False

    def __iter__(self) -> Iterator[GenerateResult]:
        return self

    def __next__(self) -> GenerateResult:
        arrived = self._arrived
        if arrived is None:
            if self._ended:
                raise StopIteration
            arrived = self._start()
        try:
            item = arrived.get()
        except BaseException:  # an interrupted wait (KeyboardInterrupt): the call is cancelled
            self._end()
            self._client._loop.call_soon(self._task.cancel)
            raise
        if type(item) is not _Ended:
            return item
        self._end()
        if item.error is None:
            raise StopIteration
        raise item.error

    def _start(self) -> queue.SimpleQueue:
        self._arrived = queue.SimpleQueue()
        self._task = self._client._run(self._begin(self._arrived))
        # dropped unclosed: cancelled, as the event loop closes an abandoned async generator
        weakref.finalize(self, self._client._loop.call_soon, self._task.cancel)
        return self._arrived

    async def _begin(self, arrived: queue.SimpleQueue) -> asyncio.Task:
        return asyncio.ensure_future(_deliver(self._chunks, arrived))

    def _end(self) -> None:
        self._ended, self._arrived = True, None

    def close(self) -> None:
        self._end()
        self._client._run(self._close())

    async def _close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._chunks.aclose()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# What generate hands its requests' builder: its own arguments of that name.
_JOB_ARGUMENTS = frozenset(inspect.signature(AsyncGenerateClient._jobs).parameters) - {"self"}
