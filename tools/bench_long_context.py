"""Long-context probe: one train step of a small Llama (workload L of bench_train.py: hidden 256,
2 layers, 4 heads, batch 1) at growing sequence lengths, msllm GRAPH with the flash and the softmax
attention core against HF + torch eager (SDPA, a flash kernel on CPU). Each variant runs in its own
process; the table gives the median step time and the process's peak RSS, and the ratios to torch.

    python tools/bench_long_context.py                       # 2K, 8K, 16K
    python tools/bench_long_context.py --seqs 32768 --variants msllm-flash
    python tools/bench_long_context.py --softmax-max 8192    # longer softmax runs need > 21 GB at 16K
    python tools/bench_long_context.py --generate 32768      # prefill a 32K-token prompt, decode 16 tokens
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402

VARIANTS = {"msllm-flash": ("msllm-graph", "flash"), "msllm-softmax": ("msllm-graph", "softmax"),
            "torch-sdpa": ("torch-eager", "auto")}


def generate_probe(prompt_len: int, new: int, threads: int) -> dict:
    """The workload-L model (random weights) in an msllm engine on CPU (the flash core, as
    train.attention auto picks for its context): prefill `prompt_len` random tokens, then greedy decode."""
    import numpy as np
    from msllm import backends, device
    from msllm.config import Config, TrainConfig
    from msllm.generate import generate
    from msllm.inference import cell_engine
    from msllm.models.decoder import build_model

    device.setup("cpu", "graph", threads)
    w = {**bench_train.WORKLOADS["L"], "seq": prompt_len + new}
    cfg = Config(model=bench_train.model_config(w), train=TrainConfig())
    model = build_model(cfg.model, seed=0)
    spec = backends.specialise(model, cfg, training=False)
    prompt = np.random.default_rng(0).integers(0, w["vocab"], prompt_len).tolist()
    engine = cell_engine(model)
    stamps = []
    started = time.perf_counter()
    generate(engine, [prompt], new, on_token=lambda row, token: stamps.append(time.perf_counter()) and False)
    first = stamps[0] - started
    decode = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"prompt": prompt_len, "new": len(stamps), "flash": spec.flash, "first_token_s": first,
            "decode_s_per_token": decode, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,8192,16384")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--softmax-max", type=int, default=8192, help="longest sequence given to msllm-softmax")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--generate", type=int, default=0, help="instead: prefill a prompt of this many tokens, then decode")
    p.add_argument("--new", type=int, default=16, help="--generate: tokens to decode")
    args = p.parse_args(argv)
    if args.generate:
        r = generate_probe(args.generate, args.new, args.threads)
        print(json.dumps(r))
        print(f"prompt {r['prompt']} tokens: first token after {r['first_token_s']:.1f} s (prefill, compile included), "
              f"then {r['decode_s_per_token'] * 1e3:.0f} ms/token; peak RSS {r['peak_rss_mb'] / 1024:.2f} GB; "
              f"flash core: {r['flash']}")
        return 0
    rows = []
    for seq in [int(x) for x in args.seqs.split(",")]:
        for name in args.variants.split(","):
            if name == "msllm-softmax" and seq > args.softmax_max:
                continue
            variant, attention = VARIANTS[name]
            worker = argparse.Namespace(
                steps=args.steps, warmup=args.warmup, threads=args.threads, family="llama", seq=seq,
                jit_level="O0", fused_kernels="auto", block_graph="auto", attention=attention)
            r = bench_train.spawn(variant, "L", worker)
            rows.append({"seq": seq, "variant": name, **r})
            print(f"  {seq:>6} {name:<14} " + (f"error: {r['error']}" if "error" in r else
                  f"step {r['step_s']:.2f}s  first {r['first_step_s']:.1f}s  peak RSS {r['peak_rss_mb'] / 1024:.2f} GB"),
                  flush=True)
    print(f"\nworkload L {bench_train.WORKLOADS['L']} (seq as given), {args.threads} threads, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print("| tokens | variant | step s | peak RSS GB | time vs torch | RSS vs torch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['seq']} | {r['variant']} | failed: {r['error']} | | | |")
            continue
        torch = next((t for t in rows if t["seq"] == r["seq"] and t["variant"] == "torch-sdpa" and "error" not in t), None)
        ratios = (f"{r['step_s'] / torch['step_s']:.2f}x | {r['peak_rss_mb'] / torch['peak_rss_mb']:.2f}x" if torch
                  else "n/a | n/a")
        print(f"| {r['seq']} | {r['variant']} | {r['step_s']:.2f} | {r['peak_rss_mb'] / 1024:.2f} | {ratios} |")
    bench_train.save(args, "long_context", {"workload": bench_train.WORKLOADS["L"], "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
