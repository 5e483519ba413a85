"""Control requests to the `generate` model: weight updates, pause / continue, the weight version.

A control request is a request to `generate` itself with the `control` input (JSON text,
`{"op": ..., ...}`) instead of a prompt, because only this model's stub holds the LM and the
engine whose weights change: a companion model would run in a stub of its own, and the
repository API can only reload the model (docs/weights.md). Its answer is one response with
`control_result` (JSON). Every operation but `get_weight_version` needs the admin key, sent as
the request parameter `admin_key` and checked against the SHA-256 the launcher gives the stub
(ADMIN_KEY_DIGEST_ENV): without one, weight operations are off.

Operations (SGLang's names and fields): update_weights_from_disk {model_path, weight_version,
pause_mode}, update_weights_from_tensor {shm_name, tensors, weight_version, pause_mode},
init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
backend}, update_weights_from_distributed {tensors, group_name, weight_version, pause_mode},
destroy_weights_update_group {group_name}, update_weight_version {weight_version, pause_mode},
release_memory_occupation {tags}, resume_memory_occupation {tags}, pause_generation {mode},
continue_generation, get_weight_version.

Every check that can refuse an update (the key, the fields, the path, the checkpoint's files,
tensor names, shapes, dtypes and values, the group) runs before the engine pauses: a refused
update, even in "abort" mode, leaves the requests in flight running. Wrong keys are limited per
source address (serving.wrong_keys), the address being the request parameter
sampling.admin.CLIENT_ADDRESS_PARAMETER.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time

import numpy as np
import torch

from ..generation.engine import IN_PLACE, PAUSE_MODES, ContinuousEngine
from ..generation.weight_transfer import (
    SharedMemoryTensors,
    close_process_group,
    open_process_group,
    receive_tensors,
)
from ..generation.weights import (
    CheckpointDirectory,
    WeightUpdateError,
    checked_plan,
    resolve_checkpoint,
    write_plan,
)
from ..sampling.admin import ADMIN_KEY_PARAMETER, CLIENT_ADDRESS_PARAMETER, TOO_MANY_WRONG_KEYS, WRONG_KEY
from ..sampling.inputs import CONTROL_INPUT
from ..sampling.outputs import CONTROL_RESULT
from .admin_key import ADMIN_KEY_DIGEST_ENV, key_matches
from .wrong_keys import UNATTRIBUTED, WrongKeyLimit

CONTROL = CONTROL_INPUT
OPEN_OPS = frozenset({"get_weight_version"})  # read-only: the version is on every token anyway
UPDATE_OPS = frozenset({"update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed"})
ADMIN_OPS = UPDATE_OPS | {
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weight_version",
    "release_memory_occupation",
    "resume_memory_occupation",
    "pause_generation",
    "continue_generation",
}
MAX_VERSION_CHARS = 256
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
# What SGLang's release / resume_memory_occupation may name (tags); none: all of them.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
MAX_ADDRESS_CHARS = 256


class ControlError(Exception):
    """A refused control request: its message and Triton error code name."""

    def __init__(self, message: str, code_name: str = "INVALID_ARG"):
        super().__init__(message)
        self.message, self.code_name = message, code_name


def parse_command(text: bytes | str) -> dict:
    """The control request's JSON object; ControlError naming the input when it is not one."""
    try:
        command = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise ControlError(f'{CONTROL} must be a JSON object, e.g. {{"op": "get_weight_version"}}') from None
    if not isinstance(command, dict) or not isinstance(command.get("op"), str):
        raise ControlError(f"{CONTROL} must be a JSON object with a string 'op'")
    if command["op"] not in OPEN_OPS | ADMIN_OPS:
        raise ControlError(f"{CONTROL}: unknown op {command['op']!r}; one of {sorted(OPEN_OPS | ADMIN_OPS)}")
    return command


def _parameters(parameters_json: str) -> dict:
    # Duplicate names keep the last value: tritonserver appends the headers it forwards (the
    # front door's client address) after the request's own parameters.
    try:
        parameters = json.loads(parameters_json or "{}")
    except ValueError:
        return {}
    return parameters if isinstance(parameters, dict) else {}


def request_key(parameters_json: str) -> str | None:
    """The admin key a request carries as its `admin_key` parameter (None when absent)."""
    value = _parameters(parameters_json).get(ADMIN_KEY_PARAMETER)
    return value if isinstance(value, str) else None


def request_source(parameters_json: str) -> str:
    """The client address a request carries (CLIENT_ADDRESS_PARAMETER), or UNATTRIBUTED."""
    value = _parameters(parameters_json).get(CLIENT_ADDRESS_PARAMETER)
    return value[:MAX_ADDRESS_CHARS] if isinstance(value, str) and value else UNATTRIBUTED


