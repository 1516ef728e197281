"""MindSpore vs torch CPU GEMM throughput on the W1 train-step shapes, per layout.

On one core MindSpore is within ~10% of torch (`taskset -c 0 python tools/bench_matmul.py --threads 1`:
143-160 vs 158-180 GFLOP/s). On two
cores MindSpore falls behind because its calling thread spin-waits while the runtime's two worker
threads compute (three runnable threads on two cores); see README, Performance.

    python tools/bench_matmul.py --threads 2
"""
from __future__ import annotations

import argparse
import time

import mindspore as ms
import numpy as np
import torch
from mindspore import nn, ops

# (rows, inner, cols, transpose_a, transpose_b, what) for y = x @ W^T with x [1024, in], W [out, in]
SHAPES = [
    (1024, 512, 1376, False, True, "forward x @ W^T (gate/up)"),
    (1024, 1376, 512, False, True, "forward x @ W^T (down)"),
    (1024, 512, 4096, False, True, "forward x @ W^T (lm head)"),
    (1024, 1376, 512, False, False, "backward dx = dy @ W"),
    (1376, 1024, 512, True, False, "backward dW = dy^T @ x"),
    (4096, 1024, 512, True, False, "backward dW (lm head)"),
]


class Gemm(nn.Cell):
    def __init__(self, transpose_a: bool, transpose_b: bool):
        super().__init__()
        self.matmul = ops.MatMul(transpose_a=transpose_a, transpose_b=transpose_b)

    def construct(self, x, y):
        return self.matmul(x, y)


def seconds(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, runtime_num_threads=args.threads)
    ms.set_device("CPU")
    torch.set_num_threads(args.threads)
    print("| GEMM | M x K x N | MindSpore GFLOP/s | torch GFLOP/s |\n|---|---|---|---|")
    for m, k, n, ta, tb, what in SHAPES:
        a = np.random.randn(*((k, m) if ta else (m, k))).astype(np.float32)
        b = np.random.randn(*((n, k) if tb else (k, n))).astype(np.float32)
        ms_fn = Gemm(ta, tb)
        xa, xb = ms.Tensor(a), ms.Tensor(b)
        ta_, tb_ = torch.from_numpy(a), torch.from_numpy(b)
        t_ms = seconds(lambda: ms_fn(xa, xb).asnumpy(), args.repeat)
        t_torch = seconds(lambda: ((ta_.T if ta else ta_) @ (tb_.T if tb else tb_)).numpy(), args.repeat)
        flops = 2.0 * m * k * n
        print(f"| {what} | {m}x{k}x{n} | {flops / t_ms / 1e9:.0f} | {flops / t_torch / 1e9:.0f} |")


if __name__ == "__main__":
    main()
