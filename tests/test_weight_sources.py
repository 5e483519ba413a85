"""The weight loader's parts on small hand-made modules and checkpoints (weights.py): which tensors a
model's checkpoint holds and which names alias them, the check of a source against them (each
refusal's exact message), a checkpoint directory's tensors read in pieces of whole rows, and the
paths and config.json a checkpoint is taken from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save, save_file

from triton_sampling_mask.generation.weights import (
    CheckpointDirectory,
    NamedTensors,
    TensorInfo,
    WeightUpdateError,
    check_infos,
    copy_into,
    resolve_checkpoint,
    weight_tensors,
)


class Tied(torch.nn.Module):
    """An embedding tied to the output head, a bias, a parameter of its own and an integer buffer
    (persistent) besides a non-persistent one a checkpoint never holds."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4)
        self.head.weight = self.embed.weight
        self.zeta = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("counts", torch.tensor([1, 2, 3], dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def refused(call, *args) -> str:
    with pytest.raises(WeightUpdateError) as caught:
        call(*args)
    return caught.value.message


# weight_tensors: what a checkpoint of a model holds.


def test_a_tied_tensor_is_held_once_under_its_first_name_and_aliased():
    model = Tied()
    tensors, aliases = weight_tensors(model)
    assert list(tensors) == ["zeta", "counts", "embed.weight", "head.bias"]
    assert aliases == {"head.weight": "embed.weight"}
    # The model's own tensors (parameters as parameters), not copies or detached views.
    assert tensors["embed.weight"] is model.embed.weight
    assert tensors["head.bias"] is model.head.bias
    assert tensors["counts"] is model.counts


# check_infos: a source's names, shapes and dtypes against the model's.


def infos(**shapes_and_dtypes) -> dict[str, TensorInfo]:
    return {name.replace("__", "."): TensorInfo(*info) for name, info in shapes_and_dtypes.items()}


def plan_of(source_infos: dict[str, TensorInfo], complete: bool = False) -> dict[str, str]:
    tensors, aliases = weight_tensors(Tied())
    return check_infos(tensors, aliases, source_infos, SimpleNamespace(label="src", complete=complete))


def test_an_alias_replaces_the_tensor_it_names():
    assert plan_of(infos(head__weight=((4, 3), torch.float32))) == {"head.weight": "embed.weight"}


def test_a_tied_tensor_sent_under_both_names_is_written_once_and_the_rest_still_checked():
    # Sorted, the alias comes after the tensor it names and before "zeta".
    source = infos(
        embed__weight=((4, 3), torch.float32), head__weight=((4, 3), torch.float32), zeta=((2,), torch.float32)
    )
    assert plan_of(source) == {"embed.weight": "embed.weight", "zeta": "zeta"}
    source["zeta"] = TensorInfo((3,), torch.float32)
    assert refused(plan_of, source) == "src: tensor 'zeta' has shape [3], the served LM's has [2]"


def test_an_integer_tensor_takes_its_own_dtype_only():
    assert plan_of(infos(counts=((3,), torch.int64))) == {"counts": "counts"}
    assert (
        refused(plan_of, infos(counts=((3,), torch.int32))) == "src: tensor 'counts' is int32, the served LM's is int64"
    )
    assert refused(plan_of, infos(counts=((3,), torch.float64))) == (
        "src: tensor 'counts' is float64, the served LM's is int64"
    )
    assert refused(plan_of, infos(head__bias=((4,), torch.int64))) == (
        "src: tensor 'head.bias' is int64, the served LM's is float32"
    )


def test_a_floating_tensor_takes_any_floating_dtype():
    assert plan_of(infos(head__bias=((4,), torch.bfloat16), embed__weight=((4, 3), torch.float64))) == {
        "embed.weight": "embed.weight",
        "head.bias": "head.bias",
    }


def test_a_source_with_nothing_to_update_is_refused():
    assert refused(plan_of, {}) == "src: no tensors to update"


def test_a_complete_source_names_the_first_missing_tensor():
    assert refused(plan_of, infos(head__bias=((4,), torch.float32)), True) == (
        "src: tensor 'counts' is missing (3 missing in all)"
    )


def test_an_integer_buffer_is_copied_exactly():
    model = Tied()
    assert copy_into(model, NamedTensors({"counts": torch.tensor([7, -(2**40), 0])}, "src")) == 1
    assert model.counts.tolist() == [7, -(2**40), 0]


# CheckpointDirectory: *.safetensors files, read in pieces of whole rows.


def test_a_directory_without_safetensors_files_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"weights")
    assert refused(CheckpointDirectory, tmp_path, "ckpt") == (
        "ckpt: no .safetensors files (save the model with safetensors)"
    )


def test_a_tensor_in_two_files_is_refused(tmp_path):
    save_file({"a": torch.zeros(2), "w": torch.zeros(3)}, tmp_path / "one.safetensors")
    save_file({"w": torch.zeros(3)}, tmp_path / "two.safetensors")
    assert refused(CheckpointDirectory, tmp_path, "ckpt") == "ckpt: tensor 'w' is in two files"


def test_a_dtype_no_served_lm_takes_is_refused_naming_the_tensor(tmp_path):
    save_file({"ok": torch.zeros(2), "odd": torch.zeros(2, dtype=torch.float8_e4m3fn)}, tmp_path / "m.safetensors")
    assert refused(CheckpointDirectory, tmp_path, "ckpt") == "tensor 'odd' has dtype F8_E4M3, which no served LM takes"


def test_an_unreadable_file_is_refused_naming_it_and_the_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    message = refused(CheckpointDirectory, tmp_path, "ckpt")
    assert message.startswith("ckpt/model.safetensors is not a readable safetensors file (SafetensorError: ")
    assert "broken" not in message


def rows_of(directory: CheckpointDirectory, name: str) -> list[tuple[object, list]]:
    return [(rows, values.tolist()) for rows, values in directory.pieces(name)]


@pytest.fixture
def checkpoint(tmp_path):
    save_file(
        {
            "matrix": torch.arange(40, dtype=torch.float32).reshape(10, 4),
            "cube": torch.arange(24, dtype=torch.int16).reshape(3, 2, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "hollow": torch.zeros(5, 0, dtype=torch.bfloat16),
        },
        tmp_path / "model.safetensors",
    )
    return CheckpointDirectory(tmp_path, "ckpt")


def test_the_infos_are_read_from_the_files_header(checkpoint):
    assert checkpoint.infos() == {
        "matrix": TensorInfo((10, 4), torch.float32),
        "cube": TensorInfo((3, 2, 4), torch.int16),
        "scalar": TensorInfo((), torch.float64),
        "hollow": TensorInfo((5, 0), torch.bfloat16),
    }


def test_a_scalar_is_one_piece(checkpoint):
    [(rows, values)] = list(checkpoint.pieces("scalar"))
    assert rows is None and values.shape == () and values.dtype == torch.float64 and values.item() == 2.5


def test_pieces_are_as_many_whole_rows_as_fit(checkpoint, monkeypatch):
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 40)  # a row: 16 bytes
    assert rows_of(checkpoint, "matrix") == [
        (slice(0, 2), [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (slice(2, 4), [[8, 9, 10, 11], [12, 13, 14, 15]]),
        (slice(4, 6), [[16, 17, 18, 19], [20, 21, 22, 23]]),
        (slice(6, 8), [[24, 25, 26, 27], [28, 29, 30, 31]]),
        (slice(8, 10), [[32, 33, 34, 35], [36, 37, 38, 39]]),
    ]
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 48)  # a row: 2 * 2 * 4 bytes
    assert rows_of(checkpoint, "cube") == [
        (slice(0, 3), torch.arange(24).reshape(3, 2, 4).tolist()),
    ]
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 47)
    assert [rows for rows, _ in rows_of(checkpoint, "cube")] == [slice(0, 2), slice(2, 3)]


def test_a_row_larger_than_a_chunk_is_one_piece(checkpoint, monkeypatch):
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 8)
    pieces = rows_of(checkpoint, "matrix")
    assert [rows for rows, _ in pieces] == [slice(i, i + 1) for i in range(10)]
    assert [values for _, values in pieces] == [[[4 * i + j for j in range(4)]] for i in range(10)]


