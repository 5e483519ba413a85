"""The `generate` model's wire, asyncio only: one connection per replica (gRPC or HTTP), the
requests of one client call on it, and their responses as dicts of numpy outputs.

Over gRPC every call opens one bidirectional `ModelStreamInfer` stream per replica it uses; its
requests go out on that stream as they come and each response is routed to its request by id.
Cancelling the stream cancels every request on it on the server (Triton offers no per-request
cancellation on a shared stream). tritonclient's own stream iterator drops the request id and the
final flag of an error response, so the stream is driven through tritonclient's generated gRPC
stubs and responses are read with its tensor decoders. Over HTTP each request is one POST to
`/generate` (or `/generate_stream`, Server-Sent Events, when streamed).

Both connections yield a request's responses as dicts holding every output name (None for one
not sent or not asked for): the sampled outputs as arrays of the values as sent, without the batch
dimension (read-only views of a gRPC response's buffers, WIRE_NEG_INF padding as on the wire; the
client makes its own copies once, `generate_client`), the weight versions as str arrays, the
finish reason as str, a control result parsed and the timings as floats.

Every failure surfaces as `GenerateError`: `status` as tritonclient spells it ("400" over HTTP,
"StatusCode.UNAVAILABLE" for a gRPC stream that failed), `IN_BAND` for an error a gRPC stream
carried for one request (Triton sends its message, not its code), None when the server could not
be reached. A request's last response carries its finish reason; responses that end without one
(a final flag on an empty response, an HTTP stream closed cleanly by a proxy in between) are a
cut, never a short result: `cut()` raises it as a failure of the replica, so the client retries.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from ..sampling.inputs import INPUTS_BY_NAME, LIST
from ..sampling.outputs import (
    CONTROL_RESULT,
    FINISH_REASON,
    MASK,
    OUTPUT_IDS,
    SAMPLED_OUTPUT_NAMES,
    SAMPLED_OUTPUTS,
    TIMING_OUTPUTS,
    WEIGHT_VERSION,
)
from ..sampling.refusals import is_busy
from .sampler_client import SamplerError

IN_BAND = "in-band"
# tritonclient's own cap on a gRPC message (INT32_MAX): a long generation's masks are large.
_MAX_GRPC_MESSAGE_BYTES = 2**31 - 1
_FINAL = "triton_final_response"


class GenerateError(SamplerError):
    """The server refused or failed a generation request (see SamplerError for `status` and
    `message`); `index` is the request's position in the call's prompts."""

    def __init__(self, status: str | None, message: str, index: int | None = None):
        super().__init__(status, message)
        self.index = index

    @property
    def busy(self) -> bool:
        """Whether the server said it cannot take the request now (so a later try may succeed)."""
        return is_busy(self.message)

    def copy(self, index: int | None = None) -> GenerateError:
        """The same error for the request at `index`."""
        return GenerateError(self.status, self.message, index)


def unreachable(exc: BaseException) -> GenerateError:
    """A transport failure: no answer from the server."""
    return GenerateError(None, f"could not reach the server: {type(exc).__name__}: {exc}")


def cut(status: str | None) -> GenerateError:
    """A request whose responses ended before its last one (no finish reason): the server or a
    proxy stopped answering it, so another try (or replica) is due."""
    return GenerateError(status, "the server ended the request before its last token (no finish reason): a cut stream")


@dataclass
class WireRequest:
    """One try of one request: its id, whether it streams, and its inputs as [1, ...] arrays."""

    request_id: str
    stream: bool
    inputs: dict[str, tuple[np.ndarray, str]]  # name -> (array with the batch dimension 1, Triton datatype)
    outputs: tuple[str, ...] | None  # output names to ask for (None: every one)
    parameters: dict[str, str] = field(default_factory=dict)  # request parameters (the admin key)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GrpcConnection:
    """One replica over gRPC: a channel, made on first use inside the running event loop."""

    def __init__(self, url: str, model_name: str, channel_options: tuple = (), api_key: str | None = None):
        self.url, self.model_name = url, model_name
        # the client key every call carries (the front door's keyed clients: docs/api.md)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._options = (
            ("grpc.max_send_message_length", _MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_GRPC_MESSAGE_BYTES),
            *channel_options,
        )
        self._channel = self._stub = None

    def stub(self):
        if self._stub is None:
            import grpc
            from tritonclient.grpc import service_pb2_grpc

            self._channel = grpc.aio.insecure_channel(self.url, options=self._options)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    def open_stream(self) -> GrpcStream:
        """A new bidirectional stream for one call."""
        return GrpcStream(self.stub(), self.model_name, self.metadata)

    async def model_config(self) -> dict:
        """The model config as the JSON Triton serves over HTTP (dims as strings)."""
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2

        try:
            request = service_pb2.ModelConfigRequest(name=self.model_name)
            reply = await self.stub().ModelConfig(request, metadata=self.metadata)
        except Exception as exc:
            raise _grpc_error(exc) from None
        return json_format.MessageToDict(reply.config, preserving_proto_field_name=True)

    async def ready(self, timeout_s: float) -> bool:
        """Whether the server and the model are ready."""
        from tritonclient.grpc import service_pb2

        stub = self.stub()
        server = await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout_s, metadata=self.metadata)
        request = service_pb2.ModelReadyRequest(name=self.model_name)
        model = await stub.ModelReady(request, timeout=timeout_s, metadata=self.metadata)
        return bool(server.ready and model.ready)

    async def control(self, request: WireRequest) -> dict:
        """Send one control request on a stream of its own; its `control_result` (raises GenerateError)."""
        stream = self.open_stream()
        try:
            async for outputs in stream.exchange(request):
                if outputs[CONTROL_RESULT.name] is not None:
                    return outputs[CONTROL_RESULT.name]
            raise GenerateError(None, "the server ended the control request without an answer")
        finally:
            await stream.close(cancel=False)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def _grpc_error(exc: BaseException) -> GenerateError:
    """A gRPC call's failure (its status code and details), or a transport error."""
    code = getattr(exc, "code", None)
    if callable(code):
        return GenerateError(str(code()), exc.details() or str(code()))
    return unreachable(exc)


