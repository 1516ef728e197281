"""Where did a non-finite train step go wrong? Re-run it eagerly and name the first Cell.

The compiled step only says that the gradient norm is not finite. A step whose gradients are not
finite skips its update, so the weights still hold what produced it: the failing batch is run
again through the same LossCell in PYNATIVE mode, with the same loss scale, and

  weights    a parameter that is already not finite is named first (nothing after it can be);
  forward    a forward hook on every Cell sees outputs in the order Cells finish: the first Cell
             with a non-finite output is the innermost one where the overflow happened;
  backward   a backward hook on every Cell sees, from the loss towards the embeddings, the gradient
             each Cell passes back: the first non-finite one is where the backward overflowed;
  gradients  else the first parameter whose gradient is not finite (a Cell's weight gradient can
             overflow while the gradient it passes back does not).

The report names step, phase, Cell, layer and tensor with min / max / abs-max of the Cell's inputs
and parameters. It is written to RUN_DIR/nonfinite/report.json, with the batch and weights beside
it through msllm's checkpoint writer (RUN_DIR/nonfinite/checkpoints/step_N: model.safetensors, and
state.json with the config, the batch and the loss scale), and summarised in one line on stderr.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import ops

from msllm import checkpoint
from msllm.config import Config
from msllm.metrics import info
from msllm.train.step import LossCell

REPORT_DIR, REPORT_FILE = "nonfinite", "report.json"


def tensors(value) -> list:
    """The tensors in a Cell's arguments or outputs (nested tuples), in order."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return [value] if isinstance(value, ms.Tensor) else []


def finite(value) -> bool:
    return all(np.isfinite(t.asnumpy()).all() for t in tensors(value) if t.dtype != ms.bool_)


def stats(t) -> dict:
    a = t.asnumpy().astype(np.float64)
    bad = ~np.isfinite(a)
    ok = a[~bad]
    return {"shape": list(a.shape), "dtype": str(t.dtype), "min": float(ok.min()) if ok.size else None,
            "max": float(ok.max()) if ok.size else None, "absmax": float(np.abs(ok).max()) if ok.size else None,
            "nonfinite": int(bad.sum())}


def layer_of(name: str) -> int | None:
    match = re.search(r"layers\.(\d+)", name)
    return int(match.group(1)) if match else None


def finding(phase: str, cell_name: str, cell, tensor: str, inputs) -> dict:
    return {"phase": phase, "cell": cell_name or "model", "type": type(cell).__name__, "layer": layer_of(cell_name),
            "tensor": tensor, "inputs": [stats(t) for t in tensors(inputs)],
            "params": {p.name: stats(p) for p in cell.get_parameters(expand=True)}}


def locate(model, tokens: np.ndarray, scale: float = 1.0) -> dict | None:
    """The first non-finite weight, forward output, backward gradient or parameter gradient of one
    LossCell evaluation on `tokens` [b, s+1], in PYNATIVE mode (the caller sets it); None if all finite."""
    params = model.trainable_params()
    bad = next((p for p in params if not finite(p)), None)
    if bad is not None:
        name = bad.name.rsplit(".", 1)[0]
        cell = dict(model.cells_and_names()).get(name, model)
        return {**finding("weights", name, cell, bad.name, ()), "inputs": []}
    loss_cell = LossCell(model)
    cells = [(name.removeprefix("model."), cell) for name, cell in loss_cell.cells_and_names() if name]
    found = []

    def forward(name):
        def hook(cell, args, out):
            if not found and not finite(out):
                found.append(finding("forward", name, cell, f"{name or 'model'} output", args))
        return hook

    passed = []  # Cells whose backward ran with finite gradients, in order

    def backward(name):
        def hook(cell, grad_input, grad_output):  # MindSpore: grad_input is what the Cell passes back
            if found or finite(grad_input):
                passed.append(name)
            elif finite(grad_output):
                found.append(finding("backward", name, cell, f"gradient {name} passes back", grad_output))
            else:  # it arrived non-finite: the ops between the last finite Cell and this one overflowed
                after = f", already non-finite after {passed[-1]}: the ops between them overflowed" if passed else ""
                found.append(finding("backward", name, cell, f"the gradient into {name}{after}", grad_output))
        return hook

    handles = [cell.register_forward_hook(forward(name)) for name, cell in cells]
    handles += [cell.register_backward_hook(backward(name)) for name, cell in cells]
    try:
        grad_fn = ops.value_and_grad(loss_cell, None, params)
        _, grads = grad_fn(ms.Tensor(tokens, ms.int32), ms.Tensor(scale, ms.float32))
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    for p, g in zip(params, grads):
        if not finite(g):
            name = p.name.rsplit(".", 1)[0]
            cell = dict(model.cells_and_names()).get(name, model)
            return {**finding("gradients", name, cell, f"gradient of {p.name}", ()), "gradient": stats(g)}
    return None


def summary(step: int, found: dict | None) -> str:
    if found is None:
        return f"step {step}: the non-finite step is finite when re-run eagerly (a compiled-graph difference)"
    where = f"{found['cell']} ({found['type']}{'' if found['layer'] is None else ', layer ' + str(found['layer'])})"

    def ranges(items):
        return ", ".join(f"{name}[{s['min']:.3g}, {s['max']:.3g}] absmax {s['absmax']:.3g}" for name, s in items
                         if s["absmax"] is not None)
    inputs = ranges(("", s) for s in found["inputs"])
    params = ranges((name.rsplit(".", 1)[-1], s) for name, s in found["params"].items())
    return (f"step {step}: first non-finite {found['phase']} value at {where}: {found['tensor']}"
            + (f"; inputs {inputs}" if inputs else "") + (f"; {params}" if params else "")
            + (f"; loss scale {found['loss_scale']:g}" if found.get("loss_scale", 1.0) != 1.0 else ""))


def report(run_dir: Path, step: int, model, tokens: np.ndarray, scale: float, cfg: Config,
           accum_steps: int = 1) -> dict:
    """Locate the failure of `step` on its batch (micro-batch by micro-batch), write the report and
    the reproduction checkpoint, print one line; the execution mode is restored afterwards."""
    folder = Path(run_dir) / REPORT_DIR
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        micro = len(tokens) // accum_steps
        found, chunk = None, 0
        for chunk in range(accum_steps):
            found = locate(model, tokens[chunk * micro:(chunk + 1) * micro], scale)
            if found is not None:
                break
    finally:
        ms.set_context(mode=mode)
    result = {"step": step, "micro_batch": chunk, "loss_scale": scale, **(found or {"phase": None})}
    result["summary"] = summary(step, found and result)
    try:
        saved = checkpoint.save(folder, step, model.trainable_params(), [],
                                {"config": cfg.to_dict(), "batch": tokens.tolist(), "loss_scale": scale})
        result["reproduce"] = {"checkpoint": str(saved), "batch": "state.json: batch",
                               "call": "msllm.train.nonfinite.locate(model, batch, loss_scale)"}
    except checkpoint.CheckpointError as e:  # non-finite weights are never saved: the report says which
        result["reproduce"] = {"checkpoint": None, "why": str(e)}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / REPORT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    info(f"non-finite: {result['summary']}; report {folder / REPORT_FILE}")
    return result
