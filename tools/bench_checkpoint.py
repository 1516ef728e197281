"""What a checkpoint costs the training it interrupts: synchronous save vs train.background_checkpoint.

One process builds the workload's train step (tools/bench_train.py's W1 / W2: random tokens,
AdamW) and alternates the two ways of saving, as the trainer saves (model weights + optimizer
state through msllm.checkpoint): each round runs a few plain steps (the baseline step time),
saves, then keeps stepping until the background write has ended. A save costs training
  stall     the time the training thread is held (sync: the whole write; background: the host copy)
  overlap   the extra time of the steps that ran beside the background write (2 cores shared)
and the write itself (write_s) is reported beside them.

    python tools/bench_checkpoint.py --workloads W1,W2 --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_dp import cpu_name  # noqa: E402 (CPU model, cores and SIMD level, as the other benchmark files name it)


def measure(workload: str, rounds: int, base_steps: int, run_dir: Path) -> dict:
    from bench_train import WORKLOADS, msllm_build
    from msllm import checkpoint

    built, batch = msllm_build(WORKLOADS[workload])
    step = lambda: built.train_step(batch)[0].asnumpy()  # noqa: E731 (asnumpy waits for the step)
    for _ in range(3):
        step()
    params = built.model.trainable_params()
    rows = {"sync": [], "background": []}
    n = 0
    for r in range(rounds):
        for mode in ("sync", "background") if r % 2 == 0 else ("background", "sync"):
            base = []
            for _ in range(base_steps):
                t0 = time.perf_counter()
                step()
                base.append(time.perf_counter() - t0)
            baseline = statistics.median(base)
            writer = checkpoint.BackgroundWriter() if mode == "background" else None
            n += 1
            t0 = time.perf_counter()
            state = {**built.optimizer.full_state(), **checkpoint.params_to_numpy(built.train_step.state_parameters())}
            checkpoint.save(run_dir, n, params, state, {"config": {}}, keep=1, writer=writer)
            stall = time.perf_counter() - t0
            overlap, steps_beside, write_s = 0.0, 0, stall
            if writer is not None:
                ended = []
                while not ended:
                    t1 = time.perf_counter()
                    step()
                    overlap += time.perf_counter() - t1 - baseline
                    steps_beside += 1
                    ended = writer.done()
                if ended[0].error is not None:
                    raise ended[0].error
                write_s = ended[0].seconds
            rows[mode].append({"stall_s": stall, "overlap_s": overlap, "steps_beside": steps_beside,
                               "write_s": write_s, "step_s": baseline})
            print(f"{workload} round {r} {mode:10s} stall {stall:6.3f} s  overlap {overlap:6.3f} s over "
                  f"{steps_beside} steps  write {write_s:6.2f} s  (step {baseline:.3f} s)", flush=True)
    size = sum(f.stat().st_size for f in checkpoint.latest(run_dir).iterdir())
    summary = {"checkpoint_bytes": size}
    for mode, got in rows.items():
        summary[mode] = {key: statistics.median(row[key] for row in got) for key in got[0]}
        summary[mode]["cost_s"] = statistics.median(row["stall_s"] + row["overlap_s"] for row in got)
    summary["cost_ratio"] = summary["sync"]["cost_s"] / summary["background"]["cost_s"]
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--rounds", type=int, default=4, help="saves of each kind per workload, alternated")
    p.add_argument("--base-steps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary dir)")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # one workload per process: its peak memory and compile state stay its own
        run_dir = Path(tempfile.mkdtemp(dir=args.dir))
        try:
            print("RESULT " + json.dumps(measure(args.worker, args.rounds, args.base_steps, run_dir)), flush=True)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu_name()}
    for workload in args.workloads.split(","):
        proc = subprocess.run([sys.executable, __file__, "--worker", workload, "--rounds", str(args.rounds),
                               "--base-steps", str(args.base_steps)] + (["--dir", args.dir] if args.dir else []),
                              cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "GLOG_v": "3"})
        lines = proc.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith("RESULT ")))
        got = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
        result[workload] = got if got is not None else {"error": f"worker exited {proc.returncode}"}
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"checkpoint_stall_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
