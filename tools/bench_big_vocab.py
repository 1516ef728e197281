"""Big-vocabulary fine-tuning: msllm before / after a change vs transformers + peft + torch eager and
torch.compile, on a model with a real family's shapes and random weights (built from its config).

    git worktree add /tmp/before <commit>
    python tools/bench_big_vocab.py --before /tmp/before                      # Gemma 3 270M's shapes
    python tools/bench_big_vocab.py --before /tmp/before --shape qwen3-0.6b --kinds lora

The batch is SFT-shaped: 8 packed rows of 128 tokens, samples of 20-60 tokens whose last ~20 % are
the response (the loss positions), as msllm.data.sft packs them. Every variant runs in a process of
its own (msllm's with PYTHONPATH on its checkout), reporting the median step time after warm-up and
its peak RSS (getrusage); the variants are alternated over --rounds rounds, the order flipped each
round, so a drifting machine affects all alike. The torch side gets the same rows, the loss on the
same positions (labels -100 elsewhere) and positions restarting per sample; its attention is not
cut between packed samples (the cost is the same). Prints a markdown table; --out writes it with
JSON beside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# transformers config class and values: the published configs' shapes (random weights)
SHAPES = {
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True)),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True)),
    # a smoke run of the tool
    "tiny": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=65536, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=64, max_position_embeddings=256,
        tie_word_embeddings=True)),
}
TARGETS = "q,k,v,o"
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def batch(vocab: int, rows: int = 8, seq: int = 128, seed: int = 0):
    """tokens [rows, seq+1], mask, segments, positions [rows, seq]: packed samples, ~20 % response."""
    import numpy as np

    from msllm.data.sft import pack, positions
    rng = np.random.default_rng(seed)
    samples, total = [], 0
    while total < rows * (seq + 1) * 1.5:
        n = int(rng.integers(20, 61))
        response = max(2, n // 5)
        samples.append((rng.integers(0, vocab, n).tolist(), [0] * (n - response) + [1] * response))
        total += n
    tokens, mask, segments = pack(samples, seq, 0)
    tokens, mask, segments = tokens[:rows], mask[:rows].astype(np.float32), segments[:rows].astype(np.int32)
    return tokens, mask, segments, positions(segments).astype(np.int32)


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def time_steps(step, steps: int, warmup: int, reset_peak: bool = False) -> dict:
    """The first step's seconds (msllm: the compile), then after warm-up the median of `steps`.
    reset_peak: also the RSS before the first step and the peak over warm-up, then the process's RSS high-water
    mark reset (/proc/self/clear_refs 5) so that it and ru_maxrss cover the timed steps alone."""
    setup = current_rss_mb() if reset_peak else None
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    result = {"first_step_s": first}
    if reset_peak:
        result.update(warmup_peak_rss_mb=peak_rss_mb(), rss_before_mb=setup)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    # cpu_s: the process's CPU seconds a step, which other processes' load inflates less than the wall time
    return {**result, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "step_times": times}


def worker_msllm(args, vocab: int) -> dict:
    import mindspore as ms

    import msllm
    from interop.pretrained import InitFrom, describe
    from msllm import device
    from msllm.config_file import load_config
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph", args.threads)
    lora = [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}", f"lora.targets=[{TARGETS}]"]
    cfg = load_config(None, [f"train.init_from={args.hf}", "data.path=bench.jsonl", "data.seq_len=128",
                             "train.batch_size=8", f"train.threads={args.threads}", "train.steps=1000",
                             "optim.warmup_steps=0", "optim.grad_clip=1.0"] + (lora if args.kind == "lora" else []),
                      pretrained=describe)
    step = build_train_step(cfg, load_weights=InitFrom(cfg).load_base).train_step
    arrays = list(batch(vocab))
    try:  # a checkout with loss rows (issue 44) feeds them as its trainer does
        from msllm.data.loader import head_rows
        if cfg.train.head_rows == "loss":
            arrays.append(head_rows(arrays[1], 1))
    except ImportError:
        pass
    inputs = [ms.Tensor(x) for x in arrays]
    result = time_steps(lambda: step(*inputs)[0].asnumpy(), args.steps, args.warmup)
    result["msllm"] = str(Path(msllm.__file__).parents[1])
    result["head_positions"] = int(arrays[4].size) if len(arrays) > 4 else int(arrays[1].size)
    return result


def worker_torch(args, compile_: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    if args.kind == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                 target_modules=[PEFT_MODULES[t] for t in TARGETS.split(",")]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens, mask, _, positions = (torch.from_numpy(x) for x in batch(model.config.vocab_size))
    ids, labels = tokens[:, :-1].long(), tokens[:, 1:].long().clone()
    labels[mask == 0] = -100
    forward = torch.compile(model) if compile_ else model

    return time_steps(torch_step(lambda: forward(input_ids=ids, position_ids=positions.long()).logits, labels, params,
                                 opt), args.steps, args.warmup)


def torch_step(logits_of, labels, params, opt):
    """One HF + torch training step as a function: cross-entropy of logits_of() against labels (-100: no loss),
    backward, gradient clipping at 1.0, the optimizer's step; it returns the loss."""
    import torch

    def step():
        logits = logits_of()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss)

    return step


def save_model(shape: str, out: Path, layers: int = 0) -> None:
    """The shape's model with random weights; `layers` > 0: that many layers instead (a scaled-down run)."""
    import torch
    import transformers
    config_class, model_class, values = SHAPES[shape]
    values = {**values, "num_hidden_layers": layers} if layers else values
    torch.manual_seed(0)
    getattr(transformers, model_class)(getattr(transformers, config_class)(**values)).save_pretrained(out)


