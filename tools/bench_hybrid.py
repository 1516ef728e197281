"""A Qwen3.5-shaped hybrid (3 Gated DeltaNet layers to 1 gated attention layer) on CPU: msllm vs transformers.

Train: tools/bench_train.py's workload as --family qwen3_5 (W1: hidden 512, 4 layers 3:1, seq 256, batch 4),
one fp32 AdamW step with clip 1.0. msllm GRAPH, HF + torch eager and torch.compile each run in a process of
their own (bench_train's workers: median step after warm-up, first step, peak RSS), alternated over --rounds
rounds with the order flipped each round. Issue 41's targets: >= 1.5x torch eager, >= 1.0x torch.compile.

Decode: the same model with transformers' random init, saved and converted by `msllm convert`. For each
context length of --contexts, a prompt of that many tokens, then --timed greedy one-token steps: msllm's
engine (tools/bench_generate.py's engine worker, GRAPH) against transformers' generate (a worker of this
script: the --timed steps after the first new token of one generate, stamped per token, so the prefill is
not counted), the two workers timed in turns. Targets: time per token flat in the context length (a
fixed-size state, not a cache that grows) and >= 1.5x transformers' generate. Both decode sides use their
library's default threads (every core); --threads sets the train step's.

    python tools/bench_hybrid.py --out benchmarks           # W1 hybrid, train and decode
    python tools/bench_hybrid.py --workload T --contexts 16,64 --timed 4 --rounds 1 --steps 2 --warmup 1
                                                            # a seconds-long smoke run of the tool
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import bench_train  # noqa: E402
from tools.bench_big_vocab import provenance, save  # noqa: E402
from tools.bench_generate import Worker, engine_worker  # noqa: E402
from tests.test_generate import byte_tokenizer  # noqa: E402

FAMILY = "qwen3_5"
TRAIN_VARIANTS = ("msllm-graph", "torch-eager", "torch-compile")
TRAIN_TARGETS = {"torch-eager": 1.5, "torch-compile": 1.0}  # msllm's speed-up over each, at least
DECODE_TARGET = 1.5                                        # over transformers' generate, at least


def train(args) -> dict:
    """variant -> one result per round (bench_train.spawn's dict: step_s, first_step_s, peak_rss_mb)."""
    worker_args = argparse.Namespace(steps=args.steps, warmup=args.warmup, threads=args.threads, family=FAMILY,
                                     seq=0, jit_level="O0", fused_kernels="auto", block_graph="auto",
                                     attention="auto")
    results = {v: [] for v in TRAIN_VARIANTS}
    for r in range(args.rounds):
        for variant in TRAIN_VARIANTS if r % 2 == 0 else TRAIN_VARIANTS[::-1]:
            result = bench_train.spawn(variant, args.workload, worker_args)
            results[variant].append(result)
            print(f"train round {r} {variant}: " + json.dumps({k: v for k, v in result.items() if k != "step_times"}),
                  flush=True)
    return results


def save_model(w: dict, context: int, out: Path) -> tuple[Path, Path]:
    """The workload's hybrid as transformers initialises it (seed 0), room for `context` tokens, with
    tests/test_generate.py's byte-level tokenizer, converted: (the HF dir, the msllm checkpoint) under out."""
    import torch
    import transformers

    config = bench_train.hf_config(w, FAMILY)
    config.max_position_embeddings = context
    torch.manual_seed(0)
    getattr(transformers, bench_train.FAMILIES[FAMILY][1])(config).save_pretrained(out / "hf")
    byte_tokenizer().save(str(out / "hf" / "tokenizer.json"))  # the engine loads a run with its tokenizer
    done = subprocess.run([sys.executable, "-m", "msllm.cli", "convert", str(out / "hf"), str(out / "msllm")],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"msllm convert failed: {done.stderr.strip()[-2000:]}")
    return out / "hf", out / "msllm"


def torch_worker(hf: Path, prompt_ids: list[int], new: int) -> None:
    """transformers' generate in this process, as bench_generate.engine_worker answers for an engine: its
    first `new` greedy tokens, then for each N read from stdin the seconds of the N one-token steps after the
    first token of one generate of N + 1 (stamped by a stopping criterion, which generate calls after every
    token: a difference of two generates would carry the noise of two prefills)."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Stamps(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = torch.tensor([prompt_ids])

    def generate(tokens: int) -> tuple[list[int], float]:
        stamps = Stamps()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamps]))
        return out[0, len(prompt_ids):].tolist(), stamps.times[-1] - stamps.times[0]

    print(json.dumps({"greedy_ids": generate(new)[0]}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"seconds": generate(int(line) + 1)[1]}), flush=True)


def peak_rss_mb(pid: int) -> float:
    """A live process's own peak RSS (VmHWM), as the kernel records it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def decode(args, w: dict, work: Path) -> dict:
    """context -> {side: {"per_token_s": [one per round], "peak_rss_mb", "greedy_ids"}} for msllm and torch."""
    import numpy as np

    contexts = [int(c) for c in args.contexts.split(",")]
    hf, ckpt = save_model(w, max(contexts) + args.timed + 8, work)
    results = {}
    for context in contexts:
        prompt = np.random.default_rng(context).integers(3, w["vocab"], context).tolist()
        workers = {"msllm": Worker("msllm", ckpt, prompt, args.check_tokens, work / f"msllm-{context}.log"),
                   "torch": Worker("torch", hf, prompt, args.check_tokens, work / f"torch-{context}.log",
                                   script=Path(__file__))}
        taken = {side: [] for side in workers}
        for r in range(args.rounds + 1):  # round 0 warms both up
            for side, worker in (workers.items() if r % 2 == 0 else list(workers.items())[::-1]):
                seconds = worker.seconds(args.timed)
                if r:
                    taken[side].append(seconds / args.timed)
        results[context] = {side: {"per_token_s": taken[side], "peak_rss_mb": peak_rss_mb(worker.proc.pid),
                                   "greedy_ids": worker.greedy_ids} for side, worker in workers.items()}
        for worker in workers.values():
            worker.close()
        print(f"decode context {context}: " + json.dumps({s: {"ms_per_token": 1e3 * statistics.median(r["per_token_s"]),
                                                               "peak_rss_mb": r["peak_rss_mb"]}
                                                           for s, r in results[context].items()}), flush=True)
    return results


def report(args, w: dict, trained: dict, decoded: dict) -> str:
    tokens = w["batch"] * w["seq"]
    shape = bench_train.hf_config(w, FAMILY)
    lines = [f"# Qwen3.5-shaped hybrid on CPU ({args.workload}): train step and decode, msllm vs transformers", "",
             *provenance("bench_hybrid.py", args),
             f"* **Model**: vocab {w['vocab']}, hidden {w['hidden']}, {w['layers']} layers "
             f"({', '.join(shape.layer_types)}), attention {w['heads']} heads / {w['kv_heads']} KV of "
             f"{shape.head_dim}, Gated DeltaNet {shape.linear_num_key_heads} key / {shape.linear_num_value_heads} "
             f"value heads of {shape.linear_key_head_dim} / {shape.linear_value_head_dim}, conv "
             f"{shape.linear_conv_kernel_dim}, MLP {w['ffn']}; fp32, {args.threads} threads", ""]
    if trained:
        lines += [f"## Train step: batch {w['batch']} x seq {w['seq']}, AdamW + clip 1.0; {args.warmup} warm-up "
                  f"steps, median of {args.steps}, variants alternated over {args.rounds} rounds (median of the "
                  f"rounds' medians, peak RSS the rounds' max)", "",
                  "| variant | tokens/s | msllm's speed-up over it | target | peak RSS MB | first step s |",
                  "|---|---|---|---|---|---|"]
        ok = {v: [r for r in runs if "error" not in r] for v, runs in trained.items()}
        step = {v: statistics.median(r["step_s"] for r in runs) for v, runs in ok.items() if runs}
        for variant, runs in trained.items():
            if variant not in step:
                lines.append(f"| {variant} | error: {runs[-1]['error']} | | | | |")
                continue
            ratio = step[variant] / step["msllm-graph"] if "msllm-graph" in step else None
            target = TRAIN_TARGETS.get(variant)
            met = "" if target is None or ratio is None else f">= {target}x: {'met' if ratio >= target else 'NOT met'}"
            lines.append(f"| {variant} | {tokens / step[variant]:,.0f} | "
                         f"{'' if variant == 'msllm-graph' or ratio is None else f'{ratio:.2f}x'} | {met} | "
                         f"{max(r['peak_rss_mb'] for r in ok[variant]):,.0f} | "
                         f"{statistics.median(r['first_step_s'] for r in ok[variant]):.1f} |")
        lines.append("")
    if decoded:
        contexts = sorted(decoded)
        lines += [f"## Decode: a prompt of each context length, then {args.timed} greedy one-token steps; msllm's "
                  f"engine and transformers' generate timed in turns over {args.rounds} rounds after a warm-up "
                  f"round (median)", "",
                  "| context | msllm ms/token | transformers generate ms/token | msllm's speed-up | "
                  f"first {args.check_tokens} greedy tokens | peak RSS MB msllm / torch |", "|---|---|---|---|---|---|"]
        per_token = {c: {s: statistics.median(r["per_token_s"]) for s, r in decoded[c].items()} for c in contexts}
        for c in contexts:
            d = decoded[c]
            same = "same" if d["msllm"]["greedy_ids"] == d["torch"]["greedy_ids"] else "DIFFERENT"
            lines.append(f"| {c} | {1e3 * per_token[c]['msllm']:.2f} | {1e3 * per_token[c]['torch']:.2f} | "
                         f"{per_token[c]['torch'] / per_token[c]['msllm']:.2f}x | {same} | "
                         f"{d['msllm']['peak_rss_mb']:,.0f} / {d['torch']['peak_rss_mb']:,.0f} |")
        growth = {s: per_token[contexts[-1]][s] / per_token[contexts[0]][s] for s in ("msllm", "torch")}
        slowest = min(per_token[c]["torch"] / per_token[c]["msllm"] for c in contexts)
        lines += ["", f"Time per token at context {contexts[-1]} over context {contexts[0]}: msllm "
                  f"{growth['msllm']:.2f}x, transformers {growth['torch']:.2f}x (flat: 1.00x). Speed-up at the "
                  f"least favourable context {slowest:.2f}x (target >= {DECODE_TARGET}x: "
                  f"{'met' if slowest >= DECODE_TARGET else 'NOT met'}).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1", choices=list(bench_train.WORKLOADS))
    p.add_argument("--parts", default="train,decode")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="train: timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="256,1024,4096", help="decode: prompt lengths")
    p.add_argument("--timed", type=int, default=32, help="decode: one-token steps timed per round")
    p.add_argument("--check-tokens", type=int, default=8, help="decode: greedy tokens compared with transformers'")
    p.add_argument("--out", help="directory for the markdown result and JSON (e.g. benchmarks)")
    args = p.parse_args(argv)
    args.before = args.after = str(REPO)  # provenance(): one commit
    w = bench_train.WORKLOADS[args.workload]
    parts = args.parts.split(",")
    trained = train(args) if "train" in parts else {}
    with tempfile.TemporaryDirectory() as tmp:
        decoded = decode(args, w, Path(tmp)) if "decode" in parts else {}
    text = report(args, w, trained, decoded)
    print(text)
    save(args.out, f"hybrid-{args.workload.lower()}", text,
         {"args": vars(args), "workload": w, "train": trained, "decode": {str(c): r for c, r in decoded.items()}})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-worker":  # one side of the decode timing, in its own process
        engine, path, ids, new = sys.argv[2:6]
        if engine == "torch":
            torch_worker(Path(path), json.loads(ids), int(new))
        else:
            engine_worker(engine, Path(path), json.loads(ids), int(new))
        sys.exit(0)
    sys.exit(main())
