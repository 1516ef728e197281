import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GLOG_v", "3")  # MindSpore: errors only

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def mindspore_runtime():
    """Set the process's MindSpore context before any test runs a kernel: thread settings are
    refused once the runtime is up, and tests that build Cells without msllm.device would start it."""
    from msllm import device

    device.setup("cpu", "graph")


def step_config(model, optim=None, **train):
    """A Config for msllm.train.build.build_train_step: the model and optim sections as given, train.* keywords."""
    from msllm.config import Config, OptimConfig, TrainConfig

    return Config(model=model, optim=optim or OptimConfig(), train=TrainConfig(**train))


def msrun_env() -> dict:
    """The environment a test's msrun workers get: this tree's msllm, the venv's msrun and python first."""
    return {**os.environ, "GLOG_v": "3", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO)}


def run_under_msrun(script: Path, out: Path, workers: int = 2, args: tuple = (), timeout: float = 300) -> None:
    """`msrun` `workers` local workers of `script OUT *args` (logs in OUT/logs); fails with the last worker's log.

    A start that fails with no Python traceback in any worker's log is retried once, on a fresh port:
    MindSpore 2.10's cluster layer has crashed there (a segfault in libmindspore_cluster.so's receive
    loop, right after the workers connected; once in the 2026-11-26 CI). The script's own failures (a
    traceback), and a second failed start, fail the test."""
    from msllm.parallel.launch import free_port

    for attempt in (1, 2):
        cmd = [str(Path(sys.executable).with_name("msrun")), "--worker_num", str(workers), "--local_worker_num",
               str(workers), "--master_port", str(free_port()), "--log_dir", str(out / "logs"), "--join", "True",
               "--cluster_time_out", "60", str(script), str(out), *args]
        done = subprocess.run(cmd, cwd=REPO, env=msrun_env(), capture_output=True, text=True, timeout=timeout)
        logs = [path.read_text(errors="replace") for path in sorted((out / "logs").glob("worker_*.log"))]
        if done.returncode == 0 or attempt == 2 or any("Traceback" in log for log in logs):
            break
        shutil.rmtree(out / "logs")
    assert done.returncode == 0, (out / "logs" / f"worker_{workers - 1}.log").read_text()[-3000:]


# test module -> the worker modules whose results it reads (tests/workers.py runs each one's main); for
# train_worker the module's two_worker_commands(out, *session fixtures) gives the `msllm` commands
WORKERS = {"tests.test_distributed": ("dp_worker", "train_worker"),
           "tests.test_context_parallel": ("cp_worker", "train_worker"), "tests.test_moe": ("ep_worker",),
           "tests.test_dpo": ("train_worker",), "tests.test_grpo": ("train_worker",)}


@pytest.fixture(scope="session")
def msrun_workers(request, tmp_path_factory) -> Path:
    """The worker modules whose results this session's tests read (all of WORKERS' in CI) on the 2 workers of
    one msrun launch (tests/workers.py: one start-up, cluster join and teardown for all, ~20 s a launch).
    OUT/<worker>/ holds each one's results; OUT/ep_worker/ also the one-process runs ep_worker's resume starts
    from, and OUT/train_worker/<test module>/ that module's inputs and runs (both written first, here)."""
    from msllm import device
    from tests import ep_worker

    device.setup("cpu", "graph")
    readers = sorted({item.module for item in request.session.items if "msrun_workers" in item.fixturenames},
                     key=lambda module: module.__name__)
    wanted = {name for m in readers for name in WORKERS[m.__name__]}
    names = [name for name in ("dp_worker", "cp_worker", "ep_worker", "train_worker") if name in wanted]
    out = tmp_path_factory.mktemp("msrun_workers")
    for name in names:
        (out / name).mkdir()
    if "ep_worker" in names:
        ep_worker.write_one_process(out / "ep_worker")
    if "train_worker" in names:
        commands = []
        for module in readers:
            if "train_worker" in WORKERS[module.__name__]:
                mine = out / "train_worker" / module.__name__.rpartition(".")[2]
                mine.mkdir()
                make = module.two_worker_commands  # its arguments after `out` name session fixtures, as a test's
                commands += make(mine, *map(request.getfixturevalue, list(inspect.signature(make).parameters)[1:]))
        write_commands(out / "train_worker", commands)
    # all of them: ~14 min on a 2-core machine at load ~10 (3-4 min quiet, by the CI times before), give it room
    run_under_msrun(REPO / "tests" / "workers.py", out, args=names, timeout=1500)
    return out


