"""Does a converted checkpoint compute what the Hugging Face model computes?

The HF model (torch) and the msllm model (MindSpore, PYNATIVE) run in fp32 on the same random
tokens. Compared: the output of every decoder layer (the residual stream) and the logits, by

    max_abs = max |msllm - hf|        max_rel = max_abs / max |hf|

(max_rel is relative to the tensor's scale, so it does not blow up where hf is near zero).
A comparison fails when max_rel exceeds the tolerance; the first failing one is named.

Tolerance (on max_rel) by dtype: when both checkpoints store the same dtype their weights are
identical once widened, only fp32 arithmetic order differs: TOLERANCES["fp32"]. When they differ,
the weights differ by the rounding of the lower-precision dtype: that dtype's tolerance.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from interop import InteropError
from interop.convert import msllm_parameters, plan
from interop.layouts import Source, open_source

# Measured max_rel on the 2-layer test models: fp32 3e-7, fp16 5e-4, bf16 4e-3; deeper models
# accumulate more rounding, so the limits leave 10-100x. Mapping bugs measured at layer 0:
# swapped norms 1e-1, interleaved q/k rows 8e-3 (tiny random models attend almost uniformly), so
# a mapping is proven by a same-dtype comparison, where the fp32 limit applies.
TOLERANCES = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}
PRECISION = {torch.float32: "fp32", torch.float64: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
ORDER = ["fp32", "fp16", "bf16"]   # most to least precise


@dataclasses.dataclass
class Report:
    names: list[str]            # "layer 0", ..., "logits"
    max_abs: list[float]
    max_rel: list[float]
    precision: str
    tolerance: float
    tokens: tuple[int, int]

    @property
    def first_failure(self) -> int | None:
        return next((k for k, rel in enumerate(self.max_rel) if not rel <= self.tolerance), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def lines(self) -> list[str]:
        out = [f"{'':8} {'max_abs':>10} {'max_rel':>10}"]
        out += [f"{n:8} {a:10.3e} {r:10.3e}{'  <- exceeds' if not r <= self.tolerance else ''}"
                for n, a, r in zip(self.names, self.max_abs, self.max_rel)]
        k = self.first_failure
        verdict = ("PASS" if k is None else
                   f"FAIL: first divergence at {self.names[k]} (max_rel {self.max_rel[k]:.3e} > {self.tolerance:.0e})")
        out.append(f"{verdict}  [tokens {self.tokens[0]}x{self.tokens[1]}, {self.precision} tolerance "
                   f"max_rel <= {self.tolerance:.0e}]")
        return out


def stored_precision(source: Source) -> str:
    """The dtype holding most of a checkpoint's bytes."""
    weight = Counter()
    for info in source.reader.infos.values():
        weight[PRECISION.get(info.dtype, "fp32")] += info.nbytes
    return weight.most_common(1)[0][0]


def msllm_model(source: Source):
    """An msllm Decoder holding the source's weights, whatever layout they are stored in."""
    from msllm import checkpoint
    from msllm.models.decoder import Decoder

    rows = plan(source)
    # copy=True: own the memory rather than keep the file mappings (interop/formats) alive in the model
    arrays = {name: t.to(torch.float32, copy=True).numpy()
              for name, t in msllm_parameters(rows, source.layout, source.reader)}
    source.reader.close()
    model = Decoder(source.config.model)
    checkpoint.load_into(model.trainable_params(), arrays, str(source.path))
    model.set_train(False)
    return model


@contextlib.contextmanager
def recording(layers, record):
    """While inside, record(output) runs after each layer's forward (torch and MindSpore Cells alike)."""
    hooks = [layer.register_forward_hook(lambda cell, args, out: record(out)) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def msllm_states(model, ids: np.ndarray) -> list[np.ndarray]:
    """Each layer's output, then the logits, of an msllm model run eagerly (PYNATIVE)."""
    import mindspore as ms

    states = []
    # Blocks return (residual stream [batch * seq, hidden], keys, values); compare the stream as HF's
    # [batch, seq, hidden].
    with recording(model.layers, lambda out: states.append(out[0].asnumpy().reshape(ids.shape + (-1,)))):
        logits = model(ms.Tensor(ids, ms.int32)).asnumpy()
    return states + [logits]


def hf_states(model, ids: np.ndarray, states: list):
    """The output of a Hugging Face model (logits; aux_loss of a MoE model with output_router_logits);
    each layer's output is appended to `states`."""
    record = lambda out: states.append((out[0] if isinstance(out, tuple) else out).detach().numpy())  # noqa: E731
    with recording(model.model.layers, record):
        return model(torch.from_numpy(ids).long())


def max_rel(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |got - ref|, that relative to max |ref|)."""
    diff = float(np.abs(np.asarray(got, np.float64) - ref).max())
    return diff, diff / max(float(np.abs(ref).max()), 1e-30)


def run_msllm(source: Source, ids: np.ndarray) -> list[np.ndarray]:
    from msllm import device

    device.setup("cpu", "pynative")
    return msllm_states(msllm_model(source), ids)


def run_hf(hf_dir: Path, ids: np.ndarray) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    states = []
    with torch.no_grad():
        logits = hf_states(model, ids, states).logits.float().numpy()
    return states + [logits]


def same_model(hf: Source, ours: Source) -> None:
    """Refuse a checkpoint of another model than the HF dir (the context may differ)."""
    a, b = hf.config.model, dataclasses.replace(ours.config.model, max_seq_len=hf.config.model.max_seq_len)
    if a != b:
        diff = [f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}" for f in dataclasses.fields(a)
                if getattr(a, f.name) != getattr(b, f.name)]
        raise InteropError(f"{ours.path}: a different model than {hf.path}: {', '.join(diff)}")


def open_hf(hf_dir: str | Path) -> Source:
    hf = open_source(hf_dir)
    if hf.layout != "hf":
        raise InteropError(f"{hf_dir}: --hf must be a Hugging Face model dir (config.json + weights)")
    return hf


def verify(hf_dir: str | Path, ckpt: str | Path, seq_len: int = 32, batch: int = 2, seed: int = 0,
           tolerance: float | None = None) -> Report:
    hf, ours = open_hf(hf_dir), open_source(ckpt)
    same_model(hf, ours)
    a = hf.config.model
    precisions = {stored_precision(hf), stored_precision(ours)}
    precision = max(precisions, key=ORDER.index) if len(precisions) > 1 else "fp32"
    hf.reader.close()
    seq = min(seq_len, a.max_seq_len, ours.config.model.max_seq_len)
    ids = np.random.default_rng(seed).integers(0, a.vocab_size, (batch, seq))
    ref, got = run_hf(Path(hf_dir), ids), run_msllm(ours, ids)
    max_abs, rel = zip(*(max_rel(x, y) for x, y in zip(got, ref)))
    names = [f"layer {k}" for k in range(a.num_layers)] + ["logits"]
    return Report(names, list(max_abs), list(rel), precision,
                  TOLERANCES[precision] if tolerance is None else tolerance, (batch, seq))
