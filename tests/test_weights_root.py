"""Nothing outside the weights root is opened by an update from disk: links that leave the root
(a shard, config.json, a directory on a file's way) are refused with nothing read from where they
point, a name swapped for such a link after the check is not read either, and the links a
checkpoint keeps under the root (a `latest` link, Hugging Face's cache layout) are followed.

The checkpoints are a small module's: under the root every value is 1, outside it 7 (what an
update must never load)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from triton_sampling_mask.generation import weights_root
from triton_sampling_mask.generation.weights import (
    CheckpointDirectory,
    WeightUpdateError,
    checked_plan,
    copy_into,
    resolve_checkpoint,
    write_plan,
)
from triton_sampling_mask.generation.weights_root import PathRefused, open_root

INSIDE, OUTSIDE = 1.0, 7.0
SECRET = "secret-model-type-from-outside"
SERVED = type("Served", (), {"model_type": "tiny", "architectures": ["TinyForCausalLM"]})()
CONFIG = {"model_type": "tiny", "architectures": ["TinyForCausalLM"]}


def model() -> torch.nn.Module:
    module = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.zero_()
    return module


def write_checkpoint(directory, value: float, config: dict | None = CONFIG) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"weight": torch.full((3, 4), value), "bias": torch.full((3,), value)}, directory / "model.safetensors")
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def tree(tmp_path):
    """(root, outside): a root with a good checkpoint `step1`; outside it, a checkpoint, a text
    file and a JSON config naming another model type."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_checkpoint(root / "step1", INSIDE)
    write_checkpoint(outside / "ckpt", OUTSIDE, {"model_type": SECRET})
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (outside / "config.json").write_text(json.dumps({"model_type": SECRET, "architectures": [SECRET]}))
    return root, outside


def load(root, path: str, module: torch.nn.Module | None = None) -> torch.nn.Module:
    module = module if module is not None else model()
    directory, label = resolve_checkpoint(str(root), path)
    with CheckpointDirectory(directory, label, SERVED) as source:
        copy_into(module, source)
    return module


def values(module: torch.nn.Module) -> set[float]:
    return {float(v) for t in module.state_dict().values() for v in t.flatten()}


def refused_load(root, outside, path: str) -> str:
    """The message of a refused load, checked to name no absolute path and to echo nothing from
    outside; the module it was loaded into is left untouched."""
    module = model()
    with pytest.raises(WeightUpdateError) as refused:
        load(root, path, module)
    message = refused.value.message
    for leak in (str(root), str(outside), "/proc/", SECRET, "root:x", "not readable JSON"):
        assert leak not in message, message
    assert values(module) == {0.0}
    return message


def test_a_checkpoint_under_the_root_loads(tree):
    root, _ = tree
    assert values(load(root, "step1")) == {INSIDE}


def test_a_shard_linked_outside_the_root_is_refused(tree):
    root, outside = tree
    (root / "linked").mkdir()
    (root / "linked" / "config.json").write_text(json.dumps(CONFIG))
    (root / "linked" / "model.safetensors").symlink_to(outside / "ckpt" / "model.safetensors")
    assert refused_load(root, outside, "linked") == ("linked/model.safetensors is outside the allowed weights root")


@pytest.mark.parametrize("target", ["passwd", "config.json"])
def test_a_config_linked_outside_the_root_is_not_read(tree, target):
    root, outside = tree
    write_checkpoint(root / "linked", INSIDE, config=None)
    (root / "linked" / "config.json").symlink_to(outside / target)
    assert refused_load(root, outside, "linked") == "linked/config.json is outside the allowed weights root"


def test_a_shard_reached_through_a_directory_link_out_of_the_root_is_refused(tree):
    root, outside = tree
    (root / "shards").symlink_to(outside / "ckpt")
    (root / "linked").mkdir()
    (root / "linked" / "model.safetensors").symlink_to("../shards/model.safetensors")
    assert refused_load(root, outside, "linked") == ("linked/model.safetensors is outside the allowed weights root")


