"""The training loop: data -> compiled step -> metrics -> eval -> checkpoint -> sample."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import mindspore as ms
import numpy as np

from msllm import checkpoint, device
from msllm.config import Config, save_config
from msllm.data import shards
from msllm.data.loader import make_dataset
from msllm.data.tokenizer import load_tokenizer
from msllm.metrics import MetricsLogger, info
from msllm.models.llama import build_model
from msllm.train.optim import AdamW
from msllm.train.step import EvalStep, TrainStep


def rank_and_world() -> tuple[int, int]:
    """Data-parallel position from the launcher's environment (msrun sets RANK_ID / RANK_SIZE)."""
    return int(os.environ.get("RANK_ID", 0)), int(os.environ.get("RANK_SIZE", 1))


def evaluate(eval_step, val_tokens, cfg: Config) -> float:
    """Mean loss over the first eval_batches windows of the held-out split (fixed order)."""
    windows = (len(val_tokens) - 1) // cfg.data.seq_len
    batch = min(cfg.train.batch_size, windows)
    data = make_dataset(val_tokens, cfg.data.seq_len, batch, seed=0, shuffle=False,
                        num_batches=min(cfg.train.eval_batches, windows // batch))
    losses = [float(eval_step(b).asnumpy()) for (b,) in data.create_tuple_iterator(num_epochs=1)]
    return float(np.mean(losses))


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        t = cfg.train
        self.run_dir = Path(t.run_dir)
        self.rank, self.world = rank_and_world()
        device.setup(t.device, t.mode, t.threads, t.jit_level)
        ms.set_seed(t.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.shard_dir = shards.build_shard(cfg, self.run_dir / "data")
        self.tokenizer = load_tokenizer(self.shard_dir / "tokenizer.json")
        self.train_tokens = shards.open_tokens(self.shard_dir, "train")
        self.val_tokens = shards.open_tokens(self.shard_dir, "val")

        self.model = build_model(cfg.model, seed=t.seed)
        self.optimizer = AdamW(self.model.trainable_params(), cfg.optim, t.steps)
        self.train_step = TrainStep(self.model, self.optimizer, cfg.optim.grad_clip)
        self.eval_step = EvalStep(self.model)
        self.start_step = 0
        if resume:
            self._restore()
        if self.rank == 0:
            save_config(cfg, self.run_dir / "config.yaml")
        self.metrics = MetricsLogger(self.run_dir, enabled=self.rank == 0)

    def _restore(self) -> None:
        path = checkpoint.latest(self.run_dir)
        checkpoint.load_into(self.model.trainable_params(), checkpoint.load_arrays(path / checkpoint.MODEL_FILE), str(path))
        checkpoint.load_into(self.optimizer.state_parameters(), checkpoint.load_arrays(path / checkpoint.OPTIM_FILE), str(path))
        self.start_step = checkpoint.read_state(path)["step"]
        info(f"resumed from {path} at step {self.start_step}")

    def save(self, step: int) -> Path | None:
        if self.rank != 0:
            return None
        state = {"data_position": step * self.cfg.train.batch_size, "world": self.world,
                 "tokenizer": str(self.shard_dir / "tokenizer.json"), "config": self.cfg.to_dict()}
        return checkpoint.save(self.run_dir, step, self.model.trainable_params(), self.optimizer.state_parameters(), state)

    def fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        remaining = t.steps - self.start_step
        if remaining <= 0:
            info(f"run already at step {self.start_step} >= train.steps {t.steps}; nothing to do")
            return {"step": self.start_step}
        data = make_dataset(self.train_tokens, cfg.data.seq_len, t.batch_size, seed=cfg.data.seed,
                            shuffle=cfg.data.shuffle, num_shards=self.world, shard_id=self.rank,
                            start_batch=self.start_step, num_batches=remaining)
        tokens_per_step = t.batch_size * cfg.data.seq_len * self.world
        flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
        info(f"model: {cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.num_layers} layers; "
             f"{t.mode} mode on {t.device}; {remaining} steps of {tokens_per_step} tokens")
        step, last = self.start_step, {}
        window_t, window_steps = time.perf_counter(), 0
        for (batch,) in data.create_tuple_iterator(num_epochs=1):
            t0 = time.perf_counter()
            loss, norm, lr = self.train_step(batch)
            loss = float(loss.asnumpy())  # also synchronises
            step += 1
            window_steps += 1
            if step == self.start_step + 1:
                compile_s = time.perf_counter() - t0
                self.metrics.log({"kind": "compile", "step": step, "first_step_s": compile_s},
                                 f"step {step}: first step (compile + run) {compile_s:.1f}s, loss {loss:.4f}")
                window_t, window_steps = time.perf_counter(), 0
            if not math.isfinite(loss):
                self.save(step)
                raise FloatingPointError(f"loss is {loss} at step {step}; lower optim.lr or raise optim.warmup_steps")
            if window_steps and (step % t.log_every == 0 or step == t.steps):
                dt = time.perf_counter() - window_t
                tps = window_steps * tokens_per_step / dt
                last = {"kind": "train", "step": step, "loss": loss, "lr": float(lr.asnumpy()),
                        "grad_norm": float(norm.asnumpy()), "tokens_per_s": tps,
                        "mfu": tps * flops_per_token / t.peak_flops}
                self.metrics.log(last, f"step {step:>6}/{t.steps}  loss {loss:.4f}  lr {last['lr']:.2e}  "
                                       f"gnorm {last['grad_norm']:.3f}  {tps:,.0f} tok/s  mfu {last['mfu']:.2%}")
                window_t, window_steps = time.perf_counter(), 0
            if step % t.eval_every == 0 or step == t.steps:
                val = evaluate(self.eval_step, self.val_tokens, cfg)
                last["val_loss"] = val
                self.metrics.log({"kind": "eval", "step": step, "val_loss": val},
                                 f"step {step:>6}  val_loss {val:.4f}  (ln vocab = {math.log(cfg.model.vocab_size):.2f})")
                window_t, window_steps = time.perf_counter(), 0
            if step % t.ckpt_every == 0 or step == t.steps:
                path = self.save(step)
                if path:
                    info(f"checkpoint: {path}")
                window_t, window_steps = time.perf_counter(), 0
        self.metrics.close()
        last["step"] = step
        return last
