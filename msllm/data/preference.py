"""Preference pairs for DPO: JSONL rows -> (chosen, rejected) token rows with completion masks, pretokenized once.

TRL's preference formats, tokenized as TRL's DPOTrainer does:

    {"prompt": str, "chosen": str, "rejected": str}
        prompt, then prompt + completion tokenized whole; the completion starts where the two
        token lists part (a merge across the boundary moves it back), then EOS.
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, or chosen / rejected as
    whole conversations sharing their first messages (the implicit prompt)
        rendered with the tokenizer's chat template: the prompt with its generation prompt, then
        prompt + completion; the completion is what the second adds (its end-of-turn included).

A pair is two rows of data.seq_len + 1 tokens (chosen first), padded at the end and never packed
with another sample, so the step's micro-batch always holds both rows of a pair. Shard files:
train.bin [2 * pairs, seq_len + 1] tokens, train.mask.bin [2 * pairs, seq_len] uint8 (1 where the
label is a completion token), val.* alike, index.json with "kind": "dpo". With dpo.precompute_ref
the reference model's log-probs are added as train.ref.bin / val.ref.bin [pairs, 2] float32
(msllm.train.dpo.precompute_reference), named in ref.json by the model they came from.

With dpo.share_prompt a pair is ONE row, its prompt computed once (index.json "share_prompt": true):

    prompt[:-1] | prompt[-1] chosen | prompt[-1] rejected | padding
    segment 0     CHOSEN              REJECTED              -1

The two completions are branches of the prompt's segment (msllm.models.layers.visibility): each sees
the prompt and itself, never the other, and its positions continue from the prompt's. Each branch
repeats the prompt's last token, whose label is the completion's first token, so every label is
still the next token of the row. The mask [pairs, seq_len] is 1 where the label is a chosen token,
2 where it is a rejected one; segments and positions follow from it (branch_tables).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from msllm.data.corpus import DataError
from msllm.data.index import INDEX, read_index, token_dtype
from msllm.data.sft import Renderer, read_rows, shard_key
from msllm.preflight import make_dir
from msllm.staged import staged_dir

DPO_KIND = "dpo"
REF_INDEX = "ref.json"
# The shared layout's segment ids: branches 0 and 1 of the prompt's segment 0 (msllm.models.layers.visibility)
CHOSEN, REJECTED = -2, -3


def _messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def _shared(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PairEncoder:
    """Row -> (prompt ids, chosen completion ids, rejected completion ids)."""

    def __init__(self, tokenizer_json: Path):
        self.renderer = Renderer(tokenizer_json)

    def pair(self, row: dict, where: str) -> tuple[list[int], list[int], list[int]]:
        missing = [k for k in ("chosen", "rejected") if k not in row]
        if missing:
            raise DataError(f"data.path: {where}: a preference pair needs \"chosen\" and \"rejected\"; "
                            f"missing {', '.join(missing)} (got keys {sorted(row)})")
        chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
        if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
            return self.text(prompt, chosen, rejected, where)
        if _messages(chosen) and _messages(rejected) and (prompt is None or _messages(prompt)):
            if prompt is None:  # whole conversations: the prompt is the messages they share
                n = _shared(chosen, rejected)
                prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            if not (prompt and chosen and rejected):
                raise DataError(f"data.path: {where}: chosen and rejected must each add messages to a non-empty prompt")
            return self.chat(prompt, chosen, rejected, where)
        raise DataError(f"data.path: {where}: expected strings \"prompt\", \"chosen\", \"rejected\", or message lists "
                        f"[{{\"role\": str, \"content\": str}}, ...] for them (\"prompt\" optional)")

    def _split(self, prompt: list[int], with_chosen: list[int], with_rejected: list[int], where: str):
        cut = min(_shared(prompt, with_chosen), _shared(prompt, with_rejected))
        chosen, rejected = with_chosen[cut:], with_rejected[cut:]
        if not (cut and chosen and rejected):
            raise DataError(f"data.path: {where}: empty prompt or completion after tokenizing")
        return prompt[:cut], chosen, rejected

    def text(self, prompt: str, chosen: str, rejected: str, where: str):
        r = self.renderer
        if r.eos is None:
            raise DataError(f"data.tokenizer: {r.tokenizer_json} names no EOS token (tokenizer_config.json "
                            f"eos_token) to end a completion")
        ids = [r.encode(t, special=True) for t in (prompt, prompt + chosen, prompt + rejected)]
        prompt_ids, chosen_ids, rejected_ids = self._split(*ids, where)
        return prompt_ids, chosen_ids + [r.eos], rejected_ids + [r.eos]

    def chat(self, prompt: list, chosen: list, rejected: list, where: str):
        r = self.renderer
        if r.template_text is None:
            raise DataError(f"data.path: {where}: conversational pairs need a chat template, and {r.tokenizer_json} "
                            f"has none (tokenizer_config.json chat_template or chat_template.jinja beside it)")
        try:
            texts = (r.render(prompt, True), r.render(prompt + chosen, False), r.render(prompt + rejected, False))
        except Exception as e:  # a template's own raise_exception, or a Jinja error
            raise DataError(f"data.path: {where}: chat template failed: {e}") from None
        return self._split(*(r.encode(t) for t in texts), where)


def rows_of(prompt: list[int], completion: list[int], seq_len: int, pad: int):
    """One sample -> (tokens [seq_len + 1], mask [seq_len]: 1 where the label is a completion token)."""
    ids = prompt + completion
    tokens = np.full(seq_len + 1, pad, np.int32)
    tokens[:len(ids)] = ids
    mask = np.zeros(seq_len, np.uint8)
    mask[len(prompt) - 1:len(ids) - 1] = 1
    return tokens, mask


def shared_row(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, pad: int):
    """One pair in the shared layout -> (tokens [seq_len + 1], mask [seq_len]: 1 / 2 where the label is a
    chosen / rejected token)."""
    ids = prompt + chosen + prompt[-1:] + rejected
    tokens = np.full(seq_len + 1, pad, np.int32)
    tokens[:len(ids)] = ids
    mask = np.zeros(seq_len, np.uint8)
    at = len(prompt) - 1  # each branch starts at its copy of the prompt's last token
    mask[at:at + len(chosen)] = 1
    at += len(chosen) + 1
    mask[at:at + len(rejected)] = 2
    return tokens, mask


def branch_tables(mask: np.ndarray):
    """A shared row's mask [s] -> (segments, positions) [s] int32: the prompt's, then each branch's
    (its copy of the prompt's last token, then its completion) continuing from the prompt."""
    chosen, rejected = np.flatnonzero(mask == 1), np.flatnonzero(mask == 2)
    fork, second, end = chosen[0], rejected[0], min(rejected[-1] + 2, len(mask))  # end: after the last input token
    segments = np.full(len(mask), -1, np.int32)
    segments[:fork], segments[fork:second], segments[second:end] = 0, CHOSEN, REJECTED
    positions = np.zeros(len(mask), np.int32)
    positions[:second] = np.arange(second)
    positions[second:end] = fork + np.arange(end - second)
    return segments, positions


def encode(path: Path, tokenizer_json: Path, seq_len: int, share_prompt: bool = False):
    """(encoder, tokens [2 * pairs, seq_len + 1], mask [2 * pairs, seq_len]), with share_prompt one row a
    pair (tokens [pairs, seq_len + 1], mask [pairs, seq_len]); every bad row is refused before anything
    is written."""
    encoder = PairEncoder(tokenizer_json)
    pad = encoder.renderer.eos if encoder.renderer.eos is not None else 0
    tokens, mask = [], []
    for number, row in read_rows(path):
        where = f"{path}:{number}"
        prompt, chosen, rejected = encoder.pair(row, where)
        if share_prompt:
            longest = len(prompt) + len(chosen) + 1 + len(rejected)
            if longest > seq_len + 1:
                raise DataError(f"data.path: {where}: prompt + both completions (dpo.share_prompt) of {longest} "
                                f"tokens do not fit data.seq_len {seq_len} (+1 label); raise data.seq_len, shorten "
                                f"the row or set dpo.share_prompt: false (pairs are not cut)")
            rows = [shared_row(prompt, chosen, rejected, seq_len, pad)]
        else:
            longest = len(prompt) + max(len(chosen), len(rejected))
            if longest > seq_len + 1:
                raise DataError(f"data.path: {where}: prompt + completion of {longest} tokens does not fit "
                                f"data.seq_len {seq_len} (+1 label); raise data.seq_len or shorten the row (pairs "
                                f"are not cut)")
            rows = [rows_of(prompt, completion, seq_len, pad) for completion in (chosen, rejected)]
        tokens += [t for t, _ in rows]
        mask += [m for _, m in rows]
    pairs = len(tokens) if share_prompt else len(tokens) // 2
    if pairs < 2:
        raise DataError(f"data.path: {path}: {pairs} pair; need at least 2 (one is held out)")
    return encoder, np.stack(tokens), np.stack(mask)


def write_shard(tmp: Path, encoder: PairEncoder, tokens, mask, val_fraction: float, vocab: int, key: dict,
                source: Path, log, share_prompt: bool = False) -> None:
    per = 1 if share_prompt else 2  # rows a pair
    pairs = len(tokens) // per
    n_val = max(1, int(pairs * val_fraction))
    dtype = token_dtype(vocab)
    cut = per * (pairs - n_val)
    for name, rows in {"train": slice(0, cut), "val": slice(cut, per * pairs)}.items():
        tokens[rows].astype(dtype).tofile(tmp / f"{name}.bin")
        mask[rows].tofile(tmp / f"{name}.mask.bin")
    renderer = encoder.renderer
    for side in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if renderer.tokenizer_json.with_name(side).is_file():
            shutil.copyfile(renderer.tokenizer_json.with_name(side), tmp / side)
    index = {"kind": DPO_KIND, "dtype": np.dtype(dtype).name, "vocab_size": renderer.tok.get_vocab_size(),
             "eos_id": renderer.eos, "seq_len": tokens.shape[1] - 1, "train_pairs": pairs - n_val, "val_pairs": n_val,
             "completion_tokens": int((mask != 0).sum()), "share_prompt": share_prompt, "source": str(source),
             "key": key}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    log(f"{pairs} preference pairs ({pairs - n_val} train / {n_val} val) in rows of {tokens.shape[1] - 1}"
        f"{', one row a pair' if share_prompt else ''}, {int((mask != 0).sum()):,} completion tokens")


class PairRows:
    """Pairs of a shard split: (tokens [2, L+1] int32, mask [2, L] float32[, ref [2] float32]), chosen first;
    with share_prompt (tokens [L+1], mask [L], segments [L], positions [L] int32[, ref [2]]), one row a pair.
    A shard is read only the way it was made."""

    def __init__(self, shard_dir: Path, split: str, index: dict, with_ref: bool = False, share_prompt: bool = False):
        if index.get("share_prompt", False) != share_prompt:
            made = "one row a pair (dpo.share_prompt: true)" if not share_prompt else "two rows a pair"
            raise DataError(f"{shard_dir / INDEX}: the shard holds {made}, and this run sets dpo.share_prompt: "
                            f"{str(share_prompt).lower()}; set it as the shard was made, or build the shard again "
                            f"from the .jsonl file")
        n, seq_len = index[f"{split}_pairs"], index["seq_len"]
        self.seq_len, self.split, self.shard_dir, self.share_prompt = seq_len, split, shard_dir, share_prompt
        rows = () if share_prompt else (2,)
        files = {"tokens": (f"{split}.bin", np.dtype(index["dtype"]), rows + (seq_len + 1,)),
                 "mask": (f"{split}.mask.bin", np.dtype(np.uint8), rows + (seq_len,))}
        if with_ref:
            files["ref"] = (f"{split}.ref.bin", np.dtype(np.float32), (2,))
        self.arrays = {}
        for name, (file, dtype, shape) in files.items():
            path = shard_dir / file
            if not path.exists() or path.stat().st_size != n * int(np.prod(shape)) * dtype.itemsize:
                raise DataError(f"{path}: missing or wrong size (index says {n} pairs); rebuild the shard")
            self.arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=(n,) + shape)
        self.columns = ["tokens", "mask"] + (["segments", "positions"] if share_prompt else []) + (
            ["ref"] if with_ref else [])

    def __len__(self):
        return len(self.arrays["tokens"])

    def __getitem__(self, i):
        i = int(i)
        mask = np.asarray(self.arrays["mask"][i])
        row = (np.asarray(self.arrays["tokens"][i], np.int32), mask.astype(np.float32))
        if self.share_prompt:
            row += branch_tables(mask)
        if "ref" in self.arrays:
            row += (np.asarray(self.arrays["ref"][i], np.float32),)
        return row


def is_preference(shard_dir: Path) -> bool:
    return (shard_dir / INDEX).exists() and read_index(shard_dir).get("kind") == DPO_KIND


def prepare(path: Path, tokenizer: str | None, out_dir: Path, seq_len: int, val_fraction: float, vocab: int,
            log, share_prompt: bool = False) -> Path:
    """The shard of a preference JSONL file in out_dir, (re)built when its inputs changed."""
    # the key names share_prompt only when it is on: shards made before the option keep theirs
    tokenizer_json, key, built = shard_key(DPO_KIND, "preference pairs", path, tokenizer, out_dir, seq_len,
                                           val_fraction, **({"share_prompt": True} if share_prompt else {}))
    if built:
        return out_dir
    encoder, tokens, mask = encode(path, tokenizer_json, seq_len, share_prompt)
    make_dir(out_dir.parent, "train.run_dir")  # the shard is cached in the run dir
    need = tokens.size * 4 + mask.size + 2 * tokenizer_json.stat().st_size
    with staged_dir(out_dir, need=need, then="free space or put train.run_dir on another disk, then run again") as tmp:
        write_shard(tmp, encoder, tokens, mask, val_fraction, vocab, key, path, log, share_prompt)
    return out_dir
