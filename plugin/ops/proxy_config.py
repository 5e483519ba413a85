"""Moved: the front door is plugin/ops/haproxy/haproxy.cfg, its values come from ops.proxy."""

GRPC_QUEUE_FULL_BACKEND = "be_grpc_queue_full"  # the template's backend of that name (ops.proxy_metrics)
