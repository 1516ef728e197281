"""Long-context probe: one train step of a small Llama (workload L of bench_train.py: hidden 256,
2 layers, 4 heads, batch 1) at growing sequence lengths, msllm GRAPH with the flash and the softmax
attention core against HF + torch eager (SDPA, a flash kernel on CPU). Each variant runs in its own
process; the table gives the median step time and the process's peak RSS, and the ratios to torch.

    python tools/bench_long_context.py                       # 2K, 8K, 16K
    python tools/bench_long_context.py --seqs 32768 --variants msllm-flash
    python tools/bench_long_context.py --softmax-max 8192    # longer softmax runs need > 21 GB at 16K
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402

VARIANTS = {"msllm-flash": ("msllm-graph", "flash"), "msllm-softmax": ("msllm-graph", "softmax"),
            "torch-sdpa": ("torch-eager", "auto")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="2048,8192,16384")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--softmax-max", type=int, default=8192, help="longest sequence given to msllm-softmax")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
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
