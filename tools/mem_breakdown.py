"""Where a train step's peak RSS comes from, on CPU: counted parts beside measured phases.

    python tools/mem_breakdown.py --shape gemma3-270m --kind full
    python tools/mem_breakdown.py --shape gemma3-270m --kind lora --ablate

One process per run (random weights, tools/bench_big_vocab.py's shapes and SFT batch: 8 packed rows x
128 tokens, ~20 % loss positions). Counted: fp32 weights (4 B x parameters), gradients and AdamW's
two moments (4 + 8 B x trainable parameters), the planner's activation estimate
(msllm.layout.plan.estimate on the CPU profile; it counts fp32 logits whole), and the head's logits
as the logits path would hold them (logits, their softmax and gradient: 3 x 4 B x tokens x vocab).
Measured (RSS sampled every 5 ms, and ru_maxrss): after MindSpore's import and context; after the
model is built; after the step is built (LoRA, specialisation, optimizer state); the first step
(compile + run) and the steady steps after it. MindSpore's memory statistics
(mindspore.runtime.memory_stats) are all zero on the CPU backend (MindSpore 2.10), so what the
graph keeps is read from the first step's growth over the built state, not from a per-tensor report.

--ablate also runs the step with the logits computed whole (layers.HEAD_CHUNK_BYTES raised) and
with every position through the head (train.head_rows all), so the head's and the loss rows' share
of the peak are differences of measured runs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 2 ** 20


class RSS:
    """The process's RSS sampled every 5 ms in a thread: peak() since the last mark()."""

    def __init__(self):
        self._peak, self._stop = 0, False
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB

    def _run(self):
        while not self._stop:
            self._peak = max(self._peak, self.now())
            time.sleep(0.005)

    def mark(self) -> float:
        self._peak = now = self.now()
        return now

    def peak(self) -> float:
        return max(self._peak, self.now())


def worker(args) -> dict:
    rss = RSS()
    sys.path.insert(0, str(REPO))
    import mindspore as ms
    import numpy as np

    from interop.hf_config import to_model_config
    from msllm import device
    from msllm.config import Config, DataConfig, LoraConfig, OptimConfig, TrainConfig
    from msllm.data.loader import head_rows
    from msllm.layout import plan
    from msllm.models import layers
    from msllm.models.decoder import build_model
    from msllm.train.build import build_train_step
    from tools.bench_big_vocab import SHAPES, TARGETS, batch

    device.setup("cpu", "graph", args.threads)
    if args.whole_head:
        layers.HEAD_CHUNK_BYTES = 1 << 62
    phases = {"runtime (import, context)": rss.mark()}
    import transformers
    config_class, _, values = SHAPES[args.shape]
    m = to_model_config(getattr(transformers, config_class)(**values).to_dict(), args.shape)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, targets=TARGETS.split(",")) if args.kind == "lora" \
        else LoraConfig()
    cfg = Config(model=m, data=DataConfig(path="bench.jsonl", seq_len=128), optim=OptimConfig(warmup_steps=0),
                 train=TrainConfig(batch_size=8, steps=100, threads=args.threads,
                                   head_rows="all" if args.all_rows else "loss"), lora=lora)
    model = build_model(m, seed=0)
    phases["model built (weights)"] = rss.mark()
    built = build_train_step(cfg, model)
    phases["step built (LoRA, optimizer state)"] = rss.mark()
    arrays = list(batch(m.vocab_size))
    if cfg.train.head_rows == "loss":
        arrays.append(head_rows(arrays[1], 1))
    inputs = [ms.Tensor(x) for x in arrays]
    float(built.train_step(*inputs)[0].asnumpy())
    phases["first step (compile + run), peak"] = rss.peak()
    phases["after the first step"] = rss.mark()
    for _ in range(args.steps):
        float(built.train_step(*inputs)[0].asnumpy())
    phases["steady steps, peak"] = rss.peak()
    params = sum(int(np.prod(p.shape)) for p in model.get_parameters())
    trainable = sum(int(np.prod(p.shape)) for p in built.model.trainable_params())
    tokens = 8 * 128
    est = plan.estimate(cfg, device="cpu")
    counted = {"weights (4 B x params)": 4 * params / MB, "gradients (4 B x trainable)": 4 * trainable / MB,
               "AdamW moments (8 B x trainable)": 8 * trainable / MB,
               "activations (planner, logits included)": est["activations"] / MB,
               "logits path's head (3 x 4 B x tokens x vocab)": 3 * 4 * tokens * m.vocab_size / MB}
    return {"phases": phases, "counted": counted, "params": params, "trainable": trainable,
            "head_positions": int(arrays[4].size) if len(arrays) > 4 else tokens,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(args, *flags) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--shape", args.shape, "--kind", args.kind, "--rank", str(args.rank),
           "--steps", str(args.steps), "--threads", str(args.threads), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"}, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.exit(f"worker failed: {proc.stderr[-3000:]}")


def describe(name: str, r: dict) -> list[str]:
    lines = [f"## {name}", "", f"{r['params'] / 1e6:.1f}M parameters, {r['trainable'] / 1e6:.2f}M trainable; "
             f"{r['head_positions']} positions through the head; ru_maxrss {r['ru_maxrss_mb']:,.0f} MB", "",
             "| measured | RSS MB | growth MB |", "|---|---|---|"]
    before = 0.0
    for phase, mb in r["phases"].items():
        lines.append(f"| {phase} | {mb:,.0f} | {mb - before:+,.0f} |")
        before = mb if "peak" not in phase else before
    work = r["phases"]["first step (compile + run), peak"] - r["phases"]["step built (LoRA, optimizer state)"]
    c = r["counted"]
    beyond = work - c["gradients (4 B x trainable)"] - c["activations (planner, logits included)"]
    lines += ["", f"The step's working memory, the first step's peak over the built state (MindSpore's memory pool "
              f"keeps it afterwards, so later steps add ~nothing): {work:+,.0f} MB; beyond the gradients and the "
              f"planner's activations: {beyond:+,.0f} MB (compile, copies the graph keeps, temporaries).", "",
              "| counted | MB |", "|---|---|"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in r["counted"].items()]
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma3-270m")
    p.add_argument("--kind", choices=["lora", "full"], default="full")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ablate", action="store_true")
    p.add_argument("--whole-head", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--all-rows", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    runs = {"as configured": run(args)}
    if args.ablate:
        runs["every position through the head (train.head_rows: all)"] = run(args, "--all-rows")
        runs["logits computed whole, every position (the path before issue 44)"] = run(args, "--all-rows",
                                                                                       "--whole-head")
    lines = [f"# Memory of one {args.kind} train step, {args.shape}'s shapes", ""]
    for name, r in runs.items():
        lines += describe(name, r)
    if args.ablate:
        peaks = {name: r["phases"]["steady steps, peak"] for name, r in runs.items()}
        lines += ["| run | steady peak MB |", "|---|---|"] + [f"| {k} | {v:,.0f} |" for k, v in peaks.items()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
