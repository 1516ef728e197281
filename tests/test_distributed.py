"""Data parallel on CPU, executed: msrun with 2 workers, through tests/dp_worker.py (the compiled step)
and through `msllm launch` (the whole trainer: data order, checkpoints, resume, faults, several nodes)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from msllm.models.decoder import build_model
from tests.conftest import REPO, msrun_env, tiny_overrides
from tests.dp_worker import CFG, STEPS
from tests.numerics import REORDER_RTOL, U32, assert_close_to_scale, decoder_rtol

VARIANTS = ("dp", "dp_portable", "zero", "overflow")
ENV = msrun_env()


@pytest.fixture(scope="module")
def ranks(msrun_workers):
    """variant -> [rank 0's results, rank 1's results] of tests/dp_worker.py under msrun."""
    out = msrun_workers / "dp_worker"
    return {v: [dict(np.load(out / f"{v}_rank{r}.npz")) for r in range(2)] for v in VARIANTS + ("loss_rows",)}


def picked(result: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_ranks_stay_bitwise_equal(ranks, variant):
    zero, one = ranks[variant]
    assert zero.keys() == one.keys()
    differ = [k for k in zero if k != "outs" and not np.array_equal(zero[k], one[k])]
    assert not differ
    # loss, grad norm, lr, finite (under overflow the loss and norm are each rank's own scale's inf / nan)
    columns = [2, 3] if variant == "overflow" else [0, 1, 2, 3]
    np.testing.assert_array_equal(zero["outs"][:, columns], one["outs"][:, columns])


def test_two_workers_at_b_equal_one_worker_at_2b(ranks):
    """The all-reduced step on 2 x 2 rows is the one-process step on 4 rows up to summation order
    (two means of 2 sequences summed instead of one mean of 4): tests.numerics.REORDER_RTOL."""
    from tests.test_robustness import Run, assert_same_step, reference_step

    reference = reference_step(fused=True)
    got = ranks["dp"][0]
    assert_same_step(Run([got["outs"][0].tolist()], picked(got, "grad1/"), picked(got, "weight1/")), reference,
                     REORDER_RTOL)


def test_zero1_equals_plain_data_parallel(ranks):
    """ZeRO-1 applies the same all-reduced gradient, times a clip coefficient whose norm another
    kernel summed (the fused one in plain DP): equal to a few ulps. Its AdamW arithmetic runs chunk
    by chunk in MindSpore ops rather than in the fused kernel, so the updated weights differ only by
    the rounding of that arithmetic: a few ulps of the weight and of the lr-sized update."""
    dp, zero = ranks["dp"][0], ranks["zero"][0]
    for name, g in picked(dp, "grad1/").items():
        np.testing.assert_allclose(zero[f"grad1/{name}"], g, rtol=8 * U32, atol=0)
    lr = dp["outs"][0][2]
    for name, w in picked(dp, "weight1/").items():
        bound = 8 * U32 * (np.abs(w) + lr)
        assert (np.abs(zero[f"weight1/{name}"] - w) <= bound).all(), name
    np.testing.assert_allclose(zero["outs"][:, 0], dp["outs"][:, 0], rtol=REORDER_RTOL)  # the losses of all steps


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(ranks):
    """Rank 1's loss scale (2^40) overflows fp16, rank 0's (2^10) does not: the summed gradient is
    non-finite on both, so both skip every step, keep their weights and halve their scales."""
    initial = {p.name: p.asnumpy() for p in build_model(CFG, seed=0).trainable_params()}
    for rank, start in ((0, 2.0 ** 10), (1, 2.0 ** 40)):
        result = ranks["overflow"][rank]
        assert result["outs"][:, 3].tolist() == [0.0] * STEPS
        assert result["outs"][:, 4].tolist() == [start / 2 ** i for i in range(STEPS)]
        for name, w in initial.items():
            np.testing.assert_array_equal(result[f"weight/{name}"], w)


def test_loss_rows_share_a_capacity_and_train_as_all_positions(ranks):
    """SFT windows with train.head_rows loss on 2 workers (tests/dp_worker.py run_loss_rows): rank 0's batch
    alone needs 64 rows and rank 1's 96, and both take 96 (one graph: the all-reduce meets); the ranks stay
    bitwise equal, and the loss and applied gradients are those of all positions."""
    zero, one = ranks["loss_rows"]
    assert zero["rows/shape"].tolist() == one["rows/shape"].tolist() == [2, 48]
    assert not [k for k in zero if k.startswith("rows/") and not np.array_equal(zero[k], one[k])]
    loss_rtol, grad_rtol = decoder_rtol(CFG, 128, 64)
    np.testing.assert_allclose(zero["rows/outs"][0], zero["all/outs"][0], rtol=loss_rtol)
    assert_close_to_scale(picked(zero, "rows/grad1/"), picked(zero, "all/grad1/"), grad_rtol)


# --- msllm launch: the whole trainer on 2 workers -------------------------------------------------

def launch_cmd(run_dir: Path, corpus: Path, *train_args, nproc=2, extra=()) -> list[str]:
    sets = tiny_overrides(run_dir, corpus, **{"train.steps": 120, "train.ckpt_every": 20, "train.eval_every": 120,
                                              "train.log_every": 20, "train.batch_size": 2,
                                              "train.keep_checkpoints": 10})
    return [sys.executable, "-m", "msllm.cli", "launch", "--nproc", str(nproc), "--timeout", "30", *extra,
            "--", "train", *[a for s in sets for a in ("--set", s)], *train_args]


def run(cmd, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def final_weights(run_dir: Path, step: int = 120) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


def losses(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


# reference_run (120 uninterrupted steps on 2 workers, launch_cmd's settings): tests/conftest.py, made
# once per session for this module and tests/test_restarts.py.


def test_launch_names_a_killed_worker_within_seconds(tmp_path, corpus):
    """Without --max-restarts the job stops, naming the dead rank and its log; that a resumed run ends
    bit-identical to an uninterrupted one is tests/test_restarts.py's (the same kill, restarted)."""
    run_dir = tmp_path / "faulty"
    proc = subprocess.Popen(launch_cmd(run_dir, corpus), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid_file = run_dir / "logs" / "rank_1.pid"
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_0000020").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    killed = time.time()
    _, err = proc.communicate(timeout=120)
    assert time.time() - killed < 60
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert "rank 1 was killed by SIGKILL" in last and str(run_dir / "logs" / "worker_1.log") in last, err[-2000:]
    assert list((run_dir / "checkpoints").glob("step_*"))       # at least the step-20 checkpoint survived


def copy_run_until(src: Path, dst: Path, step: int) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("logs"))
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    return dst


