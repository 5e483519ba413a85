"""The front door's parts without a server: the HAProxy template with the values the launcher gives
it (valid for `haproxy -c`, body caps derived from the model configs), its private files, the
stream gate's reading of Triton's responses, and the memory cage."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from triton_sampling_mask.model_config import dims, read_config_file
from triton_sampling_mask.ops import memory_limit, model_limits, proxy, proxy_metrics
from triton_sampling_mask.ops.proxy import TEMPLATE, FrontDoor, ProxyError, ProxyLimits
from triton_sampling_mask.ops.secret_files import API_KEY_CLIENT, write_secret_file
from triton_sampling_mask.ops.stream_gate import is_final
from triton_sampling_mask.sampling.refusals import RETRY_MARKER

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
    routes = {route.name: route for route in model_limits.model_routes(REPOSITORY, 12288)}
    sampler, generate = parsed("sampler"), parsed("generate")
    vocab = int(sampler["parameters"]["max_vocab_size"]["string_value"])
    row = row_bytes(sampler, vocab)
    assert routes["sampler"].body_limit_bytes == sampler["max_batch_size"] * row + 12288 + model_limits.BODY_SLACK_BYTES
    assert routes["sampler"].body_limit_bytes >= 256 * 262144 * 4  # the largest request the README promises
    assert (
        not routes["sampler"].decoupled
        and routes["generate"].decoupled == generate["model_transaction_policy"]["decoupled"]
    )
    budget = int(generate["parameters"]["kv_budget_tokens"]["string_value"])
    row = row_bytes(generate, budget)
    expected = generate["max_batch_size"] * row * model_limits.JSON_TEXT_FACTOR + 12288 + model_limits.BODY_SLACK_BYTES
    assert routes["generate"].body_limit_bytes == expected


def test_a_model_without_a_bound_on_its_variable_dims_gets_the_fallback_cap(tmp_path):
    (tmp_path / "free").mkdir()
    (tmp_path / "free" / "config.pbtxt").write_text(
        'name: "free"  # a comment with "quotes"\nmax_batch_size: 4\ninput [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
    )
    [route] = model_limits.model_routes(tmp_path, 100)
    assert route.body_limit_bytes == model_limits.UNBOUNDED_MODEL_BODY_BYTES and not route.decoupled


PUBLIC = {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 18003, "api": 18004}
INTERNAL = {"http": 19000, "grpc": 19001, "metrics": 19002, "probe": 19003, "stream_gate": 19004, "api": 19005}


def door(tmp_path: Path, admin_key: str | None = "user-key", **limits) -> FrontDoor:
    """A front door on fixed ports, with client keys (TRITON_API_KEY's among them), its files
    written into `tmp_path`."""
    keys = {"trainer": "t" * 40, API_KEY_CLIENT: "a" * 40}
    front = FrontDoor(
        REPOSITORY, PUBLIC, admin_key, dict(INTERNAL), ProxyLimits(**limits), "internal-key", client_keys=keys
    )
    front.directory = tmp_path
    front.write_files()
    return front


def template_variables() -> set[str]:
    """Every variable the template reads ("${NAME}" or `.if defined(NAME)`), but the messages it sets itself."""
    names = re.findall(r"\$\{(\w+)\}|defined\((\w+)\)", TEMPLATE.read_text())
    return {name for pair in names for name in pair if name and not name.startswith("MSG_")}


@needs_haproxy
@pytest.mark.parametrize("open_admin", [False, True])
def test_the_template_passes_haproxy_check_without_a_warning(tmp_path, open_admin):
    front = door(tmp_path, None if open_admin else "user-key")
    done = front.check()
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    environment = front.environment()
    assert ("DOOR_ADMIN_KEY_FILE" in environment) != open_admin
    assert "user-key" not in environment.values()  # the user's key stays in its own file
    assert "stats socket" not in TEMPLATE.read_text().replace("# no stats socket", "")  # 'show acl' would print it
    exporter = proxy_metrics.exporter_available(proxy.find_haproxy())
    assert environment.get("DOOR_STATS_SOCKET") == (str(tmp_path / "stats.sock") if exporter else None)


def test_the_launcher_gives_the_template_every_value_it_reads_and_nothing_else(tmp_path):
    environment = door(tmp_path).environment()
    # the connection cap and a stream's open requests become other values (DOOR_MAXCONN, the gate's)
    assert set(environment) == template_variables() | {"PROXY_MAX_CONNECTIONS", "PROXY_STREAM_MAX_OPEN"}
    assert all(environment.values())  # a switch that is off is left undefined, never empty
    off = FrontDoor(REPOSITORY, {"http": 1, "grpc": 2}, None, dict(INTERNAL), stream_gate=False, json_checks=False)
    switches = {"DOOR_ADMIN_KEY_FILE", "DOOR_JSON_CHECKS", "DOOR_STREAM_GATE", "DOOR_STATS_SOCKET", "DOOR_CLIENT_KEYS"}
    switches |= {"DOOR_API_AUTHORIZATION"}
    ports = {"TRITON_METRICS_PORT", "TRITON_PROBE_PORT", "TRITON_API_PORT"}
    assert set(off.environment()) == set(environment) - switches - ports


def test_the_values_hold_the_limits_and_models_they_are_given(tmp_path):
    front = door(tmp_path, max_connections=900, max_in_flight=7, max_queue=5, queue_timeout_s=1.5, requests_per_ip=3)
    environment = front.environment()
    # half for each of the HTTP and gRPC ports, and on each HTTP port room for one keyed client
    keyed = ProxyLimits().keyed_connections_per_ip
    assert environment["DOOR_PORT_MAXCONN"] == str(450 + keyed)
    assert environment["DOOR_MAXCONN"] == str(900 + 2 * keyed + 2 * proxy.SIDE_PORT_CONNECTIONS)
    assert (environment["PROXY_MAX_IN_FLIGHT"], environment["PROXY_MAX_QUEUE"]) == ("7", "5")
    assert (environment["PROXY_QUEUE_TIMEOUT_MS"], environment["PROXY_REQUESTS_PER_IP"]) == ("1500", "3")
    routes = {route.name: route for route in model_limits.model_routes(REPOSITORY, 12288)}
    maps = {
        path.stem: dict(line.split(" ", 1) for line in path.read_text().splitlines()) for path in tmp_path.glob("*.map")
    }
    assert maps["model_kinds"] == {"generate": "generator", "sampler": "sampler"}
    assert maps["body_limits"] == {name: str(route.body_limit_bytes) for name, route in routes.items()}
    assert (
        maps["input_specs"]["sampler"].split()[0] == "logits:FP32"
        and "admin_key:BYTES" in maps["input_specs"]["generate"]
    )


@needs_haproxy
def test_prepare_writes_private_files_and_a_bad_value_fails_loudly(tmp_path):
    door = FrontDoor(REPOSITORY, {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 0}, "user-key")
    try:
        door.prepare()
        assert stat.S_IMODE(door.directory.stat().st_mode) == 0o700
        for path in door.directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert {path.name for path in door.directory.iterdir()} >= {"admin.key", "body_limits.map"}
        assert (door.directory / "admin.key").read_text() == "user-key\n"
        assert door.environment()["DOOR_INTERNAL_KEY"] == door.internal_key != "user-key"
        with pytest.raises(FileExistsError):  # never written through a file someone planted
            write_secret_file(door.directory / "admin.key", "x")
    finally:
        door.clean_up()
    # TRITON_SIDE_PORTS_ADDRESS naming no address
    ports = {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 0}
    broken = FrontDoor(REPOSITORY, ports, "user-key", side_bind_address="no-such-host.invalid")
    try:
        with pytest.raises(ProxyError, match=r"(?s)haproxy refuses the front door.s values.*no-such-host"):
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


@needs_haproxy
def test_a_private_directory_too_long_for_haproxys_socket_goes_without_the_exporter(monkeypatch):
    """HAProxy refuses a unix socket path over 97 bytes (it binds `<path>.<pid>.tmp` first), 10 fewer
    than the kernel: the exporter's socket is then left out and the door starts; the stream gate's
    (bound by Python) stays."""
    short = Path(tempfile.mkdtemp(prefix="d"))
    owner = len(f"pid{os.getpid()}-")  # <base>/triton-front-door-pid<pid>-XXXXXXXX/stats.sock: 100 bytes
    base = short / ("d" * (62 - owner - len(str(short)) - 1))
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    door = FrontDoor(REPOSITORY, {"http": 18000, "grpc": 18001, "metrics": 18002, "probe": 0}, "user-key")
    try:
        door.prepare()
        assert len(str(door.directory / "stats.sock")) == 100 and door.stats_socket is None
        assert door.gate_socket is not None and "DOOR_STATS_SOCKET" not in door.environment()
    finally:
        door.clean_up()
        shutil.rmtree(short)


@needs_haproxy
def test_the_launcher_checks_the_door_a_start_would_run_and_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """What the image's build runs: the launcher's own front door (its defences, client keys and
    ports) checked by `haproxy -c`, its values printed with the secrets redacted, and no key file,
    map or directory left."""
    from triton_sampling_mask.ops import launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE", "TRITON_CLIENT_KEYS_FILE", "TRITON_PROXY"):
        monkeypatch.delenv(name, raising=False)
    api_key = "k" * 40
    monkeypatch.setenv("TRITON_API_KEY", api_key)
    launcher.main(["--model-repository", str(REPOSITORY), "--check-door"])
    out = capsys.readouterr().out
    assert "DOOR_INTERNAL_KEY=<secret>" in out and "DOOR_API_AUTHORIZATION=<secret>" in out, out
    assert "DOOR_ADMIN_KEY_FILE=" in out and "DOOR_STREAM_GATE=on" in out and "DOOR_CLIENT_KEYS=on" in out, out
    assert api_key not in out and "client_keys.map" not in out, out
    routes = {route.name: route for route in model_limits.model_routes(REPOSITORY, 12288)}
    maps = out[out.index("\nbody_limits.map:\n") :]
    assert f"\nsampler {routes['sampler'].body_limit_bytes}\n" in maps[: maps.index("input_specs.map")], out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("refusal", ["client keys", "haproxy"])
def test_a_launcher_that_refuses_to_start_leaves_no_generated_admin_key(tmp_path, monkeypatch, refusal):
    """A start stopped by an unusable client key file, or by HAProxy refusing the door's values,
    removes the admin key it generated (and its private directory)."""
    from triton_sampling_mask.ops import launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE", "TRITON_CLIENT_KEYS_FILE", "TRITON_PROXY"):
        monkeypatch.delenv(name, raising=False)
    if refusal == "client keys":
        monkeypatch.setenv("TRITON_CLIENT_KEYS_FILE", "/nonexistent/client.keys")
    else:
        refused = subprocess.CompletedProcess([], 1, "", "[ALERT] a value refused")
        monkeypatch.setattr(proxy.FrontDoor, "check", lambda self: refused)
    with pytest.raises(SystemExit):
        launcher.main(["--model-repository", str(REPOSITORY)])
    assert list(tmp_path.iterdir()) == []


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
    front = dataclasses.replace(door(tmp_path), side_bind_address="127.0.0.1")
    assert front.environment()["DOOR_SIDE_BIND_ADDRESS"] == "127.0.0.1"  # metrics, probe
    assert front.environment()["DOOR_BIND_ADDRESS"] == "0.0.0.0"  # the public ones
    assert TEMPLATE.read_text().count('bind "${DOOR_SIDE_BIND_ADDRESS}:') == 2


def test_the_messages_the_door_sets_fit_inside_its_json_answers():
    """Each `setenv MSG_*` text is written inside a JSON string as it is: no quote, backslash or control."""
    assert proxy.MESSAGES and all(re.fullmatch(r"[^\"\\\x00-\x1f]+", text) for text in proxy.MESSAGES.values())
    assert proxy.QUEUE_FULL.endswith(RETRY_MARKER) and proxy.QUEUE_TIMEOUT.endswith(RETRY_MARKER)
