"""Run checkpoints: safetensors weights + optimizer state + a JSON of train state.

run_dir/checkpoints/step_0000400/
    model.safetensors   model parameters by msllm name (what interop and export read)
    optim.safetensors   AdamW step and moments, loss-scaler state
    state.json          step, data position, config
    manifest.json       size and sha256 of each file above, written last
Each file is fsynced, the dir is written under a temporary name and renamed into place,
so a crash never leaves a half-written checkpoint that looks complete; on resume the
newest checkpoint whose manifest verifies is used and a corrupt one is skipped.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from msllm.errors import UserError
from msllm.metrics import info

MODEL_FILE, OPTIM_FILE, STATE_FILE, MANIFEST = "model.safetensors", "optim.safetensors", "state.json", "manifest.json"
PREFIX = "step_"


class CheckpointError(UserError, RuntimeError):
    pass


def params_to_numpy(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def load_into(params, arrays: dict[str, np.ndarray], source: str) -> None:
    """Copy arrays into Parameters by name; any missing, unexpected or mis-shaped name is an error."""
    from mindspore import Tensor, dtype_to_nptype  # here, so interop can use this module without MindSpore

    params = {p.name: p for p in params}
    missing = sorted(set(params) - set(arrays))
    unexpected = sorted(set(arrays) - set(params))
    shapes = [f"{n} {arrays[n].shape} != {tuple(params[n].shape)}" for n in params
              if n in arrays and tuple(arrays[n].shape) != tuple(params[n].shape)]
    if missing or unexpected or shapes:
        parts = [f"{what} {_first(names)}" for what, names in
                 (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)) if names]
        raise CheckpointError(f"{source}: does not match the model: " + "; ".join(parts))
    for name, p in params.items():
        p.set_data(Tensor(arrays[name].astype(dtype_to_nptype(p.dtype), copy=False)))


def _first(names: list, most: int = 4) -> str:
    """A short list for a one-line error: the first few names and how many more."""
    more = f", ... {len(names) - most} more" if len(names) > most else ""
    return f"[{', '.join(map(str, names[:most]))}{more}]"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1))
    _fsync(path)


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC, also when a library wraps it (safetensors raises its own error naming os error 28)."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or f"os error {errno.ENOSPC})" in str(e)


def write_manifest(folder: Path, names: list[str]) -> None:
    """manifest.json: size and sha256 of each named file, written last and fsynced with the dir."""
    _write_json(folder / MANIFEST, {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
                                    for name in names})
    _fsync(folder)


def save(run_dir: Path, step: int, model_params, state_params, state: dict, keep: int = 0) -> Path:
    """Write checkpoint `step` atomically; then drop all but the newest `keep` (0 = keep all).

    Non-finite weights are never saved. A failed or interrupted write removes its temporary dir,
    so the newest complete checkpoint stays the newest valid one; a full disk is one line."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"{PREFIX}{step:07d}", root / f".tmp_{PREFIX}{step:07d}"
    weights, extra = params_to_numpy(model_params), params_to_numpy(state_params)
    bad = next((name for name, a in weights.items() if not np.isfinite(a).all()), None)
    if bad is not None:
        raise CheckpointError(f"{root}: not saving step {step}: {bad} has non-finite values; the newest "
                              f"checkpoint is kept. Lower optim.lr or use train.precision=fp32, then --resume")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(weights, str(tmp / MODEL_FILE))
        save_file(extra, str(tmp / OPTIM_FILE))
        _write_json(tmp / STATE_FILE, {"step": step, **state})
        for name in (MODEL_FILE, OPTIM_FILE):
            _fsync(tmp / name)
        write_manifest(tmp, [MODEL_FILE, OPTIM_FILE, STATE_FILE])
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            need = sum(a.nbytes for a in (*weights.values(), *extra.values()))
            raise CheckpointError(f"{root}: no space left on the device writing step {step} (a checkpoint needs "
                                  f"about {need / 1e6:.1f} MB); the newest complete checkpoint is kept: free space, "
                                  f"then --resume") from None
        raise
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint dirs of a run, oldest first (temporary dirs excluded)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir()) if root.is_dir() else []


