"""What a router reads of this worker besides its answers: whether the server is ready, and the
engine's load.

- Readiness: with `--readiness-url` (the supervisor's `/ready`: a real inference of every model
  passed in its last round, 503 while it drains for a planned restart), `GET /health` answers 503
  while that probe does not answer 200, so a router's health checks on `/health` follow the same
  readiness as Kubernetes' and compose's probes.
- Load: with `--metrics-url` (tritonserver's Prometheus endpoint), `GET /v1/loads` answers SGLang's
  load report (the schema smg reads for its load-aware policies and overload protection, and slime
  polls until a server is idle) from the generate model's gauges: requests running and waiting, KV
  positions held against the config's `kv_budget_tokens`, and the token rate between two reads.

Both read loopback URLs on the server's own host (never anything a client names).
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

from prometheus_client.parser import text_string_to_metric_families

from ..client.generate_transport import GrpcConnection
from ..model_config import int_parameter
from .config import ApiConfig

# The generate model's series read here (serving.metrics names them; the API sits below serving,
# so tests/test_router_worker_state.py keeps these equal to them).
GENERATE_RUNNING = "generate_num_requests_running"
GENERATE_WAITING = "generate_num_requests_waiting"
GENERATE_KV_TOKENS = "generate_kv_tokens"
GENERATE_TOKENS = "generate_tokens_total"

_TIMEOUT_S = 2.0
_RATE_WINDOW_S = 60.0  # a token rate over a longer gap than this says nothing about now


def _get(url: str) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:  # noqa: S310 (an operator's http:// URL)
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""
    except (OSError, ValueError):
        return 0, b""


async def server_ready(config: ApiConfig) -> tuple[bool, str]:
    """Whether the readiness probe answers 200 (true without one), and why not."""
    if config.readiness_url is None:
        return True, ""
    status, _ = await asyncio.to_thread(_get, config.readiness_url)
    return (
        status == 200,
        "its readiness probe does not answer" if status == 0 else f"its readiness probe answers {status}",
    )


class EngineLoad:
    """The generate model's load as SGLang's `/v1/loads` reports it (one data-parallel rank)."""

    def __init__(self, config: ApiConfig):
        self.config = config
        self._limits: tuple[int, int] | None = None  # (max_active_sequences, kv_budget_tokens) per instance
        self._last_tokens: tuple[float, float] | None = None  # (monotonic time, tokens generated so far)

    async def _engine_limits(self) -> tuple[int, int]:
        if self._limits is None:
            connection = GrpcConnection(self.config.triton_url, self.config.triton_model)
            try:
                model_config = await connection.model_config()
            finally:
                await connection.close()
            self._limits = (
                int_parameter(model_config, "max_active_sequences", 32),
                int_parameter(model_config, "kv_budget_tokens", 32 * 512),
            )
        return self._limits

    def _gauges(self, text: str) -> dict[str, list[float]]:
        """The generate model's samples of each gauge and counter read here, one per instance."""
        wanted = {GENERATE_RUNNING, GENERATE_WAITING, GENERATE_KV_TOKENS, GENERATE_TOKENS}
        found: dict[str, list[float]] = {name: [] for name in wanted}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted and sample.labels.get("model") == self.config.triton_model:
                    found[sample.name].append(sample.value)
        return found

    def _token_rate(self, tokens: float) -> float:
        now = time.monotonic()
        last, self._last_tokens = self._last_tokens, (now, tokens)
        if last is None or not 0 < now - last[0] <= _RATE_WINDOW_S or tokens < last[1]:
            return 0.0
        return (tokens - last[1]) / (now - last[0])

    async def report(self) -> dict | None:
        """SGLang's load report, or None when the metrics cannot be read."""
        status, body = await asyncio.to_thread(_get, self.config.metrics_url)
        if status != 200:
            return None
        try:
            samples = self._gauges(body.decode())
        except ValueError:
            return None
        max_running, kv_budget = await self._engine_limits()
        instances = max(1, len(samples[GENERATE_KV_TOKENS]))
        running, waiting = int(sum(samples[GENERATE_RUNNING])), int(sum(samples[GENERATE_WAITING]))
        used, capacity = int(sum(samples[GENERATE_KV_TOKENS])), kv_budget * instances
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "dp_rank_count": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": running,
                    "num_waiting_reqs": waiting,
                    "num_total_reqs": running + waiting,
                    "num_used_tokens": used,
                    "max_total_num_tokens": capacity,
                    "token_usage": used / capacity,
                    "gen_throughput": self._token_rate(sum(samples[GENERATE_TOKENS])),
                    "cache_hit_rate": 0.0,  # no prefix cache
                    "utilization": running / (max_running * instances),
                    "max_running_requests": max_running * instances,
                }
            ],
        }
