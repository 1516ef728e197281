"""End to end: msllm train on a small corpus, checkpoint, resume, generate, bad device."""
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.conftest import run_cli, tiny_overrides


def sets(overrides):
    return [a for kv in overrides for a in ("--set", kv)]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("straight")
    proc = run_cli("train", *sets(tiny_overrides(run, corpus, **{"train.sample_tokens": 4})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_train_logs_evaluates_and_checkpoints(straight_run):
    run, proc = straight_run
    assert "first step (compile + run)" in proc.stdout
    assert "--- sample (greedy) ---" in proc.stdout  # generation from the model the train step trained
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 3, 4, 5, 6]  # step 1 is the "compile" record
    assert [r["step"] for r in records if r["kind"] == "compile"] == [1]
    # fp32, nothing skipped, and the logged lr is the schedule's (warmup 30 of the default config).
    assert all(r["loss_scale"] == 1.0 and r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in train)
    assert [r["lr"] for r in train] == pytest.approx([3e-3 * s / 30 for s in range(2, 7)], rel=1e-6)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and evals[-1]["val_loss"] < np.log(384)
    assert list((run / "tensorboard").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000003", "step_0000006"]
    state = json.loads((run / "checkpoints" / "step_0000006" / "state.json").read_text())
    assert state["step"] == 6 and state["data_position"] == 24


def losses(run):
    """step -> loss; a step logged twice (re-run after a resume) keeps its last record."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] in ("train", "compile")}


def test_resume_is_bit_identical(straight_run, tmp_path, corpus):
    """Also: the resumed run calls one shared block graph, the straight one inlines the blocks."""
    straight, _ = straight_run
    run = tmp_path / "resumed"
    first = run_cli("train", *sets(tiny_overrides(run, corpus, **{"train.steps": 3, "train.block_graph": "shared"})))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train", "--resume", str(run), "--set", "train.steps=6")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 3" in second.stderr
    assert losses(run) == losses(straight)                  # the whole loss curve, exactly
    a = load_file(str(straight / "checkpoints" / "step_0000006" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_0000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    for name in ("model.safetensors", "optim.safetensors"):
        x = load_file(str(straight / "checkpoints" / "step_0000006" / name))
        y = load_file(str(run / "checkpoints" / "step_0000006" / name))
        assert all(np.array_equal(x[n], y[n]) for n in x), name


def test_generate_from_run(straight_run):
    run, _ = straight_run
    # The end-of-training sample (4 greedy tokens from the trained Cells) continues as generate does
    # from the checkpoint (sampling and repeatability: tests/test_generate.py).
    four = run_cli("generate", "--ckpt", str(run), "--prompt", "def ", "--max-new-tokens", "4")
    assert four.returncode == 0, four.stderr[-2000:]
    assert four.stdout.startswith("def ") and f"--- sample (greedy) ---\n{four.stdout.strip()}\n---" in straight_run[1].stdout


def test_unavailable_device_is_one_line(tmp_path, corpus):
    proc = run_cli("train", "--device", "ascend", *sets(tiny_overrides(tmp_path / "r", corpus)))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("msllm train: error: device 'ascend' is not available")
    assert "available: cpu" in proc.stderr


def test_resume_without_run_dir_is_one_line(tmp_path):
    proc = run_cli("train", "--resume", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "not found; --resume takes a run dir" in proc.stderr


def test_compile_cache_is_filled_and_reused(tmp_path, corpus):
    cache = tmp_path / "cache"
    runs = [run_cli("train", *sets(tiny_overrides(tmp_path / f"r{i}", corpus, **{
        "train.compile_cache": str(cache), "train.steps": 2}))) for i in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert any(p.is_file() for p in cache.rglob("*"))
    assert losses(tmp_path / "r0") == losses(tmp_path / "r1")
