"""The planner's per-device memory against the measured peak RSS on CPU (one process = one device).

For W1 and W2 (tools/bench_train.py) in fp32 with the fused CPU kernels and no recompute: one
plain process (no msrun), 2 msrun workers of plain data parallel, and 2 with ZeRO-1 (the workers
of tools/bench_dp.py's machinery). Each worker builds the step with msllm's step builder, runs a
few steps and reports its peak RSS (getrusage), set against
`msllm.layout.plan.estimate(cfg, device="cpu")["total"]`. A runtime-only worker (MindSpore
imported, a trivial graph compiled and run, communication initialised under msrun) measures what
the CPU profile's `runtime` constant stands for. Writes benchmarks/DATE-plan-vs-rss-cpu.md.

    python tools/bench_plan_memory.py                  # W1 and W2, all settings
    python tools/bench_plan_memory.py --workloads W1 --no-write
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_dp import cpu_name, run_workers, write_result  # noqa: E402

SETTINGS = [("1 process", 1, False), ("2 workers", 2, False), ("2 workers, ZeRO-1", 2, True)]
MB = 2 ** 20


def peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)


def config(w: dict, nproc: int, zero: bool):
    from bench_train import model_config
    from msllm.config import Config, DataConfig, OptimConfig, ParallelConfig, TrainConfig

    return Config(model=model_config(w), data=DataConfig(seq_len=w["seq"]),
                  optim=OptimConfig(warmup_steps=0, grad_clip=1.0),
                  train=TrainConfig(steps=1000, batch_size=w["batch"], seed=0),
                  parallel=ParallelConfig(dp=nproc, optimizer_shard=zero))


def worker(args) -> None:
    import mindspore as ms

    from bench_train import WORKLOADS, tokens
    from msllm import device
    from msllm.parallel import dp

    threads = max(1, (os.cpu_count() or 1) // args.nproc)  # as msllm launch shares the cores
    device.setup("cpu", "graph", threads)
    rank, world = dp.init_process_group()
    result = {"rank": rank, "world": world}
    if args.workload == "runtime":  # the process without a model: one trivial graph compiled and run
        class Trivial(ms.nn.Cell):
            def construct(self, x):
                return x * 2 + 1
        Trivial()(ms.Tensor([1.0, 2.0])).asnumpy()
        if world > 1:
            dp.barrier()  # and one all-reduce: the collective library's own buffers
    else:
        from msllm.train.build import build_train_step

        w = WORKLOADS[args.workload]
        built = build_train_step(config(w, world, args.zero1), world=world, rank=rank)
        result["built_rss"] = peak_rss()
        batch = ms.Tensor(tokens(w, seed=rank))
        for _ in range(args.steps):
            built.train_step(batch)[0].asnumpy()
        result["optimizer_state"] = sum(p.nbytes for p in built.optimizer.state_parameters())
    result["peak_rss"] = peak_rss()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def measure(workload: str, nproc: int, zero: bool, steps: int) -> list[dict]:
    argv = ["--workload", workload, "--steps", str(steps), "--nproc", str(nproc)] + (["--zero1"] if zero else [])
    return run_workers(Path(__file__), nproc, argv, launch=nproc > 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; no file under benchmarks/")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--zero1", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_worker:
        return worker(args)

    from bench_train import WORKLOADS
    from msllm.layout import plan as P

    runtime = {n: max(r["peak_rss"] for r in measure("runtime", n, False, 0)) for n in (1, 2)}
    print(f"runtime only: 1 process {runtime[1] / MB:.0f} MB, 2 workers {runtime[2] / MB:.0f} MB / worker", flush=True)
    rows = []
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        for label, nproc, zero in SETTINGS:
            ranks = measure(name, nproc, zero, args.steps)
            e = P.estimate(config(w, nproc, zero), device="cpu")
            measured = max(r["peak_rss"] for r in ranks)
            rows.append({"workload": name, "setting": label, "measured": measured, "predicted": e["total"],
                         "error": e["total"] / measured - 1, "optimizer_state": ranks[0]["optimizer_state"],
                         "predicted_parts": {k: e[k] for k in ("runtime", "weights", "grads", "optimizer",
                                                               "activations")},
                         "ranks": ranks})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "ranks"}), flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    today = datetime.date.today().isoformat()
    lines = ["# Planner vs measured peak RSS on CPU: W1 and W2, one process and 2 data-parallel workers", "",
             f"- Date: {today}", f"- Commit: {commit}", f"- Machine: {cpu_name()}",
             f"- Command: `python tools/bench_plan_memory.py --workloads {args.workloads} --steps {args.steps}`",
             f"- Conditions: fp32, AdamW + clip, fused CPU kernels, recompute none, {args.steps} steps; one process "
             "with 2 threads, DP workers under msrun with 1 thread each; peak RSS by getrusage, the largest rank's",
             f"- Runtime only (MindSpore imported, a trivial graph compiled and run): {runtime[1] / MB:.0f} MB in one "
             f"process, {runtime[2] / MB:.0f} MB per msrun worker", "",
             "| workload | setting | predicted MB | measured peak RSS MB | error | predicted runtime / weights / grads / "
             "optimizer / activations MB | optimizer state MB (measured) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = " / ".join(f"{v / MB:.0f}" for v in r["predicted_parts"].values())
        lines.append(f"| {r['workload']} | {r['setting']} | {r['predicted'] / MB:.0f} | {r['measured'] / MB:.0f} | "
                     f"{r['error']:+.1%} | {parts} | {r['optimizer_state'] / MB:.0f} |")
    print("\n".join(lines))
    if not args.no_write:
        write_result(f"{today}-plan-vs-rss-cpu", lines, {"date": today, "commit": commit, "cpu": cpu_name(),
                                                          "runtime": runtime, "rows": rows})


if __name__ == "__main__":
    main()
