"""In-process A/B of the CPU inference specialisation's launch fusions on one decode step (issues 41 and 43): the
msllm engine as specialised ("fused": the one-kernel cached attention, rope tables, residual norm and SwiGLU + w2)
against a second engine over the same workload whose model has those four Cells swapped back to the plain model's
(layers.Attend, CacheTables, ResidualNorm, ActivatedLinear: "plain"). Steps alternate between the two engines; the
medians of wall and CPU time per step, and the kernels per step by MindSpore's profiler.

    python tools/ab_decode_fusions.py --family llama --batch 16 --context 64      # a GRPO rollout's decode step
    python tools/ab_decode_fusions.py --family qwen3_5 --context 4096
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_train import WORKLOADS  # noqa: E402
from tools.profile_decode import engine_at  # noqa: E402
from tools.profile_step import kernel_types  # noqa: E402


def unfuse(model) -> None:
    """The plain model's Cells back where the seam swapped the launch fusions in."""
    from msllm.models import layers

    model.cached_tables = layers.CacheTables()
    for _, cell in model.cells_and_names():
        if hasattr(cell, "attend"):
            cell.attend = layers.Attend(cell.num_heads, cell.num_kv_heads, cell.head_dim)
        if hasattr(cell, "residual_norm"):
            cell.residual_norm = layers.ResidualNorm()
        if isinstance(cell, layers.FeedForward):
            cell.down = layers.ActivatedLinear()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=150, help="timed steps of each engine, alternated")
    args = p.parse_args(argv)
    from msllm import device

    device.setup("cpu", "graph")
    max_len = max(1064, args.context + 4 * args.steps + 8)
    engines = {}
    for name in ("fused", "plain"):
        engine, model = engine_at(WORKLOADS["W1"], args.family, args.context, args.steps, max_len, args.batch)
        if name == "plain":  # its decode graph, compiled at its first step, takes the plain Cells
            unfuse(model)
        engines[name] = engine
    tokens = [5] * args.batch
    for engine in engines.values():
        for _ in range(3):
            engine.step(tokens)
    wall, cpu = {name: [] for name in engines}, {name: [] for name in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():
            c, t = time.process_time(), time.perf_counter()
            engine.step(tokens)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    print(f"W1 {args.family}, batch {args.batch}, context {args.context}, {args.steps} steps each, alternated:")
    print("| engine | kernels per step | wall ms per step | CPU ms per step |\n|---|---|---|---|")
    for name, engine in engines.items():
        kernels = sum(o["kernels_per_step"] for o in kernel_types(lambda: engine.step(tokens), 5))
        print(f"| {name} | {kernels:.0f} | {1e3 * statistics.median(wall[name]):.3f} | "
              f"{1e3 * statistics.median(cpu[name]):.3f} |")
    ratio = statistics.median(wall["plain"]) / statistics.median(wall["fused"])
    print(f"plain / fused wall: {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
