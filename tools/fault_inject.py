"""Kill -9 a training run over and over, resume each time, and check nothing was lost.

A reference run trains straight to --steps. The faulty run is started, SIGKILLed at a random
point -- during start-up, mid-training, or while a checkpoint is being written (a temporary
checkpoint dir exists) -- and resumed, --kills times; then it runs to the end. Its final
weights must equal the reference bit for bit.

    python tools/fault_inject.py --kills 20            # report "20/20 survived"
    python tools/fault_inject.py --kills 9 --workers 2 # msllm launch: kill -9 one random worker each time

With --workers N the run is `msllm launch --nproc N`; each kill hits one random worker, and
launch must then exit non-zero within 60 s naming that rank.

--campaign RUNS: unattended runs. Each run trains from scratch under
`msllm launch --nproc 2 --max-restarts 3` and gets one fault, the kinds in turn:
  kill       kill -9 of a random worker after a random number of steps
  hang       SIGSTOP of a random worker (the hang watchdog must notice, train.hang_timeout_s=10)
  disk_full  the run dir (a tmpfs: needs root) filled while a checkpoint is being written, freed 2 s later
  corrupt    one byte of the newest checkpoint flipped, then kill -9 of a worker (resume must skip it)
Nobody resumes by hand: every run must finish by itself with final weights bit-identical to an
uninterrupted 2-worker run. One line per run (restarts, steps lost, failed checkpoint writes), then
survived / total per kind.

    python tools/fault_inject.py --campaign 20 --steps 60
"""
from __future__ import annotations

import argparse
import json
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


FAULTS = ("kill", "hang", "disk_full", "corrupt")


def launch_command(settings: list[str], max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "msllm.cli", "launch", "--nproc", "2", "--timeout", "30",
            "--max-restarts", str(max_restarts), "--", "train", *settings]


class Watched:
    """A launched run whose console lines are collected, with the count of logged steps."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self.steps = [], 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.steps += line.startswith("step ")

    def wait_for(self, test, timeout: float = 300) -> bool:
        deadline = time.time() + timeout
        while not test() and self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        return self.proc.poll() is None and test()


def random_worker(run_dir: Path, rng: random.Random) -> int:
    return int((run_dir / "logs" / f"rank_{rng.randrange(2)}.pid").read_text())


def inject(fault: str, run: Watched, run_dir: Path, rng: random.Random, steps: int) -> str:
    """Inject one fault into a running run; what was done, in words."""
    after = rng.randint(4, steps // 2)
    if not run.wait_for(lambda: run.steps >= after):
        return "not injected: the run ended first"
    if fault in ("kill", "hang"):
        pid = random_worker(run_dir, rng)
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return f"{'kill -9' if fault == 'kill' else 'SIGSTOP'} of a worker after step {run.steps}"
    if fault == "corrupt":
        ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
        weights = ckpts[-1] / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
        os.kill(random_worker(run_dir, rng), signal.SIGKILL)
        return f"flipped a byte of {ckpts[-1].name}, then kill -9 of a worker"
    ckpts = run_dir / "checkpoints"  # disk_full: while a checkpoint is being written
    if not run.wait_for(lambda: any(ckpts.glob(".step_*")), timeout=120):
        return "not injected: no checkpoint write seen"
    filler = run_dir / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass
    time.sleep(2.0)
    filler.unlink()
    return f"disk full for 2 s during a checkpoint write after step {run.steps}"


def metrics_rows(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a row cut short by a kill
    return rows


def campaign(args) -> int:
    rng = random.Random(args.seed)
    work = Path(args.work).resolve()
    for mount in work.glob("run_*"):
        subprocess.run(["umount", str(mount)], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    settings = lambda d: tiny_settings(d, args.steps, args.ckpt_every, args.corpus) + [  # noqa: E731
        "--set", "train.hang_timeout_s=10"]
    ref_dir = work / "reference"
    ref = subprocess.run(launch_command(settings(ref_dir), 0), cwd=REPO, capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-2000:], ref.stderr[-2000:])
        return 1
    reference = final_weights(ref_dir, args.steps)
    results = []
    for i in range(args.campaign):
        fault = FAULTS[i % len(FAULTS)]
        run_dir = work / f"run_{i:02d}_{fault}"
        run_dir.mkdir(parents=True)
        if fault == "disk_full" and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run_dir)],
                                                   capture_output=True).returncode:
            print(f"run {i:2d} {fault:9s} skipped: mounting a tmpfs needs root", flush=True)
            continue
        t0 = time.time()
        run = Watched(launch_command(settings(run_dir), args.max_restarts))
        how = inject(fault, run, run_dir, rng, args.steps)
        try:
            code = run.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            code = "timeout"
        rows = metrics_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        restarts = [r for r in rows if r.get("kind") == "restart"]
        failed_writes = sum(r.get("kind") == "checkpoint_failed" for r in rows)
        lost = sum(r["lost_steps"] for r in restarts)
        try:
            final = final_weights(run_dir, args.steps)
            identical = final.keys() == reference.keys() and all(np.array_equal(final[k], reference[k]) for k in final)
        except (OSError, FileNotFoundError):
            identical = False
        survived = code == 0 and identical and not how.startswith("not injected")
        results.append({"run": i, "fault": fault, "injected": how, "exit": code, "identical": identical,
                        "restarts": len(restarts), "causes": [r["cause"] for r in restarts], "lost_steps": lost,
                        "failed_checkpoint_writes": failed_writes, "seconds": round(time.time() - t0, 1),
                        "survived": survived})
        print(f"run {i:2d} {fault:9s} {'survived' if survived else 'FAILED  '}  {how}; {len(restarts)} restart(s), "
              f"{lost} step(s) lost, {failed_writes} failed checkpoint write(s), {time.time() - t0:.0f} s"
              + ("" if survived else f"; exit {code}, weights {'identical' if identical else 'differ'}: "
                 + "".join(run.lines[-3:]).strip()), flush=True)
        if fault == "disk_full":  # its logs kept beside the tmpfs
            shutil.copytree(run_dir / "logs", work / f"logs_run_{i:02d}", dirs_exist_ok=True)
            subprocess.run(["umount", str(run_dir)], capture_output=True)
    total = len(results)
    ok = sum(r["survived"] for r in results)
    for fault in FAULTS:
        mine = [r for r in results if r["fault"] == fault]
        if mine:
            print(f"  {fault:9s} {sum(r['survived'] for r in mine)}/{len(mine)} survived, restarts "
                  f"{sum(r['restarts'] for r in mine)}, steps lost per run {[r['lost_steps'] for r in mine]}")
    print(f"{ok}/{total} survived: every run finished by itself with final weights identical to the "
          f"uninterrupted run" if ok == total else f"{ok}/{total} survived")
    (work / "campaign.json").write_text(json.dumps(results, indent=1))
    return 0 if ok == total else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", default=None, help="data.path (default: stdlib, capped at 300 KB)")
    parser.add_argument("--work", default="runs/fault_inject")
    parser.add_argument("--workers", type=int, default=1, help="run through msllm launch with this many workers")
    parser.add_argument("--campaign", type=int, default=0, help="this many unattended 2-worker runs, one fault each")
    parser.add_argument("--max-restarts", type=int, default=3, help="--campaign: launch --max-restarts")
    args = parser.parse_args(argv)
    if args.campaign:
        return campaign(args)
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
