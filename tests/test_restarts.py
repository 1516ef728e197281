"""msllm launch --max-restarts (issue 31): a worker killed by kill -9 mid-run, then (after that restart)
a worker stopped by SIGSTOP, which the hang watchdog catches: each time all workers restart from the
newest complete checkpoint, one line per restart, a row per restart in metrics.jsonl, the hung
workers' Python stacks in their logs, and the final weights bit-identical to an uninterrupted run;
the restart policy itself on a scripted group."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from msllm.parallel import launch as L
from tests.test_distributed import ENV, REPO, final_weights, launch_cmd  # reference_run: tests/conftest.py


def restart_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "restart"]


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240) -> None:
    until(path.exists, proc, seconds, path.name)


def until(ready, proc: subprocess.Popen, seconds: float = 240, what: str = "the awaited state") -> None:
    deadline = time.time() + seconds
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before {what}"
    assert ready(), f"no {what} after {seconds} s"


def pid_of(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def beat_step(path: Path) -> int:
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def test_a_killed_and_a_hung_worker_are_restarted_and_the_run_is_exact(tmp_path, corpus, reference_run):
    run_dir = tmp_path / "faulty"
    logs = run_dir / "logs"
    proc = subprocess.Popen(launch_cmd(run_dir, corpus, "--set", "train.hang_timeout_s=10",
                                       extra=("--max-restarts", "3")),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(run_dir / "checkpoints" / "step_0000040", proc)
    first_rank_0 = int((logs / "rank_0.pid").read_text())
    os.kill(int((logs / "rank_1.pid").read_text()), signal.SIGKILL)
    wait_for(logs / "before_restart_1", proc)
    # The restarted group's rank 0 a few steps in (its pid and beat files are new: each start removes the old
    # ones; before its second step a rank still has the compile's 30-minute allowance): a hang there leaves
    # ~75 steps undone whatever the machine's speed.
    until(lambda: pid_of(logs / "rank_0.pid") not in (None, first_rank_0) and beat_step(logs / "rank_0.beat") >= 45,
          proc)
    os.kill(int((logs / "rank_0.pid").read_text()), signal.SIGSTOP)  # a hang: alive, silent
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("msllm launch: restart")]
    assert len(lines) == 2, err[-3000:]
    killed = re.fullmatch(r"msllm launch: restart 1/3 in 2 s: rank 1 was killed by SIGKILL \(signal 9\); resuming "
                          r"from step (\d+), (\d+) logged steps? lost; logs of the failed start in (.+)", lines[0])
    assert killed, lines[0]
    step, lost = int(killed.group(1)), int(killed.group(2))
    assert step >= 40 and step % 20 == 0                         # a checkpoint step, at or after the kill's
    assert (Path(killed.group(3)) / "worker_1.log").is_file()    # the dead worker's log kept
    hung = re.fullmatch(r"msllm launch: restart 2/3 in 4 s: the group hung: ranks? [0-9, ]+ made no step for (\d+) s "
                        r"\(deadline 10 s\) after step (\d+); Python stacks in the worker logs; resuming from step "
                        r"(\d+), .* logs of the failed start in (.+)", lines[1])
    assert hung, lines[1]
    assert 10 <= int(hung.group(1)) < 30 and int(hung.group(3)) >= step
    stacks = [(Path(hung.group(4)) / f"worker_{r}.log").read_text(errors="replace") for r in (0, 1)]
    # faulthandler's dump; a rank caught in its C++ teardown (it had just finished) has no Python frame to show
    assert any("most recent call first" in text for text in stacks)
    assert err.splitlines()[-1] == "msllm launch: finished after 2 restarts"
    rows = restart_rows(run_dir)
    assert [(r["restart"], r["rank"], r["resumed_from"]) for r in rows] == [(1, 1, step), (2, None, int(hung.group(3)))]
    assert rows[0]["lost_steps"] == lost and rows[1]["cause"].startswith("hung: ")
    want, got = final_weights(reference_run), final_weights(run_dir)
    assert all(np.array_equal(got[k], want[k]) for k in want)   # bit for bit


def test_restart_policy_back_off_resume_and_giving_up(tmp_path, monkeypatch, capsys):
    """A scripted group: the first start dies before any checkpoint (restarted with the original
    arguments), later ones after a step-20 checkpoint (restarted with --resume); back-off doubles; after the
    allowed restarts the history is printed and the exit code is the last failure's."""
    run_dir, starts, slept = tmp_path / "run", [], []
    (run_dir / "logs").mkdir(parents=True)
    checkpoint_at = []

    def group(layout, args, log_dir, timeout, verbose):
        starts.append(args)
        (log_dir / "worker_0.log").write_text(f"start {len(starts)}\n")
        (run_dir / "metrics.jsonl").open("a").write(json.dumps({"kind": "train", "step": 10 * len(starts)}) + "\n")
        return L.Outcome(1, "rank 0 was killed; its log: x", 0, "was killed by SIGKILL (signal 9)")

    monkeypatch.setattr(L, "run_group", group)
    monkeypatch.setattr(L, "newest_step", lambda d: checkpoint_at[-1] if checkpoint_at else None)
    monkeypatch.setattr(L.time, "sleep", lambda s: (slept.append(s), checkpoint_at.append(20)))
    code = L.launch_with_restarts(L.Layout(2), ["train", "--config", "c"], ["train", "--resume", str(run_dir)],
                                  run_dir, run_dir / "logs", max_restarts=3)
    assert code == 1
    # the checkpoint appears during the first back-off: start 2 still begins afresh, 3 and 4 resume
    assert starts == [["train", "--config", "c"]] * 2 + [["train", "--resume", str(run_dir)]] * 2
    assert slept == [2.0, 4.0, 8.0]
    err = capsys.readouterr().err.splitlines()
    assert [x.split(":")[1].strip() for x in err if x.startswith("msllm launch: restart")] == \
        ["restart 1/3 in 2 s", "restart 2/3 in 4 s", "restart 3/3 in 8 s"]
    assert "resuming from the start (no checkpoint yet), 10 logged steps lost" in err[2]
    assert err[-1] == ("msllm launch: gave up after 3 restarts: 1) rank 0 was killed by SIGKILL (signal 9) at step "
                       "~10, resumed from step 0; 2) rank 0 was killed by SIGKILL (signal 9) at step ~20, resumed "
                       "from step 20; 3) rank 0 was killed by SIGKILL (signal 9) at step ~30, resumed from step 20")
    rows = restart_rows(run_dir)
    assert [(r["restart"], r["resumed_from"], r["lost_steps"]) for r in rows] == [(1, 0, 10), (2, 20, 0), (3, 20, 10)]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["before_restart_1", "before_restart_2",
                                                                     "before_restart_3", "worker_0.log"]
    assert (run_dir / "logs" / "worker_0.log").read_text() == "start 4\n"  # the last start's, where its error points
    assert (run_dir / "logs" / "before_restart_2" / "worker_0.log").read_text() == "start 2\n"


