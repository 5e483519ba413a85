"""Past one machine behind the routers RL teams already run: two `make serve` replicas (launcher,
supervisor, front door, HTTP API; testbed/stack.py) behind smg 1.13, the SGLang model gateway,
started from its PyPI wheel as docker/router/launch.py starts it in the router image (the
deployment's policy and health checks, its API key from a file; the replicas require the same
key, TRITON_API_KEY). sglang-router 0.3.2 is checked beside it for what it forwards.

- Through smg, seeded `/generate`, chat and completions requests with masks equal the same
  requests sent to a replica directly (ids and masks exactly, log-probs to float32 rounding),
  weight versions included, and both replicas serve; `/v1/models` names the served model and
  the router reads each replica's `/v1/loads`.
- sglang-router 0.3.2 forwards `return_sampling_mask` on `/v1/completions` only: it drops it from
  `/generate` and chat (documented in docs/deploy.md; use smg or completions).
- One replica SIGKILLed (its whole stack) mid-run: every non-streamed request is answered, equal
  to its direct answer (the router retries it on the other replica); a stream in flight on the
  dead replica ends without a finish reason, which is how a client tells it was cut (smg ends
  it as a clean stream and appends `data: [DONE]`); every other stream ends with its finish
  reason. The kill test runs last: it leaves one replica.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import numpy as np
import psutil
import pytest

from testbed.api_server import ApiProcess
from testbed.router import RouterProcess, http_json, router_python
from testbed.server import ExternalTritonServer
from testbed.stack import launch, shipped_repository
from triton_sampling_mask.ops.shm_cleanup import remove_unused_regions, server_shm_prefix

KEY = "router-suite-api-key-0123456789abcdefghij"
MODEL = "generate"  # the served model's name (the shipped repository's built-in LM)
REPLICAS = 2
TOP_K = 8
CASES = 6  # seeded requests per route
KILL_STREAMS = 4  # long streams in flight when a replica is killed
KILL_THREADS = 6  # threads sending non-streamed requests meanwhile
AFTER_KILL_S = 5.0  # the senders go on this long after the kill: smg's retries and its health checks' removal


def needs(router: str) -> None:
    if router_python(router) is None:
        pytest.skip(f"{router} is not installed (.venv/routers/{router}): run `make setup`")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two full stacks side by side, each requiring KEY on its API."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts two local `make serve` stacks of its own; with an external server only that one is tested")
    needs("smg")
    root = tmp_path_factory.mktemp("router_replicas")

    def start(index: int):
        repository = shipped_repository(root / f"models{index}")
        return launch(repository, root / f"replica{index}.log", stack_memory_bytes=None, env={"TRITON_API_KEY": KEY})

    with ThreadPoolExecutor(REPLICAS) as pool:
        futures = [pool.submit(start, i) for i in range(REPLICAS)]
        stacks = [future.result() for future in futures]
    try:
        yield stacks
    finally:
        for stack in stacks:
            stack.stop()
            remove_unused_regions(server_shm_prefix(stack.ports["http"]))


def api_url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports['api']}"


@pytest.fixture(scope="module")
def smg(replicas):
    router = RouterProcess("smg", [api_url(s) for s in replicas], api_key=KEY).start(MODEL)
    yield router
    router.stop()


def direct(stack, path: str, body: dict) -> dict:
    status, answer = http_json(api_url(stack) + path, body, key=KEY)
    assert status == 200, answer
    return answer


def generate_body(case: int, stream: bool = False, max_new_tokens: int = 12) -> dict:
    """slime's /generate payload (no `model`: smg then sends "unknown"), with masks."""
    return {
        "input_ids": [5, 6, 7 + case],
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": TOP_K,
            "max_new_tokens": max_new_tokens,
            "sampling_seed": 100 + case,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "return_sampling_mask": True,
        "stream": stream,
    }


def chat_body(case: int, stream: bool = False, max_tokens: int = 12) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Rollout {case} returns masks"}],
        "max_tokens": max_tokens,
        "top_k": TOP_K,
        "seed": 200 + case,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
        "return_sampling_mask": True,
        "return_weight_versions": True,
        "stream": stream,
    }


def completion_body(case: int) -> dict:
    return {
        "model": MODEL,
        "prompt": f"Rollout {case} returns",
        "max_tokens": 12,
        "top_k": TOP_K,
        "seed": 300 + case,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_sampling_mask": True,
    }


