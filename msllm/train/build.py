"""The one place a configured train step is built: model -> specialisation -> optimizer -> step.

The trainer, tools/bench_train.py, tools/profile_step.py and the tests all call build_train_step,
so what is benchmarked and tested is what trains.
"""
from __future__ import annotations

from dataclasses import dataclass

from msllm import backends, device
from msllm.backends import Specialisation
from msllm.config import Config
from msllm.models.decoder import Decoder, build_model
from msllm.models.moe import bias_balance
from msllm.parallel import ep
from msllm.parallel.dp import GradAllReduce, RankMean
from msllm.parallel.zero import ShardedAdamW
from msllm.lora import switch_of
from msllm.train.dpo import DPOLoss
from msllm.train.grpo import GRPOLoss
from msllm.train.optim import AdamW
from msllm.train.step import EvalStep, TrainStep, make_loss_scaler


@dataclass
class Built:
    model: Decoder
    optimizer: AdamW
    train_step: TrainStep
    eval_step: EvalStep
    spec: Specialisation

    @property
    def state_params(self) -> list:
        """Everything a checkpoint holds beside the weights: optimizer and loss-scaler state."""
        return self.optimizer.state_parameters() + self.train_step.state_parameters()


def build_train_step(cfg: Config, model: Decoder | None = None, wrap_optimizer=None, world: int = 1,
                     rank: int = 0, load_weights=None) -> Built:
    """The configured train step on a new model (seeded by train.seed), or on `model` as given.
    wrap_optimizer(optimizer) -> a Cell with the optimizer's call, `params` and `fused` (tests use it
    to record the applied gradients). load_weights(params): pretrained weights into the new model
    before it is specialised (train.init_from). The process's device context must be set
    (msllm.device.setup) first."""
    t = cfg.train
    if model is None:
        model = build_model(cfg.model, seed=t.seed, compute_dtype=device.compute_dtype(t.precision, t.device))
        if load_weights is not None:
            load_weights(model.trainable_params())
    spec = backends.specialise(model, cfg, training=True)
    # each rank holds its experts alone: ranks holding the same ones (the edp group) sum their gradients
    ep_group, edp_group = ep.groups(spec.ep, rank, world) if spec.ep > 1 else (None, None)
    params = model.trainable_params()
    if cfg.model.mtp_depths and not cfg.model.trains_mtp:  # MTP blocks carried, untrained: no gradient, no decay
        params = [p for p in params if not p.name.startswith("mtp.")]
    if cfg.parallel.optimizer_shard and world > 1:
        optimizer = ShardedAdamW(params, cfg.optim, t.steps, rank=rank, world=world, ep=spec.ep, edp_group=edp_group)
    else:
        optimizer = AdamW(params, cfg.optim, t.steps, fused=spec.fused_kernels)
    scaler = make_loss_scaler(t.loss_scale, t.loss_scale_window) if t.precision == "fp16" else None
    stepped = wrap_optimizer(optimizer) if wrap_optimizer else optimizer
    reducer = GradAllReduce(optimizer.params) if world > 1 else None
    if spec.ep > 1:
        reducer = ep.ExpertGradReduce(optimizer.params, ep_group, edp_group)
    loss_cell = eval_cell = None
    if t.objective == "dpo":  # the objective's loss cell; the model knows nothing of it
        loss_cell = DPOLoss(model, cfg.dpo, spec.fused_kernels, switch_of(model))
        eval_cell = loss_cell
    elif t.objective == "grpo":
        g = cfg.grpo
        loss_cell = eval_cell = GRPOLoss(model, g.loss_type, g.epsilon, beta=g.beta, max_completion=g.max_new_tokens,
                                         temperature=g.temperature, fused=spec.fused_kernels, switch=switch_of(model),
                                         accum_steps=t.accum_steps, world=world, head_rows=t.head_rows == "loss")
    # metrics that are means over a rank's samples are averaged over the ranks (MoE loads stay each rank's)
    stats_reducer = RankMean(world) if world > 1 and getattr(loss_cell, "stats_are_means", False) else None
    train_step = TrainStep(model, stepped, cfg.optim.grad_clip, t.accum_steps, scaler, reducer, world,
                           bias_balance(model, t.moe_bias_update_rate, world), loss_cell, stats_reducer)
    return Built(model, optimizer, train_step, EvalStep(model, spec.fused_kernels, eval_cell), spec)
