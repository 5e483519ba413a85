"""The tests' tritonserver harness: a port another process took between `free_port` and
tritonserver's bind (any connection's ephemeral port may land there) costs a restart on fresh
ports, not the tests that needed the server."""

from __future__ import annotations

import socket

import pytest

from testbed.server import ExternalTritonServer, TritonServer, copy_model
from testbed.stack import free_port_block
from triton_sampling_mask.ops.proxy import INTERNAL_PORTS


def test_a_port_taken_before_tritonserver_binds_it_is_replaced(tmp_path):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver of its own")
    repository = tmp_path / "models"
    copy_model(repository, "sampler")
    server = TritonServer(repository, log_path=tmp_path / "tritonserver.log")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        server.ports["http"] = taken.getsockname()[1]
        with server:
            assert server.ports["http"] != taken.getsockname()[1]
            assert server.is_ready()


def test_port_blocks_chosen_side_by_side_never_overlap():
    """Stacks launched together (the router bench's replicas) choose their internal port blocks
    before any of them binds one: no two blocks this process hands out may share a port."""
    count = len(INTERNAL_PORTS)
    blocks = [free_port_block(count) for _ in range(300)]
    ports = [port for base in blocks for port in range(base, base + count)]
    assert len(ports) == len(set(ports))