class GrpcStream:
    """One bidirectional stream: requests are written as they come, responses routed by request id
    to a callable of each request's, on the task that reads the stream."""

    def __init__(self, stub, model_name: str, metadata: tuple = ()):
        import asyncio

        self._asyncio, self.model_name = asyncio, model_name
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._routes: dict[str, object] = {}  # request id -> route(response or the stream's end)
        self._unanswered: set[str] = set()  # requests sent whose final response has not come
        self.ended: GenerateError | None = None
        self._call = stub.ModelStreamInfer(self._requests(), metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                route = self._routes.get(response.infer_response.id)
                if route is not None:
                    route(response)
            ended = GenerateError("StatusCode.UNAVAILABLE", "the server closed the stream")
        except self._asyncio.CancelledError:
            ended = GenerateError("StatusCode.CANCELLED", "the stream was cancelled")
        except Exception as exc:
            ended = _grpc_error(exc)
        self.ended = ended
        for route in list(self._routes.values()):
            route(ended)

    def _send(self, request: WireRequest, route) -> None:
        if self.ended is not None:
            raise self.ended.copy()
        self._routes[request.request_id] = route
        self._unanswered.add(request.request_id)
        self._outgoing.put_nowait(_infer_request(request, self.model_name))

    async def exchange(self, request: WireRequest) -> AsyncIterator[dict]:
        """Send `request`; yield its responses' outputs to its final one (raises GenerateError)."""
        route: self._asyncio.Queue = self._asyncio.Queue()
        self._send(request, route.put_nowait)
        wanted, answered = _wanted(request), functools.partial(self._unanswered.discard, request.request_id)
        try:
            while True:
                outputs, final = _response_outputs(await route.get(), wanted, answered)
                yield outputs
                if final:
                    return
        finally:
            self._routes.pop(request.request_id, None)

    async def receive(self, request: WireRequest, take) -> None:
        """Send `request`; hand its responses' outputs to `take` as they are read, to its final
        one; returns then (raises GenerateError, or what `take` raised). `exchange` without a
        task switch per response: `take` runs on the task that reads the stream."""
        done = self._asyncio.get_running_loop().create_future()
        wanted, answered = _wanted(request), functools.partial(self._unanswered.discard, request.request_id)

        def route(item) -> None:
            if done.done():  # failed already, or its waiter was cancelled
                return
            try:
                outputs, final = _response_outputs(item, wanted, answered)
                take(outputs)
            except Exception as error:
                done.set_exception(error)
                return
            if final:
                done.set_result(None)

        self._send(request, route)
        try:
            await done
        finally:
            self._routes.pop(request.request_id, None)

    async def close(self, cancel: bool) -> None:
        """End the stream: `cancel` cancels every request still on it; otherwise, or when every
        request has had its final response, it is half-closed (the server ends it once every
        request has answered). A stream is never cancelled for nothing: Triton 2.51 may keep a
        cancelled stream's responses, and with them the model, for good (its stop then times out)."""
        if cancel and self._unanswered:
            self._call.cancel()
        else:
            self._outgoing.put_nowait(None)
        await self._asyncio.gather(self._reader, return_exceptions=True)


def _wanted(request: WireRequest) -> frozenset[str] | None:
    """The outputs a request asked for (None: every one)."""
    return None if request.outputs is None else frozenset(request.outputs)


def _response_outputs(item, wanted: frozenset[str] | None, answered) -> tuple[dict, bool]:
    """One routed response's outputs and whether it is the request's final one (then `answered()`
    is called first); raises its error (the stream's end, an in-band error, or a cut: a final
    response without a finish reason)."""
    if isinstance(item, GenerateError):
        raise item.copy()
    parameters = item.infer_response.parameters
    if item.error_message:
        if parameters[_FINAL].bool_param if _FINAL in parameters else True:
            answered()
        raise GenerateError(IN_BAND, item.error_message)
    outputs = _grpc_outputs(item.infer_response, wanted)
    ended = bool(outputs[FINISH_REASON.name]) or outputs[CONTROL_RESULT.name] is not None
    final = parameters[_FINAL].bool_param if _FINAL in parameters else ended
    if final:
        answered()
    if final and not ended:  # e.g. the empty final of a request cancelled on the server
        raise cut("StatusCode.UNAVAILABLE")
    return outputs, final


def _infer_request(request: WireRequest, model_name: str):
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name=model_name, id=request.request_id)
    for name, (array, datatype) in request.inputs.items():
        tensor = message.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(array.shape)
        if datatype == "BYTES":  # length-prefixed elements, as Triton reads BYTES
            from tritonclient.utils import serialize_byte_tensor

            message.raw_input_contents.append(serialize_byte_tensor(array).item())
        else:
            message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in request.outputs or ():
        message.outputs.add().name = name
    for name, value in request.parameters.items():
        message.parameters[name].string_param = value
    return message


