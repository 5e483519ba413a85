"""SGLang's weight endpoints (and vLLM's /sleep, /wake_up) over the generate model's control
requests (docs/weights.md, docs/api.md "Weights").

Routes: POST /update_weights_from_disk, /update_weights_from_distributed,
/init_weights_update_group, /destroy_weights_update_group, /update_weight_version,
/pause_generation, /continue_generation, /release_memory_occupation and
/resume_memory_occupation (GET too, as SGLang), /sleep, /wake_up; GET /get_weight_version.

Answers are SGLang's, refusals included: `{"success": true|false, "message": ...}` (plus
`num_paused_requests` from disk, `new_version` for a version), with SGLang's statuses: 200, or 400
for a request that cannot be done. Ours beside them: 403 without the admin key (checked before the
body: weight_access), 429 past the wrong-key limit, 503 with Retry-After when the model is busy or
unreachable, 502 when it failed. SGLang's request models are accepted field for field
(weight_schemas): values this server cannot honour are refused by name, never ignored.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..client import GenerateError
from ..client.generate_transport import IN_BAND, GrpcConnection
from ..client.weight_updates import on_every_replica
from ..sampling.admin import ADMIN_HEADER, CLIENT_ADDRESS_PARAMETER, TOO_MANY_WRONG_KEYS
from .errors import from_validation_error, without_addresses
from .weight_access import WeightAccess
from .weight_schemas import (
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    PauseGeneration,
    Sleep,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateWeightVersion,
    WakeUp,
)

WRONG_KEY_RETRY_S = 60  # the wrong-key window (serving.wrong_keys.WINDOW_S)
NEEDS_KEY = (
    f"this operation needs the admin key in the '{ADMIN_HEADER}' header "
    "(or a call from a network in TRITON_API_TRUSTED_NETWORKS)"
)


class WeightRefusal(Exception):
    """A refused weight call: its HTTP status and message, answered in SGLang's shape."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse({"success": False, "message": self.message}, status_code=self.status, headers=headers)


def refusal_of(error: GenerateError) -> WeightRefusal:
    """The model's refusal or failure as the weight routes answer it."""
    if TOO_MANY_WRONG_KEYS in error.message:
        return WeightRefusal(429, error.message, WRONG_KEY_RETRY_S)
    if "admin_key:" in error.message or "without an admin key" in error.message:
        return WeightRefusal(403, error.message)
    if error.busy or error.status is None or "UNAVAILABLE" in str(error.status):
        return WeightRefusal(503, f"the generate model is unavailable: {error.message}", 1)
    if error.status in (IN_BAND, "400", "StatusCode.INVALID_ARGUMENT"):
        return WeightRefusal(400, error.message)
    return WeightRefusal(502, f"the generate model failed: {error.message}")


async def parsed(raw: Request, schema: type[BaseModel], max_body_bytes: int, default: bytes = b"{}") -> BaseModel:
    """The body as `schema` (an empty body: its defaults), every field this server cannot honour
    refused by name."""
    body = await raw.body()
    if len(body) > max_body_bytes:
        raise WeightRefusal(413, f"the body is {len(body)} bytes; at most {max_body_bytes} are accepted")
    try:
        request = schema.model_validate_json(body.strip() or default)
    except ValidationError as error:
        raise WeightRefusal(400, from_validation_error(error).message) from None
    problems = request.unsupported() if hasattr(request, "unsupported") else []
    if problems:
        raise WeightRefusal(400, "; ".join(problems))
    return request