def generate_fields(answer: dict) -> dict:
    info = answer["meta_info"]
    return {
        "ids": answer["output_ids"],
        "text": answer["text"],
        "finish": info["finish_reason"],
        "version": info["weight_version"],
        "versions": info["weight_versions"],
        "masks": info.get("output_token_sampling_mask"),
        "logprobs": [entry[0] for entry in info["output_token_logprobs"]],
        "sampling_logprobs": info.get("output_token_sampling_logprobs"),
    }


def choice_fields(answer: dict) -> dict:
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]  # chat: content entries; completions: token_logprobs
    if "content" in logprobs:
        values = [entry["logprob"] for entry in logprobs["content"]]
    else:
        values = logprobs["token_logprobs"]
    return {
        "ids": choice.get("token_ids"),  # sglang-router 0.3.2 drops chat's return_token_ids too
        "text": choice["message"]["content"] if "message" in choice else choice["text"],
        "finish": choice["finish_reason"],
        "versions": choice.get("weight_versions"),
        "masks": choice.get("sampling_mask"),
        "logprobs": values,
        "sampling_logprobs": choice.get("sampling_logprobs"),
    }


def assert_same(got: dict, want: dict) -> None:
    """Ids, masks, finish reasons and versions exactly; log-probs to float32 rounding (a request
    batched beside others gets its logits from the LM's batched forward pass)."""
    for name in ("ids", "finish", "masks", "version", "versions"):
        assert got.get(name) == want.get(name), name
    for name in ("logprobs", "sampling_logprobs"):
        np.testing.assert_allclose(np.float32(got[name]), np.float32(want[name]), rtol=0, atol=1e-4, err_msg=name)


ROUTES = {
    "/generate": (generate_body, generate_fields),
    "/v1/chat/completions": (chat_body, choice_fields),
    "/v1/completions": (completion_body, choice_fields),
}


def through(router: RouterProcess, path: str, body: dict) -> tuple[int, dict, str | None]:
    """(status, answer, the replica smg says it routed to) of a POST through the router."""
    target = urlsplit(router.url)
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        connection.request("POST", path, json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null"), response.getheader("x-smg-routed-worker-id")
    finally:
        connection.close()


def test_the_router_names_the_served_model_and_reads_each_replicas_load(smg, replicas):
    status, models = smg.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL], models
    status, info = smg.get("/get_server_info")  # forwarded to a replica
    assert status == 200 and info["served_model_name"] == MODEL and info["context_length"] > 0, info
    deadline, by_worker = time.monotonic() + 30, {}
    while time.monotonic() < deadline and len(by_worker) < REPLICAS:  # each replica's report, once polled
        status, loads = smg.get("/get_loads")
        assert status == 200, loads
        by_worker = {entry["worker"]: entry for entry in loads["loads"]}
        time.sleep(0.5)
    assert sorted(by_worker) == sorted(api_url(s) for s in replicas), loads
    for entry in by_worker.values():  # the generate model's config, read through /v1/loads
        assert entry["max_running_requests"] == 32 and entry["max_total_num_tokens"] == 16384, entry
    status, _ = http_json(smg.url + "/generate", generate_body(0))  # the router requires its key
    assert status == 401


def test_seeded_requests_with_masks_through_smg_equal_a_replicas_direct_answers(smg, replicas):
    jobs = [(path, case) for path in ROUTES for case in range(CASES)]
    expected = {(path, case): ROUTES[path][1](direct(replicas[0], path, ROUTES[path][0](case))) for path, case in jobs}
    with ThreadPoolExecutor(8) as pool:  # concurrent, so that both replicas serve
        answers = list(pool.map(lambda job: through(smg, job[0], ROUTES[job[0]][0](job[1])), jobs))
    served = set()
    for (path, case), (status, answer, worker) in zip(jobs, answers):
        assert status == 200, (path, answer)
        got = ROUTES[path][1](answer)
        assert got["masks"] and len(got["masks"]) == len(got["ids"]) == 12, (path, got)
        assert_same(got, expected[(path, case)])
        served.add(worker)
    assert served == {api_url(s) for s in replicas}, served


