"""The FastAPI application and the process: routes, the API key, the body limit, every error in
OpenAI's shape, Server-Sent Events, and `main` (uvicorn, SIGTERM drains requests in flight).

Routes: GET /health (200 while the generate model is ready, else 503), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions, POST /generate, POST /inference/v1/generate
(vLLM's token route), SGLang's weight routes (weight_routes) and worker routes (info_routes:
server and model info, flush_cache, the aborts). With an API key every route but /health needs
`Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..client.generate_transport import GrpcConnection
from .config import ApiConfig, build_parser, config_from_args, forwarded_allow_ips
from .encoding import JsonBody, sse_event
from .errors import ApiError, bad_request, from_validation_error
from .field_table import CHAT, COMPLETIONS, GENERATE, TOKENS, accept
from .in_flight import InFlight
from .info_routes import add_info_routes
from .openai_routes import OPENAI_NAMES, CompletionStream, OpenAIHandlers
from .schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest, TokenGenerateRequest
from .service import ApiService
from .sglang_routes import SGLANG_NAMES, GenerateHandler, SequenceSoFar
from .token_route import TOKEN_NAMES, TokenHandler
from .weight_access import WeightAccess
from .weight_routes import add_weight_routes
from .worker_state import server_ready

logger = logging.getLogger("triton_sampling_mask.api")
_HEALTH_TIMEOUT_S = 2.0
# How long an idle client connection is kept (uvicorn's default is 5 s): a client whose pooled
# connection the server closed just as it sent a request on it sees a connection error, which a
# trainer pausing between rollout batches (or the gRPC half of bench/api_cost.py) meets at 5 s.
_KEEP_ALIVE_S = 75
_OPEN_PATHS = ("/health",)


async def _body(request: Request, model: type[BaseModel], limit: int, route: str) -> BaseModel:
    """The request body parsed into `model` as `route`'s upstream parses it: the route's neutral and
    ignored fields checked and taken out first (field_table), a 400 naming each problem, 413 past
    `limit`."""
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"the body is {len(raw)} bytes; at most {limit} are accepted", None, code="body_too_large")
    try:
        data = from_json(raw)
    except ValueError as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(accept(route, data))
    except ValidationError as error:
        raise from_validation_error(error) from None


class KeyAndBodyLimit:
    """ASGI middleware (no task per request, streams untouched): the Bearer key on every route
    but /health, and a body whose Content-Length is over the limit refused before it is read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return ApiError(413, f"the body is {length} bytes; at most {self.max_body_bytes} are accepted")
        if self.api_key and scope["path"] not in _OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return ApiError(
                    401,
                    "a valid API key is required: Authorization: Bearer <key>",
                    None,
                    "authentication_error",
                    "invalid_api_key",
                )
        return None