@pytest.mark.parametrize(
    "link",
    ["../../outside/ckpt/model.safetensors", "../../root/../outside/ckpt/model.safetensors", "ABSOLUTE"],
)
def test_relative_and_absolute_links_that_climb_out_are_refused(tree, link):
    root, outside = tree
    (root / "linked").mkdir()
    target = str(outside / "ckpt" / "model.safetensors") if link == "ABSOLUTE" else link
    (root / "linked" / "model.safetensors").symlink_to(target)
    assert refused_load(root, outside, "linked").endswith("is outside the allowed weights root")


def test_a_checkpoint_directory_linked_out_of_the_root_is_refused(tree):
    root, outside = tree
    (root / "away").symlink_to(outside)
    message = refused_load(root, outside, "away/ckpt")
    assert message == "model_path 'away/ckpt' is outside the allowed weights root"


def test_a_directory_swapped_for_a_link_after_it_was_resolved_is_not_read(tree):
    """The directory resolve_checkpoint opened is the one read, whatever its name points to later."""
    root, outside = tree
    directory, label = resolve_checkpoint(str(root), "step1")
    (root / "step1").rename(root / "moved")
    (root / "step1").symlink_to(outside / "ckpt")
    module = model()
    with CheckpointDirectory(directory, label, SERVED) as source:
        copy_into(module, source)
    assert values(module) == {INSIDE}


def test_a_shard_swapped_for_a_link_between_the_check_and_the_write_is_not_read(tree):
    """The engine pauses between the check and the write: a name swapped then is not followed."""
    root, _ = tree
    directory, label = resolve_checkpoint(str(root), "step1")
    module = model()
    with CheckpointDirectory(directory, label, SERVED) as source:
        plan = checked_plan(module, source)
        shard = root / "step1" / "model.safetensors"
        shard.rename(root / "step1" / "old")
        shard.symlink_to(tree[1] / "ckpt" / "model.safetensors")
        write_plan(module, source, plan)
    assert values(module) == {INSIDE}


def test_a_config_naming_another_model_type_is_refused_without_echoing_it(tree):
    root, outside = tree
    write_checkpoint(root / "other", INSIDE, {"model_type": SECRET})
    assert refused_load(root, outside, "other") == "other/config.json: model_type is not the served LM's ('tiny')"


@pytest.mark.parametrize("config", ["[1, 2]", '"model_type"', "3"])
def test_a_config_that_is_not_an_object_is_refused(tree, config):
    root, outside = tree
    write_checkpoint(root / "odd", INSIDE, config=None)
    (root / "odd" / "config.json").write_text(config)
    assert refused_load(root, outside, "odd") == "odd/config.json is not a JSON object"


def test_a_config_larger_than_a_config_is_refused_unread(tree):
    root, outside = tree
    write_checkpoint(root / "big", INSIDE, config=None)
    (root / "big" / "config.json").write_text(" " * (2**20 + 1))
    assert refused_load(root, outside, "big") == "big/config.json is larger than 1048576 bytes"


def test_a_header_quoting_its_file_is_refused_without_the_quote(tree):
    root, outside = tree
    header = json.dumps({"w": {"dtype": "F32", "shape": SECRET, "data_offsets": [0, 4]}}).encode()
    (root / "quoting").mkdir()
    (root / "quoting" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    message = refused_load(root, outside, "quoting")
    assert message.startswith("quoting/model.safetensors is not a readable safetensors file (SafetensorError: ")


def test_links_that_stay_under_the_root_are_followed(tree):
    """A `latest` link, an absolute link into the root, Hugging Face's cache (snapshot files that
    link into blobs/) and a shard reached through `..` of a linked directory all load."""
    root, _ = tree
    (root / "latest").symlink_to("step1")
    (root / "absolute").symlink_to(root / "step1")
    cache = root / "models--tiny"
    write_checkpoint(cache / "blobs_src", INSIDE)
    (cache / "blobs").mkdir()
    (cache / "blobs_src" / "model.safetensors").rename(cache / "blobs" / "3f2a")
    (cache / "blobs_src" / "config.json").rename(cache / "blobs" / "9c1d")
    (cache / "snapshots" / "rev").mkdir(parents=True)
    (cache / "snapshots" / "rev" / "model.safetensors").symlink_to("../../blobs/3f2a")
    (cache / "snapshots" / "rev" / "config.json").symlink_to("../../blobs/9c1d")
    (root / "deep" / "a").mkdir(parents=True)
    (root / "deep" / "to_step1").symlink_to("../step1")
    (root / "via").mkdir()
    (root / "via" / "model.safetensors").symlink_to("../deep/to_step1/../step1/model.safetensors")
    for path in ("latest", "absolute", str(root / "latest"), "models--tiny/snapshots/rev", "via", "deep/a/../../step1"):
        assert values(load(root, path)) == {INSIDE}, path


def test_a_link_loop_is_refused(tree):
    root, outside = tree
    (root / "loop").mkdir()
    (root / "loop" / "model.safetensors").symlink_to("model.safetensors")
    assert refused_load(root, outside, "loop") == ("loop/model.safetensors has too many levels of symbolic links")


def test_a_fifo_or_a_directory_named_like_a_shard_is_refused_unopened(tree):
    root, outside = tree
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "model.safetensors")  # opening it for reading would wait for a writer
    assert refused_load(root, outside, "fifo") == "fifo/model.safetensors is not a regular file"
    (root / "dir" / "model.safetensors").mkdir(parents=True)
    assert refused_load(root, outside, "dir") == "dir/model.safetensors is not a regular file"


