"""`make serve` (the README's first command) serves a repository, with the HTTP API on a port of its
own behind the front door, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

from testbed.server import REPO_ROOT
from testbed.stack import shipped_repository
from triton_sampling_mask.ops.server_process import free_port


def api_completion(port: int, deadline: float) -> dict:
    """A two-token completion with masks through the HTTP API's public port, once it answers."""
    base = f"http://127.0.0.1:{port}/v1"
    while True:
        try:
            with urllib.request.urlopen(f"{base}/models", timeout=5) as response:
                model = json.loads(response.read())["data"][0]["id"]
            break
        except (OSError, KeyError, IndexError):
            assert time.monotonic() < deadline, "the HTTP API did not answer through its port"
            time.sleep(1.0)
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
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (open while the server runs)
    # A session of its own, so cleanup can reach the exec'd tritonserver whatever happens to make.
    make = subprocess.Popen(
        ["make", "-s", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{ports['TRITON_HTTP_PORT']}/v2/models/sampler/ready"
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and make.poll() is None and not ready:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    ready = response.status == 200
            except OSError:
                time.sleep(0.5)
        assert ready, (tmp_path / "serve.log").read_text()[-3000:]
        completion = api_completion(ports["TRITON_API_PORT"], time.monotonic() + 120)
        assert len(completion["choices"][0]["token_ids"]) == 2, completion
        assert all(len(mask) <= 5 for mask in completion["choices"][0]["sampling_mask"]), completion
        make.send_signal(signal.SIGTERM)  # what a supervisor sends; make forwards it to tritonserver
        assert make.wait(timeout=60) is not None
        text = (tmp_path / "serve.log").read_text()
        assert "successfully unloaded 'sampler'" in text, text[-3000:]
        try:
            urllib.request.urlopen(url, timeout=2)
            raise AssertionError("server still answering after SIGTERM")
        except OSError:
            pass
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        log.close()
