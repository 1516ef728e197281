"""Checks that need the file system or the machine, run before anything heavy is imported or written.

`msllm train` calls check_train() after the config validates and before it imports MindSpore or
creates train.run_dir; `convert` and `export` call check_new_dir() on their destination. Each
failure is one PreflightError line naming the key or path.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from msllm.config import Config
from msllm.data.index import open_tokens
from msllm.errors import UserError


class PreflightError(UserError, ValueError):
    pass


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable(path: Path) -> str:
    read_only = os.statvfs(path).f_flag & os.ST_RDONLY
    return f"{path} is {'on a read-only file system' if read_only else 'not writable'}"


def _creatable_dir(path: Path, what: str) -> None:
    """`path` is a directory, or can be made one (mkdir -p) by this process."""
    fix = f"set {what} to a directory you can write"
    if path.exists():
        if not path.is_dir():
            raise PreflightError(f"{what}: {path} is a file, not a directory; {fix}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PreflightError(f"{what}: {_unwritable(path)}; {fix}")
        return
    base = _existing_ancestor(path.absolute().parent)
    if not base.is_dir():
        raise PreflightError(f"{what}: cannot create {path}: {base} is a file, not a directory; {fix}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise PreflightError(f"{what}: cannot create {path}: {_unwritable(base)}; {fix}")


def make_dir(path: Path, what: str) -> None:
    """mkdir -p, where the permission checks above cannot see the refusal (root on /sys, /proc)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PreflightError(f"{what}: cannot create {path} ({e.strerror}); set {what} to a directory "
                             f"you can write") from None


def check_new_dir(path: str | Path, force: bool, what: str) -> None:
    """A destination dir that is written under a temporary name beside it: its parent must exist
    and be writable, and it may exist only if it will be replaced (--force)."""
    path = Path(path)
    if path.exists() and not force:
        raise PreflightError(f"{path}: already exists (--force replaces it)")
    parent = path.absolute().parent
    if not parent.is_dir():
        state = "is a file, not a directory" if parent.exists() else "does not exist"
        raise PreflightError(f"{what} {path}: parent {parent} {state}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PreflightError(f"{what} {path}: parent {parent} is not writable")


def check_train(cfg: Config, resume: bool = False) -> None:
    """Everything about a train config that can be known before building: paths, tokenizer, memory."""
    d, t = cfg.data, cfg.train
    world = os.environ.get("RANK_SIZE", "1")
    if world not in ("", "1") and "MS_SCHED_HOST" not in os.environ:  # msrun exports MS_SCHED_HOST
        raise PreflightError(f"RANK_SIZE={world} is set but msrun did not start this process: run "
                             f"`msllm launch --nproc {world} -- train ...`, or unset RANK_SIZE for one process")
    p = cfg.parallel
    if t.device == "cpu":
        layout = [k for k, on in (("tp", p.tp > 1), ("pp", p.pp > 1), ("micro_batches", p.micro_batches > 1),
                                  ("sequence_parallel", p.sequence_parallel), ("sink_size", p.sink_size > 0)) if on]
        if layout:
            raise PreflightError(f"parallel.{layout[0]}: tensor / pipeline layouts and data sink run on Ascend only "
                                 f"(train.device: ascend); on CPU, `msllm launch --nproc N` gives data parallel")
        cores = os.cpu_count() or 1
        if t.threads > 4 * cores:
            raise PreflightError(f"train.threads: {t.threads} is more than 4x this machine's {cores} cores; "
                                 f"use 0 (= all cores) or at most {4 * cores}")
    if not resume:
        _creatable_dir(Path(t.run_dir).expanduser(), "train.run_dir")
    if t.compile_cache:
        _creatable_dir(Path(t.compile_cache).expanduser(), "train.compile_cache")
    if t.init_from and not d.tokenizer:
        raise PreflightError(f"train.init_from: {t.init_from} has no tokenizer.json; set data.tokenizer to the "
                             f"model's tokenizer.json (a new tokenizer would not match its embeddings)")
    if d.path and Path(d.path).suffix == ".jsonl" and not d.tokenizer:
        raise PreflightError(f"data.path: {d.path} holds SFT rows, which need the model's tokenizer: set "
                             f"train.init_from (or data.tokenizer)")
    if d.tokenizer:
        check_tokenizer(Path(d.tokenizer).expanduser(), cfg.model.vocab_size, "data.tokenizer")
    if d.path and (Path(d.path).expanduser() / "index.json").is_file():
        _check_shard_dir(Path(d.path).expanduser(), cfg.model.vocab_size)
    else:
        from msllm.data import corpus  # light: lists files, reads nothing

        from msllm.data.tokenizer import MIN_VOCAB

        corpus.list_files(d.path, d.glob, d.max_bytes)
        if not d.tokenizer and cfg.model.vocab_size < MIN_VOCAB:
            raise PreflightError(f"model.vocab_size: {cfg.model.vocab_size} is below the {MIN_VOCAB} tokens a "
                                 f"byte-level BPE trained on the corpus starts with (256 bytes and EOS); raise "
                                 f"it or give data.tokenizer")
    if t.device == "cpu":
        _check_host_memory(cfg)


def check_tokenizer(path: Path, vocab_size: int, what: str) -> None:
    """A readable tokenizer.json whose vocabulary fits model.vocab_size."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise PreflightError(f"{what}: {path} {'does not exist' if not path.exists() else 'is not a file'}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed files
        reason = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise PreflightError(f"{what}: {path}: not a readable tokenizer.json ({reason})") from None
    if tok.get_vocab_size() > vocab_size:
        raise PreflightError(f"{what}: {path} has {tok.get_vocab_size()} tokens > model.vocab_size {vocab_size}; "
                             f"raise model.vocab_size or use another tokenizer")


def _check_shard_dir(folder: Path, vocab_size: int) -> None:
    try:
        index = json.loads((folder / "index.json").read_text())
        shard_vocab = int(index["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PreflightError(f"data.path: {folder / 'index.json'}: unreadable shard index ({e})") from None
    if shard_vocab > vocab_size:
        raise PreflightError(f"data.path: {folder} has shard vocab_size {shard_vocab} > model.vocab_size "
                             f"{vocab_size}; raise model.vocab_size")
    check_tokenizer(folder / "tokenizer.json", vocab_size, "data.path")
    for split in ("train", "val"):
        open_tokens(folder, split)  # files of the size the index says


def _check_host_memory(cfg: Config) -> None:
    """Refuse a model that cannot fit in this machine's RAM even before activations: fp32 weights,
    gradients and two AdamW moments (16 bytes per parameter; 4 with LoRA), msllm's precomputed
    [max_seq_len, max_seq_len] causal mask, and one micro-batch of logits and their gradient."""
    m, t = cfg.model, cfg.train
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare against
        return
    params = m.num_params()
    per_param = 4 if cfg.lora.rank > 0 else 16  # LoRA: frozen weights, no gradient or moments
    need = per_param * params + 4 * m.max_seq_len ** 2 + 8 * t.batch_size * cfg.data.seq_len * m.vocab_size
    if need > ram:
        raise PreflightError(
            f"model: needs at least {need / 2**30:,.1f} GiB ({params:,} parameters x {per_param} bytes for "
            f"weights{', gradients and AdamW moments' if per_param == 16 else ''}, a {m.max_seq_len}x"
            f"{m.max_seq_len} causal mask, logits) but "
            f"this machine has {ram / 2**30:,.1f} GiB; lower model.hidden_size, model.num_layers, "
            f"model.vocab_size, model.max_seq_len or train.batch_size")
