"""What a request may ask of the API, checked before any costly work: how many prompts (and
sequences) and chat messages it carries, and how long its texts are, before they are tokenized or
rendered through a chat template; and whether it may bring a chat template of its own.

The context length bounds the tokens a prompt may have, and no token decodes to more characters
than the vocabulary's longest, so a text longer than `context x longest token` characters cannot
fit: it is refused (400) before tokenizing, with a margin of PROMPT_CHARS_MARGIN for tokenizers
whose normalizer drops characters. A conversation of more messages than the context has tokens
cannot fit either (a chat template marks every turn with a token at least). A prompt count is
checked against `--max-choices` before any prompt is tokenized. What remains costs at most
`max_choices x max_prompt_chars` characters of tokenizing, spent off the event loop
(preparation.py), each prompt refused as soon as its tokens pass the context.

A client's own chat template is code the API would run: refused unless the operator trusts request
templates (`--trust-request-chat-template`, vLLM's flag and message).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ApiError, bad_request

# How many times over a text may exceed what the context can hold, at the longest token, before it
# is refused untokenized (a normalizer may fold whitespace or drop characters).
PROMPT_CHARS_MARGIN = 2
UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` decodes to, at most: its longest vocabulary
    entry (a byte-level entry spells each byte as one character; added tokens as their text)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class PromptPastContext(ApiError):
    """A prompt whose tokens already pass the context (the route names the field)."""

    def __init__(self, tokens: int, context: int):
        super().__init__(
            400,
            f"the prompt is {tokens} tokens; this model's context is {context} tokens, which must hold the "
            "prompt and at least one new token",
        )


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_count(prompts) -> int:
    """How many prompts a `prompt` / `text` / `input_ids` value holds (a list of ids is one)."""
    if isinstance(prompts, list) and prompts and not _is_token_ids(prompts):
        return len(prompts)
    return 1


def _texts(prompts) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    return [p for p in prompts if isinstance(p, str)] if isinstance(prompts, list) else []


def _n_of(sampling_params) -> int:
    """The `n` of one SGLang sampling_params object (1 when absent or not a number: the route
    refuses a wrong type)."""
    n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _string_chars(value) -> int:
    """The characters of every string in a JSON value (dict keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _string_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_string_chars(v) for v in value)
    return 0


@dataclass(frozen=True)
class InputBounds:
    """The bounds of one deployment (see the module docstring)."""

    context_length: int
    max_choices: int
    max_prompt_chars: int
    trust_request_chat_template: bool = False

    @classmethod
    def of(cls, tokenizer, context_length: int, max_choices: int, max_prompt_chars=None, trust=False) -> InputBounds:
        """The bounds for `tokenizer` at `context_length` (`max_prompt_chars` None: derived)."""
        if max_prompt_chars is None:
            max_prompt_chars = context_length * longest_token_chars(tokenizer) * PROMPT_CHARS_MARGIN
        return cls(context_length, max_choices, max_prompt_chars, trust)

    @property
    def max_messages(self) -> int:
        return self.context_length

    def check_completion(self, prompt, n) -> None:
        """/v1/completions' `prompt` and `n`: the sequences within --max-choices, every text within
        max_prompt_chars (before any prompt is tokenized)."""
        count = _prompt_count(prompt)
        self._check_prompts(prompt, count * n if isinstance(n, int) else count, "prompt", "n")

    def check_generate(self, text, input_ids, sampling_params) -> None:
        """/generate's prompts and the sequences its `sampling_params` ask for (their `n`), as
        `check_completion`."""
        prompts, field = (text, "text") if text is not None else (input_ids, "input_ids")
        count = _prompt_count(prompts)
        if isinstance(sampling_params, list):
            choices = sum(_n_of(item) for item in sampling_params)
        else:
            choices = count * _n_of(sampling_params)
        self._check_prompts(prompts, max(choices, count), field, "sampling_params.n")

    def _check_prompts(self, prompts, choices: int, field: str, choices_field: str) -> None:
        count = _prompt_count(prompts)
        if choices > self.max_choices:
            where = field if count > self.max_choices else choices_field
            raise bad_request(
                f"this request asks for {choices} sequences ({count} prompts); at most {self.max_choices} are "
                "generated per request (--max-choices): send several requests",
                where,
            )
        for i, text in enumerate(_texts(prompts)):
            self._check_chars(len(text), f"{field}[{i}]" if isinstance(prompts, list) else field, field)

    def _check_chars(self, chars: int, what: str, field: str) -> None:
        if chars > self.max_prompt_chars:
            raise bad_request(
                f"{what} holds {chars} characters: more than this model's context of {self.context_length} tokens "
                f"can hold (at most {self.max_prompt_chars} characters are tokenized)",
                field,
            )

    def check_message_count(self, body) -> None:
        """A chat body's `messages` count, read from the parsed JSON before each message is
        validated (a model per message is the costly part)."""
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise bad_request(
                f"messages holds {len(messages)} messages; a conversation this model's context of "
                f"{self.context_length} tokens can hold has at most {self.max_messages}",
                "messages",
            )

    def check_chat(self, messages: list, template_kwargs: dict | None, request_template: str | None) -> None:
        """A validated chat request: its own template only when trusted, and the characters its
        messages and template arguments hold within max_prompt_chars."""
        kwargs = template_kwargs or {}
        if not self.trust_request_chat_template:
            if kwargs.get("chat_template") is not None:
                raise bad_request(UNTRUSTED_TEMPLATE, "chat_template_kwargs.chat_template")
            if request_template is not None:
                raise bad_request(UNTRUSTED_TEMPLATE, "chat_template")
        chars = _string_chars([m.content for m in messages]) + _string_chars(kwargs)
        self._check_chars(chars, "messages (with chat_template_kwargs)", "messages")

    def check_tokens(self, ids: list[int]) -> list[int]:
        """`ids` of one prompt, refused at once when they already pass the context."""
        if len(ids) >= self.context_length:
            raise PromptPastContext(len(ids), self.context_length)
        return ids
