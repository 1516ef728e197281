"""msllm lint --compile: compile the configured train step, without running it, and turn a
MindSpore compile error into the user's `file:line` and one message.

MindSpore's compile errors are a message, a C++ call stack and "The Traceback of Net Construct
Code": `In file PATH:LINE` frames from the outermost Cell to the innermost. The innermost frame
outside MindSpore's own package is where the user's code went wrong.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from graph_opt.lint import Finding, display
from msllm.config import Config
from msllm.errors import UserError

FRAME = re.compile(r"In file (.+?):(\d+)(?:~\d+)?, \d+")
# Frames in these packages are msllm's own Cells: the user's line is the innermost frame outside them.
OWN_PACKAGES = [Path(__file__).resolve().parents[1] / name for name in ("msllm", "graph_opt", "interop")]


class CompileCheckError(UserError, RuntimeError):
    pass


def source_frames(text: str) -> list[tuple[Path, int]]:
    """(file, line) of the traceback frames outside MindSpore's package, outermost first, without repeats."""
    frames = []
    for path, line in FRAME.findall(text):
        if f"{os.sep}mindspore{os.sep}" in path or not path.endswith(".py"):
            continue
        frame = (Path(path), int(line))
        if frame not in frames:
            frames.append(frame)
    return frames


def error_message(text: str) -> str:
    """The first line of MindSpore's error that says what is wrong (not a log prefix or a rule)."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("[ERROR]", "[WARNING]", "----", "- ", "#")):
            quoted = len(line) > 1 and line[0] == line[-1] == "'"  # a construct's own raise, as MindSpore quotes it
            return line[1:-1] if quoted else line
    return "compile failed (no message)"


def compile_error_finding(error: BaseException, ir_dir: Path | None = None) -> Finding:
    """A MindSpore compile error as one `file:line: compile: message` finding: the innermost frame
    in the user's code (or in msllm's, when all of it is msllm's), naming the op's own line too."""
    text = str(error)
    frames = source_frames(text)
    message = error_message(text)
    ir = next(iter(sorted(Path(ir_dir).glob("**/analyze_fail.ir"))), None) if ir_dir else None
    fix = (f"MindSpore's analysis of the failed graph: {ir}" if ir else
           "run with train.mode: pynative to see the failing op with a Python traceback")
    if not frames:
        return Finding("<train step>", 0, "compile", message, fix)
    users = [f for f in frames if not any(f[0].resolve().is_relative_to(p) for p in OWN_PACKAGES)]
    path, line = users[-1] if users else frames[-1]
    if (path, line) != frames[-1]:
        message += f" (inside {display(frames[-1][0])}:{frames[-1][1]})"
    return Finding(display(path), line, "compile", message, fix)


def _train_step(cfg: Config):
    """The configured train step (what Trainer builds, without data)."""
    from msllm.train.build import build_train_step

    return build_train_step(cfg).train_step


def compile_train_step(cfg: Config, log=print) -> Finding | None:
    """Compile cfg's train step in GRAPH_MODE on its batch shape; None if it compiles."""
    from msllm import doctor

    need, free = doctor.train_memory_bytes(cfg.model), doctor.available_memory()
    if free and need > free:
        raise CompileCheckError(f"building this config's train step holds its weights and AdamW state in host "
                                f"memory: ~{doctor.human_bytes(need)}, {doctor.human_bytes(free)} available; check a "
                                f"smaller shape (--set model.num_layers=2 keeps every op of the step)")
    os.environ.setdefault("GLOG_v", "4")  # the error comes back as one finding; no log lines, no deprecations
    import mindspore as ms
    import numpy as np

    from msllm import device

    t = cfg.train
    device.setup(t.device, "graph", t.threads, t.jit_level)
    step = _train_step(cfg)
    tokens = ms.Tensor(np.zeros((t.batch_size * t.accum_steps, cfg.data.seq_len + 1), np.int32))
    # MindSpore writes analyze_fail.ir under the working directory: compile from a scratch one.
    scratch, cwd = Path(tempfile.mkdtemp(prefix="msllm-lint-")), Path.cwd()
    start, failure = time.perf_counter(), None
    try:
        os.chdir(scratch)
        step.compile(tokens)
    except Exception as e:  # MindSpore raises RuntimeError / TypeError / ValueError from the compiler
        failure = e
    finally:
        os.chdir(cwd)
    if failure is not None:
        return compile_error_finding(failure, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    log(f"msllm lint: compiled the train step ({cfg.model.num_layers} layers, batch {t.batch_size} x "
        f"{t.accum_steps}, seq {cfg.data.seq_len}, {t.precision}) in {time.perf_counter() - start:.1f} s")
    return None