def check_key(given: str | None, digest: str) -> None:
    """Refuse a weight operation unless `given` is the admin key whose SHA-256 is `digest`."""
    if not digest:
        raise ControlError("weight operations are off: the server runs without an admin key", "UNAVAILABLE")
    if given is None:
        raise ControlError(f"{ADMIN_KEY_PARAMETER}: this operation needs the admin key as request parameter")
    if not key_matches(given, digest):
        raise ControlError(f"{ADMIN_KEY_PARAMETER}: {WRONG_KEY}")


def check_key_from(given: str | None, digest: str, source: str, wrong_keys: WrongKeyLimit) -> None:
    """check_key, with wrong keys counted against `source`: past the limit, every keyed request
    from there is refused (the right key too) before its key is looked at."""
    if given is not None and wrong_keys.blocked(source):
        raise ControlError(f"{ADMIN_KEY_PARAMETER}: {TOO_MANY_WRONG_KEYS}; try again in a minute", "UNAVAILABLE")
    try:
        check_key(given, digest)
    except ControlError as error:
        if error.message.endswith(WRONG_KEY):
            wrong_keys.record(source)
        raise


def _version(command: dict) -> str:
    version = command.get("weight_version")
    if version is None:
        return ""
    if not isinstance(version, str) or len(version) > MAX_VERSION_CHARS:
        raise ControlError(f"weight_version must be a string of at most {MAX_VERSION_CHARS} characters")
    return version


