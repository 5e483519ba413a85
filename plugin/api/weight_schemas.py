"""The request bodies of the weight routes: SGLang's request models (io_struct.py) field for field,
and vLLM's /sleep and /wake_up as SkyRL sends them.

Every field SGLang defines is accepted at its neutral value; a value this server cannot honour is
refused by `unsupported()` with a message naming the field, never ignored. Unknown fields are
refused (a typo must not pass as a default). Numbers are parsed in pydantic's lax mode, as SGLang
parses them: AReaL sends `master_port` as the string "29500".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from ..client.weight_updates import PAUSE_MODES

SGLANG_DEFAULT_GROUP = "weight_update_group"
# load_format values that name what this server reads (Hugging Face safetensors directories).
DISK_FORMATS = (None, "auto", "safetensors")


class SGLangRequest(BaseModel):
    """SGLang's BaseReq: every request may carry its id; the tokenizer worker's IPC name is SGLang's
    own plumbing (accepted only empty)."""

    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    http_worker_ipc: str | None = None

    def unsupported(self) -> list[str]:
        """The fields set to values this server cannot honour, each with why (empty: none)."""
        return ["http_worker_ipc: SGLang's internal routing field must be left out"] if self.http_worker_ipc else []


def _pause_mode(abort_all_requests: bool, pause_mode: str | None) -> str:
    """Our pause mode: `pause_mode` (our extension) wins, else SGLang's abort_all_requests."""
    return pause_mode or ("abort" if abort_all_requests else "in_place")


class UpdateFromDisk(SGLangRequest):
    """SGLang's UpdateWeightFromDiskReqInput, plus our `pause_mode`."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False  # no effect: an update here leaves no cached blocks to return
    keep_pause: bool = False
    recapture_cuda_graph: bool = False  # no effect: no CUDA graphs are captured here
    token_step: int = 0
    flush_cache: bool = True  # no effect: rows in flight always get their KV cache rebuilt
    manifest: dict | None = None
    pause_mode: Literal[PAUSE_MODES] | None = None

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.load_format not in DISK_FORMATS:
            problems.append(f"load_format {self.load_format!r}: only safetensors checkpoints are read")
        if self.is_async:
            problems.append("is_async: updates here are synchronous (the answer comes once the weights serve)")
        if self.keep_pause:
            problems.append("keep_pause: call /pause_generation first; an update keeps a paused engine paused")
        if self.token_step:
            problems.append("token_step: name the weights with weight_version instead")
        if self.manifest is not None:
            problems.append("manifest: a checkpoint is read whole from its directory")
        return problems

    def command(self) -> dict:
        return {
            "op": "update_weights_from_disk",
            "model_path": self.model_path,
            "pause_mode": _pause_mode(self.abort_all_requests, self.pause_mode),
            **({"weight_version": self.weight_version} if self.weight_version is not None else {}),
        }


class UpdateFromDistributed(SGLangRequest):
    """SGLang's UpdateWeightsFromDistributedReqInput in both its forms: the batched one (`names`,
    `dtypes`, `shapes`: AReaL, current SGLang) and the one-tensor one of SGLang before 0.4.4
    (`name`, `dtype`, `shape`: SkyRL), plus our `pause_mode`. Without `group_name` the open group
    is used (the one-tensor form has none; SkyRL names its group "skyrl")."""

    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    group_name: str | None = None
    flush_cache: bool = True  # no effect, as from disk
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False  # no effect, as from disk
    pause_mode: Literal[PAUSE_MODES] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> UpdateFromDistributed:
        batched = (self.names, self.dtypes, self.shapes)
        single = (self.name, self.dtype, self.shape)
        if any(v is not None for v in batched) and any(v is not None for v in single):
            raise ValueError("send either names, dtypes and shapes, or name, dtype and shape, not both")
        if any(v is not None for v in single):
            if any(v is None for v in single):
                raise ValueError("name, dtype and shape go together")
        elif any(v is None for v in batched):
            raise ValueError("names, dtypes and shapes are required (or name, dtype and shape for one tensor)")
        elif not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor, got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        return self

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.load_format is not None:
            problems.append(f"load_format {self.load_format!r}: tensors are received as sent, one by one")
        if self.selector == "draft":
            problems.append("selector 'draft': this server has no draft model (its n-gram drafting has no weights)")
        return problems

    def command(self) -> dict:
        if self.name is not None:
            names, dtypes, shapes = [self.name], [self.dtype], [self.shape]
        else:
            names, dtypes, shapes = self.names, self.dtypes, self.shapes
        return {
            "op": "update_weights_from_distributed",
            "tensors": [{"name": n, "dtype": d, "shape": s} for n, d, s in zip(names, dtypes, shapes)],
            "pause_mode": _pause_mode(self.abort_all_requests, self.pause_mode),
            **({"group_name": self.group_name} if self.group_name is not None else {}),
            **({"weight_version": self.weight_version} if self.weight_version is not None else {}),
        }


class InitWeightsUpdateGroup(SGLangRequest):
    """SGLang's InitWeightsUpdateGroupReqInput. SGLang's default backend is NCCL; left out here, the
    model takes its device's (NCCL on a GPU, gloo on CPU)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = SGLANG_DEFAULT_GROUP
    backend: str | None = None

    def command(self) -> dict:
        fields = self.model_dump(include={"master_address", "master_port", "rank_offset", "world_size", "group_name"})
        return {"op": "init_weights_update_group", **fields, **({"backend": self.backend} if self.backend else {})}


class DestroyWeightsUpdateGroup(SGLangRequest):
    """SGLang's DestroyWeightsUpdateGroupReqInput; without `group_name`, the open group."""

    group_name: str | None = None

    def command(self) -> dict:
        return {"op": "destroy_weights_update_group", **({"group_name": self.group_name} if self.group_name else {})}


class UpdateWeightVersion(SGLangRequest):
    """SGLang's UpdateWeightVersionReqInput: a new version for the weights as they are."""

    new_version: str
    abort_all_requests: bool = True

    def command(self) -> dict:
        mode = "abort" if self.abort_all_requests else "in_place"
        return {"op": "update_weight_version", "weight_version": self.new_version, "pause_mode": mode}


class MemoryOccupation(SGLangRequest):
    """SGLang's Release/ResumeMemoryOccupationReqInput."""

    tags: list[str] | None = None


class Sleep(BaseModel):
    """vLLM's /sleep (`level` is a query parameter there; SkyRL sends it in the body)."""

    model_config = ConfigDict(extra="forbid")
    level: Literal[1, 2] = 1


class WakeUp(BaseModel):
    """vLLM's /wake_up (`tags` are query parameters there; SkyRL sends `{"tags": 1}` in the body
    when it has none, which is taken as none)."""

    model_config = ConfigDict(extra="forbid")
    tags: list[str] | Literal[1] | None = None


class PauseGeneration(SGLangRequest):
    """SGLang's PauseGenerationReqInput, with our `finish` mode."""

    mode: Literal["abort", "retract", "in_place", "finish"] = "abort"

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.mode == "retract":
            problems.append("mode 'retract' is not supported; use abort, finish or in_place")
        return problems


class ContinueGeneration(SGLangRequest):
    """SGLang's ContinueGenerationReqInput."""

    torch_empty_cache: bool = True  # no effect: nothing is cached to hand back
