"""The CPU flash-attention kernel alone: forward and backward of causal attention at one shape,
called through ctypes on the library msllm builds (no MindSpore in the loop), best of --reps.
Use it to compare kernel versions: run it once per source tree, alternated, in one session.

    python tools/bench_flash_kernel.py                          # s 16384, 4 heads of 64 (bench_long_context's L)
    python tools/bench_flash_kernel.py --seq 8192 --head-dim 128 --heads 8 --kv-heads 2
    MSLLM_KERNEL_MARCH=x86-64-v3 python tools/bench_flash_kernel.py   # the AVX2 build

GFLOP/s counts the causal half of the matmuls: forward 2 (q k^T, p v), backward 5 (with p recomputed).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

from msllm import kernels  # before bench_dp puts this checkout first on sys.path: PYTHONPATH picks the tree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dp import cpu_name  # noqa: E402


def call(fn, arrays: list[np.ndarray]) -> None:
    """An AOT custom-op entry point: (nparam, params, ndims, shapes, dtypes, stream, extra)."""
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    dims = [(ctypes.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
    fn(n, params, ndims, shapes, None, None, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    s, h, d = args.seq, args.heads, args.head_dim
    kv = args.kv_heads or h
    lib = ctypes.CDLL(kernels.library())
    rng = np.random.default_rng(0)
    q = (rng.normal(size=(1, h, s, d)) / np.sqrt(d)).astype(np.float32)
    k, v = (rng.normal(size=(1, kv, s, d)).astype(np.float32) for _ in range(2))
    index = [np.arange(s, dtype=np.int32), np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(1, np.int32)]
    out, lse = np.empty_like(q), np.empty((1, h, s), np.float32)
    d_out = rng.normal(size=q.shape).astype(np.float32)
    grads = [np.empty_like(q), np.empty_like(k), np.empty_like(v)]
    times = {"forward": [], "backward": []}
    for _ in range(args.reps):
        started = time.perf_counter()
        call(lib.FlashAttention, [q, k, v, *index, out, lse])
        middle = time.perf_counter()
        call(lib.FlashAttentionGrad, [q, k, v, *index, out, lse, d_out, *grads])
        times["forward"].append(middle - started)
        times["backward"].append(time.perf_counter() - middle)
    causal = 2.0 * s * s * d * h  # two [s, s/2, d] matmuls per head
    print(f"flash kernel, {cpu_name()}, build -march={kernels.march()}: "
          f"s {s}, heads {h} (kv {kv}) x {d}, best of {args.reps}")
    for name, matmuls in (("forward", 2), ("backward", 5)):
        best = min(times[name])
        print(f"  {name:<9} {best:.3f} s  {causal * matmuls / 2 / best / 1e9:.0f} GFLOP/s  "
              f"(all: {', '.join(f'{t:.3f}' for t in times[name])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
