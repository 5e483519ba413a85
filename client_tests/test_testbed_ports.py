"""The tests' tritonserver harness: a port another process took between `free_port` and
tritonserver's bind (any connection's ephemeral port may land there) costs a restart on fresh
ports, not the tests that needed the server; a launched stack whose server cannot start fails
its start, naming why, instead of waiting out the last-resort cap."""

from __future__ import annotations

import re
import socket

import pytest

from testbed.server import ExternalTritonServer, TritonServer, copy_model
from testbed.stack import RESTARTS_BEFORE_READY, free_port_block, launch, shipped_repository
from testbed.startup_wait import StartupFailed
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


def test_a_stack_whose_server_cannot_bind_fails_its_start_naming_the_restarts(tmp_path):
    """The supervisor restarts a tritonserver that cannot bind its port for good (with a backoff):
    the harness gives up after a few restarts, not after the 900 s cap."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("launches a local stack of its own")
    base = free_port_block(len(INTERNAL_PORTS))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + INTERNAL_PORTS.index("http")))
        taken.listen()
        with pytest.raises(StartupFailed) as failed:
            launch(
                shipped_repository(tmp_path / "models", ("sampler",)),
                tmp_path / "launcher.log",
                env={"TRITON_INTERNAL_PORT_BASE": base},
                api=False,
                stack_memory_bytes=None,
            )
    restarts = re.search(r"restarted tritonserver (\d+) times before it was ready", str(failed.value))
    assert restarts and int(restarts[1]) >= RESTARTS_BEFORE_READY, str(failed.value)
