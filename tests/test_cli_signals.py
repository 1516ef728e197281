"""Ctrl-C during train / convert / export: one line, exit 130, no temporary files left; and MindSpore's
log stays off the terminal unless --verbose. Each runs the real CLI in a subprocess without GLOG_v."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from tests.test_train import sets


def start(*args, cwd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG")}
    return subprocess.Popen([sys.executable, "-m", "msllm.cli", *map(str, args)], cwd=cwd, text=True,
                            env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def interrupt_when(proc: subprocess.Popen, ready, timeout=120) -> tuple[str, str]:
    """Send SIGINT once ready() is true; return (stdout, stderr) after the process ends."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "never got ready"
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=60)


def temp_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if "tmp" in p.name]


def assert_interrupted(proc, err, command):
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "[WARNING]" not in err and "[ERROR]" not in err, err[-3000:]
    assert err.splitlines()[-1] == f"msllm {command}: interrupted"


def test_ctrl_c_during_training(tmp_path, corpus):
    run = tmp_path / "run"
    proc = start("train", *sets(tiny_overrides(run, corpus, **{"train.steps": 100000, "train.ckpt_every": 50,
                                                               "train.eval_every": 100000})), cwd=tmp_path)
    _, err = interrupt_when(proc, lambda: (run / "checkpoints" / "step_0000050").is_dir())  # mid-training
    assert_interrupted(proc, err, "train")
    assert not temp_files(tmp_path)


def test_ctrl_c_during_convert(tmp_path):
    from tests.hf_models import build

    src = tmp_path / "hf"  # ~180 MB, so the conversion takes long enough to be interrupted
    build("llama2_mha", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
          num_key_value_heads=8, num_hidden_layers=6, head_dim=64).save_pretrained(src)
    proc = start("convert", src, tmp_path / "out", "--dtype", "bf16", cwd=tmp_path)
    _, err = interrupt_when(proc, lambda: any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir()))
    assert_interrupted(proc, err, "convert")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.fixture(scope="module")
def run_dir(llama_run):
    """tests/test_export.py's LLAMA run, made once per session (tests/conftest.py)."""
    return llama_run


def test_ctrl_c_during_export(run_dir, tmp_path):
    proc = start("export", "--ckpt", run_dir, "--format", "mindir", "--out", tmp_path / "out", cwd=tmp_path)
    _, err = interrupt_when(proc, lambda: (tmp_path / ".out.tmp").is_dir())
    assert_interrupted(proc, err, "export")
    assert list(tmp_path.iterdir()) == []


def test_mindspore_log_only_with_verbose(run_dir, tmp_path):
    quiet = start("generate", "--ckpt", run_dir, "--max-new-tokens", "2", cwd=tmp_path)
    out, err = quiet.communicate(timeout=300)
    assert quiet.returncode == 0 and out
    [summary] = err.splitlines()  # generate's one summary line, nothing of MindSpore's log
    assert summary.startswith("msllm generate: 2 prompt tokens, 2 new tokens")
    verbose = start("generate", "--verbose", "--ckpt", run_dir, "--max-new-tokens", "2", cwd=tmp_path)
    out, err = verbose.communicate(timeout=300)
    assert verbose.returncode == 0 and "[WARNING] ME" in err and "deprecated" in err
