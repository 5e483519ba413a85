"""tritonserver's OpenTelemetry tracing flags, from TRITON_TRACE_ENDPOINT and TRITON_TRACE_RATE.

Off (no flags) while the endpoint is empty. On, tritonserver traces one request in `rate` with
its own spans (the request, its queue and compute times) and exports them over OTLP/HTTP to the
endpoint; the Python models add their child spans under the same trace (serving.tracing). The
trace API that changes these settings at run time stays behind the admin key (server_process.ADMIN_APIS).
"""

from __future__ import annotations

# The service name Triton's spans carry (the models' spans carry their own: serving.tracing).
SERVICE_NAME = "tritonserver"


def trace_args(endpoint: str, rate: int) -> list[str]:
    """The --trace-config flags for an OTLP/HTTP traces URL (none when it is empty)."""
    if not endpoint:
        return []
    return [
        "--trace-config=mode=opentelemetry",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=rate={rate}",
        "--trace-config=count=-1",
        f"--trace-config=opentelemetry,url={endpoint}",
        f"--trace-config=opentelemetry,resource=service.name={SERVICE_NAME}",
    ]
