"""msllm doctor: one screen about this machine and install, to paste into an issue.

Versions, the device targets this MindSpore can use, the Ascend environment, msrun, g++ and the
fused-kernel cache, CPU model and flags, threads, memory and disk. Each problem is listed with
its fix. With a config, the problems that config runs into are marked `[needed]`, and any of
them makes the exit status 1.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from msllm.config import Config, ModelConfig
from msllm.staged import cache_root

PACKAGES = {  # distribution -> what needs it
    "mindspore": "everything",
    "numpy": "everything",
    "torch": "msllm convert / verify against Hugging Face",
    "transformers": "msllm convert / verify against Hugging Face",
    "onnx": "msllm export --format onnx",
    "onnxruntime": "msllm export --format onnx, msllm generate --engine onnxruntime",
}
TESTED_MINDSPORE = "2.10.0"
ASCEND_HOME = Path("/usr/local/Ascend")
CANN_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
AVX512_SHOWN = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
BYTES_PER_PARAM_TRAIN = 16  # fp32 weight, gradient and the two AdamW moments
BYTES_PER_PARAM_CKPT = 12   # fp32 weight and the two AdamW moments


@dataclass
class Problem:
    what: str
    fix: str
    needed: bool = False  # the given config cannot run without this fixed

    def __str__(self) -> str:
        return f"  ! {self.what}{' [needed]' if self.needed else ''}; fix: {self.fix}"


@dataclass
class Screen:
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def row(self, label: str, text: str) -> None:
        self.lines.append(f"{label:<12} {text}")

    def problem(self, what: str, fix: str, needed: bool = False) -> None:
        self.problems.append(Problem(what, fix, needed))


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def train_memory_bytes(model: ModelConfig) -> int:
    """Lower bound of the memory to train `model`: weights, gradients, AdamW moments
    (activations come on top and depend on batch and sequence length)."""
    return model.num_params() * BYTES_PER_PARAM_TRAIN


def available_memory() -> int:
    """Bytes available to this process: MemAvailable, capped by a cgroup limit (containers); 0 if unknown."""
    free = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        return 0
    limit = _cgroup_memory_limit()
    return min(free, limit) if limit else free


def _cgroup_memory_limit() -> int:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 reports "no limit" as a huge number
            return int(text)
    return 0


def _which(name: str) -> str | None:
    """On PATH, or beside this Python (a venv's bin dir is not on PATH when run as venv/bin/python)."""
    local = Path(sys.executable).parent / name
    return shutil.which(name) or (str(local) if local.exists() else None)


# --- the sections of the screen, top to bottom -------------------------------------------------
def packages(s: Screen, strict: bool) -> dict[str, str | None]:
    versions = {}
    for dist in PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
            s.problem(f"{dist} is not installed (needed by {PACKAGES[dist]})",
                      "pip install -e . in the msllm checkout (or tools/setup_env.sh)",
                      needed=strict and dist in ("mindspore", "numpy"))
    s.row("python", f"{platform.python_version()} ({sys.executable}), {platform.platform()}")
    s.row("packages", ", ".join(f"{d} {v or 'missing'}" for d, v in versions.items()))
    ms_version, np_version = versions["mindspore"], versions["numpy"]
    if ms_version and ms_version != TESTED_MINDSPORE:
        s.problem(f"mindspore {ms_version}: msllm is tested with {TESTED_MINDSPORE}",
                  f"pip install mindspore=={TESTED_MINDSPORE}")
    if np_version and int(np_version.split(".")[0]) >= 2:
        s.problem(f"numpy {np_version}: the mindspore {TESTED_MINDSPORE} wheel is built against numpy 1.x",
                  "pip install 'numpy<2'", needed=strict)
    return versions


def devices(s: Screen, device: str, strict: bool) -> dict[str, bool]:
    """Which device targets this MindSpore install can use (its plugins load at import)."""
    try:
        import mindspore  # noqa: F401
        from mindspore._c_expression import MSContext  # hal.is_available says the same, with log warnings
    except Exception as e:  # a broken install: say so instead of failing the whole screen
        s.problem(f"import mindspore failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                  f"pip install --force-reinstall mindspore=={TESTED_MINDSPORE}", needed=strict)
        return {}
    ctx = MSContext.get_instance()
    found = {target: bool(ctx.is_pkg_support_device(target)) for target in ("CPU", "GPU", "Ascend")}
    why = {"GPU": " (CUDA plugin not loaded)" if _which("nvidia-smi") else " (no NVIDIA driver: no nvidia-smi)",
           "Ascend": _ascend_plugin_error(ctx.load_plugin_error())}
    s.row("devices", "; ".join(f"{t} {'yes' if ok else 'no' + why.get(t, '')}" for t, ok in found.items()))
    wanted = {"cpu": "CPU", "gpu": "GPU", "ascend": "Ascend"}[device]
    if strict and not found[wanted]:
        fix = (f"install CANN and `{CANN_ENV}` before msllm" if wanted == "Ascend"
               else "install MindSpore's GPU build and an NVIDIA driver")
        s.problem(f"train.device: {device} is not available in this MindSpore install",
                  f"{fix}, or set train.device: cpu", needed=True)
    return found


def _ascend_plugin_error(plugin_error: str) -> str:
    """From "Load dynamic library: libmindspore_ascend.so.2 failed. libge_runner.so: cannot open shared...":
    the library that is missing."""
    for line in plugin_error.splitlines():
        if "ascend" in line and "cannot open shared object file" in line:
            lib = line.split("failed.")[-1].split(":")[0].strip()
            return f" ({lib} not found: CANN not installed or its set_env.sh not sourced)"
    return ""


def ascend(s: Screen, device: str) -> None:
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("ASCEND_")}
    if not (env or ASCEND_HOME.exists() or device == "ascend"):
        return
    toolkit = ASCEND_HOME / "ascend-toolkit" / "latest"
    cann = _version_in(toolkit / "version.cfg", toolkit / "compiler" / "version.info")
    driver = _version_in(ASCEND_HOME / "driver" / "version.info")
    s.row("ascend", f"CANN {cann or 'not found'}; driver {driver or 'not found'}; "
                    f"npu-smi {_which('npu-smi') or 'not found'}; "
                    + (", ".join(f"{k}={v}" for k, v in env.items()) or "no ASCEND_* variables"))
    if device == "ascend" and not env:
        s.problem("no ASCEND_* environment variables (CANN's environment is not set)", CANN_ENV, needed=True)


def _version_in(*paths: Path) -> str:
    for path in paths:
        try:
            for line in path.read_text().splitlines():
                if "version" in line.lower() and "=" in line:
                    return line.split("=", 1)[1].strip()
        except OSError:
            continue
    return ""


def tools(s: Screen, cpu_available: bool, fused_kernels: str) -> None:
    msrun = _which("msrun")
    s.row("msrun", msrun or "not found")
    if not msrun:
        s.problem("msrun not found (MindSpore's multi-process launcher)", f"put {Path(sys.executable).parent} on PATH")
    gxx = _which("g++")
    s.row("g++", f"{gxx} {_output([gxx, '-dumpfullversion'])}" if gxx else "not found")
    if cpu_available:
        s.row("kernels", _kernel_cache(s, bool(gxx), fused_kernels))


def _kernel_cache(s: Screen, has_gxx: bool, mode: str) -> str:
    from msllm import kernels

    if mode == "off":
        return f"off (train.fused_kernels: off); cache {kernels.cache_dir()}"
    if kernels.library_path().exists():
        return f"built for this CPU: {kernels.library_path()}"
    if not has_gxx:
        s.problem("no g++: the fused CPU kernels cannot be built, CPU training uses the slower portable ops",
                  "apt install g++")
        return "not built, and no g++ to build them"
    return f"not built yet: g++ compiles them at the first CPU training run, into {kernels.cache_dir()}"


def _output(cmd: list) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu(s: Screen, threads: int) -> None:
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            model = value if key == "model name" else model
            flags = set(value.split()) if key == "flags" and not flags else flags
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    avx512 = [f for f in AVX512_SHOWN if f in flags]
    s.row("cpu", f"{model}, {platform.machine()}, {cores} usable cores"
                 + (f" (cgroup quota {quota:g})" if quota else "")
                 + f"; AVX2 {'yes' if 'avx2' in flags else 'no'}; AVX-512 "
                 + (f"yes ({', '.join(avx512)})" if avx512 else "no"))
    if platform.machine() == "x86_64" and flags and "avx2" not in flags:
        s.problem("CPU without AVX2: MindSpore's CPU kernels and msllm's fused kernels run without their "
                  "vector paths", "train on a CPU with AVX2, or on Ascend")

    runtime = threads or os.cpu_count() or 1  # what msllm.device.setup gives MindSpore
    variables = ", ".join(f"{k}={os.environ[k]}" for k in THREAD_VARIABLES if k in os.environ)
    s.row("threads", f"MindSpore runtime {runtime} ({'train.threads' if threads else 'train.threads: 0 = all cores'})"
                     f"; {variables or 'no OMP/MKL/OpenBLAS variables'}")
    usable = max(1, min(cores, int(quota)) if quota else cores)
    if runtime > usable:
        s.problem(f"{runtime} MindSpore threads on {usable} usable cores: they compete and steps slow down",
                  f"set train.threads: {usable}")


def _cgroup_cpu_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return int(quota) / int(period) if quota != "max" else None
    except (OSError, ValueError):
        return None


def memory_and_disk(s: Screen, run_dir: Path) -> tuple[int, int]:
    free_mem, limit = available_memory(), _cgroup_memory_limit()
    s.row("memory", f"{human_bytes(free_mem)} available" + (f" (cgroup limit {human_bytes(limit)})" if limit else ""))
    cache = cache_root()
    free_run, free_cache = (shutil.disk_usage(_existing_parent(p)).free for p in (run_dir, cache))
    s.row("disk", f"run dir {run_dir}: {human_bytes(free_run)} free; cache {cache}: {human_bytes(free_cache)} free")
    if free_run < 1 << 30:
        s.problem(f"under 1 GiB free for {run_dir}", "free disk space or set train.run_dir elsewhere")
    return free_mem, free_run


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def config_needs(s: Screen, cfg: Config, name: str | None, free_mem: int, free_disk: int) -> None:
    m, t, d = cfg.model, cfg.train, cfg.data
    mem = train_memory_bytes(m)
    disk = m.num_params() * BYTES_PER_PARAM_CKPT * (t.keep_checkpoints + 1)
    where = "host memory" if t.device == "cpu" else "device memory before parallel sharding"
    s.row("config", f"{name or '<defaults>'}: {m.num_params() / 1e6:,.1f}M parameters, {t.device} {t.mode} "
                    f"{t.precision}; needs >= {human_bytes(mem)} {where}, {human_bytes(disk)} disk for "
                    f"{t.keep_checkpoints} checkpoints")
    if t.device == "cpu" and free_mem and mem > free_mem:
        s.problem(f"training needs >= {human_bytes(mem)} for weights, gradients and AdamW moments, "
                  f"{human_bytes(free_mem)} available", "a smaller model, or a machine with more memory", needed=True)
    if disk > free_disk:
        s.problem(f"{t.keep_checkpoints} checkpoints (+1 being written) need {human_bytes(disk)}, "
                  f"{human_bytes(free_disk)} free for {t.run_dir}",
                  "free disk space, lower train.keep_checkpoints or move train.run_dir", needed=True)
    if t.precision == "bf16" and t.device == "cpu":
        s.problem("train.precision: bf16 has no MatMul kernel on CPU in MindSpore 2.10",
                  "use fp32 or fp16 on CPU, bf16 on Ascend", needed=True)
    for key, value in (("data.path", d.path), ("data.tokenizer", d.tokenizer)):
        if value is not None and not Path(value).exists():
            s.problem(f"{key}: {value} does not exist", f"set {key} to an existing path", needed=True)


def report(cfg: Config | None = None, config_name: str | None = None) -> Screen:
    """The whole screen; with cfg, its needs are checked too and their problems marked needed."""
    s, strict = Screen(), cfg is not None
    t = (cfg or Config()).train
    versions = packages(s, strict)
    found = devices(s, t.device, strict) if versions["mindspore"] else {}
    ascend(s, t.device)
    tools(s, found.get("CPU", False), t.fused_kernels)
    cpu(s, t.threads)
    free_mem, free_disk = memory_and_disk(s, Path(t.run_dir))
    if cfg is not None:
        config_needs(s, cfg, config_name, free_mem, free_disk)
    return s


def main(cfg: Config | None, config_name: str | None) -> int:
    from msllm import __version__

    s = report(cfg, config_name)
    print(f"msllm doctor (msllm {__version__})")
    print("\n".join(s.lines))
    print(f"problems ({len(s.problems)}):\n" + "\n".join(map(str, s.problems)) if s.problems else "problems: none")
    return 1 if any(p.needed for p in s.problems) else 0
