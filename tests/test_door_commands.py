"""The HTTP API's command line as the launcher writes it (ops.door_commands.api_command): every API
limit an operator sets in the environment (docs/settings.md) reaches the API, read back by the API's
own parser, and unset ones leave the API's defaults, which are the settings' documented ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from triton_sampling_mask.ops import settings
from triton_sampling_mask.ops.door_commands import API_LIMITS, api_command
from triton_sampling_mask.ops.proxy import ProxyLimits

api_config = pytest.importorskip("triton_sampling_mask.api.config")  # the `api` extra

# setting -> (what an operator writes, the ApiConfig field and the value it must hold)
OPERATOR_VALUES = {
    "TRITON_API_MAX_CHOICES": ("8", "max_choices", 8),
    "TRITON_API_MAX_STOP_STRINGS": ("3", "max_stop_strings", 3),
    "TRITON_API_MAX_MODEL_LEN": ("1024", "max_model_len", 1024),
    "TRITON_API_MAX_PROMPT_CHARS": ("5000", "max_prompt_chars", 5000),
    "TRITON_API_BUSY_TIMEOUT_S": ("0.5", "busy_timeout_s", 0.5),
    "TRITON_API_TOKENIZER_THREADS": ("4", "tokenizer_threads", 4),
    "TRITON_API_TRUST_REQUEST_CHAT_TEMPLATE": ("true", "trust_request_chat_template", True),
}


def _door(tmp_path, limits=None):
    return SimpleNamespace(
        repository=tmp_path,  # no generate model here: no --model-path
        internal={"grpc": 18001, "api": 18002, "probe": 18003, "metrics": 18004},
        limits=limits or ProxyLimits(),
        directory=tmp_path,
        admin_key=None,
    )


def _api_config(command: list[str]):
    assert command[1:3] == ["-m", "triton_sampling_mask.api"], command
    return api_config.config_from_args(api_config.build_parser().parse_args(command[3:]))


@pytest.fixture
def clean_environment(monkeypatch):
    for name in (*OPERATOR_VALUES, "TRITON_API_TRUSTED_NETWORKS", "TRITON_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_api_limit_an_operator_sets_reaches_the_api(tmp_path, clean_environment):
    assert set(OPERATOR_VALUES) == {setting.name for setting in API_LIMITS.values()}
    for name, (text, _, _) in OPERATOR_VALUES.items():
        clean_environment.setenv(name, text)
    config = _api_config(api_command(_door(tmp_path, ProxyLimits(api_max_body_bytes=4096, client_timeout_s=7.0))))
    for name, (_, field, value) in OPERATOR_VALUES.items():
        assert getattr(config, field) == value, name
    assert config.max_body_bytes == 4096 and config.client_timeout_s == 7.0


def test_unset_api_limits_leave_the_apis_defaults_which_are_the_documented_ones(tmp_path, clean_environment):
    config = _api_config(api_command(_door(tmp_path)))
    defaults = api_config.ApiConfig(triton_url="x")
    for name, (_, field, _) in OPERATOR_VALUES.items():
        assert getattr(config, field) == getattr(defaults, field) == settings.SETTINGS[name].value({}), name
    assert config.max_body_bytes == defaults.max_body_bytes == settings.PROXY_API_MAX_BODY_BYTES.value({})


def test_a_switch_takes_the_usual_words_and_refuses_others():
    switch = settings.TRITON_API_TRUST_REQUEST_CHAT_TEMPLATE
    assert [switch.value({switch.name: word}) for word in ("1", "On", "yes", "0", "false", "")] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    with pytest.raises(ValueError, match=switch.name):
        switch.value({switch.name: "maybe"})