def verify(ckpt_dir: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    try:
        manifest = json.loads((ckpt_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    for name, want in manifest.items():
        path = ckpt_dir / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {want['size']}"
        if _sha256(path) != want["sha256"]:
            return f"{name} checksum mismatch"
    return None


def latest(path: Path) -> Path:
    """The newest checkpoint of a run that verifies, or a checkpoint dir given directly (which must verify)."""
    path = Path(path)
    if (path / MODEL_FILE).exists():  # a checkpoint dir given directly is verified like any other
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}; this checkpoint is damaged or incomplete: use another "
                                  f"checkpoint of the run, or convert / train it again")
        return path
    candidates = list_checkpoints(path)
    if not candidates:
        raise CheckpointError(f"{path}: no checkpoint found (expected {path}/checkpoints/{PREFIX}*)")
    for ckpt in reversed(candidates):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        info(f"warning: skipping corrupt checkpoint {ckpt}: {problem}")
    raise CheckpointError(f"{path}: all {len(candidates)} checkpoints are corrupt; see warnings above")


def read_state(ckpt_dir: Path) -> dict:
    try:
        return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{Path(ckpt_dir) / STATE_FILE}: unreadable ({e})") from None


def _has_bf16(path: Path) -> bool:
    """Whether a safetensors file holds bf16 tensors (its JSON header says; unreadable counts as yes)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        return any(isinstance(v, dict) and v.get("dtype") == "BF16" for v in header.values())
    except (OSError, ValueError, OverflowError):
        return True


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """name -> array. bf16 checkpoints (converted ones may be) are read through torch, as numpy
    lacks bf16, and widened to fp32 (exactly); others without importing torch (a faster start)."""
    if not Path(path).exists():
        raise CheckpointError(f"{path}: missing")
    try:
        if not _has_bf16(path):
            from safetensors.numpy import load_file as load_numpy

            return load_numpy(str(path))
        import torch
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    return {name: (t.float() if t.dtype == torch.bfloat16 else t).numpy() for name, t in tensors.items()}


def find_tokenizer(ckpt_dir: Path, state: dict) -> Path | None:
    """The checkpoint's tokenizer.json, or None if it has none.

    Training records an absolute path, conversion a name inside the checkpoint dir; when a
    run dir was moved, its own copy under data/ is used.
    """
    ckpt_dir = Path(ckpt_dir)
    for candidate in (ckpt_dir / state["tokenizer"] if state.get("tokenizer") else None,
                      ckpt_dir.parent.parent / "data" / "tokenizer.json"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def load_model(ckpt: str | Path):
    """(config, eval-mode model, checkpoint dir, train state) from a run dir or a checkpoint dir."""
    from msllm.config import config_from_dict
    from msllm.models.llama import Llama

    path = latest(Path(ckpt))
    state = read_state(path)
    cfg = config_from_dict(state["config"], str(path / STATE_FILE))
    model = Llama(cfg.model)
    load_into(model.trainable_params(), load_arrays(path / MODEL_FILE), str(path))
    model.set_train(False)
    return cfg, model, path, state


def load_run(ckpt: str | Path):
    """(config, model, tokenizer, text conventions: EOS ids, chat template) from a run dir or a checkpoint dir."""
    from msllm import chat
    from msllm.data.tokenizer import load_tokenizer

    cfg, model, path, state = load_model(ckpt)
    tokenizer = find_tokenizer(path, state)
    if tokenizer is None:
        raise CheckpointError(f"{path}: no tokenizer.json (state.json 'tokenizer'); put the model's "
                              f"tokenizer.json in the checkpoint dir to generate text")
    tokenizer = load_tokenizer(tokenizer)
    return cfg, model, tokenizer, chat.read(path, state.get("hf_config"), tokenizer)
