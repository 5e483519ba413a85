"""The server's custom counters and gauges, read from its Prometheus endpoint."""

from __future__ import annotations

import re
import time
import urllib.request


def counter(metrics_url: str, name: str, model: str = "generate") -> float:
    """The value of a custom counter or gauge on the metrics endpoint (0 before its first update)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^{re.escape(name)}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for_counter(
    metrics_url: str, name: str, until, why: str, timeout_s: float = 30.0, model: str = "generate"
) -> None:
    """Poll a counter or gauge until `until(value)` holds; fail with `why` after `timeout_s` (a wait
    for the server's state, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not until(counter(metrics_url, name, model)):
        assert time.monotonic() < deadline, why
        time.sleep(0.02)
