"""The W1 Llama train step's non-attention fused kernels alone, this tree's build against another commit's,
called through ctypes (no MindSpore in the loop) and alternated in one process, so a loaded machine slows
both alike. Prints per kernel the medians of wall and CPU ms (getrusage-style process time: every thread)
and the after / before ratios, and whether the outputs are bit-identical.

    python tools/bench_kernel_ab.py --before main                       # every kernel, 12 rounds x 3 calls
    python tools/bench_kernel_ab.py --before HEAD~2 --kernels MaskedSoftmax --rounds 40
    python tools/bench_kernel_ab.py --before HEAD              # A/A: how far apart equal builds time

Shapes are W1's (bench_train.WORKLOADS): 4 x 256 tokens, hidden 512, 8 heads of 64, ffn 1376, vocab 4096;
the sum of squares over 16M parameters (about W1's count).
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mindspore as ms
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_flash_kernel import call  # noqa: E402
from msllm.kernels import build  # noqa: E402


def library_at(commit: str, out: Path) -> str:
    """The kernel library built from `commit`'s sources with this tree's flags."""
    for path in build.SOURCES + build.HEADERS:
        shown = subprocess.run(["git", "show", f"{commit}:{path.relative_to(REPO)}"], cwd=REPO, capture_output=True)
        if shown.returncode != 0 and path in build.HEADERS:  # a header newer than `commit`: its sources need none
            continue
        shown.check_returncode()
        (out / path.name).write_bytes(shown.stdout)
    target = out / "before.so"
    subprocess.run(["g++", *build.flags(), "-o", str(target), *(str(out / p.name) for p in build.SOURCES)], check=True)
    return str(target)


def as_mindspore_places(a: np.ndarray) -> np.ndarray:
    """A copy of `a` starting 16 bytes past a 64-byte boundary, where MindSpore's CPU tensors start: numpy's
    start anywhere, and the few-rows tiles' speed depends on where (loads across cache lines)."""
    buffer = np.empty(a.size + 16, a.dtype)
    start = (16 - buffer.ctypes.data) % 64 // a.itemsize
    copy = buffer[start:start + a.size].reshape(a.shape)
    copy[...] = a
    return copy


def w1_cases(rng) -> dict:
    """name -> (entry point, the call's inputs then outputs, how many outputs, FLOPs or 0 when not a GEMM)."""
    def normal(*shape, scale=1.0):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    tokens, hidden, heads, s, ffn, vocab = 1024, 512, 8, 256, 1376, 4096
    x, dy, w = normal(tokens, hidden), normal(tokens, hidden), normal(hidden)
    eps = np.full(1, 1e-6, np.float32)
    gate, up = normal(tokens, ffn), normal(tokens, ffn)
    cos, sin, per_head = normal(s, 64), normal(s, 64), normal(4, heads, s, 64)
    scores = normal(4, heads, s, s, scale=3.0)
    mask = np.triu(np.full((s, s), -np.inf, np.float32), 1)
    head_w, labels = normal(vocab, hidden, scale=0.05), rng.integers(0, vocab, tokens).astype(np.int32)
    params = [normal(512, 800) for _ in range(40)]
    grads = [normal(512, 800) for _ in range(40)]
    row = np.full(tokens, 1.0 / tokens, np.float32)
    scalar = np.zeros(1, np.float32)
    f32 = lambda *shape: np.empty(shape, np.float32)  # noqa: E731
    cases = {
        "RMSNorm": ("RMSNorm", [x, w, eps, f32(tokens, hidden)], 1),
        "RMSNormGrad": ("RMSNormGrad", [x, w, eps, dy, f32(tokens, hidden), f32(hidden), f32(1)], 3),
        "SwiGLU": ("SwiGLU", [gate, up, f32(tokens, ffn)], 1),
        "SwiGLUGrad": ("SwiGLUGrad", [gate, up, up, f32(tokens, ffn), f32(tokens, ffn)], 2),
        "RopeHeads": ("RopeHeads", [x, cos, sin, f32(4, heads, s, 64)], 1),
        "RopeHeadsGrad": ("RopeHeadsGrad", [per_head, cos, sin, f32(tokens, hidden)], 1),
        "MaskedSoftmax": ("MaskedSoftmax", [scores, mask, f32(*scores.shape)], 1),
        "SoftmaxAttentionGrad": ("SoftmaxAttentionGrad", [scores, scores, per_head, per_head, f32(*scores.shape)], 1),
        "LinearCrossEntropy": ("LinearCrossEntropy", [x, head_w, labels, scalar, f32(tokens), f32(tokens)], 2),
        "LinearCrossEntropyGrad": ("LinearCrossEntropyGrad", [x, head_w, labels, scalar, row, row, row,
                                                              f32(tokens, hidden), f32(vocab, hidden)], 2),
        "LinearCrossEntropyGrad softcap 30": ("LinearCrossEntropyGrad", [x, head_w, labels, np.full(1, 30, np.float32),
                                                                         row, row, row, f32(tokens, hidden),
                                                                         f32(vocab, hidden)], 2),
        "SumOfSquares": ("SumOfSquares", [*grads, f32(1)], 1),
    }
    # a decode step's projections (q k v, gate up, down, the head) of 1, 4 or 16 rows (a GRPO rollout's batch)
    projections = {"qkv": (hidden, (hidden, 128, 128)), "gate up": (hidden, (ffn, ffn)), "down": (ffn, (hidden,)),
                   "head": (hidden, (vocab,))}
    for m in (1, 4, 16):
        for what, (k, ns) in projections.items():
            weights = [normal(n, k, scale=0.05) for n in ns]
            arrays = [as_mindspore_places(a) for a in (normal(m, k), *weights, *(f32(m, n) for n in ns))]
            cases[f"LinearsFewRows m={m} {what}"] = ("LinearsFewRows", arrays, len(ns), 2 * m * k * sum(ns))
    cases.update(rule_cases(normal, f32))
    return {name: case if len(case) == 4 else (*case, 0) for name, case in cases.items()}


