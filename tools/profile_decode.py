"""Where one single-stream decode step of the msllm engine goes (GRAPH_MODE, the CPU inference
specialisation), at one context length: issue 41's split of a step into host work, the graph launch and
the kernels, against the floor of reading every weight once.

Timed in one process, the parts alternated step by step (each a median over --steps):
  step        engine.step: the whole decode call as generate makes it
  graph       the CachedInPlace cell called on ready int32 tensors, logits read back (launch + kernels)
  launch      a trivial GRAPH_MODE cell (one [1] multiply) called and read back: the per-call floor of a launch
  per kernel  a chain of CHAIN such multiplies less the one: what each more kernel in a graph costs
  host        what engine.step adds around the graph: the int32 Tensors made, the logits' asnumpy
  gemv floor  numpy's matrix-vector product over as many fp32 bytes as the weights (each read once)
Then MindSpore's profiler over --steps more steps: kernels per step and their summed time, by kernel type.

    python tools/profile_decode.py                              # W1 hybrid (Qwen3.5-shaped), context 256
    python tools/profile_decode.py --family llama --context 1024
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_train import WORKLOADS, model_config  # noqa: E402
from tools.profile_step import kernel_types  # noqa: E402

CHAIN = 101  # kernels of the chain whose time per kernel is the launch cost of one more kernel


def engine_at(w: dict, family: str, context: int, steps: int, max_len: int, batch: int):
    """The msllm engine over the workload's model of context `max_len` (random weights, the CPU inference
    specialisation), prefilled with `batch` random prompts of `context` tokens and room for 4 * steps + 8 more."""
    import numpy as np

    from msllm.backends import specialise
    from msllm.config import Config
    from msllm.inference import cell_engine
    from msllm.models.decoder import build_model

    new = 4 * steps + 8
    cfg = replace(model_config(w, family), max_seq_len=max(max_len, context + new))
    model = build_model(cfg, seed=0)
    model.set_train(False)
    specialise(model, Config(model=cfg), training=False)
    engine = cell_engine(model)
    rng = np.random.default_rng(0)
    engine.start([rng.integers(3, cfg.vocab_size, context).tolist() for _ in range(batch)], new)
    return engine, model


def split(engine, model, steps: int) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    class Chain(nn.Cell):  # `ops` one-element kernels in a row (MindSpore does not fold a float add chain)
        def __init__(self, ops: int):
            super().__init__()
            self.ops = ops

        def construct(self, x):
            for _ in range(self.ops):
                x = x * 1.0001
            return x

    trivial, chain, one = Chain(1), Chain(CHAIN), ms.Tensor(np.ones(1, np.float32))
    cell = next(iter(engine.in_place.values()))
    weight_bytes = sum(p.nbytes for p in model.get_parameters())
    matrix = np.random.default_rng(0).normal(size=(weight_bytes // 4 // 512, 512)).astype(np.float32)
    vector = np.ones(512, np.float32)
    token = [5] * len(engine.pad)

    def host():
        tensors = [ms.Tensor(np.asarray(x, np.int32)) for x in (np.array(token)[:, None],
                                                               np.array([engine.next_slot]), engine.pad)]
        return tensors

    times = defaultdict(list)
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        engine.step(token)
        t1 = time.perf_counter()
        tensors = host()
        t2 = time.perf_counter()
        logits = cell(*tensors)
        t3 = time.perf_counter()
        logits.asnumpy()
        t4 = time.perf_counter()
        trivial(one).asnumpy()
        t5 = time.perf_counter()
        matrix @ vector
        t6 = time.perf_counter()
        chain(one).asnumpy()
        t7 = time.perf_counter()
        for key, seconds in (("step", t1 - t0), ("host tensors", t2 - t1), ("graph", t4 - t2),
                             ("asnumpy", t4 - t3), ("launch", t5 - t4), ("gemv floor", t6 - t5),
                             ("per kernel", (t7 - t6 - (t5 - t4)) / (CHAIN - 1))):
            times[key].append(seconds)
    return {key: 1e3 * statistics.median(v[2:]) for key, v in times.items()} | {"weight_mb": weight_bytes / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1", choices=list(WORKLOADS))
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (a GRPO rollout's group: 16)")
    p.add_argument("--max-len", type=int, default=1064,
                   help="the model's context (bench_hybrid's at --contexts 256,1024)")
    args = p.parse_args(argv)
    from msllm import device

    device.setup("cpu", "graph")
    engine, model = engine_at(WORKLOADS[args.workload], args.family, args.context, args.steps,
                              args.max_len, args.batch)
    tokens = [5] * args.batch
    for _ in range(3):
        engine.step(tokens)
    parts = split(engine, model, args.steps)
    print(f"{args.workload} {args.family}, batch {args.batch}, context {args.context}: weights {parts.pop('weight_mb'):.1f} MB; "
          "ms per step (median, alternated):")
    for key, value in parts.items():
        print(f"  {key:<13} {value:8.3f}")
    ops = kernel_types(lambda: engine.step(tokens), args.steps)
    busy = sum(o["ms_per_step"] for o in ops)
    print("\n| kernel type | kernels per step | ms per step | share |\n|---|---|---|---|")
    for o in ops:
        print(f"| {o['op']} | {o['kernels_per_step']:.0f} | {o['ms_per_step']:.3f} | {o['ms_per_step'] / busy:.1%} |")
    print(f"| total | {sum(o['kernels_per_step'] for o in ops):.0f} | {busy:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
