"""Run under msrun by tests/test_moe.py: expert-parallel train steps on a fixed global batch.

    msrun --worker_num 2 ... tests/ep_worker.py OUT_DIR     # writes OUT_DIR/rank{r}.npz

Each rank trains on its half of the batch with half of every MoE layer's experts (parallel.ep = 2);
the test runs the whole batch with every expert in one process and compares.
"""
import sys
from pathlib import Path

import numpy as np

from msllm.config import ModelConfig, OptimConfig, ParallelConfig

# a dense and a MoE layer; 4 experts, top 2, renormalised
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64, num_experts=4, experts_per_token=2, moe_ffn_size=48, mlp_types=["dense", "moe"])
SEQ, STEPS = 32, 10
CAPACITY = 0.75  # tight enough that some choices are dropped
TOKENS = np.random.default_rng(11).integers(0, 256, (4, SEQ + 1)).astype(np.int32)


def run(ep: int, world: int, rank: int, capacity: float = 0.0) -> dict:
    """STEPS steps of this rank's share of TOKENS: (loss, grad norm, lr) per step, the routing loads
    of the last, and the weights with every expert (gathered from the ep group); capacity: the
    experts' capacity factor (0: dropless)."""
    import mindspore as ms
    from msllm import checkpoint
    from msllm.config import Config, TrainConfig
    from msllm.parallel import ep as expert_parallel
    from msllm.train.build import build_train_step

    cfg = Config(model=CFG, optim=OptimConfig(warmup_steps=2, lr=3e-3),
                 train=TrainConfig(steps=STEPS, seed=0, batch_size=len(TOKENS) // world, moe_capacity_factor=capacity),
                 parallel=ParallelConfig(ep=ep))
    cfg.data.seq_len = SEQ
    built = build_train_step(cfg, world=world, rank=rank)
    share = ms.Tensor(TOKENS[rank * len(TOKENS) // world:(rank + 1) * len(TOKENS) // world])
    outs = []
    for _ in range(STEPS):
        out = built.train_step(share)
        outs.append([float(x.asnumpy()) for x in out[:3]])
    held = checkpoint.params_to_numpy(built.model.trainable_params())
    whole = expert_parallel.whole(held, ep)
    return {"outs": np.array(outs), "loads": out[5].asnumpy(), "held": held["layers.1.feed_forward.experts.w1"].copy(),
            **{f"weight/{k}": v.copy() for k, v in whole.items()}}


if __name__ == "__main__":
    from msllm import device
    from msllm.parallel import dp

    device.setup("cpu", "graph", 1)
    rank, world = dp.init_process_group()
    np.savez(Path(sys.argv[1]) / f"rank{rank}.npz", **run(world, world, rank))
    np.savez(Path(sys.argv[1]) / f"rank{rank}_capacity.npz", **run(world, world, rank, CAPACITY))