def test_sglang_router_0_3_2_forwards_masks_on_completions_only(replicas):
    """What sglang-router 0.3.2 does with `return_sampling_mask` (docs/deploy.md): kept on
    /v1/completions, dropped from /generate and chat (its typed requests lack the field; chat
    loses `return_token_ids` as well). The answers are otherwise the replica's."""
    needs("sglang-router")
    with RouterProcess("sglang-router", [api_url(s) for s in replicas], api_key=KEY).start(MODEL) as router:
        for path, (body, fields) in ROUTES.items():
            status, answer = router.post(path, body(1))
            assert status == 200, (path, answer)
            got, want = fields(answer), fields(direct(replicas[0], path, body(1)))
            assert got["text"] == want["text"] and got["finish"] == want["finish"], path
            if path == "/v1/completions":
                assert_same(got, want)
            else:
                assert got["masks"] is None and want["masks"], path


def test_v1_loads_reports_the_engine_running_a_request(replicas):
    """SGLang's load report from the generate model's gauges, in the shape smg and slime read."""
    stack = replicas[0]
    target = urlsplit(api_url(stack))
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
    body = generate_body(0, stream=True, max_new_tokens=400)
    connection.request("POST", "/generate", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    assert response.status == 200
    response.readline()  # the first event: the request runs
    try:
        deadline, report = time.monotonic() + 30, None
        while time.monotonic() < deadline:
            status, report = http_json(api_url(stack) + "/v1/loads", key=KEY)
            assert status == 200, report
            if report["loads"][0]["num_running_reqs"] >= 1:
                break
            time.sleep(0.2)
    finally:
        connection.close()  # leaving cancels the generation
    (load,) = report["loads"]
    assert (
        load["num_running_reqs"] >= 1 and load["num_total_reqs"] == load["num_running_reqs"] + load["num_waiting_reqs"]
    )
    assert 0 < load["num_used_tokens"] <= load["max_total_num_tokens"] == 16384
    assert load["token_usage"] == load["num_used_tokens"] / 16384 and load["max_running_requests"] == 32
    assert report["dp_rank_count"] == 1 and load["dp_rank"] == 0


def test_health_follows_the_readiness_probe(triton_server, tmp_path):
    """With --readiness-url (the supervisor's /ready under `make serve`), /health answers 503
    while that probe does not answer 200: a router's health checks then follow the readiness
    Kubernetes and compose use. The probe here is a stand-in whose answer the test sets."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = {"status": 503}

    class Probe(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(answer["status"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    probe = ThreadingHTTPServer(("127.0.0.1", 0), Probe)
    threading.Thread(target=probe.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{probe.server_address[1]}/ready"
    api = ApiProcess(triton_server.grpc_url, ["--readiness-url", url])
    try:
        api.child.start()
        deadline = time.monotonic() + 90
        status, body = 0, None
        while time.monotonic() < deadline and status != 503:
            status, body = api.get("/health")
            time.sleep(0.2)
        assert status == 503 and "readiness probe answers 503" in body["error"]["message"], body
        answer["status"] = 200
        assert api.get("/health")[0] == 200
        probe.shutdown()
        probe.server_close()
        status, body = api.get("/health")
        assert status == 503 and "does not answer" in body["error"]["message"], body
    finally:
        api.stop()
        probe.server_close()


def stream_events(router: RouterProcess, path: str, body: dict, started: threading.Event, outcome: dict) -> None:
    """Read one SSE answer through the router into `outcome` (its routed replica, its events),
    setting `started` once a few events arrived."""
    target = urlsplit(router.url)
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
    events = []
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        connection.request("POST", path, json.dumps(body), headers)
        response = connection.getresponse()
        outcome.update(status=response.status, worker=response.getheader("x-smg-routed-worker-id"))
        for line in response:
            line = line.strip()
            if line.startswith(b"data:"):
                events.append(line[5:].strip().decode())
                if len(events) == 5:
                    started.set()
    except (OSError, http.client.HTTPException) as error:
        outcome["error"] = repr(error)
    finally:
        connection.close()
        outcome["events"] = events
        started.set()


def stream_tokens_and_finish(path: str, events: list[str]) -> tuple[list[int], object]:
    """The token ids a streamed answer carried and its last finish reason (None: none came). An
    error event (smg 1.13 adds one when the replica's body breaks off) is left out."""
    data = [event for event in (json.loads(e) for e in events if e != "[DONE]") if "error" not in event]
    if path == "/generate":  # cumulative events: the last holds the sequence so far
        last = data[-1] if data else {"output_ids": [], "meta_info": {"finish_reason": None}}
        return last["output_ids"], last["meta_info"]["finish_reason"]
    ids, finish = [], None
    for chunk in data:
        for choice in chunk.get("choices", []):
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return ids, finish


def kill_stack(stack) -> list:
    """SIGKILL a replica's launcher and everything it started, as a lost machine; the processes."""
    launcher = psutil.Process(stack.process.pid)
    processes = [launcher, *launcher.children(recursive=True)]
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return processes


def test_a_replica_killed_mid_run_loses_no_request_and_its_cut_streams_are_detected(smg, replicas, capsys):
    long_tokens = 400
    streams = [("/generate", generate_body(i, True, long_tokens)) for i in range(KILL_STREAMS // 2)]
    streams += [("/v1/chat/completions", chat_body(i, True, long_tokens)) for i in range(KILL_STREAMS // 2)]
    cases = [("/generate", case) for case in range(CASES)] + [("/v1/chat/completions", case) for case in range(CASES)]
    with ThreadPoolExecutor(8) as pool:  # the direct answers, concurrently (seeded: batching changes no token)
        expected_streams = list(
            pool.map(lambda s: ROUTES[s[0]][1](direct(replicas[0], s[0], {**s[1], "stream": False}))["ids"], streams)
        )
        answers = pool.map(lambda job: ROUTES[job[0]][1](direct(replicas[1], job[0], ROUTES[job[0]][0](job[1]))), cases)
        expected = dict(zip(cases, answers))

    outcomes = [{} for _ in streams]
    started = [threading.Event() for _ in streams]
    readers = [
        threading.Thread(target=stream_events, args=(smg, path, body, started[i], outcomes[i]))
        for i, (path, body) in enumerate(streams)
    ]
    answered, lost, wrong = [0], [], []
    stop = threading.Event()

    def sender(index: int) -> None:
        turn = index
        while not stop.is_set():
            job = cases[turn % len(cases)]
            status, answer, _ = through(smg, job[0], ROUTES[job[0]][0](job[1]))
            if status != 200:
                lost.append((job, status, answer))
            elif ROUTES[job[0]][1](answer)["ids"] != expected[job]["ids"]:
                wrong.append(job)
            else:
                answered[0] += 1
            turn += 1

    senders = [threading.Thread(target=sender, args=(i,)) for i in range(KILL_THREADS)]
    for thread in readers + senders:
        thread.start()
    try:
        for event in started:
            assert event.wait(120), "a stream did not start"
        routed = [outcome.get("worker") for outcome in outcomes]
        victim_url = max({url for url in routed if url}, key=routed.count)
        victim = next(s for s in replicas if api_url(s) == victim_url)
        killed = kill_stack(victim)
        killed_at = time.monotonic()
        time.sleep(AFTER_KILL_S)
    finally:
        stop.set()
        for thread in senders + readers:
            thread.join(300)
    elapsed = time.monotonic() - killed_at
    psutil.wait_procs(killed, timeout=30)  # its stubs gone, their /dev/shm regions (the supervisor's prefix) go
    remove_unused_regions(server_shm_prefix(victim.ports["http"]))

    cut, whole, error_events = [], [], 0
    for (path, _), outcome, want in zip(streams, outcomes, expected_streams):
        ids, finish = stream_tokens_and_finish(path, outcome["events"])
        if finish is None:  # no finish reason: a cut stream, and only the dead replica's
            assert outcome["worker"] == victim_url, outcome
            assert len(ids) < long_tokens and ids == want[: len(ids)], (path, len(ids))
            assert outcome["events"][-1:] == ["[DONE]"], outcome["events"][-2:]  # it ends as a whole one does
            error_events += any('"error"' in event for event in outcome["events"])
            cut.append(path)
        else:
            assert ids == want, path  # a stream that ends with its finish reason is whole
            whole.append(path)
    with capsys.disabled():
        print(
            f"\n[router] smg, {REPLICAS} replicas, one SIGKILLed mid-run: {answered[0]} non-streamed requests "
            f"answered ({elapsed:.0f} s after the kill included), {len(lost)} lost, {len(wrong)} different from their "
            f"direct answers; {len(cut)} of {len(streams)} streams cut (ended without a finish reason, all on the "
            f"killed replica; {error_events} of them with smg's error event before its [DONE]), {len(whole)} whole"
        )
    assert not lost, lost[:3]
    assert not wrong, wrong[:3]
    assert answered[0] > KILL_THREADS
    assert cut, "no stream was in flight on the killed replica"
    survivor = next(s for s in replicas if s is not victim)
    status, answer, worker = through(smg, "/generate", generate_body(0))
    assert status == 200 and worker == api_url(survivor) and answer["output_ids"] == expected[("/generate", 0)]["ids"]
