"""Weights that follow the trainer: new values copied into a running LM's own tensors, in place.

A source (a Hugging Face safetensors directory, named tensors a trainer handed over) is checked
whole before anything is written: every name known, every shape equal, every dtype of the same
kind (a floating tensor takes floating values, cast as `lm_dtype` casts them; other dtypes must
match exactly) and every value finite. Only then is each tensor copied into the parameter it
replaces, one at a time, so the LM's memory is never doubled and a refused source leaves the old
weights serving untouched. Errors name the first bad tensor and paths relative to the allowed root.
"""

from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .weights_root import OUTSIDE, PathRefused, RootedDirectory, RootedFile, open_root

SAFETENSORS_SUFFIX = ".safetensors"
# A tensor on disk is read this many bytes at a time at most (whole rows), each piece from a fresh
# memory map: what an update adds to the process's memory is one piece, not the largest tensor.
CHUNK_BYTES = 8 * 2**20
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 2**20  # a Hugging Face config.json is a few KiB
MAX_QUOTED_CHARS = 200  # of a name from a file, in a message


class WeightUpdateError(ValueError):
    """A weight source that cannot replace the LM's weights (nothing was written); `message` says
    why and names the first bad tensor or file."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class TensorInfo:
    """What the check needs of one incoming tensor before its values are read."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightSource:
    """Named tensors to copy in: their shapes and dtypes first, then each one's values on demand."""

    label: str  # how messages name the source (a repository-relative path, "shared memory", ...)
    complete: bool  # whether it must hold every weight of the LM (a checkpoint) or may hold some

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def pieces(self, name: str) -> Iterator[tuple[slice | None, torch.Tensor]]:
        """A tensor's values as (rows, values) pieces in order (rows None: the whole tensor)."""
        raise NotImplementedError


def weight_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors a checkpoint of `model` holds (parameters and persistent buffers, each shared
    tensor once, under its first name) and the aliases of tied ones (alias -> that name)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owner: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in owner:
            aliases[name] = owner[key]
        else:
            owner[key] = name
            tensors[name] = tensor
    return tensors, aliases


def _same_kind(incoming: torch.dtype, target: torch.dtype) -> bool:
    if target.is_floating_point or incoming.is_floating_point:
        return target.is_floating_point and incoming.is_floating_point
    return incoming == target


