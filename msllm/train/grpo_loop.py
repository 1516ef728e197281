"""`msllm train` with train.objective grpo: each step samples grpo.group_size completions for each of
train.batch_size x train.accum_steps prompts (a micro-batch: batch_size prompts' groups) with msllm's
compiled static-cache decoder, scores them with the reward functions, turns the rewards into group
advantages, appends every rollout to RUN_DIR/rollouts.jsonl, and takes grpo.num_iterations compiled
steps of GRPOLoss on them, as TRL: one (the sampling policy is the one trained, ratio 1), or more with
the log-probs at sampling time kept as the ratio's old ones.
train.steps counts optimizer steps; a rollout batch starts at step 1, 1 + num_iterations, ...

The decoder is a second model specialised for generation: at the start it gets every weight of the
trained model, then before each step's rollouts the trainable ones (with LoRA, the adapted weights
with their adapters merged in: the generator has none), so generation never sees the training
specialisation. Its memory: one more copy of the weights.
The prompts a step reads and its sampler's seeds are pure functions of (data.seed, position) and
(train.seed, the step it starts at, each completion's row in the global batch), so a run resumed at a
rollout batch's start (checkpoints are taken there: train.ckpt_every is a multiple of num_iterations)
samples what the uninterrupted one would, on each worker.

Data parallel (msllm launch): each worker takes its contiguous share of the batch's prompts (as the
other objectives read samples) and samples, scores and trains on their whole groups; the rewards of
every worker are gathered so that the advantages (scale_rewards batch: the global std), the reward
metrics, dapo's token count and rollouts.jsonl (written by rank 0 alone, in the global batch's order)
are those of one worker taking the whole batch.
"""
from __future__ import annotations

import dataclasses
import time

import mindspore as ms
import numpy as np

from msllm import backends
from msllm.data.loader import RankSampler, head_rows, most_loss_positions
from msllm.data.tokenizer import eos_id, tokenizer_config
from msllm.config import ConfigError
from msllm.generate import Sampling
from msllm.inference import cell_engine
from msllm.lora import merged_weights
from msllm.metrics import info
from msllm.models.decoder import build_model
from msllm.parallel import dp
from msllm.parallel.watchdog import Heartbeat
from msllm.train.grpo import METRICS, group_advantages
from msllm.train.rewards import load_reward, score
from msllm.train.rollout import Rollouts, log_rollouts, rollout_rows, sample_groups


def copy_weights(source, target, trainable_only: bool) -> None:
    """The generator `target`'s weights from the trained model `source`: its trainable ones (all of them
    at the start), each LoRA-adapted weight merged (W + scale * B A): the generator has no adapters, so
    a decode step runs none of their small matmuls."""
    theirs = {p.name: p for p in target.get_parameters()}
    merged = merged_weights(source)
    for p in source.trainable_params() if trainable_only else source.get_parameters():
        if p.name in theirs and p.name not in merged:  # the adapters themselves and their switch are not there
            theirs[p.name].set_data(ms.Tensor(p.asnumpy()))
    for name, weight in merged.items():
        theirs[name].set_data(ms.Tensor(weight))


def step_inputs(cell, tokens, mask, advantages, accum_steps: int, num_iterations: int, world: int = 1,
                batch_tokens: int | None = None) -> list:
    """GRPOLoss `cell`'s inputs for rollout rows tokens [n, s+1], mask [n, s] and their advantages [n]:
    tokens, mask, advantages, then the head rows (cell.head_rows: only the completion positions go through
    the head, in a capacity every data-parallel rank shares), dapo's batch token count (`batch_tokens`:
    every worker's completion tokens; default this batch's), and with
    num_iterations > 1 the log-probs of the policy as it is now (the ratio's old ones for the later updates)."""
    inputs = [ms.Tensor(tokens), ms.Tensor(mask), ms.Tensor(advantages)]
    if cell.head_rows:
        most = dp.all_gather(np.array([most_loss_positions(mask, accum_steps)])).max() if world > 1 else 0
        inputs.append(ms.Tensor(head_rows(mask, accum_steps, int(most))))
    if cell.batch_count:  # each micro-batch's dapo normaliser: the whole batch's tokens
        count = mask.sum() if batch_tokens is None else batch_tokens
        inputs.append(ms.Tensor(np.full(len(tokens), count, np.float32)))
    if num_iterations > 1:  # computed once for the whole batch: its own head rows
        rows = (ms.Tensor(head_rows(mask, 1)),) if cell.head_rows else ()
        inputs.append(cell.logps(inputs[0], *rows))
    return inputs


