"""An ASGI app served by uvicorn on a thread of this process, on a free loopback port: the API
unit tests' server (no tritonserver behind it unless the test gives one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from triton_sampling_mask.ops.server_process import free_port


@contextmanager
def app_on_a_thread(app, start_timeout_s: float = 30, stop_timeout_s: float = 20) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL once uvicorn has started."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout_s)