def _mode(command: dict, field: str = "pause_mode") -> str:
    mode = command.get(field, IN_PLACE)
    if mode not in PAUSE_MODES:
        raise ControlError(f"{field} must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def _group_name(command: dict) -> str:
    name = command.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name or len(name) > MAX_VERSION_CHARS:
        raise ControlError(f"group_name must be a non-empty string of at most {MAX_VERSION_CHARS} characters")
    return name


def _memory_tags(command: dict) -> list[str]:
    tags = command.get("tags")
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ControlError(f"tags must be a list of {list(MEMORY_TAGS)}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ControlError(f"tags: unknown {unknown}; the tags are {list(MEMORY_TAGS)}")
    return tags


class WeightControl:
    """Runs the control operations of one model instance on a thread of their own, one at a time
    (a pause in "finish" mode waits for the rows in flight; a process group for its trainer)."""

    def __init__(self, engine: ContinuousEngine, module: torch.nn.Module | None, weights_root: str, logger):
        self.engine, self.module, self.weights_root, self.logger = engine, module, weights_root, logger
        self.digest = os.environ.get(ADMIN_KEY_DIGEST_ENV, "").strip().lower()
        self.wrong_keys = WrongKeyLimit()
        self.group, self.group_name = None, None
        self._updates = 0  # versions set without a name get "<update count>"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="generate-control", daemon=True)
        self._thread.start()

    def submit(self, command_text: bytes, parameters_json: str, answer) -> None:
        """Check a control request and queue it; `answer(result_dict | ControlError)` is called once
        with its outcome (from this thread for a refusal or a read, else the control thread)."""
        try:
            command = parse_command(command_text)
            if command["op"] in OPEN_OPS:
                answer(self.weight_info())
                return
            check_key_from(request_key(parameters_json), self.digest, request_source(parameters_json), self.wrong_keys)
        except ControlError as error:
            answer(error)
            return
        self._queue.put((command, answer))

    def weight_info(self) -> dict:
        """The served weights' version and whether generation is paused."""
        return {"weight_version": self.engine.weight_version, "paused": self.engine.paused}

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            command, answer = item
            try:
                outcome = self._execute(command)
            except ControlError as error:
                outcome = error
            except WeightUpdateError as error:
                outcome = ControlError(error.message)
            except Exception as exc:  # an internal fault: refused, the old weights serve on
                self.logger.log_error(f"generate: control op {command['op']!r} failed: {type(exc).__name__}: {exc}")
                outcome = ControlError(f"{command['op']} failed ({type(exc).__name__}); see the server log", "INTERNAL")
            try:
                answer(outcome)
            except Exception as exc:  # the client may be gone
                self.logger.log_error(f"generate: control answer not sent ({type(exc).__name__}: {exc})")

    def _execute(self, command: dict) -> dict:
        op = command["op"]
        if op == "pause_generation":
            self.engine.pause(_mode(command, "mode"))
            return self.weight_info()
        if op == "continue_generation":
            self.engine.resume()
            return self.weight_info()
        if op == "init_weights_update_group":
            return self._init_group(command)
        if op == "destroy_weights_update_group":
            self._check_group(command, op)
            self._close_group()
            return self.weight_info()
        if op == "update_weight_version":
            return self._set_version(command)
        if op in ("release_memory_occupation", "resume_memory_occupation"):
            return self._memory(op, command)
        return self._update(op, command)

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device if self.module is not None else torch.device("cpu")

    def _update(self, op: str, command: dict) -> dict:
        """Check the whole source first (nothing paused yet), then pause, write and resume."""
        if self.module is None:
            raise ControlError(f"{op}: this deployment's LM has no torch module to update", "UNSUPPORTED")
        version, mode = _version(command), _mode(command)
        started = time.monotonic()
        if op == "update_weights_from_disk":
            path = command.get("model_path")
            if not isinstance(path, str) or not path:
                raise ControlError("model_path must be a checkpoint directory relative to the weights root")
            directory, label = resolve_checkpoint(self.weights_root, path)
            with CheckpointDirectory(directory, label, getattr(self.module, "config", None)) as source:
                written = self._apply(source, version, mode)
        elif op == "update_weights_from_tensor":
            with SharedMemoryTensors(command.get("shm_name"), command.get("tensors")) as shared:
                written = self._apply(shared.source(), version, mode)
        else:
            self._check_group(command, op)
            # Every tensor is received before any check: the trainer broadcasts them all whatever
            # this side thinks of them, and the group must stay in step for the next update.
            source = receive_tensors(self.group, command.get("tensors"), self._device())
            written = self._apply(source, version, mode)
        seconds = time.monotonic() - started
        self.logger.log_info(
            f"generate: {op} wrote {written} tensors in {seconds:.2f}s ({mode}); weight version "
            f"{self.engine.weight_version!r}"
        )
        return {**self.weight_info(), "tensors": written, "seconds": round(seconds, 4)}

    def _apply(self, source, version: str, mode: str) -> int:
        plan = checked_plan(self.module, source)  # refusals happen here, before the pause
        self._updates += 1
        return self.engine.update_weights(
            lambda: write_plan(self.module, source, plan), version or str(self._updates), mode
        )

    def _set_version(self, command: dict) -> dict:
        """SGLang's update_weight_version: the weights stay, later tokens carry the new version
        (the rows in flight too, from their next token; "abort" ends them first)."""
        version, mode = command.get("weight_version"), _mode(command)
        if not isinstance(version, str) or not version:
            raise ControlError("weight_version must be a non-empty string")
        _version(command)
        self.engine.update_weights(lambda: 0, version, mode)
        return self.weight_info()

    def _memory(self, op: str, command: dict) -> dict:
        """SGLang's release / resume_memory_occupation: on CPU there is no accelerator memory to
        hand back, so both are answered as done with nothing released; on a GPU this server keeps
        its weights and KV cache resident, so both are refused rather than pretended."""
        tags = _memory_tags(command)
        device = self._device()
        if device.type != "cpu":
            raise ControlError(
                f"{op}: this server keeps its weights and KV cache on {device.type} resident; "
                "run the trainer on other devices (colocated offloading is not supported)",
                "UNSUPPORTED",
            )
        return {**self.weight_info(), "device": device.type, "tags": tags, "released": False}

    def _check_group(self, command: dict, op: str) -> None:
        name = _group_name(command) if "group_name" in command else self.group_name
        if self.group is None:
            raise ControlError(f"{op}: no weights update group (init_weights_update_group first)")
        if name != self.group_name:
            raise ControlError(f"{op}: no weights update group named {name!r} (the open one is {self.group_name!r})")

    def _close_group(self) -> None:
        group, self.group, self.group_name = self.group, None, None
        if group is not None:
            try:
                close_process_group(group)
            except Exception as exc:  # the group is dropped all the same
                self.logger.log_error(f"generate: weights update group not closed cleanly: {type(exc).__name__}")

    def _init_group(self, command: dict) -> dict:
        try:
            address = command["master_address"]
            port, rank, world = (_integer(command[key]) for key in ("master_port", "rank_offset", "world_size"))
            if not isinstance(address, str) or not address:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ControlError(
                "init_weights_update_group needs master_address (a host), and master_port, rank_offset and "
                "world_size (integers)"
            ) from None
        if not 0 < port < 65536:
            raise ControlError(f"master_port must be 1 to 65535, got {port}")
        group_name = _group_name(command)
        backend = command.get("backend") or ("nccl" if self._device().type == "cuda" else "gloo")
        timeout_s = command.get("timeout_s", 120.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ControlError("timeout_s must be a number of seconds in (0, 3600]")
        if backend == "nccl" and self._device().type != "cuda":
            raise ControlError(
                f"backend 'nccl' needs the LM on a GPU; this deployment runs on {self._device().type}: use 'gloo'"
            )
        self._close_group()  # a new group replaces the open one, as a trainer that restarted expects
        self.group = open_process_group(address, port, rank, world, group_name, backend, float(timeout_s))
        self.group_name = group_name
        return {**self.weight_info(), "rank": rank, "world_size": world}

    def stop(self) -> None:
        """End the control thread once the operation in progress is done."""
        self._queue.put(None)
        self._thread.join(timeout=30)


def _integer(value: object) -> int:
    """An integer field: a JSON integer, or its decimal text (as SGLang's lax parsing takes "29500")."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError


def control_response(pb_utils, result: dict):
    """A control request's answer: `control_result` holding `result` as JSON."""
    payload = np.array([[json.dumps(result).encode()]], dtype=CONTROL_RESULT.dtype)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(CONTROL_RESULT.name, payload)])
