"""Text in and out: the checkpoint's tokenizer and chat template, incremental detokenization and
stop strings.

Streams are detokenized token by token without breaking UTF-8: a token that ends inside a
multi-byte character (a byte-level BPE splits them) releases no text until the character is
complete, and the text of a whole generation is the same streamed or not. Stop strings are
matched on that text, across token boundaries; what a stream sends is held back by the longest
stop string less one character, so a stop string is never half sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..generation.lm import DEFAULT_LM_CONFIG, DEFAULT_TOKENIZER

# A decoded piece that ends like this is an incomplete UTF-8 sequence (wait for the next token).
_REPLACEMENT = "\ufffd"
# The context length a checkpoint that names none gets (as the generate model's Hugging Face LM).
_FALLBACK_CONTEXT = 2048


def load_tokenizer(model_path: str):
    """The tokenizer of the checkpoint in `model_path` (the built-in tiny LM's when empty), from
    local files only; raises ValueError saying why it cannot be loaded."""
    from transformers import AutoTokenizer

    path = Path(model_path) if model_path else DEFAULT_TOKENIZER
    if not path.is_dir():
        raise ValueError(f"--model-path {model_path!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError... for a bad directory
        raise ValueError(f"no tokenizer could be loaded from --model-path {model_path!r}: {error}") from None


def context_length(model_path: str) -> int:
    """The LM's context length as the generate model reads it: `max_position_embeddings` of the
    checkpoint's config.json (of lm_configs/tiny_llama.json for the built-in LM)."""
    config = Path(model_path) / "config.json" if model_path else DEFAULT_LM_CONFIG
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return _FALLBACK_CONTEXT
    text_config = settings.get("text_config") or {}
    return int(
        settings.get("max_position_embeddings") or text_config.get("max_position_embeddings") or _FALLBACK_CONTEXT
    )


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its own message says why)."""


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    template_kwargs: dict,
    add_special_tokens: bool = False,
) -> list[int]:
    """The prompt ids of a conversation: the checkpoint's chat template, then its tokenizer."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("this checkpoint's tokenizer has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except Exception as error:  # jinja2's TemplateError, or the template's raise_exception
        raise ChatTemplateError(f"the chat template refused the messages: {error}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def ids_decoder(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool = True):
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)`
    answers it (a fast tokenizer ignores the spaces switch, as in vLLM and SGLang): the tokenizers
    library's own decode where transformers' wrapper adds nothing to it (a fast tokenizer whose
    classes keep the base decode and that cleans up no spaces), which spares the wrapper's argument
    conversions on every streamed token; the wrapper itself otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers comes with the api extra
        backend = None
    plain = (
        backend is not None
        and isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )
    if plain:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
    )


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time, each UTF-8 character released whole.

    Only a short window of ids is decoded per token (the ids since the last released text, plus
    those before them for context), so a step costs the same at token 10 and token 10,000."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces: bool = True, decode=None):
        """`decode` (ids -> text, as `ids_decoder` makes it) may be passed to share one."""
        self._decode = decode or ids_decoder(tokenizer, skip_special_tokens, spaces)
        self.decode = self._decode
        self._ids: list[int] = []
        self._prefix_offset = self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; the text it completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """The text still held back at the end (an incomplete character, as U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if text.startswith(prefix) else ""


@dataclass
class StopMatch:
    """Where the first stop string starts in the text, and which one it is."""

    position: int
    string: str


class StopStrings:
    """Finds the earliest of several stop strings in a growing text, looking only at what the new
    text can complete."""

    def __init__(self, strings: tuple[str, ...], kept: bool = False):
        """`kept`: the text keeps the stop string, so nothing needs holding back while streaming."""
        self.strings = tuple(s for s in strings if s)
        self.hold_back = 0 if kept else max((len(s) for s in self.strings), default=1) - 1

    def search(self, text: str, new_from: int) -> StopMatch | None:
        """The earliest stop string that ends in text[new_from:], or None."""
        if not self.strings:
            return None
        start = max(0, new_from - self.hold_back)
        best = None
        for string in self.strings:
            at = text.find(string, start)
            if at >= 0 and (best is None or at < best.position):
                best = StopMatch(at, string)
        return best
