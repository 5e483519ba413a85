#!/usr/bin/env bash
# The image's command: the launcher on the GPU model repository, with Triton's pinned and CUDA pools
# sized for the largest request the sampler's config admits (the launcher sizes the /dev/shm pools).
#   serve.sh [extra tritonserver flags]   e.g. --model-control-mode=explicit --load-model=sampler
#   serve.sh --dry-run [flags]            print the command, one argument a line, and exit
# Every size is a setting of plugin/ops/settings.py (docs/settings.md): its default lives there, and
# the environment overrides it (docker run -e CUDA_POOL_BYTES=...).
set -euo pipefail

MODEL_REPOSITORY="${MODEL_REPOSITORY:-/models}"
# CUDA_POOL_BYTES, PINNED_POOL_BYTES and GPU_COUNT (the GPUs torch sees, unless set), shell-quoted.
settings="$(python3 -m triton_sampling_mask.ops.settings --shell CUDA_POOL_BYTES PINNED_POOL_BYTES GPU_COUNT)"
eval "$settings"

dry_run=false
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=true
    shift
fi

# One CUDA pool flag per visible GPU, numbered as CUDA numbers them (Triton has no "every GPU" form).
pools=()
for ((gpu = 0; gpu < GPU_COUNT; gpu++)); do
    pools+=("--cuda-memory-pool-byte-size=${gpu}:${CUDA_POOL_BYTES}")
done

# The launcher's supervisor runs the image's tritonserver on loopback behind HAProxy, which owns
# ports 8000-8003 (the front door: connection caps, timeouts, body limits, load shedding, the admin
# APIs locked with TRITON_ADMIN_KEY, a random one when unset); it restarts tritonserver when it
# dies, reloads a model whose stub died and serves :8003/ready (a real inference works). The pod's
# or container's memory limit bounds tritonserver (no cgroup of its own can be made in one).
# Flags after "--" go to tritonserver and win.
command=(
    python3 -m triton_sampling_mask.ops.launcher
    --model-repository "${MODEL_REPOSITORY}"
    --
    "--pinned-memory-pool-byte-size=${PINNED_POOL_BYTES}"
    "${pools[@]}"
    "$@"
)
if "$dry_run"; then
    printf '%s\n' "${command[@]}"
    exit 0
fi
exec "${command[@]}"
