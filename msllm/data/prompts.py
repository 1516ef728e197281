"""GRPO's prompts: JSONL rows {"prompt": str} or {"messages": [...]} (rendered with the chat template and
its generation prompt), any other keys kept as columns for the reward functions. Read whole, checked
row by row before anything is written: a prompt that leaves no room for data.seq_len's completions
is refused with its file and line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from msllm.data.corpus import DataError
from msllm.data.sft import Renderer, read_rows


@dataclass
class Prompt:
    ids: list
    text: str
    columns: dict


def read_prompts(path: Path, tokenizer_json: Path, seq_len: int, max_new: int) -> tuple[Renderer, list[Prompt]]:
    renderer = Renderer(tokenizer_json)
    prompts = []
    for number, row in read_rows(path):
        where = f"{path}:{number}"
        if isinstance(row.get("prompt"), str):
            text, special = row["prompt"], True
        elif "messages" in row:
            messages = row["messages"]
            if renderer.template_text is None or not isinstance(messages, list) or not messages:
                raise DataError(f"data.path: {where}: \"messages\" needs a non-empty message list and a chat template")
            try:
                text, special = renderer.render(messages, True), False
            except Exception as e:  # a template's own raise_exception, or a Jinja error
                raise DataError(f"data.path: {where}: chat template failed: {e}") from None
        else:
            raise DataError(f"data.path: {where}: expected a string \"prompt\" or \"messages\"; got keys {sorted(row)}")
        ids = renderer.encode(text, special=special)
        if not ids or len(ids) + max_new > seq_len + 1:
            raise DataError(f"data.path: {where}: prompt of {len(ids)} tokens + grpo.max_new_tokens {max_new} does "
                            f"not fit data.seq_len {seq_len} (+1); raise data.seq_len or shorten the prompt")
        prompts.append(Prompt(ids, text, {k: v for k, v in row.items() if k not in ("prompt", "messages")}))
    return renderer, prompts
