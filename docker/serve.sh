#!/usr/bin/env bash
# The image's command: tritonserver on the GPU model repository, sized for the largest request the
# README promises ("Operations: limits"): max_batch_size 256 rows of max_vocab_size 262144 FP32
# logits, 256 MiB (tests/test_container_image.py checks these numbers against config.pbtxt).
#   serve.sh [extra tritonserver flags]   e.g. --model-control-mode=explicit --load-model=sampler
#   serve.sh --dry-run [flags]            print the command, one argument a line, and exit
# Every size below can be overridden from the environment (docker run -e CUDA_POOL_BYTES=...).
set -euo pipefail

MIB=$((1024 * 1024))
LARGEST_REQUEST_BYTES=$((256 * 262144 * 4))
# Python backend: each model instance (one per GPU) takes its inputs through a /dev/shm region of
# its own. It starts at 64 MiB, enough for every batch below 64 rows at the largest vocabulary,
# and grows 64 MiB at a time (the backend asks 1.1 x the bytes it needs), so the largest batch
# takes at most 4 growth steps and a region peaks near 320 MiB: size /dev/shm for that per
# instance (compose.yaml's shm_size; run-gpu-tests.sh shares the host's with --ipc=host).
SHM_DEFAULT_BYTES="${SHM_DEFAULT_BYTES:-$((64 * MIB))}"
SHM_GROWTH_BYTES="${SHM_GROWTH_BYTES:-$((64 * MIB))}"
# Inputs a client or an ensemble leaves on a GPU reach the KIND_GPU instances through Triton's
# CUDA pool (FORCE_CPU_ONLY_INPUT_TENSORS "no"); the default is 64 MiB a GPU. Room for two largest
# requests a GPU: one being sampled while the next is handed over.
CUDA_POOL_BYTES="${CUDA_POOL_BYTES:-$((2 * LARGEST_REQUEST_BYTES))}"
# Host inputs are staged to the GPUs through pinned memory (default 256 MiB in all): the same room.
PINNED_POOL_BYTES="${PINNED_POOL_BYTES:-$((2 * LARGEST_REQUEST_BYTES))}"
MODEL_REPOSITORY="${MODEL_REPOSITORY:-/models}"

dry_run=false
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=true
    shift
fi

# One CUDA pool flag per visible GPU, numbered as CUDA numbers them (Triton has no "every GPU" form).
gpu_count="${GPU_COUNT:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
pools=()
for ((gpu = 0; gpu < gpu_count; gpu++)); do
    pools+=("--cuda-memory-pool-byte-size=${gpu}:${CUDA_POOL_BYTES}")
done

# The launcher's supervisor runs the image's tritonserver: restarts it when it dies, reloads a model
# whose stub died, serves :8003/ready (a real inference works) and locks the admin APIs with
# TRITON_ADMIN_KEY (a random one when unset). Flags after "--" go to tritonserver and win.
command=(
    python3 -m triton_sampling_mask.ops.launcher
    --model-repository "${MODEL_REPOSITORY}"
    --
    "--backend-config=python,shm-default-byte-size=${SHM_DEFAULT_BYTES}"
    "--backend-config=python,shm-growth-byte-size=${SHM_GROWTH_BYTES}"
    "--pinned-memory-pool-byte-size=${PINNED_POOL_BYTES}"
    "${pools[@]}"
    "$@"
)
if "$dry_run"; then
    printf '%s\n' "${command[@]}"
    exit 0
fi
exec "${command[@]}"
