#!/usr/bin/env bash
# Build the image, serve the client tests' model repository on the GPUs inside the container and
# run client_tests/ from this host against it. Needs Docker with the NVIDIA container toolkit.
#   docker/run-gpu-tests.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${IMAGE:-triton-sampling-mask:gpu-tests}"
HTTP_PORT="${HTTP_PORT:-18000}"
GRPC_PORT="${GRPC_PORT:-18001}"
METRICS_PORT="${METRICS_PORT:-18002}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-300}"
SERVER_LOG="${SERVER_LOG:-${TMPDIR:-/tmp}/tritonserver-gpu-tests.log}"

make setup
docker build -f docker/Dockerfile -t "$IMAGE" .

workdir="$(mktemp -d)"
container=""
cleanup() {
    if [ -n "$container" ]; then
        docker logs "$container" >"$SERVER_LOG" 2>&1 || true
        echo "server log: $SERVER_LOG" >&2
        docker rm -f "$container" >/dev/null || true
    fi
    rm -rf "$workdir"
}
trap cleanup EXIT

# The same repository the local tests serve (sampler plus its variants), rewritten for GPUs.
.venv/bin/python -c 'import sys; from client_tests.server import build_test_repository; build_test_repository(__import__("pathlib").Path(sys.argv[1]))' "$workdir/cpu"
.venv/bin/python -m triton_sampling_mask.ops.gpu_repository "$workdir/cpu" "$workdir/models"

# --ipc=host: the client's system shared-memory regions must be visible to the server.
container="$(docker run -d --gpus all --ipc=host \
    -p "$HTTP_PORT:8000" -p "$GRPC_PORT:8001" -p "$METRICS_PORT:8002" \
    -v "$workdir/models:/models:ro" "$IMAGE" tritonserver --model-repository=/models)"

deadline=$((SECONDS + READY_TIMEOUT_S))
until curl -fsS "http://127.0.0.1:$HTTP_PORT/v2/health/ready" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ] || [ "$(docker inspect -f '{{.State.Running}}' "$container")" != "true" ]; then
        echo "tritonserver did not become ready; its log:" >&2
        docker logs "$container" >&2 || true
        exit 1
    fi
    sleep 2
done

TRITON_EXTERNAL_HTTP_URL="127.0.0.1:$HTTP_PORT" \
TRITON_EXTERNAL_GRPC_URL="127.0.0.1:$GRPC_PORT" \
TRITON_EXTERNAL_METRICS_URL="http://127.0.0.1:$METRICS_PORT/metrics" \
    .venv/bin/python -m pytest client_tests "$@"
