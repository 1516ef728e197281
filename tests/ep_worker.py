"""Run under msrun for tests/test_moe.py: expert-parallel train steps on a fixed global batch.

    msrun --worker_num 2 ... tests/workers.py OUT_DIR ep_worker
    # writes OUT_DIR/ep_worker/rank{r}{,_capacity_zero1}.npz

Each rank trains on its half of the batch with half of every MoE layer's experts (parallel.ep = 2):
dropless with plain AdamW, then at a capacity with ZeRO-1, resumed after HALF steps from one process's
state (RESUME). Before the launch, write_one_process runs the whole batch with every expert in one
process (the test compares against it) and writes that state.
"""
from pathlib import Path

import numpy as np

from msllm.config import ModelConfig, OptimConfig, ParallelConfig

# a dense and a MoE layer; 4 experts, top 2, renormalised
CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64, num_experts=4, experts_per_token=2, moe_ffn_size=48, mlp_types=["dense", "moe"])
SEQ, STEPS = 32, 10
HALF = STEPS // 2  # the ZeRO-1 run resumes from one process's state here
RESUME = "resume.npz"
CAPACITY = 0.75  # tight enough that some choices are dropped
TOKENS = np.random.default_rng(11).integers(0, 256, (4, SEQ + 1)).astype(np.int32)


def run(ep: int, world: int, rank: int, capacity: float = 0.0, shard: bool = False, resume: dict | None = None) -> dict:
    """STEPS steps of this rank's share of TOKENS: (loss, grad norm, lr) per step, the routing loads
    of the last, and the weights and optimizer state as a checkpoint holds them (`whole_state`), also
    after HALF steps ("saved/..."). capacity: the experts' capacity factor (0: dropless); shard:
    ZeRO-1; resume: another run's saved state ({"weight/...", "state/..."}), loaded as
    msllm.train.trainer resumes (before the first step), then the steps after HALF."""
    import mindspore as ms
    from msllm import checkpoint
    from msllm.config import Config, TrainConfig
    from msllm.parallel import ep as expert_parallel
    from msllm.train.build import build_train_step

    cfg = Config(model=CFG, optim=OptimConfig(warmup_steps=2, lr=3e-3),
                 train=TrainConfig(steps=STEPS, seed=0, batch_size=len(TOKENS) // world, moe_capacity_factor=capacity),
                 parallel=ParallelConfig(ep=ep, optimizer_shard=shard))
    cfg.data.seq_len = SEQ
    built = build_train_step(cfg, world=world, rank=rank)
    if resume is not None:  # this rank's part of the whole arrays
        weights, state = (expert_parallel.mine(part(resume, kind), ep, rank % ep) for kind in ("weight/", "state/"))
        checkpoint.load_into(built.model.trainable_params(), weights, "saved weights")
        built.optimizer.load_full_state(state, "saved optimizer state")
    share = ms.Tensor(TOKENS[rank * len(TOKENS) // world:(rank + 1) * len(TOKENS) // world])
    outs, saved = [], {}
    for step in range(0 if resume is None else HALF, STEPS):
        if step == HALF and resume is None:
            saved = {f"saved/{name}": a for name, a in whole_state(built, ep).items()}
        out = built.train_step(share)
        outs.append([float(x.asnumpy()) for x in out[:3]])
    held = checkpoint.params_to_numpy(built.model.trainable_params())["layers.1.feed_forward.experts.w1"]
    return {"outs": np.array(outs), "loads": out[5].asnumpy(), "held": held.copy(), **whole_state(built, ep), **saved}


def part(arrays: dict, prefix: str) -> dict:
    """The arrays whose names start with prefix, without it."""
    return {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}


def whole_state(built, ep: int) -> dict:
    """{"weight/NAME", "state/NAME"}: the weights and optimizer state as a checkpoint holds them (every
    expert, moments unsharded; msllm.train.trainer.save). A collective: every rank calls it."""
    from msllm import checkpoint
    from msllm.parallel import ep as expert_parallel

    weights = expert_parallel.whole(checkpoint.params_to_numpy(built.model.trainable_params()), ep)
    state = expert_parallel.whole(built.optimizer.full_state(), ep)
    return {**{f"weight/{k}": v.copy() for k, v in weights.items()},
            **{f"state/{k}": v.copy() for k, v in state.items()}}


def group_all_gather(rank: int, world: int) -> np.ndarray:
    """msllm.parallel.ep.GroupAllGather over the world: each rank's 3 values, as [world, 3]."""
    import mindspore as ms
    from msllm.parallel.ep import GroupAllGather

    return GroupAllGather(world, rank, None)(ms.Tensor(np.arange(3, dtype=np.float32) + 10 * rank)).asnumpy()


def write_one_process(out: Path) -> None:
    """The whole batch with every expert in this one process: OUT/whole.npz dropless, OUT/capped.npz at
    CAPACITY, and what the capped run's checkpoint holds after HALF steps as OUT/RESUME."""
    capped = run(1, 1, 0, CAPACITY)
    np.savez(out / "whole.npz", **run(1, 1, 0))
    np.savez(out / "capped.npz", **capped)
    np.savez(out / RESUME, **part(capped, "saved/"))


def main(out: Path, rank: int, world: int) -> None:
    np.savez(out / f"rank{rank}.npz", **run(world, world, rank))
    resume = dict(np.load(out / RESUME))
    np.savez(out / f"rank{rank}_capacity_zero1.npz", **run(world, world, rank, CAPACITY, shard=True, resume=resume),
             group_all_gather=group_all_gather(rank, world))
