"""Production loop: precision, accumulation, recompute, corrupt checkpoints, faults, NaN guard."""
import functools
import json
import shutil
from typing import NamedTuple

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file

from msllm import checkpoint, device
from msllm.staged import DiskFullError
from msllm.config import ModelConfig, OptimConfig
from msllm.models.decoder import build_model
from msllm.train.build import build_train_step
from tests.conftest import REPO, leave_free, needed_bytes, run_cli, step_config, tiny_overrides
from tests.numerics import (FP16_RTOL, REORDER_RTOL, Recorded, assert_adamw_first_step, assert_close_to_scale,
                            weights)
from tests.test_train import sets

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64)
TOKENS = np.random.default_rng(0).integers(0, 256, (4, 33)).astype(np.int32)


class Run(NamedTuple):
    outs: list      # per step: loss, grad norm, lr, finite, loss scale
    grads: dict     # name -> the gradient AdamW applied at the last step (clipped, unscaled)
    weights: dict   # name -> value after the last step


def train_steps(steps=1, precision="fp32", accum=1, recompute="none", loss_scale=2.0 ** 16, fused=False,
                model: ModelConfig = CFG) -> Run:
    device.setup("cpu", "graph")
    # block_graph shared where it may be (it excludes recompute), so both paths are exercised
    cfg = step_config(model, OptimConfig(warmup_steps=1), steps=10, seed=0, precision=precision, accum_steps=accum,
                      recompute=recompute, loss_scale=loss_scale, fused_kernels="auto" if fused else "off",
                      block_graph="shared" if recompute == "none" else "inlined")
    built = build_train_step(cfg, wrap_optimizer=Recorded)
    outs = [[float(x.asnumpy()) for x in built.train_step(ms.Tensor(TOKENS))] for _ in range(steps)]
    return Run(outs, built.train_step.optimizer.gradients(), weights(built.model.trainable_params()))


# Each test runs with the portable ops and with msllm.kernels' fused CPU kernels.
@pytest.fixture(scope="module", params=[False, True], ids=["portable", "fused"])
def fused(request):
    return request.param


@functools.lru_cache(maxsize=None)
def reference_step(fused: bool) -> Run:
    """One fp32 step on the batch of 4: its loss, gradient and updated weights. Compiled and run once a
    session: the reference here and in tests/test_distributed.py (read it, never change it)."""
    return train_steps(fused=fused)


@pytest.fixture(scope="module")
def reference(fused):
    return reference_step(fused=fused)  # the key test_distributed.py uses too (lru_cache keys keywords apart)


def assert_same_step(run: Run, ref: Run, rtol: float) -> None:
    """Same loss and gradient norm (rtol of their value), the same applied gradient (rtol of each
    tensor's scale), and weights that differ only as AdamW's first step turns that gradient
    difference into a weight difference (numerics.adamw_step_bound: up to 2 lr where a gradient
    is within rounding of 0, which is what varies between CPUs)."""
    (loss, norm, lr, finite, _), (ref_loss, ref_norm, ref_lr, *_) = run.outs[0], ref.outs[0]
    assert finite == 1.0 and lr == ref_lr
    np.testing.assert_allclose([loss, norm], [ref_loss, ref_norm], rtol=rtol)
    assert_close_to_scale(run.grads, ref.grads, rtol)
    assert_adamw_first_step(run.weights, ref.weights, run.grads, ref.grads, lr)


def test_accumulation_equals_one_big_batch(reference, fused):
    """2 micro-batches of 2 give the step of one batch of 4. fp32; only the summation order differs
    (two sums of 2 sequences instead of one of 4), hence numerics.REORDER_RTOL."""
    assert_same_step(train_steps(accum=2, fused=fused), reference, REORDER_RTOL)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_keeps_gradients(reference, fused, mode):
    """Recomputing activations in backward runs the same forward kernels again: the same step."""
    assert_same_step(train_steps(recompute=mode, fused=fused), reference, REORDER_RTOL)


def test_fp16_trains_close_to_fp32_with_fp32_master_weights(reference, fused):
    """fp16 compute with loss scaling takes the fp32 step up to fp16 rounding (numerics.FP16_RTOL):
    the scale is divided out of the gradient, and the fp32 master weights get the update."""
    run = train_steps(precision="fp16", loss_scale=2.0 ** 16, fused=fused)
    assert run.outs[0][4] == 2.0 ** 16                                 # finite: scale kept
    assert_same_step(run, reference, FP16_RTOL)
    assert all(a.dtype == np.float32 for a in run.weights.values())


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(fused):
    before = {p.name: p.asnumpy() for p in build_model(CFG, seed=0).trainable_params()}
    run = train_steps(steps=2, precision="fp16", loss_scale=2.0 ** 40, fused=fused)
    assert [o[3] for o in run.outs] == [0.0, 0.0]                     # both steps non-finite
    assert [o[4] for o in run.outs] == [2.0 ** 40, 2.0 ** 39]         # scale halves per overflow
    assert all(np.array_equal(before[n], run.weights[n]) for n in before)  # weights untouched
    assert not any(g.any() for g in run.grads.values())               # the optimizer was never called


