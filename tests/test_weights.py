"""Weight updates without Triton: the in-place loader (checks before any write, refusals naming the
first bad tensor, paths kept inside the weights root) and the engine's pause modes, each token
replayed in float64 on the weights its version tag names."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from triton_sampling_mask.generation.engine import ABORT, FINISH, IN_PLACE, PAUSE_MODES
from triton_sampling_mask.generation.lm import load_lm
from triton_sampling_mask.generation.weight_transfer import SharedMemoryTensors
from triton_sampling_mask.generation.weights import (
    CheckpointDirectory,
    NamedTensors,
    WeightUpdateError,
    copy_into,
    resolve_checkpoint,
)

from .reference import reference_row
from .test_generation import MASKED, RecordingHandle, engine, request
from .weights_fixtures import moved_model, replay_logits, replay_model

SEED = 11  # the 'trained' weights: moved_model(SEED)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A weights root holding the new weights and the broken checkpoints."""
    base = tmp_path_factory.mktemp("weights_root")
    moved_model(SEED).save_pretrained(base / "step1")
    good = load_file(base / "step1" / "model.safetensors")
    first = sorted(good)[0]
    broken = {
        "missing": {k: v for k, v in good.items() if k != first},
        "wrong_shape": {**good, first: good[first][:-1].clone()},
        "nan": {**good, first: torch.full_like(good[first], float("nan"))},
        "int_dtype": {**good, first: good[first].to(torch.int32)},
        "extra": {**good, "model.layers.9.mlp.up_proj.weight": good[first].clone()},
    }
    for name, tensors in broken.items():
        (base / name).mkdir()
        save_file(tensors, base / name / "model.safetensors")
    (base / "truncated").mkdir()
    data = (base / "step1" / "model.safetensors").read_bytes()
    (base / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    wide = json.loads((base / "step1" / "config.json").read_text())
    (base / "other_arch").mkdir()
    (base / "other_arch" / "config.json").write_text(json.dumps({**wide, "model_type": "gpt2"}))
    save_file(good, base / "other_arch" / "model.safetensors")
    return base


def served():
    """A float64 LM as the generate model serves it (lm_dtype float64)."""
    return load_lm(dtype="float64")


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def load(model, root, name: str) -> int:
    directory, label = resolve_checkpoint(str(root), name)
    return copy_into(model, CheckpointDirectory(directory, label, model.config))


def test_a_checkpoint_is_copied_into_the_same_tensors(root, monkeypatch):
    # Pieces of a few rows: every tensor crosses several of them.
    monkeypatch.setattr("triton_sampling_mask.generation.weights.CHUNK_BYTES", 1000)
    lm = served()
    pointers = {name: t.data_ptr() for name, t in lm.model.state_dict().items()}
    assert load(lm.model, root, "step1") == len(pointers)
    expected = replay_model(SEED).state_dict()
    for name, tensor in lm.model.state_dict().items():
        assert tensor.data_ptr() == pointers[name], f"{name} was replaced, not written in place"
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing", "is missing"),
        ("wrong_shape", "has shape"),
        ("nan", "NaN"),
        ("int_dtype", "is int32"),
        ("extra", "'model.layers.9.mlp.up_proj.weight' is not a weight"),
        ("truncated", "truncated/model.safetensors is not a readable safetensors file"),
        ("other_arch", r"other_arch/config.json: model_type is not the served LM's \('llama'\)"),
    ],
)
def test_a_bad_checkpoint_is_refused_naming_it_and_nothing_is_written(root, name, message):
    lm = served()
    before = snapshot(lm.model)
    with pytest.raises(WeightUpdateError, match=message) as refused:
        load(lm.model, root, name)
    assert str(root) not in refused.value.message and "gpt2" not in refused.value.message
    if name not in ("truncated", "other_arch", "extra"):
        first = sorted(before)[0]
        assert repr(first) in refused.value.message, "the error names the first bad tensor"
    for tensor_name, tensor in lm.model.state_dict().items():
        assert torch.equal(tensor, before[tensor_name]), f"{tensor_name} changed"


