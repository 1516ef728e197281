"""Run under msrun for tests/test_context_parallel.py: context-parallel train steps on a fixed batch.

    msrun --worker_num 2 ... tests/workers.py OUT_DIR cp_worker   # writes OUT_DIR/cp_worker/{variant}_rank{r}.npz

for the variants CI_VARIANTS names.

Every rank gets the whole batch (a cp group reads the same samples) and computes its zig-zag chunks
of each sequence; the test runs the same variants whole in one process and compares.
"""
import os
from pathlib import Path

import numpy as np

from msllm.config import ModelConfig, OptimConfig, ParallelConfig

# one multi-token-prediction depth carried (model.mtp_loss_weight 0): not computed, not trained, under cp as without
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64, sliding_window=24, layer_types=["sliding", "full"], mtp_depths=1)
SEQ, STEPS = 48, 3
_rng = np.random.default_rng(7)
TOKENS = _rng.integers(0, 256, (2, SEQ + 1)).astype(np.int32)
SEGMENTS = np.stack([np.repeat([1, 2, 3], [20, 10, 18]), np.repeat([1, 2], [7, 41])]).astype(np.int32)
# SFT-like labels: about half the tokens count, unevenly over the chunks of the two ranks
MASK = (_rng.random((2, SEQ)) < np.linspace(0.9, 0.1, SEQ)).astype(np.float32)
VARIANTS = {  # name -> (train.attention, packed samples)
    "softmax": ("softmax", False),   # the [q, s] additive mask, fused masked softmax
    "packed_flash": ("flash", True),  # segments, restarted positions, a sliding layer, a masked mean
}
# CI runs the packed, label-masked variant (the masked mean over chunks whose label counts differ,
# which nothing else under cp checks; `msllm launch` at cp 2 in tests/test_context_parallel.py trains flash
# and packed documents with every label counted); the softmax core's variant by hand.
CI_VARIANTS = list(VARIANTS) if os.environ.get("MSLLM_BY_HAND") else ["packed_flash"]


def config(variant: str, cp: int):
    from msllm.config import Config, TrainConfig

    attention, packed = VARIANTS[variant]
    cfg = Config(model=CFG, optim=OptimConfig(warmup_steps=1),
                 train=TrainConfig(steps=10, seed=0, attention=attention), parallel=ParallelConfig(cp=cp))
    cfg.data.seq_len = SEQ
    cfg.data.document_attention = packed  # the seam then specialises for per-sample inputs
    return cfg


def batch(variant: str) -> list:
    import mindspore as ms
    from msllm.data.sft import positions

    if not VARIANTS[variant][1]:
        return [ms.Tensor(TOKENS)]
    return [ms.Tensor(x) for x in (TOKENS, MASK, SEGMENTS, positions(SEGMENTS))]


def run(variant: str, cp: int, world: int, rank: int) -> dict:
    from msllm.train.build import build_train_step
    from tests.numerics import weights

    built = build_train_step(config(variant, cp), world=world, rank=rank)
    inputs = batch(variant)
    outs = [[float(x.asnumpy()) for x in built.train_step(*inputs)[:3]] for _ in range(STEPS)]
    evaluated = float(built.eval_step(*inputs).asnumpy())
    return {"outs": np.array(outs), "eval": np.array(evaluated),
            **{f"weight/{k}": v for k, v in weights(built.model.trainable_params()).items()}}


def main(out: Path, rank: int, world: int) -> None:
    for name in CI_VARIANTS:
        np.savez(out / f"{name}_rank{rank}.npz", **run(name, world, world, rank))
