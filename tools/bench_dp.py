"""Data-parallel throughput and memory on CPU: 1 worker vs 2 workers (one core each), plain DP vs ZeRO-1.

Each setting runs under msrun; every worker builds the W1 step with msllm's step builder
(msllm.train.build, so the gradient all-reduce and ZeRO-1 are the trained ones) at the same
micro-batch, times steps after warm-up, times the gradient all-reduce alone, and reports its
peak RSS. Writes benchmarks/DATE-dp-W1-cpu.md (and .json) naming the CPU and the commit.

    python tools/bench_dp.py                    # W1, 1 vs 2 workers, plain DP and ZeRO-1
    python tools/bench_dp.py --steps 3 --warmup 1 --workload W1 --no-write   # quick check
    python tools/bench_dp.py --moe              # W1 as Mixtral (8 experts, top 2): 1 worker vs 2, dp vs ep 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

# (label, workers, ZeRO-1, accum_steps, ep, capacity factor): accumulation shows how the all-reduce cost amortizes
SETTINGS = [("1 worker", 1, False, 1, 1, 0.0), ("2 workers", 2, False, 1, 1, 0.0), ("2 workers, ZeRO-1", 2, True, 1, 1, 0.0),
            ("1 worker, accum 4", 1, False, 4, 1, 0.0), ("2 workers, accum 4", 2, False, 4, 1, 0.0)]
# --moe: expert parallel against data parallel, dropless and at a capacity
MOE_SETTINGS = [("1 worker, dropless", 1, False, 1, 1, 0.0), ("2 workers, dp, dropless", 2, False, 1, 1, 0.0),
                ("2 workers, ep 2, dropless", 2, False, 1, 2, 0.0), ("1 worker, capacity 1.25", 1, False, 1, 1, 1.25),
                ("2 workers, dp, capacity 1.25", 2, False, 1, 1, 1.25), ("2 workers, ep 2, capacity 1.25", 2, False, 1, 2, 1.25)]


def rss_now_mb() -> float:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def worker(args) -> None:
    import mindspore as ms
    import numpy as np

    from bench_train import WORKLOADS, model_config, time_steps, tokens
    from msllm import device
    from msllm.config import Config, OptimConfig, ParallelConfig, TrainConfig
    from msllm.parallel import dp
    from msllm.train.build import build_train_step

    w = WORKLOADS[args.workload]
    os.environ["MSLLM_LOCAL_WORKERS"] = str(args.nproc)
    dp.pin_local_cores()  # one core each, as msllm launch does; a single worker is pinned to one core below
    if args.nproc == 1:
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), {0})
    device.setup("cpu", "graph", 1)
    rank, world = dp.init_process_group()
    cfg = Config(model=model_config(w, "mixtral" if args.moe else "llama"), optim=OptimConfig(warmup_steps=0, grad_clip=1.0),
                 train=TrainConfig(steps=1000, batch_size=w["batch"], accum_steps=args.accum, seed=0, threads=1,
                                   moe_capacity_factor=args.capacity),
                 parallel=ParallelConfig(optimizer_shard=args.zero1, ep=args.ep))
    built = build_train_step(cfg, world=world, rank=rank)
    batch = ms.Tensor(np.concatenate([tokens(w, seed=rank * 100 + i) for i in range(args.accum)]))
    timing = time_steps(lambda: built.train_step(batch)[0].asnumpy(), args.steps, args.warmup)
    result = {"rank": rank, "world": world, "zero": args.zero1, **timing,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # compile included
              "rss_after_steps_mb": rss_now_mb(),
              "optimizer_state_mb": sum(p.nbytes for p in built.optimizer.state_parameters()) / 2 ** 20}
    if world > 1:  # the all-reduce alone, on gradient-shaped tensors
        reducer = dp.GradAllReduce(built.optimizer.params)
        grads = tuple(ms.Tensor(np.ones(p.shape, np.float32)) for p in built.optimizer.params)
        loss = ms.Tensor(np.float32(1))
        times = []
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            reducer(grads, loss)[1].asnumpy()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        result["allreduce_s"] = statistics.median(times)
        result["allreduce_mb"] = sum(p.nbytes for p in built.optimizer.params) / 2 ** 20
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def run_workers(script: Path, nproc: int, argv: list[str], launch: bool = True) -> list[dict]:
    """Run `script --as-worker --out DIR *argv` as nproc msrun workers (or, launch=False, as one plain
    process: no msrun, no communication init); each worker writes DIR/rank{r}.json, returned in rank order."""
    from msllm.parallel.launch import free_port

    out = Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}_"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "GLOG_v": "3"}
    worker_cmd = [str(Path(script).resolve()), "--as-worker", "--out", str(out), *argv]
    if launch:
        cmd = [str(Path(sys.executable).with_name("msrun")), "--worker_num", str(nproc), "--local_worker_num",
               str(nproc), "--master_port", str(free_port()), "--log_dir", str(out / "logs"), "--join", "True",
               "--cluster_time_out", "120", *worker_cmd]
    else:
        assert nproc == 1, "without msrun there is one process"
        cmd = [sys.executable, *worker_cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{Path(script).name}: {nproc} workers failed; see {out}/logs\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_setting(nproc: int, zero: bool, accum: int, ep: int, capacity: float, args) -> list[dict]:
    return run_workers(Path(__file__), nproc, ["--workload", args.workload, "--steps", str(args.steps),
                                               "--warmup", str(args.warmup), "--accum", str(accum),
                                               "--nproc", str(nproc), "--ep", str(ep), "--capacity", str(capacity)]
                       + (["--zero1"] if zero else []) + (["--moe"] if args.moe else []))


def write_result(name: str, lines: list[str], data: dict) -> None:
    """benchmarks/NAME.md (the table) and NAME.json (the numbers)."""
    stem = REPO / "benchmarks" / name
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    print(f"wrote {stem}.md")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
            simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
            return f"{name}, {os.cpu_count()} cores, {simd}"
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; no file under benchmarks/")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)  # msrun would take --worker
    p.add_argument("--zero1", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--moe", action="store_true", help="the workload as Mixtral (8 experts, top 2): dp vs expert parallel")
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--capacity", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_worker:
        return worker(args)

    from bench_train import WORKLOADS
    w = WORKLOADS[args.workload]
    rows = []
    for label, nproc, zero, accum, ep, capacity in (MOE_SETTINGS if args.moe else SETTINGS):
        ranks = run_setting(nproc, zero, accum, ep, capacity, args)
        step_s = max(r["step_s"] for r in ranks)  # the ranks wait for each other in the all-reduce
        rows.append({"setting": label, "workers": nproc, "zero": zero, "accum": accum, "ep": ep, "capacity": capacity,
                     "step_s": step_s,
                     "tokens_per_s": nproc * accum * w["batch"] * w["seq"] / step_s,
                     "first_step_s": max(r["first_step_s"] for r in ranks),
                     "peak_rss_mb_per_worker": max(r["peak_rss_mb"] for r in ranks),
                     "rss_after_steps_mb_per_worker": max(r["rss_after_steps_mb"] for r in ranks),
                     "optimizer_state_mb_per_worker": ranks[0]["optimizer_state_mb"],
                     "allreduce_s": ranks[0].get("allreduce_s"), "allreduce_mb": ranks[0].get("allreduce_mb")})
        print(json.dumps(rows[-1]), flush=True)
    base = {(r["accum"], r["capacity"]): r["tokens_per_s"] for r in rows if r["workers"] == 1}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    today = datetime.date.today().isoformat()
    title = (f"# Expert parallel on CPU: {args.workload} as Mixtral (8 experts, top 2), 1 vs 2 workers (one core "
             f"each), dp vs ep 2" if args.moe else
             f"# Data parallel on CPU: {args.workload}, 1 vs 2 workers (one core each), plain DP vs ZeRO-1")
    lines = [title, "",
             f"- Date: {today}", f"- Commit: {commit}", f"- Machine: {cpu_name()}",
             f"- Command: `python tools/bench_dp.py --workload {args.workload} --steps {args.steps} --warmup {args.warmup}"
             f"{' --moe' if args.moe else ''}`",
             f"- Workload: {w}; micro-batch {w['batch']} per worker, fp32, fused CPU kernels, 1 thread per worker", "",
             "| setting | step s | tokens/s | vs 1 worker (same accum, capacity) | first step s | peak RSS MB / worker | RSS after steps MB / worker | optimizer state MB / worker | all-reduce s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ar = f"{r['allreduce_s']:.3f} ({r['allreduce_mb']:.0f} MB)" if r["allreduce_s"] else "-"
        lines.append(f"| {r['setting']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base[r['accum'], r['capacity']]:.2f}x | "
                     f"{r['first_step_s']:.1f} | {r['peak_rss_mb_per_worker']:.0f} | {r['rss_after_steps_mb_per_worker']:.0f} | "
                     f"{r['optimizer_state_mb_per_worker']:.0f} | {ar} |")
    print("\n".join(lines))
    if not args.no_write:
        write_result(f"{today}-{'ep' if args.moe else 'dp'}-{args.workload}-cpu", lines, {"date": today, "commit": commit, "cpu": cpu_name(),
                                                                 "workload": w, "rows": rows})


if __name__ == "__main__":
    main()
