"""The training loop: data -> compiled step -> metrics -> eval -> checkpoint.

Resuming is exact: a checkpoint holds weights, optimizer moments and step, loss-scaler state
and the data position; the LR comes from the optimizer step and the data order is a pure
function of (seed, position), and the step uses no random ops, so a resumed run continues
the same loss curve bit for bit on CPU.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np

from msllm import backends, checkpoint, device
from msllm.config import Config, ConfigError
from msllm.config_file import config_from_dict, save_config
from msllm.data import shards
from msllm.data.loader import DocumentWindows, make_dataset, windows_of
from msllm.data.preference import PairRows
from msllm.data.prompts import read_prompts
from msllm.parallel.watchdog import Heartbeat
from msllm.data.tokenizer import load_tokenizer
from msllm.errors import UserError
from msllm.metrics import MetricsLogger, info
from msllm.models.moe import routing_metrics
from msllm.parallel import dp, ep
from msllm.layout.check import data_replicas
from msllm.preflight import make_dir
from msllm.train import nonfinite
from msllm.models.decoder import build_model
from msllm.train.build import build_train_step
from msllm.train.compat import check_weights
from msllm.train.dpo import METRICS as DPO_METRICS, reference_needed, store_reference
from msllm.train.grpo_loop import fit_grpo
from msllm.train.optim import warmup_warning

# Sections that must not change when resuming: they define the weights and the data stream.
FIXED_ON_RESUME = ("model", "data", "lora")
LOSS_SCALE = "loss_scale."  # names of the fp16 loss-scaler state (train/step.py)


class NonFiniteError(UserError, RuntimeError):
    pass


def evaluate(eval_step, val_tokens, cfg: Config) -> float:
    """Mean loss over the first eval_batches windows of the held-out split (fixed order)."""
    windows = len(windows_of(val_tokens, cfg.data.seq_len))
    batch = min(cfg.train.batch_size, windows)
    data = make_dataset(val_tokens, cfg.data.seq_len, batch, seed=0, shuffle=False,
                        num_batches=min(cfg.train.eval_batches, windows // batch))
    losses = [float(eval_step(*b).asnumpy()) for b in data.create_tuple_iterator(num_epochs=1)]
    return float(np.mean(losses))


def check_resumable(cfg: Config, state: dict, source: str, world: int = 1) -> None:
    saved = config_from_dict(state["config"], source).to_dict()
    now = cfg.to_dict()
    for section in FIXED_ON_RESUME:
        for key, value in saved[section].items():
            if now[section][key] != value:
                raise ConfigError(source, f"{section}.{key}",
                                  f"is {value!r} in the checkpoint but {now[section][key]!r} now; "
                                  f"a resumed run must keep the model and data settings")
    saved_world = state.get("world", 1)
    before = saved["train"]["batch_size"] * saved["train"]["accum_steps"] * saved_world
    after = now["train"]["batch_size"] * now["train"]["accum_steps"] * world
    accum, rest = divmod(before, now["train"]["batch_size"] * world)
    if before != after and world != saved_world and rest == 0:  # e.g. relaunched on fewer workers
        info(f"resuming a {saved_world}-worker run on {world}: train.accum_steps {cfg.train.accum_steps} -> {accum} "
             f"keeps the global batch of {before}")
        cfg.train.accum_steps = accum
        return
    if before != after:
        raise ConfigError(source, "train.batch_size", f"global batch (batch_size x accum_steps x workers) was {before} "
                          f"({saved['train']['batch_size']} x {saved['train']['accum_steps']} x {saved_world}) but is "
                          f"{after} now; keep it (e.g. --set train.batch_size={before // (now['train']['accum_steps'] * world)}"
                          f" for {world} workers) so the data stream and the LR schedule continue")


class Trainer:
    """`pretrained` (train.init_from, read by the CLI through interop): load_base(params),
    load_adapter(params), identity() and check(recorded, what); see interop/pretrained.py InitFrom."""

    def __init__(self, cfg: Config, resume: bool = False, pretrained=None):
        self.cfg, self.pretrained = cfg, pretrained
        t = cfg.train
        self.run_dir = Path(t.run_dir)
        # Workers launched together on a CPU node each get their own cores (and as many threads).
        if t.device == "cpu":
            dp.pin_local_cores()
        threads = t.threads or max(1, (os.cpu_count() or 1) // dp.local_workers())
        device.setup(t.device, t.mode, threads, t.jit_level, t.compile_cache)
        device.compute_dtype(t.precision, t.device)  # refuse an impossible precision before writing anything
        self.rank, self.world = dp.init_process_group()
        # world = dp x cp: each cp group of ranks reads one data-parallel replica's samples (checked here)
        self.replicas, self.replica = data_replicas(cfg, self.world), self.rank // cfg.parallel.cp
        ep.check(cfg, self.replicas)  # experts split over ep of the replicas
        ms.set_seed(t.seed)
        # checked when training only: a merged run's config holds both lora.rank 0 and objective dpo
        if t.objective == "dpo" and cfg.lora.rank == 0 and not cfg.dpo.precompute_ref:
            raise ConfigError("the run config", "dpo.precompute_ref",
                              "a full fine-tune keeps no reference model in the step: set dpo.precompute_ref: true "
                              "(or train with lora.rank > 0, whose reference is the base with the adapters off)")
        resume_from = checkpoint.latest(self.run_dir) if resume else None
        lora = cfg.lora.rank > 0  # checkpoints hold the adapters; the base is read from init_from every time
        if resume_from:
            state = checkpoint.read_state(resume_from)
            check_resumable(cfg, state, str(resume_from / checkpoint.STATE_FILE), self.replicas)
            if lora:
                pretrained.check(state.get("lora_base", {}), str(resume_from))
            else:
                check_weights(cfg.model, resume_from / checkpoint.MODEL_FILE, str(resume_from))
        if t.compile_cache:  # MindSpore silently compiles without a cache it cannot create
            make_dir(Path(t.compile_cache).expanduser(), "train.compile_cache")
        if self.rank == 0:  # rank 0 tokenizes (checking the corpus before writing); the others then find
            self.shard_dir = shards.build_shard(cfg, self.run_dir / "data")  # its shard, or build their own copy
        if self.world > 1:                                                    # on a node without the run dir
            dp.barrier()
        if self.rank != 0:
            self.shard_dir = shards.build_shard(cfg, self.run_dir / "data")
        make_dir(self.run_dir, "train.run_dir")
        self.tokenizer = load_tokenizer(self.shard_dir / "tokenizer.json")
        if t.objective == "grpo":  # prompts, read whole (msllm.data.prompts); no held-out split
            self.prompts = read_prompts(Path(cfg.data.path).expanduser(), self.shard_dir / "tokenizer.json",
                                        cfg.data.seq_len, cfg.grpo.max_new_tokens)[1]
            self.train_tokens = self.val_tokens = None
        elif t.objective == "dpo":  # preference pairs; with dpo.precompute_ref their reference log-probs, once built
            index = shards.read_index(self.shard_dir)
            self.train_tokens, self.val_tokens = (PairRows(self.shard_dir, split, index, False, cfg.dpo.share_prompt)
                                                  for split in ("train", "val"))
        else:
            self.train_tokens = shards.open_split(self.shard_dir, "train")
            self.val_tokens = shards.open_split(self.shard_dir, "val")
        if cfg.data.document_attention and not hasattr(self.train_tokens, "columns"):
            eos = shards.read_index(self.shard_dir)["eos_id"]
            self.train_tokens, self.val_tokens = (DocumentWindows(split, cfg.data.seq_len, eos)
                                                  for split in (self.train_tokens, self.val_tokens))

        load_base = pretrained.load_base if pretrained is not None and (lora or not resume_from) else None
        built = build_train_step(cfg, world=self.world, rank=self.rank, load_weights=load_base)
        self.model, self.train_step, self.eval_step = built.model, built.train_step, built.eval_step
        if lora and not resume_from:
            pretrained.load_adapter(self.model.trainable_params())
        self.optimizer = built.optimizer
        if t.objective == "dpo" and cfg.dpo.precompute_ref:
            self._reference_logps(built.spec.fused_kernels, bool(resume_from))
        self.start_step, self.skipped, self.data_position = 0, 0, 0
        self.nonfinite_report = None  # the first non-finite step, located (train/nonfinite.py)
        if resume_from:
            self._restore(resume_from)
        if self.world > 1:
            differ = dp.ranks_differing([p for p in self.model.trainable_params() if not ep.is_expert(p.name)])
            if differ:
                raise device.DeviceError(f"ranks {differ} start from weights different from rank 0's; every rank "
                                         f"must build the same model (same train.seed and checkpoint)")
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        self.metrics = MetricsLogger(self.run_dir, enabled=self.rank == 0)
        self.writer = checkpoint.BackgroundWriter() if t.background_checkpoint and self.rank == 0 else None
        self.stalls = {}  # step -> seconds training paused for its checkpoint

    def _reference_logps(self, fused: bool, resumed: bool) -> None:
        """dpo.precompute_ref: the starting model's log-probs of every pair, unless already beside the
        shard: each data-parallel rank computes its share, all of them store the gathered whole; then
        read with the pairs. Every rank decides alike (a shared run dir, or the same files in each)."""
        t = self.cfg.train
        key = {"init_from": self.pretrained.identity() if self.pretrained else None, "lora_from": t.lora_from,
               "seed": t.seed, "precision": t.precision, "lora": self.cfg.to_dict()["lora"]}
        if reference_needed(self.shard_dir, key, resumed):
            store_reference(self.shard_dir, self.model, fused, t.batch_size, key, info, self.replica, self.replicas)
        index = shards.read_index(self.shard_dir)
        self.train_tokens, self.val_tokens = (PairRows(self.shard_dir, split, index, True, self.cfg.dpo.share_prompt)
                                              for split in ("train", "val"))

    def _restore(self, path: Path) -> None:
        ep_size, index = self.cfg.parallel.ep, self.rank % self.cfg.parallel.ep  # checkpoints hold whole experts
        with checkpoint.load_arrays(path / checkpoint.MODEL_FILE) as weights:
            checkpoint.load_into(self.model.trainable_params(), ep.mine(weights, ep_size, index), str(path))
        # The loss-scaler state exists only under fp16: a resume that switches precision drops or starts it.
        with checkpoint.load_arrays(path / checkpoint.OPTIM_FILE) as optim:
            scaler = [p for p in self.train_step.state_parameters() if p.name in optim]
            checkpoint.load_into(scaler, {p.name: optim[p.name] for p in scaler}, str(path))
            self.optimizer.load_full_state(ep.mine({k: v for k, v in optim.items() if not k.startswith(LOSS_SCALE)},
                                                   ep_size, index), str(path))
        state = checkpoint.read_state(path)
        self.start_step, self.skipped = state["step"], state.get("skipped_steps", 0)
        self.data_position = state.get("data_position", self.start_step * self.global_batch)
        info(f"resumed from {path} at step {self.start_step}")

    @property
    def samples_per_step(self) -> int:
        """Samples one rank reads per optimizer step."""
        return self.cfg.train.batch_size * self.cfg.train.accum_steps

    @property
    def global_batch(self) -> int:
        return self.samples_per_step * self.replicas

    def inference_model(self):
        """The trained model re-specialised for generation (dynamic shapes, blocks inlined, no fused
        training kernels): the seam swaps parameter-free Cells only, so the weights are the same.
        Under expert parallel this rank holds some experts only: a new model takes the whole weights
        of the last checkpoint."""
        if self.cfg.parallel.ep > 1:
            self.model = build_model(self.cfg.model, compute_dtype=self.model.compute_dtype)
            checkpoint.load_into(self.model.trainable_params(), self.whole_weights, "the last checkpoint")
        backends.specialise(self.model, self.cfg, training=False)
        self.model.set_train(False)
        return self.model

    def save(self, step: int, data_position: int | None = None) -> Path | None:
        """Every rank calls this (a sharded optimizer gathers its state); rank 0 writes, in the
        background with train.background_checkpoint (the path it will have is returned at once).
        data_position: the samples read so far, when not global_batch per step (grpo.num_iterations)."""
        t0 = time.perf_counter()
        ep_size = self.cfg.parallel.ep  # experts split over the ep group are gathered whole (a collective)
        arrays = {**ep.whole(self.optimizer.full_state(), ep_size),
                  **checkpoint.params_to_numpy(self.train_step.state_parameters())}
        weights = ep.whole(checkpoint.params_to_numpy(self.model.trainable_params()), ep_size)
        if self.world > 1:
            dp.barrier()  # every rank has finished this step
        if self.rank != 0:
            return None
        self.whole_weights = weights
        position = data_position if data_position is not None else \
            self.data_position + (step - self.start_step) * self.global_batch
        state = {"data_position": position, "skipped_steps": self.skipped,
                 "world": self.replicas, "seed": self.cfg.train.seed, "data_seed": self.cfg.data.seed,
                 "tokenizer": str(self.shard_dir / "tokenizer.json"), "config": self.cfg.to_dict()}
        if self.cfg.lora.rank > 0:  # the checkpoint holds the adapters: name the base they belong to
            state["lora_base"] = self.pretrained.identity()
        path = checkpoint.save(self.run_dir, step, weights, arrays, state,
                               keep=self.cfg.train.keep_checkpoints, writer=self.writer,
                               add_files=lambda d: backends.save_with_checkpoint(self.cfg, self.run_dir, d, self.rank))
        self.stalls[step] = time.perf_counter() - t0
        if self.writer is None:
            self.metrics.log({"kind": "checkpoint", "step": step, "stall_s": self.stalls.pop(step),
                              "background": False}, f"checkpoint: {path}")
        return path

    def report_checkpoints(self, wait: bool = False, final: int | None = None) -> None:
        """Log the background writes that ended (with wait: after the one in flight). A failed one
        (a full disk) is a warning: the state is still in memory and the next checkpoint tries
        again; only the `final` step's checkpoint failing stops the run."""
        if self.writer is None:
            return
        for w in self.writer.wait() if wait else self.writer.done():
            stall = self.stalls.pop(w.step, 0.0)
            if w.error is None:
                self.metrics.log({"kind": "checkpoint", "step": w.step, "stall_s": stall, "write_s": w.seconds,
                                  "background": True},
                                 f"checkpoint: {w.path} (training paused {stall:.2f} s; written in {w.seconds:.1f} s "
                                 f"beside it)")
            elif not isinstance(w.error, UserError) or w.step == final:
                raise w.error
            else:
                self.metrics.log({"kind": "checkpoint_failed", "step": w.step, "error": str(w.error)},
                                 f"warning: checkpoint of step {w.step} not written: {w.error}. Training goes on; "
                                 f"the next checkpoint tries again")

    def skip_update(self, step: int, loss: float, bad_run: int, scale, tokens, data_position=None) -> int:
        """A step whose gradients were not finite (fp16 overflow, or a NaN / Inf): the step left the weights
        and optimizer as they were (and lowered the loss scale); logged and counted here. bad_run: the
        consecutive such steps, this one included (returned). train.max_bad_steps of them stop the run
        with a checkpoint (data_position: as for save) and NonFiniteError."""
        t = self.cfg.train
        self.skipped += 1
        scaler = self.train_step.loss_scaler
        info(f"step {step}: non-finite gradients (loss {loss}); update skipped"
             + (f", loss scale now {float(scaler.scale_value.asnumpy()):g}" if scaler is not None else ""))
        stopping = bad_run >= t.max_bad_steps
        # rank 0 locates the first one by an eager re-run: one process (no cp group) re-running LossCell on
        # next-token batches, not DPO's or GRPO's loss
        located = self.cfg.parallel.cp == 1 and t.objective not in ("dpo", "grpo")
        if self.rank == 0 and located and self.nonfinite_report is None and (t.debug_nonfinite or stopping):
            self.nonfinite_report = nonfinite.report(self.run_dir, step, self.model, tokens.asnumpy(),
                                                     float(scale.asnumpy()), self.cfg, t.accum_steps)
        if stopping:
            path = self.save(step, data_position)
            self.report_checkpoints(wait=True, final=step)
            report = self.run_dir / nonfinite.REPORT_DIR / nonfinite.REPORT_FILE
            where = f"; where it started: {report}" if located else ""
            raise NonFiniteError(
                f"{bad_run} consecutive non-finite steps (last at step {step}); checkpoint {path}{where}. "
                f"Lower optim.lr, raise optim.warmup_steps or tighten optim.grad_clip, or use "
                f"train.precision=fp32, then resume with --resume {self.run_dir}")
        return bad_run

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        remaining = t.steps - self.start_step
        if remaining <= 0:
            info(f"run already at step {self.start_step} >= train.steps {t.steps}; nothing to do")
            return {"step": self.start_step}
        if t.objective == "grpo":
            return fit_grpo(self)
        # SFT and DPO rows: only the positions with a loss go through the head, in a capacity every CPU data-parallel
        # rank agrees on (the loader reads their masks). Not under context parallel (a rank holds part of each
        # sequence), nor Ascend's sharded graphs (no layout for the gather)
        rows = t.accum_steps if t.head_rows == "loss" and cfg.parallel.cp == 1 and (
            self.world == 1 or t.device == "cpu") else 0
        data = make_dataset(self.train_tokens, cfg.data.seq_len, self.samples_per_step, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle, world=self.replicas, rank=self.replica,
                            start=self.data_position, num_batches=remaining, loss_rows=rows)
        rows_a_pair = 2 if t.objective == "dpo" and not cfg.dpo.share_prompt else 1  # dpo: batch_size counts pairs
        tokens_per_step = self.global_batch * cfg.data.seq_len * rows_a_pair
        flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
        info(f"model: {cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.num_layers} layers; {t.mode} mode on "
             f"{t.device}, {t.precision}; {remaining} steps of {tokens_per_step} tokens")
        if self.rank == 0 and (warning := warmup_warning(cfg.optim, t.steps)):
            info(warning)
        info(f"global batch {self.global_batch} = batch_size {t.batch_size} x accum_steps {t.accum_steps} x "
             f"{self.replicas} worker{'s' if self.replicas > 1 else ''}"
             + (f", each sequence split over {cfg.parallel.cp} ranks (parallel.cp)" if cfg.parallel.cp > 1 else "")
             + (", optimizer state sharded (ZeRO-1)" if cfg.parallel.optimizer_shard and self.world > 1 else ""))
        step, last, bad_run, evaluated = self.start_step, {}, 0, False
        window_t, window_steps = time.perf_counter(), 0
        heartbeat = Heartbeat(t.hang_timeout_s, self.rank)  # under msllm launch: its hang watchdog reads it
        heartbeat.beat(step)
        for batch in data.create_tuple_iterator(num_epochs=1):
            t0 = time.perf_counter()
            loss, norm, lr, finite, scale, *loads = self.train_step(*batch)  # loads: MoE models
            loss = float(loss.asnumpy())  # also synchronises
            step += 1
            window_steps += 1
            heartbeat.beat(step, None if step == self.start_step + 1 else time.perf_counter() - t0)
            self.report_checkpoints()
            if step == self.start_step + 1:
                compile_s = time.perf_counter() - t0
                self.metrics.log({"kind": "compile", "step": step, "first_step_s": compile_s, "loss": loss},
                                 f"step {step}: first step (compile + run) {compile_s:.1f}s, loss {loss:.4f}")
                window_t, window_steps = time.perf_counter(), 0
            bad_run = 0 if bool(finite.asnumpy()) else self.skip_update(step, loss, bad_run + 1, scale, batch[0])
            if window_steps and (step % t.log_every == 0 or step == t.steps):
                dt = time.perf_counter() - window_t
                tps = window_steps * tokens_per_step / dt
                last = {"kind": "train", "step": step, "loss": loss, "lr": float(lr.asnumpy()),
                        "grad_norm": float(norm.asnumpy()), "tokens_per_s": tps,
                        "mfu": tps * flops_per_token / t.peak_flops, "loss_scale": float(scale.asnumpy()),
                        "skipped_steps": self.skipped}
                if loads and t.objective == "dpo":
                    last.update(zip(DPO_METRICS, map(float, loads[0].asnumpy())))
                elif loads:
                    if "moe" in cfg.model.mlp_kinds():
                        last.update(routing_metrics(loads[0].asnumpy()))
                    if cfg.model.trains_mtp:  # each depth's loss, after the routing loads
                        last.update({f"mtp_loss/{k}": float(x) for k, x in enumerate(loads[-1].asnumpy(), 1)})
                self.metrics.log(last, f"step {step:>6}/{t.steps}  loss {loss:.4f}  lr {last['lr']:.2e}  "
                                       f"gnorm {last['grad_norm']:.3f}  {tps:,.0f} tok/s  mfu {last['mfu']:.2%}"
                                       + (f"  scale {last['loss_scale']:g}  skipped {self.skipped}"
                                          if t.precision == "fp16" else "")
                                       + (f"  reward acc {last['rewards/accuracies']:.2f} margin "
                                          f"{last['rewards/margins']:.3f}" if "rewards/margins" in last else "")
                                       + (f"  expert load max/mean {last['expert_load_max']:.2f}"
                                          if "expert_load_max" in last else "")
                                       + (f"  mtp {' '.join(f'{v:.4f}' for k, v in last.items() if k.startswith('mtp_loss/'))}"
                                          if "mtp_loss/1" in last else "")
                                       + (f" dropped {last['dropped']:.1%}" if t.moe_capacity_factor else ""))
                window_t, window_steps = time.perf_counter(), 0
            evaluating = step % t.eval_every == 0 or step == t.steps
            if evaluating and not evaluated:  # the eval graph compiles now; the other ranks wait for it
                heartbeat.beat(step, compiling=True)
                evaluated = True
            # rank 0's cp or ep group (its ranks compute one sequence or one layer's experts together)
            if evaluating and self.rank < cfg.parallel.cp * cfg.parallel.ep:
                val = evaluate(self.eval_step, self.val_tokens, cfg)
                last["val_loss"] = val
                self.metrics.log({"kind": "eval", "step": step, "val_loss": val},
                                 f"step {step:>6}  val_loss {val:.4f}  (ln vocab = {math.log(cfg.model.vocab_size):.2f})")
                heartbeat.beat(step)
                window_t, window_steps = time.perf_counter(), 0
            if step % t.ckpt_every == 0 or step == t.steps:
                self.save(step)
                heartbeat.beat(step)
                window_t, window_steps = time.perf_counter(), 0
        self.report_checkpoints(wait=True, final=step)
        heartbeat.beat(step)
        self.metrics.close()
        last["step"] = step
        return last
