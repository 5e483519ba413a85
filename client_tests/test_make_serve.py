"""`make serve` (the README's first command) serves a repository, with the HTTP API on a port of its
own behind the front door, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

from testbed.server import REPO_ROOT
from testbed.stack import shipped_repository
from testbed.startup_wait import StartupFailed, wait_until_ready
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.server_process import free_port


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def api_completion(port: int) -> dict:
    """A two-token completion with masks through the HTTP API's public port (which answers)."""
    base = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=5) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": 5, "seed": 1, "ignore_eos": True}
    body |= {"return_sampling_mask": True, "return_token_ids": True}
    request = urllib.request.Request(
        f"{base}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_make_serve_honours_the_environment_and_stops_on_sigterm(tmp_path):
    repository = shipped_repository(tmp_path / "repo")
    ports = {
        "TRITON_HTTP_PORT": free_port(),
        "TRITON_GRPC_PORT": free_port(),
        "TRITON_METRICS_PORT": free_port(),
        "TRITON_PROBE_PORT": free_port(),
        "TRITON_API_PORT": free_port(),
    }
    env = {**os.environ, "MODEL_REPOSITORY": str(repository), **{k: str(v) for k, v in ports.items()}}
    # A session of its own, so cleanup can reach the exec'd tritonserver whatever happens to make.
    make = Child("make serve", ["make", "-s", "serve"], env=env, cwd=REPO_ROOT, log_path=tmp_path / "serve.log")
    make.start()
    try:
        sampler = f"http://127.0.0.1:{ports['TRITON_HTTP_PORT']}/v2/models/sampler/ready"
        api_models = f"http://127.0.0.1:{ports['TRITON_API_PORT']}/v1/models"
        try:  # on readiness, for as long as the start makes progress: a busy machine only slows it
            wait_until_ready("make serve", lambda: answers(sampler) and answers(api_models), [make], poll_s=0.5)
        except StartupFailed as failed:
            raise AssertionError(f"{failed}\n{(tmp_path / 'serve.log').read_text()[-3000:]}") from None
        completion = api_completion(ports["TRITON_API_PORT"])
        assert len(completion["choices"][0]["token_ids"]) == 2, completion
        assert all(len(mask) <= 5 for mask in completion["choices"][0]["sampling_mask"]), completion
        make.signal(signal.SIGTERM)  # what a supervisor sends; make forwards it to tritonserver
        assert make.process.wait(timeout=60) is not None
        text = (tmp_path / "serve.log").read_text()
        assert "successfully unloaded 'sampler'" in text, text[-3000:]
        assert not answers(sampler), "server still answering after SIGTERM"
    finally:
        if make.running():
            os.killpg(make.pid, signal.SIGKILL)
            make.process.wait()
