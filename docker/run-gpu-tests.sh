#!/usr/bin/env bash
# Build the image, serve the client tests' model repository on the GPUs inside the container and
# run every test of client_tests/ from this host against it. The few that need a local server of
# their own are skipped, each with its reason, and pytest ends with a summary of what ran where;
# the last line names the image line and the Triton that served them.
# Needs Docker with the NVIDIA container toolkit.
#   docker/run-gpu-tests.sh [extra pytest arguments]
#   IMAGE_LINE=2.51 docker/run-gpu-tests.sh      # the NGC 24.10 line (default: current, NGC 26.09)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_LINE="${IMAGE_LINE:-$(python3 docker/image_lines.py --default)}"
IMAGE="${IMAGE:-triton-sampling-mask:gpu-tests-$IMAGE_LINE}"
HTTP_PORT="${HTTP_PORT:-18000}"
GRPC_PORT="${GRPC_PORT:-18001}"
METRICS_PORT="${METRICS_PORT:-18002}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-300}"
SERVER_LOG="${SERVER_LOG:-${TMPDIR:-/tmp}/tritonserver-gpu-tests.log}"

make setup
docker build -f docker/Dockerfile --build-arg "LINE=$IMAGE_LINE" -t "$IMAGE" .

workdir="$(mktemp -d)"
container=""
log_follower=""
cleanup() {
    if [ -n "$log_follower" ]; then
        kill "$log_follower" 2>/dev/null || true
    fi
    if [ -n "$container" ]; then
        docker logs "$container" >"$SERVER_LOG" 2>&1 || true
        echo "server log: $SERVER_LOG" >&2
        docker rm -f "$container" >/dev/null || true
    fi
    rm -rf "$workdir"
}
trap cleanup EXIT

# The repository the local tests serve (the sampler and its variants, plus the faulty sampler
# test_reload loads on request), rewritten for GPUs, and the flags that serve it as the tests
# expect: explicit model control, every model loaded but the faulty one.
flags="$(.venv/bin/python -m testbed.server "$workdir/models" --gpu)"
mapfile -t server_flags <<<"$flags"

# --ipc=host: the client's system shared-memory regions must be visible to the server (and the
# Python backend's /dev/shm regions then use the host's). The regions the tests create are this
# user's, mode 0600, so the server runs as this user too (--user; the image runs as any uid).
# serve.sh adds the shm and CUDA-pool sizes.
# The container locks its admin APIs with this key; the tests that load and unload models send it.
# The front door is on, as users reach the container: the client tests run through it, as they do
# locally (client_tests/conftest.py); the attacks on the front door itself run on a local launcher.
ADMIN_KEY="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
container="$(docker run -d --gpus all --ipc=host --user "$(id -u):$(id -g)" -e "TRITON_ADMIN_KEY=$ADMIN_KEY" \
    -p "$HTTP_PORT:8000" -p "$GRPC_PORT:8001" -p "$METRICS_PORT:8002" \
    -v "$workdir/models:/models:ro" "$IMAGE" bash /opt/triton-sampling-mask/serve.sh "${server_flags[@]}")"
# Some tests read the server's log (test_reload, test_generate): stream it to a file as it grows.
docker logs -f "$container" >"$SERVER_LOG" 2>&1 &
log_follower=$!

deadline=$((SECONDS + READY_TIMEOUT_S))
until curl -fsS "http://127.0.0.1:$HTTP_PORT/v2/health/ready" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ] || [ "$(docker inspect -f '{{.State.Running}}' "$container")" != "true" ]; then
        echo "tritonserver did not become ready; its log:" >&2
        docker logs "$container" >&2 || true
        exit 1
    fi
    sleep 2
done

# The line as the image itself states it (docker/Dockerfile's SAMPLER_*, NGC's own versions).
# shellcheck disable=SC2016  # expanded inside the container
line="$(docker exec "$container" sh -c 'echo "line $SAMPLER_LINE: Triton $TRITON_SERVER_VERSION (NGC $NVIDIA_TRITON_SERVER_VERSION), Python $SAMPLER_PYTHON, torch $SAMPLER_TORCH"')"
echo "client_tests/ against container ${container:0:12} ($IMAGE, $line), serving on:"
docker exec "$container" nvidia-smi -L || true
rc=0
TRITON_EXTERNAL_HTTP_URL="127.0.0.1:$HTTP_PORT" \
TRITON_EXTERNAL_GRPC_URL="127.0.0.1:$GRPC_PORT" \
TRITON_EXTERNAL_METRICS_URL="http://127.0.0.1:$METRICS_PORT/metrics" \
TRITON_EXTERNAL_LOG="$SERVER_LOG" \
TRITON_EXTERNAL_MODEL_CONTROL=explicit \
TRITON_EXTERNAL_ADMIN_KEY="$ADMIN_KEY" \
    .venv/bin/python -m pytest client_tests "$@" || rc=$?
echo "run-gpu-tests: client_tests/ exit $rc on $IMAGE, $line"
[ "$rc" = 0 ] || exit "$rc"
