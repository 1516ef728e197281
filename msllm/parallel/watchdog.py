"""Hang watchdog for `msllm launch`: a worker that stops making steps is a fault, like one that dies.

Each worker under launch writes a heartbeat file after every train step (log_dir/rank_N.beat:
its step, the time, and its own deadline: the larger of train.hang_timeout_s and 10x its recent
median step). The launcher polls them; when a rank's beat is older than its deadline it sends
every worker SIGCONT (a stopped one could not answer) and SIGUSR1, on which the workers dump
their Python stacks into their logs (faulthandler), then stops the group, which --max-restarts
restarts from the newest checkpoint. A rank blocked in a collective stops beating like the rank
it waits for, so the stacks, not the beats, tell which one hung.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections import deque
from pathlib import Path

MEDIAN_FACTOR = 10        # a step this many times the recent median is a hang...
FIRST_STEP_S = 1800.0     # ...except before the first step or eval (compile), which may take this long
STACK_DUMP_WAIT_S = 2.0   # for the workers to write their stacks before the group is stopped


def beat_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank_{rank}.beat"


class Heartbeat:
    """Worker side: `beat(step, step_s)` after each step; a no-op outside `msllm launch`."""

    def __init__(self, hang_timeout_s: float, rank: int):
        log_dir = os.environ.get("MSLLM_PID_DIR")
        self.path = beat_path(Path(log_dir), rank) if log_dir else None
        self.hang_timeout_s = hang_timeout_s
        self.recent = deque(maxlen=20)
        self.compiling = False

    def beat(self, step: int, step_s: float | None = None, compiling: bool = False) -> None:
        """After a step (step_s: its time), or after other work (a checkpoint, an eval) to say the
        worker is still alive. `compiling`: a graph compiles next (the first eval), on this rank or on
        one this rank waits for; the compile's allowance holds until the next timed step."""
        if self.path is None:
            return
        if step_s is not None:
            self.recent.append(step_s)
            self.compiling = False
        self.compiling = self.compiling or compiling
        if not self.recent or self.compiling:  # the compile's allowance
            deadline = max(self.hang_timeout_s, FIRST_STEP_S)
        else:
            deadline = max(self.hang_timeout_s, MEDIAN_FACTOR * statistics.median(self.recent))
        tmp = self.path.with_suffix(".beat.tmp")
        try:
            tmp.write_text(json.dumps({"step": step, "time": time.time(), "deadline_s": deadline}))
            os.replace(tmp, self.path)  # the launcher never reads half a file
        except OSError:  # a full disk: a missed beat, which the deadline judges, not a crash
            pass


def stalled(log_dir: Path, now: float | None = None) -> str | None:
    """Launcher side: what is hung, in words, or None. Ranks that have not beaten yet are not judged."""
    now = time.time() if now is None else now
    late = []
    for path in sorted(log_dir.glob("rank_*.beat")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        silent = now - beat["time"]
        if silent > beat["deadline_s"]:
            late.append((int(path.stem.split("_")[1]), beat["step"], silent, beat["deadline_s"]))
    if not late:
        return None
    ranks = ", ".join(str(rank) for rank, *_ in late)
    _, step, silent, deadline = max(late, key=lambda row: row[2])
    return (f"hung: rank{'s' if len(late) > 1 else ''} {ranks} made no step for {silent:.0f} s (deadline "
            f"{deadline:.0f} s) after step {step}; Python stacks in the worker logs")


def dump_stacks(pids: list[int]) -> None:
    """Wake every worker and ask it for its Python stacks (msllm_worker.py registers SIGUSR1)."""
    for sig in (signal.SIGCONT, signal.SIGUSR1):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(STACK_DUMP_WAIT_S)
