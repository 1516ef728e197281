"""GRPO on CPU: msllm vs transformers / TRL on the same model, prompts, group size, completion length and sampling.

(a) rollout: `group` completions of each of --prompts prompts (--prompt-len tokens), up to --new tokens
    each, sampled at temperature 1, top_p 1, top_k 0, stopping at EOS: msllm's compiled static-cache
    decoder (msllm.train.rollout.sample_groups over msllm.inference.cell_engine, what `msllm train` with
    train.objective grpo samples with) vs transformers' `generate` with TRL GRPOTrainer's generation
    config (torch eager). Generated tokens (each up to its EOS) per second.
(b) a whole GRPO step: `msllm train` with train.objective grpo (rollouts, the reward, advantages,
    rollouts.jsonl, one compiled step; its metrics' step_s) vs TRL's GRPOTrainer.train (a callback times
    each optimizer step: generation, reward, loss, backward, AdamW), both with LoRA (rank 8 on q, k, v, o),
    dapo, beta 0, one update per batch, AdamW + clip 1.0, the same reward function.

The model is bench_dpo's (a random Llama of --shape saved as a Hugging Face checkpoint, a word-level
tokenizer whose words are token ids, so both stacks see the same prompt ids). The EOS of a random model
over a 4096 vocabulary is rare: completions are nearly all --new tokens long, so both sides do the same work.

    python tools/bench_grpo.py                          # W1 shape, 2 rounds alternated, both parts
    python tools/bench_grpo.py --shape tiny --steps 2 --warmup 1 --rounds 1   # a smoke run of the tool

Every variant runs in a process of its own (msllm's with PYTHONPATH on its checkout), reports the median
after warm-up and its peak RSS; the variants alternate over --rounds rounds (tools/bench_big_vocab.alternate).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_big_vocab import alternate, print_result, provenance, run_worker, save, time_steps  # noqa: E402
from bench_dpo import RANK, SHAPES, TARGETS, write_model  # noqa: E402

EOS = 2  # bench_dpo's tokenizer: </s>
REWARD = '''
def reward(completions, prompts=None, **columns):
    """Rewards that differ within a group: the completion's words (token ids w<id>) with an even id."""
    return [float(sum(w[-1] in "02468" for w in c.split())) for c in completions]
