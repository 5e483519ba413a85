"""Derive the GPU model repository from the CPU one, so config.pbtxt stays the one source of truth.

Every model's config.pbtxt is copied with two changes: its instance group becomes KIND_GPU (one
instance per visible GPU; the model samples on cuda:<model_instance_device_id>) and the parameter
FORCE_CPU_ONLY_INPUT_TENSORS is "no", so Triton hands GPU-resident inputs over without a copy and
the model takes them through DLPack. Everything else (the mask width W included) is unchanged, and
the version folders (1/model.py) are copied as they are. The configs are rewritten through protobuf
with Triton's own ModelConfig (the package's config reader, `model_config`), so their comments stay
in the CPU repository only.

    python -m triton_sampling_mask.ops.gpu_repository SOURCE_REPOSITORY DEST_REPOSITORY
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

FORCE_CPU_ONLY_KEY = "FORCE_CPU_ONLY_INPUT_TENSORS"


def gpu_config_text(config_text: str) -> str:
    """The GPU variant of a config.pbtxt text: KIND_GPU instances, GPU inputs left on the GPU
    (rewritten through protobuf with Triton's own ModelConfig, as `model_config` reads it)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_text, model_config_pb2.ModelConfig())
    del config.instance_group[:]
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_GPU, count=1)
    config.parameters[FORCE_CPU_ONLY_KEY].string_value = "no"
    return text_format.MessageToString(config)


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
