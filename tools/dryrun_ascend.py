"""Compile a config's parallel layout for Ascend without Ascend devices: MindSpore's dry run
(msrun --sim_level) builds one rank's graph under AutoParallel with the layouts from
msllm/layout/table.py and reports compile errors and, at level 1, the memory it would use.

NOT EXECUTED by this project (no CANN / Ascend here; MindSpore's CPU build refuses both the
semi-auto compile and --sim_level). For users with CANN installed:

    bash tools/dryrun_ascend.sh configs/llama2_7b.yaml 8 --set parallel.dp=2 --set parallel.tp=4 \
        --set parallel.sequence_parallel=true --set train.batch_size=16

This file is the worker msrun starts; the shell script is the launcher. It compiles the
forward, the loss and the backward (no optimizer) of one train step on simulated rank
--rank (msrun --sim_rank_id).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402
from mindspore.communication import get_group_size, get_rank, init  # noqa: E402

from msllm import backends  # noqa: E402
from msllm.backends import ascend  # noqa: E402
from msllm.config_file import load_config  # noqa: E402
from msllm.models.decoder import build_model  # noqa: E402
from msllm.models.layers import CausalLMLoss  # noqa: E402
from msllm.layout.check import check_parallel, global_batch_of  # noqa: E402


class LossNet(nn.Cell):
    """tokens [b, s+1] -> mean next-token loss."""

    def __init__(self, model, loss):
        super().__init__(auto_prefix=False)
        self.model, self.loss = model, loss

    def construct(self, tokens):
        return self.loss(self.model(tokens[:, :-1]), tokens[:, 1:])


class GradStep(nn.Cell):
    """Loss and gradients; with pipeline stages, gradients accumulate over micro-batches."""

    def __init__(self, net, params, reducer):
        super().__init__(auto_prefix=False)
        self.net, self.params, self.reducer = net, params, reducer
        self.grad = ops.value_and_grad(net, None, params)

    def construct(self, tokens):
        loss, grads = self.grad(tokens)
        if self.reducer is not None:
            grads = self.reducer(grads)
        return loss, grads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--strategy-dir", default="dryrun_strategy")
    args = parser.parse_args()

    cfg = load_config(args.config, args.set)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("Ascend")
    ms.set_context(**ascend.execution_profile(cfg, args.config).context())
    init()  # simulated under msrun --sim_level: the group is --worker_num ranks
    devices, rank = get_group_size(), get_rank()
    check_parallel(cfg, devices, args.config)

    model = build_model(cfg.model, compute_dtype={"fp32": ms.float32, "fp16": ms.float16,
                                                  "bf16": ms.bfloat16}[cfg.train.precision])
    flash = backends.uses_flash(cfg, fused=False, training=True)  # FlashAttentionScore per layer (train.attention)
    applied = ascend.specialise(model, cfg, flash=flash)
    loss = CausalLMLoss()
    ascend.use_vocab_parallel_loss(loss, cfg)
    net = ascend.micro_batches(LossNet(model, loss), cfg)
    params = model.trainable_params()
    step = GradStep(net, params, ascend.pipeline_grad_reducer(params, cfg))
    strategy = str(ascend.strategy_file(args.strategy_dir, rank))
    wrapped = ascend.parallel_wrapper(step, cfg, strategy)

    p = cfg.parallel
    local_batch = global_batch_of(cfg) // p.dp  # each dp replica's rows (dataset_strategy ((dp, 1),))
    tokens = Tensor(np.zeros((local_batch, cfg.data.seq_len + 1), np.int32))
    print(f"rank {rank}/{devices}: dp {p.dp} x tp {p.tp} x pp {p.pp}, {sum(applied.values())} primitives laid out, "
          f"{'FlashAttentionScore' if flash else 'softmax'} attention; compiling tokens {tuple(tokens.shape)}",
          flush=True)
    start = time.perf_counter()
    wrapped.compile(tokens)
    print(f"rank {rank}: compiled in {time.perf_counter() - start:.1f} s; strategy file {strategy}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
