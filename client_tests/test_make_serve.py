"""`make serve` (the README's first command) serves a repository and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request

from triton_sampling_mask.ops.server_process import free_port

from .server import MODEL_REPOSITORY, REPO_ROOT


def test_make_serve_honours_the_environment_and_stops_on_sigterm(tmp_path):
    repository = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "sampler", repository / "sampler")
    ports = {
        "TRITON_HTTP_PORT": free_port(),
        "TRITON_GRPC_PORT": free_port(),
        "TRITON_METRICS_PORT": free_port(),
        "TRITON_PROBE_PORT": free_port(),
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
