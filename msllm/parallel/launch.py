"""msllm launch: run `msllm train` on N workers per node through MindSpore's msrun, and say which one failed.

msrun starts a scheduler (on the node whose address is --master) and the workers, each with
RANK_ID / MS_* in its environment and its output in LOG_DIR/worker_RANK.log; `msllm train` then
takes rank and world size from mindspore.communication. msrun notices a dead worker within a
second and kills the others, but then waits for its scheduler's time-out; this module stops the
whole job as soon as msrun reports the death and prints one line: the rank, its signal or exit
code, and its log file. A worker that stops making steps is stopped the same way, after its
Python stacks are dumped (msllm/parallel/watchdog.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msllm
from msllm.errors import UserError
from msllm.parallel import watchdog

WORKER_SCRIPT = Path(__file__).with_name("entry") / "msllm_worker.py"
DIED = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
MSLLM_ERROR = re.compile(r"^msllm \w+: (error|interrupted)")
EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")
WATCH_EVERY_S = 1.0  # how often the watchdog reads the heartbeats
MINDSPORE_LOG = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] |^Start (scheduler|worker) process")


class LaunchError(UserError, RuntimeError):
    pass


@dataclass
class Layout:
    nproc: int          # workers on this node
    nnodes: int = 1
    node_rank: int = 0
    master: str = ""    # ADDR:PORT of the scheduler; default 127.0.0.1 and a free port

    @property
    def world(self) -> int:
        return self.nproc * self.nnodes

    def address(self) -> tuple[str, int]:
        if not self.master:
            return "127.0.0.1", free_port()
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"--master {self.master!r}: expected ADDR:PORT, e.g. 10.0.0.1:8118")
        return host, int(port)

    def check(self) -> None:
        if self.nproc < 1 or self.nnodes < 1:
            raise LaunchError(f"--nproc {self.nproc} / --nnodes {self.nnodes}: both must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank}: must be in [0, {self.nnodes}) for --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master:
            raise LaunchError("--nnodes > 1 needs --master ADDR:PORT, the address of node 0 that every node reaches")
        if self.master:
            self.address()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(layout: Layout, log_dir: Path, timeout: int, args: list[str]) -> list[str]:
    host, port = layout.address()
    return [str(Path(sys.executable).with_name("msrun")),
            "--worker_num", str(layout.world), "--local_worker_num", str(layout.nproc),
            "--master_addr", host, "--master_port", str(port), "--node_rank", str(layout.node_rank),
            "--log_dir", str(log_dir), "--join", "True", "--cluster_time_out", str(timeout),
            "--tail_worker_log", str(layout.node_rank * layout.nproc),  # this node's first worker to the console
            str(WORKER_SCRIPT), *args]


def worker_env(layout: Layout, log_dir: Path, timeout: int) -> dict:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # msrun starts `python` from PATH: this venv's
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    package_root = str(Path(msllm.__file__).resolve().parent.parent)  # the msllm this launcher runs
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MSLLM_LOCAL_WORKERS"] = str(layout.nproc)
    env["MSLLM_PID_DIR"] = str(log_dir)
    env.setdefault("MS_NODE_TIMEOUT", str(timeout))
    # msrun reports a dead worker as a MindSpore ERROR log line, which launch reads (and hides)
    env["GLOG_v"] = str(min(3, int(env.get("GLOG_v", "3")))) if env.get("GLOG_v", "3").isdigit() else "3"
    return env


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (signal {-code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def last_line(path: Path) -> str:
    """What the worker said last: its msllm one-line error, else the exception a traceback ended with."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    for pattern in (MSLLM_ERROR, EXCEPTION):
        said = next((line for line in reversed(lines) if pattern.match(line)), None)
        if said:
            return said
    return ""


def rank_of(pid: int, log_dir: Path) -> int | None:
    for path in log_dir.glob("rank_*.pid"):
        try:
            if int(path.read_text()) == pid:
                return int(path.stem.split("_")[1])
        except (OSError, ValueError):
            continue
    return None


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def worker_pids(log_dir: Path) -> list[int]:
    pids = []
    for path in log_dir.glob("rank_*.pid"):
        try:
            pids.append(int(path.read_text()))
        except (OSError, ValueError):
            pass
    return pids


