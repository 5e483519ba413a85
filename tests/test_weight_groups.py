"""Weights over a torch.distributed process group (weight_transfer): the group a trainer's rank 0 and
a server instance both open (gloo on CPU, on a free loopback port), tensors broadcast from rank 0
arriving bit-exact in manifest order, and every bad argument refused with its message before any
connection is tried. The other rank of each group is opened as the RL frameworks open theirs
(SGLang's init_custom_process_group), in a process of its own (torch.distributed keeps one group
per name in a process), so only one side runs the code under test."""

from __future__ import annotations

import io
import multiprocessing
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from triton_sampling_mask.generation.weight_transfer import (
    broadcast_tensors,
    close_process_group,
    manifest_of,
    open_process_group,
    receive_tensors,
)
from triton_sampling_mask.generation.weights import WeightUpdateError

HOST = "127.0.0.1"
TIMEOUT_S = 8.0  # every group here: a mutant that never connects fails in seconds, not minutes
GROUP = "weights-update-test"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def sent_tensors() -> dict[str, torch.Tensor]:
    """Values whose every bit is known: negative zero, extremes, a bfloat16 and an empty tensor."""
    return {
        "layers.0.weight": torch.tensor([[0.0, -0.0, 1.5], [-2.25, 3.4028235e38, 1.4e-45]], dtype=torch.float32),
        "layers.0.bias": torch.tensor([1.0 / 3.0, -1e-300], dtype=torch.float64),
        "norm.weight": torch.tensor([0.1, -7.0, 65280.0], dtype=torch.bfloat16),
        "steps": torch.tensor([-(2**62), 0, 2**62 + 1], dtype=torch.int64),
        "codes": torch.tensor([[-128], [127]], dtype=torch.int8),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.view(torch.uint8))


class FakeGroup:
    """A group's broadcast as receive_tensors uses it: fills each buffer with its index + 1 and
    records the buffers and source ranks."""

    def __init__(self):
        self.calls = []

    def broadcast(self, buffer, src):
        self.calls.append((buffer, src))
        if buffer.device.type != "meta":
            buffer.fill_(len(self.calls))
        return self

    def wait(self):
        return True


def test_buffers_are_made_on_the_device_asked_for_and_filled_from_rank_0():
    manifest = [
        {"name": "a", "dtype": "int32", "shape": [2, 2]},
        {"name": "b", "dtype": "bfloat16", "shape": [3]},
    ]
    group = FakeGroup()
    received = receive_tensors(group, manifest, torch.device("cpu"))
    assert [src for _, src in group.calls] == [0, 0]
    assert [buffer is received.tensors[name] for (buffer, _), name in zip(group.calls, "ab")] == [True, True]
    assert received.tensors["a"].dtype == torch.int32 and received.tensors["a"].tolist() == [[1, 1], [1, 1]]
    assert received.tensors["b"].dtype == torch.bfloat16 and received.tensors["b"].tolist() == [2.0, 2.0, 2.0]
    on_meta = receive_tensors(FakeGroup(), manifest, torch.device("meta"))
    assert {name: (t.device.type, t.dtype, tuple(t.shape)) for name, t in on_meta.tensors.items()} == {
        "a": ("meta", torch.int32, (2, 2)),
        "b": ("meta", torch.bfloat16, (3,)),
    }


def test_a_bad_manifest_is_refused_before_anything_is_received():
    group = FakeGroup()
    with pytest.raises(WeightUpdateError) as caught:
        receive_tensors(group, [{"name": "a", "dtype": "int32", "shape": [2]}, {"name": "a"}], torch.device("cpu"))
    assert caught.value.message.startswith("tensors[1] ('a'): dtype must be one of")
    assert group.calls == []


