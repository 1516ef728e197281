"""msllm launch --max-restarts (issue 31): a worker killed by kill -9 mid-run, all workers restarted from
the newest complete checkpoint, one line per restart, a row per restart in metrics.jsonl, and the final
weights bit-identical to an uninterrupted run; the restart policy itself on a scripted group."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from msllm.parallel import launch as L
from tests.test_distributed import ENV, REPO, final_weights, launch_cmd, reference_run  # noqa: F401 (fixture)


def restart_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "restart"]


def test_a_killed_worker_is_restarted_from_the_newest_checkpoint_and_the_run_is_exact(tmp_path, corpus,
                                                                                      reference_run):
    run_dir = tmp_path / "faulty"
    proc = subprocess.Popen(launch_cmd(run_dir, corpus, extra=("--max-restarts", "2")), cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_0000040").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(int((run_dir / "logs" / "rank_1.pid").read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("msllm launch: restart")]
    found = re.fullmatch(r"msllm launch: restart 1/2 in 2 s: rank 1 was killed by SIGKILL \(signal 9\); resuming "
                         r"from step (\d+), (\d+) logged steps? lost; logs of the failed start in (.+)", line)
    assert found, line
    step, lost = int(found.group(1)), int(found.group(2))
    assert step >= 40 and step % 20 == 0                         # a checkpoint step, at or after the kill's
    assert (Path(found.group(3)) / "worker_1.log").is_file()     # the dead worker's log kept
    assert err.splitlines()[-1] == "msllm launch: finished after 1 restart"
    [row] = restart_rows(run_dir)
    assert (row["restart"], row["rank"], row["resumed_from"], row["lost_steps"]) == (1, 1, step, lost)
    assert row["cause"] == "was killed by SIGKILL (signal 9)"
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

    from msllm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^--set: train.max_restarts: must be >= 0"):
        load_config(None, ["train.max_restarts=-1"])
    with pytest.raises(L.LaunchError, match="--max-restarts: one node only"):
        L.launch_with_restarts(L.Layout(2, nnodes=2, master="127.0.0.1:8118"), ["train"], ["train"], tmp_path,
                               tmp_path / "logs", 1)