'''


def write_inputs(shape: str, out: Path, prompts: int, prompt_len: int, rows: int) -> None:
    """The HF model and tokenizer, `rows` prompt rows of prompt_len words in prompts.jsonl, rewards.py."""
    import numpy as np

    words = write_model(shape, out)
    rng = np.random.default_rng(0)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": words(prompt_len, rng)}) + "\n"
                                              for _ in range(rows)))
    (out / "rewards.py").write_text(REWARD)


def prompt_ids(hf: Path, count: int) -> list[list[int]]:
    """The first `count` prompts' token ids (each word is its id: w17 -> 17)."""
    rows = [json.loads(line)["prompt"] for line in (hf / "prompts.jsonl").read_text().splitlines()[:count]]
    return [[int(w[1:]) for w in row.split()] for row in rows]


def completion_tokens(ids: list[int]) -> int:
    return ids.index(EOS) + 1 if EOS in ids else len(ids)


def timed_rollouts(sample, args) -> dict:
    """time_steps over sample(seed) -> the completions' token counts; tokens / s over the timed calls."""
    counts, seed = [], iter(range(10 ** 6))
    result = time_steps(lambda: counts.append(sample(next(seed))), args.steps, args.warmup)
    timed = counts[-args.steps:]
    result.update(tokens_per_s=sum(timed) / sum(result["step_times"]), tokens=timed)
    return result


def rollout_msllm(args) -> dict:
    import msllm
    from interop.verify import msllm_model, open_hf
    from msllm import backends, device
    from msllm.config import Config, TrainConfig
    from msllm.generate import Sampling
    from msllm.inference import cell_engine
    from msllm.train.rollout import sample_groups

    device.setup("cpu", "graph", args.threads)
    model = msllm_model(open_hf(Path(args.hf)))
    backends.specialise(model, Config(model=model.cfg, train=TrainConfig(threads=args.threads)), training=False)
    engine, prompts = cell_engine(model), prompt_ids(Path(args.hf), args.prompts)

    def sample(seed):
        completions, _ = sample_groups(engine, prompts, args.group, args.new, Sampling(seed=seed), eos_ids=(EOS,))
        return sum(map(len, completions))

    return {**timed_rollouts(sample, args), "msllm": str(Path(msllm.__file__).parents[1])}


def rollout_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.hf).float().eval()
    ids = torch.tensor(prompt_ids(Path(args.hf), args.prompts)).repeat_interleave(args.group, 0)
    config = GenerationConfig(max_new_tokens=args.new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              eos_token_id=EOS, pad_token_id=EOS, disable_compile=True)  # TRL's (GRPOTrainer)

    def sample(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return sum(completion_tokens(row) for row in out[:, ids.shape[1]:].tolist())

    return timed_rollouts(sample, args)


def step_msllm(args) -> dict:
    """`msllm train` in this process; step_s of its metrics rows (the first one compiles)."""
    import msllm
    from msllm.cli import main

    hf, run = Path(args.hf), Path(tempfile.mkdtemp()) / "run"
    steps = args.warmup + args.steps
    values = {"data.path": hf / "prompts.jsonl", "data.seq_len": args.prompt_len + args.new, "train.run_dir": run,
              "train.objective": "grpo", "train.steps": steps, "train.batch_size": args.prompts,
              "train.log_every": 1, "train.ckpt_every": steps, "train.sample_tokens": 0, "train.threads": args.threads,
              "data.shuffle": "false", "optim.lr": 1e-5, "optim.min_lr": 0.0, "optim.warmup_steps": 0,
              "optim.decay": "constant",
              "optim.grad_clip": 1.0, "lora.rank": RANK, "lora.alpha": 2 * RANK, "lora.targets": f"[{TARGETS}]",
              "grpo.reward": f"[{hf / 'rewards.py'}:reward]", "grpo.group_size": args.group,
              "grpo.max_new_tokens": args.new, "grpo.loss_type": "dapo"}
    started = time.perf_counter()
    assert main(["train", "--init-from", str(hf), *[a for k, v in values.items() for a in ("--set", f"{k}={v}")]]) == 0
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    times = [r["step_s"] for r in rows]
    return {"first_step_s": times[0], "step_s": statistics.median(times[args.warmup:]), "step_times": times,
            "rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in rows[args.warmup:]),
            # where a step's time goes: sampling, the compiled update, the rest (weights to the generator, rewards)
            "rollout_s": statistics.median(r["rollout_s"] for r in rows[args.warmup:]),
            "update_s": statistics.median(r["update_s"] for r in rows[args.warmup:]),
            "run_s": time.perf_counter() - started, "msllm": str(Path(msllm.__file__).parents[1])}


def step_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    hf = Path(args.hf)
    sys.path.insert(0, str(hf))
    from rewards import reward

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    steps = args.warmup + args.steps
    rows = [json.loads(line) for line in (hf / "prompts.jsonl").read_text().splitlines()]
    config = GRPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                        max_completion_length=args.new, temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo",
                        beta=0.0, max_steps=steps, learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0,
                        max_grad_norm=1.0, logging_steps=1, shuffle_dataset=False)
    timer = StepTimes()
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(hf).float(), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(hf),
                          peft_config=LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                                 target_modules=[f"{m}_proj" for m in TARGETS.split(",")]),
                          callbacks=[timer])
    trainer.train()
    return {"first_step_s": timer.times[0], "step_s": statistics.median(timer.times[args.warmup:]),
            "step_times": timer.times}


WORKERS = {("rollout", "msllm"): rollout_msllm, ("rollout", "transformers"): rollout_transformers,
           ("step", "msllm"): step_msllm, ("step", "trl"): step_trl}


def spawn(part: str, variant: str, args, hf: Path) -> dict:
    side = {"msllm-before": args.before, "msllm-after": args.after}.get(variant, str(REPO))
    cmd = [sys.executable, __file__, "--worker", variant, "--part", part, "--hf", str(hf), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--prompts", str(args.prompts),
           "--group", str(args.group), "--new", str(args.new), "--prompt-len", str(args.prompt_len)]
    return run_worker(cmd, side)


def report(args, results: dict) -> str:
    tokens = args.prompts * args.group * args.new
    lines = [f"# GRPO on CPU, {args.shape}: msllm vs transformers generate / TRL GRPOTrainer + torch eager", "",
             *provenance("bench_grpo.py", args),
             f"* **Conditions**: fp32, {args.prompts} prompts of {args.prompt_len} tokens x {args.group} completions "
             f"of up to {args.new} tokens (<= {tokens} a step), temperature 1, top_p 1, top_k 0, EOS stops; step: "
             f"LoRA rank {RANK} alpha {2 * RANK} on {TARGETS}, dapo, beta 0, one update per batch, AdamW + clip 1.0; "
             f"{args.threads} threads; {args.warmup} warm-up calls / steps, median of {args.steps}; variants "
             f"alternated over {args.rounds} rounds (each cell: median of the rounds, peak RSS their max)", ""]
    for part, base, unit in (("rollout", "transformers", "rollout tokens/s"), ("step", "trl", "step s")):
        runs = {v: r for (p, v), r in results.items() if p == part}
        if not runs:
            continue
        title = "(a) rollout generation" if part == "rollout" else "(b) a whole GRPO step"
        lines += [f"## {title}",
                  "", f"| variant | {unit} | vs {base} | peak RSS MB | first call s |", "|---|---|---|---|---|"]
        key = "tokens_per_s" if part == "rollout" else "step_s"
        value = {v: statistics.median(r[key] for r in rs) for v, rs in runs.items() if all(key in r for r in rs)}
        for variant, rs in runs.items():
            if variant not in value:
                lines.append(f"| {variant} | failed: {next(r.get('error', '') for r in rs if key not in r)} | | | |")
                continue
            ratio = "n/a"
            if base in value:
                ratio = value[variant] / value[base] if part == "rollout" else value[base] / value[variant]
                ratio = f"{ratio:.2f}x"
            shown = f"{value[variant]:,.0f}" if part == "rollout" else f"{value[variant]:.3f}"
            lines.append(f"| {variant} | {shown} | {ratio} | {max(r['peak_rss_mb'] for r in rs):,.0f} | "
                         f"{statistics.median(r['first_step_s'] for r in rs):.1f} |")
        for variant, rs in runs.items():
            if variant in value and all("update_s" in r for r in rs):
                rollout, update = (statistics.median(r[k] for r in rs) for k in ("rollout_s", "update_s"))
                lines.append(f"\n{variant} step: rollout {rollout:.3f} s, update {update:.3f} s, the rest "
                             f"{value[variant] - rollout - update:.3f} s (weights to the generator, rewards, inputs)")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="W1")
    p.add_argument("--parts", default="rollout,step")
    p.add_argument("--before", help="checkout of msllm before a change (git worktree add)")
    p.add_argument("--after", default=str(REPO))
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="directory for the markdown table and JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return print_result(WORKERS[args.part, "msllm" if args.worker.startswith("msllm") else args.worker](args))
    args.before = args.before or args.after
    msllm_sides = ["msllm-after"] + (["msllm-before"] if args.before != args.after else [])
    variants = [(part, v) for part in args.parts.split(",")
                for v in msllm_sides + ["transformers" if part == "rollout" else "trl"]]
    with tempfile.TemporaryDirectory() as tmp:
        write_inputs(args.shape, Path(tmp), args.prompts, args.prompt_len,
                     args.prompts * (args.warmup + args.steps))
        results = alternate(variants, args.rounds, lambda pv: spawn(*pv, args, Path(tmp)))
    text = report(args, results)
    print(text)
    save(args.out, f"grpo-{args.shape}", text, {"args": vars(args), "results": {f"{p}/{v}": r for (p, v), r in
                                                                               results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