# Triton datatype -> numpy dtype, as tritonclient maps them: the numeric ones seen so far
_NP_DTYPES: dict[str, np.dtype] = {}


def _np_dtype(datatype: str):
    try:
        return _NP_DTYPES[datatype]
    except KeyError:
        from tritonclient.utils import triton_to_np_dtype

        dtype = triton_to_np_dtype(datatype)
        if datatype != "BYTES":
            _NP_DTYPES[datatype] = dtype
        return dtype


def _grpc_tensor(raw: bytes | None, output) -> np.ndarray:
    """One output tensor, read the way tritonclient's `InferResult.as_numpy` reads it (`raw`: its
    raw contents, None when it was sent in `contents`)."""
    datatype = output.datatype
    if raw is not None:
        if datatype == "BYTES":
            from tritonclient.utils import deserialize_bytes_tensor

            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=_np_dtype(datatype))
    elif len(output.contents.bytes_contents) != 0:
        array = np.array(output.contents.bytes_contents)
    else:
        array = np.empty(0, dtype=_np_dtype(datatype))
    return array.reshape(tuple(output.shape))


def _uniform_bytes(raw: bytes | None, count: int) -> bytes | None:
    """The value of a BYTES tensor's `count` elements (each a 4-byte little-endian length, then
    its bytes) when all of them hold the same one, else None (read them one by one then): a
    request's tokens mostly share one weight version, so this saves a Python loop per token."""
    if raw is None or count < 1 or len(raw) % count:
        return None
    width = len(raw) // count
    if width < 4 or int.from_bytes(raw[:4], "little") != width - 4:
        return None
    if count > 1 and raw != raw[:width] * count:
        return None
    return raw[4:width]


