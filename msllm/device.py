"""The one place that knows about CPU / GPU / Ascend differences.

Everything else in msllm is device-neutral: it asks this module for the context.
"""
from __future__ import annotations

import os

import mindspore as ms

from msllm.errors import UserError

TARGETS = {"cpu": "CPU", "gpu": "GPU", "ascend": "Ascend"}


class DeviceError(UserError, RuntimeError):
    pass


def available_devices() -> list[str]:
    from mindspore import hal  # probes the installed backend plugins

    found = []
    for name, target in TARGETS.items():
        try:
            if hal.is_available(target):
                found.append(name)
        except Exception:  # a missing plugin raises on some builds instead of returning False
            pass
    return found


def setup(device: str = "cpu", mode: str = "graph", threads: int = 0, jit_level: str = "O0",
          compile_cache: str | None = None) -> None:
    """Select device, execution mode, thread count, JIT level and compile cache for this process."""
    if device not in TARGETS:
        raise DeviceError(f"unknown device {device!r}; choose one of {', '.join(TARGETS)}")
    if device != "cpu":  # CPU is always built in; probing the others is slow and noisy
        avail = available_devices()
        if device not in avail:
            raise DeviceError(f"device {device!r} is not available in this MindSpore install "
                              f"(available: {', '.join(avail)}); set train.device accordingly")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE,
                   jit_config={"jit_level": jit_level})
    try:
        ms.set_device(TARGETS[device])
    except RuntimeError:  # set before in this process: under msrun with the id its cluster gave this worker
        if ms.get_current_device().device_target != TARGETS[device]:
            raise
    if compile_cache:
        use_compile_cache(compile_cache)
    if device == "cpu":
        ms.set_context(runtime_num_threads=threads or os.cpu_count() or 1)


def use_compile_cache(path: str) -> None:
    """MindSpore's compile cache in `path`, from the next compile on. MindSpore does not tell one
    network from another of the same code: give each model its own dir."""
    ms.set_context(enable_compile_cache=True, compile_cache_path=str(path))


def compute_dtype(precision: str, device: str):
    """The matmul dtype for train.precision on this device."""
    if precision == "bf16" and device == "cpu":
        # Measured: MindSpore 2.10 has no bf16 MatMul kernel on CPU.
        raise DeviceError("train.precision: bf16 has no MatMul kernel on CPU in MindSpore 2.10; "
                          "use fp16 (with loss scaling) or fp32 on CPU, bf16 on Ascend")
    return {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}[precision]
