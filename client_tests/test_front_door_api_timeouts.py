"""The HTTP API's answers to a client silent mid-body, through the front door: the API's 408 reaches
the client and the door closes the client's connection after it. Against a stack of its own whose
PROXY_CLIENT_TIMEOUT_S is short (the API takes it from the door), so that the silence costs
seconds, not the default minute (testbed/api_attacks.py's silent_body, `make hostile`)."""

from __future__ import annotations

import pytest

from testbed import api_attacks
from testbed import stack as full_stack
from testbed.server import ExternalTritonServer

CLIENT_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("the launcher's own front door: needs a local launcher")
    work = tmp_path_factory.mktemp("api-timeouts")
    running = full_stack.launch(
        full_stack.shipped_repository(work / "model_repository"),
        work / "launcher.log",
        env={"PROXY_CLIENT_TIMEOUT_S": str(CLIENT_TIMEOUT_S)},
    )
    yield running
    running.stop()


def test_a_client_silent_mid_body_gets_the_apis_408_and_its_connection_closed(stack):
    if not stack.proxied:
        pytest.skip("the front door's own handling")
    outcome = api_attacks.silent_body(stack)
    print(f"\n{outcome.row()}")
    assert outcome.held, f"{outcome.detail}\n{stack.log_tail()}"
