"""Fine-tuning benchmark: msllm LoRA and full fine-tune vs transformers + peft + torch eager.

The same random Llama (saved once as a Hugging Face dir, which msllm reads with --init-from's
reader) and the same SFT-shaped batch (one sample per window, the first half of each masked out
of the loss) for every variant; each variant in its own process, reporting the median step time
after warm-up, tokens/s and its own peak RSS. Ratios are against the torch variant of the same
kind (LoRA vs peft, full vs full). Writes JSON and a markdown table under --out, dated and
naming the CPU.

    python tools/bench_finetune.py                         # W1: msllm-lora, peft-lora, msllm-full, torch-full
    python tools/bench_finetune.py --workload W2 --variants msllm-lora,peft-lora
    python tools/bench_finetune.py --workload tiny --steps 2 --warmup 1 --out /tmp/bench   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_dp import cpu_name  # noqa: E402
from tools.bench_big_vocab import torch_step  # noqa: E402
from tools.bench_train import WORKLOADS, hf_model, time_steps, tokens  # noqa: E402

WORKLOADS = {**WORKLOADS, "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32, batch=2)}
VARIANTS = ("msllm-lora", "peft-lora", "msllm-full", "torch-full")
BASELINE = {"msllm-lora": "peft-lora", "msllm-full": "torch-full"}
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                "down": "down_proj"}


def loss_mask(w: dict):
    import numpy as np
    mask = np.ones((w["batch"], w["seq"]), np.float32)
    mask[:, : w["seq"] // 2] = 0  # the "prompt"
    return mask


def worker_msllm(w: dict, args) -> dict:
    import mindspore as ms
    import numpy as np

    from interop.pretrained import InitFrom, describe
    from msllm import device
    from msllm.config_file import load_config
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph", args.threads)
    lora = ["lora.rank=%d" % args.rank, "lora.alpha=%g" % (2 * args.rank), f"lora.targets=[{args.targets}]"]
    cfg = load_config(None, [f"train.init_from={args.hf}", "data.path=bench.jsonl", f"data.seq_len={w['seq']}",
                             f"train.batch_size={w['batch']}", f"train.threads={args.threads}", "train.steps=1000",
                             "optim.warmup_steps=0", "optim.grad_clip=1.0"] + (lora if args.kind == "lora" else []),
                      pretrained=describe)
    step = build_train_step(cfg, load_weights=InitFrom(cfg).load_base).train_step
    segments = np.ones((w["batch"], w["seq"]), np.int32)
    positions = np.broadcast_to(np.arange(w["seq"], dtype=np.int32), segments.shape).copy()
    batch = [ms.Tensor(x) for x in (tokens(w), loss_mask(w), segments, positions)]
    return time_steps(lambda: step(*batch)[0].asnumpy(), args.steps, args.warmup)


def worker_torch(w: dict, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    if args.kind == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                 target_modules=[PEFT_MODULES[t.strip()] for t in args.targets.split(",")]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = torch.from_numpy(tokens(w)).long()
    labels = batch[:, 1:].clone()
    labels[torch.from_numpy(loss_mask(w)) == 0] = -100

    return time_steps(torch_step(lambda: model(input_ids=batch[:, :-1]).logits, labels, params, opt), args.steps,
                      args.warmup)


def spawn(variant: str, args, hf: Path) -> dict:
    kind = variant.split("-")[1]
    cmd = [sys.executable, __file__, "--worker", variant.split("-")[0], "--kind", kind, "--hf", str(hf),
           "--workload", args.workload, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--rank", str(args.rank), "--targets", args.targets]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"}, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def report(args, results: dict) -> str:
    w = WORKLOADS[args.workload]
    tokens_per_step = w["batch"] * w["seq"]
    lines = [f"# Fine-tuning step on CPU, {args.workload}: msllm vs transformers + peft + torch eager", "",
             f"* **Command**: `python tools/bench_finetune.py {' '.join(sys.argv[1:])}`",
             f"* **Commit**: `{commit()}`", f"* **Machine**: {cpu_name()}",
             f"* **Conditions**: fp32, AdamW + clip 1.0, SFT-shaped batch {w['batch']}x{w['seq']} (loss on the second "
             f"half), LoRA rank {args.rank} alpha {2 * args.rank} on {args.targets}; {args.threads} threads; "
             f"{args.warmup} warm-up steps, median of {args.steps}", "",
             "| variant | tokens/s | vs torch | first step s | peak RSS MB | RSS vs torch |", "|---|---|---|---|---|---|"]
    for variant, r in results.items():
        if "error" in r:
            lines.append(f"| {variant} | error: {r['error']} | | | | |")
            continue
        base = results.get(BASELINE.get(variant, ""), {})
        speed = f"{base['step_s'] / r['step_s']:.2f}x" if "step_s" in base else ""
        rss = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if "peak_rss_mb" in base else ""
        lines.append(f"| {variant} | {tokens_per_step / r['step_s']:,.0f} | {speed} | {r['first_step_s']:.1f} | "
                     f"{r['peak_rss_mb']:,.0f} | {rss} |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return proc.stdout.strip() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="W1")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--out", default=str(REPO / "benchmarks"))
    p.add_argument("--worker", choices=["msllm", "peft", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["lora", "full"], help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    w = WORKLOADS[args.workload]
    if args.worker:
        result = worker_msllm(w, args) if args.worker == "msllm" else worker_torch(w, args)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        import torch
        torch.manual_seed(0)
        hf_model(w).save_pretrained(tmp)  # one base model for every variant
        for variant in args.variants.split(","):
            results[variant] = spawn(variant, args, Path(tmp))
            print(variant, json.dumps({k: v for k, v in results[variant].items() if k != "step_times"}), flush=True)
    text = report(args, results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y-%m-%d')}-finetune-{args.workload.lower()}-cpu"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps({"workload": w, "cpu": cpu_name(), "commit": commit(),
                                                  "args": vars(args), "results": results}, indent=1))
    print(f"saved {out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
