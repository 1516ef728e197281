"""Where training text comes from: the interpreter's own standard library, or user files."""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from msllm.errors import UserError


class DataError(UserError, ValueError):
    pass


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _order_key(rel: str) -> str:
    # A stable pseudo-random order, so a byte cap samples the whole tree, not just 'a*'.
    return hashlib.sha1(rel.encode()).hexdigest()


def list_files(path: str | None, pattern: str, max_bytes: int) -> tuple[Path, list[Path]]:
    """Resolve data.path to (root, files) in a stable order, capped at max_bytes in total."""
    if path is None:
        root = stdlib_root()
        files = [p for p in root.glob(pattern) if "site-packages" not in p.parts and p.is_file()]
    else:
        root = Path(path).expanduser()
        if root.is_file():
            return root.parent, [root]
        if not root.is_dir():
            raise DataError(f"data.path: {path} does not exist; give a text file, a directory or a pretokenized shard dir")
        files = [p for p in root.glob(pattern) if p.is_file()]
    files.sort(key=lambda p: _order_key(str(p.relative_to(root))))
    if not files:
        raise DataError(f"data.path: no files matching {pattern!r} under {root}; set data.glob")
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if max_bytes and total + size > max_bytes and chosen:
            continue
        chosen.append(p)
        total += size
    return root, chosen


def read_text(path: Path) -> str | None:
    """The file's text, or None if it is not UTF-8 text (undecodable, or binary with NUL bytes)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_texts(files: list[Path]) -> tuple[list[str], list[Path]]:
    """(texts of the UTF-8 text files, the files skipped as binary or not UTF-8)."""
    texts, skipped = [], []
    for p in files:
        text = read_text(p)
        if text is None:
            skipped.append(p)
        else:
            texts.append(text)
    return texts, skipped


def fingerprint(root: Path, files: list[Path]) -> str:
    """Names and sizes of the corpus; enough to tell whether a cached shard is stale."""
    h = hashlib.sha1()
    for p in files:
        h.update(f"{p.relative_to(root)}:{p.stat().st_size};".encode())
    return h.hexdigest()