def add_weight_routes(app: FastAPI, triton_url: str, triton_model: str, access: WeightAccess, max_body_bytes: int):
    """Mount the weight routes on `app`, acting through the generate model `triton_model` at the
    gRPC address `triton_url`."""

    def connect(url: str) -> GrpcConnection:
        return GrpcConnection(url, triton_model)

    @app.exception_handler(WeightRefusal)
    async def weight_refusal(_request, error: WeightRefusal):
        return error.response()

    def key_of(raw: Request) -> str:
        key = access.key_for(raw)
        if key is None:  # first: a keyless caller learns nothing about the body it sent
            raise WeightRefusal(403, NEEDS_KEY)
        return key

    async def act(raw: Request, key: str | None, command: dict) -> dict:
        address = access.client_address(raw)
        extra = {CLIENT_ADDRESS_PARAMETER: address} if address else {}
        try:
            answers = await on_every_replica(connect, [triton_url], [command], key, extra)
        except GenerateError as error:  # without the replica's (internal) address
            message = without_addresses(error.message, triton_url)
            raise refusal_of(GenerateError(error.status, message)) from None
        return next(iter(answers.values()))

    async def admin_call(raw: Request, schema: type[BaseModel], default: bytes = b"{}"):
        key = key_of(raw)
        return key, await parsed(raw, schema, max_body_bytes, default)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(raw: Request):
        key, request = await admin_call(raw, UpdateFromDisk)
        answer = await act(raw, key, request.command())
        message = f"updated {answer.get('tensors')} tensors; weight version {answer.get('weight_version')!r}"
        return {"success": True, "message": message, "num_paused_requests": 0, **answer}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(raw: Request):
        key, request = await admin_call(raw, UpdateFromDistributed)
        answer = await act(raw, key, request.command())
        message = f"updated {answer.get('tensors')} tensors; weight version {answer.get('weight_version')!r}"
        return {"success": True, "message": message, **answer}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(raw: Request):
        key, request = await admin_call(raw, InitWeightsUpdateGroup)
        answer = await act(raw, key, request.command())
        return {"success": True, "message": f"joined group {request.group_name!r} as rank {answer.get('rank')}"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(raw: Request):
        key, request = await admin_call(raw, DestroyWeightsUpdateGroup)
        await act(raw, key, request.command())
        return {"success": True, "message": "left the weights update group"}

    @app.post("/update_weight_version")
    async def update_weight_version(raw: Request):
        key, request = await admin_call(raw, UpdateWeightVersion)
        await act(raw, key, request.command())
        message = f"Weight version updated to {request.new_version}"
        return {"success": True, "message": message, "new_version": request.new_version}

    async def memory(raw: Request, op: str, tags: list[str] | None) -> dict:
        answer = await act(raw, key_of(raw), {"op": op, **({"tags": tags} if tags is not None else {})})
        return {
            "success": True,
            "message": f"nothing to {'release' if op.startswith('release') else 'resume'}: "
            f"the model runs on {answer.get('device')}, without accelerator memory to hand back",
        }

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(raw: Request):
        key_of(raw)
        request = await parsed(raw, MemoryOccupation, max_body_bytes)
        return await memory(raw, "release_memory_occupation", request.tags)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(raw: Request):
        key_of(raw)
        request = await parsed(raw, MemoryOccupation, max_body_bytes)
        return await memory(raw, "resume_memory_occupation", request.tags)

    @app.post("/sleep")
    async def sleep(raw: Request):
        key_of(raw)
        request = await parsed(raw, Sleep, max_body_bytes)
        level = raw.query_params.get("level")
        if level is not None and level not in ("1", "2"):
            raise WeightRefusal(400, f"level must be 1 or 2, got {level!r}")
        del request  # both levels mean the same here: nothing to offload or discard on CPU
        return await memory(raw, "release_memory_occupation", None)

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        key_of(raw)
        request = await parsed(raw, WakeUp, max_body_bytes)
        tags = raw.query_params.getlist("tags") or (request.tags if isinstance(request.tags, list) else None)
        return await memory(raw, "resume_memory_occupation", tags)

    @app.post("/pause_generation")
    async def pause_generation(raw: Request):
        key, request = await admin_call(raw, PauseGeneration)
        await act(raw, key, {"op": "pause_generation", "mode": request.mode})
        return {"success": True, "message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(raw: Request):
        key, _ = await admin_call(raw, ContinueGeneration)
        await act(raw, key, {"op": "continue_generation"})
        return {"success": True, "message": "Generation continued successfully.", "status": "ok"}

    @app.get("/get_weight_version")
    async def get_weight_version(raw: Request):
        answer = await act(raw, None, {"op": "get_weight_version"})
        return {"weight_version": answer["weight_version"]}
