"""The front door's parts without a server: the generated HAProxy config (valid for `haproxy -c`,
body caps derived from the model configs), its private files, the stream gate's reading of
Triton's responses, and the memory cage."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from triton_sampling_mask.model_config import dims, read_config_file
from triton_sampling_mask.ops import memory_limit, proxy, proxy_config, proxy_metrics
from triton_sampling_mask.ops.proxy import FrontDoor, ProxyError
from triton_sampling_mask.ops.proxy_config import ProxyLimits, ProxyPlan
from triton_sampling_mask.ops.stream_gate import is_final

REPO_ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = REPO_ROOT / "model_repository"
# TYPE_STRING (generate's `control`): 8, the proxy's figure for a type without a fixed size.
BYTES = {"TYPE_FP32": 4, "TYPE_INT32": 4, "TYPE_UINT64": 8, "TYPE_BOOL": 1, "TYPE_STRING": 8}
needs_haproxy = pytest.mark.skipif(proxy.find_haproxy() is None, reason="haproxy is not installed")


def parsed(model: str) -> dict:
    """A shipped config.pbtxt as Triton's JSON (the package's one reader: protobuf, Triton's schema)."""
    return read_config_file(REPOSITORY / model / "config.pbtxt")


def row_bytes(config: dict, variable: int) -> int:
    """One row of every input, a -1 dimension counted as `variable` elements."""
    return sum(BYTES[i["data_type"]] * (variable if -1 in dims(i) else 1) for i in config["input"])


def test_body_caps_follow_the_model_configs():
    routes = {route.name: route for route in proxy_config.model_routes(REPOSITORY, 12288)}
    sampler, generate = parsed("sampler"), parsed("generate")
    vocab = int(sampler["parameters"]["max_vocab_size"]["string_value"])
    row = row_bytes(sampler, vocab)
    assert routes["sampler"].body_limit_bytes == sampler["max_batch_size"] * row + 12288 + proxy_config.BODY_SLACK_BYTES
    assert routes["sampler"].body_limit_bytes >= 256 * 262144 * 4  # the largest request the README promises
    assert (
        not routes["sampler"].decoupled
        and routes["generate"].decoupled == generate["model_transaction_policy"]["decoupled"]
    )
    budget = int(generate["parameters"]["kv_budget_tokens"]["string_value"])
    row = row_bytes(generate, budget)
    expected = generate["max_batch_size"] * row * proxy_config.JSON_TEXT_FACTOR + 12288 + proxy_config.BODY_SLACK_BYTES
    assert routes["generate"].body_limit_bytes == expected


def test_a_model_without_a_bound_on_its_variable_dims_gets_the_fallback_cap(tmp_path):
    (tmp_path / "free").mkdir()
    (tmp_path / "free" / "config.pbtxt").write_text(
        'name: "free"  # a comment with "quotes"\nmax_batch_size: 4\ninput [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
    )
    [route] = proxy_config.model_routes(tmp_path, 100)
    assert route.body_limit_bytes == proxy_config.UNBOUNDED_MODEL_BODY_BYTES and not route.decoupled


