"""Causal language models for the `generate` model: a small interface and a Hugging Face backend.

An LM turns a batch of prompts into next-token logits and then, one token per row at a time,
extends every row with a KV cache. Rows of a batch are left-padded to one length with an
attention mask, and rows that finish leave the batch (`keep`), so the LM never computes for them.

Continuous batching (the engine) also needs `merge(states)`: one state holding the rows of
several, in order, so a request prefilled on its own can join a running decode batch. It is
optional: an LM without it still works, the engine then admits new requests only when its batch
is empty.

Speculative decoding needs `decode_many(state, tokens, lengths)` (several new tokens per row in
one forward pass, each row its own count) and `rollback(state, counts)` (forget each row's last
tokens: the rejected drafts). Also optional: an LM without them decodes one token at a time.

Built in: any `transformers` causal LM in a local directory (`model_path`), or, when no path is
given, the default tiny Llama built from `lm_configs/tiny_llama.json` with fixed-seed random
weights (deterministic on a given torch build, no download). A custom LM is named by the
`lm` config parameter as "package.module:factory"; the factory gets (model_path, device).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..sampling.backends import import_object

DEFAULT_LM_CONFIG = Path(__file__).with_name("lm_configs") / "tiny_llama.json"
# The default LM's tokenizer (Hugging Face format, with a chat template), for text in and out.
DEFAULT_TOKENIZER = DEFAULT_LM_CONFIG.with_name("tiny_tokenizer")


@runtime_checkable
class CausalLM(Protocol):
    """What the generate model needs of a language model (all logits are float32 [rows, V])."""

    vocab_size: int
    context_length: int  # prompt + generated tokens must fit in this many positions
    eos_token_ids: tuple[int, ...]

    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Logits for the token after each prompt (1-D int64 tensors) and the batch state."""
        ...

    def decode(self, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (int64 [rows]) to the state; logits for the next token."""
        ...

    def keep(self, state: Any, rows: torch.Tensor) -> Any:
        """The state restricted to `rows` (int64 indices into the current rows, in order)."""
        ...


def can_merge(lm: CausalLM) -> bool:
    """Whether the LM offers the optional `merge(states) -> state` that continuous batching uses."""
    return callable(getattr(lm, "merge", None))


def can_speculate(lm: CausalLM) -> bool:
    """Whether the LM offers the optional `decode_many` and `rollback` that speculative decoding uses:

    - `decode_many(state, tokens, lengths) -> logits`: append row i's first `lengths[i]` (>= 1)
      tokens of `tokens` (int64 [rows, L]) to the state in one forward pass; the logits after each
      of them, float32 [sum(lengths), V], row 0's in order, then row 1's, ...
    - `rollback(state, counts) -> state`: forget each row's last `counts[i]` tokens (int64 [rows],
      zeros allowed), as if they had never been appended.
    """
    return callable(getattr(lm, "decode_many", None)) and callable(getattr(lm, "rollback", None))


@dataclass
class PaddedBatchState:
    """A left-padded batch in flight: the model's KV cache, its attention mask, next positions."""

    cache: Any
    attention_mask: torch.Tensor  # int64 [rows, cached positions], 0 on left padding
    next_position: torch.Tensor  # int64 [rows], the position id of each row's next token


