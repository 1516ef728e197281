"""Outputs that are complete or absent: written under a temporary name beside them, then renamed.

    with staged_dir(final, need=nbytes, then="free space and run again") as tmp:
        ...write files into tmp...

When the block completes, every file and directory under tmp is fsynced, manifest.json is written
(manifest=True), tmp is renamed to `final` (a previous `final` is replaced only now) and the parent
is fsynced. Any failure or Ctrl-C inside the block removes tmp and leaves a previous `final` as it
was; a full disk becomes one DiskFullError line naming `final` and the space the output needs.
Every writer of msllm (checkpoints, token shards, convert, export) goes through here. Standard
library only, so interop and graph_opt use it without MindSpore.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

from msllm.errors import UserError

MANIFEST = "manifest.json"


class OutputError(UserError, RuntimeError):
    """An output that cannot be written (it exists, its place is not writable, the disk is full)."""


class DiskFullError(OutputError):
    pass


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, also when a library wraps it in its own error (safetensors: "os error 28"),
    or loses it: numpy's tofile (onnx_ir's external-data writer) reports a short write as
    "N requested and M written" without an errno."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    return ((isinstance(e, OSError) and e.errno in codes)
            or any(f"os error {code})" in str(e) or f"[Errno {code}]" in str(e) for code in codes)
            or (isinstance(e, OSError) and re.fullmatch(r"\d+ requested and \d+ written", str(e)) is not None))


def size_text(n: float) -> str:
    """Bytes in kB / MB / GB, rounded up: a stated need is never below the real one."""
    for unit, scale, digits in (("GB", 1e9, 1), ("MB", 1e6, 1), ("kB", 1e3, 0)):
        if n >= scale or unit == "kB":
            return f"{math.ceil(n / scale * 10 ** digits) / 10 ** digits:.{digits}f} {unit}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """manifest.json: size and sha256 of every file under `folder`, by relative path."""
    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)}
               for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1))
    _fsync(folder / MANIFEST)


def check_manifest(folder: Path) -> str | None:
    """None if every file the manifest lists is there with its size and sha256, else what is wrong.
    A file whose sha256 was checked before and that has not changed since (same inode, size,
    mtime and ctime: any write or rename changes the ctime) is not read again."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    checked, learned = _read_checked(), {}
    for name, want in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        st = path.stat()
        if st.st_size != want["size"]:
            return f"{name} has {st.st_size} bytes, manifest says {want['size']}"
        key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        if checked.get(key) != want["sha256"]:
            if sha256(path) != want["sha256"]:
                return f"{name} checksum mismatch"
            learned[key] = want["sha256"]
    if learned:
        _write_checked({**checked, **learned})
    return None


CHECKED_LIMIT = 1000  # files remembered as checked; the oldest are forgotten first


def cache_root() -> Path:
    """msllm's own cache: $MSLLM_CACHE, default ~/.cache/msllm (built kernels, checked checksums)."""
    return Path(os.environ.get("MSLLM_CACHE", Path.home() / ".cache" / "msllm"))


def _checked_file() -> Path:
    return cache_root() / "checked-sha256.json"


def _read_checked() -> dict[str, str]:
    try:
        return dict(json.loads(_checked_file().read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _write_checked(entries: dict[str, str]) -> None:
    """Best effort (a read-only home only costs the re-hash); several ranks may write at once,
    so each writes its own temporary file and renames it over."""
    path = _checked_file()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(list(entries.items())[-CHECKED_LIMIT:])))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def holds(outer: str | Path, inner: str | Path) -> bool:
    """`outer` is `inner` or one of its parent dirs (os.path.realpath: Path.resolve raises on a symlink loop)."""
    outer, inner = Path(os.path.realpath(outer)), Path(os.path.realpath(inner))
    return outer == inner or outer in inner.parents


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename tmp to final. An old final is moved aside first and removed last, so a crash in
    between leaves one of the two complete, never neither."""
    old = final.with_name(f".{final.name}.old")
    had_old = final.exists() or final.is_symlink()
    if had_old:
        _remove(old)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if had_old:
            os.replace(old, final)
        raise
    if had_old:
        _remove(old)
    _fsync(final.parent)


@contextlib.contextmanager
def staged_dir(final: str | Path, *, need: int, then: str, replace: bool = True, manifest: bool = False,
               sources: tuple = ()):
    """A fresh temporary dir beside `final` (whose parent must exist), put in place when the block
    completes. `need`: the bytes the output takes (for the disk-full message); `then`: what the
    user does after freeing space; replace=False refuses an existing `final` (--force); `sources`:
    inputs that `final` must not be or contain (replacing it would delete them), nor may it hold
    the current directory ("." , "..", "/")."""
    final = Path(final)
    for what, kept in [(f"the input {s}", Path(s)) for s in sources] + [("the current directory", Path.cwd())]:
        if holds(final, kept):
            raise OutputError(f"{final}: holds {what}, which replacing it would delete; choose another destination")
    if not replace and (final.exists() or final.is_symlink()):
        raise OutputError(f"{final}: already exists (--force replaces it)")
    tmp = final.with_name(f".{final.name}.tmp")
    try:  # created inside: a Ctrl-C right after mkdir still removes it
        _remove(tmp)
        try:
            tmp.mkdir()
        except OSError as e:
            if is_disk_full(e):
                raise
            raise OutputError(f"{final}: cannot write here ({e.strerror})") from None
        yield tmp
        for path in _files(tmp):
            _fsync(path)
        if manifest:
            write_manifest(tmp)
        for folder in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
            _fsync(folder)
        _fsync(tmp)
        _put_in_place(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            free = shutil.disk_usage(final.parent).free
            raise DiskFullError(f"{final}: no space left on the device ({size_text(need)} needed, "
                                f"{size_text(free)} free); {then}") from None
        raise
