"""Control requests without Triton: their JSON, the admin key check, and the control thread's
answers (one per request, refusals as 400s naming the field)."""

from __future__ import annotations

import json
import queue

import pytest

from triton_sampling_mask.client.weight_updates import SharedTensors, control_request
from triton_sampling_mask.serving.admin_key import ADMIN_KEY_DIGEST_ENV, key_digest
from triton_sampling_mask.serving.weight_control import ControlError, WeightControl, check_key, parse_command

from .test_generation import engine
from .test_weights import served
from .weights_fixtures import moved_model

KEY = "control-test-key"


class Logger:
    def log_info(self, message):
        pass

    def log_error(self, message):
        pass


@pytest.mark.parametrize(
    "text, message",
    [
        (b"not json", "must be a JSON object"),
        (b"[1]", "with a string 'op'"),
        (b'{"op": "reload_everything"}', "unknown op 'reload_everything'"),
    ],
)
def test_a_malformed_command_is_refused_naming_the_input(text, message):
    with pytest.raises(ControlError, match=message) as refused:
        parse_command(text)
    assert refused.value.code_name == "INVALID_ARG" and "control" in refused.value.message


def test_the_key_is_checked_against_its_digest_only():
    check_key(KEY, key_digest(KEY))
    with pytest.raises(ControlError, match="wrong admin key"):
        check_key("other", key_digest(KEY))
    with pytest.raises(ControlError, match="needs the admin key"):
        check_key(None, key_digest(KEY))
    with pytest.raises(ControlError, match="without an admin key") as off:
        check_key(KEY, "")
    assert off.value.code_name == "UNAVAILABLE"


def ask(control: WeightControl, command: dict, key: str | None) -> dict | ControlError:
    answers: queue.SimpleQueue = queue.SimpleQueue()
    wire = control_request(command, key)
    text = wire.inputs["control"][0].reshape(-1)[0]
    control.submit(text, json.dumps(wire.parameters), answers.put)
    return answers.get(timeout=60)


def test_the_control_thread_updates_pauses_and_answers_each_request(tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_DIGEST_ENV, key_digest(KEY))
    moved_model(5).save_pretrained(tmp_path / "step1")
    lm = served()
    running = engine(lm)
    control = WeightControl(running, lm.model, str(tmp_path), Logger())
    try:
        assert ask(control, {"op": "get_weight_version"}, None) == {"weight_version": "default", "paused": False}
        refused = ask(control, {"op": "update_weights_from_disk", "model_path": "step1"}, "wrong")
        assert isinstance(refused, ControlError) and "wrong admin key" in refused.message
        bad = ask(control, {"op": "update_weights_from_disk", "model_path": "step1", "pause_mode": "later"}, KEY)
        assert isinstance(bad, ControlError) and "pause_mode must be one of" in bad.message
        done = ask(control, {"op": "update_weights_from_disk", "model_path": "step1", "weight_version": "s1"}, KEY)
        assert done["weight_version"] == "s1" and done["tensors"] == len(lm.model.state_dict())
        assert ask(control, {"op": "pause_generation", "mode": "abort"}, KEY)["paused"] is True
        assert ask(control, {"op": "continue_generation"}, KEY)["paused"] is False
        with SharedTensors({"model.norm.weight": moved_model(6).model.norm.weight}) as shared:
            command = {"op": "update_weights_from_tensor", "shm_name": shared.name, "tensors": shared.manifest}
            assert ask(control, command, KEY)["tensors"] == 1
        no_group = ask(control, {"op": "update_weights_from_distributed", "tensors": []}, KEY)
        assert isinstance(no_group, ControlError) and "init_weights_update_group first" in no_group.message
    finally:
        running.stop()
        control.stop()
    expected = moved_model(6).model.norm.weight.detach()
    assert float(lm.model.model.norm.weight.detach()[0]) == pytest.approx(float(expected[0]))
