"""Derive the GPU model repository from the CPU one, so config.pbtxt stays the one source of truth.

Every model's config.pbtxt is copied with two changes: its instance group becomes KIND_GPU (one
instance per visible GPU; the model samples on cuda:<model_instance_device_id>) and the parameter
FORCE_CPU_ONLY_INPUT_TENSORS is "no", so Triton hands GPU-resident inputs over without a copy and
the model takes them through DLPack. Everything else (the mask width W included) is unchanged, and
the version folders (1/model.py) are copied as they are.

    python -m triton_sampling_mask.ops.gpu_repository SOURCE_REPOSITORY DEST_REPOSITORY
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

GPU_INSTANCE_GROUP = "instance_group [\n  { kind: KIND_GPU, count: 1 }\n]"
FORCE_CPU_ONLY_KEY = "FORCE_CPU_ONLY_INPUT_TENSORS"
_INSTANCE_GROUP = re.compile(r"instance_group\s*\[[^\]]*\]")
_PARAMETERS = re.compile(r"parameters\s*\[")
_FORCE_CPU_ONLY = re.compile(rf'(key:\s*"{FORCE_CPU_ONLY_KEY}",\s*value:\s*\{{\s*string_value:\s*)"[^"]*"')


def gpu_config_text(config_text: str) -> str:
    """The GPU variant of a config.pbtxt text: KIND_GPU instances, GPU inputs left on the GPU."""
    text, groups = _INSTANCE_GROUP.subn(GPU_INSTANCE_GROUP, config_text)
    if groups == 0:
        text = text.rstrip("\n") + "\n\n" + GPU_INSTANCE_GROUP + "\n"
    elif groups > 1:
        raise ValueError("config.pbtxt has several instance_group blocks; expected one")
    if _FORCE_CPU_ONLY.search(text):
        return _FORCE_CPU_ONLY.sub(lambda m: f'{m.group(1)}"no"', text)
    entry = f'{{ key: "{FORCE_CPU_ONLY_KEY}", value: {{ string_value: "no" }} }}'
    text, lists = _PARAMETERS.subn(
        lambda m: f"parameters [\n  # Keep GPU inputs on the GPU (the model reads them through DLPack).\n  {entry},",
        text,
        count=1,
    )
    if lists == 0:
        text = text.rstrip("\n") + f"\n\nparameters [\n  {entry}\n]\n"
    return text


def build_gpu_repository(source: Path, dest: Path) -> Path:
    """Copy a model repository to `dest`, rewriting every model's config.pbtxt for GPUs."""
    source, dest = Path(source), Path(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    configs = sorted(dest.glob("*/config.pbtxt"))
    if not configs:
        raise ValueError(f"{source} holds no model (no */config.pbtxt)")
    for config in configs:
        config.write_text(gpu_config_text(config.read_text()))
    return dest


def main(argv: list[str] | None = None) -> None:
    """CLI: build DEST from SOURCE (used by docker/Dockerfile and docker/run-gpu-tests.sh)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    print(f"GPU model repository written to {build_gpu_repository(args.source, args.dest)}")


if __name__ == "__main__":
    main()