def gathered(trainer, mine: Rollouts, functions: int) -> Rollouts:
    """Every worker's rollouts of the batch, in rank order (the global batch's order): the packed
    arrays all-gathered bit for bit. One worker: its own."""
    if trainer.world == 1:
        return mine
    packed = dp.all_gather_exact(mine.pack(trainer.cfg.grpo.max_new_tokens))
    return Rollouts.unpack(packed.reshape(-1, packed.shape[-1]), functions)


def roll_out(trainer, engine, generator, order, rewards, weights, eos, step) -> dict:
    """This worker's batch_size x accum_steps prompts' rollouts with the policy as it is now, scored;
    advantages over the global batch (every worker's rewards, gathered as TRL gathers them), every
    rollout logged by rank 0: the step's inputs (tokens, mask, advantages and, with grpo.num_iterations
    > 1, their log-probs now, the ratio's old ones) and the batch's metrics."""
    cfg, g, tokenizer = trainer.cfg, trainer.cfg.grpo, trainer.tokenizer
    rows = [next(order) for _ in range(trainer.samples_per_step)]  # batch_size x accum_steps prompt rows
    batch = [trainer.prompts[i] for i in rows]
    copy_weights(trainer.model, generator, trainable_only=True)
    seed = int(np.random.SeedSequence([cfg.train.seed, step]).generate_state(1)[0])
    n = len(batch) * g.group_size
    completions, seconds = sample_groups(
        engine, [p.ids for p in batch], g.group_size, g.max_new_tokens,
        Sampling(top_p=g.top_p, temperature=g.temperature, seed=seed), eos_ids=() if eos is None else (eos,),
        first_row=trainer.replica * n)
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    per_row = [p for p in batch for _ in range(g.group_size)]
    names = sorted({k for p in batch for k in p.columns})
    _, each = score(rewards, weights, [p.text for p in per_row], texts,
                    {k: [p.columns.get(k) for p in per_row] for k in names})
    mine = Rollouts(np.repeat(rows, g.group_size), completions, each, np.full(n, seconds))
    everyone = gathered(trainer, mine, len(rewards))
    total = everyone.rewards @ np.asarray(weights, np.float64)
    advantages = group_advantages(total, g.group_size, g.scale_rewards)
    if trainer.rank == 0:
        log_rollouts(trainer.run_dir / "rollouts.jsonl", step,
                     [trainer.prompts[i].text for i in everyone.prompts[::g.group_size]],
                     [tokenizer.decode(c, skip_special_tokens=True) for c in everyone.completions],
                     total, everyone.rewards, list(rewards), advantages, everyone.completions)
    tokens, mask = rollout_rows([p.ids for p in batch], completions, g.group_size, cfg.data.seq_len,
                                eos if eos is not None else 0)
    ours = slice(trainer.replica * n, (trainer.replica + 1) * n)
    inputs = step_inputs(trainer.train_step.loss_cell, tokens, mask, advantages[ours], cfg.train.accum_steps,
                         g.num_iterations, trainer.world, everyone.tokens())
    return {"inputs": inputs, "metrics": {
        "reward": float(total.mean()), "reward_std": float(total.std()),
        "rollout_tokens_per_s": everyone.tokens() / max(float(everyone.seconds.max()), 1e-9),
        "rollout_s": float(everyone.seconds.max()),
        **{f"rewards/{name}/mean": float(everyone.rewards[:, k].mean()) for k, name in enumerate(rewards)}}}


