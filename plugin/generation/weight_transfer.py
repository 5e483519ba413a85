"""Named tensors from a trainer: a shared-memory region on the same host, or a torch.distributed
process group (gloo on CPU, NCCL on GPUs) between the trainer's rank 0 and each server instance.

Both ends describe a transfer with the same manifest: a list of {"name", "dtype", "shape"}
(and, in shared memory, "offset": where the tensor's bytes start in the region). dtypes are
torch's names ("float32", "bfloat16", ...). Over a process group rank 0 broadcasts the tensors
in manifest order, each as one contiguous tensor; the server receives them into buffers of its
own and checks them all before one is written (weights.copy_into).
"""

from __future__ import annotations

import mmap
import re
from datetime import timedelta
from pathlib import Path

import torch

from .weights import NamedTensors, WeightUpdateError

SHM_DIR = Path("/dev/shm")
# A POSIX shared-memory name as Python's multiprocessing.shared_memory makes them: no path.
_REGION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")
DTYPES = {
    name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int8")
}
GROUP_BACKENDS = ("gloo", "nccl")


def manifest_entry(entry: object, index: int, with_offset: bool) -> tuple[str, torch.dtype, tuple[int, ...], int]:
    """(name, dtype, shape, offset) of one manifest entry; raises WeightUpdateError naming it."""
    where = f"tensors[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise WeightUpdateError(f"{where} must be an object with a string 'name'")
    name = entry["name"]
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise WeightUpdateError(
            f"{where} ({name!r}): dtype must be one of {sorted(DTYPES)}, got {entry.get('dtype')!r}"
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise WeightUpdateError(f"{where} ({name!r}): shape must be a list of sizes >= 0")
    if not with_offset:  # a group's entries carry no bytes of their own: any offset is ignored
        return name, dtype, tuple(shape), 0
    offset = entry.get("offset", 0)
    if not _is_size(offset):
        raise WeightUpdateError(f"{where} ({name!r}): offset must be an integer >= 0")
    return name, dtype, tuple(shape), offset


def _is_size(value: object) -> bool:
    """A JSON integer >= 0 (JSON's true and false are not sizes, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entries(manifest: object, with_offset: bool) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    if not isinstance(manifest, list) or not manifest:
        raise WeightUpdateError("tensors must be a non-empty list of {name, dtype, shape} objects")
    entries = [manifest_entry(entry, i, with_offset) for i, entry in enumerate(manifest)]
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise WeightUpdateError("tensors names a tensor twice")
    return entries


class SharedMemoryTensors:
    """The tensors a trainer wrote into the POSIX shared-memory region `region` (/dev/shm/<region>),
    as read-only views of its memory map (no copy); a context manager that unmaps it."""

    def __init__(self, region: str, manifest: object):
        if not isinstance(region, str) or not _REGION_NAME.fullmatch(region):
            raise WeightUpdateError("shm_name must be a shared-memory region name (letters, digits, _.-; no path)")
        entries = _entries(manifest, with_offset=True)
        try:
            with open(SHM_DIR / region, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise WeightUpdateError(
                f"shared-memory region {region!r} cannot be opened ({type(exc).__name__})"
            ) from None
        self.label = f"shared-memory region {region!r}"
        self.tensors: dict[str, torch.Tensor] = {}
        buffer = memoryview(self._map)
        for name, dtype, shape, offset in entries:
            count = 1
            for size in shape:
                count *= size
            end = offset + count * dtype.itemsize
            if end > len(buffer):
                self.close()
                raise WeightUpdateError(f"{self.label}: tensor {name!r} ends at byte {end}, past the region's end")
            self.tensors[name] = (
                _readonly_view(buffer, dtype, count, offset).reshape(shape)
                if count
                else torch.empty(shape, dtype=dtype)
            )

    def source(self) -> NamedTensors:
        return NamedTensors(self.tensors, self.label)

    def close(self) -> None:
        self.tensors.clear()
        try:
            self._map.close()
        except BufferError:  # a view still alive: the map goes when the last one does
            pass

    def __enter__(self) -> SharedMemoryTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _readonly_view(buffer: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not writable: the views are read, never written
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


def open_process_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
):
    """A process group of `world_size` ranks on its own TCP store (rank 0 hosts it), apart from any
    default group the process has: what the trainer's rank 0 and each server instance both open.
    It is opened as SGLang's `init_custom_process_group` opens it (and AReaL's and SkyRL's copies
    of it): a `tcp://` rendezvous, the store under the prefix `group_name`, then torch's own group
    constructor, whose store keys a group made any other way does not share. Blocks until every
    rank has joined."""
    if backend not in GROUP_BACKENDS:
        raise WeightUpdateError(f"backend must be one of {list(GROUP_BACKENDS)}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise WeightUpdateError(f"rank {rank} is outside a world of {world_size}")
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{host}:{int(master_port)}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        group_desc=group_name,
    )
    # as SGLang does: its ranks are the world's, which torch.distributed's collectives look up
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_process_group(group) -> None:
    """Leave a group opened by open_process_group (its name may then be opened again)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)


def broadcast_tensors(group, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor (contiguous, in order) from rank `src` of `group` to every rank."""
    for tensor in tensors:
        group.broadcast(tensor, src).wait()


def receive_tensors(group, manifest: object, device: torch.device) -> NamedTensors:
    """Receive the manifest's tensors from rank 0 of `group`, in order, into fresh buffers."""
    received = {}
    for name, dtype, shape, _ in _entries(manifest, with_offset=False):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        group.broadcast(buffer, 0).wait()
        received[name] = buffer
    return NamedTensors(received, "the weights update group")


def manifest_of(tensors: dict[str, torch.Tensor]) -> list[dict]:
    """The manifest (name, dtype, shape) of named tensors, in the order they are sent."""
    return [
        {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        for name, t in tensors.items()
    ]