@pytest.mark.parametrize("path", ["../outside", "/etc", "step1/../../x", "missing_dir"])
def test_paths_outside_the_root_or_missing_are_refused_without_absolute_paths(root, path):
    with pytest.raises(WeightUpdateError) as refused:
        resolve_checkpoint(str(root), path)
    assert str(root) not in refused.value.message and "model_path" in refused.value.message


def test_a_symlink_out_of_the_root_is_refused(root, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    link = root / "link"
    link.symlink_to(tmp_path / "elsewhere")
    try:
        with pytest.raises(WeightUpdateError, match="outside the allowed weights root"):
            resolve_checkpoint(str(root), "link")
    finally:
        link.unlink()


def test_updates_from_disk_are_off_without_a_root():
    with pytest.raises(WeightUpdateError, match="weights_root"):
        resolve_checkpoint("", "step1")


def test_named_tensors_may_update_some_weights_and_are_checked_alike():
    lm = served()
    name = "model.norm.weight"
    before = snapshot(lm.model)
    copy_into(lm.model, NamedTensors({name: torch.full((64,), 2.0)}, "test"))
    assert torch.equal(lm.model.state_dict()[name], torch.full((64,), 2.0, dtype=torch.float64))
    assert all(torch.equal(t, before[n]) for n, t in lm.model.state_dict().items() if n != name)
    with pytest.raises(WeightUpdateError, match="has shape"):
        copy_into(lm.model, NamedTensors({name: torch.zeros(63)}, "test"))


def test_shared_memory_tensors_are_read_by_their_manifest():
    from triton_sampling_mask.client.weight_updates import SharedTensors

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.5], dtype=torch.bfloat16)}
    with SharedTensors(tensors) as shared, SharedMemoryTensors(shared.name, shared.manifest) as mapped:
        for name, tensor in tensors.items():
            assert torch.equal(mapped.tensors[name], tensor)
    with pytest.raises(WeightUpdateError, match="no path"):
        SharedMemoryTensors("../etc/passwd", shared.manifest)


# The engine: each token replayed in float64 on the weights its version names.

VERSIONS = {"default": None, "v1": SEED}


def assert_replays(prompt, handle: RecordingHandle, params: dict) -> list[str]:
    """Every token's mask and log-prob equal the float64 replay on its version's weights; the
    versions in order (old ones first)."""
    ids, versions = handle.ids(), [v.decode() for v in handle.output("weight_version")]
    masks, lengths = handle.output("sampling_mask"), handle.output("sampling_mask_len")
    logprobs = handle.output("output_logprobs")
    for i, (token, version) in enumerate(zip(ids, versions)):
        logits = replay_logits(replay_model(VERSIONS[version]), prompt, ids, i)
        ref = reference_row(logits, params["temperature"], params["top_k"], params["top_p"], params["min_p"])
        np.testing.assert_array_equal(masks[i, : lengths[i]], ref.support, err_msg=f"token {i} ({version})")
        assert abs(logprobs[i] - ref.logprobs[token]) < 1e-5, f"token {i} ({version})"
    assert versions == sorted(versions, key=lambda v: list(VERSIONS).index(v)), "old tokens come first"
    return versions


def wait_for_tokens(handle: RecordingHandle, count: int) -> None:
    deadline = time.monotonic() + 30
    while sum(len(c["output_ids"]) for c in handle.chunks) < count:
        assert time.monotonic() < deadline and not handle.errors
        time.sleep(0.001)


PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("mode", PAUSE_MODES)
def test_each_mode_serves_the_new_weights_after_the_update_and_the_old_before(root, mode):
    lm = served()
    running = engine(lm)
    try:
        straddling = RecordingHandle()
        running.submit(request(PROMPT, 20, stream=True, ignore_eos=True, **MASKED), straddling)
        wait_for_tokens(straddling, 3)
        running.update_weights(lambda: load(lm.model, root, "step1"), "v1", mode)
        after = RecordingHandle()
        running.submit(request(PROMPT, 8, ignore_eos=True, **MASKED), after)
        assert after.done.wait(30) and straddling.done.wait(30)
    finally:
        running.stop()
    assert running.weight_version == "v1"
    assert assert_replays(PROMPT, after, MASKED) == ["v1"] * 8
    if mode == ABORT:
        assert straddling.finals == 0 and straddling.errors[0][0] == "UNAVAILABLE"
        assert (
            "weight update to version 'v1'" in straddling.errors[0][1]
            and "retry with backoff" in straddling.errors[0][1]
        )
        assert set(assert_replays(PROMPT, straddling, MASKED)) == {"default"}
    elif mode == FINISH:  # drained on the old weights
        assert straddling.finals == 1 and assert_replays(PROMPT, straddling, MASKED) == ["default"] * 20
    else:  # the rows in flight go on, on the new weights (their cache recomputed)
        versions = assert_replays(PROMPT, straddling, MASKED)
        assert straddling.finals == 1 and versions[0] == "default" and versions[-1] == "v1"
    # The replay can fail: the new weights give other log-probs than the old.
    old = replay_logits(replay_model(None), PROMPT, after.ids(), 0)
    new = replay_logits(replay_model(SEED), PROMPT, after.ids(), 0)
    assert np.abs(old - new).max() > 1e-2


def test_a_refused_update_leaves_the_old_weights_and_version_serving(root):
    lm = served()
    running = engine(lm)
    try:
        with pytest.raises(WeightUpdateError, match="NaN"):
            running.update_weights(lambda: load(lm.model, root, "nan"), "v1", IN_PLACE)
        handle = RecordingHandle()
        running.submit(request(PROMPT, 6, ignore_eos=True, **MASKED), handle)
        assert handle.done.wait(30)
    finally:
        running.stop()
    assert running.weight_version == "default" and not running.paused
    assert assert_replays(PROMPT, handle, MASKED) == ["default"] * 6


def test_pause_holds_new_requests_until_resume():
    running = engine(served())
    try:
        running.pause(IN_PLACE)
        held = RecordingHandle()
        running.submit(request(PROMPT, 4, ignore_eos=True, **MASKED), held)
        time.sleep(0.2)
        assert not held.chunks and running.paused
        running.resume()
        assert held.done.wait(30) and held.finals == 1
    finally:
        running.stop()


def test_finish_mode_waits_for_the_rows_in_flight_and_holds_newcomers():
    running = engine(served())
    try:
        long = RecordingHandle()
        running.submit(request(PROMPT, 60, stream=True, ignore_eos=True, **MASKED), long)
        wait_for_tokens(long, 2)
        pausing = threading.Thread(target=running.pause, args=(FINISH,))
        pausing.start()
        newcomer = RecordingHandle()
        running.submit(request([9], 4, ignore_eos=True, **MASKED), newcomer)
        pausing.join(30)
        assert long.finals == 1 and not newcomer.chunks and running.paused
        running.resume()
        assert newcomer.done.wait(30)
    finally:
        running.stop()


def test_stop_releases_a_pause_waiting_to_drain():
    running = engine(served())
    long = RecordingHandle()
    running.submit(request(PROMPT, 400, stream=True, ignore_eos=True, **MASKED), long)
    wait_for_tokens(long, 2)
    pausing = threading.Thread(target=running.pause, args=(FINISH,))
    pausing.start()
    running.stop()
    pausing.join(10)
    assert not pausing.is_alive() and long.errors


def test_client_and_server_agree_on_the_control_names():
    from triton_sampling_mask.client import weight_updates
    from triton_sampling_mask.serving import weight_control

    assert weight_updates.PAUSE_MODES == PAUSE_MODES
    assert (weight_updates.CONTROL, weight_updates.ADMIN_KEY_PARAMETER) == (
        weight_control.CONTROL,
        weight_control.ADMIN_KEY_PARAMETER,
    )
