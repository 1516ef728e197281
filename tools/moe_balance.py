"""How evenly a MoE model's experts are loaded over a short run, with and without balancing.

Trains the same tiny MoE model (configs/tiny.yaml with 8 experts, top 2, every MLP MoE) on the
default corpus once per variant, and prints the worst layer's busiest expert over the mean
(`expert_load_max` of metrics.jsonl: 1.0 is even, E / k = 4.0 every token to the same 2 experts)
as a table over the steps, the expert-load "plot" of docs/moe.md.

    python tools/moe_balance.py --steps 100 --out runs/moe_balance

Variants: no balancing; the load-balancing loss (router_aux_loss_coef 0.01); a capacity factor
of 1.25 (drops counted); DeepSeek-V3's grouped sigmoid router without and with its bias update.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_ffn_size": 176}
VARIANTS = {
    "none": {},
    "aux 0.01": {"model.router_aux_loss_coef": 0.01},
    "capacity 1.25": {"train.moe_capacity_factor": 1.25},
    # DeepSeek-V3's router (sigmoid scores, 2 groups of 4, the best group only) without and with its
    # aux-loss-free bias update
    "sigmoid": {"model.router": "sigmoid_grouped", "model.expert_groups": 2, "model.topk_groups": 1},
    "sigmoid + bias 0.001": {"model.router": "sigmoid_grouped", "model.expert_groups": 2, "model.topk_groups": 1,
                             "train.moe_bias_update_rate": 0.001},
}


def train(run_dir: Path, steps: int, log_every: int, extra: dict) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed or appended one
    sets = {**MOE, **extra, "train.steps": steps, "train.log_every": log_every, "train.eval_every": steps,
            "train.ckpt_every": steps, "train.sample_tokens": 0, "train.run_dir": str(run_dir)}
    cmd = [sys.executable, "-m", "msllm.cli", "train", "--config", "configs/tiny.yaml",
           *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="runs/moe_balance")
    args = p.parse_args(argv)
    runs = {}
    for name, extra in VARIANTS.items():
        runs[name] = train(Path(args.out) / name.replace(" ", "_"), args.steps, args.log_every, extra)
        print(f"{name}: done, final loss {runs[name][-1]['loss']:.4f}", flush=True)
    steps = [r["step"] for r in runs["none"]]
    print("\nworst layer's expert load, max / mean (1.0 = even, 4.0 = all tokens to 2 of 8 experts)\n")
    print("| step | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for i, step in enumerate(steps):
        cells = []
        for name in VARIANTS:
            r = runs[name][i]
            cells.append(f"{r['expert_load_max']:.2f}" + (f" ({r['dropped']:.0%} dropped)" if r.get("dropped") else ""))
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("\nfinal loss: " + ", ".join(f"{n} {runs[n][-1]['loss']:.4f}" for n in VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
