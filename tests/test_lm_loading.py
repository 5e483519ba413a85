"""Loading an LM (lm.py): HFCausalLM's reading of its model, the default tiny Llama, load_lm's
factory hook and errors, the dtype cast, the cache / EOS helpers and the optional-method probes.

Most cases run on small fakes (a model whose logits spell out what it was given) so each branch
is checked without a checkpoint; nothing is downloaded.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from triton_sampling_mask.generation.lm import (
    DEFAULT_LM_CONFIG,
    HFCausalLM,
    _cache_of,
    _cast,
    _eos_ids,
    _hf_model,
    build_default_model,
    can_speculate,
    load_lm,
)

VOCAB = 32


class _Output(dict):
    """A transformers 5 style output: a mapping (with `get`) whose keys also read as attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _sum_logits(seen: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width, VOCAB] logits peaked at (sum of every token seen so far) % VOCAB."""
    logits = torch.zeros((seen.shape[0], width, VOCAB))
    logits[:, -1] = torch.nn.functional.one_hot(seen.sum(1) % VOCAB, VOCAB).float()
    return logits


class _CacheModel(torch.nn.Module):
    """A fake causal LM taking its cache as `cache` (transformers 5) and `logits_to_keep`; its
    'cache' is every token seen, so the logits show whether decode handed it back."""

    def __init__(self, **config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(**{"vocab_size": VOCAB, "eos_token_id": 3, **config})
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids, use_cache, cache=None, logits_to_keep=0):
        self.calls.append({"cache": cache, "logits_to_keep": logits_to_keep})
        seen = input_ids if cache is None else torch.cat([cache, input_ids], 1)
        return _Output(logits=_sum_logits(seen, logits_to_keep or input_ids.shape[1]), cache=seen)


class _PastKeyValuesModel(_CacheModel):
    """The same, as transformers 4 named it: `past_key_values`, no `logits_to_keep`, a plain output."""

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None):
        self.calls.append({"past_key_values": past_key_values})
        seen = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
        return SimpleNamespace(logits=_sum_logits(seen, input_ids.shape[1]), past_key_values=seen)


def _prefill_then_decode(lm) -> tuple[list[int], list[int]]:
    # Prompts [5, 6] and [9] (the second left-padded with 0), then tokens 1 and 2.
    logits, state = lm.prefill([torch.tensor([5, 6]), torch.tensor([9])])
    after = lm.decode(state, torch.tensor([1, 2]))
    return logits.argmax(-1).tolist(), after.argmax(-1).tolist()


@pytest.mark.parametrize("model_class", [_CacheModel, _PastKeyValuesModel])
def test_decode_hands_the_cache_back_under_the_name_the_model_takes(model_class):
    # transformers 5 renamed past_key_values to cache; the strict fakes refuse the other name.
    model = model_class(max_position_embeddings=64)
    first, then = _prefill_then_decode(HFCausalLM(model, torch.device("cpu")))
    assert (first, then) == ([11, 9], [12, 11])
    assert len(model.calls) == 2


def test_prefill_asks_a_model_that_can_for_the_last_position_only():
    # The lm head over every prompt position is [rows, width, V] of work only the last column needs.
    model = _CacheModel(max_position_embeddings=64)
    _prefill_then_decode(HFCausalLM(model, torch.device("cpu")))
    assert model.calls[0]["logits_to_keep"] == 1


def test_the_model_and_the_lm_move_to_the_device_asked_for():
    # The meta device stands in for an accelerator: nothing is computed, only placed.
    lm = HFCausalLM(_CacheModel(max_position_embeddings=64), torch.device("meta"))
    assert lm.device == torch.device("meta")
    assert lm.model.weight.device == torch.device("meta")


@pytest.mark.parametrize("config", [{}, {"max_position_embeddings": 0}, {"max_position_embeddings": None}])
def test_context_length_is_2048_when_the_config_gives_none(config):
    lm = HFCausalLM(_CacheModel(**config), torch.device("cpu"))
    assert (lm.vocab_size, lm.context_length, lm.eos_token_ids) == (VOCAB, 2048, (3,))


def test_context_length_comes_from_max_position_embeddings():
    assert HFCausalLM(_CacheModel(max_position_embeddings=77), torch.device("cpu")).context_length == 77


def test_cache_of_reads_the_cache_key_of_a_transformers_5_output():
    cache = object()
    assert _cache_of(_Output(logits=None, cache=cache)) is cache


def test_cache_of_falls_back_to_past_key_values_of_a_mapping_without_cache():
    cache = object()
    output = _Output(logits=None)
    output.past_key_values = cache  # an instance attribute, as transformers 4's outputs expose it
    assert _cache_of(output) is cache


def test_cache_of_reads_past_key_values_of_an_output_without_get():
    cache = object()
    assert _cache_of(SimpleNamespace(past_key_values=cache)) is cache


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # The generation config wins over the model config, and a list keeps every id.
        (
            SimpleNamespace(
                generation_config=SimpleNamespace(eos_token_id=[2, 7]), config=SimpleNamespace(eos_token_id=2)
            ),
            (2, 7),
        ),
        (
            SimpleNamespace(
                generation_config=SimpleNamespace(eos_token_id=(4,)), config=SimpleNamespace(eos_token_id=9)
            ),
            (4,),
        ),
        # No generation config at all, or one without EOS ids: the model config's.
        (SimpleNamespace(config=SimpleNamespace(eos_token_id=5)), (5,)),
        (SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=[5, 6])), (5, 6)),
        (SimpleNamespace(generation_config=SimpleNamespace(), config=SimpleNamespace(eos_token_id=8)), (8,)),
        (
            SimpleNamespace(
                generation_config=SimpleNamespace(eos_token_id=None), config=SimpleNamespace(eos_token_id=8)
            ),
            (8,),
        ),
        # None anywhere: no EOS ids.
        (SimpleNamespace(generation_config=SimpleNamespace(), config=SimpleNamespace()), ()),
    ],
)
def test_eos_ids_prefer_the_generation_config_then_the_model_config(model, expected):
    assert _eos_ids(model) == expected


def test_can_speculate_needs_both_decode_many_and_rollback():
    def method(*args):
        return None

    assert can_speculate(SimpleNamespace(decode_many=method, rollback=method))
    assert not can_speculate(SimpleNamespace(decode_many=method))
    assert not can_speculate(SimpleNamespace(rollback=method))
    assert not can_speculate(SimpleNamespace(decode_many=method, rollback=None))


def test_a_model_path_loads_from_local_files_only(tmp_path, monkeypatch):
    # A model_path must never reach the Hub, even for a file the directory lacks.
    calls = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: calls.append((args, kwargs)))
    _hf_model(str(tmp_path))
    assert calls == [((tmp_path,), {"local_files_only": True})]


def _write_config(path, **changes):
    settings = json.loads(DEFAULT_LM_CONFIG.read_text())
    settings.update(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    for key, value in changes.items():
        if value is None:
            settings.pop(key)
        else:
            settings[key] = value
    path.write_text(json.dumps(settings))
    return path


def test_the_default_model_is_the_configs_eager_llama_without_its_comment():
    model = build_default_model()
    assert model.config._attn_implementation == "eager"  # as tiny_llama.json asks
    assert (model.config.vocab_size, model.config.max_position_embeddings) == (1024, 512)
    # `_comment` documents the file; it is no config setting (save_pretrained would write it out).
    assert not hasattr(model.config, "_comment")
    assert "_comment" not in model.config.to_dict()


def test_building_the_default_model_leaves_every_global_generator_alone(monkeypatch):
    reseeded = []
    for module in (torch.cuda, torch.mps, torch.xpu):  # what torch.manual_seed reseeds beside the CPU
        if hasattr(module, "manual_seed_all"):
            monkeypatch.setattr(module, "manual_seed_all", lambda seed, name=module.__name__: reseeded.append(name))
    if hasattr(torch.mps, "manual_seed"):
        monkeypatch.setattr(torch.mps, "manual_seed", lambda seed: reseeded.append("torch.mps"))
    generator = torch.default_generator
    generator.manual_seed(1234)
    expected_next = torch.rand(4)
    generator.manual_seed(1234)
    first, second = build_default_model(), build_default_model()
    assert torch.equal(torch.rand(4), expected_next)  # the CPU generator is where it was
    assert reseeded == []  # no accelerator's generator reseeded (on a GPU host, it would stay so)
    # the weights depend on the config's seed only
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_a_config_without_comment_or_attention_builds_with_the_default_attention(tmp_path):
    path = _write_config(tmp_path / "plain.json", _comment=None, attn_implementation=None)
    model = build_default_model(path)
    assert model.config.vocab_size == VOCAB
    assert model.config._attn_implementation == "sdpa"  # transformers' own default


def test_casting_to_float32_leaves_eager_attention_alone(tmp_path):
    model = _cast(build_default_model(_write_config(tmp_path / "tiny.json")), "float32")
    assert model.config._attn_implementation == "eager"
    assert model.lm_head.weight.dtype == torch.float32


def test_casting_to_float64_moves_eager_attention_to_sdpa(tmp_path):
    # Eager attention's float32 softmax would lose float64's precision (see _cast).
    model = _cast(build_default_model(_write_config(tmp_path / "tiny.json")), "float64")
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.dtype == torch.float64


def test_casting_a_model_whose_config_names_no_attention():
    # A config without `_attn_implementation` is only cast, whatever the dtype.
    class Model:
        config = SimpleNamespace()

        def to(self, dtype):
            self.dtype = dtype
            return self

    model = Model()
    assert _cast(model, "float64") is model and model.dtype == torch.float64


def recording_factory(model_path, device):
    recording_factory.calls.append((model_path, device))
    return SimpleNamespace()  # no CausalLM: load_lm refuses it after the call


recording_factory.calls = []


def test_a_factory_gets_the_model_path_and_device_and_a_non_lm_is_refused_naming_the_factory():
    recording_factory.calls.clear()
    spec = f"{__name__}:recording_factory"
    with pytest.raises(ValueError, match=rf"^lm '{spec}' lacks vocab_size"):
        load_lm(model_path="", lm_factory=spec, device=torch.device("meta"))
    with pytest.raises(ValueError, match=rf"^lm '{spec}' lacks vocab_size"):
        load_lm(model_path="some/dir", lm_factory=spec)
    assert recording_factory.calls == [("", torch.device("meta")), ("some/dir", torch.device("cpu"))]


def test_a_factory_that_cannot_be_imported_is_reported_against_the_lm_parameter():
    with pytest.raises(ValueError, match=r"^lm 'no_such_module_for_lm_tests:factory' could not be imported"):
        load_lm(lm_factory="no_such_module_for_lm_tests:factory")


def test_the_default_lm_lives_on_the_cpu_by_default():
    lm = load_lm()
    assert lm.device == torch.device("cpu")
    assert {p.device for p in lm.model.parameters()} == {torch.device("cpu")}
    assert (lm.vocab_size, lm.context_length, lm.eos_token_ids) == (1024, 512, (2,))
