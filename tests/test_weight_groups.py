"""Weights over a torch.distributed process group (weight_transfer): the group a trainer's rank 0 and
a server instance both open (gloo on CPU, on a free loopback port), tensors broadcast from rank 0
arriving bit-exact in manifest order, and every bad argument refused with its message before any
connection is tried. The other rank of each group is opened here with torch.distributed itself, in
a thread, so only one side runs the code under test."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from triton_sampling_mask.generation.weight_transfer import (
    broadcast_tensors,
    manifest_of,
    open_process_group,
    receive_tensors,
)
from triton_sampling_mask.generation.weights import WeightUpdateError

HOST = "127.0.0.1"
TIMEOUT_S = 8.0  # every group here: a mutant that never connects fails in seconds, not minutes
GROUP = "weights-update-test"
TCP_STORE = dist.TCPStore  # the peers' own, whatever a test records


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


class Peer(threading.Thread):
    """The group's other rank, opened with torch.distributed directly; runs `action(group)`."""

    def __init__(self, port: int, rank: int, world_size: int, action):
        super().__init__(daemon=True)
        self.port, self.rank, self.world_size, self.action = port, rank, world_size, action
        self.error: BaseException | None = None
        self.result = None

    def run(self) -> None:
        try:
            timeout = timedelta(seconds=TIMEOUT_S)
            store = TCP_STORE(HOST, self.port, self.world_size, self.rank == 0, timeout=timeout)
            group = dist.ProcessGroupGloo(dist.PrefixStore(GROUP, store), self.rank, self.world_size, timeout)
            self.result = self.action(group)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self):
        self.join(TIMEOUT_S * 3)
        assert not self.is_alive(), "the peer rank never finished"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def peers():
    """Starts peers, and waits for each at teardown even when the test failed: a thread left inside
    gloo when the interpreter exits aborts the process."""
    started = []

    def start(port: int, rank: int, world_size: int, action) -> Peer:
        peer = Peer(port, rank, world_size, action)
        peer.start()
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.join(TIMEOUT_S * 3)


@pytest.fixture
def recorded_stores(monkeypatch):
    """Every TCPStore made while the test runs (the real ones, to read their settings)."""
    made = []

    def recording(*args, **kwargs):
        store = TCP_STORE(*args, **kwargs)
        made.append(store)
        return store

    monkeypatch.setattr(dist, "TCPStore", recording)
    return made


def test_a_server_rank_receives_the_trainers_tensors_bit_exact(peers, recorded_stores):
    tensors = sent_tensors()
    port = free_port()

    def trainer(group):
        for tensor in tensors.values():
            group.broadcast(tensor.clone(), 0).wait()

    peer = peers(port, 0, 2, trainer)
    group = open_process_group(HOST, port, 1, 2, GROUP, timeout_s=TIMEOUT_S)
    assert isinstance(group, dist.ProcessGroupGloo)
    assert (group.rank(), group.size()) == (1, 2)
    assert group.options._timeout == timedelta(seconds=TIMEOUT_S)
    [store] = recorded_stores
    assert (store.host, store.port, store.timeout) == (HOST, port, timedelta(seconds=TIMEOUT_S))
    # Over a group the manifest's offsets (a shared-memory field) are not checked.
    manifest = [{**entry, "offset": -1} for entry in manifest_of(tensors)]
    received = receive_tensors(group, manifest, torch.device("cpu"))
    peer.finish()
    assert received.label == "the weights update group"
    assert received.complete is False
    assert list(received.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert same_bits(received.tensors[name], tensor), name
        assert received.tensors[name].device.type == "cpu"


def test_the_trainers_rank_0_hosts_the_group_and_broadcasts_in_order(peers, recorded_stores):
    tensors = sent_tensors()
    manifest = manifest_of(tensors)
    port = free_port()

    def server(group):
        buffers = [torch.full(t.shape, 9, dtype=t.dtype) for t in tensors.values()]
        for buffer in buffers:
            group.broadcast(buffer, 0).wait()
        return buffers

    peer = peers(port, 1, 2, server)
    group = open_process_group(HOST, port, 0, 2, GROUP, backend="gloo", timeout_s=TIMEOUT_S)
    assert (group.rank(), group.size()) == (0, 2)
    [store] = recorded_stores
    assert (store.port, store.timeout) == (port, timedelta(seconds=TIMEOUT_S))
    sent = [t.clone() for t in tensors.values()]
    broadcast_tensors(group, sent)
    buffers = peer.finish()
    for name, tensor, buffer, mine in zip(tensors, tensors.values(), buffers, sent):
        assert same_bits(buffer, tensor), name
        assert same_bits(mine, tensor), name  # the sender's own tensors are left as they were
    assert [e["name"] for e in manifest] == list(tensors)


def test_a_group_of_one_opens_with_gloo_and_two_minutes_by_default():
    group = open_process_group(HOST, free_port(), 0, 1, GROUP)
    assert isinstance(group, dist.ProcessGroupGloo)
    assert (group.rank(), group.size()) == (0, 1)
    assert group.options._timeout == timedelta(seconds=120)
    tensor = torch.arange(4.0)
    broadcast_tensors(group, [tensor])
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]


class FakeNCCL:
    """Stands in for ProcessGroupNCCL (absent from CPU builds of torch): what it is given."""

    def __init__(self, store, rank, size):
        self.store, self.rank, self.size = store, rank, size


def test_nccl_groups_get_the_groups_own_store_rank_and_size(monkeypatch):
    port = free_port()
    timeout = timedelta(seconds=TIMEOUT_S)
    master = dist.TCPStore(HOST, port, 2, True, timeout=timeout, wait_for_workers=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = open_process_group(HOST, port, 1, 2, "nccl-group", backend="nccl", timeout_s=TIMEOUT_S)
    assert isinstance(group, FakeNCCL)
    assert (group.rank, group.size) == (1, 2)
    group.store.set("key", "value")  # under the group's prefix, on the host's store
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