def _read_sampled(raw: bytes | None, output) -> np.ndarray:
    """A sampled output's values as sent, without the batch dimension."""
    return _grpc_tensor(raw, output)[0]


def _read_versions(raw: bytes | None, output) -> np.ndarray:
    """The weight versions (one per token) as a str array."""
    shape = output.shape
    if len(shape) and shape[0] == 1:
        count = math.prod(shape)
        value = _uniform_bytes(raw, count)
        if value is not None:
            return np.array([value.decode()] * count, dtype=object)
    return _texts(_grpc_tensor(raw, output)[0])


_EMPTY_TEXT = bytes(4)  # one BYTES element of length 0: a streamed chunk's finish reason before the last


def _read_text(raw: bytes | None, output) -> str:
    """A one-value text output (its first value)."""
    if raw == _EMPTY_TEXT and math.prod(output.shape) == 1:
        return ""
    value = _uniform_bytes(raw, math.prod(output.shape))
    if value is not None:
        return value.decode()
    return _text(_grpc_tensor(raw, output).reshape(-1)[0])


def _read_control(raw: bytes | None, output):
    return json.loads(_read_text(raw, output))


def _read_timing(raw: bytes | None, output) -> float:
    return float(_grpc_tensor(raw, output).reshape(-1)[0])


# How each output the client knows is read from a gRPC response; others are left unread.
_GRPC_READERS = {
    **{name: _read_sampled for name in SAMPLED_OUTPUT_NAMES},
    WEIGHT_VERSION.name: _read_versions,
    FINISH_REASON.name: _read_text,
    CONTROL_RESULT.name: _read_control,
    **{spec.name: _read_timing for spec in TIMING_OUTPUTS},
}
# What ends a request: read whether or not it was asked for.
_ALWAYS_READ = frozenset((FINISH_REASON.name, CONTROL_RESULT.name))
_SAMPLED_NAMES = frozenset(SAMPLED_OUTPUT_NAMES)
# A response's outputs before any is read: every name, as when it is not sent.
_NOT_SENT = {
    **{name: None for name in SAMPLED_OUTPUT_NAMES},
    WEIGHT_VERSION.name: None,
    FINISH_REASON.name: "",
    CONTROL_RESULT.name: None,
    **{spec.name: None for spec in TIMING_OUTPUTS},
}


def _grpc_outputs(infer_response, wanted: frozenset[str] | None = None) -> dict:
    """A response's outputs (the module docstring says how each is held), those in `wanted` only
    when given: the others are not read."""
    outputs = _NOT_SENT.copy()
    raw = infer_response.raw_output_contents
    sent = len(raw)
    for index, output in enumerate(infer_response.outputs):
        name = output.name
        if wanted is not None and name not in wanted and name not in _ALWAYS_READ:
            continue
        if name in _SAMPLED_NAMES and index < sent and output.datatype in _NP_DTYPES:
            # the common case inline (a streamed token's outputs): a view of the values as sent
            outputs[name] = np.frombuffer(raw[index], _NP_DTYPES[output.datatype]).reshape(output.shape)[0]
            continue
        read = _GRPC_READERS.get(name)
        if read is not None:
            outputs[name] = read(raw[index] if index < sent else None, output)
    return outputs


def _texts(values) -> np.ndarray:
    """Strings (bytes on the wire) as an object array of str."""
    return np.array([_text(v) for v in np.asarray(values).reshape(-1)], dtype=object)


