"""msllm's packed sgemm (msllm/kernels/sgemm.cc) against torch.matmul and MindSpore's MatMul on the training
step's three GEMM forms at W1's shapes, alternated in one process (GFLOP/s, median of --rounds), and each one's
largest error against float64 numpy (relative to the largest |result|); MatMul's CPU / wall: the cores it kept
busy. --before: another build's Sgemm (e.g. main's library) alternated with this one's, its GFLOP/s and the
after / before ratio.
--linears: each W1 Linear as training runs it, in a compiled graph: layers.Linear with MindSpore's MatMul or
kernels.PackedLinear, its forward alone and forward + backward (y, dx, dW), one Linear or two of one input (two
GEMMs the runtime may run at once, as q and k), alternated; ms per call (best of the rounds) and process CPU.

    python tools/bench_gemm.py --threads 2
    python tools/bench_gemm.py --threads 1 --before ~/.cache/msllm/kernels/cpu_kernels-<main's hash>.so
    python tools/bench_gemm.py --linears --rounds 6
--step llama|qwen3_5: a W1 train step's GEMM floor: every GEMM of the step (each Linear's forward, dx and dW by
sgemm or torch, whichever sums less; the attention layers' six batched products by torch, counted at half for
causality) on --threads, back to back with nothing else running: what the step can not beat with these GEMMs.
--against alternates that floor, in one process, with msllm's and / or torch's train step of the same model, so
that the machine's drift hits every side alike.

    python tools/bench_gemm.py --step llama --rounds 6 --against msllm,compile
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import mindspore as ms
import numpy as np
import torch
from mindspore import ParameterTuple, nn, ops

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import bench_train  # noqa: E402
from bench_matmul import Gemm  # noqa: E402
from msllm import kernels  # noqa: E402
from msllm.kernels import library  # noqa: E402
from msllm.models import layers  # noqa: E402

# (tokens, in, out, what): Y = X W^T with X [tokens, in], W [out, in]
LINEARS = [
    (1024, 512, 512, "q/k/v/o"),
    (1024, 512, 256, "hybrid q/k"),
    (1024, 512, 8, "hybrid b/a"),
    (1024, 512, 1376, "gate/up"),
    (1024, 1376, 512, "down"),
    (1024, 512, 4096, "lm head"),
]


# W1 (hidden 512, ffn 1376, vocab 4096, 4 x 256 tokens) Linears per train step: (in, out, count)
STEP_LINEARS = {
    "llama": [(512, 512, 4 * 4), (512, 1376, 2 * 4), (1376, 512, 4), (512, 4096, 1)],
    # 3 Gated DeltaNet layers (q, k 4 x 64; v, z 8 x 64; b, a 8; out) + 1 gated attention layer (q, gate, k, v, o)
    "qwen3_5": [(512, 256, 2 * 3), (512, 512, 3 * 3), (512, 8, 2 * 3), (512, 512, 5),
                (512, 1376, 2 * 4), (1376, 512, 4), (512, 4096, 1)],
}
STEP_ATTENTION_LAYERS = {"llama": 4, "qwen3_5": 1}
BATCH, SEQ, HEADS, HEAD_DIM = 4, 256, 8, 64


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


class Linears(nn.Cell):
    """`count` Linears of one input, each [d_out, d_in], through MatMul or PackedLinear."""

    def __init__(self, d_in: int, d_out: int, count: int, packed: bool):
        super().__init__()
        self.linears = nn.CellList([layers.Linear(d_in, d_out) for _ in range(count)])
        rng = np.random.default_rng(1)
        for linear in self.linears:
            linear.weight.set_data(ms.Tensor(rng.standard_normal((d_out, d_in), dtype=np.float32) * 0.05))
            if packed:
                linear.matmul = kernels.PackedLinear()

    def construct(self, x):
        return tuple(linear(x) for linear in self.linears)


class Backward(nn.Cell):
    """The Linears' forward and backward: dx and every dW for the given output gradients."""

    def __init__(self, net: nn.Cell):
        super().__init__()
        self.net, self.params = net, ParameterTuple(net.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

    def construct(self, x, dys):
        return self.grad(self.net, self.params)(x, dys)


def timed_cpu(fn, seconds_each: float = 0.25) -> tuple[float, float]:
    """(wall, process CPU) seconds per call."""
    fn()
    calls, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds_each:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def linears_table(rounds: int) -> None:
    print("| Linear | in x out | Linears | forward MatMul ms | forward Packed ms | ratio | train MatMul ms | "
          "train Packed ms | ratio | train CPU ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens, d_in, d_out, what in LINEARS:
        for count in (1, 2):
            rng = np.random.default_rng(0)
            x = ms.Tensor(rng.standard_normal((tokens, d_in), dtype=np.float32))
            dys = tuple(ms.Tensor(rng.standard_normal((tokens, d_out), dtype=np.float32)) for _ in range(count))
            runs = {}
            for packed in (False, True):
                net = Linears(d_in, d_out, count, packed)
                backward = Backward(net)
                runs["forward", packed] = lambda net=net: [y.asnumpy() for y in net(x)]
                runs["train", packed] = lambda b=backward: [g.asnumpy() for gs in b(x, dys) for g in gs]
            times = {key: [] for key in runs}
            for r in range(rounds):
                for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    times[key].append(timed_cpu(runs[key]))
            wall = {key: min(w for w, _ in t) * 1e3 for key, t in times.items()}
            cpu = {key: statistics.median(c for _, c in t) for key, t in times.items()}
            print(f"| {what} | {d_in}x{d_out} | {count} | {wall['forward', False]:.2f} | {wall['forward', True]:.2f} "
                  f"| {wall['forward', False] / wall['forward', True]:.2f} | {wall['train', False]:.2f} "
                  f"| {wall['train', True]:.2f} | {wall['train', False] / wall['train', True]:.2f} "
                  f"| {cpu['train', False] / cpu['train', True]:.2f} |", flush=True)


class StepGemm(NamedTuple):
    """A GEMM of the step: `count` calls a step, each implementation's call and best seconds, and which of them
    the floor pass calls."""
    what: str
    shape: str
    count: int
    runs: dict
    best: dict
    floor_by: str
    flops: float

    def floor_call(self):
        return self.runs[self.floor_by]()


def step_gemms(family: str, sgemm, threads: int, rounds: int) -> list[StepGemm]:
    """Every GEMM of the step: attention's batched products first, by torch, then the Linears' GEMMs, each timed by
    sgemm and by torch. The floor pass calls the Linears' GEMMs by whichever library sums less over the step
    (sgemm on the AVX2 VM; torch's MKL on AVX-512, twice as wide as sgemm's tiles), all by that one: torch's
    OpenMP threads spin after each of its calls and would slow sgemm calls that follow (a mixed pass ran 12-24 %
    above the sum of its parts)."""
    gemms = []
    # attention's S = Q K^T, O = P V and their four gradients: torch.bmm, counted at half for causality
    q, p = torch.randn(BATCH * HEADS, SEQ, HEAD_DIM), torch.randn(BATCH * HEADS, SEQ, SEQ)
    for what, x, y, per_layer in (("Q K^T / dP", q, q.transpose(1, 2), 2), ("P V / dQ / dK / dV", p, q, 4)):
        seconds = min(timed_cpu(lambda: torch.bmm(x, y))[0] for _ in range(rounds)) / 2
        half = (x[: BATCH * HEADS // 2], y[: BATCH * HEADS // 2])
        gemms.append(StepGemm(f"attention {what} (half)", f"{BATCH * HEADS}x{SEQ}x{HEAD_DIM}x{SEQ}",
                              STEP_ATTENTION_LAYERS[family] * per_layer, {"torch": lambda h=half: torch.bmm(*h)},
                              {"torch": seconds}, "torch", 2.0 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM / 2))
    for d_in, d_out, count in STEP_LINEARS[family]:
        for form, a, b, ta, tb in forms(BATCH * SEQ, d_in, d_out):
            op_a, op_b = (a.T if ta else a), (b.T if tb else b)
            m, k, n = op_a.shape[0], op_a.shape[1], op_b.shape[1]
            c = np.empty((m, n), np.float32)
            a_rows, a_cols = (1, a.shape[1]) if ta else (a.shape[1], 1)
            b_rows, b_cols = (1, b.shape[1]) if tb else (b.shape[1], 1)
            ta_, tb_ = torch.from_numpy(op_a), torch.from_numpy(op_b)
            run = {"sgemm": lambda a=a, b=b, c=c, m=m, n=n, k=k, ar=a_rows, ac=a_cols, br=b_rows, bc=b_cols: sgemm(
                       m, n, k, a.ctypes.data, ar, ac, b.ctypes.data, br, bc, c.ctypes.data, n, threads),
                   "torch": lambda x=ta_, y=tb_: torch.matmul(x, y)}
            best = {name: min(timed_cpu(fn)[0] for _ in range(rounds)) for name, fn in run.items()}
            gemms.append(StepGemm(f"{d_in}x{d_out} {form}", f"{m}x{k}x{n}", count, run, best, "sgemm", 2.0 * m * k * n))
    return by_faster_library(gemms)


def by_faster_library(gemms: list[StepGemm]) -> list[StepGemm]:
    """The GEMMs with the Linears' floor_by set to the library (sgemm or torch) whose calls sum less a step."""
    linears = [g for g in gemms if "sgemm" in g.runs]
    library = min(("sgemm", "torch"), key=lambda name: sum(g.best[name] * g.count for g in linears))
    return [g._replace(floor_by=library) if "sgemm" in g.runs else g for g in gemms]


def step_floor(family: str, sgemm, threads: int, rounds: int, against: list[str]) -> None:
    """The step's GEMMs back to back (step_gemms); with `against`, that pass alternated in this process with those
    train steps of the same model (msllm, torch eager or compile), so drift hits all alike."""
    gemms = step_gemms(family, sgemm, threads, rounds)
    print("| GEMM | M x K x N | per step | sgemm ms | torch ms | best ms x count |\n|---|---|---|---|---|---|")
    for g in gemms:
        cells = " | ".join(f"{g.best[name] * 1e3:.3f}" if name in g.best else "" for name in ("sgemm", "torch"))
        print(f"| {g.what} | {g.shape} | {g.count} | {cells} | {min(g.best.values()) * g.count * 1e3:.1f} |")
    flops = sum(g.count * g.flops for g in gemms)
    summed = sum(min(g.best.values()) * g.count for g in gemms)
    passed = sum(g.best[g.floor_by] * g.count for g in gemms)
    print(f"\nsum of the best GEMMs: {summed * 1e3:.0f} ms ({flops / 1e9:.1f} GFLOP, "
          f"{flops / summed / 1e9:.0f} GFLOP/s); of the floor pass's (Linears {gemms[-1].floor_by}; attention torch): "
          f"{passed * 1e3:.0f} ms")

    def floor_pass():
        for g in gemms:
            for _ in range(g.count):
                g.floor_call()
    sides = {"GEMM floor": floor_pass}
    w = dict(bench_train.WORKLOADS["W1"])
    for name in against:
        if name == "msllm":
            step, batch = bench_train.msllm_train_step(w, threads=threads, family=family)
            sides["msllm"] = lambda: step(batch)[0].asnumpy()
        else:
            sides[f"torch {name}"] = bench_train.torch_train_step(w, family, compile_=name == "compile",
                                                                  threads=threads)
    times = {name: [] for name in sides}
    for fn in sides.values():
        for _ in range(3):
            fn()
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            for _ in range(4):
                t0 = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"alternated in one process, {rounds} rounds x 4: " + ", ".join(
        f"{name} {s * 1e3:.0f} ms ({BATCH * SEQ / s:,.0f} tokens/s)" for name, s in median.items()))
    for name in list(sides)[1:]:
        ratio = median[name] / median["GEMM floor"]
        print(f"{name}'s step / the GEMM floor: **{ratio:.2f}**; a step 1.25x {name} would be {ratio / 1.25:.2f}x the "
              f"floor, 1.5x {ratio / 1.5:.2f}x")
    if "msllm" in sides:
        for name in [name for name in list(sides)[1:] if name != "msllm"]:
            print(f"msllm vs {name}, same process: **{median[name] / median['msllm']:.2f}x**")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--library", help="a .so with Sgemm (default: msllm's kernel library)")
    p.add_argument("--before", help="a second .so with Sgemm, timed alongside (after / before: > 1 this one faster)")
    p.add_argument("--linears", action="store_true", help="each Linear in a graph: MatMul vs PackedLinear")
    p.add_argument("--step", choices=list(STEP_LINEARS), help="a W1 train step's GEMM floor")
    p.add_argument("--against", default="", help="--step: comma list of train steps alternated with the floor in one "
                   "process: msllm (GRAPH), eager, compile (torch)")
    args = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, runtime_num_threads=args.threads)
    ms.set_device("CPU")
    if args.linears:
        print(f"threads {args.threads}; ms per call, best of {args.rounds} alternated rounds; ratios MatMul / Packed "
              "(> 1: Packed faster); CPU: median process CPU time per call\n")
        linears_table(args.rounds)
        return
    torch.set_num_threads(args.threads)
    # MatMul's own kernel threads: runtime_num_threads does not bound them (1 gave MatMul ~1.9 cores)
    ms.device_context.cpu.op_tuning.threads_num(args.threads)
    sgemm = sgemm_library(args.library)
    if args.step:
        print(f"W1 {args.step} train step, threads {args.threads}, best of {args.rounds} rounds\n")
        step_floor(args.step, sgemm, args.threads, args.rounds, [a for a in args.against.split(",") if a])
        return
    before = sgemm_library(args.before) if args.before else None
    print(f"threads {args.threads}; GFLOP/s, median of {args.rounds} alternated rounds\n")
    print("| GEMM | M x K x N | msllm sgemm | torch | MindSpore MatMul | sgemm / MatMul | MatMul CPU / wall "
          "| sgemm err | torch err |" + (" sgemm before | after / before |" if before else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if before else ""))
    for tokens, d_in, d_out, what in LINEARS:
        for form, a, b, ta, tb in forms(tokens, d_in, d_out):
            op_a, op_b = (a.T if ta else a), (b.T if tb else b)
            m, k, n = op_a.shape[0], op_a.shape[1], op_b.shape[1]
            c = np.empty((m, n), np.float32)
            # element strides of op(A), op(B) in floats
            a_rows, a_cols = (1, a.shape[1]) if ta else (a.shape[1], 1)
            b_rows, b_cols = (1, b.shape[1]) if tb else (b.shape[1], 1)

            def run_sgemm(fn=sgemm):
                fn(m, n, k, a.ctypes.data, a_rows, a_cols, b.ctypes.data, b_rows, b_cols, c.ctypes.data, n,
                   args.threads)
            ta_, tb_ = torch.from_numpy(op_a), torch.from_numpy(op_b)
            ms_fn, ms_a, ms_b = Gemm(ta, tb), ms.Tensor(a), ms.Tensor(b)
            variants = {"sgemm": run_sgemm, "torch": lambda: (ta_ @ tb_).numpy(),
                        "ms": lambda: ms_fn(ms_a, ms_b).asnumpy()}
            if before:
                variants["before"] = lambda: run_sgemm(before)
            times = {name: [] for name in variants}
            for r in range(args.rounds):
                for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                    times[name].append(timed_cpu(variants[name]))
            rate = {name: 2.0 * m * k * n / statistics.median(w for w, _ in t) / 1e9 for name, t in times.items()}
            ms_cores = statistics.median(c / w for w, c in times["ms"])
            exact = op_a.astype(np.float64) @ op_b.astype(np.float64)
            run_sgemm()
            scale = np.abs(exact).max()
            err_sgemm = np.abs(c - exact).max() / scale
            err_torch = np.abs((ta_ @ tb_).numpy() - exact).max() / scale
            ab = f" {rate['before']:.0f} | {rate['sgemm'] / rate['before']:.3f} |" if before else ""
            print(f"| {what} {form} | {m}x{k}x{n} | {rate['sgemm']:.0f} | {rate['torch']:.0f} | {rate['ms']:.0f} "
                  f"| {rate['sgemm'] / rate['ms']:.2f} | {ms_cores:.2f} | {err_sgemm:.1e} | {err_torch:.1e} |{ab}",
                  flush=True)


if __name__ == "__main__":
    main()
