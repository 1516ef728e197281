"""The conversion engine: source checkpoint -> family table -> destination layout, one tensor at a time.

1. Open the source (layouts.open_source): msllm config, architecture, a lazy tensor reader.
2. Plan: expand the family table for this model and check that the source holds exactly the
   tensors the table expects, with the expected shapes. Otherwise raise one line naming the file
   and the tensors, before anything is written.
3. Stream: for each msllm tensor, read its source part(s), join / transpose, cast, split into
   the destination part(s), append them to the open file. The destination's headers are written
   first from the plan, so at any time we hold a few copies of one tensor, never the model.
4. Write config / state files; all of it goes into a temporary dir beside the destination that is
   renamed into place at the end (msllm.staged; an msllm destination also gets manifest.json).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from interop import InteropError
from interop.hf_config import to_hf_config
from interop.layouts import HF_CONFIG, MF_CONFIG, WRITERS, Source, hf_index, open_source, weight_files
from interop.maps import table_for
from interop.table import LAYOUTS, Entry, entries
from msllm import checkpoint
from msllm.errors import names_line
from msllm.safetensors_reader import TensorInfo
from msllm.staged import holds, staged_dir

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_SHARD_BYTES = 5 << 30


@dataclasses.dataclass
class Result:
    path: Path
    source_layout: str
    layout: str
    tensors: int
    bytes: int
    seconds: float


def plan(source: Source, to: str | None = None) -> list[Entry]:
    """The family table's entries for this model (converting to `to`), after checking the source holds
    exactly those tensors. (hf_config.architecture() has already refused architectures without a table.)"""
    table = table_for(source.architecture, source.layout, to or source.layout)
    rows = entries(table, source.config.model)
    want = {}
    for e in rows:
        want.update(e.stored[source.layout].shapes(e))
    have = source.reader.infos
    ignore = table.ignore.get(source.layout, [])
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want and not any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    misshaped = [f"{n} {list(have[n].shape)} != {list(want[n])}" for n in want
                 if n in have and have[n].shape != want[n]]
    problems = [f"{what} {names_line(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)) if names]
    if problems:
        raise InteropError(f"{source.reader.path}: does not match {source.architecture} with this config "
                           f"({source.layout} layout): " + "; ".join(problems))
    return rows


def msllm_tensors(rows: list[Entry], layout: str, reader):
    """(entry, msllm tensor) for each entry, read from a checkpoint stored in `layout` (an entry of
    joined msllm parameters gives them joined: see msllm_parameters)."""
    for e in rows:
        yield e, e.stored[layout].gather(e, reader.read)


def msllm_parameters(rows: list[Entry], layout: str, reader):
    """(msllm parameter name, tensor) for every parameter, read from a checkpoint stored in `layout`."""
    for e, t in msllm_tensors(rows, layout, reader):
        yield from e.stored["msllm"].scatter(e, t)


def parameter_names(rows: list[Entry]) -> list[str]:
    """The msllm parameter names of `rows`, in file order."""
    return [name for e in rows for name in e.stored["msllm"].shapes(e)]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def convert(src: str | Path, dst: str | Path, to: str | None = None, dtype: str = "keep", mf_format: str = "ckpt",
            max_shard_bytes: int = MAX_SHARD_BYTES, max_seq_len: int | None = None, force: bool = False,
            progress: bool = True) -> Result:
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if holds(src, dst.parent):
        raise InteropError(f"{dst}: destination must not be inside the source")
    source = open_source(src, max_seq_len)
    to = to or ("hf" if source.layout == "msllm" else "msllm")
    if to not in LAYOUTS:
        raise InteropError(f"unknown destination layout {to!r} (expected {', '.join(LAYOUTS)})")
    if to == "mindformers":
        _refuse_what_mindformers_computes_differently(source)
    rows = plan(source, to)
    if any(e.stored[to] is None for e in rows):
        raise InteropError(f"{source.path}: msllm has no {to} layout for {source.architecture} (MindFormers names "
                           f"are mapped for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3; MindFormers 1.9 "
                           f"has no Gemma 3, Phi-3 or Mixtral)")

    def out_dtype(e: Entry) -> torch.dtype:
        first = next(iter(e.stored[source.layout].shapes(e)))
        return source.reader.infos[first].dtype if dtype == "keep" else DTYPES[dtype]

    dtypes = {e.name: out_dtype(e) for e in rows}
    infos = {name: TensorInfo(shape, dtypes[e.name]) for e in rows for name, shape in e.stored[to].shapes(e).items()}
    files = weight_files(to, infos, mf_format, max_shard_bytes)
    written = sum(i.nbytes for i in infos.values())
    try:
        with staged_dir(dst, need=written, replace=force, manifest=to == "msllm", sources=(src,),
                        then="free space or choose another destination, then convert again") as tmp:
            _stream(rows, dtypes, source, to, files, tmp, progress)
            _write_metadata(source, to, files, tmp, dtypes[rows[0].name])
    finally:
        source.reader.close()
    return Result(dst, source.layout, to, len(infos), written, time.perf_counter() - start)


def _refuse_what_mindformers_computes_differently(source: Source) -> None:
    """MindFormers 1.9's Qwen3 and Qwen3-MoE mark sliding_window unused, and its Qwen3-MoE builds every
    layer MoE (mlp_only_layers / decoder_sparse_step unused); its DeepSeek-V3 always builds an output layer
    of its own, always de-interleaves the RoPE dims and scores an expert group by its best
    experts_per_token // topk_groups experts (transformers: best 2): such models would compute differently there."""
    why = _what_mindformers_computes_differently(source)
    if why:
        raise InteropError(f"{source.path}: {why}: it would compute differently there; convert to hf or msllm "
                           f"instead")


