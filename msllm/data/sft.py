"""Supervised fine-tuning data: JSONL rows -> token windows with a loss mask, packed, pretokenized once.

A row is {"prompt": ..., "response": ...} (tokens: prompt, response, EOS; loss on response and
EOS) or {"messages": [{"role", "content"}, ...]} rendered with the tokenizer's chat template (loss
on what each assistant turn adds to the rendered text). Samples are packed in file order into
windows of data.seq_len + 1 tokens and padded; a sample never spans two windows and one that
does not fit a window is refused. Per window the shard stores, beside the tokens:

    mask      [seq_len] uint8   1 where the label (the next token) is a response token of the same sample
    segments  [seq_len] uint16  1, 2, ... per sample, 0 on padding

and positions restart at 0 with each sample (computed from segments when read). Shard files:
train.bin / val.bin (tokens), train.mask.bin, train.segments.bin (and val.*), index.json with
"kind": "sft"; the held-out split is the last windows.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from msllm.data.corpus import DataError
from msllm.data.index import INDEX, SFT_KIND, read_index, token_dtype
from msllm.data.tokenizer import chat_template, eos_id, load_tokenizer, special_token, tokenizer_config
from msllm.preflight import make_dir
from msllm.staged import staged_dir

def read_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of every non-blank line; a line that is not a JSON object is refused."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"data.path: {path}:{number}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"data.path: {path}:{number}: expected a JSON object")
            rows.append((number, row))
    if not rows:
        raise DataError(f"data.path: {path}: no rows")
    return rows


class Renderer:
    """Row -> (token ids, response mask) with one tokenizer and, for chat rows, its template."""

    def __init__(self, tokenizer_json: Path):
        self.tok = load_tokenizer(tokenizer_json)
        config = tokenizer_config(tokenizer_json)
        self.eos = eos_id(self.tok, config)
        self.template_text = chat_template(tokenizer_json)
        self.specials = {k: special_token(config, k) or "" for k in ("bos_token", "eos_token")}
        self.tokenizer_json, self._template = tokenizer_json, None

    def render(self, messages: list, generation_prompt: bool) -> str:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.template_text)
        return self._template.render(messages=messages, add_generation_prompt=generation_prompt, **self.specials)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids if text else []

    def sample(self, row: dict, where: str) -> tuple[list[int], list[int]]:
        if "messages" in row:
            return self.chat(row["messages"], where)
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str)):
            raise DataError(f"data.path: {where}: expected string fields \"prompt\" and \"response\", or "
                            f"\"messages\"; got keys {sorted(row)}")
        if self.eos is None:
            raise DataError(f"data.tokenizer: {self.tokenizer_json} names no EOS token (tokenizer_config.json "
                            f"eos_token) to end a response")
        prompt, response = self.encode(row["prompt"], special=True), self.encode(row["response"]) + [self.eos]
        return prompt + response, [0] * len(prompt) + [1] * len(response)

    def chat(self, messages, where: str) -> tuple[list[int], list[int]]:
        if self.template_text is None:
            raise DataError(f"data.path: {where}: chat rows need a chat template, and {self.tokenizer_json} has "
                            f"none (tokenizer_config.json chat_template or chat_template.jinja beside it)")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise DataError(f"data.path: {where}: \"messages\" must be a non-empty list of "
                            f"{{\"role\": str, \"content\": str}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"data.path: {where}: no assistant message to learn from")
        # Each assistant turn is what rendering it adds to the conversation up to its generation prompt.
        pieces, done = [], ""
        try:
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                prompt, full = self.render(messages[:k], True), self.render(messages[:k + 1], False)
                if not (prompt.startswith(done) and full.startswith(prompt)):
                    raise DataError(f"data.path: {where}: the chat template does not render turn by turn "
                                    f"(a conversation prefix renders differently), so responses cannot be masked")
                pieces += [(prompt[len(done):], 0), (full[len(prompt):], 1)]
                done = full
            whole = self.render(messages, False)
        except DataError:
            raise
        except Exception as e:  # a template's own raise_exception, or a Jinja error
            raise DataError(f"data.path: {where}: chat template failed: {e}") from None
        pieces.append((whole[len(done):] if whole.startswith(done) else "", 0))
        ids, mask = [], []
        for text, label in pieces:
            piece = self.encode(text)
            ids += piece
            mask += [label] * len(piece)
        return ids, mask


def pack(samples: list[tuple[list[int], list[int]]], seq_len: int, pad: int):
    """Greedy, in order: (tokens [n, seq_len+1], mask [n, seq_len], segments [n, seq_len])."""
    rows, width = [], seq_len + 1
    current: list = []
    for ids, resp in samples:
        if current and sum(len(s[0]) for s in current) + len(ids) > width:
            rows.append(current)
            current = []
        current.append((ids, resp))
    rows.append(current)
    tokens = np.full((len(rows), width), pad, np.int32)
    seg_full = np.zeros((len(rows), width), np.int32)
    resp_full = np.zeros((len(rows), width), np.uint8)
    for r, row in enumerate(rows):
        at = 0
        for k, (ids, resp) in enumerate(row, 1):
            tokens[r, at:at + len(ids)], seg_full[r, at:at + len(ids)], resp_full[r, at:at + len(ids)] = ids, k, resp
            at += len(ids)
    # The label of input j is token j+1: learn it when it is a response token of input j's own sample.
    mask = (resp_full[:, 1:] == 1) & (seg_full[:, 1:] == seg_full[:, :-1]) & (seg_full[:, :-1] > 0)
    return tokens, mask.astype(np.uint8), seg_full[:, :-1]


def positions(segments: np.ndarray) -> np.ndarray:
    """Position of each token inside its sample: restarts at 0 wherever the segment id changes."""
    idx = np.broadcast_to(np.arange(segments.shape[-1]), segments.shape)
    first = np.ones(segments.shape, bool)
    first[..., 1:] = segments[..., 1:] != segments[..., :-1]
    return (idx - np.maximum.accumulate(np.where(first, idx, 0), axis=-1)).astype(np.int32)


def encode(path: Path, tokenizer_json: Path, seq_len: int):
    """(renderer, packed windows) of the JSONL file; every bad row is refused before anything is written."""
    renderer = Renderer(tokenizer_json)
    samples = []
    for number, row in read_rows(path):
        ids, resp = renderer.sample(row, f"{path}:{number}")
        if len(ids) > seq_len + 1:
            raise DataError(f"data.path: {path}:{number}: sample of {len(ids)} tokens does not fit data.seq_len "
                            f"{seq_len} (+1 label); raise data.seq_len or shorten the row (samples are not cut)")
        if not any(resp[1:]):
            raise DataError(f"data.path: {path}:{number}: no response tokens to learn from")
        samples.append((ids, resp))
    tokens, mask, segments = pack(samples, seq_len, renderer.eos if renderer.eos is not None else 0)
    if len(tokens) < 2:
        raise DataError(f"data.path: {path}: {len(samples)} samples fill only {len(tokens)} window of data.seq_len "
                        f"{seq_len}; need at least 2 (one is held out)")
    return renderer, len(samples), (tokens, mask, segments)


def write_shard(tmp: Path, renderer: Renderer, samples: int, packed, val_fraction: float, vocab: int, key: dict,
                source: Path, log) -> None:
    """The packed windows, the tokenizer files and index.json into tmp."""
    tokens, mask, segments = packed
    n_val = max(1, int(len(tokens) * val_fraction))
    dtype = token_dtype(vocab)
    split = {"train": slice(0, len(tokens) - n_val), "val": slice(len(tokens) - n_val, len(tokens))}
    for name, rows in split.items():
        tokens[rows].astype(dtype).tofile(tmp / f"{name}.bin")
        mask[rows].tofile(tmp / f"{name}.mask.bin")
        segments[rows].astype(np.uint16).tofile(tmp / f"{name}.segments.bin")
    tokenizer_json = renderer.tokenizer_json
    shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
    for side in ("tokenizer_config.json", "chat_template.jinja"):
        if tokenizer_json.with_name(side).is_file():
            shutil.copyfile(tokenizer_json.with_name(side), tmp / side)
    seq_len = tokens.shape[1] - 1
    index = {"kind": SFT_KIND, "dtype": np.dtype(dtype).name, "vocab_size": renderer.tok.get_vocab_size(),
             "eos_id": renderer.eos, "seq_len": seq_len, "train_windows": len(tokens) - n_val, "val_windows": n_val,
             "samples": samples, "response_tokens": int(mask.sum()), "source": str(source), "key": key}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    log(f"{samples} SFT samples packed into {len(tokens)} windows of {seq_len} ({len(tokens) - n_val} train / "
        f"{n_val} val), {int(mask.sum()):,} response tokens")


class SFTWindows:
    """Packed windows of a shard split: (tokens [L+1] int32, mask [L] float32, segments, positions [L] int32)."""

    columns = ["tokens", "mask", "segments", "positions"]

    def __init__(self, shard_dir: Path, split: str, index: dict):
        n, seq_len = index[f"{split}_windows"], index["seq_len"]
        self.seq_len = seq_len
        files = {"tokens": (f"{split}.bin", np.dtype(index["dtype"]), seq_len + 1),
                 "mask": (f"{split}.mask.bin", np.dtype(np.uint8), seq_len),
                 "segments": (f"{split}.segments.bin", np.dtype(np.uint16), seq_len)}
        self.arrays = {}
        for name, (file, dtype, width) in files.items():
            path = shard_dir / file
            if not path.exists() or path.stat().st_size != n * width * dtype.itemsize:
                raise DataError(f"{path}: missing or wrong size (index says {n} windows); rebuild the shard")
            self.arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=(n, width))

    def __len__(self):
        return len(self.arrays["tokens"])

    def __getitem__(self, i):
        i = int(i)
        segments = np.asarray(self.arrays["segments"][i], dtype=np.int32)
        return (np.asarray(self.arrays["tokens"][i], dtype=np.int32), np.asarray(self.arrays["mask"][i], np.float32),
                segments, positions(segments))


def shard_key(kind: str, what: str, path: Path, tokenizer: str | None, out_dir: Path, seq_len: int,
              val_fraction: float, **layout) -> tuple[Path, dict, bool]:
    """(tokenizer.json, the key of the shard of a JSONL file of `what`, whether out_dir holds it already);
    `layout`: more settings the shard depends on."""
    if tokenizer is None:
        raise DataError(f"data.path: {path} holds {what}, which need the model's tokenizer: set train.init_from "
                        f"(or data.tokenizer)")
    tokenizer_json = Path(tokenizer).expanduser()
    stat = path.stat()
    key = {"kind": kind, "source": f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}",
           "tokenizer": str(tokenizer_json.resolve()), "seq_len": seq_len, "val_fraction": val_fraction, **layout}
    return tokenizer_json, key, (out_dir / INDEX).exists() and read_index(out_dir).get("key") == key


def prepare(path: Path, tokenizer: str | None, out_dir: Path, seq_len: int, val_fraction: float, vocab: int,
            log) -> Path:
    """The shard of an SFT JSONL file in out_dir, (re)built when its inputs changed."""
    tokenizer_json, key, built = shard_key(SFT_KIND, "SFT rows", path, tokenizer, out_dir, seq_len, val_fraction)
    if built:
        return out_dir
    renderer, samples, packed = encode(path, tokenizer_json, seq_len)
    make_dir(out_dir.parent, "train.run_dir")  # the shard is cached in the run dir
    need = sum(a.size * 4 for a in packed) + 2 * tokenizer_json.stat().st_size  # tokens (<= 4 bytes), mask, segments
    with staged_dir(out_dir, need=need, then="free space or put train.run_dir on another disk, then run again") as tmp:
        write_shard(tmp, renderer, samples, packed, val_fraction, vocab, key, path, log)
    return out_dir
