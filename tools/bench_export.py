"""Export time and inference tokens/s on CPU: onnxruntime vs MindSpore (MindIR GraphCell, msllm Cells in GRAPH_MODE).

    python tools/bench_export.py                      # tiny and W1, prompt 128, 64 decode steps
    python tools/bench_export.py --sizes tiny --prompt 8 --new 4 --repeats 1   # seconds-long smoke run

Random weights (speed does not depend on them), batch 1. Prefill tokens/s = prompt / time of
one prefill; decode tokens/s = new tokens / time of that many one-token KV-cache steps.
Each number is the best of --repeats runs after one warm-up run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from graph_opt.export import export  # noqa: E402
from graph_opt.manifest import read_manifest  # noqa: E402
from graph_opt.runtime import export_engine  # noqa: E402
from msllm.inference import cell_engine  # noqa: E402
from msllm import checkpoint, device  # noqa: E402
from msllm.config import Config, ModelConfig  # noqa: E402
from msllm.checkpoint import load_model  # noqa: E402
from msllm.models.decoder import build_model  # noqa: E402

SIZES = {
    "tiny": ModelConfig(),  # configs/tiny.yaml: vocab 2048, hidden 128, 4 layers, 4/2 heads, FFN 352
    "w1": ModelConfig(vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8, ffn_size=1376,
                      max_seq_len=256),
}


def make_checkpoint(root: Path, model_cfg: ModelConfig) -> Path:
    device.setup("cpu", "pynative")
    cfg = Config(model=model_cfg)
    cfg.data.seq_len = min(cfg.data.seq_len, model_cfg.max_seq_len)
    checkpoint.save(root, 0, build_model(model_cfg, seed=0).trainable_params(), [], {"config": cfg.to_dict()})
    return root


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: graph compilation, session allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def tokens_per_s(engine, vocab: int, prompt: int, new: int, repeats: int) -> dict[str, float]:
    ids = np.random.default_rng(0).integers(0, vocab, prompt).tolist()
    prefill_s = best_time(lambda: engine.start([ids], new), repeats)

    def decode_steps():
        logits = engine.start([ids], new)
        start = time.perf_counter()
        for _ in range(new):
            logits = engine.step(logits.argmax(-1).tolist())
        return time.perf_counter() - start

    decode_steps()
    decode_s = min(decode_steps() for _ in range(repeats))
    return {"prefill_tok_s": prompt / prefill_s, "decode_tok_s": new / decode_s}


def bench(size: str, prompt: int, new: int, repeats: int, work: Path) -> list[dict]:
    model_cfg = SIZES[size]
    ckpt = make_checkpoint(work / size / "run", model_cfg)
    rows = []
    for fmt, engine_name in (("onnx", "onnxruntime"), ("mindir", "mindspore-mindir")):
        out = work / size / fmt
        start = time.perf_counter()
        manifest = export(ckpt, fmt, out, log=lambda line: None)
        total = time.perf_counter() - start
        speed = tokens_per_s(export_engine(out, read_manifest(out)), model_cfg.vocab_size, prompt, new, repeats)
        rows.append({"size": size, "engine": engine_name, "export_s": manifest["export_seconds"],
                     "export_verify_s": round(total, 2), "max_abs_diff": max(manifest["max_abs_diff"].values()),
                     **speed})
    device.setup("cpu", "graph")  # as msllm generate --engine msllm runs
    _, model, _, _ = load_model(ckpt)
    rows.append({"size": size, "engine": "msllm-cells-graph",
                 **tokens_per_s(cell_engine(model), model_cfg.vocab_size, prompt, new, repeats)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,w1", help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="msllm_bench_") as work:
        for size in args.sizes.split(","):
            rows += bench(size, args.prompt, args.new, args.repeats, Path(work))
    print(f"batch 1, prompt {args.prompt}, {args.new} decode steps, best of {args.repeats}")
    print("| size | engine | export s (+verify) | max abs diff | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        export_s = f"{r['export_s']:.1f} ({r['export_verify_s']:.1f})" if "export_s" in r else "-"
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
        print(f"| {r['size']} | {r['engine']} | {export_s} | {diff} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
