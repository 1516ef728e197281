"""Long-context probe: one train step of a small Llama (workload L of bench_train.py: hidden 256,
2 layers, 4 heads, batch 1) at growing sequence lengths, msllm GRAPH with the flash and the softmax
attention core against HF + torch eager (SDPA, a flash kernel on CPU). Each variant runs in its own
process; the table gives the median step time and the process's peak RSS, and the ratios to torch.
--family deepseek_v3 gives the workload DeepSeek-V3's MLA heads (q/k 128 + 64, values 128) and MoE
(bench_train.FAMILIES): msllm's flash kernel with value heads smaller than q/k heads against HF's
DeepseekV3Attention on SDPA. torch's CPU flash kernel takes one head size for q, k and v, so there
SDPA runs its math kernel ([s, t] scores); torch-sdpa-padded-v pads V to the q/k heads first (as HF's
flash-attention-2 path does) so that torch's flash kernel runs. --rounds alternates the variants' order
round by round.

    python tools/bench_long_context.py                       # 2K, 8K, 16K
    python tools/bench_long_context.py --seqs 32768 --variants msllm-flash
    python tools/bench_long_context.py --softmax-max 8192    # longer softmax runs need > 21 GB at 16K
    python tools/bench_long_context.py --generate 32768      # prefill a 32K-token prompt, decode 16 tokens
    python tools/bench_long_context.py --family deepseek_v3 --seqs 16384 \
        --variants msllm-flash,torch-sdpa,torch-sdpa-padded-v --rounds 3   # the MLA goal: within 1.25x torch's RSS
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
from bench_big_vocab import provenance  # noqa: E402

# name -> (bench_train variant, msllm's train.attention or the torch side's attention implementation)
VARIANTS = {"msllm-flash": ("msllm-graph", "flash"), "msllm-softmax": ("msllm-graph", "softmax"),
            "torch-sdpa": ("torch-eager", "sdpa"), "torch-sdpa-padded-v": ("torch-eager", "sdpa_padded_v")}


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
    p.add_argument("--family", default="llama", choices=list(bench_train.FAMILIES), help="the workload's shape as this "
                   "family (deepseek_v3: MLA)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every variant, the order reversed every other round")
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
        names = [n for n in args.variants.split(",") if n != "msllm-softmax" or seq <= args.softmax_max]
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                variant, attention = VARIANTS[name]
                torch_side = variant.startswith("torch")
                worker = argparse.Namespace(
                    steps=args.steps, warmup=args.warmup, threads=args.threads, family=args.family, seq=seq,
                    jit_level="O0", fused_kernels="auto", block_graph="auto",
                    attention="auto" if torch_side else attention, torch_attention=attention if torch_side else "sdpa")
                r = bench_train.spawn(variant, "L", worker)
                rows.append({"seq": seq, "variant": name, "round": round_, **r})
                print(f"  {seq:>6} {name:<14} " + (f"error: {r['error']}" if "error" in r else
                      f"step {r['step_s']:.2f}s  first {r['first_step_s']:.1f}s  "
                      f"peak RSS {r['peak_rss_mb'] / 1024:.2f} GB"), flush=True)
    text = report(args, rows)
    print(text)
    stem = f"long_context_{args.family}"
    bench_train.save(args, stem, {"workload": bench_train.WORKLOADS["L"], "family": args.family,
                                  "threads": args.threads, "rows": rows})
    out = Path(args.out) / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.md"
    out.write_text(text)
    print(f"saved {out}")
    return 0


def report(args, rows: list[dict]) -> str:
    """The result file: provenance, conditions, and per round each variant's step and peak RSS against
    torch SDPA's in the same round."""
    args.before = args.after = str(bench_train.REPO)
    lines = [f"# Long-context train step on CPU, workload L as {args.family}: msllm vs HF + torch SDPA", "",
             *provenance("bench_long_context.py", args),
             f"* **Conditions**: workload L {bench_train.WORKLOADS['L']} (seq as given) with "
             f"{bench_train.FAMILIES[args.family][2] or 'no family additions'}, fp32, AdamW + clip 1.0, "
             f"{args.threads} threads, median of {args.steps} steps after {args.warmup} warm-up, each variant its "
             f"own process, {args.rounds} round(s) alternated", "",
             "| tokens | round | variant | step s | peak RSS GB | time vs torch | RSS vs torch |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['round']} | {r['variant']} | failed: {r['error']} | | | |")
            continue
        torch = next((t for t in rows if (t["seq"], t["round"], t["variant"]) == (r["seq"], r["round"], "torch-sdpa")
                      and "error" not in t), None)
        ratios = (f"{r['step_s'] / torch['step_s']:.2f}x | {r['peak_rss_mb'] / torch['peak_rss_mb']:.2f}x" if torch
                  else "n/a | n/a")
        lines.append(f"| {r['seq']} | {r['round']} | {r['variant']} | {r['step_s']:.2f} | "
                     f"{r['peak_rss_mb'] / 1024:.2f} | {ratios} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
