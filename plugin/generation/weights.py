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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_SUFFIX = ".safetensors"
# A tensor on disk is read this many bytes at a time at most (whole rows), each piece from a fresh
# memory map: what an update adds to the process's memory is one piece, not the largest tensor.
CHUNK_BYTES = 8 * 2**20


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
            raise WeightUpdateError(f"{source.label}: tensor {name!r} is not a weight of the served LM")
        if target_name in plan.values():
            continue  # a tied alias written under both names: the first copy is enough
        target, info = targets[target_name], infos[name]
        if tuple(target.shape) != tuple(info.shape):
            raise WeightUpdateError(
                f"{source.label}: tensor {name!r} has shape {list(info.shape)}, the served LM's has {list(target.shape)}"
            )
        if not _same_kind(info.dtype, target.dtype):
            raise WeightUpdateError(
                f"{source.label}: tensor {name!r} is {_dtype_name(info.dtype)}, the served LM's is "
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
            raise WeightUpdateError(f"{source.label}: tensor {name!r} holds NaN or infinite values")


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
    tensor through safetensors' `safe_open` (a memory map: one tensor's values in memory at a time)."""

    complete = True

    def __init__(self, directory: Path, label: str, served_config=None):
        self.directory, self.label = directory, label
        self.files = sorted(directory.glob(f"*{SAFETENSORS_SUFFIX}"))
        if not self.files:
            raise WeightUpdateError(f"{label}: no {SAFETENSORS_SUFFIX} files (save the model with safetensors)")
        if served_config is not None:
            _check_architecture(directory / "config.json", f"{label}/config.json", served_config)
        self._where: dict[str, Path] = {}
        self._infos: dict[str, TensorInfo] = {}
        for path in self.files:
            with self._open(path) as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    if name in self._where:
                        raise WeightUpdateError(f"{label}: tensor {name!r} is in two files")
                    view = handle.get_slice(name)
                    self._where[name] = path
                    self._infos[name] = TensorInfo(tuple(view.get_shape()), _safetensors_dtype(view.get_dtype(), name))

    def _open(self, path: Path):
        from safetensors import safe_open

        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # a truncated file, a bad header: safetensors' own error says which
            raise WeightUpdateError(
                f"{self.label}/{path.name} is not a readable safetensors file ({type(exc).__name__}: {exc})"
            ) from None

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def pieces(self, name: str) -> Iterator[tuple[slice | None, torch.Tensor]]:
        info, path = self._infos[name], self._where[name]
        if not info.shape:
            yield None, self._read(path, name, None)
            return
        row_bytes = info.dtype.itemsize * math.prod(info.shape[1:])
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for start in range(0, info.shape[0], step):
            rows = slice(start, min(start + step, info.shape[0]))
            yield rows, self._read(path, name, rows)

    def _read(self, path: Path, name: str, rows: slice | None) -> torch.Tensor:
        """Rows of one tensor, through a memory map opened for them alone (and closed after)."""
        try:
            with self._open(path) as handle:
                return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
        except WeightUpdateError:
            raise
        except Exception as exc:
            raise WeightUpdateError(
                f"{self.label}/{path.name}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})"
            ) from None


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
        raise WeightUpdateError(f"tensor {name!r} has dtype {text}, which no served LM takes")
    return _SAFETENSORS_DTYPES[text]


def _check_architecture(config_file: Path, label: str, served_config) -> None:
    """A checkpoint's config.json must name the served LM's model type and architecture (when it
    has one: the shapes decide the rest)."""
    if not config_file.is_file():
        return
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"{label} is not readable JSON ({type(exc).__name__})") from None
    for key in ("model_type", "architectures"):
        served = getattr(served_config, key, None)
        if key in config and served is not None and config[key] != served:
            raise WeightUpdateError(f"{label}: {key} is {config[key]!r}, the served LM's is {served!r}")


class NamedTensors(WeightSource):
    """Tensors already in this process (views of a shared-memory region, or received from a process
    group); `complete` False: a trainer may send only the weights it changed."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str, complete: bool = False):
        self.tensors, self.label, self.complete = tensors, label, complete

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def pieces(self, name: str) -> Iterator[tuple[slice | None, torch.Tensor]]:
        yield None, self.tensors[name]


def resolve_checkpoint(root: str, requested: str) -> tuple[Path, str]:
    """The directory `requested` names, relative to the allowed `root` (an absolute path inside it
    is accepted too), and how messages name it (relative to the root). Raises WeightUpdateError
    for anything outside the root or not a directory, never naming the server's absolute paths."""
    if not root:
        raise WeightUpdateError("updates from disk are off: the generate model's 'weights_root' parameter is empty")
    base = Path(root).resolve()
    candidate = Path(requested)
    full = (candidate if candidate.is_absolute() else base / candidate).resolve()
    if not full.is_relative_to(base):
        raise WeightUpdateError(f"model_path {requested!r} is outside the allowed weights root")
    label = full.relative_to(base).as_posix() or "."
    if not full.is_dir():
        raise WeightUpdateError(f"model_path {label!r} is not a directory under the weights root")
    return full, label