def _what_mindformers_computes_differently(source: Source) -> str | None:
    m = source.config.model
    name = {"Qwen3ForCausalLM": "Qwen3", "Qwen3MoeForCausalLM": "Qwen3-MoE"}.get(source.architecture)
    sliding = m.layer_kinds().count("sliding")
    dense = m.mlp_kinds().count("dense") if m.num_experts else 0
    if source.architecture == "DeepseekV3ForCausalLM":
        if m.tie_embeddings:
            return ("its output layer is tied to the embedding, which MindFormers 1.9's TrainingDeepseekV3ForCausalLM "
                    "builds apart (it ignores tie_word_embeddings)")
        if not m.rope_interleave:
            return "rope_interleave is false, and MindFormers 1.9's MLA always de-interleaves the RoPE dims"
        if m.expert_groups > 1 and m.experts_per_token // m.topk_groups != 2:
            return (f"num_experts_per_tok // topk_group is {m.experts_per_token // m.topk_groups}, and MindFormers "
                    f"1.9 scores an expert group by that many best experts where transformers takes 2")
    elif name and sliding:
        return (f"{sliding} of its layers attend to a sliding window of {m.sliding_window} positions, which "
                f"MindFormers 1.9's {name} ignores (its config marks sliding_window unused)")
    elif name and dense:
        return (f"{dense} of its layers are dense MLPs (mlp_only_layers / decoder_sparse_step), which MindFormers "
                f"1.9's Qwen3-MoE builds as MoE (its config marks both unused)")
    return None


def cast(t: torch.Tensor, dtype: torch.dtype, name: str, path) -> torch.Tensor:
    """t in `dtype`; values a narrower dtype cannot hold (fp16 beyond 65504) are refused, not turned into inf."""
    out = t.to(dtype)
    if out.dtype != t.dtype and t.is_floating_point() and not torch.isfinite(out).all() and torch.isfinite(t).all():
        raise InteropError(f"{path}: {name} has values beyond the {DTYPE_NAMES.get(dtype, dtype)} range (max |x| "
                           f"{t.abs().max().item():.4g}); choose --dtype bf16 or fp32")
    return out


def _stream(rows: list[Entry], dtypes: dict, source: Source, to: str, files, folder: Path, progress: bool) -> None:
    owner = {name: k for k, (_, infos) in enumerate(files) for name in infos}
    total = sum(i.nbytes for _, infos in files for i in infos.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{source.layout} -> {to}",
               disable=None if progress else True, mininterval=0.5)
    writer, current, done = None, -1, 0
    try:
        for e, t in msllm_tensors(rows, source.layout, source.reader):
            for name, part in e.stored[to].scatter(e, cast(t, dtypes[e.name], e.name, source.reader.path)):
                if owner[name] != current:  # files are filled in order: move on to the next one
                    if writer is not None:
                        writer.close()
                    current = owner[name]
                    file_name, infos = files[current]
                    writer = WRITERS[Path(file_name).suffix](folder / file_name, infos)
                writer.write(name, part)
                done += 1
                bar.update(part.numel() * part.element_size())
                bar.set_postfix_str(f"{done}/{len(owner)} tensors", refresh=False)
        writer.close()
    finally:
        bar.close()
        if writer is not None:
            writer.file.close()  # also after a failure: the removed temporary file would hold its space


def _write_metadata(source: Source, to: str, files, folder: Path, dtype: torch.dtype) -> None:
    for path in source.side_files:
        shutil.copyfile(path, folder / path.name)
    if to == "hf":
        write_json(folder / HF_CONFIG, to_hf_config(source.config.model, source.architecture,
                                                    DTYPE_NAMES.get(dtype, str(dtype)), source.hf_config))
        if len(files) > 1:
            write_json(folder / "model.safetensors.index.json", hf_index(files))
    elif to == "mindformers":
        write_json(folder / MF_CONFIG, dataclasses.asdict(source.config.model))
    else:
        tokenizer = "tokenizer.json" if (folder / "tokenizer.json").is_file() else None
        write_json(folder / checkpoint.STATE_FILE, {
            "step": 0, "config": source.config.to_dict(), "tokenizer": tokenizer,
            "hf_architecture": source.architecture, "hf_config": source.hf_config,
            "converted_from": {"path": str(source.path), "layout": source.layout}})