def create_app(config: ApiConfig, service: ApiService | None = None) -> FastAPI:
    """The application serving `config` (a prepared `service` may be passed, e.g. by tests)."""
    service = service or ApiService(config)
    openai = OpenAIHandlers(service)
    sglang = GenerateHandler(service)
    tokens = TokenHandler(service)
    in_flight = InFlight()

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await service.close()

    app = FastAPI(title="triton-sampling-mask API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service

    app.add_middleware(KeyAndBodyLimit, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError):
        return ApiError(400, str(error.errors()[:3])).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        return ApiError(
            error.status_code, str(error.detail), None, code="not_found" if error.status_code == 404 else None
        ).response()

    @app.exception_handler(Exception)
    async def unexpected(_request, error: Exception):
        logger.exception("unexpected error")
        return ApiError(500, f"internal error: {type(error).__name__}", None, "internal_error").response()

    access = WeightAccess(config.api_key, config.admin_key, config.trusted_networks)
    add_weight_routes(app, config.triton_url, config.triton_model, access, config.max_body_bytes)
    add_info_routes(app, service, in_flight)

    @app.get("/health")
    async def health():
        connection = GrpcConnection(config.triton_url, config.triton_model)
        try:
            ready = await asyncio.wait_for(connection.ready(_HEALTH_TIMEOUT_S), 2 * _HEALTH_TIMEOUT_S)
        except Exception:
            ready = False
        finally:
            await connection.close()
        if not ready:
            return ApiError(
                503, "the generate model is not ready", None, "service_unavailable", retry_after_s=1
            ).response()
        served, why = await server_ready(config)
        if not served:
            return ApiError(
                503, f"the server is not ready: {why}", None, "service_unavailable", retry_after_s=1
            ).response()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return openai.models()

    async def run_openai(request, prompts, sequences, render):
        try:
            if not request.stream:
                results = await service.runner.generate(sequences)
                return JsonBody(render(request, prompts, results))
            stream = CompletionStream(openai, request, prompts, sequences)
            return await _streamed(service.runner.stream(sequences), stream.opening(), stream.chunk, stream.closing)
        except ApiError:
            raise
        except Exception as error:
            raise service.api_error(error, OPENAI_NAMES, "prompt") from None

    @app.post("/v1/completions")
    async def completions(raw: Request):
        request = await _body(raw, CompletionRequest, config.max_body_bytes, COMPLETIONS)
        prompts, sequences = openai.completion_sequences(request)
        return await run_openai(request, prompts, sequences, openai.completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        request = await _body(raw, ChatCompletionRequest, config.max_body_bytes, CHAT)
        prompts, sequences = openai.chat_sequences(request)
        return await run_openai(request, prompts, sequences, openai.chat_body)

    @app.post("/generate")
    async def generate(raw: Request):
        request = await _body(raw, GenerateRequest, config.max_body_bytes, GENERATE)
        sequences, batch, rids = sglang.sequences(request)
        started = time.monotonic()
        aborts = in_flight.register([*rids, *([request.rid] if isinstance(request.rid, str) else [])])
        try:
            if not request.stream:
                results = await aborts.run(service.runner.generate(sequences))
                if results is None:  # aborted by /abort_request
                    return JsonBody(sglang.aborted(request, sequences, rids, started, batch))
                now = await service.weight_version() if any(not r.weight_versions for r in results) else None
                items = [sglang.item(request, r, rid, started, now) for r, rid in zip(results, rids)]
                return JsonBody(items if batch else items[0])
            so_far = [SequenceSoFar(s) for s in sequences]

            def event(delta):
                item = sglang.item(request, so_far[delta.index].add(delta), rids[delta.index], started)
                if batch:
                    item["index"] = delta.index
                return item

            def closing():
                return sglang.aborted_events(request, so_far, rids, started, batch) if aborts.aborted else []

            deltas = aborts.stream(service.runner.stream(sequences))
            return await _streamed(deltas, [], event, closing, aborts.release)
        except ApiError:
            aborts.release()
            raise
        except Exception as error:
            aborts.release()
            raise service.api_error(error, SGLANG_NAMES, "input_ids") from None
        finally:
            if not request.stream:
                aborts.release()

    @app.post("/inference/v1/generate")
    async def inference_generate(raw: Request):
        request = await _body(raw, TokenGenerateRequest, config.max_body_bytes, TOKENS)
        job = tokens.job(request)
        aborts = in_flight.register([job.request_id])
        try:
            if not request.stream:
                results = await aborts.run(service.runner.generate(job.sequences))
                return JsonBody(tokens.body(job, results, aborted=results is None))
            stream = tokens.stream(job, aborts)
            deltas = aborts.stream(service.runner.stream(job.sequences))
            return await _streamed(deltas, [], stream.chunk, stream.closing, aborts.release)
        except ApiError:
            aborts.release()
            raise
        except Exception as error:
            aborts.release()
            raise service.api_error(error, TOKEN_NAMES, "token_ids") from None
        finally:
            if not request.stream:
                aborts.release()

    return app


async def _streamed(deltas, opening: list[dict], render, closing, done=None) -> StreamingResponse:
    """An SSE response of `deltas`; the first is awaited before answering, so a request refused
    before its first token gets its 4xx, not a 200 stream. A failure later in the stream is sent
    as an `{"error": ...}` event; a client that leaves cancels the generation. `done` is called
    when the stream ends, however it ends."""
    iterator = deltas.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = None

    async def events():
        try:
            for chunk in opening:
                yield sse_event(chunk)
            if first is not None:
                yield sse_event(render(first))
                async for delta in iterator:
                    yield sse_event(render(delta))
            for chunk in closing():
                yield sse_event(chunk)
            yield sse_event("[DONE]")
        except Exception as error:  # after the status line: the error travels in the stream
            yield sse_event(_stream_error(error).body())
            yield sse_event("[DONE]")
        finally:
            await iterator.aclose()
            if done is not None:
                done()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _stream_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    return ApiError(502, f"the generation failed: {error}", None, "upstream_error")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the tokenizer (exit 2 on a bad setting) and serve until SIGTERM."""
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        app = create_app(config)
    except ValueError as error:
        print(f"triton_sampling_mask.api: {error}", file=sys.stderr)
        sys.exit(2)
    logger.info(
        "serving %r (context %d) on %s:%d over %s",
        config.served_model_name,
        app.state.service.context_length,
        args.host,
        args.port,
        config.triton_url,
    )
    # uvicorn stops accepting on SIGTERM / SIGINT and lets requests in flight finish, up to the grace
    # period; then it raises the signal again under the handler found before it: exit 0 on SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # uvicorn takes uvloop and httptools (the api extra) when they are installed.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=_KEEP_ALIVE_S,
        # the client address (weight_access): X-Forwarded-For only from these proxies
        proxy_headers=True,
        forwarded_allow_ips=forwarded_allow_ips(args),
    )
