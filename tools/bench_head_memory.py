"""Peak RSS of compiled train steps of a small decoder with a big vocabulary: what the output head
and its loss cost. Imports msllm from PYTHONPATH (not this checkout), so the same script measures
another tree, e.g. the commit before a change checked out with `git worktree add /tmp/before <commit>`:

    python tools/peak_rss.py python tools/bench_head_memory.py --vocab 131072 --tokens 1024
    PYTHONPATH=/tmp/before python tools/peak_rss.py python tools/bench_head_memory.py --vocab 131072

Prints one JSON line: the tree measured, the peak RSS before the first step (model, optimizer and
data built) and after the steps (this process's ru_maxrss), the step times and losses. Run old
and new in separate processes, alternated.
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step (batch x seq)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)

    import mindspore as ms
    import msllm
    from msllm import device
    from msllm.config import ModelConfig
    from msllm.models.decoder import build_model
    from msllm.train.build import build_train_step
    from msllm.config import Config, OptimConfig, TrainConfig

    device.setup("cpu", "graph", args.threads)
    heads = max(1, args.hidden // 64)
    m = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                    num_kv_heads=heads, ffn_size=3 * args.hidden, max_seq_len=args.seq,
                    tie_embeddings=not args.untied)
    cfg = Config(model=m, optim=OptimConfig(warmup_steps=0), train=TrainConfig(steps=args.steps + 1, batch_size=1))
    built = build_train_step(cfg, build_model(m, seed=0))
    batch = np.random.default_rng(0).integers(0, args.vocab, (args.tokens // args.seq, args.seq + 1)).astype(np.int32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = built.train_step(ms.Tensor(batch))
        losses.append(float(out[0].asnumpy()))
        times.append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"msllm": msllm.__file__, "vocab": args.vocab, "tokens": args.tokens, "hidden": args.hidden,
                      "tied": not args.untied, "peak_rss_before_step_mb": before / 1024,
                      "peak_rss_mb": after / 1024, "step_s": times, "loss": losses}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
