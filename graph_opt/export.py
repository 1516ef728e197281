"""msllm export: a trained run -> MindIR or ONNX graphs for deployment, verified before they are kept.

OUT/ is assembled under a temporary name next to it (msllm.staged) and renamed into place only
after the files reload and match the msllm model, so a failure never leaves a half-written export.
Each format writes two graphs:
  model           input_ids [batch, seq] -> logits [batch, seq, vocab] fp32
  cached          input_ids [batch, seq], the caches (ModelConfig.caches: keys, values [layers, batch,
                  kv_heads, max_len, head_dim]; sliding layers' ring_keys, ring_values of at most their
                  window's slots; a hybrid's Gated DeltaNet states and conv windows), start [1], pad [batch]
                  -> logits [batch, vocab] of the last token and the caches with slots start .. start+seq-1
                  written (msllm.inference.CachedForward): prefill, and decode with seq = 1, so generation
                  loads one graph and one copy of the weights. A hybrid's MindIR is this graph alone, of
                  one token per call (write_mindir)
ONNX writes model.onnx and cached.onnx and their weights once, as external data both point at
(weights.onnx.data); with --embed-weights each graph file carries its own copy instead
(self-contained files, up to protobuf's 2 GB). MindIR writes model_graph.mindir and cached_graph.mindir,
each with its weights in MindSpore's external-data layout (<name>_variables/), the two weight
files one hard link.
  export.json     format, dtype, config, files (by kind: model, prefill, decode), file sizes, the
                  caches the cached graph takes (by name), tolerance, measured diffs, timings
  tokenizer.json    the run's tokenizer (its EOS ids and chat template are in export.json), so the
                    export dir is all `msllm generate` needs
Batch, sequence and cache length are dynamic in both formats; layers, heads, head_dim and
vocab are fixed by the model. input_ids are int32 in MindIR (msllm's dtype), int64 in ONNX.
"""
from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from graph_opt import ExportError
from graph_opt.manifest import MANIFEST, file_sizes
from msllm.staged import size_text, staged_dir

FORMATS = ("mindir", "onnx")
DTYPES = ("fp32", "fp16")
# Verification passes when max|exported - msllm fp32| <= TOLERANCE[dtype] * max(1, max|msllm logits|).
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}
VERIFY_SHAPES = ((2, 5), (1, 11))  # (batch, seq): two batches and lengths run through one file
DECODE_STEPS = 3                   # the last tokens of the longest case are fed one at a time
ONNX_DATA = "weights.onnx.data"
PROTOBUF_LIMIT = 2**31 - 2**26     # a ModelProto must stay under 2 GiB; keep 64 MiB for the graph itself
HYBRID_MINDIR_TOKENS = 1           # tokens per call of a hybrid's MindIR cached graph (write_mindir)


def verification_inputs(vocab_size: int, max_seq_len: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, (b, min(s, max_seq_len))).astype(np.int32) for b, s in VERIFY_SHAPES]


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - b).max())


def verify_graph(export_dir: Path, manifest: dict, graph: str, inputs: list[np.ndarray],
                 references: list[np.ndarray], log) -> dict[str, float]:
    """Max-abs logit differences of one exported graph, in its own worker process (a loaded graph's
    memory is not handed back to the OS, so the next one would add to it). "model": every input
    through the model graph. "cached": prefill + one-token decode steps with the cache, on the
    first input as prompts of different lengths (left padding) and on the last as one prompt."""
    from graph_opt.runtime import export_engine
    from msllm import device

    device.setup("cpu", "pynative")
    engine = export_engine(export_dir, manifest)
    if graph == "model":
        return {f"model b{ids.shape[0]} s{ids.shape[1]}": max_abs(engine.logits(ids), ref)
                for ids, ref in zip(inputs, references)}
    diffs = {}
    for ids, ref in ((inputs[0], references[0]), (inputs[-1], references[-1])):
        b, s = ids.shape
        lengths = [max(1, s - DECODE_STEPS - row) for row in range(b)]
        worst = max_abs(engine.start([ids[r, :n].tolist() for r, n in enumerate(lengths)], DECODE_STEPS),
                        ref[np.arange(b), np.array(lengths) - 1])
        for k in range(DECODE_STEPS):
            at = np.minimum(np.array(lengths) + k, s - 1)
            worst = max(worst, max_abs(engine.step(ids[np.arange(b), at].tolist()), ref[np.arange(b), at]))
        diffs[f"prefill b{b} lengths {lengths} + {DECODE_STEPS} decode steps"] = worst
    return diffs


def to_half(model) -> None:
    """fp16 compute with fp16 weights stored in the file (half the size); norm weights stay fp32
    (they scale fp32 statistics), as do a Gated DeltaNet layer's decay parameters (fp32 maths), and
    RoPE rows are computed in fp32 from positions, then cast."""
    import mindspore as ms

    for p in model.trainable_params():
        if not p.name.endswith(("norm.weight", "A_log", "dt_bias")):
            p.set_data(p.astype(ms.float16))
    model.compute_dtype = ms.float16


