"""Control requests without Triton: their JSON, the admin key check, and the control thread's
answers (one per request, refusals as 400s naming the field)."""

from __future__ import annotations

import json
import queue

import pytest

from triton_sampling_mask.client.weight_updates import SharedTensors, control_request
from triton_sampling_mask.sampling.admin import CLIENT_ADDRESS_PARAMETER, TOO_MANY_WRONG_KEYS, WRONG_KEYS_PER_MINUTE
from triton_sampling_mask.serving.admin_key import ADMIN_KEY_DIGEST_ENV, key_digest
from triton_sampling_mask.serving.weight_control import (
    ControlError,
    WeightControl,
    check_key,
    check_key_from,
    parse_command,
    request_source,
)
from triton_sampling_mask.serving.wrong_keys import WINDOW_S, WrongKeyLimit

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


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_wrong_keys_past_the_limit_block_their_source_for_the_rest_of_the_minute():
    """The front door's rule (HAProxy: refused once gpc0_rate(60s) > 10): the 11th wrong key is
    still checked, the 12th call is refused, the right key too; other sources are not."""
    clock = Clock()
    limit = WrongKeyLimit(clock=clock)
    digest = key_digest(KEY)
    for _ in range(WRONG_KEYS_PER_MINUTE + 1):
        with pytest.raises(ControlError, match="wrong admin key"):
            check_key_from("wrong", digest, "10.0.0.1", limit)
        clock.now += 1
    for key in ("wrong", KEY):
        with pytest.raises(ControlError, match=TOO_MANY_WRONG_KEYS) as refused:
            check_key_from(key, digest, "10.0.0.1", limit)
        assert refused.value.code_name == "UNAVAILABLE"
    check_key_from(KEY, digest, "10.0.0.2", limit)
    with pytest.raises(ControlError, match="needs the admin key"):  # no key: not a guess, not counted
        check_key_from(None, digest, "10.0.0.3", limit)
    assert not limit.blocked("10.0.0.3")
    clock.now += WINDOW_S - WRONG_KEYS_PER_MINUTE  # the first wrong key leaves the window
    check_key_from(KEY, digest, "10.0.0.1", limit)


def test_the_source_is_the_client_address_parameter_the_last_one_when_repeated():
    assert request_source(json.dumps({CLIENT_ADDRESS_PARAMETER: "10.1.1.1", "admin_key": "k"})) == "10.1.1.1"
    # tritonserver appends the headers it forwards (the front door's) after the request's own
    assert request_source('{"triton-client-address": "6.6.6.6", "triton-client-address": "10.1.1.1"}') == "10.1.1.1"
    assert request_source("{}") == request_source("not json") == request_source('{"triton-client-address": 3}') == ""


def test_a_refused_update_never_pauses_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_DIGEST_ENV, key_digest(KEY))
    lm = served()
    running = engine(lm)
    pauses = []
    original = running.pause
    monkeypatch.setattr(running, "pause", lambda *a, **k: (pauses.append(a), original(*a, **k)))
    (tmp_path / "empty").mkdir()
    control = WeightControl(running, lm.model, str(tmp_path), Logger())
    try:
        for command in (
            {"op": "update_weights_from_disk", "model_path": "empty", "pause_mode": "abort"},
            {"op": "update_weights_from_disk", "model_path": "../", "pause_mode": "abort"},
            {"op": "update_weights_from_distributed", "tensors": [], "pause_mode": "abort"},
            {"op": "destroy_weights_update_group", "group_name": "nope"},
            {
                "op": "init_weights_update_group",
                "master_address": "h",
                "master_port": "x",
                "rank_offset": 0,
                "world_size": 1,
            },
        ):
            assert isinstance(ask(control, command, KEY), ControlError), command
        with SharedTensors({"model.unknown": moved_model(6).model.norm.weight}) as shared:
            command = {
                "op": "update_weights_from_tensor",
                "shm_name": shared.name,
                "tensors": shared.manifest,
                "pause_mode": "abort",
            }
            refused = ask(control, command, KEY)
            assert isinstance(refused, ControlError) and "not a weight of the served LM" in refused.message
        assert pauses == []
    finally:
        running.stop()
        control.stop()