def spawn(variant: str, kind: str, args, hf: Path) -> dict:
    """variant: msllm-before, msllm-after, torch-eager, torch-compile."""
    side = {"msllm-before": args.before, "msllm-after": args.after}.get(variant, str(REPO))
    cmd = [sys.executable, __file__, "--worker", variant, "--kind", kind, "--hf", str(hf), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--rank", str(args.rank),
           "--shape", args.shape]
    return run_worker(cmd, side)


def run_worker(cmd: list, side: str, env: dict | None = None) -> dict:
    """A worker process (cmd) run with PYTHONPATH and cwd on the checkout `side` and `env` added to this
    process's environment: its print_result line, or {"error": the last line of its stderr}."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=side,
                          env={**os.environ, "GLOG_v": "3", "PYTHONPATH": side, **(env or {})})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def alternate(variants: list, rounds: int, run) -> dict:
    """variant -> [run(variant) of each round], the variants run in turn, their order flipped every round
    (a drift of the machine's speed then falls on each side alike)."""
    results = {}
    for round_ in range(rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            r = results.setdefault(variant, [])
            r.append(run(variant))
            print(round_, variant, json.dumps({k: v for k, v in r[-1].items() if not k.endswith("_times")}), flush=True)
    return results


def print_result(result: dict) -> int:
    """A worker's last line: its result with the process's peak RSS, for spawn to read."""
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def save(out: str | None, subject: str, text: str, data: dict) -> None:
    """The markdown table and the JSON beside it as <out>/<date>-<subject>-cpu.{md,json}."""
    if not out:
        return
    stem = Path(out) / f"{datetime.date.today()}-{subject}-cpu"
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.md").write_text(text)  # (not with_suffix: "qwen3-0.6b" has a dot)
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    print(f"saved {stem}.md and .json")


def commit_of(side: str) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=side, capture_output=True, text=True).stdout.strip()


def provenance(tool: str, args) -> list[str]:
    """A result file's Command, Commit(s) and Machine lines (benchmarks/README.md asks for them)."""
    return [f"* **Command**: `python tools/{tool} {' '.join(sys.argv[1:])}`",
            (f"* **Commits**: before `{commit_of(args.before)}`, after `{commit_of(args.after)}`"
             if args.before != args.after else f"* **Commit**: `{commit_of(args.after)}`"),
            f"* **Machine**: {cpu_name()}; {datetime.date.today()}"]


def report(args, results: dict) -> str:
    tokens = 8 * 128
    layers = f", {args.layers} layers" if args.layers else ""
    lines = [f"# Big-vocabulary fine-tuning on CPU, {args.shape}'s shapes{layers}: msllm before / after vs torch", "",
             *provenance("bench_big_vocab.py", args),
             f"* **Conditions**: fp32, AdamW + clip 1.0, 8 packed SFT rows x 128 tokens (~20 % loss positions), "
             f"LoRA rank {args.rank} alpha {2 * args.rank} on {TARGETS}; {args.threads} threads; {args.warmup} "
             f"warm-up steps, median of {args.steps}; variants alternated over {args.rounds} rounds (each cell: "
             f"median of the rounds' medians, peak RSS the rounds' max)", "",
             "| kind | variant | tokens/s | vs torch eager | peak RSS MB | RSS vs torch eager | first step s |",
             "|---|---|---|---|---|---|---|"]
    for (kind, variant), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {kind} | {variant} | error: {runs[-1]['error']} | | | | |")
            continue
        step = statistics.median(r["step_s"] for r in ok)
        rss = max(r["peak_rss_mb"] for r in ok)
        base = [r for r in results.get((kind, "torch-eager"), []) if "error" not in r]
        speed = f"{statistics.median(r['step_s'] for r in base) / step:.2f}x" if base else ""
        rss_ratio = f"{rss / max(r['peak_rss_mb'] for r in base):.2f}x" if base else ""
        first = statistics.median(r["first_step_s"] for r in ok)
        lines.append(f"| {kind} | {variant} | {tokens / step:,.0f} | {speed} | {rss:,.0f} | {rss_ratio} | {first:.0f} |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    sys.path.insert(0, str(REPO))
    from tools.bench_dp import cpu_name as name
    return name()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="gemma3-270m")
    p.add_argument("--before", help="checkout of msllm before the change (git worktree add)")
    p.add_argument("--after", default=str(REPO))
    p.add_argument("--kinds", default="lora,full")
    p.add_argument("--variants", default="msllm-before,msllm-after,torch-eager,torch-compile")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--layers", type=int, default=0, help="the shape with this many layers (a scaled-down run)")
    p.add_argument("--out", help="directory for the markdown table and JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["lora", "full"], help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        vocab = SHAPES[args.shape][2]["vocab_size"]
        return print_result(worker_msllm(args, vocab) if args.worker.startswith("msllm")
                            else worker_torch(args, args.worker == "torch-compile"))
    variants = [v for v in args.variants.split(",") if v != "msllm-before" or args.before]
    args.before = args.before or args.after
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(args.shape, Path(tmp), args.layers)
        for round_ in range(args.rounds):
            for kind in args.kinds.split(","):
                for variant in variants if round_ % 2 == 0 else variants[::-1]:
                    r = spawn(variant, kind, args, Path(tmp))
                    results.setdefault((kind, variant), []).append(r)
                    print(round_, kind, variant, json.dumps({k: v for k, v in r.items() if k != "step_times"}),
                          flush=True)
    text = report(args, results)
    print(text)
    save(args.out, f"big-vocab-{args.shape}", text, {"shape": SHAPES[args.shape][2], "args": vars(args),
                                                     "results": {f"{k} {v}": r for (k, v), r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
