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
backend}, update_weights_from_distributed {tensors, weight_version, pause_mode},
destroy_weights_update_group, pause_generation {mode}, continue_generation, get_weight_version.
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
from ..generation.weight_transfer import SharedMemoryTensors, open_process_group, receive_tensors
from ..generation.weights import (
    CheckpointDirectory,
    WeightUpdateError,
    copy_into,
    resolve_checkpoint,
)
from ..sampling.admin import ADMIN_KEY_PARAMETER
from ..sampling.inputs import CONTROL_INPUT
from ..sampling.outputs import CONTROL_RESULT
from .admin_key import ADMIN_KEY_DIGEST_ENV, key_matches

CONTROL = CONTROL_INPUT
OPEN_OPS = frozenset({"get_weight_version"})  # read-only: the version is on every token anyway
UPDATE_OPS = frozenset({"update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed"})
ADMIN_OPS = UPDATE_OPS | {
    "init_weights_update_group",
    "destroy_weights_update_group",
    "pause_generation",
    "continue_generation",
}
MAX_VERSION_CHARS = 256


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


def request_key(parameters_json: str) -> str | None:
    """The admin key a request carries as its `admin_key` parameter (None when absent)."""
    try:
        parameters = json.loads(parameters_json or "{}")
    except ValueError:
        return None
    value = parameters.get(ADMIN_KEY_PARAMETER) if isinstance(parameters, dict) else None
    return value if isinstance(value, str) else None


def check_key(given: str | None, digest: str) -> None:
    """Refuse a weight operation unless `given` is the admin key whose SHA-256 is `digest`."""
    if not digest:
        raise ControlError("weight operations are off: the server runs without an admin key", "UNAVAILABLE")
    if given is None:
        raise ControlError(f"{ADMIN_KEY_PARAMETER}: this operation needs the admin key as request parameter")
    if not key_matches(given, digest):
        raise ControlError(f"{ADMIN_KEY_PARAMETER}: wrong admin key")


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


class WeightControl:
    """Runs the control operations of one model instance on a thread of their own, one at a time
    (a pause in "finish" mode waits for the rows in flight; a process group for its trainer)."""

    def __init__(self, engine: ContinuousEngine, module: torch.nn.Module | None, weights_root: str, logger):
        self.engine, self.module, self.weights_root, self.logger = engine, module, weights_root, logger
        self.digest = os.environ.get(ADMIN_KEY_DIGEST_ENV, "").strip().lower()
        self.group = None
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
            check_key(request_key(parameters_json), self.digest)
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
            self.group = None
            return self.weight_info()
        return self._update(op, command)

    def _update(self, op: str, command: dict) -> dict:
        if self.module is None:
            raise ControlError(f"{op}: this deployment's LM has no torch module to update", "UNSUPPORTED")
        version, mode = _version(command), _mode(command)
        started = time.monotonic()
        if op == "update_weights_from_disk":
            path = command.get("model_path")
            if not isinstance(path, str) or not path:
                raise ControlError("model_path must be a checkpoint directory relative to the weights root")
            directory, label = resolve_checkpoint(self.weights_root, path)
            source = CheckpointDirectory(directory, label, getattr(self.module, "config", None))
            written = self._apply(source, version, mode)
        elif op == "update_weights_from_tensor":
            with SharedMemoryTensors(command.get("shm_name"), command.get("tensors")) as shared:
                written = self._apply(shared.source(), version, mode)
        else:
            if self.group is None:
                raise ControlError(f"{op}: no weights update group (init_weights_update_group first)")
            device = next(self.module.parameters()).device
            written = self._apply(receive_tensors(self.group, command.get("tensors"), device), version, mode)
        seconds = time.monotonic() - started
        self.logger.log_info(
            f"generate: {op} wrote {written} tensors in {seconds:.2f}s ({mode}); weight version "
            f"{self.engine.weight_version!r}"
        )
        return {**self.weight_info(), "tensors": written, "seconds": round(seconds, 4)}

    def _apply(self, source, version: str, mode: str) -> int:
        self._updates += 1
        return self.engine.update_weights(lambda: copy_into(self.module, source), version or str(self._updates), mode)

    def _init_group(self, command: dict) -> dict:
        try:
            address = str(command["master_address"])
            port, rank, world = int(command["master_port"]), int(command["rank_offset"]), int(command["world_size"])
        except (KeyError, TypeError, ValueError):
            raise ControlError(
                "init_weights_update_group needs master_address, master_port, rank_offset and world_size"
            ) from None
        group_name = str(command.get("group_name", "weight_update_group"))
        timeout_s = float(command.get("timeout_s", 120.0))
        self.group = open_process_group(
            address, port, rank, world, group_name, str(command.get("backend", "gloo")), timeout_s
        )
        return {**self.weight_info(), "rank": rank, "world_size": world}

    def stop(self) -> None:
        """End the control thread once the operation in progress is done."""
        self._queue.put(None)
        self._thread.join(timeout=30)


def control_response(pb_utils, result: dict):
    """A control request's answer: `control_result` holding `result` as JSON."""
    payload = np.array([[json.dumps(result).encode()]], dtype=CONTROL_RESULT.dtype)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(CONTROL_RESULT.name, payload)])
