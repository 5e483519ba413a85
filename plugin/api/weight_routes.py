"""SGLang's weight endpoints over the generate model's control requests (docs/weights.md).

`POST /update_weights_from_disk`, `POST /pause_generation`, `POST /continue_generation` and
`GET /get_weight_version`, named and answered as SGLang's HTTP server does (`{"success",
"message"}`, `{"weight_version"}`). Every operation but the version query needs the server's
admin key, sent in the `sampling.admin.ADMIN_HEADER` header (or as `Authorization: Bearer` when the API has
no key of its own): the API passes it on and the model checks it. SGLang's
`abort_all_requests: true` is our `abort` pause mode; without it the update swaps in place.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from ..client import GenerateError
from ..client.weight_updates import check_pause_mode
from ..sampling.admin import ADMIN_HEADER
from .errors import ApiError, bad_request


class UpdateFromDisk(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput, the fields this server acts on."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    pause_mode: str | None = None  # ours: abort, finish or in_place (wins over abort_all_requests)
    load_format: str | None = None
    flush_cache: bool = True


class PauseGeneration(BaseModel):
    """SGLang's PauseGenerationReqInput."""

    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"


def _admin_key(raw: Request, api_key: str | None) -> str | None:
    key = raw.headers.get(ADMIN_HEADER)
    if key is None and not api_key:
        scheme, _, token = raw.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return key


async def _parsed(raw: Request, schema):
    try:
        return schema.model_validate_json(await raw.body() or b"{}")
    except ValueError as error:
        raise bad_request(f"invalid body: {str(error).splitlines()[0]}", None) from None


def _refusal(error: GenerateError) -> ApiError:
    status = 503 if error.busy else 403 if "admin key" in error.message else 400
    return ApiError(status, error.message, None, retry_after_s=1 if status == 503 else None)


def add_weight_routes(app: FastAPI, client, api_key: str | None) -> None:
    """Mount SGLang's weight endpoints on `app`, acting through `client` (an AsyncGenerateClient)."""

    async def act(call) -> dict:
        try:
            answers = await call
        except GenerateError as error:
            raise _refusal(error) from None
        except ValueError as error:
            raise bad_request(str(error), None) from None
        return next(iter(answers.values()))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(raw: Request):
        request = await _parsed(raw, UpdateFromDisk)
        if request.load_format not in (None, "auto", "safetensors"):
            raise bad_request("load_format: only safetensors checkpoints are read", "load_format")
        mode = request.pause_mode or ("abort" if request.abort_all_requests else "in_place")
        check_pause_mode(mode, "pause_mode")
        answer = await act(
            client.update_weights_from_disk(
                request.model_path,
                weight_version=request.weight_version,
                pause_mode=mode,
                admin_key=_admin_key(raw, api_key),
            )
        )
        return {"success": True, "message": "updated", "num_paused_requests": 0, **answer}

    @app.post("/pause_generation")
    async def pause_generation(raw: Request):
        request = await _parsed(raw, PauseGeneration)
        if request.mode == "retract":
            raise bad_request("mode: 'retract' is not supported; use abort, finish or in_place", "mode")
        await act(client.pause_generation(request.mode, admin_key=_admin_key(raw, api_key)))
        return {"success": True, "message": f"paused ({request.mode})"}

    @app.post("/continue_generation")
    async def continue_generation(raw: Request):
        await act(client.continue_generation(admin_key=_admin_key(raw, api_key)))
        return {"success": True, "message": "continued"}

    @app.get("/get_weight_version")
    async def get_weight_version():
        try:
            versions = await client.get_weight_version()
        except GenerateError as error:
            raise _refusal(error) from None
        return {"weight_version": next(iter(versions.values()))}