def fit_grpo(trainer) -> dict:
    cfg, t, g = trainer.cfg, trainer.cfg.train, trainer.cfg.grpo
    every = g.num_iterations  # optimizer steps per rollout batch
    if trainer.start_step % every:
        raise ConfigError(str(trainer.run_dir), "grpo.num_iterations", f"the last checkpoint is at step "
                          f"{trainer.start_step}, inside a rollout batch of {every} steps; resume from one at a "
                          f"multiple of {every} (delete the later one) or keep the num_iterations it was run with")
    rewards = {spec: load_reward(spec) for spec in g.reward}
    weights = g.reward_weights or [1.0] * len(rewards)
    eos = eos_id(trainer.tokenizer, tokenizer_config(trainer.shard_dir / "tokenizer.json"))
    generator = build_model(cfg.model, compute_dtype=trainer.model.compute_dtype)
    backends.specialise(generator, dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0)),
                        training=False)  # no adapters: copy_weights merges them into its weights
    generator.set_train(False)
    copy_weights(trainer.model, generator, trainable_only=False)
    engine = cell_engine(generator)
    batches = -(-(t.steps - trainer.start_step) // every)
    prompts = trainer.global_batch  # batch_size x accum_steps x workers
    order = iter(RankSampler(len(trainer.prompts), trainer.samples_per_step, world=trainer.replicas,
                             rank=trainer.replica, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                             start=trainer.data_position, steps=batches))
    split = f", {trainer.samples_per_step} on each of {trainer.replicas} workers" if trainer.replicas > 1 else ""
    info(f"grpo: {t.steps - trainer.start_step} steps on {batches} rollout batches of {prompts} prompts{split} x "
         f"{g.group_size} completions (up to {g.max_new_tokens} tokens), rewards {', '.join(rewards)}")
    last, rollout, bad_run = {}, {}, 0
    heartbeat = Heartbeat(t.hang_timeout_s, trainer.rank)  # under msllm launch: its hang watchdog reads it
    heartbeat.beat(trainer.start_step)
    for step in range(trainer.start_step + 1, t.steps + 1):
        t0 = time.perf_counter()
        if (step - 1) % every == 0:
            rollout = roll_out(trainer, engine, generator, order, rewards, weights, eos, step)
        t1 = time.perf_counter()
        loss, norm, lr, finite, scale, stats = trainer.train_step(*rollout["inputs"])
        loss = float(loss.asnumpy())
        update_s = time.perf_counter() - t1  # log-probs, loss, backward and optimizer: one compiled step
        read = -(-(step - trainer.start_step) // every) * prompts  # prompts read so far (a checkpoint's position)
        if bool(finite.asnumpy()):
            bad_run = 0
        else:
            bad_run = trainer.skip_update(step, loss, bad_run + 1, scale, rollout["inputs"][0],
                                          trainer.data_position + read)
        last = {"kind": "train", "step": step, "loss": loss, "lr": float(lr.asnumpy()),
                "grad_norm": float(norm.asnumpy()), **rollout["metrics"], "step_s": time.perf_counter() - t0,
                "update_s": update_s,
                "loss_scale": float(scale.asnumpy()), "skipped_steps": trainer.skipped,
                **dict(zip(METRICS, map(float, stats.asnumpy())))}
        trainer.metrics.log(last, f"step {step:>6}/{t.steps}  loss {loss:.4f}  reward {last['reward']:.3f} "
                                  f"(std {last['reward_std']:.3f})  length {last['completions/mean_length']:.1f}  "
                                  f"clip {last['clip_ratio/region_mean']:.2%}  "
                                  f"{last['rollout_tokens_per_s']:,.0f} rollout tok/s")
        heartbeat.beat(step, None if step == trainer.start_step + 1 else last["step_s"])
        if step % t.ckpt_every == 0 or step == t.steps:
            trainer.save(step, data_position=trainer.data_position + read)
            heartbeat.beat(step)
    trainer.report_checkpoints(wait=True, final=t.steps)
    trainer.metrics.close()
    return {**last, "step": t.steps}
