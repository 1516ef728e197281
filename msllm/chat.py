"""A model's own text conventions, read from the files it came with: the token ids that end a
reply, and the chat template that turns messages into a prompt.

Hugging Face dirs (and msllm checkpoints converted from them, which keep the side files and the
source config.json in state.json) say where generation ends in generation_config.json or
config.json (`eos_token_id`, an id or a list), and carry the template in chat_template.jinja or
in tokenizer_config.json's `chat_template`. A run trained by msllm ends documents with its
tokenizer's <|endoftext|>. Exports store what was read here in export.json.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path

from msllm.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
EOS_SOURCES = ("generation_config.json", "config.json")
ENDOFTEXT = "<|endoftext|>"  # msllm.data.tokenizer.EOS: what msllm training puts after each document


class ChatError(UserError, ValueError):
    pass


@dataclasses.dataclass
class TextConventions:
    eos_ids: list[int]
    chat_template: str | None = None
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ... by name


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as text or as {"content": text, ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def read(folder: Path, hf_config: dict | None, tokenizer) -> TextConventions:
    """The conventions of the model whose files are in `folder` (hf_config: its HF config.json, if known)."""
    folder = Path(folder)
    eos = []
    for config in [_json(folder / name) for name in EOS_SOURCES] + [hf_config or {}]:
        eos = _ids(config.get("eos_token_id"))
        if eos:
            break
    tokenizer_config = _json(folder / "tokenizer_config.json")
    specials = {name: text for name, value in tokenizer_config.items()
                if name.endswith("_token") and (text := _token_text(value)) is not None}
    if not eos:
        named = specials.get("eos_token", ENDOFTEXT)
        eos = _ids(tokenizer.token_to_id(named))
    template = tokenizer_config.get("chat_template")
    if (folder / TEMPLATE_FILE).is_file():
        template = (folder / TEMPLATE_FILE).read_text()
    if isinstance(template, list):  # several named templates: the default one, as transformers picks
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TextConventions(eos, template if isinstance(template, str) else None, specials)


def render(conventions: TextConventions, messages: list[dict], where: str) -> str:
    """The prompt text for `messages` ({"role", "content"} dicts), ending where the assistant's
    reply starts. Rendered as transformers renders it: a sandboxed jinja2 environment with
    trim_blocks / lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`
    and a `tojson` filter, and the tokenizer's special tokens as variables."""
    if conventions.chat_template is None:
        raise ChatError(f"{where}: the model has no chat template ({TEMPLATE_FILE} or tokenizer_config.json "
                        f"'chat_template'); use --prompt with text in the model's own format")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(conventions.chat_template).render(
            messages=messages, add_generation_prompt=True, **conventions.special_tokens)
    except jinja2.TemplateError as e:
        raise ChatError(f"{where}: the model's chat template fails: {e}") from None
