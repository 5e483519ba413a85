"""The busy contract: how a refusal that a later try may get past is marked, in one place.

The proxy (when it sheds), the generate engine (when its bounds are full or it is unloading) and
both clients share `RETRY_MARKER`: every retryable refusal's message carries it, and a client
retries a refusal whose message carries it (or Triton's own queue-full message) after a backoff,
without counting the replica as failed. Clients read an in-band gRPC stream error's message only,
without its code, so the marker is text, not a status.
"""

from __future__ import annotations

RETRY_MARKER = "retry with backoff"
# Triton's dynamic batcher when a model's queue policy caps its queue (not ours to reword).
TRITON_QUEUE_FULL = "Exceeds maximum queue size"
# Requests per model route the proxy lets into tritonserver at once (PROXY_MAX_IN_FLIGHT's default),
# and what a client keeps on the wire per replica by default: one client fits the route it calls.
DEFAULT_ROUTE_CAPACITY = 64


def is_busy(message: str) -> bool:
    """Whether a refusal's message says the server cannot take the request now (retry later)."""
    return RETRY_MARKER in message or TRITON_QUEUE_FULL in message
