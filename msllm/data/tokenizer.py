"""Byte-level BPE (Hugging Face `tokenizers`), trained on the corpus and cached as tokenizer.json;
or a pretrained model's tokenizer.json with its tokenizer_config.json (EOS, chat template) beside it."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # a trained tokenizer starts with the 256 byte tokens and EOS


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def tokenizer_config(tokenizer_json: str | Path) -> dict:
    """The tokenizer_config.json beside a tokenizer.json ({} when there is none or it is unreadable)."""
    path = Path(tokenizer_json).with_name("tokenizer_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def special_token(config: dict, key: str) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def chat_template(tokenizer_json: str | Path) -> str | None:
    """The Jinja chat template of a pretrained tokenizer: tokenizer_config.json's `chat_template`
    (a string, or named templates of which "default" is used) or chat_template.jinja beside it."""
    template = tokenizer_config(tokenizer_json).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    jinja = Path(tokenizer_json).with_name("chat_template.jinja")
    if not template and jinja.is_file():
        template = jinja.read_text()
    return template if isinstance(template, str) and template else None


def eos_id(tok: Tokenizer, config: dict | None = None) -> int | None:
    """The end-of-sequence id: the pretrained tokenizer's eos_token, else msllm's own EOS."""
    name = special_token(config or {}, "eos_token")
    found = tok.token_to_id(name) if name else None
    return found if found is not None else tok.token_to_id(EOS)
