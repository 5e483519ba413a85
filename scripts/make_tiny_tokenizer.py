"""Train the default tiny LM's tokenizer: a byte-level BPE over the text this repository ships.

    python scripts/make_tiny_tokenizer.py   # rewrites plugin/generation/lm_configs/tiny_tokenizer/

The vocabulary is exactly the tiny LM's (`vocab_size` of lm_configs/tiny_llama.json), its first ids
are the special tokens the LM config names (pad, bos, eos), and the chat template ends each turn
with the EOS token, so a chat reply stops where the LM's EOS is sampled. Byte-level: every string
encodes, and any id sequence decodes (partial UTF-8 only shows as U+FFFD until completed).
Nothing is downloaded; the files are committed as package data.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
LM_CONFIGS = REPO_ROOT / "plugin" / "generation" / "lm_configs"
OUTPUT = LM_CONFIGS / "tiny_tokenizer"
# Ids 0, 1, 2 as tiny_llama.json's pad_token_id, bos_token_id and eos_token_id; then the turn opener.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def training_text() -> list[str]:
    """The repository's own prose, in a fixed order: README, changelog and docs/."""
    files = [REPO_ROOT / "README.md", REPO_ROOT / "CHANGELOG.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return [path.read_text() for path in files]


def main() -> None:
    config = json.loads((LM_CONFIGS / "tiny_llama.json").read_text())
    ids = [config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]]
    assert ids == [0, 1, 2], f"the special tokens are trained as ids 0, 1, 2; the LM config says {ids}"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    assert tokenizer.get_vocab_size() == config["vocab_size"], tokenizer.get_vocab_size()
    OUTPUT.mkdir(exist_ok=True)
    tokenizer.save(str(OUTPUT / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "additional_special_tokens": ["<|im_start|>"],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (OUTPUT / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"wrote {OUTPUT.relative_to(REPO_ROOT)}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