def plan(tmp_path: Path, **limits) -> ProxyPlan:
    key_file = tmp_path / "admin.key"
    key_file.write_text("user-key\n")
    return ProxyPlan(
        public={"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 18003, "api": 18004},
        internal={"http": 19000, "grpc": 19001, "metrics": 19002, "probe": 19003, "stream_gate": 19004, "api": 19005},
        admin_key_file=key_file,
        internal_key="internal-key",
        routes=proxy_config.model_routes(REPOSITORY, 12288),
        limits=ProxyLimits(**limits),
    )


@needs_haproxy
@pytest.mark.parametrize("open_admin", [False, True])
def test_the_generated_config_passes_haproxy_check_without_a_warning(tmp_path, open_admin):
    config = plan(tmp_path)
    if open_admin:
        config = dataclasses.replace(config, admin_key_file=None)
    exporter = proxy_metrics.exporter_available(proxy.find_haproxy())
    if exporter:  # the counters' unix socket (ops.proxy_metrics), where this haproxy has the exporter
        config = dataclasses.replace(config, stats_socket=tmp_path / "stats.sock")
    path = tmp_path / "haproxy.cfg"
    path.write_text(proxy_config.render(config))
    done = subprocess.run([proxy.find_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    text = path.read_text()
    assert "stats socket" not in text.replace("# no stats socket", "")  # 'show acl' would print the key
    assert ("admin_ok always_true" in text) == open_admin
    assert "user-key" not in text  # the user's key stays in its own file
    assert (f"bind unix@{tmp_path / 'stats.sock'} mode 600" in text) == exporter


def test_the_config_holds_the_limits_it_is_given(tmp_path):
    text = proxy_config.render(
        plan(tmp_path, max_connections=900, max_in_flight=7, max_queue=5, queue_timeout_s=1.5, requests_per_ip=3)
    )
    assert "maxconn 450\n" in text  # half for each of the HTTP and gRPC ports
    assert text.count("maxconn 7\n") == 6  # every model route's server, HTTP and unary gRPC, and the API's
    assert "127.0.0.1:19004 proto h2 maxconn 0\n" in text  # streams: the stream gate keeps their queue
    # each model route counts every address's requests in a table of its own, refused past 3
    for backend in proxy_config.SHARED_BACKENDS:
        assert f"track-sc2 src table st_share_{backend} if " in text and f"backend st_share_{backend}\n" in text
    assert text.count("{ sc2_trackers gt 3 }") == 3  # HTTP, gRPC and the API's frontends
    assert "queue(be_http_sampler) ge 5" in text and "queue(be_grpc_infer) ge 5" in text
    assert "timeout queue 1500ms" in text
    assert "bind 0.0.0.0:18000\n" in text and "127.0.0.1:19004 proto h2" in text


@needs_haproxy
def test_prepare_writes_private_files_and_a_bad_config_fails_loudly(tmp_path, monkeypatch):
    door = FrontDoor(REPOSITORY, {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 0}, "user-key")
    try:
        door.prepare()
        assert stat.S_IMODE(door.directory.stat().st_mode) == 0o700
        for name in ("admin.key", "haproxy.cfg"):
            assert stat.S_IMODE((door.directory / name).stat().st_mode) == 0o600
        assert (door.directory / "admin.key").read_text() == "user-key\n"
        assert door.internal_key in door.config_path.read_text() and door.internal_key != "user-key"
        with pytest.raises(FileExistsError):  # never written through a file someone planted
            proxy.write_private(door.directory / "admin.key", "x")
    finally:
        door.clean_up()
    monkeypatch.setattr(proxy_config, "render", lambda plan: "frontend broken\n    bind :notaport\n")
    broken = FrontDoor(REPOSITORY, {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 0}, "user-key")
    try:
        with pytest.raises(ProxyError, match="haproxy refuses the generated config"):
            broken.prepare()
    finally:
        broken.clean_up()


def test_a_descriptor_limit_too_low_for_the_connection_cap_is_refused_with_the_fix():
    limits = ProxyLimits(max_connections=10**9)
    door = FrontDoor(REPOSITORY, {"http": 1, "grpc": 2, "metrics": 3, "probe": 0}, "k", limits=limits)
    if proxy.find_haproxy() is None:
        pytest.skip("haproxy is not installed")
    with pytest.raises(ProxyError, match="PROXY_MAX_CONNECTIONS"):
        door.prepare()
    assert door.directory is None


def response(final: bool | None = None, error: str = "", request_id: str = "", outputs: int = 0) -> bytes:
    """A ModelStreamInferResponse as Triton serializes it."""
    message = service_pb2.ModelStreamInferResponse(error_message=error)
    if not error:
        message.infer_response.model_name = "sampler"
        message.infer_response.id = request_id
        if final is not None:
            message.infer_response.parameters["triton_final_response"].bool_param = final
        for _ in range(outputs):
            message.infer_response.raw_output_contents.append(np.zeros(64, np.float32).tobytes())
    return message.SerializeToString()


def test_the_stream_gate_tells_a_requests_last_response():
    assert is_final(response(final=True))
    assert is_final(response(final=True, outputs=3, request_id="r" * 300))
    assert not is_final(response(final=False, outputs=1))
    assert not is_final(response())  # no flag at all
    assert is_final(response(error="bad request"))
    # an id that spells the flag is still the id, not the parameter
    assert not is_final(response(final=False, request_id="\n\x15triton_final_response\x12\x02\x08\x01"))
    assert not is_final(b"") and not is_final(b"\x12\xff\xff") and not is_final(b"\x12\x05\x08")


def test_the_memory_cage_falls_back_to_an_address_space_limit_that_holds(monkeypatch):
    monkeypatch.setattr(memory_limit, "_mounts", lambda: [])
    monkeypatch.setattr(memory_limit.Path, "glob", lambda self, pattern: iter(()))
    cage = memory_limit.make_cage("unused", 512 * 2**20)
    assert cage.kind == "address space" and cage.path is None
    code = "bytearray(1024 * 2**20)"
    assert subprocess.run([sys.executable, "-c", code], preexec_fn=cage.enter, capture_output=True).returncode != 0
    assert subprocess.run([sys.executable, "-c", "bytearray(64 * 2**20)"], preexec_fn=cage.enter).returncode == 0
    assert memory_limit.make_cage("unused", 0).kind == "none"


def test_a_cgroup_cage_kills_only_what_runs_in_it_and_counts_it():
    cage = memory_limit.make_cage(f"tsm-cage-test-{os.getpid()}", 256 * 2**20)
    if cage.path is None:
        pytest.skip(f"no writable memory cgroup here ({cage.describe()})")
    try:
        done = subprocess.run([sys.executable, "-c", "bytearray(1024 * 2**20)"], preexec_fn=cage.enter)
        assert done.returncode == -9 and cage.oom_kills() >= 1
    finally:
        cage.remove()
    assert not cage.path.exists()


def test_the_side_ports_bind_where_the_deployment_says(tmp_path):
    text = proxy_config.render(dataclasses.replace(plan(tmp_path), side_bind_address="127.0.0.1"))
    assert "bind 127.0.0.1:18002\n" in text and "bind 127.0.0.1:18003\n" in text  # metrics, probe
    assert "bind 0.0.0.0:18000\n" in text and "bind 0.0.0.0:18001 proto h2\n" in text  # the public ones