def kill_tree(proc: subprocess.Popen, log_dir: Path) -> None:
    """msrun, its scheduler and tail processes, and the workers (which msrun starts in sessions of their own)."""
    pids = descendants(proc.pid) + worker_pids(log_dir)
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


@dataclass
class Outcome:
    """How one start of the worker group ended."""
    code: int                  # the job's exit code: 0 finished, else non-zero
    message: str = ""          # the one error line, without "msllm launch: error: "
    rank: int | None = None    # the rank that died, when msrun named one
    cause: str = ""            # what happened to it: "was killed by SIGKILL (signal 9)", "exited with code 1 (...)"


def start_watchdog(proc: subprocess.Popen, log_dir: Path, hung: list) -> threading.Event:
    """Poll the workers' heartbeats (msllm/parallel/watchdog.py) until the returned event is set; on a
    hang, record it in `hung`, have the workers dump their stacks and stop the group."""
    done = threading.Event()

    def watch():
        while not done.wait(WATCH_EVERY_S):
            said = watchdog.stalled(log_dir)
            if said:
                hung.append(said)
                watchdog.dump_stacks(worker_pids(log_dir))
                kill_tree(proc, log_dir)
                return

    threading.Thread(target=watch, daemon=True).start()
    return done


def run_group(layout: Layout, args: list[str], log_dir: Path, timeout: int, verbose: bool) -> Outcome:
    """Start msrun once and wait for it; stop everything as soon as msrun reports a dead worker, or
    the watchdog a hung one."""
    command = msrun_command(layout, log_dir, timeout, args)
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*log_dir.glob("rank_*.pid"), *log_dir.glob("rank_*.beat")]:
        stale.unlink()
    proc = subprocess.Popen(command, env=worker_env(layout, log_dir, timeout),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    failure, hung = None, []
    watching = start_watchdog(proc, log_dir, hung)
    try:
        for line in proc.stdout:
            died = DIED.search(line)
            if died:
                failure = (int(died.group(1)), int(died.group(2)))
                time.sleep(1)  # let msrun stop the other workers; then stop msrun without its time-out wait
                kill_tree(proc, log_dir)
                break
            if verbose or not MINDSPORE_LOG.match(line):
                print(line, end="", flush=True)
        code = proc.wait()
    except KeyboardInterrupt:
        kill_tree(proc, log_dir)
        raise
    finally:
        watching.set()
    if hung:
        return Outcome(1, f"{hung[0]} ({log_dir})", None, hung[0])
    if failure is not None:
        pid, exit_code = failure
        rank = rank_of(pid, log_dir)
        log = log_dir / f"worker_{rank}.log" if rank is not None else log_dir
        said = last_line(log) if rank is not None and exit_code > 0 else ""
        who = f"rank {rank}" if rank is not None else f"worker pid {pid}"
        cause = f"{describe(exit_code)}{f' ({said})' if said else ''}"
        return Outcome(exit_code if exit_code > 0 else 1, f"{who} {cause}; its log: {log}", rank, cause)
    if code != 0:
        return Outcome(1, f"msrun exited with code {code} (the cluster did not form or its scheduler failed); "
                          f"see {log_dir}/scheduler.log and the worker logs there", None, f"msrun exited with code {code}")
    return Outcome(0)


def announce(layout: Layout, log_dir: Path) -> None:
    first = layout.node_rank * layout.nproc
    print(f"msllm launch: ranks {first}-{first + layout.nproc - 1} of {layout.world} on this node, logs in {log_dir}",
          file=sys.stderr, flush=True)


def launch(layout: Layout, args: list[str], log_dir: Path, timeout: int = 60, verbose: bool = False) -> int:
    """Run `msllm ARGS` on this node's workers; the exit code of the job (non-zero: one line on stderr)."""
    layout.check()
    announce(layout, log_dir)
    outcome = run_group(layout, args, log_dir, timeout, verbose)
    if outcome.code:
        print(f"msllm launch: error: {outcome.message}", file=sys.stderr, flush=True)
    return outcome.code


# ---- restarts ------------------------------------------------------------------------------------

BACKOFF_S = 2.0       # before the first restart; doubled for each further one
MAX_BACKOFF_S = 60.0
USER_ERROR = 2        # a worker's one-line msllm error (bad config, bad data): a restart would repeat it...
TRANSIENT = re.compile(r"no space left|disk quota exceeded", re.IGNORECASE)  # ...unless space may be freed


def newest_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint that verifies (what `train --resume` continues from), or None."""
    from msllm import checkpoint

    try:
        return checkpoint.read_state(checkpoint.latest(run_dir))["step"]
    except UserError:
        return None


def last_logged_step(run_dir: Path) -> int:
    """The last train step the run logged (metrics.jsonl): how far it got before the fault."""
    last = 0
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a row cut short by the crash
            if row.get("kind") == "train":
                last = max(last, int(row.get("step", 0)))
    except OSError:
        pass
    return last


def keep_logs(log_dir: Path, restart: int) -> Path:
    """Move the failed start's logs aside (msrun would overwrite them): log_dir/before_restart_K/."""
    kept = log_dir / f"before_restart_{restart}"
    kept.mkdir(parents=True, exist_ok=True)
    for path in log_dir.glob("*.log"):
        path.rename(kept / path.name)
    return kept


def launch_with_restarts(layout: Layout, args: list[str], resume_args: list[str], run_dir: Path, log_dir: Path,
                         max_restarts: int, timeout: int = 60, verbose: bool = False) -> int:
    """launch(), and when the group fails, restart every worker up to max_restarts times, each from the
    run's newest complete checkpoint (`resume_args`; `args` again while there is none), after a
    back-off. One line per restart, a row per restart in metrics.jsonl; the history when it gives up."""
    layout.check()
    if layout.nnodes > 1:
        raise LaunchError("--max-restarts: one node only (restarting every node needs a launcher on each to agree)")
    announce(layout, log_dir)
    history, command = [], args
    while True:
        outcome = run_group(layout, command, log_dir, timeout, verbose)
        if outcome.code == 0:
            if history:
                print(f"msllm launch: finished after {len(history)} restart{'s' if len(history) > 1 else ''}",
                      file=sys.stderr, flush=True)
            return 0
        print(f"msllm launch: error: {outcome.message}", file=sys.stderr, flush=True)
        if outcome.code == USER_ERROR and outcome.cause.startswith("exited") and not TRANSIENT.search(outcome.cause):
            return outcome.code  # the same input would fail the same way
        if len(history) == max_restarts:
            print(f"msllm launch: gave up after {max_restarts} restart{'s' if max_restarts != 1 else ''}: "
                  + "; ".join(history), file=sys.stderr, flush=True)
            return outcome.code
        restart = len(history) + 1
        step, reached = newest_step(run_dir), last_logged_step(run_dir)
        command = resume_args if step is not None else args
        backoff = min(BACKOFF_S * 2 ** (restart - 1), MAX_BACKOFF_S)
        who = f"rank {outcome.rank}" if outcome.rank is not None else "the group"
        lost = max(0, reached - (step or 0))
        kept = keep_logs(log_dir, restart)
        print(f"msllm launch: restart {restart}/{max_restarts} in {backoff:.0f} s: {who} {outcome.cause}; resuming "
              + (f"from step {step}" if step is not None else "from the start (no checkpoint yet)")
              + f", {lost} logged step{'s' if lost != 1 else ''} lost; logs of the failed start in {kept}",
              file=sys.stderr, flush=True)
        history.append(f"{restart}) {who} {outcome.cause} at step ~{reached}, resumed from step {step or 0}")
        with open(run_dir / "metrics.jsonl", "a") as metrics:  # no worker is running: nobody else writes it
            metrics.write(json.dumps({"kind": "restart", "restart": restart, "rank": outcome.rank,
                                      "cause": outcome.cause, "resumed_from": step or 0, "reached": reached,
                                      "lost_steps": lost, "backoff_s": backoff, "time": time.time()}) + "\n")
        time.sleep(backoff)
