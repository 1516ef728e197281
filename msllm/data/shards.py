"""Pretokenized shards: tokens as a flat uint16/uint32 memmap plus index.json.

Layout of a shard dir:  tokenizer.json, train.bin, val.bin, index.json
Documents are joined with EOS; the held-out split is the tail `val_fraction` of the
stream (documents are already in a hashed, i.e. shuffled, order).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from msllm.config import Config
from msllm.data import corpus, preference, prompts, sft
from msllm.data.corpus import DataError
from msllm.data.index import INDEX, SFT_KIND, open_tokens, read_index, token_dtype
from msllm.data.tokenizer import eos_id, load_tokenizer, tokenizer_config, train_tokenizer
from msllm.preflight import make_dir
from msllm.staged import staged_dir

def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def open_split(shard_dir: Path, split: str):
    """What the loader reads: the token stream of a text shard, or the packed windows of an SFT shard."""
    index = read_index(shard_dir)
    if index.get("kind") == SFT_KIND:
        return sft.SFTWindows(shard_dir, split, index)
    return open_tokens(shard_dir, split)


def build_shard(cfg: Config, out_dir: Path) -> Path:
    """Tokenize the configured corpus into out_dir (reused when already built from the same inputs)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if cfg.train.objective == "grpo":  # prompts are read whole each run; the dir holds the tokenizer
        if not (d.path and Path(d.path).expanduser().suffix == ".jsonl" and d.tokenizer):
            raise DataError(f"data.path: {d.path}: train.objective grpo reads a .jsonl file of prompt rows and the "
                            f"model's tokenizer (train.init_from)")
        tokenizer_json = Path(d.tokenizer).expanduser()
        prompts.read_prompts(Path(d.path).expanduser(), tokenizer_json, d.seq_len, cfg.grpo.max_new_tokens)
        sides = {side: tokenizer_json.with_name(side).read_bytes() for side in
                 ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if tokenizer_json.with_name(side).is_file()}
        index = {"kind": "prompts", "source": str(d.path)}
        if (out_dir / INDEX).is_file() and read_index(out_dir) == index and all(
                (out_dir / side).is_file() and (out_dir / side).read_bytes() == data for side, data in sides.items()):
            return out_dir  # already in place (rank 0's copy, or a run resumed): replacing it would pull the
        make_dir(out_dir.parent, "train.run_dir")  # tokenizer from under another rank reading it
        with staged_dir(out_dir, need=2 * tokenizer_json.stat().st_size, then="free space, then run again") as tmp:
            for side, data in sides.items():
                (tmp / side).write_bytes(data)
            (tmp / INDEX).write_text(json.dumps(index))
        return out_dir
    if cfg.train.objective == "dpo":
        if d.path and Path(d.path).expanduser().suffix == ".jsonl":
            return preference.prepare(Path(d.path).expanduser(), d.tokenizer, out_dir, d.seq_len, d.val_fraction,
                                      vocab, _log, cfg.dpo.share_prompt)
        if not (d.path and preference.is_preference(Path(d.path).expanduser())):
            raise DataError(f"data.path: {d.path}: train.objective dpo reads preference pairs: a .jsonl file of "
                            f"prompt / chosen / rejected rows, or the shard built from one")
        return Path(d.path).expanduser()
    if d.path and Path(d.path).expanduser().suffix == ".jsonl":
        return sft.prepare(Path(d.path).expanduser(), d.tokenizer, out_dir, d.seq_len, d.val_fraction, vocab, _log)
    if d.path and (Path(d.path) / INDEX).exists():  # already a pretokenized shard
        index = read_index(Path(d.path))
        if index["vocab_size"] > vocab:
            raise DataError(f"{d.path}/{INDEX}: vocab_size {index['vocab_size']} > model.vocab_size {vocab}")
        return Path(d.path)
    root, files = corpus.list_files(d.path, d.glob, d.max_bytes)
    key = {"fingerprint": corpus.fingerprint(root, files), "vocab_size": vocab,
           "val_fraction": d.val_fraction, "tokenizer": d.tokenizer}
    if (out_dir / INDEX).exists() and read_index(out_dir).get("key") == key:
        return out_dir

    where = d.path or "Python stdlib"
    texts, skipped = corpus.read_texts(files)
    if not texts:
        raise DataError(f"data.path: {where}: none of its {len(files)} file(s) is UTF-8 text (binary or another "
                        f"encoding); msllm trains on UTF-8 text files")
    nbytes = sum(len(t) for t in texts)
    if nbytes + len(texts) < 3 * (d.seq_len + 1):  # a token covers at least one character, plus one EOS per file
        raise DataError(f"data.path: {where}: only {nbytes} characters of text; data.seq_len {d.seq_len} needs at "
                        f"least {3 * (d.seq_len + 1)} tokens (two training windows and one held-out)")
    tok = load_tokenizer(d.tokenizer) if d.tokenizer else None  # None: trained on the corpus
    if tok is not None and tok.get_vocab_size() > vocab:
        raise DataError(f"data.tokenizer: {d.tokenizer} has {tok.get_vocab_size()} tokens > model.vocab_size {vocab}")
    make_dir(out_dir.parent, "train.run_dir")  # the shard is cached in the run dir
    source = "Python stdlib" if d.path is None else str(root)
    _log(f"corpus: {len(texts)} files, {sum(p.stat().st_size for p in files) / 1e6:.1f} MB from {source}"
         + (f"; skipped {len(skipped)} that are not UTF-8 text (e.g. {skipped[0]})" if skipped else ""))
    # At most one token per byte plus an EOS per file; the tokenizer's JSON takes ~100 bytes per token.
    need = (sum(len(t.encode()) for t in texts) + len(texts)) * np.dtype(token_dtype(vocab)).itemsize + 100 * vocab
    with staged_dir(out_dir, need=need, then="free space or put train.run_dir on another disk, then run again") as tmp:
        _write_shard(cfg, tmp, texts, tok, key, source)
    return out_dir


