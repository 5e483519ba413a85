"""The worker endpoints SGLang's routers and RL frameworks read besides generation: server and
model info, cache flushing and aborts, named and shaped as SGLang's HTTP server (and vLLM's abort).

- `GET /server_info`, `/get_server_info` (SGLang's older name, which sglang-router reads and smg
  falls back to): the served model's name as `model_path` and `served_model_name` (a router names
  the model after them in its `/v1/models`; no server path is disclosed), the context length,
  `dp_size` 1, the package version and the weights' version.
- `GET /model_info`, `/get_model_info`: the model's name, `is_generation`, `model_type` and
  `architectures` from the checkpoint's config.json, the weights' version.
- `GET|POST /flush_cache`: 200. The engine keeps no prefix cache (each request's KV cache is its
  own and is freed when the request ends), so there is nothing to flush; SGLang's answer to a
  successful flush is a 200, which is what slime and Miles wait for after a weight update.
- `POST /abort_request` (SGLang's `{"rid", "abort_all"}`) and `POST /inference/v1/abort_requests`
  (vLLM's `{"request_ids"}`): stop the named requests, or every one (plugin/api/in_flight.py).
- `GET /v1/loads`: SGLang's load report of the engine (requests running and waiting, KV cache
  use, token rate), read from tritonserver's metrics when the API is given them (`--metrics-url`;
  plugin/api/worker_state.py); without them no load route is served, and the routers count their
  own requests instead.

No `/version` is served: smg takes a worker that answers it for vLLM, and this server speaks
SGLang's native routes to routers.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import from_json

from .. import __version__
from ..generation.lm import DEFAULT_LM_CONFIG
from .errors import ApiError, bad_request, from_validation_error
from .in_flight import InFlight
from .service import ApiService
from .worker_state import EngineLoad

FLUSHED = "Cache flushed: this engine keeps no prefix cache (each request's KV cache is freed when it ends).\n"


class AbortRequest(BaseModel):
    """SGLang's AbortReq, the fields this server acts on (the others are accepted and unused)."""

    model_config = ConfigDict(extra="ignore")
    rid: str | None = ""
    abort_all: bool = False


class AbortRequests(BaseModel):
    """vLLM's abort body."""

    model_config = ConfigDict(extra="ignore")
    request_ids: list[str]


def _checkpoint_config(model_path: str) -> dict:
    """The checkpoint's config.json (the built-in LM's when no path is set); {} when unreadable."""
    path = Path(model_path) / "config.json" if model_path else DEFAULT_LM_CONFIG
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


async def _parsed(raw: Request, schema: type[BaseModel]) -> BaseModel:
    try:
        data = from_json(await raw.body() or b"{}")
    except ValueError as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None


def add_info_routes(app: FastAPI, service: ApiService, in_flight: InFlight) -> None:
    """Mount the info, flush and abort routes on `app`."""
    name = service.config.served_model_name
    checkpoint = _checkpoint_config(service.config.model_path)

    async def server_info() -> dict:
        return {
            "model_path": name,
            "served_model_name": name,
            "tokenizer_path": name,
            "context_length": service.context_length,
            "max_req_input_len": service.context_length - 1,
            "tp_size": 1,
            "dp_size": 1,
            "disaggregation_mode": "null",
            "skip_tokenizer_init": False,
            "version": __version__,
            "weight_version": await service.weight_version(),
        }

    async def model_info() -> dict:
        return {
            "model_path": name,
            "served_model_name": name,
            "tokenizer_path": name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": await service.weight_version(),
            "model_type": checkpoint.get("model_type"),
            "architectures": checkpoint.get("architectures"),
        }

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return PlainTextResponse(FLUSHED)

    @app.post("/abort_request")
    async def abort_request(raw: Request):
        request = await _parsed(raw, AbortRequest)
        in_flight.abort([request.rid] if request.rid else [], everything=request.abort_all)
        return Response(status_code=200)

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(raw: Request):
        request = await _parsed(raw, AbortRequests)
        in_flight.abort(request.request_ids)
        return Response(status_code=200)

    if service.config.metrics_url is not None:
        engine_load = EngineLoad(service.config)

        @app.get("/v1/loads")
        async def loads():
            report = await engine_load.report()
            if report is None:
                raise ApiError(503, "the server's metrics cannot be read", None, "service_unavailable", retry_after_s=1)
            return report
