"""Run checkpoints: safetensors weights + optimizer state + a JSON of train state.

run_dir/checkpoints/step_0000400/
    model.safetensors   model parameters by msllm name (what interop and export read)
    optim.safetensors   AdamW step and moments
    state.json          step, data position, config
A checkpoint dir is written under a temporary name and renamed into place, so a crash
never leaves a half-written checkpoint that looks complete. `latest` names the newest.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from mindspore import Tensor, dtype_to_nptype
from safetensors.numpy import load_file, save_file

MODEL_FILE, OPTIM_FILE, STATE_FILE = "model.safetensors", "optim.safetensors", "state.json"


class CheckpointError(RuntimeError):
    pass


def params_to_numpy(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def load_into(params, arrays: dict[str, np.ndarray], source: str) -> None:
    """Copy arrays into Parameters by name; any missing, unexpected or mis-shaped name is an error."""
    params = {p.name: p for p in params}
    missing = sorted(set(params) - set(arrays))
    unexpected = sorted(set(arrays) - set(params))
    shapes = [f"{n} {arrays[n].shape} != {tuple(params[n].shape)}" for n in params
              if n in arrays and tuple(arrays[n].shape) != tuple(params[n].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing {missing}" if missing else "", f"unexpected {unexpected}" if unexpected else "",
                 f"shape mismatch {shapes}" if shapes else ""]
        raise CheckpointError(f"{source}: does not match the model: " + "; ".join(p for p in parts if p))
    for name, p in params.items():
        p.set_data(Tensor(arrays[name].astype(dtype_to_nptype(p.dtype), copy=False)))


def save(run_dir: Path, step: int, model_params, optim_params, state: dict) -> Path:
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp_step_{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(params_to_numpy(model_params), str(tmp / MODEL_FILE))
    if optim_params is not None:
        save_file(params_to_numpy(optim_params), str(tmp / OPTIM_FILE))
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "latest")
    return final


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint dir of a run, or a checkpoint dir given directly."""
    run_dir = Path(run_dir)
    if (run_dir / MODEL_FILE).exists():
        return run_dir
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        raise CheckpointError(f"{run_dir}: no checkpoint found (expected {pointer})")
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / MODEL_FILE).exists():
        raise CheckpointError(f"{path}: checkpoint named by 'latest' is missing {MODEL_FILE}")
    return path


def read_state(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