def _write_shard(cfg: Config, tmp: Path, texts: list[str], tok, key: dict, source: str) -> None:
    """Tokenizer (trained unless given), train.bin, val.bin and index.json into tmp."""
    d, vocab = cfg.data, cfg.model.vocab_size
    t0 = time.time()
    if tok is None:
        tok = train_tokenizer(texts, vocab)
        _log(f"trained byte-level BPE, vocab {tok.get_vocab_size()} in {time.time() - t0:.1f}s")
    tok.save(str(tmp / "tokenizer.json"))

    eos, dtype = eos_id(tok, tokenizer_config(d.tokenizer) if d.tokenizer else None), token_dtype(vocab)
    if eos is None:
        raise DataError(f"data.tokenizer: {d.tokenizer} names no EOS token (tokenizer_config.json eos_token) to "
                        f"join documents with")
    chunks, t0 = [], time.time()
    for start in range(0, len(texts), 256):
        for enc in tok.encode_batch(texts[start:start + 256]):
            chunks.append(np.asarray(enc.ids + [eos], dtype=dtype))
        _log(f"tokenized {min(len(texts), start + 256)}/{len(texts)} files")
    stream = np.concatenate(chunks)
    n_val = max(d.seq_len + 1, int(len(stream) * d.val_fraction))
    if len(stream) < n_val + 2 * (d.seq_len + 1):
        raise DataError(f"data.path: corpus has only {len(stream)} tokens; need more text for seq_len {d.seq_len}")
    for name, tokens in (("train.bin", stream[:-n_val]), ("val.bin", stream[-n_val:])):
        with open(tmp / name, "wb") as f:  # not ndarray.tofile: its short write on a full disk carries no errno
            f.write(memoryview(tokens))
    index = {"dtype": np.dtype(dtype).name, "vocab_size": tok.get_vocab_size(), "eos_id": eos,
             "train_tokens": int(len(stream) - n_val), "val_tokens": int(n_val),
             "documents": len(texts), "source": source, "key": key}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    _log(f"{len(stream):,} tokens ({len(stream) - n_val:,} train / {n_val:,} val) in {time.time() - t0:.1f}s")