def test_a_hard_link_under_the_root_is_the_file_itself(tree):
    """Documented: a hard link cannot be told from the file; it is read like any file under the root."""
    root, outside = tree
    (root / "hard").mkdir()
    os.link(outside / "ckpt" / "model.safetensors", root / "hard" / "model.safetensors")
    assert values(load(root, "hard")) == {OUTSIDE}


@pytest.mark.parametrize(
    "path, message",
    [
        ("missing", "model_path 'missing' does not exist under the weights root"),
        ("step1/model.safetensors", "model_path 'step1/model.safetensors' is not a directory under the weights root"),
        (
            "step1/model.safetensors/x",
            "model_path 'step1/model.safetensors/x' is not a directory under the weights root",
        ),
        ("bad\0name", "model_path 'bad\\x00name' cannot be opened (ValueError) under the weights root"),
        ("x" * 300, "cannot be opened (File name too long) under the weights root"),
    ],
)
def test_a_path_that_names_no_directory_is_refused_naming_it_relative_to_the_root(tree, path, message):
    root, outside = tree
    assert refused_load(root, outside, path).endswith(message)


def test_no_descriptor_is_left_open(tree):
    root, outside = tree
    (root / "linked").mkdir()
    (root / "linked" / "model.safetensors").symlink_to(outside / "ckpt" / "model.safetensors")
    before = set(os.listdir("/proc/self/fd"))
    load(root, "step1")
    for path in ("linked", "missing", "../outside", "step1/model.safetensors"):
        with pytest.raises(WeightUpdateError):
            load(root, path)
    assert set(os.listdir("/proc/self/fd")) == before


# The walk itself (weights_root.py).


def test_the_walk_opens_nothing_outside_the_root(tree, monkeypatch):
    """Every descriptor the walk opens for reading is under the root (a link out is read, never
    opened), and every component is opened without following a link."""
    root, outside = tree
    (root / "linked").mkdir()
    (root / "linked" / "model.safetensors").symlink_to(outside / "ckpt" / "model.safetensors")
    opened = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened.append((os.readlink(f"/proc/self/fd/{fd}"), flags))
        return fd

    monkeypatch.setattr(weights_root.os, "open", recording_open)
    with open_root(str(root)) as base, pytest.raises(PathRefused):
        base.open_file("linked/model.safetensors")
    assert opened and all(name.startswith(str(root)) for name, _ in opened), opened
    assert all(flags & os.O_NOFOLLOW for name, flags in opened if name != str(root))


def test_a_directory_moved_out_of_the_root_during_the_walk_is_caught(tree, monkeypatch):
    """The kernel's name for what the walk opened must be under the root: a directory renamed out
    of the root between two steps of the walk is refused, not read."""
    root, outside = tree
    real_open, moved = os.open, threading.Event()

    def moving_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if path == "step1" and not moved.is_set():
            moved.set()
            (root / "step1").rename(outside / "step1")
        return fd

    monkeypatch.setattr(weights_root.os, "open", moving_open)
    with open_root(str(root)) as base, pytest.raises(PathRefused, match="outside the allowed weights root"):
        base.open_file("step1/model.safetensors")
