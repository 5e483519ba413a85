"""A real tritonserver on free ports for the whole session, with HTTP and gRPC clients."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from triton_sampling_mask.ops.launcher import TritonServer

from .server import ExternalTritonServer, build_test_repository


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    external = ExternalTritonServer.from_environment()
    if external is not None:  # docker/run-gpu-tests.sh serves the same repository in a container
        yield external
        return
    repository = build_test_repository(tmp_path_factory.mktemp("models") / "model_repository")
    server = TritonServer(repository, log_path=tmp_path_factory.mktemp("logs") / "tritonserver.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def http_client(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url, concurrency=16)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    yield client
    client.close()


@pytest.fixture(params=["http", "grpc"])
def protocol(request, http_client, grpc_client):
    """(client, tritonclient module) for each protocol in turn."""
    if request.param == "http":
        return http_client, httpclient
    return grpc_client, grpcclient