def write_commands(out: Path, commands: list[list]) -> None:
    """OUT/commands.json: the `msllm` argument lists tests/train_worker.py runs."""
    (out / "commands.json").write_text(json.dumps([[str(a) for a in args] for args in commands]))


def assert_same_files(made: Path, want: Path) -> None:
    """Every file under `made` is byte for byte the one at its place under `want`: inputs written twice (for a
    test module and for the shared msrun launch) are the same inputs."""
    differ = [str(f.relative_to(made)) for f in sorted(made.rglob("*")) if f.is_file()
              and f.read_bytes() != (want / f.relative_to(made)).read_bytes()]
    assert not differ, f"{made} and {want} differ in {differ}"


def msllm_under_msrun(out: Path, commands: list[list], workers: int = 2) -> None:
    """The `msllm` commands (argument lists), one after the other, on `workers` workers of one msrun launch
    (tests/train_worker.py: one start-up for all of them); logs in OUT/logs."""
    write_commands(out, commands)
    run_under_msrun(REPO / "tests" / "train_worker.py", out, workers)


def tiny_overrides(run_dir: Path, corpus: Path, **extra) -> list[str]:
    """--set overrides for a seconds-long CPU run on a small corpus."""
    values = {
        "model.vocab_size": 384, "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.ffn_size": 128, "model.max_seq_len": 64,
        "data.path": str(corpus), "data.seq_len": 32, "data.val_fraction": 0.1,
        "train.run_dir": str(run_dir), "train.steps": 6, "train.batch_size": 4, "train.log_every": 1,
        "train.eval_every": 3, "train.eval_batches": 2, "train.ckpt_every": 3, "train.sample_tokens": 0,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~200 KB of real Python source copied from the stdlib: a small user-style data dir."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    total = 0
    for name in sorted(root.glob("*.py")):
        if total > 200_000:
            break
        (out / name.name).write_bytes(name.read_bytes())
        total += name.stat().st_size
    return out


def run_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "msllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "GLOG_v": "3"})


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a write that does not fit fails with ENOSPC, as on a full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs permission to mount a tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def leave_free(disk: Path, nbytes: int) -> None:
    """Fill `disk` with a file so that only about `nbytes` stay free."""
    (disk / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - nbytes))


def needed_bytes(message: str) -> float:
    """The space a disk-full message says the output needs ("(1.2 MB needed" / "(34 kB needed")."""
    import re

    number, unit = re.search(r"\(([\d.]+) (MB|kB) needed", message).groups()
    return float(number) * (1e6 if unit == "MB" else 1e3)


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory, corpus) -> Path:
    """tests/test_export.py's LLAMA as a run dir (random weights and biases, a tokenizer), made once
    for the modules that export or generate from it; they read it and never write into it."""
    from tests.test_export import LLAMA, make_run

    return make_run(tmp_path_factory.mktemp("llama"), LLAMA, corpus)


EXPORT_BY_CLI = ("import sys; from msllm.cli import main; code = main(sys.argv[1:]); "
                 "print(sorted(m for m in ('mindspore', 'torch') if m in sys.modules)); sys.exit(code)")


@pytest.fixture(scope="session")
def llama_exports(llama_run, tmp_path_factory):
    """fmt -> (export dir, the CompletedProcess that wrote it): llama_run exported once per format and
    session by `msllm export` (the CLI's main() in a process without GLOG_v, which prints last whether
    it imported MindSpore or torch). Tests read these dirs (copy them to change anything)."""
    made = {}

    def get(fmt: str):
        if fmt not in made:
            out = tmp_path_factory.mktemp(f"llama-{fmt}") / "export"
            env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG")}
            proc = subprocess.run([sys.executable, "-c", EXPORT_BY_CLI, "export", "--ckpt", str(llama_run), "--format",
                                   fmt, "--out", str(out)], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            made[fmt] = (out, proc)
        return made[fmt]

    return get


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, corpus) -> Path:
    """120 uninterrupted steps on 2 workers at micro-batch 2 (global batch 4), checkpoints every 20
    (tests/test_distributed.py's launch_cmd): the run tests/test_distributed.py and
    tests/test_restarts.py compare against, made once per session. Tests copy it, never write into it."""
    from tests.test_distributed import launch_cmd, run

    run_dir = tmp_path_factory.mktemp("launch") / "ref"
    run(launch_cmd(run_dir, corpus))
    return run_dir
