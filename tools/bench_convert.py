#!/usr/bin/env python
"""Benchmark `msllm convert` on a generated Llama-shaped HF checkpoint (bf16, sharded safetensors).

    python tools/bench_convert.py                  # ~1 GB
    python tools/bench_convert.py --size-mb 8      # smoke test (what tests/ runs)

Measured, each in a fresh process so peak RSS (VmHWM) is its own:
  raw     a plain sequential read of the same files (8 MiB readinto): the speed limit
  stream  interop.convert.convert(): HF -> msllm, one tensor at a time
  cli     the same through `msllm convert`
  naive   load the whole state dict (safetensors.torch.load_file), rename, save_file
each twice: "cold", the source files evicted from the page cache first (posix_fadvise DONTNEED on
these files only), as when converting a checkpoint that is not in RAM; and "warm", read from the
page cache. Times are the best of --repeat runs (the machine is shared). Goals: stream >= 50% of
raw MB/s, peak RSS <= 3 x largest tensor + 1 GB. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MB = 1e6


def shape(size_mb: float) -> dict:
    """A Llama-like config (GQA 4:1, SwiGLU 2.75x, vocab 16x hidden) with layers filling size_mb of bf16."""
    h = 2048 if size_mb >= 512 else 128
    vocab, ffn, kv = 16 * h, int(2.75 * h), max(64, h // 4)  # at least one 64-wide kv head
    embed, layer = 2 * vocab * h * 2, (2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h) * 2
    layers = max(1, round((size_mb * MB - embed) / layer))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": h // 64,
            "num_key_value_heads": kv // 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def generate(folder: Path, config: dict, shard_mb: int) -> None:
    """Random bf16 weights, in HF's file layout, written with our streaming writer."""
    import torch

    from msllm.safetensors_reader import TensorInfo
    from interop.layouts import hf_index, weight_files
    from interop.maps import FAMILIES
    from interop.table import entries
    from interop.formats.safetensors import SafetensorsWriter
    from interop.layouts import model_config

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    from interop.hf_config import to_model_config
    rows = entries(FAMILIES["LlamaForCausalLM"].table, to_model_config(config, "bench"))
    infos = {e.stored["hf"].name: TensorInfo(e.shape, torch.bfloat16) for e in rows}
    files = weight_files("hf", infos, "ckpt", shard_mb << 20)
    for name, file_infos in files:
        writer = SafetensorsWriter(folder / name, file_infos)
        for tensor_name, info in file_infos.items():
            writer.write(tensor_name, torch.empty(info.shape, dtype=info.dtype).normal_(0, 0.02))
        writer.close()
    if len(files) > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps(hf_index(files)))


def raw_read(folder: Path) -> None:
    buf = bytearray(8 << 20)
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def naive(src: Path, dst: Path) -> None:
    """What a one-off script does: everything in memory, then one save."""
    from safetensors.torch import load_file, save_file

    from interop.layouts import open_source
    from interop.maps import FAMILIES
    from interop.table import entries

    source = open_source(src)
    state = {}
    for path in sorted(src.glob("*.safetensors")):
        state.update(load_file(path))
    rows = entries(FAMILIES[source.architecture].table, source.config.model)
    renamed = {e.name: state.pop(e.stored["hf"].name) for e in rows}
    dst.mkdir()
    save_file(renamed, dst / "model.safetensors")


def peak_rss_mb() -> float:
    """VmHWM: this process's own peak (ru_maxrss would include the parent's RSS at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def evict(folder: Path) -> None:
    """Drop these files (only) from the page cache, so the next read comes from disk."""
    os.sync()
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(mode: str, src: Path, dst: Path) -> None:
    """One measurement in this (fresh) process; prints seconds and peak RSS as JSON."""
    # Imports happen before the clock starts: the timing is the conversion, the RSS includes them.
    import torch  # noqa: F401
    from interop.convert import convert
    if mode == "cli":
        import msllm.cli  # noqa: F401
    rss0 = peak_rss_mb()
    start = time.perf_counter()
    if mode == "raw":
        raw_read(src)
    elif mode == "stream":
        convert(src, dst, progress=False)
    elif mode == "cli":
        from msllm.cli import main
        assert main(["convert", str(src), str(dst)]) == 0
    else:
        naive(src, dst)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "start_rss_mb": rss0}))


def measure(mode: str, cache: str, src: Path, dst: Path, repeat: int) -> dict:
    """Best time of `repeat` fresh-process runs, and the largest peak RSS among them."""
    runs = []
    for _ in range(repeat):
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()  # start every run with no dirty pages from the last one to write back
        if cache == "cold":
            evict(src)
        else:
            raw_read(src)
        proc = subprocess.run([sys.executable, __file__, "_child", mode, str(src), str(dst)], capture_output=True,
                              text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"bench_convert: {mode} failed:\n{proc.stderr[-3000:]}")
        shutil.rmtree(dst, ignore_errors=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        return child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024)
    p.add_argument("--shard-mb", type=int, default=400)
    p.add_argument("--dir", default=None, help="work dir (default: a temp dir, removed afterwards)")
    p.add_argument("--modes", default="raw,stream,cli,naive")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench_convert_"))
    src = work / "hf"
    try:
        if not src.exists():
            generate(src, shape(a.size_mb), a.shard_mb)
        files = list(src.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        from interop.layouts import open_source
        largest = max(i.nbytes for i in open_source(src).reader.infos.values())
        results = {f"{mode} {cache}": measure(mode, cache, src, work / f"out_{mode}", a.repeat)
                   for cache in a.caches.split(",") for mode in a.modes.split(",")}
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    budget = 3 * largest / MB + 1000
    print(f"checkpoint {total / MB:.0f} MB in {len(files)} "
          f"files, largest tensor {largest / MB:.0f} MB, RSS goal <= {budget:.0f} MB")
    print(f"{'run':12} {'seconds':>8} {'MB/s':>8} {'vs raw':>7} {'peak RSS MB':>12} {'(after imports)':>16}")
    for run, r in results.items():
        raw = results.get(f"raw {run.split()[1]}")
        r["mb_per_s"] = total / MB / r["seconds"]
        r["vs_raw"] = r["mb_per_s"] / raw["mb_per_s"] if raw else None
        print(f"{run:12} {r['seconds']:8.2f} {r['mb_per_s']:8.0f} {r['vs_raw'] or 0:7.0%} "
              f"{r['peak_rss_mb']:12.0f} {r['start_rss_mb']:16.0f}")
    print(json.dumps({"total_mb": total / MB, "largest_tensor_mb": largest / MB, "rss_goal_mb": budget,
                      "results": results}))


if __name__ == "__main__":
    main()
