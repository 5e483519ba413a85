"""Every ```python block of README.md runs against the session's real server, so none can rot.

The examples address Triton's default ports; the test points them at the session server instead.
(It lives in client_tests/ to reuse that server rather than start another one.)
"""

from __future__ import annotations

import re

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .server import REPO_ROOT

README = REPO_ROOT / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_the_documented_examples():
    text = "\n".join(BLOCKS)
    assert len(BLOCKS) >= 2
    assert "tritonclient.http" in text  # "Calling it"
    assert "replay_logprobs" in text and "to_vllm_csr" in text  # "Use it from an RL trainer"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i}")
def test_readme_python_block_runs(index, triton_server):
    code = BLOCKS[index]
    code = code.replace("localhost:8000", triton_server.http_url).replace("localhost:8001", triton_server.grpc_url)
    namespace = {"__name__": "readme_example"}
    try:
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    finally:
        # An example may leave its client open; an open HTTP connection delays the server's shutdown.
        for value in namespace.values():
            if isinstance(value, (httpclient.InferenceServerClient, grpcclient.InferenceServerClient)):
                value.close()