def test_a_workers_own_error_is_not_restarted(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    starts = []
    monkeypatch.setattr(L, "run_group", lambda *a: starts.append(a) or L.Outcome(
        2, "rank 0 exited with code 2 (msllm train: error: data.path: not found); its log: x", 0,
        "exited with code 2 (msllm train: error: data.path: not found)"))
    assert L.launch_with_restarts(L.Layout(2), ["train"], ["train", "--resume", "r"], run_dir, run_dir / "logs", 3) == 2
    assert len(starts) == 1 and "restart" not in capsys.readouterr().err


def test_max_restarts_config_key_is_validated_and_several_nodes_are_refused(tmp_path):
    import pytest

    from msllm.config import ConfigError

    from msllm.config_file import load_config

    with pytest.raises(ConfigError, match=r"^--set: train.max_restarts: must be >= 0"):
        load_config(None, ["train.max_restarts=-1"])
    with pytest.raises(L.LaunchError, match="--max-restarts: one node only"):
        L.launch_with_restarts(L.Layout(2, nnodes=2, master="127.0.0.1:8118"), ["train"], ["train"], tmp_path,
                               tmp_path / "logs", 1)


def test_watchdog_judges_each_rank_by_its_own_deadline(tmp_path, monkeypatch):
    """Heartbeat deadlines: the compile's allowance before the first step, then the larger of
    train.hang_timeout_s and 10x the median step; `stalled` names the late ranks only."""
    from msllm.parallel import watchdog

    monkeypatch.setenv("MSLLM_PID_DIR", str(tmp_path))
    beats = [watchdog.Heartbeat(30.0, rank) for rank in (0, 1)]
    beats[0].beat(0)
    assert json.loads(watchdog.beat_path(tmp_path, 0).read_text())["deadline_s"] == watchdog.FIRST_STEP_S
    for step, seconds in enumerate([0.1, 9.0, 8.0, 7.0], 1):   # median 7.5 s: deadline 75 s
        beats[0].beat(step, seconds)
    beats[1].beat(4, 0.5)                                      # 10 x 0.5 < 30: deadline 30 s
    beat = json.loads(watchdog.beat_path(tmp_path, 0).read_text())
    assert beat["step"] == 4 and beat["deadline_s"] == 75.0
    now = beat["time"]
    assert watchdog.stalled(tmp_path, now + 29) is None
    assert watchdog.stalled(tmp_path, now + 40) == ("hung: rank 1 made no step for 40 s (deadline 30 s) after step 4; "
                                                     "Python stacks in the worker logs")
    assert watchdog.stalled(tmp_path, now + 80).startswith("hung: ranks 0, 1 made no step for 80 s (deadline 75 s)")
    # the first eval compiles a graph: its allowance holds through the beats after it, until a timed step
    beats[1].beat(4, compiling=True)
    beats[1].beat(4)
    assert json.loads(watchdog.beat_path(tmp_path, 1).read_text())["deadline_s"] == watchdog.FIRST_STEP_S
    beats[1].beat(5, 0.5)
    assert json.loads(watchdog.beat_path(tmp_path, 1).read_text())["deadline_s"] == 30.0
    monkeypatch.delenv("MSLLM_PID_DIR")
    watchdog.Heartbeat(30.0, 0).beat(1, 1.0)                   # outside msllm launch: nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0.beat", "rank_1.beat"]


def test_only_workers_note_their_pid(tmp_path):
    """msrun starts its scheduler with the workers' script and RANK_ID 0: were it to write rank_0.pid, a race
    with rank 0 could leave the scheduler's pid there, and launch (or this file's hang test) would stop the
    scheduler instead of rank 0."""
    script = REPO / "msllm" / "parallel" / "entry" / "msllm_worker.py"
    for role in ("MS_SCHED", "MS_WORKER"):
        env = dict(ENV, MS_ROLE=role, RANK_ID="0", MSLLM_PID_DIR=str(tmp_path))
        proc = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        written = pid_of(tmp_path / "rank_0.pid")
        if role == "MS_SCHED":
            assert written is None
        else:
            assert written is not None and written > 0
