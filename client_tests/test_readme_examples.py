"""The documentation cannot rot: every ```python block of README.md and docs/*.md, and every script
in examples/, runs against the session's real server, and every relative link of the guides (and of CHANGELOG.md, bench/README.md and
bench/results/history.md) points at a file, and heading, that exists.

The examples address Triton's default ports; the test points them at the session server instead.
(It lives in client_tests/ to reuse that server rather than start another one.)
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.server import REPO_ROOT

README = REPO_ROOT / "README.md"
EXAMPLE_FILES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
# Scripts taking --url (gRPC) and --protocol, like examples/rl_rollout.py. rl_loop.py pushes weights,
# which needs a server with an admin key and a weights root: client_tests/test_weight_updates.py runs it.
EXAMPLE_SCRIPTS = sorted(path for path in (REPO_ROOT / "examples").glob("*.py") if path.name != "rl_loop.py")
LINKED_FILES = [
    *EXAMPLE_FILES,
    REPO_ROOT / "CHANGELOG.md",
    REPO_ROOT / "bench" / "README.md",
    REPO_ROOT / "bench" / "results" / "history.md",
]

FENCED_BLOCK = re.compile(r"^```.*?^```", flags=re.S | re.M)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", flags=re.M)


def _relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


BLOCKS = [
    (_relative(path), index, code)
    for path in EXAMPLE_FILES
    for index, code in enumerate(PYTHON_BLOCK.findall(path.read_text()))
]


def test_the_documented_examples_are_there():
    readme = "\n".join(code for path, _, code in BLOCKS if path == "README.md")
    assert "tritonclient.http" in readme  # "Calling it"
    assert "replay_logprobs" in readme and "to_vllm_csr" in readme  # "Use it from an RL trainer"
    docs = "\n".join(code for path, _, code in BLOCKS if path.startswith("docs/"))
    assert "InferRequestedOutput" in docs  # docs/sampler.md: only the requested outputs
    assert "replica_shares" in docs  # docs/operations.md: scale out
    assert "GenerateClient" in docs  # docs/generate.md: the generate client
    assert REPO_ROOT / "examples" / "rl_rollout.py" in EXAMPLE_SCRIPTS  # rollout, masks, replay


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS, ids=_relative)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_example_script_runs(script, protocol, triton_server, monkeypatch):
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    monkeypatch.setattr("sys.argv", [str(script), "--url", url, "--protocol", protocol])
    runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize(("path", "index", "code"), BLOCKS, ids=[f"{path}:block{index}" for path, index, _ in BLOCKS])
def test_python_block_runs(path, index, code, triton_server, request):
    code = code.replace("localhost:8000", triton_server.http_url).replace("localhost:8001", triton_server.grpc_url)
    if "localhost:9000" in code:  # the HTTP API's examples (docs/api.md): the session's API process
        code = code.replace("http://localhost:9000", request.getfixturevalue("api_server").url)
    namespace = {"__name__": "readme_example"}
    try:
        exec(compile(code, f"{path} python block {index}", "exec"), namespace)
    finally:
        # An example may leave its client open; an open HTTP connection delays the server's shutdown.
        for value in namespace.values():
            if isinstance(value, (httpclient.InferenceServerClient, grpcclient.InferenceServerClient)):
                value.close()


def _prose(text: str) -> str:
    """The text without code: a link-like string inside code is not a link."""
    return INLINE_CODE.sub("", FENCED_BLOCK.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors, seen = set(), {}
    for heading in HEADING.findall(FENCED_BLOCK.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("path", LINKED_FILES, ids=_relative)
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{_relative(path)} links to: {broken}"
