"""Kill -9 a training run over and over, resume each time, and check nothing was lost.

A reference run trains straight to --steps. The faulty run is started, SIGKILLed at a random
point -- during start-up, mid-training, or while a checkpoint is being written (a temporary
checkpoint dir exists) -- and resumed, --kills times; then it runs to the end. Its final
weights must equal the reference bit for bit.

    python tools/fault_inject.py --kills 20            # report "20/20 survived"
    python tools/fault_inject.py --kills 9 --workers 2 # msllm launch: kill -9 one random worker each time

With --workers N the run is `msllm launch --nproc N`; each kill hits one random worker, and
launch must then exit non-zero within 60 s naming that rank.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[1]
MODES = ("startup", "training", "checkpoint")


def tiny_settings(run_dir: Path, steps: int, ckpt_every: int, corpus: str | None) -> list[str]:
    values = {"model.vocab_size": 384, "model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2,
              "model.num_kv_heads": 1, "model.ffn_size": 64, "model.max_seq_len": 32, "data.seq_len": 16,
              "data.max_bytes": 300000, "train.batch_size": 4, "train.steps": steps, "train.log_every": 1,
              "train.eval_every": steps, "train.eval_batches": 1, "train.ckpt_every": ckpt_every,
              "train.keep_checkpoints": 2, "train.sample_tokens": 0, "train.run_dir": str(run_dir)}
    if corpus:
        values["data.path"] = corpus
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def command(run_dir: Path, settings: list[str], workers: int = 1) -> list[str]:
    base = [sys.executable, "-m", "msllm.cli", "train"]
    if workers > 1:
        base = [sys.executable, "-m", "msllm.cli", "launch", "--nproc", str(workers), "--timeout", "30", "--", "train"]
    if any((run_dir / "checkpoints").glob("step_*")):
        return base + ["--resume", str(run_dir)]
    return base + settings


def final_weights(run_dir: Path, steps: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{steps:07d}" / "model.safetensors"))


def run_until_killed(cmd: list[str], run_dir: Path, mode: str, rng: random.Random,
                     workers: int = 1) -> tuple[bool, str]:
    """Start cmd and SIGKILL it (or one of its workers) according to mode. Returns (killed, how)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Training kills land after a random number of logged steps (log_every is 1), not a random
    # time: a step takes a few ms here, so a time would often outlast the whole run.
    kill_after_steps = rng.randint(1, 12)
    trained = threading.Event()
    output = []

    def watch():
        steps = 0
        for line in proc.stdout:
            output.append(line)
            steps += line.startswith("step ")
            if steps >= kill_after_steps:
                trained.set()

    threading.Thread(target=watch, daemon=True).start()
    deadline = time.time() + 300
    if mode == "startup":
        time.sleep(rng.uniform(0.5, 4.0))
    elif mode == "training":
        while not trained.is_set() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)
    else:  # checkpoint: kill while a temporary checkpoint dir is being written
        ckpts = run_dir / "checkpoints"
        while proc.poll() is None and time.time() < deadline and not any(ckpts.glob(".step_*.tmp")):
            time.sleep(0.0005)
    if proc.poll() is not None:
        return False, f"{mode}: finished before the kill (exit {proc.returncode})"
    if workers == 1:
        proc.kill()
        proc.wait()
        return True, mode
    rank = rng.randrange(workers)
    pid_file = run_dir / "logs" / f"rank_{rank}.pid"
    while not pid_file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # a start-up kill lands once the worker exists
    if proc.poll() is not None:
        return False, f"{mode}: finished before the kill (exit {proc.returncode})"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed = time.time()
    proc.wait(timeout=120)
    took = time.time() - killed
    time.sleep(0.2)  # the watcher thread reads the last lines
    named = any(f"rank {rank} was killed by SIGKILL" in line for line in output[-5:])
    if proc.returncode == 0 or took > 60 or not named:
        raise SystemExit(f"launch did not report the killed rank {rank} within 60 s (exit {proc.returncode} "
                         f"after {took:.0f} s): {''.join(output[-3:])}")
    return True, f"{mode}, rank {rank}; launch named it and exited after {took:.0f} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="data.path (default: stdlib, capped at 300 KB)")
    parser.add_argument("--work", default="runs/fault_inject")
    parser.add_argument("--workers", type=int, default=1, help="run through msllm launch with this many workers")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    ref_dir, run_dir = work / "reference", work / "faulty"

    ref = subprocess.run(command(ref_dir, tiny_settings(ref_dir, args.steps, args.ckpt_every, args.corpus), args.workers),
                         cwd=REPO, capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-2000:], ref.stderr[-2000:])
        return 1
    settings = tiny_settings(run_dir, args.steps, args.ckpt_every, args.corpus)
    killed, survived = 0, 0
    while killed < args.kills:
        mode = MODES[killed % len(MODES)]
        ok, how = run_until_killed(command(run_dir, settings, args.workers), run_dir, mode, rng, args.workers)
        if not ok:
            print(f"  {how}; the run is complete, stopping early")
            break
        killed += 1
        newest = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if run_dir.exists() else []
        print(f"kill {killed}/{args.kills} ({how}); newest checkpoint: {newest[-1] if newest else 'none'}", flush=True)
    final = subprocess.run(command(run_dir, settings, args.workers), cwd=REPO, capture_output=True, text=True)
    if final.returncode != 0:
        print(final.stdout[-2000:], final.stderr[-2000:])
        print(f"0/{killed} survived: the final resume failed")
        return 1
    a, b = final_weights(ref_dir, args.steps), final_weights(run_dir, args.steps)
    identical = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    survived = killed if identical else 0
    print(f"{survived}/{killed} survived: final weights {'identical to' if identical else 'DIFFER from'} "
          f"the uninterrupted run")
    return 0 if identical and killed == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