def two_worker_commands(out: Path, reference_run: Path) -> list[list]:
    """test_resume_at_another_world_size's runs: reference_run continued from step 60 on 1 worker (OUT/one, here,
    before conftest's shared msrun launch; its stderr in OUT/one.stderr), and from that run's step 80 on the
    launch's 2 workers with ZeRO-1 (OUT/two)."""
    one = copy_run_until(reference_run, out / "one", 60)
    (out / "one.stderr").write_text(run([sys.executable, "-m", "msllm.cli", "train", "--resume", str(one)]).stderr)
    two = copy_run_until(one, out / "two", 80)      # step 80 was written by the 1-worker run
    return [["train", "--resume", two, "--set", "train.batch_size=2", "--set", "parallel.optimizer_shard=true",
             "--set", "train.threads=1"]]


def test_resume_at_another_world_size(msrun_workers, reference_run):
    """2 workers at b = 2 -> 1 worker (accum_steps raised to 2 by itself: a relaunch on fewer workers needs no
    batch arithmetic), and (via a 1-worker start) 1 -> 2 workers with ZeRO-1: the same samples in the same
    steps, so the loss curve continues as the reference's up to summation order."""
    out = msrun_workers / "train_worker" / "test_distributed"   # two_worker_commands' runs
    want = losses(reference_run)
    one, two = out / "one", out / "two"
    assert ("resuming a 2-worker run on 1: train.accum_steps 1 -> 2 keeps the global batch of 4"
            in (out / "one.stderr").read_text())
    for run_dir in (one, two):
        got = losses(run_dir)
        steps = [s for s in got if s > 60]
        # measured: 2.3e-7 after 60 steps; another data order would differ by ~1e-2
        np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)
    optim = load_file(str(two / "checkpoints" / "step_0000120" / "optim.safetensors"))
    weights = final_weights(two)
    assert all(optim[f"exp_avg.{k}"].shape == w.shape for k, w in weights.items())   # saved whole, not sharded


def test_resume_refuses_another_global_batch(tmp_path, reference_run):
    run_dir = copy_run_until(reference_run, tmp_path / "r", 20)  # global batch 4: 3 per worker cannot make it
    done = subprocess.run([sys.executable, "-m", "msllm.cli", "train", "--resume", str(run_dir), "--set",
                           "train.batch_size=3"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "global batch" in done.stderr and "train.batch_size=4" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.fixture
def second_host():
    """A network namespace with its own address, 10.77.0.2, reaching this host at 10.77.0.1: a second
    node on this machine. (msrun starts a scheduler on every node whose own address is --master, so
    two "nodes" that both have 127.0.0.1 cannot be simulated with loopback alone.)"""
    ns, here, there = f"msllm{os.getpid()}", f"msa{os.getpid()}", f"msb{os.getpid()}"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
             ["ip", "link", "set", there, "netns", ns], ["ip", "addr", "add", "10.77.0.1/24", "dev", here],
             ["ip", "link", "set", here, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", "10.77.0.2/24", "dev", there],
             ["ip", "netns", "exec", ns, "ip", "link", "set", there, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot simulate a second host here ({' '.join(step)}: {done.stderr.strip()})")
        yield ["ip", "netns", "exec", ns]
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): ~31 s, beyond CI's budget")
def test_two_nodes_train_as_the_one_node_run(tmp_path, corpus, reference_run, second_host):
    from msllm.parallel.launch import free_port

    run_dir, master = tmp_path / "nodes", f"10.77.0.1:{free_port()}"
    nodes = [launch_cmd(run_dir, corpus, nproc=1, extra=("--nnodes", "2", "--node-rank", str(rank), "--master", master))
             for rank in (0, 1)]
    node1 = subprocess.Popen(second_host + nodes[1], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    run(nodes[0])
    _, err = node1.communicate(timeout=120)
    assert node1.returncode == 0, err[-2000:]
    want, got = final_weights(reference_run), final_weights(run_dir)
    assert all(np.array_equal(got[k], want[k]) for k in want)   # the same ranks, the same sums
