"""Context parallel on CPU: one train step of workload L (tools/bench_train.py: hidden 256, 2 layers,
4 heads, batch 1, flash attention) on 1 worker against 2 workers at parallel.cp=2 under msrun, each
sequence split in zig-zag chunks. Same model, seed and tokens; the table gives the median step
time, the first (compile) step, the loss and each worker's peak RSS.

    python tools/bench_context_parallel.py                  # 16K tokens, 2 timed steps after 1 warm-up
    python tools/bench_context_parallel.py --seq 32768 --steps 1
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import bench_train  # noqa: E402


def worker(args) -> None:
    """One rank: build the step (parallel.cp = the launched world), time it, write OUT/rank_R.json."""
    import mindspore as ms
    from msllm import device
    from msllm.config import Config, OptimConfig, ParallelConfig, TrainConfig
    from msllm.parallel import dp
    from msllm.train.build import build_train_step

    w = {**bench_train.WORKLOADS["L"], "seq": args.seq}
    dp.pin_local_cores()
    threads = max(1, (os.cpu_count() or 1) // dp.local_workers())
    device.setup("cpu", "graph", threads)
    rank, world = dp.init_process_group()
    cfg = Config(model=bench_train.model_config(w), optim=OptimConfig(warmup_steps=0, grad_clip=1.0),
                 train=TrainConfig(steps=1000, batch_size=1, seed=0, threads=threads, attention="flash"),
                 parallel=ParallelConfig(cp=world))
    cfg.data.seq_len = args.seq
    built = build_train_step(cfg, world=world, rank=rank)
    batch = ms.Tensor(bench_train.tokens(w))
    losses = []
    timing = bench_train.time_steps(lambda: losses.append(float(built.train_step(batch)[0].asnumpy())),
                                    args.steps, args.warmup)
    result = {**timing, "rank": rank, "world": world, "threads": threads, "loss": losses[0],
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}
    (Path(args.out) / f"rank_{rank}.json").write_text(json.dumps(result))


def run(nproc: int, args, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    # positional: msrun's own parser would take --worker for a prefix of its options
    me = [str(Path(__file__).resolve()), "worker", str(args.seq), str(args.steps), str(args.warmup), str(out)]
    env = {**os.environ, "GLOG_v": "3", "PYTHONPATH": str(REPO), "MSLLM_LOCAL_WORKERS": str(nproc),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        from msllm.parallel.launch import free_port
        cmd = [str(Path(sys.executable).with_name("msrun")), "--worker_num", str(nproc), "--local_worker_num",
               str(nproc), "--master_port", str(free_port()), "--log_dir", str(out / "logs"), "--join", "True",
               "--cluster_time_out", "120", *me]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(nproc)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="runs/bench/context_parallel")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # one rank, started by run()
        seq, steps, warmup, out = argv[1:]
        worker(argparse.Namespace(seq=int(seq), steps=int(steps), warmup=int(warmup), out=out))
        return 0
    args = p.parse_args(argv)
    print("| workers | cp | threads each | step s | first step s | loss | peak RSS GB per worker |")
    print("|---|---|---|---|---|---|---|")
    for nproc in (1, 2):
        ranks = run(nproc, args, Path(args.out) / f"w{nproc}")
        r0 = ranks[0]
        rss = " / ".join(f"{r['peak_rss_gb']:.2f}" for r in ranks)
        print(f"| {nproc} | {nproc} | {r0['threads']} | {max(r['step_s'] for r in ranks):.2f} | "
              f"{r0['first_step_s']:.1f} | {r0['loss']:.6f} | {rss} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
