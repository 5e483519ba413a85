"""A router RL teams put in front of replicas (smg, the SGLang model gateway, or sglang-router:
their PyPI wheels, each in a venv of its own that `make setup` makes under .venv/routers/), on a
free port, started by docker/router/launch.py as the router image runs it (the deployment's
flags, the API key from a file).

The one router launcher of the tests and bench/: client_tests/test_router.py and
bench/load/router.py start it in front of `make serve` stacks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from testbed.server import log_tail
from triton_sampling_mask.ops.child import Child
from triton_sampling_mask.ops.server_process import free_port

from .server import REPO_ROOT

LAUNCHER = REPO_ROOT / "docker" / "router" / "launch.py"
# Router name -> its venv under .venv/routers (the Makefile installs each there).
ROUTER_VENVS = Path(sys.prefix) / "routers"
ROUTERS = ("smg", "sglang-router")


def router_python(router: str) -> Path | None:
    """The interpreter of `router`'s venv, or None when it is not installed."""
    python = ROUTER_VENVS / router / "bin" / "python"
    return python if python.exists() else None


def http_json(
    url: str, body: dict | None = None, key: str | None = None, timeout_s: float = 60.0
) -> tuple[int, dict | list | None]:
    """(status, parsed JSON body) of a GET (or a POST of `body`); (0, None) without an answer."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text or b"null")
        except ValueError:
            return error.code, {"text": text.decode(errors="replace")}
    except (OSError, ValueError):
        return 0, None


class RouterProcess:
    """One router in front of `worker_urls` (a context manager); `url` is its base URL. `api_key`
    is written to a 0600 file for the launcher; `args` are more router flags; `python` is an
    interpreter with the router installed (default: its venv under .venv/routers)."""

    def __init__(
        self,
        router: str,
        worker_urls: list[str],
        api_key: str | None = None,
        args: list[str] = (),
        python: Path | None = None,
    ):
        python = python or router_python(router)
        if python is None:
            raise RuntimeError(f"{router} is not installed in {ROUTER_VENVS / router}: run `make setup`")
        self.router, self.api_key = router, api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = Path(tempfile.mkdtemp(prefix=f"router-{router}-"))
        self.log_path = self.directory / "router.log"
        command = [str(python), str(LAUNCHER), "--router", router]
        if api_key is not None:
            key_file = self.directory / "api.key"
            key_file.touch(mode=0o600)
            key_file.write_text(api_key + "\n")
            command += ["--api-key-file", str(key_file)]
        command += [
            *("--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port())),
            # smg waits out a grace period on SIGTERM even with nothing in flight; its users here stop it once
            # their requests are answered
            *(["--prometheus-host", "127.0.0.1", "--shutdown-grace-period-secs", "0"] if router == "smg" else []),
            *("--worker-urls", *worker_urls),
            *args,
        ]
        # No tokenizer download from the Hub for the model name the workers report (sglang-router tries).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.child = Child(f"router {router}", command, env=env, log_path=self.log_path, append_log=False)
        self.worker_urls = list(worker_urls)

    def get(self, path: str, timeout_s: float = 60.0):
        return http_json(self.url + path, key=self.api_key, timeout_s=timeout_s)

    def post(self, path: str, body: dict, timeout_s: float = 120.0):
        return http_json(self.url + path, body, key=self.api_key, timeout_s=timeout_s)

    def healthy_workers(self) -> set[str]:
        """The worker URLs the router lists as healthy (`GET /workers`, both routers)."""
        status, body = self.get("/workers", timeout_s=5)
        if status != 200 or not isinstance(body, dict):
            return set()
        return {w["url"] for w in body.get("workers", []) if w.get("is_healthy")}

    def start(self, served_model: str, timeout_s: float = 90.0) -> RouterProcess:
        """Start the router and wait until every worker is registered and healthy and
        `/v1/models` through it names `served_model`; raises with the log tail if not."""
        self.child.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.child.running():
                raise RuntimeError(f"the router exited:\n{self.log_tail()}")
            if self.healthy_workers() == set(self.worker_urls):
                status, body = self.get("/v1/models", timeout_s=5)
                if status == 200 and served_model in [m.get("id") for m in body.get("data", [])]:
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(
            f"the router did not serve {served_model!r} from every worker within {timeout_s}s:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 20.0) -> int | None:
        return self.child.stop(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