class HFCausalLM:
    """A `transformers` causal LM with left padding, position ids and a dynamic KV cache."""

    def __init__(self, model, device: torch.device):
        self.model = model.to(device).eval()
        self.device = device
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.eos_token_ids = _eos_ids(model)
        parameters = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; support both.
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._keeps_last = "logits_to_keep" in parameters

    @torch.inference_mode()
    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, PaddedBatchState]:
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros((len(prompts), width), dtype=torch.int64, device=self.device)
        position = torch.arange(width, device=self.device).unsqueeze(0)
        attention_mask = (position >= (width - lengths).unsqueeze(1)).to(torch.int64)
        ids[attention_mask.bool()] = torch.cat([p.to(self.device, torch.int64) for p in prompts])
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        extra = {"logits_to_keep": 1} if self._keeps_last else {}
        out = self.model(
            input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **extra
        )
        state = PaddedBatchState(_cache_of(out), attention_mask, lengths.to(torch.int64))
        return out.logits[:, -1].float(), state

    @torch.inference_mode()
    def decode(self, state: PaddedBatchState, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        state.attention_mask = torch.cat(
            [state.attention_mask, torch.ones((rows, 1), dtype=torch.int64, device=self.device)], dim=1
        )
        out = self.model(
            input_ids=tokens.to(self.device, torch.int64).unsqueeze(1),
            attention_mask=state.attention_mask,
            position_ids=state.next_position.unsqueeze(1),
            use_cache=True,
            **{self._cache_kwarg: state.cache},
        )
        state.cache = _cache_of(out)
        state.next_position = state.next_position + 1
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def decode_many(self, state: PaddedBatchState, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Append row i's first `lengths[i]` tokens in one forward pass; the logits after each of
        them, [sum(lengths), V] (see `can_speculate`).

        Each row's tokens go to the right end of the new block (shorter rows are masked on its
        left), so every row's newest position stays the cache's last column; `rollback` closes
        the masked gaps.
        """
        rows, width = tokens.shape
        tokens, lengths = tokens.to(self.device, torch.int64), lengths.to(self.device, torch.int64)
        column = torch.arange(width, device=self.device).unsqueeze(0)
        offset = column - (width - lengths).unsqueeze(1)  # index into the row's own tokens; < 0 on padding
        new = offset >= 0
        ids = torch.where(new, tokens.gather(1, offset.clamp(min=0)), 0)
        state.attention_mask = torch.cat([state.attention_mask, new.to(torch.int64)], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=state.attention_mask,
            position_ids=(state.next_position.unsqueeze(1) + offset).clamp(min=0),
            use_cache=True,
            **{self._cache_kwarg: state.cache},
        )
        state.cache = _cache_of(out)
        state.next_position = state.next_position + lengths
        return out.logits[new].float()  # row-major: each row's positions in order

    def rollback(self, state: PaddedBatchState, counts: torch.Tensor) -> PaddedBatchState:
        """Forget each row's last `counts[i]` tokens; rows are then re-aligned to the right so no
        masked gap is left inside the cache (one gather per layer, only when a gap exists)."""
        counts = counts.to(self.device, torch.int64)
        mask = state.attention_mask
        from_right = mask.flip(1).cumsum(1).flip(1)  # kept positions at or after each column
        mask = torch.where(from_right <= counts.unsqueeze(1), 0, mask)
        state = PaddedBatchState(state.cache, mask, state.next_position - counts)
        return _close_gaps(state)

    def keep(self, state: PaddedBatchState, rows: torch.Tensor) -> PaddedBatchState:
        rows = rows.to(self.device)
        state.cache.batch_select_indices(rows)  # in place
        # Columns that are padding in every remaining row are trimmed; others stay masked.
        mask = state.attention_mask.index_select(0, rows)
        state = PaddedBatchState(state.cache, mask, state.next_position.index_select(0, rows))
        return _trim_left_padding(state)

    def merge(self, states: list[PaddedBatchState]) -> PaddedBatchState:
        """The rows of every state, in order: shorter caches are left-padded (masked) to the longest.

        A padded column is masked out of attention, so each row's logits stay those of the row
        alone (within float noise); `keep` trims columns that only padding still holds.
        """
        width = max(s.attention_mask.shape[1] for s in states)
        masks = [torch.nn.functional.pad(s.attention_mask, (width - s.attention_mask.shape[1], 0)) for s in states]
        layers = [_layer_tensors(s.cache) for s in states]
        merged = []
        for per_state in zip(*layers):  # one model layer: (keys, values) of every state
            keys = torch.cat([_pad_seq(k, width) for k, _ in per_state])
            values = torch.cat([_pad_seq(v, width) for _, v in per_state])
            merged.append((keys, values))
        _set_layer_tensors(states[0].cache, merged)
        return PaddedBatchState(states[0].cache, torch.cat(masks), torch.cat([s.next_position for s in states]))


def _pad_seq(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a [rows, heads, positions, dim] cache tensor with zeros to `width` positions."""
    return torch.nn.functional.pad(tensor, (0, 0, width - tensor.shape[2], 0))


def _layer_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers dynamic cache (>= 4.56 `layers`, else key_cache)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    raise NotImplementedError(
        f"cannot merge a {type(cache).__name__}: joining a running batch needs a transformers dynamic cache"
    )


def _set_layer_tensors(cache, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (keys, values) in zip(cache.layers, tensors):
            layer.keys, layer.values = keys, values
    else:
        cache.key_cache[:] = [k for k, _ in tensors]
        cache.value_cache[:] = [v for _, v in tensors]


def _trim_left_padding(state: PaddedBatchState) -> PaddedBatchState:
    """Drop leading cache columns that are padding in every row (left by rows that left the batch)."""
    used = state.attention_mask.any(dim=0)
    start = int(used.to(torch.int8).argmax()) if used.any() else 0
    if start == 0:
        return state
    try:
        tensors = _layer_tensors(state.cache)
    except NotImplementedError:  # an unknown cache: keep its (masked) padding
        return state
    _set_layer_tensors(state.cache, [(k[:, :, start:], v[:, :, start:]) for k, v in tensors])
    return PaddedBatchState(state.cache, state.attention_mask[:, start:], state.next_position)


def _close_gaps(state: PaddedBatchState) -> PaddedBatchState:
    """Move every row's cached positions to the right end, in order, and drop the columns that only
    padding then holds: the left-padded layout `merge` and `keep` keep. A no-op without gaps."""
    mask = state.attention_mask
    counts = mask.sum(1)
    trailing = mask.flip(1).cumprod(1).sum(1)  # positions already packed at the right end
    if bool((trailing == counts).all()):
        return _trim_left_padding(state)
    try:
        tensors = _layer_tensors(state.cache)
    except NotImplementedError:  # an unknown cache: its gaps stay masked, which is still exact
        return state
    width = int(counts.max())
    # A stable sort puts each row's padding first and its positions after, in their order.
    order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices[:, mask.shape[1] - width :]

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        index = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
        return tensor.gather(2, index)

    _set_layer_tensors(state.cache, [(gather(k), gather(v)) for k, v in tensors])
    return PaddedBatchState(state.cache, mask.gather(1, order), state.next_position)


def _cache_of(output) -> Any:
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


def _eos_ids(model) -> tuple[int, ...]:
    """EOS ids from the generation config, else the model config (an int or a list)."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ()


def build_default_model(config_path: Path = DEFAULT_LM_CONFIG):
    """The tiny Llama of `config_path`, its weights drawn with the config's `init_seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = json.loads(Path(config_path).read_text())
    seed = int(settings.pop("init_seed"))
    settings.pop("_comment", None)
    attention = settings.pop("attn_implementation", None)
    config = AutoConfig.for_model(**settings)
    # A private RNG scope: the weights depend on the seed only, and global RNG state is untouched.
    # The weights are drawn on the CPU: seed its generator alone (torch.manual_seed would also reseed
    # every GPU's generator, which fork_rng(devices=[]) does not restore).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **({"attn_implementation": attention} if attention else {}))
    return model


# Weight dtypes a built-in Hugging Face LM may be cast to (config parameter `lm_dtype`; "" keeps
# the model's own: float32 for the default tiny Llama, the checkpoint's for a directory). Logits
# reach the sampler as float32 whatever the LM computes in.
LM_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_model(model_path: str):
    """The Hugging Face model of a local directory, or the default tiny Llama without one."""
    if not model_path:
        return build_default_model()
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"model_path {model_path!r} is not a directory")
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def _cast(model, dtype: str):
    """The model in `dtype` ("" leaves it as it is)."""
    if not dtype:
        return model
    model = model.to(LM_DTYPES[dtype])
    if dtype == "float64" and getattr(model.config, "_attn_implementation", None) == "eager":
        # Eager attention takes its softmax in float32, where float64's mask minimum becomes -inf
        # (NaN on padded rows) and float64's precision is lost; SDPA stays in float64.
        model.set_attn_implementation("sdpa")
    return model


def load_lm(
    model_path: str = "", lm_factory: str = "", device: torch.device = torch.device("cpu"), dtype: str = ""
) -> CausalLM:
    """The LM of a deployment: a custom factory, a local HF directory, or the default tiny Llama;
    `dtype` (a key of LM_DTYPES, or "" for the model's own) casts the Hugging Face ones."""
    if dtype and dtype not in LM_DTYPES:
        raise ValueError(f"lm_dtype must be one of {sorted(LM_DTYPES)} or empty, got {dtype!r}")
    if lm_factory:
        if dtype:
            raise ValueError(f"lm_dtype {dtype!r} applies to the Hugging Face LMs only, not to lm {lm_factory!r}")
        lm = import_object(lm_factory, "lm")(model_path, device)
    else:
        lm = HFCausalLM(_cast(_hf_model(model_path), dtype), device)
    if not isinstance(lm, CausalLM):
        raise ValueError(f"lm {lm_factory or model_path!r} lacks vocab_size, context_length, eos_token_ids or a method")
    return lm