def test_bf16_is_refused_on_cpu(tmp_path, corpus):
    proc = run_cli("train", *sets(tiny_overrides(tmp_path / "r", corpus, **{"train.precision": "bf16"})))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("msllm train: error: train.precision: bf16 has no MatMul")


def test_checkpoints_keep_last_k_and_skip_corrupt(tmp_path, corpus):
    run = tmp_path / "run"
    proc = run_cli("train", *sets(tiny_overrides(run, corpus, **{"train.ckpt_every": 1, "train.keep_checkpoints": 2,
                                                               "train.steps": 4, "train.eval_every": 4})))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_0000003", "step_0000004"]
    manifest = json.loads((run / "checkpoints" / "step_0000004" / "manifest.json").read_text())
    assert set(manifest) == {"model.safetensors", "optim.safetensors", "state.json"}
    newest = run / "checkpoints" / "step_0000004" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF                                                   # flip one byte of a weight
    newest.write_bytes(bytes(data))
    resumed = run_cli("train", "--resume", str(run), "--set", "train.steps=5")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipping corrupt checkpoint" in resumed.stderr and "step_0000004: model.safetensors checksum" in resumed.stderr
    assert "at step 3" in resumed.stderr


def test_resume_refuses_a_different_model_and_missing_files(tmp_path, corpus):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny_overrides(run, corpus, **{"train.steps": 3}))).returncode == 0
    proc = run_cli("train", "--resume", str(run), "--set", "model.hidden_size=32")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"msllm train: error: {run}/checkpoints/step_0000003/state.json: model.hidden_size: "
        "is 64 in the checkpoint but 32 now; a resumed run must keep the model and data settings"]
    shutil.rmtree(run / "checkpoints")
    proc = run_cli("train", "--resume", str(run))
    assert proc.returncode == 2 and "no checkpoint found" in proc.stderr.strip().splitlines()[-1]


def test_nonfinite_guard_stops_with_a_checkpoint(tmp_path, corpus):
    run = tmp_path / "run"
    proc = run_cli("train", *sets(tiny_overrides(run, corpus, **{
        "train.precision": "fp16", "train.loss_scale": 2.0 ** 100, "train.max_bad_steps": 2})))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "2 consecutive non-finite steps (last at step 2)" in last and "--resume" in last
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_0000002"]
    # Located when the guard stopped the run: the fp16 gradient overflows after the loss.
    report = json.loads((run / "nonfinite" / "report.json").read_text())
    assert (report["step"], report["phase"], report["cell"]) == (2, "backward", "output")
    assert [line for line in proc.stderr.splitlines() if line.startswith("non-finite:")] == [
        f"non-finite: {report['summary']}; report {run}/nonfinite/report.json"]


def test_full_disk_keeps_the_previous_checkpoint(small_disk):
    """Out of space mid-checkpoint: one-line error naming the dir and the space a checkpoint needs,
    no temporary dir left, and the previous checkpoint still the newest that verifies."""
    from mindspore import Parameter, Tensor

    params = [Parameter(Tensor(np.ones((64, 512), np.float32)), name="w")]  # 128 KiB per copy
    first = checkpoint.save(small_disk, 1, params, [], {"config": {}})
    leave_free(small_disk, 64 * 1024)  # half of one more checkpoint
    with pytest.raises(DiskFullError) as e:
        checkpoint.save(small_disk, 2, params, [], {"config": {}})
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{small_disk / 'checkpoints' / 'step_0000002'}: no space left")
    assert needed_bytes(message) >= 64 * 512 * 4
    assert checkpoint.latest(small_disk) == first
    assert [p.name for p in (small_disk / "checkpoints").iterdir()] == [first.name]


