"""A W1 decode step's projections through LinearsFewRows, this tree's build against another commit's: per layer
q/k/v, o, gate/up and down, then the head, each weight at its own address, so a step streams all 58 MB of them
from memory as a decode step does (bench_kernel_ab's few-rows cases repeat one call, its weights cached in L3).
The builds alternate step by step in one process, so a loaded machine slows both alike; prints per row count
the median step ms, GFLOP/s and the after / before ratio.

    python tools/bench_few_rows.py --before main --rows 1,4,8,16 --steps 30
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_flash_kernel import call  # noqa: E402
from bench_kernel_ab import as_mindspore_places, library_at  # noqa: E402
from msllm.kernels import build  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS = 512, 1376, 4096, 4
# (k, the weights' rows) of each LinearsFewRows call of a step, in order: q k v, o, gate up, down; the head
LAYER = [(HIDDEN, (HIDDEN,) * 3), (HIDDEN, (HIDDEN,)), (HIDDEN, (FFN, FFN)), (FFN, (HIDDEN,))]
CALLS = LAYER * LAYERS + [(HIDDEN, (VOCAB,))]


def step_calls(m: int, rng) -> list[list[np.ndarray]]:
    """Each call's inputs then outputs: x [m, k], its own weights [n, k], outputs [m, n]."""
    calls = []
    for k, ns in CALLS:
        weights = [(rng.normal(size=(n, k)) * 0.05).astype(np.float32) for n in ns]
        arrays = [rng.normal(size=(m, k)).astype(np.float32), *weights, *(np.empty((m, n), np.float32) for n in ns)]
        calls.append([as_mindspore_places(a) for a in arrays])
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="main", help="the commit to compare this tree's kernels against")
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": ctypes.CDLL(library_at(args.before, Path(tmp))), "after": ctypes.CDLL(build.library())}
    print(f"loaded or not: builds alternated step by step in one process, median of {args.steps} steps; "
          f"before = {args.before}")
    print("| rows | before ms | after ms | after/before | GFLOP/s before -> after |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for m in map(int, args.rows.split(",")):
        calls = {side: step_calls(m, rng) for side in libs}
        flops = 2 * m * sum(k * sum(ns) for k, ns in CALLS)
        times = {side: [] for side in libs}
        for step in range(args.steps + 1):  # the first step packs the weights
            for side in (("before", "after") if step % 2 else ("after", "before")):
                entry, start = libs[side].LinearsFewRows, time.perf_counter()
                for arrays in calls[side]:
                    call(entry, arrays)
                if step:
                    times[side].append(time.perf_counter() - start)
        before, after = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"| {m} | {1e3 * before:.2f} | {1e3 * after:.2f} | {after / before:.3f} | "
              f"{flops / before / 1e9:.0f} -> {flops / after / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