def sglang_peer(port: int, rank: int, tensors: dict, results) -> None:
    """The group's other rank, in a process of its own, opened as SGLang's init_custom_process_group
    opens it (AReaL and SkyRL carry copies): a tcp:// rendezvous, PrefixStore(group name), torch's
    group constructor. Rank 0 broadcasts `tensors`; another rank receives into buffers of 9s and
    puts them in `results`."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=TIMEOUT_S)
    try:
        store, rank, world = next(rendezvous(f"tcp://{HOST}:{port}", rank, 2, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world, rank, [], Backend("gloo"), PrefixStore(GROUP, store), group_name=GROUP, timeout=timeout
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world)}
        if rank == 0:
            for tensor in tensors.values():
                dist.broadcast(tensor.clone(), 0, group=group)
            results.put("sent")
        else:
            buffers = {name: torch.full(t.shape, 9, dtype=t.dtype) for name, t in tensors.items()}
            for buffer in buffers.values():
                dist.broadcast(buffer, 0, group=group)
            saved = io.BytesIO()  # bytes: a tensor sent through a queue outlives its process badly
            torch.save(buffers, saved)
            results.put(saved.getvalue())
    except BaseException as exc:  # reported by the test
        results.put(repr(exc))


@pytest.fixture
def peer():
    """Starts the peer process; kills it at teardown if the test left it waiting."""
    started = []
    context = multiprocessing.get_context("spawn")

    def start(port: int, rank: int, tensors: dict):
        results = context.Queue()
        process = context.Process(target=sglang_peer, args=(port, rank, tensors, results))
        process.start()
        started.append(process)
        return lambda: results.get(timeout=TIMEOUT_S * 4)

    yield start
    for process in started:
        process.join(TIMEOUT_S * 2)
        if process.is_alive():
            process.kill()


def test_a_server_rank_receives_a_framework_trainers_tensors_bit_exact(peer):
    """Fails with a group made any other way than the frameworks make theirs: their store keys
    differ, and both ranks wait for each other until the timeout."""
    tensors = sent_tensors()
    port = free_port()
    outcome = peer(port, 0, tensors)
    group = open_process_group(HOST, port, 1, 2, GROUP, timeout_s=TIMEOUT_S)
    try:
        assert (group.rank(), group.size()) == (1, 2)
        # Over a group the manifest's offsets (a shared-memory field) are not checked.
        manifest = [{**entry, "offset": -1} for entry in manifest_of(tensors)]
        received = receive_tensors(group, manifest, torch.device("cpu"))
        assert outcome() == "sent"
    finally:
        close_process_group(group)
    assert received.label == "the weights update group"
    assert received.complete is False
    assert list(received.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert same_bits(received.tensors[name], tensor), name
        assert received.tensors[name].device.type == "cpu"


def test_the_trainers_rank_0_hosts_the_group_and_broadcasts_in_order(peer):
    tensors = sent_tensors()
    manifest = manifest_of(tensors)
    port = free_port()
    outcome = peer(port, 1, tensors)
    group = open_process_group(HOST, port, 0, 2, GROUP, backend="gloo", timeout_s=TIMEOUT_S)
    try:
        assert (group.rank(), group.size()) == (0, 2)
        sent = [t.clone() for t in tensors.values()]
        broadcast_tensors(group, sent)
        buffers = outcome()
    finally:
        close_process_group(group)
    assert isinstance(buffers, bytes), buffers
    buffers = torch.load(io.BytesIO(buffers))
    for (name, tensor), mine in zip(tensors.items(), sent):
        assert same_bits(buffers[name], tensor), name
        assert same_bits(mine, tensor), name  # the sender's own tensors are left as they were
    assert [e["name"] for e in manifest] == list(tensors)


def test_a_group_of_one_opens_with_gloo_and_two_minutes_by_default_and_reopens_once_closed():
    for _ in range(2):  # a closed group's name may be opened again (a trainer that restarts)
        group = open_process_group(HOST, free_port(), 0, 1, GROUP)
        try:
            assert (group.rank(), group.size()) == (0, 1)
            gloo = group._get_backend(torch.device("cpu"))
            assert isinstance(gloo, dist.ProcessGroupGloo)
            assert gloo.options._timeout == timedelta(seconds=120)
            tensor = torch.arange(4.0)
            broadcast_tensors(group, [tensor])
            assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
        finally:
            close_process_group(group)


def test_nccl_groups_are_asked_of_torch_under_the_groups_own_name_and_store(monkeypatch):
    made = {}

    def constructor(size, rank, ranks, backend, store, group_name, **options):
        made.update(size=size, rank=rank, backend=str(backend), group_name=group_name, store=store)
        return object(), None

    monkeypatch.setattr(dist.distributed_c10d, "_new_process_group_helper", constructor)
    port = free_port()
    master = dist.TCPStore(HOST, port, 2, True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    group = open_process_group(HOST, port, 1, 2, "nccl-group", backend="nccl", timeout_s=TIMEOUT_S)
    dist.distributed_c10d._world.pg_group_ranks.pop(group)
    assert {k: made[k] for k in ("size", "rank", "backend", "group_name")} == {
        "size": 2,
        "rank": 1,
        "backend": "nccl",
        "group_name": "nccl-group",
    }
    made["store"].set("key", "value")  # under the group's prefix, on the host's store
    assert master.get("nccl-group/key") == b"value"


@pytest.mark.parametrize("backend", ["mpi", "GLOO", "", None])
def test_an_unknown_backend_is_refused(backend):
    with pytest.raises(WeightUpdateError) as caught:
        open_process_group(HOST, free_port(), 0, 1, GROUP, backend=backend, timeout_s=2)
    assert caught.value.message == f"backend must be one of ['gloo', 'nccl'], got {backend!r}"


@pytest.mark.parametrize("rank, world_size", [(-1, 2), (2, 2), (3, 2), (0, 0), (1, 1)])
def test_a_rank_outside_the_world_is_refused_before_connecting(rank, world_size):
    with pytest.raises(WeightUpdateError) as caught:
        open_process_group(HOST, free_port(), rank, world_size, GROUP, timeout_s=2)
    assert caught.value.message == f"rank {rank} is outside a world of {world_size}"
