"""What both dialects share: the tokenizer, the generate client and runner, the preparing threads,
and the checks every request passes before any token is generated (its input's bounds before any
tokenizing, input_bounds.py; prompt and budget within the context, choice and stop-list bounds,
the sampling rules of plugin/sampling/validation.py through SamplingParams)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ..client import AsyncGenerateClient, GenerateError
from ..client.generate_transport import GrpcConnection
from ..client.sampling_params import SamplingParams
from ..sampling.params import PARAM_SPECS, SEED
from ..sampling.validation import SamplingRequestError
from .admission import EngineCapacity, FairAdmission
from .config import ApiConfig
from .errors import ApiError, bad_request, from_generate_error, from_sampling_error
from .input_bounds import InputBounds
from .preparation import PreparationPool
from .sequences import SequenceRunner
from .text import context_length, load_tokenizer

_UINT64 = 2**64


def sampling_knobs(fields: object, renames: Mapping[str, str] | None = None, **given: object) -> dict[str, object]:
    """One request's sampling parameters as the client sent them, one per `PARAM_SPECS` entry
    (None: the server's default): read from `fields` under this dialect's name (`renames` maps a
    parameter to it, else its own), or taken from `given`."""
    renames = renames or {}
    return {
        spec.name: given[spec.name] if spec.name in given else getattr(fields, renames.get(spec.name, spec.name), None)
        for spec in PARAM_SPECS
    }


class ApiService:
    """The API's state: its config, the checkpoint's tokenizer and context, the generate client."""

    def __init__(self, config: ApiConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_path)
        self.context_length = config.max_model_len or context_length(config.model_path)
        self.client = AsyncGenerateClient(
            config.triton_url, "grpc", config.triton_model, busy_timeout_s=config.busy_timeout_s
        )
        self.bounds = InputBounds.of(
            self.tokenizer,
            self.context_length,
            config.max_choices,
            config.max_prompt_chars,
            config.trust_request_chat_template,
        )
        self.preparation = PreparationPool(config.tokenizer_threads, config.retry_after_s)
        self._admission: FairAdmission | None = None
        self._admission_read = asyncio.Lock()
        self.runner = SequenceRunner(self.client, self.tokenizer, self.admission)

    async def admission(self) -> FairAdmission | None:
        """The order sequences enter the engine in, once the model's config has been read (None
        while it cannot be, or when it names no bounds: sequences then go as they come)."""
        async with self._admission_read:
            if self._admission is None:
                connection = GrpcConnection(self.config.triton_url, self.config.triton_model)
                try:
                    capacity = EngineCapacity.from_model_config(await connection.model_config())
                except Exception:  # the model is not up: its generation call will say so
                    return None
                finally:
                    await connection.close()
                if capacity is not None:
                    self._admission = FairAdmission(capacity)
        return self._admission

    async def close(self) -> None:
        self.preparation.close()
        await self.client.close()

    def check_model(self, model: str | None) -> None:
        """An unknown `model` is a 404, as OpenAI answers it."""
        if model is not None and model != self.config.served_model_name:
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.config.served_model_name}' (GET /v1/models)",
                "model",
                code="model_not_found",
            )

    def sampling_params(self, knobs: dict[str, object], choices: int, names: dict[str, str]) -> list[SamplingParams]:
        """One SamplingParams per choice, checked with the server's rules; choice j of a seeded
        request with several choices is seeded with seed + j (mod 2**64), so each differs and
        each can be replayed alone. `knobs` is `sampling_knobs`' answer; `names` renames fields for
        this dialect's messages."""
        values = {k: v for k, v in knobs.items() if v is not None and k != SEED.name}
        seed = knobs.get(SEED.name)
        try:
            if seed is not None and not -(2**63) <= seed < _UINT64:
                raise SamplingRequestError("seed", f"seed must be a 64-bit integer, got {seed}")
            seeds = [None] * choices if seed is None else [(seed + j) % _UINT64 for j in range(choices)]
            return [SamplingParams(**values, seed=seed) for seed in seeds]
        except SamplingRequestError as error:
            raise from_sampling_error(error, names) from None

    def check_choices(self, choices: int, field: str) -> None:
        if choices > self.config.max_choices:
            raise bad_request(
                f"this request asks for {choices} sequences; at most {self.config.max_choices} are generated per "
                "request (--max-choices): send several requests",
                field,
            )

    def stop_strings(self, stop: str | list[str] | None, field: str) -> tuple[str, ...]:
        """The stop strings, within the API's bounds."""
        strings = [stop] if isinstance(stop, str) else list(stop or ())
        limit, chars = self.config.max_stop_strings, self.config.max_stop_string_chars
        if len(strings) > limit:
            raise bad_request(f"{field} holds {len(strings)} strings; at most {limit} are accepted", field)
        if any(len(s) > chars for s in strings):
            raise bad_request(f"{field} strings must be at most {chars} characters long", field)
        return tuple(s for s in strings if s)

    def budget(self, prompt_tokens: int, max_tokens: int | None, default: int | None, fields: tuple[str, str]) -> int:
        """The new-token budget: `max_tokens`, else `default`, else what the context leaves;
        a prompt or budget past the context is a 400 naming the field."""
        prompt_field, budget_field = fields
        room = self.context_length - prompt_tokens
        if room <= 0:
            raise bad_request(
                f"the prompt is {prompt_tokens} tokens; this model's context is {self.context_length} tokens, "
                "which must hold the prompt and at least one new token",
                prompt_field,
            )
        wanted = max_tokens if max_tokens is not None else (default if default is not None else room)
        if wanted > room:
            raise bad_request(
                f"{budget_field} {wanted} + the prompt's {prompt_tokens} tokens exceed this model's context of "
                f"{self.context_length} tokens; ask for at most {room} new tokens",
                budget_field,
            )
        return wanted

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a prompt text (its length bounded before, input_bounds), refused at once
        when they pass the context."""
        return self.bounds.check_tokens(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def weight_version(self) -> str | None:
        """The generate model's weight version now (for an answer with no token to carry one)."""
        try:
            versions = await self.client.get_weight_version()
        except GenerateError:
            return None
        return next(iter(versions.values()), None)

    def api_error(self, error: Exception, names: dict[str, str], prompt_field: str) -> ApiError:
        """A failure of a generation as the ApiError it is answered with (re-raises the unexpected)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, SamplingRequestError):
            return from_sampling_error(error, names)
        if isinstance(error, GenerateError):
            param = prompt_field if "input_ids" in error.message else None
            return from_generate_error(error, self.config.retry_after_s, param, self.config.triton_url)
        raise error
