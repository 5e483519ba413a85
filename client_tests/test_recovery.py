"""What a dead, hung or stopped stub leaves behind, and what other local users can read, through the
real server the launcher runs (supervisor on; `sampler`, `generate` and `sampler_hanging`, whose
backend holds `execute` on request, with 4 MiB stub regions and a 1 s watchdog interval):

- the stubs' /dev/shm regions, through which every tensor passes, are mode 0600 even when the
  launcher starts under umask 022, and neither tritonserver nor a stub has the admin key in its
  environment;
- the region of a stub that died after a request reached it is unlinked at once (tritonserver
  keeps it mapped: Triton 2.51 never releases the dead instance), and once what tritonserver
  still maps of such regions exceeds TRITON_SHM_LEAK_LIMIT_BYTES the supervisor drains and
  restarts it, after which /dev/shm holds the live stubs' regions only (first: it needs a server
  with no such region yet);
- a stub that stops answering while Triton's own health check still passes (a hung `execute`)
  makes /ready 503 about one watchdog interval into the round that meets it, not when its probe
  times out;
- a SIGSTOPped stub makes /ready 503 and, once it continues and its model was reloaded, the
  replaced stub's region is unlinked too.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading

import psutil
import pytest

from testbed.backends.hanging_backend import HANG_SECONDS, HANG_VOCAB
from testbed.server import ExternalTritonServer, copy_model
from testbed.stack import Stack, launch, pids_with_argument, recover, request, shipped_repository
from triton_sampling_mask.ops.child import group_members
from triton_sampling_mask.ops.shm_cleanup import SHM_DIR, mapped_regions, server_shm_prefix, stub_process

ADMIN_KEY = "recovery-test-admin-key-0123456789abcdef"
HANGING = "sampler_hanging"
REGION_BYTES = 4 * 2**20
KILLS_WITHIN_LIMIT = 2
LEAK_LIMIT_BYTES = 10 * 2**20  # two dead stubs' regions stay within it, three exceed it
WATCHDOG_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 30.0  # far longer than the waits below: /ready must not wait for it
LIMIT_S = 20.0  # waits for the server to act, not timing assertions
RESTART_LIMIT_S = 90.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The three models under the launcher, on free ports, started with umask 022."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("kills, hangs and stops the server's stubs: needs a local launcher of its own")
    repository = shipped_repository(tmp_path_factory.mktemp("recovery") / "model_repository")
    copy_model(repository, "sampler", HANGING, backend="hanging_backend:HangingBackend")
    server = launch(
        repository,
        tmp_path_factory.mktemp("recovery-logs") / "launcher.log",
        # The supervisor's own behaviour is under test: tritonserver faces the tests directly.
        proxied=False,
        args=["--probe-timeout", str(PROBE_TIMEOUT_S)],
        env={
            "TRITON_ADMIN_KEY": ADMIN_KEY,
            "TRITON_WATCHDOG_INTERVAL_S": WATCHDOG_INTERVAL_S,
            "SHM_DEFAULT_BYTES": REGION_BYTES,
            "SHM_GROWTH_BYTES": REGION_BYTES,
            "TRITON_SHM_LEAK_LIMIT_BYTES": LEAK_LIMIT_BYTES,
        },
        umask=0o022,
        stack_memory_bytes=None,
        api=False,
    )
    try:
        yield server
    finally:
        server.stop()


def ready_status(server: Stack) -> tuple[int | None, dict]:
    status, text = request(server.ports["probe"], "GET", "/ready")
    return status, json.loads(text) if status in (200, 503) else {}


def assert_ready(server: Stack, limit_s: float = LIMIT_S) -> None:
    seconds, _ = recover(lambda: (ready_status(server)[0] == 200, "not ready"), limit_s)
    assert seconds is not None, f"/ready not 200 within {limit_s:g} s\n{server.log_tail()}"


def not_ready_for(server: Stack, model: str, limit_s: float) -> dict | None:
    """The first /ready report within `limit_s` that is 503 because `model` failed, or None. (On a
    loaded host another idle model's probe may outlast an interval too: such reports are skipped.)"""
    answers = []

    def failed() -> tuple[bool, str]:
        status, report = answers.append(ready_status(server)) or answers[-1]
        return status == 503 and not report.get("models", {}).get(model, {"ok": True})["ok"], "ready"

    seconds, _ = recover(failed, limit_s)
    return None if seconds is None else answers[-1][1]


def tritonserver_pid(server: Stack) -> int:
    pids = pids_with_argument(f"--http-port={server.ports['http']}")
    assert len(pids) == 1, pids
    return pids[0]


def stubs(server_pid: int, model: str = "") -> dict[int, str]:
    """The live stubs of a tritonserver (of `model` only, when given): pid -> their region."""
    found = filter(None, map(stub_process, group_members(server_pid)))
    return {stub.pid: stub.region for stub in found if not model or stub.instance == f"{model}_0_0"}


def the_stub(server: Stack, model: str) -> tuple[int, str]:
    """(pid, region) of the one stub of `model`."""
    found = stubs(tritonserver_pid(server), model)
    assert len(found) == 1, found
    return next(iter(found.items()))


def regions(server: Stack) -> dict[str, os.stat_result]:
    prefix = server_shm_prefix(server.ports["http"])
    return {path.name: path.stat() for path in SHM_DIR.glob(prefix + "*")}


def leaked(server: Stack, server_pid: int) -> list[tuple[str, int]]:
    """(name, size) of the unlinked regions tritonserver still maps."""
    mapped = mapped_regions(server_pid, server_shm_prefix(server.ports["http"])).values()
    return sorted((region.name, region.size) for region in mapped if region.deleted)


def test_stub_regions_are_private_and_no_server_process_holds_the_admin_key(served):
    server_pid = tritonserver_pid(served)
    live = stubs(server_pid)
    modes = {name: oct(stat.S_IMODE(info.st_mode)) for name, info in regions(served).items()}
    assert len(live) == 3 and modes == {region: "0o600" for region in live.values()}
    for pid in (server_pid, *live):
        assert "TRITON_ADMIN_KEY" not in psutil.Process(pid).environ(), pid


def test_dead_stub_regions_are_removed_and_tritonserver_restarts_past_the_bound(served):
    assert_ready(served)
    first_server = tritonserver_pid(served)
    assert leaked(served, first_server) == []
    dead_regions = []
    for kill in range(KILLS_WITHIN_LIMIT + 1):
        stub_pid, region = the_stub(served, "sampler")
        os.kill(stub_pid, signal.SIGKILL)  # the watchdog's next probe reaches the dead stub, then reloads it
        dead_regions.append(region)
        if kill < KILLS_WITHIN_LIMIT:  # within the bound: the same tritonserver, the dead regions unlinked but mapped
            seconds, _ = recover(
                lambda: (region not in regions(served) and served.sampler_check()[0], "not yet"), LIMIT_S
            )
            assert seconds is not None, f"the dead stub's region is still there\n{served.log_tail()}"
            assert tritonserver_pid(served) == first_server
            assert leaked(served, first_server) == sorted((name, REGION_BYTES) for name in dead_regions)
            assert_ready(served)
    seconds, _ = recover(
        lambda: (
            pids_with_argument(f"--http-port={served.ports['http']}") not in ([], [first_server]),
            "not restarted",
        ),
        RESTART_LIMIT_S,
    )
    assert seconds is not None, f"tritonserver was not restarted\n{served.log_tail()}"
    assert_ready(served, RESTART_LIMIT_S)
    assert served.sampler_check() == (True, "ok")
    report = json.loads(request(served.ports["probe"], "GET", "/status")[1])
    assert (report["drain_restarts"], report["restarts"]) == (1, 0), report
    assert "draining and restarting it" in served.log_tail(20_000)
    new_server = tritonserver_pid(served)
    live_regions = set(stubs(new_server).values())
    assert len(live_regions) == 3 and set(regions(served)) == live_regions and not live_regions & set(dead_regions)
    assert leaked(served, new_server) == []


def test_a_hung_stub_makes_ready_503_one_interval_into_the_round(served):
    assert_ready(served)
    body = json.dumps(
        {"inputs": [{"name": "logits", "shape": [1, HANG_VOCAB], "datatype": "FP32", "data": [0.0] * HANG_VOCAB}]}
    ).encode()
    hung = threading.Thread(
        target=request, args=(served.ports["http"], "POST", f"/v2/models/{HANGING}/infer", body), daemon=True
    )
    hung.start()
    try:
        report = not_ready_for(served, HANGING, HANG_SECONDS - 2)
        assert report is not None, f"/ready stayed 200 with the stub hung\n{served.log_tail()}"
        assert "no answer within" in report["models"][HANGING]["detail"], report  # not its probe's timeout
    finally:
        hung.join(HANG_SECONDS + 30)
    assert_ready(served, RESTART_LIMIT_S)  # the watchdog reloads it once its execute returns
    logits = [0.0] * 7 + [6.0]
    status, text = request(
        served.ports["http"],
        "POST",
        f"/v2/models/{HANGING}/infer",
        json.dumps({"inputs": [{"name": "logits", "shape": [1, 8], "datatype": "FP32", "data": logits}]}).encode(),
    )
    assert status == 200, text


def test_a_stopped_stub_makes_ready_503_and_its_region_goes_once_replaced(served):
    assert_ready(served)
    server_pid = tritonserver_pid(served)
    stub_pid, region = the_stub(served, "generate")
    os.kill(stub_pid, signal.SIGSTOP)
    try:
        report = not_ready_for(served, "generate", LIMIT_S)
        assert report is not None, f"/ready stayed 200 with the stub stopped\n{served.log_tail()}"
    finally:
        os.kill(stub_pid, signal.SIGCONT)
    assert_ready(served, RESTART_LIMIT_S)
    assert served.generate_check() == (True, "ok")
    seconds, _ = recover(lambda: (region not in regions(served), "still there"), LIMIT_S)
    assert seconds is not None, f"the replaced stub's region is still there\n{served.log_tail()}"
    assert the_stub(served, "generate")[0] != stub_pid  # reloaded: a new stub serves it
    if psutil.pid_exists(stub_pid) and tritonserver_pid(served) == server_pid:
        assert (region, REGION_BYTES) in leaked(served, server_pid)  # the replaced stub lingers: counted
