"""A trainer's whole rollout batch at once through `make serve`'s front door (testbed.trainer_burst):
a keyed client on one address sends 1,024 streaming chat completions with the official `openai`
SDK (max_retries=0) and 2,000 requests through GenerateClient; none is refused or lost, and each
equals its sequential seeded twin. Meanwhile an unauthenticated flood from a second address is
shared out as before (PROXY_REQUESTS_PER_IP answered, the rest refused with 429) and a keyless
client on a third address is served."""

from __future__ import annotations

import resource

import pytest

from testbed import trainer_burst
from testbed.server import ExternalTritonServer
from testbed.stack import launch_keyed
from triton_sampling_mask.ops.proxy import ProxyLimits, find_haproxy

pytestmark = pytest.mark.skipif(find_haproxy() is None, reason="the front door needs haproxy")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("needs a local launcher with a client key file of its own")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))  # the SDK's 1,000 connections
    work = tmp_path_factory.mktemp("trainer-burst")
    running = launch_keyed(work)
    yield running
    running.stop()


def test_a_keyed_burst_is_neither_refused_nor_lost_while_a_flood_is_shared_out(stack):
    outcome = trainer_burst.run(stack, requests=1024, generate_requests=2000, flood=100)
    clients = outcome.clients
    print({name: (c.sent, c.equal, c.refused, c.lost, c.different) for name, c in clients.items()}, outcome.seconds)
    for name in ("keyed sdk", "keyed generate", "keyless"):
        client = clients[name]
        assert (client.refused, client.lost, client.different) == (0, 0, 0), (name, client, stack.log_tail())
        assert client.equal == client.sent
    share = ProxyLimits().requests_per_ip
    flood = clients["flood"]
    assert (flood.equal, flood.refused, flood.lost, flood.different) == (share, flood.sent - share, 0, 0), flood
