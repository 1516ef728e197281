"""msllm doctor: the screen, what a config needs (exit 1), and bad input (exit 2)."""
import platform
import re
import shutil
from importlib import metadata

from msllm import doctor
from msllm.config import ModelConfig
from tests.conftest import run_cli

LABELS = ["python", "packages", "devices", "msrun", "g++", "kernels", "cpu", "threads", "memory", "disk"]


def test_screen_names_versions_devices_cpu_memory_and_disk():
    done = run_cli("doctor", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr  # without a config nothing is `needed`
    lines = done.stdout.splitlines()
    assert lines[0].startswith("msllm doctor (msllm ")
    assert [line.split()[0] for line in lines[1:len(LABELS) + 1]] == LABELS
    rows = {line.split()[0]: line for line in lines[1:]}
    assert platform.python_version() in rows["python"]
    assert f"mindspore {metadata.version('mindspore')}" in rows["packages"]
    assert "CPU yes" in rows["devices"]
    assert ("g++ not found" in rows["g++"]) == (shutil.which("g++") is None)
    flags = open("/proc/cpuinfo").read()
    assert ("AVX2 yes" in rows["cpu"]) == (" avx2" in flags)
    free = doctor.available_memory()
    shown = float(re.search(r"memory\s+([\d.]+) GiB available", rows["memory"]).group(1))
    assert abs(shown - free / 2**30) < 0.5  # the same reading, taken a moment apart
    assert re.search(r"run dir runs/tiny: [\d.]+ [GM]iB free", rows["disk"])
    assert lines[-1] == "problems: none" or lines[-1].startswith("  ! ")
    assert done.stderr == ""  # no MindSpore log lines or deprecation warnings on the screen


def test_config_needs_are_marked_and_exit_1(tmp_path):
    done = run_cli("doctor", "--set", f"data.path={tmp_path / 'no-corpus'}", "--set", "model.num_layers=4096",
                   "--set", "model.hidden_size=16384", "--set", "model.ffn_size=65536", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    needed = [line for line in done.stdout.splitlines() if "[needed]" in line]
    assert any(f"data.path: {tmp_path / 'no-corpus'} does not exist" in line for line in needed)
    params = ModelConfig(num_layers=4096, hidden_size=16384, ffn_size=65536).num_params()
    gib = params * 16 / 2**30
    assert any(f"training needs >= {gib:.1f} GiB" in line for line in needed), needed
    assert re.search(rf"config\s+<defaults>: {params / 1e6:,.1f}M parameters", done.stdout)


def test_bad_config_is_one_line_exit_2(tmp_path):
    done = run_cli("doctor", "--config", str(tmp_path / "missing.yaml"), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"msllm doctor: error: {tmp_path / 'missing.yaml'}: <file>: cannot read: " \
                          f"No such file or directory\n"


def test_memory_and_sizes():
    assert doctor.train_memory_bytes(ModelConfig()) == ModelConfig().num_params() * 16
    assert doctor.human_bytes(3 * 2**30) == "3.0 GiB" and doctor.human_bytes(5 * 2**20) == "5 MiB"
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    assert 0 < doctor.available_memory() <= available * 1.1