@contextlib.contextmanager
def external_weights():
    """ms.export in MindSpore's layout for models over 1 GB whatever the size: the graph file plus
    the weights written one tensor at a time to <name>_variables/. The in-file layout copies every
    weight into the protobuf and again into its serialised bytes (export peak RSS ~3x the model).
    The 1 GB switch is a module constant of mindspore.train.serialization; without it (another
    MindSpore) export falls back to the in-file layout, which loads the same way."""
    from mindspore.train import serialization

    threshold = getattr(serialization, "TOTAL_SAVE", None)
    serialization.TOTAL_SAVE = -1
    try:
        yield
    finally:
        if threshold is None:
            del serialization.TOTAL_SAVE
        else:
            serialization.TOTAL_SAVE = threshold


def link_identical(first: Path, second: Path) -> None:
    """Files under `second` byte-identical to the same path under `first` become hard links to it."""
    for path in sorted(p for p in second.rglob("*") if p.is_file()):
        twin = first / path.relative_to(second)
        if twin.is_file() and twin.stat().st_size == path.stat().st_size and filecmp.cmp(twin, path, shallow=False):
            path.unlink()
            try:
                os.link(twin, path)
            except OSError:  # no hard links here: keep a copy
                shutil.copyfile(twin, path)


def mindir_file(tmp: Path, name: str) -> str:
    """The graph file ms.export wrote for `name`: <name>_graph.mindir (external weights) or <name>.mindir."""
    return f"{name}_graph.mindir" if (tmp / f"{name}_graph.mindir").is_file() else f"{name}.mindir"


def write_mindir(model, dtype: str, tmp: Path, log) -> dict[str, str]:
    """Two graphs via ms.export (GRAPH_MODE) with None for every dynamic dimension: the model, and
    the cached forward that serves prefill and decode (one graph and one copy of the weights in
    memory for generation). A hybrid writes the cached forward alone, of one token per call
    (HYBRID_MINDIR_TOKENS): the chunked rule's loop over chunks follows the sequence length, which a
    graph of dynamic length cannot; with one token it is the recurrent step, and prefill feeds the
    prompt through it token by token."""
    import mindspore as ms

    from msllm.inference import CachedForward

    cfg = model.cfg
    ms.set_context(mode=ms.GRAPH_MODE)
    if dtype == "fp16":
        to_half(model)
    ids = ms.Tensor(shape=[None, None], dtype=ms.int32)
    caches = [ms.Tensor(shape=list(shape), dtype=ms.float16 if dtype == "fp16" else ms.float32)
              for shape in cfg.cache_shapes(None, None)]  # batch and length dynamic
    where = (ms.Tensor(shape=[1], dtype=ms.int32), ms.Tensor(shape=[None], dtype=ms.int32))  # start, pad
    if cfg.hybrid:
        one_token = ms.Tensor(shape=[None, HYBRID_MINDIR_TOKENS], dtype=ms.int32)
        graphs = {"cached": (CachedForward(model), one_token, *caches, *where)}
    else:
        graphs = {"model": (model, ids), "cached": (CachedForward(model), ids, *caches, *where)}
    with external_weights():
        for name, (cell, *inputs) in graphs.items():
            ms.export(cell, *inputs, file_name=str(tmp / name), file_format="MINDIR")
            log(f"wrote {mindir_file(tmp, name)}")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cached_file = mindir_file(tmp, "cached")
    files = {"prefill": cached_file, "decode": cached_file}
    if "model" in graphs:
        link_identical(tmp / "model_variables", tmp / "cached_variables")
        files["model"] = mindir_file(tmp, "model")
    return files


def write_onnx(cfg, arrays: dict[str, np.ndarray], dtype: str, tmp: Path, external_data: bool, log) -> dict[str, str]:
    """Build, clean up, save and check the graphs. With external data the weights are written
    once, by the first graph, and the other points at the same file."""
    import onnx
    import onnx_ir as ir

    from graph_opt.onnx_decoder import GRAPHS, build_graph
    from graph_opt.onnx_passes import clean_up, describe

    shared = None  # initializer name -> its bytes in ONNX_DATA
    for kind in GRAPHS:
        model = build_graph(cfg, arrays, kind, dtype)
        log(f"onnx clean-up {kind}: {describe(*clean_up(model))}")
        path = tmp / f"{kind}.onnx"
        if not external_data:
            ir.save(model, path)
        elif shared is None:  # the first graph writes the weights
            ir.save(model, path, external_data=ONNX_DATA)
            shared = {name: value.const_value for name, value in ir.load(path).graph.initializers.items()
                      if isinstance(value.const_value, ir.ExternalTensor)}
        else:  # the others point at the same bytes: the checkpoint's parameters (a constant the optimizer
            for name, value in model.graph.initializers.items():  # folded is named per graph, not shared)
                if name in shared and name in arrays:
                    value.const_value = shared[name]
            ir.save(model, path)
        onnx.checker.check_model(str(path), full_check=True)
        log(f"wrote {path.name}: onnx.checker ok")
    return {"model": "model.onnx", "prefill": "cached.onnx", "decode": "cached.onnx"}