def test_rows_of_no_bytes_are_read_a_chunk_at_a_time(checkpoint, monkeypatch):
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 3)
    assert [(rows, len(values)) for rows, values in rows_of(checkpoint, "hollow")] == [
        (slice(0, 3), 3),
        (slice(3, 5), 2),
    ]


def test_a_tensor_gone_from_its_file_is_refused_naming_it(checkpoint, tmp_path):
    # The same file rewritten after its header was read (a file replaced by another is not read:
    # test_weights_root.py).
    (tmp_path / "model.safetensors").write_bytes(save({"other": torch.zeros(1)}))
    with pytest.raises(WeightUpdateError) as caught:
        list(checkpoint.pieces("scalar"))
    assert caught.value.message.startswith("ckpt/model.safetensors: tensor 'scalar' cannot be read (SafetensorError: ")


# config.json and the weights root.


def directory_with_config(tmp_path, config) -> None:
    save_file({"w": torch.zeros(1)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))


def test_a_config_that_is_not_json_is_refused(tmp_path):
    directory_with_config(tmp_path, "{not json")
    served = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    assert (
        refused(CheckpointDirectory, tmp_path, "ckpt", served)
        == "ckpt/config.json is not readable JSON (JSONDecodeError)"
    )


def test_a_config_naming_another_architecture_is_refused(tmp_path):
    directory_with_config(tmp_path, {"model_type": "llama", "architectures": ["MistralForCausalLM"]})
    served = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    assert refused(CheckpointDirectory, tmp_path, "ckpt", served) == (
        "ckpt/config.json: architectures is not the served LM's (['LlamaForCausalLM'])"
    )


def test_what_the_served_config_does_not_say_is_not_checked(tmp_path):
    directory_with_config(tmp_path, {"model_type": "llama", "architectures": ["MistralForCausalLM"]})
    assert CheckpointDirectory(tmp_path, "ckpt", SimpleNamespace(model_type="llama")).infos() == {
        "w": TensorInfo((1,), torch.float32)
    }


def test_updates_from_disk_off_say_which_parameter_turns_them_on():
    assert refused(resolve_checkpoint, "", "step1") == (
        "updates from disk are off: the generate model's 'weights_root' parameter is empty"
    )


def test_the_root_itself_is_named_dot(tmp_path):
    (tmp_path / "a").mkdir()
    for requested in (".", str(tmp_path), "a/..", "./"):
        directory, label = resolve_checkpoint(str(tmp_path), requested)
        with directory:
            assert label == directory.label == "."
