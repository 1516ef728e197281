"""The CPU flash-attention kernel alone: forward and backward of causal attention at one shape,
called through ctypes on the library msllm builds (no MindSpore in the loop), best of --reps.
Use it to compare kernel versions: run it once per source tree, alternated, in one session.

    python tools/bench_flash_kernel.py                          # s 16384, 4 heads of 64 (bench_long_context's L)
    python tools/bench_flash_kernel.py --seq 8192 --head-dim 128 --heads 8 --kv-heads 2
    MSLLM_KERNEL_MARCH=x86-64-v3 python tools/bench_flash_kernel.py   # the AVX2 build
    python tools/bench_flash_kernel.py --sinks                  # the kernel with a sink logit per head (gpt-oss)
    python tools/bench_flash_kernel.py --alternate 4 --out benchmarks   # without vs with sinks, 4 rounds

GFLOP/s counts the causal half of the matmuls: forward 2 (q k^T, p v), backward 5 (with p recomputed).
--alternate N runs the kernel without and with sinks, each in a process of its own, over N rounds, the
order flipped each round (a drifting machine affects both alike), and reports each side's median of its
rounds' best forward and backward times, the sinks' cost in per cent and the peak RSS (getrusage);
--out writes the table with its Command, Commit and Machine lines, and the JSON beside it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from msllm import kernels  # before bench_dp puts this checkout first on sys.path: PYTHONPATH picks the tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_big_vocab import print_result, provenance, save  # noqa: E402
from bench_dp import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def call(fn, arrays: list[np.ndarray]) -> None:
    """An AOT custom-op entry point: (nparam, params, ndims, shapes, dtypes, stream, extra)."""
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    dims = [(ctypes.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
    fn(n, params, ndims, shapes, None, None, None)


def measure(args) -> dict:
    """Best-of-reps forward and backward seconds of the kernel (with sinks if args.sinks) at args' shape."""
    s, h, d = args.seq, args.heads, args.head_dim
    kv = args.kv_heads or h
    lib = ctypes.CDLL(kernels.library())
    rng = np.random.default_rng(0)
    q = (rng.normal(size=(1, h, s, d)) / np.sqrt(d)).astype(np.float32)
    k, v = (rng.normal(size=(1, kv, s, d)).astype(np.float32) for _ in range(2))
    index = [np.arange(s, dtype=np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(1, np.int32)]
    sinks = [rng.normal(0, 2, h).astype(np.float32)] if args.sinks else []  # gpt-oss's are of this size
    forward, backward = ((lib.FlashAttentionSinks, lib.FlashAttentionSinksGrad) if args.sinks
                         else (lib.FlashAttention, lib.FlashAttentionGrad))
    out, lse = np.empty_like(q), np.empty((1, h, s), np.float32)
    d_out = rng.normal(size=q.shape).astype(np.float32)
    grads = [np.empty_like(q), np.empty_like(k), np.empty_like(v)] + [np.empty_like(x) for x in sinks]
    times = {"forward": [], "backward": []}
    for _ in range(args.reps):
        started = time.perf_counter()
        call(forward, [q, k, v, *index, *sinks, out, lse])
        middle = time.perf_counter()
        call(backward, [q, k, v, *index, *sinks, out, lse, d_out, *grads])
        times["forward"].append(middle - started)
        times["backward"].append(time.perf_counter() - middle)
    return {name: min(t) for name, t in times.items()} | {"all": times}


def print_times(args, result: dict) -> None:
    s, h, d = args.seq, args.heads, args.head_dim
    causal = 2.0 * s * s * d * h  # two [s, s/2, d] matmuls per head
    print(f"flash kernel{' with sinks' if args.sinks else ''}, {cpu_name()}, build -march={kernels.march()}: "
          f"s {s}, heads {h} (kv {args.kv_heads or h}) x {d}, best of {args.reps}")
    for name, matmuls in (("forward", 2), ("backward", 5)):
        best = result[name]
        print(f"  {name:<9} {best:.3f} s  {causal * matmuls / 2 / best / 1e9:.0f} GFLOP/s  "
              f"(all: {', '.join(f'{t:.3f}' for t in result['all'][name])})")


def shape_flags(args) -> list[str]:
    return ["--seq", str(args.seq), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
            "--head-dim", str(args.head_dim), "--reps", str(args.reps)]


def spawn(args, sinks: bool) -> dict:
    """One side in a process of its own: its RESULT line, or the error it ended with."""
    cmd = [sys.executable, __file__, "--worker", *shape_flags(args), *(["--sinks"] if sinks else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def report(args, results: dict) -> str:
    lines = ["# The CPU flash-attention kernel with a sink logit per head vs without", "",
             *provenance("bench_flash_kernel.py", args),
             f"* **Conditions**: causal, fp32, s {args.seq}, {args.heads} heads (kv {args.kv_heads or args.heads}) "
             f"x {args.head_dim}, build -march={kernels.march()}, {os.cpu_count()} threads; each process the best of "
             f"{args.reps} calls; sides alternated over {args.alternate} rounds, one process each (each cell: the "
             f"median of the rounds' bests, peak RSS the rounds' max)", "",
             "| side | forward s | backward s | forward + backward s | vs without sinks | peak RSS MB |",
             "|---|---|---|---|---|---|"]
    base = None
    for side, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {side} | error: {runs[-1]['error']} | | | | |")
            continue
        forward, backward = (statistics.median(r[name] for r in ok) for name in ("forward", "backward"))
        base = base or forward + backward
        lines.append(f"| {side} | {forward:.3f} | {backward:.3f} | {forward + backward:.3f} | "
                     f"{(forward + backward) / base - 1:+.1%} | {max(r['peak_rss_mb'] for r in ok):,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sinks", action="store_true", help="the kernel with a sink logit per head (FlashAttentionSinks)")
    p.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                   help="without vs with sinks, one process each, over ROUNDS rounds")
    p.add_argument("--out", help="with --alternate: directory for the markdown table and JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return print_result(measure(args))
    if not args.alternate:
        print_times(args, measure(args))
        return 0
    args.before = args.after = str(REPO)  # provenance's one commit
    results = {"without sinks": [], "with sinks": []}
    for round_ in range(args.alternate):
        for sinks in (False, True) if round_ % 2 == 0 else (True, False):
            side = "with sinks" if sinks else "without sinks"
            result = spawn(args, sinks)
            results[side].append(result)
            print(round_, side, json.dumps({k: v for k, v in result.items() if k != "all"}), flush=True)
    text = report(args, results)
    print(text)
    save(args.out, f"flash-sinks-s{args.seq}", text, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
