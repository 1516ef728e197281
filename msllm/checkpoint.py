"""Run checkpoints: safetensors weights + optimizer state + a JSON of train state.

run_dir/checkpoints/step_0000400/
    model.safetensors   model parameters by msllm name (what interop and export read)
    optim.safetensors   AdamW step and moments, loss-scaler state
    state.json          step, data position, config
    strategy_rank_0.ckpt  Ascend with a parallel layout: the parameter strategy (msllm.backends)
    manifest.json       size and sha256 of each file above, written last
Written through msllm.staged (temporary dir, fsync, rename, manifest),
so a crash never leaves a half-written checkpoint that looks complete; on resume the
newest checkpoint whose manifest verifies is used and a corrupt one is skipped.

Training pauses only to copy the state to host memory: a BackgroundWriter writes it in a thread
while the next steps run, one checkpoint at a time.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from msllm.errors import UserError
from msllm.metrics import info
from msllm.staged import check_manifest, staged_dir

MODEL_FILE, OPTIM_FILE, STATE_FILE = "model.safetensors", "optim.safetensors", "state.json"
PREFIX = "step_"


class CheckpointError(UserError, RuntimeError):
    pass


def params_to_numpy(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def host_copy(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies that training cannot change: asnumpy() is a view of the live parameter."""
    return {name: np.array(a, copy=True) for name, a in arrays.items()}


def load_into(params, arrays: dict[str, np.ndarray], source: str) -> None:
    """Copy arrays into Parameters by name; any missing, unexpected or mis-shaped name is an error."""
    from mindspore import Tensor, dtype_to_nptype  # here, so interop can use this module without MindSpore

    params = {p.name: p for p in params}
    # a LazyArrays knows its shapes from the file's header: no tensor is read to check them
    found = getattr(arrays, "shapes", None) or {name: tuple(a.shape) for name, a in arrays.items()}
    check_shapes({name: tuple(p.shape) for name, p in params.items()}, found, source)
    for name, p in params.items():
        p.set_data(Tensor(arrays[name].astype(dtype_to_nptype(p.dtype), copy=False)))


def check_shapes(expected: dict[str, tuple], found: dict[str, tuple], source: str) -> None:
    """Raise unless `found` has exactly the names of `expected`, each with that shape."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{n} {found[n]} != {expected[n]}" for n in expected if n in found and tuple(found[n]) != expected[n]]
    if missing or unexpected or wrong:
        parts = [f"{what} {_first(names)}" for what, names in
                 (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong)) if names]
        raise CheckpointError(f"{source}: does not match the model: " + "; ".join(parts))


def _first(names: list, most: int = 4) -> str:
    """A short list for a one-line error: the first few names and how many more."""
    more = f", ... {len(names) - most} more" if len(names) > most else ""
    return f"[{', '.join(map(str, names[:most]))}{more}]"


def save(run_dir: Path, step: int, model_params, state_params, state: dict, keep: int = 0,
         add_files: Callable[[Path], object] | None = None, writer: BackgroundWriter | None = None) -> Path:
    """Write checkpoint `step` atomically; then drop all but the newest `keep` (0 = keep all).
    model_params, state_params: Parameters, or name -> array dicts (gathered from data- or expert-parallel ranks).
    add_files(dir): writes more files into the checkpoint, listed in its manifest like the others.
    writer: write in its thread from host copies and return at once (the path it will have).

    Non-finite weights are never saved. A failed or interrupted write leaves no trace, so the
    newest complete checkpoint stays the newest valid one; a full disk is one line."""
    root = Path(run_dir) / "checkpoints"
    weights = model_params if isinstance(model_params, dict) else params_to_numpy(model_params)
    extra = state_params if isinstance(state_params, dict) else params_to_numpy(state_params)
    bad = next((name for name, a in weights.items() if not np.isfinite(a).all()), None)
    if bad is not None:
        raise CheckpointError(f"{root}: not saving step {step}: {bad} has non-finite values; the newest "
                              f"checkpoint is kept. Lower optim.lr or use train.precision=fp32, then --resume")
    final = root / f"{PREFIX}{step:07d}"
    if writer is not None:
        weights, extra = host_copy(weights), host_copy(extra)

    def write() -> Path:
        root.mkdir(parents=True, exist_ok=True)
        need = sum(a.nbytes for a in (*weights.values(), *extra.values()))
        with staged_dir(final, need=need, manifest=True,
                        then="the newest complete checkpoint is kept: free space, then --resume") as tmp:
            save_file(weights, str(tmp / MODEL_FILE))
            save_file(extra, str(tmp / OPTIM_FILE))
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
            if add_files is not None:
                add_files(tmp)
        if keep:
            for old in list_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    if writer is None:
        return write()
    writer.submit(step, write)
    return final


@dataclass
class Written:
    """How one background write ended."""
    step: int
    path: Path | None          # None: not written
    seconds: float             # the write, in its thread
    error: BaseException | None = None


class BackgroundWriter:
    """Writes checkpoints in a thread, one at a time: submit() waits for the previous write first,
    so two writes never overlap and at most one host copy of the state is pending besides the
    one being made. A write that fails (a full disk) is reported by done()/wait(), not raised in
    the thread; the previous checkpoint stays the newest that verifies. The thread is not a daemon:
    a run that ends or fails in between still finishes the write it started."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._result: Written | None = None   # set by the thread
        self._ended: list[Written] = []       # collected by the training thread, not yet reported

    def submit(self, step: int, write: Callable[[], Path]) -> None:
        self._collect()

        def run():
            t0 = time.perf_counter()
            try:
                self._result = Written(step, write(), time.perf_counter() - t0)
            except Exception as e:  # reported in the training thread
                self._result = Written(step, None, time.perf_counter() - t0, e)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}")
        self._thread.start()

    def done(self) -> list[Written]:
        """The writes that ended since the last call (does not wait)."""
        if self._thread is not None and not self._thread.is_alive():
            self._collect()
        ended, self._ended = self._ended, []
        return ended

    def wait(self) -> list[Written]:
        """Wait for the write in flight; then done()."""
        self._collect()
        return self.done()

    def _collect(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._ended.append(self._result)
            self._thread = self._result = None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint dirs of a run, oldest first (temporary dirs excluded)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir()) if root.is_dir() else []