class HttpConnection:
    """One replica over HTTP: an aiohttp session, made on first use inside the running event loop."""

    def __init__(self, url: str, model_name: str, max_connections: int, api_key: str | None = None):
        self.url, self.model_name, self._max_connections = url, model_name, max_connections
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    def session(self):
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    def _model_url(self, suffix: str) -> str:
        return f"http://{self.url}/v2/models/{self.model_name}/{suffix}"

    async def model_config(self) -> dict:
        """The model config (Triton's JSON)."""
        return await self._get_json(self._model_url("config"))

    async def ready(self, timeout_s: float) -> bool:
        """Whether the server and the model are ready."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for url in (f"http://{self.url}/v2/health/ready", self._model_url("ready")):
            async with self.session().get(url, timeout=timeout) as response:
                if response.status != 200:
                    return False
        return True

    async def _get_json(self, url: str) -> dict:
        try:
            async with self.session().get(url) as response:
                text = await response.text()
                if response.status != 200:
                    raise GenerateError(str(response.status), _error_message(text))
                return json.loads(text)
        except GenerateError:
            raise
        except Exception as exc:
            raise unreachable(exc) from None

    async def exchange(self, request: WireRequest, mask_width: int) -> AsyncIterator[dict]:
        """POST `request`; yield its outputs (one dict, or one per streamed token)."""
        body = _json_body(request)
        path = "generate_stream" if request.stream else "generate"
        try:
            async with self.session().post(self._model_url(path), json=body) as response:
                if response.status != 200:
                    raise GenerateError(str(response.status), _error_message(await response.text()))
                wanted = _wanted(request)
                if not request.stream:
                    yield _json_outputs(json.loads(await response.text()), mask_width, wanted)
                    return
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise GenerateError(IN_BAND, str(event["error"]))
                    outputs = _json_outputs(event, mask_width, wanted)
                    yield outputs
                    if outputs[FINISH_REASON.name]:
                        return
                raise cut(None)  # the body ended cleanly before the last token
        except GenerateError:
            raise
        except Exception as exc:  # aiohttp's ClientError, a reset connection, a broken body
            raise unreachable(exc) from None

    async def control(self, request: WireRequest) -> dict:
        """POST one control request; its `control_result` (raises GenerateError)."""
        async for outputs in self.exchange(request, mask_width=0):
            if outputs[CONTROL_RESULT.name] is not None:
                return outputs[CONTROL_RESULT.name]
        raise GenerateError(None, "the server ended the control request without an answer")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text


def _json_body(request: WireRequest) -> dict:
    """The JSON body of a generate request: each input as a list, a one-value input as a scalar."""
    body = dict(request.parameters)  # fields that are not inputs are request parameters
    for name, (array, _) in request.inputs.items():
        values = array.reshape(-1).tolist()
        values = [_text(v) for v in values] if array.dtype == object else values
        body[name] = values if INPUTS_BY_NAME[name].per == LIST else values[0]
    return body


def _json_outputs(reply: dict, mask_width: int, wanted: frozenset[str] | None = None) -> dict:
    """Outputs from a JSON reply (tensors flat, one-value ones possibly as scalars). HTTP sends
    every output: token and timing outputs not in `wanted` (when given) are not read."""
    outputs = _NOT_SENT.copy()
    ids = np.array(reply.get(OUTPUT_IDS.name, []), OUTPUT_IDS.dtype).reshape(-1)
    width = -1 if ids.size else mask_width  # the server's own W when there are rows to tell it
    for spec in SAMPLED_OUTPUTS:
        if spec.name in reply and (wanted is None or spec.name in wanted):
            array = ids if spec is OUTPUT_IDS else np.array(reply[spec.name], spec.dtype)
            outputs[spec.name] = array.reshape((ids.size, width) if spec.per == MASK else (-1,))
    versions = reply.get(WEIGHT_VERSION.name)
    if versions is not None and (wanted is None or WEIGHT_VERSION.name in wanted):
        outputs[WEIGHT_VERSION.name] = _texts(versions if isinstance(versions, list) else [versions])
    finish = reply.get(FINISH_REASON.name, "")
    outputs[FINISH_REASON.name] = _text(finish[0] if isinstance(finish, list) else finish)
    control = reply.get(CONTROL_RESULT.name)
    if isinstance(control, list):
        control = control[0]
    outputs[CONTROL_RESULT.name] = None if control is None else json.loads(_text(control))
    for spec in TIMING_OUTPUTS:  # a request's last response only
        value = reply.get(spec.name)
        if value is not None and (wanted is None or spec.name in wanted):
            outputs[spec.name] = float(np.asarray(value).reshape(-1)[0])
    return outputs