def check_infos(
    targets: Mapping[str, torch.Tensor], aliases: Mapping[str, str], infos: Mapping[str, TensorInfo], source
) -> dict[str, str]:
    """Which target each incoming tensor replaces (name -> target name), once every name, shape and
    dtype is checked; raises WeightUpdateError naming the first bad tensor."""
    plan: dict[str, str] = {}
    for name in sorted(infos):
        target_name = aliases.get(name, name)
        if target_name not in targets:
            raise WeightUpdateError(f"{source.label}: tensor {_quoted(name)} is not a weight of the served LM")
        if target_name in plan.values():
            continue  # a tied alias written under both names: the first copy is enough
        target, info = targets[target_name], infos[name]
        if tuple(target.shape) != tuple(info.shape):
            raise WeightUpdateError(
                f"{source.label}: tensor {_quoted(name)} has shape {list(info.shape)}, the served LM's has {list(target.shape)}"
            )
        if not _same_kind(info.dtype, target.dtype):
            raise WeightUpdateError(
                f"{source.label}: tensor {_quoted(name)} is {_dtype_name(info.dtype)}, the served LM's is "
                f"{_dtype_name(target.dtype)}"
            )
        plan[name] = target_name
    if source.complete:
        missing = sorted(set(targets) - set(plan.values()))
        if missing:
            raise WeightUpdateError(f"{source.label}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    if not plan:
        raise WeightUpdateError(f"{source.label}: no tensors to update")
    return plan


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_finite(name: str, source: WeightSource) -> None:
    for _, values in source.pieces(name):
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            raise WeightUpdateError(f"{source.label}: tensor {_quoted(name)} holds NaN or infinite values")


def checked_plan(model: torch.nn.Module, source: WeightSource) -> dict[str, str]:
    """Check `source` whole against `model` (names, shapes, dtypes, then every value finite) and
    return which target each of its tensors replaces; raises WeightUpdateError naming the first bad
    tensor. Nothing is written: a caller checks before it pauses anything (write_plan writes)."""
    targets, aliases = weight_tensors(model)
    plan = check_infos(targets, aliases, source.infos(), source)
    for name in plan:  # one piece in memory at a time: read, checked, dropped
        _check_finite(name, source)
    return plan


@torch.no_grad()
def write_plan(model: torch.nn.Module, source: WeightSource, plan: Mapping[str, str]) -> int:
    """Copy each tensor of a checked `source` into `model`'s own, one at a time; the tensors written."""
    targets, _ = weight_tensors(model)
    for name, target_name in plan.items():
        target = targets[target_name]
        for rows, values in source.pieces(name):
            (target if rows is None else target[rows]).copy_(values)
    return len(plan)


def copy_into(model: torch.nn.Module, source: WeightSource) -> int:
    """Check `source` whole, then copy it into `model` (checked_plan, then write_plan); returns the
    tensors written. Raises WeightUpdateError, with nothing written, for a source that cannot
    replace them."""
    return write_plan(model, source, checked_plan(model, source))


class CheckpointDirectory(WeightSource):
    """A Hugging Face directory's `*.safetensors` files (one or several shards), read tensor by
    tensor through safetensors' `safe_open` (a memory map: one tensor's values in memory at a time).

    `directory` is one resolve_checkpoint opened under the weights root (this takes it over), or a
    path, which is then a root of its own. Every file is opened once, here, under the root
    (weights_root.py), and read through that descriptor until close(): a name swapped for a link
    after the check is never read."""

    complete = True

    def __init__(self, directory: Path | RootedDirectory, label: str, served_config=None):
        self.label = label
        self._files: dict[str, RootedFile] = {}
        self._closer = weakref.finalize(self, _close_all, self._files)
        try:
            with open_root(str(directory)) if isinstance(directory, Path) else directory as opened:
                self._open_files(opened, served_config)
            self._read_headers()
        except BaseException:
            self.close()
            raise

    def _open_files(self, directory: RootedDirectory, served_config) -> None:
        names = [name for name in directory.entries() if name.endswith(SAFETENSORS_SUFFIX)]
        if not names:
            raise WeightUpdateError(f"{self.label}: no {SAFETENSORS_SUFFIX} files (save the model with safetensors)")
        if served_config is not None and directory.has_entry(CONFIG_FILE):
            with _open_under(directory, CONFIG_FILE, self.label) as config:
                _check_architecture(config, f"{self.label}/{CONFIG_FILE}", served_config)
        for name in names:
            self._files[name] = _open_under(directory, name, self.label)

    def _read_headers(self) -> None:
        self._where: dict[str, str] = {}
        self._infos: dict[str, TensorInfo] = {}
        for file_name in self._files:
            with self._open(file_name) as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    if name in self._where:
                        raise WeightUpdateError(f"{self.label}: tensor {_quoted(name)} is in two files")
                    view = handle.get_slice(name)
                    self._where[name] = file_name
                    self._infos[name] = TensorInfo(tuple(view.get_shape()), _safetensors_dtype(view.get_dtype(), name))

    def __enter__(self) -> CheckpointDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the checkpoint's files (garbage collection closes them too)."""
        self._closer()

    @property
    def files(self) -> list[str]:
        """The names of the checkpoint's safetensors files, sorted."""
        return list(self._files)

    def _open(self, file_name: str):
        from safetensors import safe_open

        try:
            return safe_open(self._files[file_name].path, framework="pt", device="cpu")
        except Exception as exc:  # a truncated file, a bad header: safetensors' own reason
            raise WeightUpdateError(
                f"{self.label}/{file_name} is not a readable safetensors file ({_safetensors_reason(exc)})"
            ) from None

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def pieces(self, name: str) -> Iterator[tuple[slice | None, torch.Tensor]]:
        info, file_name = self._infos[name], self._where[name]
        if not info.shape:
            yield None, self._read(file_name, name, None)
            return
        row_bytes = info.dtype.itemsize * math.prod(info.shape[1:])
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for start in range(0, info.shape[0], step):
            rows = slice(start, min(start + step, info.shape[0]))
            yield rows, self._read(file_name, name, rows)

    def _read(self, file_name: str, name: str, rows: slice | None) -> torch.Tensor:
        """Rows of one tensor, through a memory map opened for them alone (and closed after)."""
        try:
            with self._open(file_name) as handle:
                return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
        except WeightUpdateError:
            raise
        except Exception as exc:
            raise WeightUpdateError(
                f"{self.label}/{file_name}: tensor {_quoted(name)} cannot be read ({_safetensors_reason(exc)})"
            ) from None


def _close_all(files: dict[str, RootedFile]) -> None:
    for file in files.values():
        file.close()


def _open_under(directory: RootedDirectory, name: str, label: str) -> RootedFile:
    try:
        return directory.open_file(name)
    except PathRefused as refused:
        raise WeightUpdateError(f"{label}/{name} {refused.reason}") from None


def _quoted(text: str) -> str:
    """A name from a file, quoted and cut short: what identifies it, not a way to read the file."""
    return repr(text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "...")


def _safetensors_reason(exc: Exception) -> str:
    """safetensors' reason, without the part of its message that quotes the file (its JSON
    parser's, e.g. 'invalid type: string "...", expected ...')."""
    kept = ": ".join(str(exc).split(": ")[:2])
    return f"{type(exc).__name__}: {kept[:MAX_QUOTED_CHARS]}"


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_dtype(text: str, name: str) -> torch.dtype:
    if text not in _SAFETENSORS_DTYPES:
        raise WeightUpdateError(f"tensor {_quoted(name)} has dtype {text}, which no served LM takes")
    return _SAFETENSORS_DTYPES[text]


def _check_architecture(config_file: RootedFile, label: str, served_config) -> None:
    """A checkpoint's config.json must name the served LM's model type and architecture (when it
    has one: the shapes decide the rest). The refusal names the field, never the file's value."""
    try:
        config = json.loads(config_file.read(MAX_CONFIG_BYTES))
    except PathRefused as refused:
        raise WeightUpdateError(f"{label} {refused.reason}") from None
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"{label} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise WeightUpdateError(f"{label} is not a JSON object")
    for key in ("model_type", "architectures"):
        served = getattr(served_config, key, None)
        if key in config and served is not None and config[key] != served:
            raise WeightUpdateError(f"{label}: {key} is not the served LM's ({served!r})")


class NamedTensors(WeightSource):
    """Tensors already in this process (views of a shared-memory region, or received from a process
    group); `complete` False: a trainer may send only the weights it changed."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str, complete: bool = False):
        self.tensors, self.label, self.complete = tensors, label, complete

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def pieces(self, name: str) -> Iterator[tuple[slice | None, torch.Tensor]]:
        yield None, self.tensors[name]


def resolve_checkpoint(root: str, requested: str) -> tuple[RootedDirectory, str]:
    """The directory `requested` names under the allowed `root` (relative to it, or an absolute path
    under it), opened there (weights_root.py: links are followed only while they stay under the
    root), and how messages name it (relative to the root). CheckpointDirectory takes it over.
    Raises WeightUpdateError for anything outside the root or not a directory, never naming the
    server's absolute paths."""
    if not root:
        raise WeightUpdateError("updates from disk are off: the generate model's 'weights_root' parameter is empty")
    try:
        base = open_root(root)
    except OSError as exc:
        raise WeightUpdateError(f"the weights root cannot be opened ({os.strerror(exc.errno or 0)})") from None
    with base:
        try:
            directory = base.open_directory(requested)
        except PathRefused as refused:
            where = "" if refused.reason == OUTSIDE else " under the weights root"
            raise WeightUpdateError(f"model_path {_quoted(requested)} {refused.reason}{where}") from None
    return directory, directory.label
