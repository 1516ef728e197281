"""What an export dir records about itself (export.json): read without loading MindSpore."""
from __future__ import annotations

import json
from pathlib import Path

from graph_opt import ExportError

MANIFEST = "export.json"


def read_manifest(export_dir: Path) -> dict:
    path = Path(export_dir) / MANIFEST
    if not path.exists():
        raise ExportError(f"{export_dir}: not an msllm export (no {MANIFEST}); make one with msllm export")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ExportError(f"{path}: unreadable ({e})") from None


def file_sizes(export_dir: Path) -> dict[str, int]:
    """Bytes of every file under an export dir, by relative path (export.json records them)."""
    return {p.relative_to(export_dir).as_posix(): p.stat().st_size
            for p in sorted(Path(export_dir).rglob("*")) if p.is_file() and p.name != MANIFEST}


def check_sizes(export_dir: Path, manifest: dict) -> None:
    """A missing or truncated file of the export is one line naming it, before any graph loads."""
    for name, size in manifest.get("sizes", {}).items():  # older exports record none
        path = Path(export_dir) / name
        if not path.is_file():
            raise ExportError(f"{path}: missing from the export; export the run again")
        if path.stat().st_size != size:
            raise ExportError(f"{path}: has {path.stat().st_size} bytes, the export wrote {size}; export the run again")
