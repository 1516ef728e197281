"""Single-stream decode speed of one process, and which of its threads burned the CPU: run it several times to see
the spread between processes (issue 41: the same W1 hybrid decode step took ~5-7 ms in some processes and ~10-11 ms
in others on the 2-vCPU AMD VM, benchmarks/2026-11-28-decode-spread-cpu.md).

    for i in 1 2 3 4; do python tools/decode_spread.py; done
    python tools/decode_spread.py --runtime-threads 1 --family llama
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_train import WORKLOADS  # noqa: E402
from tools.profile_decode import engine_at  # noqa: E402


def thread_ticks() -> dict:
    """thread id -> (name, user + system clock ticks, the CPU it last ran on), from /proc/self/task."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        out[tid] = (name, int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--runtime-threads", type=int, default=2, help="MindSpore's runtime_num_threads")
    args = p.parse_args()

    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, runtime_num_threads=args.runtime_threads)
    engine, _ = engine_at(WORKLOADS["W1"], args.family, args.context, args.steps // 4, 2 * args.context, 1)
    for _ in range(20):  # warm-up
        engine.step([5])
    before, times = thread_ticks(), []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step([5])
        times.append(time.perf_counter() - start)
    after = thread_ticks()
    busy = sorted(((after[t][1] - before[t][1], after[t][0], after[t][2]) for t in after if t in before), reverse=True)
    print(f"{args.family} context {args.context}: {1e3 * statistics.median(times):.2f} ms a step (median of {args.steps})")
    print("busiest threads (clock ticks, name, last CPU):", busy[:4])


if __name__ == "__main__":
    main()
