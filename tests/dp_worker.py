"""Run under msrun for tests/test_distributed.py: data-parallel train steps on a fixed batch, results per rank.

    msrun ... tests/workers.py OUT_DIR dp_worker   # writes OUT_DIR/dp_worker/{variant}_rank{r}.npz for each
                                                  # variant, and loss_rows_rank{r}.npz (run_loss_rows)

Rank r of `world` takes rows [r*b, (r+1)*b) of TOKENS, so the ranks together see the batch that
one process sees in tests/test_robustness.py's reference step.
"""
from pathlib import Path

import numpy as np

from msllm.config import ModelConfig, OptimConfig, ParallelConfig

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64)
TOKENS = np.random.default_rng(0).integers(0, 256, (4, 33)).astype(np.int32)
STEPS = 3
VARIANTS = {  # name -> (train.* settings, parallel.optimizer_shard)
    "dp": (dict(fused_kernels="auto"), False),
    "dp_portable": (dict(fused_kernels="off"), False),
    "zero": (dict(fused_kernels="auto"), True),
    # fp16 with a scale that overflows on rank 1 only (rank 0's is moderate): both must skip
    "overflow": (dict(precision="fp16", fused_kernels="auto"), False),
}


def config(variant: str, rank: int = 0):
    from msllm.config import Config, TrainConfig

    train, shard = VARIANTS[variant]
    if variant == "overflow":
        train = dict(train, loss_scale=2.0 ** 40 if rank == 1 else 2.0 ** 10)
    return Config(model=CFG, optim=OptimConfig(warmup_steps=1),
                  train=TrainConfig(steps=10, seed=0, block_graph="shared", **train),
                  parallel=ParallelConfig(optimizer_shard=shard))


def run(variant: str, rank: int, world: int) -> dict:
    import mindspore as ms

    from msllm.train.build import build_train_step
    from tests.numerics import Recorded, weights

    built = build_train_step(config(variant, rank), wrap_optimizer=Recorded, world=world, rank=rank)
    rows = len(TOKENS) // world
    batch = ms.Tensor(TOKENS[rank * rows:(rank + 1) * rows])
    result = {f"initial/{k}": v for k, v in weights(built.model.trainable_params()).items()}
    outs = []
    for step in range(1, STEPS + 1):
        outs.append([float(x.asnumpy()) for x in built.train_step(batch)])
        if step == 1:  # what tests/test_robustness.py's one-step reference holds
            result.update({f"grad1/{k}": v for k, v in built.train_step.optimizer.gradients().items()})
            result.update({f"weight1/{k}": v for k, v in weights(built.model.trainable_params()).items()})
    result.update({f"weight/{k}": v for k, v in weights(built.model.trainable_params()).items()})
    return {"outs": np.array(outs), **result}


def run_loss_rows(rank: int, world: int) -> dict:
    """One step on packed SFT windows, 2 per rank, through each rank's own dataset (msllm.data.loader.make_dataset)
    with all positions and with the loss rows (train.head_rows loss). Rank 0's samples hold 20 loss labels,
    rank 1's 80 (buckets 64 and 96): both must take 96 to run one graph."""
    from msllm.data.loader import make_dataset
    from msllm.train.build import build_train_step
    from tests.numerics import Recorded, weights
    from tests.test_big_vocab import Windows

    windows = Windows(4, 64, CFG.vocab_size)
    windows.mask[:] = 0
    for i in range(4):
        windows.mask[i, 4:4 + (40 if i >= 2 else 10)] = 1
    result = {}
    for name, rows in (("all", 0), ("rows", 1)):
        built = build_train_step(config("dp"), wrap_optimizer=Recorded, world=world, rank=rank)
        data = make_dataset(windows, 64, 2, seed=0, shuffle=False, world=world, rank=rank, num_batches=1,
                            loss_rows=rows)
        [batch] = list(data.create_tuple_iterator(num_epochs=1))
        result[f"{name}/outs"] = np.array([float(x.asnumpy()) for x in built.train_step(*batch)])
        result[f"{name}/shape"] = np.array(batch[-1].shape)
        result.update({f"{name}/grad1/{k}": v for k, v in built.train_step.optimizer.gradients().items()})
        result.update({f"{name}/weight/{k}": v for k, v in weights(built.model.trainable_params()).items()})
    return result


def main(out: Path, rank: int, world: int) -> None:
    for name in VARIANTS:
        np.savez(out / f"{name}_rank{rank}.npz", **run(name, rank, world))
    np.savez(out / f"loss_rows_rank{rank}.npz", **run_loss_rows(rank, world))