def latest(path: Path) -> Path:
    """The newest checkpoint of a run that verifies, or a checkpoint dir given directly (which must verify)."""
    path = Path(path)
    if (path / MODEL_FILE).exists():  # a checkpoint dir given directly is verified like any other
        problem = check_manifest(path)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}; this checkpoint is damaged or incomplete: use another "
                                  f"checkpoint of the run, or convert / train it again")
        return path
    candidates = list_checkpoints(path)
    if not candidates:
        raise CheckpointError(f"{path}: no checkpoint found (expected {path}/checkpoints/{PREFIX}*)")
    corrupt = []
    for ckpt in reversed(candidates):
        problem = check_manifest(ckpt)
        if problem is None:
            for name, why in corrupt:
                info(f"warning: skipping corrupt checkpoint {name}: {why}")
            return ckpt
        corrupt.append((ckpt.name, problem))
    raise CheckpointError(f"{path}: all {len(candidates)} checkpoints are corrupt (newest: {corrupt[0][0]}: "
                          f"{corrupt[0][1]}); train again or restore the run from a backup")


def read_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path}: not an msllm train state (needs an integer 'step' and a 'config' object)")
    return state


def load_arrays(path: Path):
    """name -> array, read when looked up (converted checkpoints may be bf16: widened to fp32,
    exactly); `with load_arrays(path) as arrays:` closes the file after the block."""
    from msllm.safetensors_reader import read_arrays

    return read_arrays(path)


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


def read_checkpoint(ckpt: str | Path):
    """(config, checkpoint dir, train state) of a full model, from a run dir or a checkpoint dir,
    without loading the weights."""
    from msllm.config_file import config_from_dict
    from msllm.params import param_shapes
    from msllm.train.compat import stored_shapes

    path = latest(Path(ckpt))
    state = read_state(path)
    cfg = config_from_dict(state["config"], str(path / STATE_FILE))
    if cfg.lora.rank > 0:
        raise CheckpointError(f"{path}: holds LoRA adapters only; `msllm lora merge {ckpt} OUT` makes a full "
                              f"checkpoint of base + adapters")
    check_shapes(param_shapes(cfg.model), stored_shapes(path / MODEL_FILE), str(path))  # from the header
    return cfg, path, state


def load_model(ckpt: str | Path):
    """(config, eval-mode model, checkpoint dir, train state) from a run dir or a checkpoint dir."""
    from msllm.models.decoder import Decoder

    cfg, path, state = read_checkpoint(ckpt)
    model = Decoder(cfg.model)
    with load_arrays(path / MODEL_FILE) as arrays:
        load_into(model.trainable_params(), arrays, str(path))
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
