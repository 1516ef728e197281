"""One Gated DeltaNet layer alone, forward + backward at a long sequence: msllm's layer with the chunked rule
as graph ops (autodiff backward) and with the C++ kernels CPU training swaps in (msllm.kernels.GatedDeltaRule,
FusedCausalConv and FusedRMSNormCore, hand-written backwards) vs transformers' Qwen3_5GatedDeltaNet running
its torch fallback, torch_chunk_gated_delta_rule, in eager torch.

    python tools/bench_gated_deltanet.py                      # Qwen3.5-like layer: 16 + 16 heads of 128, s 16384
    python tools/bench_gated_deltanet.py --seq 2048 --variants msllm-kernel,torch --rounds 1
    python tools/bench_gated_deltanet.py --shape tiny --steps 1 --warmup 1   # a smoke run of the tool

A step is the layer's forward on x [1, s, hidden] and the backward of out.sum() to x and every weight. Each
variant runs in a process of its own (msllm's with PYTHONPATH on --after / --before), variants alternate over
--rounds rounds, the order flipped each round. Reported: the median step after warm-up; the process's peak
RSS over the timed steps (ru_maxrss, tools/peak_rss.py's measure of one process, its high-water mark reset
after warm-up, so msllm's graph compile's transient peak is not counted: that peak is its own column) and the
steps' own peak: that minus the RSS before the first step (imports, weights and inputs excluded, which differ
between the frameworks; what the first steps allocated and kept, as MindSpore's memory pool does, counts).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_big_vocab import alternate, print_result, provenance, run_worker, save, time_steps  # noqa: E402

SHAPES = {  # Qwen3.5's linear layers: 16 key heads of 128 (its 9B: 32 value heads; here as many as key heads)
    "qwen3.5": dict(hidden=2048, key_heads=16, value_heads=16, key_dim=128, value_dim=128, seq=16384),
    "tiny": dict(hidden=64, key_heads=2, value_heads=2, key_dim=16, value_dim=16, seq=256),
}


def worker_msllm(args, kernel: bool) -> dict:
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    import msllm
    from msllm import device, kernels
    from msllm.config import ModelConfig
    from msllm.models.mixers.gated_deltanet import GatedDeltaNet

    device.setup("cpu", "graph", args.threads)
    shape = SHAPES[args.shape]
    cfg = ModelConfig(vocab_size=256, hidden_size=shape["hidden"], num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=shape["key_dim"], ffn_size=shape["hidden"], layer_types=["linear"],
                      linear_num_key_heads=shape["key_heads"], linear_num_value_heads=shape["value_heads"],
                      linear_key_head_dim=shape["key_dim"], linear_value_head_dim=shape["value_dim"])
    layer = GatedDeltaNet(cfg)
    rng = np.random.default_rng(0)
    for p in layer.trainable_params():  # a layer off its zero init: weights ~ torch's Linear init scale
        p.set_data(ms.Tensor(rng.uniform(-1, 1, p.shape).astype(np.float32) / np.sqrt(p.shape[-1])))
    if kernel:  # as msllm.backends.cpu.specialise does for fused training
        layer.rule, layer.gate = kernels.GatedDeltaRule(), kernels.FusedSwiGLU()
        for conv in (layer.conv_q, layer.conv_k, layer.conv_v):
            conv.core = kernels.FusedCausalConv()
        layer.norm.core = kernels.FusedRMSNormCore(layer.norm.eps, layer.norm.offset)
    s = args.seq or shape["seq"]
    x = ms.Tensor(rng.normal(size=(s, shape["hidden"])).astype(np.float32))
    table = ms.Tensor(np.zeros((s, shape["key_dim"]), np.float32))  # the mixer reads only its length

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def construct(self, x):
            return self.layer(x, table, table, None)[0].sum()

    loss = Loss()
    step = ms.jit(ops.value_and_grad(loss, grad_position=0, weights=loss.trainable_params()))
    result = time_steps(lambda: step(x)[0].asnumpy(), args.steps, args.warmup, reset_peak=True)
    result["msllm"] = str(Path(msllm.__file__).parents[1])
    return result


def worker_torch(args) -> dict:
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    config = Qwen3_5TextConfig(hidden_size=shape["hidden"], num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=shape["key_heads"], linear_num_value_heads=shape["value_heads"],
                               linear_key_head_dim=shape["key_dim"], linear_value_head_dim=shape["value_dim"])
    layer = Qwen3_5GatedDeltaNet(config, 0).float()
    x = torch.randn(1, args.seq or shape["seq"], shape["hidden"], requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x).sum()
        out.backward()
        return float(out)

    return time_steps(step, args.steps, args.warmup, reset_peak=True)


def spawn(variant: str, args) -> dict:
    """variant: msllm-graph, msllm-kernel (of --after), msllm-before-graph / -kernel (of --before), torch."""
    side = args.before if variant.startswith("msllm-before") else args.after
    cmd = [sys.executable, __file__, "--worker", variant, "--shape", args.shape, "--seq", str(args.seq),
           "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    return run_worker(cmd, side)


def report(args, results: dict) -> str:
    shape = SHAPES[args.shape]
    lines = [f"# One Gated DeltaNet layer, forward + backward, {args.shape}: msllm (graph rule, C++ rule) vs "
             "transformers' torch_chunk_gated_delta_rule", "",
             *provenance("bench_gated_deltanet.py", args),
             f"* **Conditions**: fp32, batch 1, s {args.seq or shape['seq']}, hidden {shape['hidden']}, {shape['key_heads']} key / "
             f"{shape['value_heads']} value heads of {shape['key_dim']} / {shape['value_dim']}, loss out.sum(), "
             f"gradients of x and every weight; {args.threads} threads; {args.warmup} warm-up steps, median of "
             f"{args.steps}; variants alternated over {args.rounds} rounds (median of the rounds' medians, RSS the "
             "rounds' max)", "",
             "| variant | step s | time vs torch | peak RSS MB | steps' own peak MB | vs torch | first step s | "
             "peak RSS MB with warm-up |", "|---|---|---|---|---|---|---|---|"]
    ok = {v: [r for r in runs if "error" not in r] for v, runs in results.items()}
    base = ok.get("torch") or []
    base_s = statistics.median(r["step_s"] for r in base) if base else None
    base_peak = max(r["peak_rss_mb"] - r["rss_before_mb"] for r in base) if base else None
    for variant, runs in results.items():
        if not ok[variant]:
            lines.append(f"| {variant} | failed: {runs[-1]['error']} | | | | | | |")
            continue
        good = ok[variant]
        s = statistics.median(r["step_s"] for r in good)
        peak = max(r["peak_rss_mb"] for r in good)
        own = max(r["peak_rss_mb"] - r["rss_before_mb"] for r in good)
        lines.append(f"| {variant} | {s:.3f} | {f'{s / base_s:.2f}x' if base_s else 'n/a'} | {peak:,.0f} | {own:,.0f} | "
                     f"{f'{own / base_peak:.2f}x' if base_peak else 'n/a'} | "
                     f"{statistics.median(r['first_step_s'] for r in good):.1f} | "
                     f"{max(r['warmup_peak_rss_mb'] for r in good):,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3.5")
    p.add_argument("--seq", type=int, default=0, help="tokens (default: the shape's)")
    p.add_argument("--before", help="checkout of msllm before a change (git worktree add)")
    p.add_argument("--after", default=str(REPO))
    p.add_argument("--variants", default="msllm-kernel,msllm-graph,torch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", help="directory for the markdown table and JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if args.worker == "torch":
            return print_result(worker_torch(args))
        return print_result(worker_msllm(args, kernel=args.worker.endswith("kernel")))
    variants = [v for v in args.variants.split(",") if not v.startswith("msllm-before") or args.before]
    args.before = args.before or args.after
    results = alternate(variants, args.rounds, lambda variant: spawn(variant, args))
    text = report(args, results)
    print(text)
    save(args.out, f"gated-deltanet-{args.shape}", text, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
