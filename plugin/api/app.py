"""The FastAPI application and the process: routes, every error in OpenAI's shape, Server-Sent
Events, and `main` (uvicorn, SIGTERM drains requests in flight).

Routes: GET /health (200 while the generate model is ready, else 503), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions, POST /generate, POST /inference/v1/generate
(vLLM's token route), SGLang's weight routes (weight_routes) and worker routes (info_routes:
server and model info, flush_cache, the aborts). With an API key every route but /health needs
`Authorization: Bearer <key>` (request_limits.py, which also bounds the body). A request's body
is parsed, checked and tokenized on the preparing threads (preparation.py, input_bounds.py); its
sequences then wait their turn in the engine (admission.py), and a client that leaves cancels them
(disconnects.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from ..client.generate_transport import GrpcConnection
from .config import ApiConfig, build_parser, config_from_args, forwarded_allow_ips
from .disconnects import ClientLeft, EventStream, answer_error, unless_client_leaves
from .encoding import JsonBody
from .errors import ApiError, bad_request, from_validation_error
from .field_table import CHAT, COMPLETIONS, GENERATE, TOKENS, accept
from .in_flight import InFlight
from .info_routes import add_info_routes
from .input_bounds import PromptPastContext
from .openai_routes import OPENAI_NAMES, CompletionStream, OpenAIHandlers
from .request_limits import RequestLimits
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


def _json(body: bytes) -> dict:
    """The body as a JSON object (a 400 saying what is wrong)."""
    try:
        data = from_json(body)
    except ValueError as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def _validated(data: dict, model: type[BaseModel], route: str) -> BaseModel:
    """`data` parsed into `model` as `route`'s upstream parses it: the route's neutral and ignored
    fields checked and taken out first (field_table), a 400 naming each problem."""
    try:
        return model.model_validate(accept(route, data))
    except ValidationError as error:
        raise from_validation_error(error) from None


def _naming(field: str, prepare, request):
    """`prepare(request)`, a prompt past the context named as `field`."""
    try:
        return prepare(request)
    except PromptPastContext as error:
        error.param = field
        raise


def create_app(config: ApiConfig, service: ApiService | None = None) -> FastAPI:
    """The application serving `config` (a prepared `service` may be passed, e.g. by tests)."""
    service = service or ApiService(config)
    openai = OpenAIHandlers(service)
    sglang = GenerateHandler(service)
    tokens = TokenHandler(service)
    in_flight = InFlight()
    bounds = service.bounds

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await service.close()

    # No /openapi.json: the API is documented in docs/api.md (its generated schema would list every
    # route, the weight routes included, to whoever asks where no key is set).
    app = FastAPI(title="triton-sampling-mask API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    app.add_middleware(
        RequestLimits,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        client_timeout_s=config.client_timeout_s,
    )

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

    @app.exception_handler(ClientDisconnect)
    async def client_left_mid_body(request: Request, _error):
        logger.info("%s %s: the client left before sending its whole body", request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(ClientLeft)
    async def client_left(_request, _error):
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

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

    # What runs on a preparing thread: parse, bound, tokenize or render (the sync part of a request).
    def prepare_completion(body: bytes):
        request = _validated(_json(body), CompletionRequest, COMPLETIONS)
        bounds.check_completion(request.prompt, request.n)
        return request, *_naming("prompt", openai.completion_sequences, request)

    def prepare_chat(body: bytes):
        data = _json(body)
        bounds.check_message_count(data)  # before each message is validated: that is the costly part
        request = _validated(data, ChatCompletionRequest, CHAT)
        bounds.check_chat(request.messages, request.chat_template_kwargs, getattr(request, "chat_template", None))
        return request, *openai.chat_sequences(request)

    def prepare_generate(body: bytes):
        request = _validated(_json(body), GenerateRequest, GENERATE)
        bounds.check_generate(request.text, request.input_ids, request.sampling_params)
        field = "text" if request.text is not None else "input_ids"
        return request, *_naming(field, sglang.sequences, request)

    def prepare_tokens(body: bytes):
        request = _validated(_json(body), TokenGenerateRequest, TOKENS)
        return request, tokens.job(request)

    def errors_of(names: dict[str, str], prompt_field: str):
        return lambda error: answer_error(error, lambda e: service.api_error(e, names, prompt_field))

    async def whole(raw: Request, generation, to_error):
        """The result of `generation` (every sequence to its end), cancelled when the client leaves."""
        try:
            return await unless_client_leaves(raw.receive, generation)
        except ClientLeft:
            raise
        except Exception as error:
            raise to_error(error) from None

    async def run_openai(raw: Request, prepare, render):
        request, prompts, sequences = await service.preparation.run(prepare, await raw.body())
        to_error = errors_of(OPENAI_NAMES, "prompt")
        if not request.stream:
            return JsonBody(render(request, prompts, await whole(raw, service.runner.generate(sequences), to_error)))
        stream = CompletionStream(openai, request, prompts, sequences)
        return EventStream(service.runner.stream(sequences), stream.chunk, to_error, stream.opening(), stream.closing)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await run_openai(raw, prepare_completion, openai.completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await run_openai(raw, prepare_chat, openai.chat_body)

    @app.post("/generate")
    async def generate(raw: Request):
        started = time.monotonic()
        request, sequences, batch, rids = await service.preparation.run(prepare_generate, await raw.body())
        to_error = errors_of(SGLANG_NAMES, "input_ids")
        aborts = in_flight.register([*rids, *([request.rid] if isinstance(request.rid, str) else [])])
        if not request.stream:
            try:
                results = await whole(raw, aborts.run(service.runner.generate(sequences)), to_error)
            finally:
                aborts.release()
            if results is None:  # aborted by /abort_request
                return JsonBody(sglang.aborted(request, sequences, rids, started, batch))
            now = await service.weight_version() if any(not r.weight_versions for r in results) else None
            items = [
                sglang.item(request, r, rid, started, now, s.top_p_token_ids)
                for r, rid, s in zip(results, rids, sequences)
            ]
            return JsonBody(items if batch else items[0])
        so_far = [SequenceSoFar(s) for s in sequences]

        def event(delta):
            state = so_far[delta.index].add(delta)
            item = sglang.item(request, state, rids[delta.index], started, top_p_ids=state.top_p_token_ids)
            if batch:
                item["index"] = delta.index
            return item

        def closing():
            return sglang.aborted_events(request, so_far, rids, started, batch) if aborts.aborted else []

        deltas = aborts.stream(service.runner.stream(sequences))
        return EventStream(deltas, event, to_error, closing=closing, done=aborts.release)

    @app.post("/inference/v1/generate")
    async def inference_generate(raw: Request):
        request, job = await service.preparation.run(prepare_tokens, await raw.body())
        to_error = errors_of(TOKEN_NAMES, "token_ids")
        aborts = in_flight.register([job.request_id])
        if not request.stream:
            try:
                results = await whole(raw, aborts.run(service.runner.generate(job.sequences)), to_error)
            finally:
                aborts.release()
            return JsonBody(tokens.body(job, results, aborted=results is None))
        stream = tokens.stream(job, aborts)
        deltas = aborts.stream(service.runner.stream(job.sequences))
        return EventStream(deltas, stream.chunk, to_error, closing=stream.closing, done=aborts.release)

    return app


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