def test_an_unchanged_checkpoint_is_hashed_once(tmp_path, monkeypatch):
    """Loading a checkpoint again (every `msllm generate`) does not re-read its weights for the
    sha256 check; a file changed since, even to the same size, is read again and caught."""
    from mindspore import Parameter, Tensor

    from msllm import staged

    monkeypatch.setenv("MSLLM_CACHE", str(tmp_path / "cache"))
    params = [Parameter(Tensor(np.ones((64, 512), np.float32)), name="w")]
    ckpt = checkpoint.save(tmp_path / "run", 1, params, [], {"config": {}})
    hashed = []
    real_sha256 = staged.sha256
    monkeypatch.setattr(staged, "sha256", lambda path: hashed.append(path.name) or real_sha256(path))
    assert checkpoint.latest(tmp_path / "run") == ckpt
    assert checkpoint.MODEL_FILE in hashed
    hashed.clear()
    assert checkpoint.latest(ckpt) == ckpt and hashed == []
    weights = ckpt / checkpoint.MODEL_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{checkpoint.MODEL_FILE} checksum mismatch"):
        checkpoint.latest(ckpt)
    assert hashed == [checkpoint.MODEL_FILE]


def test_non_finite_weights_are_never_saved(tmp_path):
    from mindspore import Parameter, Tensor

    w = np.ones((4, 4), np.float32)
    w[1, 2] = np.nan
    with pytest.raises(checkpoint.CheckpointError, match="layers.0.w has non-finite"):
        checkpoint.save(tmp_path, 1, [Parameter(Tensor(w), name="layers.0.w")], [], {"config": {}})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_background_checkpoints_equal_synchronous_ones_and_survive_a_full_disk(tmp_path, corpus, monkeypatch):
    """Checkpoints written in a thread from host copies while training goes on hold exactly what a
    synchronous save holds; a write that runs out of space is a warning line, the run goes on, the
    next checkpoint is written, and the failed step leaves nothing behind."""
    import errno
    import time

    from msllm.config_file import load_config
    from msllm.train.trainer import Trainer

    def run(name, background, fail_step=None):
        cfg = load_config(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path / name, corpus, **{
            "train.ckpt_every": 2, "train.keep_checkpoints": 5, "train.eval_every": 6,
            "train.background_checkpoint": background}))
        real = checkpoint.save_file

        def save_file(arrays, path):
            if fail_step is not None and f"step_{fail_step:07d}" in path:
                raise OSError(errno.ENOSPC, "No space left on device", path)
            if background:
                time.sleep(0.5)  # slower than the steps that follow: they must not change what is written
            real(arrays, path)

        monkeypatch.setattr(checkpoint, "save_file", save_file)
        Trainer(cfg).fit()
        return tmp_path / name

    sync, background = run("sync", False), run("background", True, fail_step=4)
    assert [p.name for p in checkpoint.list_checkpoints(sync)] == ["step_0000002", "step_0000004", "step_0000006"]
    assert [p.name for p in checkpoint.list_checkpoints(background)] == ["step_0000002", "step_0000006"]
    assert not list((background / "checkpoints").glob(".*"))  # no temporary dir of the failed write
    for step in (2, 6):
        for name in (checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE):
            a = load_file(str(sync / "checkpoints" / f"step_{step:07d}" / name))
            b = load_file(str(background / "checkpoints" / f"step_{step:07d}" / name))
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (step, name)
    rows = [json.loads(line) for line in (background / "metrics.jsonl").read_text().splitlines()]
    written = [r["step"] for r in rows if r["kind"] == "checkpoint"]
    failed = [r for r in rows if r["kind"] == "checkpoint_failed"]
    assert written == [2, 6] and [r["step"] for r in failed] == [4] and "no space left" in failed[0]["error"]
    assert all(r["background"] and r["write_s"] > 0 and r["stall_s"] >= 0 for r in rows if r["kind"] == "checkpoint")


def test_metrics_survive_a_full_disk(small_disk, capsys):
    """Rows that cannot be written while the disk is full cost one warning line, not the run, and
    logging goes on once there is room (TensorBoard's events too: no writer thread to die)."""
    from msllm.metrics import MetricsLogger

    metrics = MetricsLogger(small_disk)
    metrics.log({"kind": "train", "step": 1, "loss": 2.0})
    leave_free(small_disk, 0)
    for step in range(2, 200):  # ~20 kB of rows: more than the page metrics.jsonl already has
        metrics.log({"kind": "train", "step": step, "loss": 1.0, "note": "x" * 64})
    (small_disk / "filler").unlink()
    metrics.log({"kind": "train", "step": 500, "loss": 0.5})
    metrics.close()
    assert capsys.readouterr().err.count("warning: metrics not written (No space left on device)") == 1
    rows = (small_disk / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[0])["step"] == 1 and json.loads(rows[-1]) == {"kind": "train", "step": 500, "loss": 0.5}
    assert (small_disk / "tensorboard").stat().st_size and any((small_disk / "tensorboard").iterdir())
