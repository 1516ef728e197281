"""Building the kernel library: every .cc here compiled once per source version, build flags and CPU with
the system g++ into $MSLLM_CACHE/kernels (default ~/.cache/msllm/kernels), written to a temp file and
renamed, so a crash never leaves a half-written library behind. It targets -march=$MSLLM_KERNEL_MARCH
(default native: AVX-512 where the CPU has it, AVX2 on e.g. AMD EPYC); the file name hashes the flags and
the CPU's feature flags, so a home directory copied to another CPU rebuilds rather than loading code its
CPU may not run.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mindspore as ms

from msllm.errors import UserError
from msllm.staged import cache_root

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cc", "causal_conv.cc", "flash_attention.cc", "gated_delta_rule.cc", "grouped_matmul.cc",
                        "linear_cross_entropy.cc", "sgemm.cc", "cached_attention.cc")]
HEADERS = [Path(__file__).with_name(name) for name in ("common.h", "dnnl.h", "library.h", "panels.h")]
# -fno-math-errno lets sqrt vectorize, -fno-trapping-math the float compares of exp_approx's clamps and of
# max / select loops (without it GCC keeps them as branches: SwiGLU, GeGLU and the head's exps ran scalar).
# Neither changes a result; no -ffast-math: results stay IEEE (same as the portable path).
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC", "-pthread"]


def march() -> str:
    """The build's -march: $MSLLM_KERNEL_MARCH, default native (e.g. x86-64-v3 for an AVX2 build)."""
    return os.environ.get("MSLLM_KERNEL_MARCH", "native")


def flags(arch: str | None = None) -> list[str]:
    return [*FLAGS, f"-march={arch or march()}"]


class KernelBuildError(UserError, RuntimeError):
    pass


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: part of the cache key, since -march=native code may not run elsewhere."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def library_path(arch: str | None = None) -> Path:
    """Where the build for -march=`arch` (default march()) on this CPU is cached."""
    build = " ".join(flags(arch)).encode()
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(code + b"\0" + build + b"\0" + _cpu_flags()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def library(arch: str | None = None) -> str:
    """Path of the compiled kernel library for -march=`arch` (default march()), built on first use."""
    return _library(arch or march())


# the libraries library() gave in this process: the ones MindSpore may have loaded
given: set[str] = set()


@functools.lru_cache(maxsize=None)
def _library(arch: str) -> str:
    target = library_path(arch)
    given.add(str(target))
    if target.exists():
        return str(target)
    compiler = shutil.which("g++")
    if compiler is None:
        raise KernelBuildError("fused CPU kernels need g++ (apt install g++), or set train.fused_kernels: off")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags(arch), "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise KernelBuildError(f"building {SOURCES[0].parent}/*.cc failed: {first_error}; "
                                   f"set train.fused_kernels: off to train without it")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return str(target)


library.cache_clear = _library.cache_clear  # forget the paths built or found in this process


def enabled(mode: str = "auto") -> bool:
    """Whether to use the fused kernels: mode auto on the CPU backend with g++ present."""
    return (mode == "auto" and ms.get_context("device_target") == "CPU"
            and (library_path().exists() or shutil.which("g++") is not None))


def has_sgemm() -> bool:
    """Whether MindSpore's CPU backend carries oneDNN's dnnl_sgemm, which GroupedMatmul calls (its
    libdnnl.so.3, loaded with the backend)."""
    try:
        return hasattr(ctypes.CDLL(str(Path(ms.__file__).parent / "lib" / "libdnnl.so.3")), "dnnl_sgemm")
    except OSError:
        return False