def rule_cases(normal, f32) -> dict:
    """One W1 Qwen3.5 Gated DeltaNet layer's gated delta rule (4 x 256 tokens, 4 key / 8 value heads of 64,
    state saved every 64 tokens), forward and backward; rows 2-3 packed with a sample starting mid-chunk."""
    b, nk, n, s, d = 4, 4, 8, 256, 64

    def unit_rows(*shape, scale=1.0):  # L2-normalised rows, as the mixer feeds q and k
        x = normal(*shape)
        return (x * scale / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q, k, v = unit_rows(b, nk, s, d, scale=d ** -0.5), unit_rows(b, nk, s, d), normal(b, n, s, d)
    g = -np.abs(normal(b, n, s, scale=0.3)).astype(np.float32)
    beta = (1 / (1 + np.exp(-normal(b, n, s)))).astype(np.float32)
    segments = np.zeros((b, s), np.int32)
    segments[2:, 100:] = 1
    initial, saved = np.zeros((b, n, d, d), np.float32), f32(b, n, s // 64, d, d)
    inputs = [q, k, v, g, beta, segments, initial]
    forward = [*inputs, f32(b, n, s, d), f32(b, n, d, d), saved]
    grads = [f32(b, nk, s, d), f32(b, nk, s, d), f32(b, n, s, d), f32(b, n, s), f32(b, n, s), f32(b, n, d, d)]
    rule = ctypes.CDLL(build.library()).GatedDeltaRule  # the saved states backward reads, from this tree
    call(rule, forward)
    backward = [*inputs, saved, normal(b, n, s, d), np.zeros((b, n, d, d), np.float32), *grads]
    return {"GatedDeltaRule": ("GatedDeltaRule", forward, 3), "GatedDeltaRuleGrad": ("GatedDeltaRuleGrad", backward, 6)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="main", help="the commit to compare this tree's kernels against")
    p.add_argument("--kernels", default="", help="comma-separated case names (default: all)")
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args(argv)
    # dnnl_sgemm for the head's kernels, loaded as MindSpore's CPU backend loads it
    ctypes.CDLL(str(Path(ms.__file__).parent / "lib" / "libdnnl.so.3"), mode=ctypes.RTLD_GLOBAL)
    # Each side's library loaded twice (copies), in the order before, after, after, before, and the copies
    # taken in turn: in A/A runs the library loaded second ran 5-10 % faster, whatever it held.
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"before": library_at(args.before, Path(tmp)), "after": build.library()}
        copies = {}
        for i, side in enumerate(("before", "after", "after", "before")):
            copy = Path(tmp) / f"{side}-{i}.so"
            shutil.copy(paths[side], copy)
            copies.setdefault(side, []).append(ctypes.CDLL(str(copy)))
    cases = {side: w1_cases(np.random.default_rng(0)) for side in copies}
    wanted = args.kernels.split(",")
    names = [n for n in cases["after"] if not args.kernels or n in wanted or n.split()[0] in wanted]
    times = {(n, side): ([], []) for n in names for side in copies}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            lib = copies[side][r // 2 % 2]
            for name in names:
                entry, arrays, _, _ = cases[side][name]
                for _ in range(3):
                    wall, cpu = time.perf_counter(), time.process_time()
                    call(getattr(lib, entry), arrays)
                    times[name, side][0].append(time.perf_counter() - wall)
                    times[name, side][1].append(time.process_time() - cpu)
    print(f"loaded or not: alternated in one process, {args.rounds} rounds x 3 calls; before = {args.before}")
    print("| kernel (W1 shapes) | before CPU ms | after CPU ms | CPU after/before | wall after/before | "
          "GFLOP/s before -> after (wall) | outputs |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        (wb, cb), (wa, ca) = times[name, "before"], times[name, "after"]
        outputs = cases["before"][name][2]
        same = all(np.array_equal(b.view(np.int32), a.view(np.int32))
                   for b, a in zip(cases["before"][name][1][-outputs:], cases["after"][name][1][-outputs:]))
        cpu_b, cpu_a, wall_b, wall_a = map(statistics.median, (cb, ca, wb, wa))
        flops = cases["after"][name][3]
        rate = f"{flops / wall_b / 1e9:.0f} -> {flops / wall_a / 1e9:.0f}" if flops else ""
        print(f"| {name} | {1e3 * cpu_b:.2f} | {1e3 * cpu_a:.2f} | {cpu_a / cpu_b:.2f} | {wall_a / wall_b:.2f} | "
              f"{rate} | {'bit-identical' if same else 'differ'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
