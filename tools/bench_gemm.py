"""msllm's packed sgemm (msllm/kernels/sgemm.cc) against torch.matmul and MindSpore's MatMul on the training
step's three GEMM forms at W1's shapes, alternated in one process (GFLOP/s, median of --rounds), and each one's
largest error against float64 numpy (relative to the largest |result|).

    python tools/bench_gemm.py --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_matmul import Gemm  # noqa: E402
from msllm.kernels import library  # noqa: E402

# (tokens, in, out, what): Y = X W^T with X [tokens, in], W [out, in]
LINEARS = [
    (1024, 512, 512, "q/k/v/o"),
    (1024, 512, 256, "hybrid q/k"),
    (1024, 512, 1376, "gate/up"),
    (1024, 1376, 512, "down"),
    (1024, 512, 4096, "lm head"),
]


def sgemm_library(path: str | None = None):
    """The library's Sgemm (tests and benchmarks' entry: strides and a thread cap) as a ctypes function."""
    fn = ctypes.CDLL(path or str(library())).Sgemm
    fn.restype = None
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return fn


def forms(tokens: int, d_in: int, d_out: int):
    """(name, a, b, transpose_a, transpose_b): forward X W^T, dX = dY W, dW = dY^T X."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, d_in), dtype=np.float32)
    w = rng.standard_normal((d_out, d_in), dtype=np.float32)
    dy = rng.standard_normal((tokens, d_out), dtype=np.float32)
    return [("forward", x, w, False, True), ("dx", dy, w, False, False), ("dW", dy, x, True, False)]


def timed(fn, seconds_each: float = 0.3) -> float:
    fn()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds_each:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--library", help="a .so with Sgemm (default: msllm's kernel library)")
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, runtime_num_threads=args.threads)
    ms.set_device("CPU")
    torch.set_num_threads(args.threads)
    sgemm = sgemm_library(args.library)
    print(f"threads {args.threads}; GFLOP/s, median of {args.rounds} alternated rounds\n")
    print("| GEMM | M x K x N | msllm sgemm | torch | MindSpore MatMul | sgemm / MatMul | sgemm err | torch err |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens, d_in, d_out, what in LINEARS:
        for form, a, b, ta, tb in forms(tokens, d_in, d_out):
            op_a, op_b = (a.T if ta else a), (b.T if tb else b)
            m, k, n = op_a.shape[0], op_a.shape[1], op_b.shape[1]
            c = np.empty((m, n), np.float32)
            # element strides of op(A), op(B) in floats
            a_rows, a_cols = (1, a.shape[1]) if ta else (a.shape[1], 1)
            b_rows, b_cols = (1, b.shape[1]) if tb else (b.shape[1], 1)

            def run_sgemm():
                sgemm(m, n, k, a.ctypes.data, a_rows, a_cols, b.ctypes.data, b_rows, b_cols, c.ctypes.data, n,
                      args.threads)
            ta_, tb_ = torch.from_numpy(op_a), torch.from_numpy(op_b)
            ms_fn, ms_a, ms_b = Gemm(ta, tb), ms.Tensor(a), ms.Tensor(b)
            variants = {"sgemm": run_sgemm, "torch": lambda: (ta_ @ tb_).numpy(),
                        "ms": lambda: ms_fn(ms_a, ms_b).asnumpy()}
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(timed(fn))
            rate = {name: 2.0 * m * k * n / statistics.median(t) / 1e9 for name, t in times.items()}
            exact = op_a.astype(np.float64) @ op_b.astype(np.float64)
            run_sgemm()
            scale = np.abs(exact).max()
            err_sgemm = np.abs(c - exact).max() / scale
            err_torch = np.abs((ta_ @ tb_).numpy() - exact).max() / scale
            print(f"| {what} {form} | {m}x{k}x{n} | {rate['sgemm']:.0f} | {rate['torch']:.0f} | {rate['ms']:.0f} "
                  f"| {rate['sgemm'] / rate['ms']:.2f} | {err_sgemm:.1e} | {err_torch:.1e} |", flush=True)


if __name__ == "__main__":
    main()