def write_graphs(ckpt_dir: Path, fmt: str, dtype: str, external_data: bool, tmp: Path,
                 inputs: list[np.ndarray], log) -> tuple[dict[str, str], float, list[np.ndarray]]:
    """In the export's worker process: load the model, compute the reference logits (fp32, before
    any cast), write the graphs to tmp. Returns (files, seconds writing, references)."""
    import mindspore as ms

    from msllm import device
    from msllm.checkpoint import load_model

    device.setup("cpu", "pynative")
    cfg, model, _, _ = load_model(ckpt_dir)
    references = [model(ms.Tensor(ids)).asnumpy() for ids in inputs]
    started = time.perf_counter()
    if fmt == "mindir":
        files = write_mindir(model, dtype, tmp, log)
    else:
        files = write_onnx(cfg.model, {p.name: p.asnumpy() for p in model.trainable_params()}, dtype, tmp,
                           external_data, log)
    return files, time.perf_counter() - started, references


def export(ckpt: str | Path, fmt: str, out: str | Path, dtype: str = "fp32", embed_weights: bool = False,
           force: bool = False, log=print) -> dict:
    """Export a run (or checkpoint dir) to OUT; returns the manifest. Raises ExportError / CheckpointError.
    Worker processes write the graphs and verify each: MindSpore keeps the memory of a graph it
    exported or loaded until the process ends, so each stage starts from an empty heap and this
    process never imports MindSpore."""
    from msllm import chat
    from msllm.checkpoint import find_tokenizer, read_checkpoint
    from msllm.data.tokenizer import load_tokenizer
    from msllm.isolated import run_isolated

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out = Path(out)
    cfg, ckpt_dir, state = read_checkpoint(ckpt)
    nbytes = cfg.model.num_params() * (2 if dtype == "fp16" else 4)
    if embed_weights and fmt != "onnx":
        raise ExportError("--embed-weights: only for --format onnx (MindIR keeps its weights in <name>_variables/)")
    if embed_weights and nbytes > PROTOBUF_LIMIT:
        raise ExportError(f"--embed-weights: {size_text(nbytes)} of weights do not fit in one ONNX file (protobuf's "
                          f"2 GB limit); export without it (the weights go to {ONNX_DATA})")
    # Serialising a graph with its weights inside holds two more copies of them (docs/export.md,
    # Memory), so ONNX weights are external unless asked.
    external_data = fmt == "onnx" and not embed_weights
    # ONNX: two graphs sharing one weights file or holding a copy each; MindIR: two weight files
    # (linked into one where the file system allows). Graph files take ~0.2 MB a layer each.
    tokenizer = find_tokenizer(ckpt_dir, state)
    need = (nbytes * (1 if external_data else 2) + (cfg.model.num_layers + 16) * 2**20
            + (tokenizer.stat().st_size if tokenizer is not None else 0))
    with staged_dir(out, need=need, replace=force, sources=(ckpt_dir,),
                    then="free space or choose another --out, then export again") as tmp:
        inputs = verification_inputs(cfg.model.vocab_size, cfg.model.max_seq_len)
        files, export_seconds, references = run_isolated(write_graphs, ckpt_dir, fmt, dtype, external_data, tmp,
                                                         inputs, log=log, what=f"export to {out}")
        manifest = {"format": fmt, "dtype": dtype, "checkpoint": str(ckpt_dir), "step": state.get("step"),
                    "files": files, "sizes": file_sizes(tmp), "config": cfg.to_dict(),
                    "caches": list(cfg.model.cache_names()),
                    "export_seconds": round(export_seconds, 3)}
        if fmt == "mindir" and cfg.model.hybrid:  # the cached graph's fixed tokens per call (write_mindir)
            manifest["tokens_per_call"] = HYBRID_MINDIR_TOKENS

        diffs = {}
        for graph in ("model", "cached") if "model" in files else ("cached",):
            diffs.update(run_isolated(verify_graph, tmp, manifest, graph, inputs, references, log=log,
                                      what=f"verifying the {graph} graph"))
        bound = TOLERANCE[dtype] * max(1.0, max(float(np.abs(r).max()) for r in references))
        for what, diff in diffs.items():
            log(f"verify {fmt} {what}: max|diff| {diff:.3g}")
        worst = max(diffs.values())
        if not worst <= bound:  # also catches NaN
            raise ExportError(f"verification failed: max|diff| {worst:.3g} > tolerance {bound:.3g}; nothing written")
        log(f"verified: max|diff| {worst:.3g} <= tolerance {bound:.3g} ({TOLERANCE[dtype]:g} x max(1, max|logits|))")
        manifest.update(max_abs_diff=diffs, tolerance=bound)
        if tokenizer is not None:  # with the EOS ids and chat template generate needs
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
            conventions = chat.read(ckpt_dir, state.get("hf_config"), load_tokenizer(tokenizer))
            manifest["text"] = dataclasses.asdict(conventions)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    log(f"exported {fmt} ({dtype}) in {export_seconds:.1f}s to {out}")
    return manifest
