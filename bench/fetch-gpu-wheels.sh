#!/usr/bin/env bash
# Download, here (where PyPI answers), the wheels bench/gpu-check.sh installs on the device machine a
# session may be lent: one H200, x86-64, no network, a python3 3.12 that already has torch (CUDA),
# triton and numpy. 3.12 is the Python of docker/Dockerfile's current line, so the wheels are that
# line's (cp312, manylinux x86-64) and transformers is the line's pin (docker/image_lines.py reads
# it); .gpu-wheels/LINE names the line. They land in .gpu-wheels/ (git-ignored) and travel with the working tree, and
# tree plus wheels may weigh 64 MiB in all: the groups below are kept, most needed first, while the
# total fits; the others are listed in .gpu-wheels/MANIFEST.tsv and the check skips what needs them.
#   bench/fetch-gpu-wheels.sh     then, on the device: bench/gpu-check.sh (carry .gpu-wheels)
# nvidia-pytriton (the real tritonserver) is not among them: its wheel alone is 52.8 MiB, and the
# client tests it would serve need 8.6 MiB of HTTP client wheels beside the groups below (78 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${GPU_WHEELS:-.gpu-wheels}"
budget_bytes=$(( ${GPU_WHEEL_BUDGET_MIB:-64} * 1024 * 1024 ))
margin_bytes=$(( 1024 * 1024 ))  # the logs and JSON a check writes are not carried, but stay clear of the edge
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
line="$("$python" docker/image_lines.py --default)"
line_python="$("$python" docker/image_lines.py --line "$line" --get python)"
transformers="$("$python" docker/image_lines.py --line "$line" --get transformers)"
abi="cp${line_python/./}"

# Exact closures for CPython 3.12 (resolved with pip for 3.12, manylinux x86-64), less what the
# device's python3 has (torch and its dependencies, triton, numpy; typing-extensions is here all the
# same: pydantic and anyio need 4.16). Left out on purpose: hf-xet (4.3 MiB; huggingface_hub imports
# it only to download from the Hub). The transformers closure is the one of the line's pin: when
# that pin moves, resolve it again (pip install --dry-run --report for 3.12) and update it here.
# Each entry: group|what needs it|wheels.
groups=(
    "pytest|anything at all: pytest, pytest-timeout (pyproject sets a timeout), hypothesis|pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 pytest-timeout==2.4.0 hypothesis==6.170.17 sortedcontainers==2.4.0"
    "tritonclient|the client package (testbed.server, test_sampling_params) and tests/test_gpu_path.py|tritonclient==2.73.0 ml-dtypes==0.5.4 python-rapidjson==1.25 urllib3==2.8.0 grpcio==1.85.3 protobuf==6.33.6"
    "scipy|tests/test_sampler.py (the chi-square test of the draws; the module imports scipy.stats)|scipy==1.17.1"
    "transformers|tests/test_generation.py (the generate model's LM, transformers as in the $line image)|transformers==$transformers huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19 pyyaml==6.0.4 tqdm==4.70.1 typer==0.29.2 click==8.5.1 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 annotated-doc==0.0.7 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 idna==3.20 truststore==0.10.5"
)
# The device's glibc is not known here: wheels for glibc 2.28 and older only.
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done

staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
rm -rf "$dest"
mkdir -p "$dest"
echo "$line" >"$dest/LINE"
# What `run` carries besides the wheels: tracked files and untracked ones git does not ignore.
tree_bytes="$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')"
manifest="$dest/MANIFEST.tsv"
printf 'status\tgroup\tbytes\tneeded by\n' >"$manifest"
used=$((tree_bytes + margin_bytes))
for entry in "${groups[@]}"; do
    IFS='|' read -r group needed_by wheels <<<"$entry"
    read -ra pins <<<"$wheels"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$line_python" --implementation cp \
        --abi "$abi" "${platforms[@]}" --dest "$staging/$group" "${pins[@]}"
    bytes="$(du -cb "$staging/$group"/*.whl | tail -n 1 | cut -f 1)"
    if [ $((used + bytes)) -le "$budget_bytes" ]; then
        mv "$staging/$group"/*.whl "$dest/"
        used=$((used + bytes))
        status=kept
    else
        status=left-out
    fi
    printf '%s\t%s\t%s\t%s\n' "$status" "$group" "$bytes" "$needed_by" >>"$manifest"
done

echo "wheels for the GPU check in $dest, line $line (Python $line_python; working tree $((tree_bytes / 1024)) KiB, budget $((budget_bytes / 1048576)) MiB):"
awk -F '\t' 'NR > 1 {printf "  %-8s %-13s %6.2f MiB  %s\n", $1, $2, $3 / 1048576, $4}' "$manifest"
find "$dest" -name '*.whl' -printf '%s %f\n' | sort -k 2 | awk '{printf "    %7.2f MiB  %s\n", $1 / 1048576, $2}'
echo "  in all: $(( (used - margin_bytes) / 1024 )) KiB of $((budget_bytes / 1024)) KiB"
