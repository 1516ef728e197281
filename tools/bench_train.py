"""Training-throughput benchmark: msllm (GRAPH, PYNATIVE) vs HF+torch eager, torch.compile, MindFormers.

Every variant runs in its own process on the same workload (random tokens, fp32, AdamW, one
full train step), reports the median step time after warm-up, the first-step (compile) time
and its own peak RSS. Ratios are against torch eager. The table is printed and saved as JSON.

    python tools/bench_train.py                          # W1, all variants
    python tools/bench_train.py --workload W2 --variants msllm-graph,torch-eager
    python tools/bench_train.py --variants msllm-graph --recompute none,full,selective --workload W2
    python tools/bench_train.py --compile-layers 2,8,32  # first-step compile time vs depth
    python tools/bench_train.py --compile-layers 2,32 --block-graph shared  # every depth shares the block graph
    python tools/bench_train.py --ab fused-kernels       # msllm with vs without msllm.kernels
    python tools/bench_train.py --ab block-graph         # one block graph for all layers vs inlined
    python tools/bench_train.py --ab attention --workload L --seq 2048   # flash vs softmax attention core
    python tools/bench_train.py --ab moe-dropless --family mixtral      # dropless MoE: blocks vs every expert
    python tools/bench_train.py --family gemma3 --variants msllm-graph,torch-eager,torch-compile
                                                         # the workload's shape as Qwen3 / Gemma 3 (their spec)
    python tools/bench_train.py --family mixtral --moe-capacity 0,1.25 --variants msllm-graph,torch-eager,torch-compile
                                                         # 8 experts top-2: dropless and capacity dispatch
    python tools/bench_train.py --family gpt_oss --variants msllm-graph,torch-eager,torch-compile
                                                         # sinks, alternating windows, 4 experts top-2
    python tools/bench_train.py --variants msllm-graph,torch-compile --rounds 4
                                                         # 4 alternated pairs, each run its own process
    python tools/bench_train.py --variants msllm-before,msllm-graph --before /tmp/before --rounds 6
                                                         # msllm of another checkout (git worktree add) vs this one
    python tools/bench_train.py --variants msllm-graph,msllm-env --env GLIBC_TUNABLES=glibc.malloc.hugetlb=1 --rounds 6
                                                         # the same msllm with runtime environment variables set

--rounds runs every variant once per round, the order flipped each round, each run a process of its own
(a drifting machine affects all alike); a cell is the median of the rounds' medians, and the rounds'
tokens/s are listed, so the spread between processes shows (benchmarks/2026-11-28-w1-spread-cpu.md).

--ab builds both msllm steps in one process and alternates them (--rounds rounds of
--steps-per-round steps each, the order flipped every round), so a machine that drifts
between runs affects both sides alike: a few-percent change is visible that separate runs
would bury in noise.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import bench_big_vocab  # noqa: E402  (alternate, run_worker)
from tools.bench_big_vocab import time_steps  # noqa: E402,F401  (bench_dp's, bench_finetune's too)

# W1 is the reference workload; W2 a larger one that still fits 24 GB with every variant.
WORKLOADS = {
    "W1": dict(vocab=4096, hidden=512, layers=4, heads=8, kv_heads=8, ffn=1376, seq=256, batch=4),
    "W2": dict(vocab=8192, hidden=1024, layers=8, heads=16, kv_heads=4, ffn=2816, seq=512, batch=4),
    # long context (tools/bench_long_context.py): a small model whose attention dominates; --seq sets the length
    "L": dict(vocab=4096, hidden=256, layers=2, heads=4, kv_heads=4, ffn=704, seq=2048, batch=1),
    # a seconds-long smoke run of a tool (tools/bench_hybrid.py --workload T)
    "T": dict(vocab=512, hidden=64, layers=4, heads=4, kv_heads=4, ffn=128, seq=32, batch=2),
}
VARIANTS = ("msllm-graph", "msllm-pynative", "torch-eager", "torch-compile", "mindformers")
# --before's variant: msllm-graph run from that checkout (its own tools/bench_train.py worker)
BEFORE = "msllm-before"
ENV = "msllm-env"  # msllm-graph in a process with --env's variables added
# Family -> (transformers config class, model class, what the family adds to the workload's shape, a value or
# a function of the workload): Qwen3's head_dim 128 apart from hidden / heads, Gemma 3's sliding window half
# the sequence; Qwen3.5 its default 3 Gated DeltaNet layers to 1 gated attention layer, as many value heads
# as attention heads over hidden / heads features each, half as many key heads (Qwen3.5's ratios).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "query_pre_attn_scalar": 64,
                                                         "sliding_window": lambda w: w["seq"] // 2,
                                                         "tie_word_embeddings": False}),
    # W1-sized MoE: every MLP 8 experts of the workload's ffn, each token routed to 2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # DeepSeek-V3's per-head MLA sizes (q/k heads 128 + 64, values 128) on the workload's hidden size: latents
    # scaled down with it, layer 0 dense, then 8 experts of ffn / 4 in 2 groups, top 2 from the best group, and
    # a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": lambda w: w["ffn"] // 4, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5}),
    # gpt-oss: every MLP 4 experts of the workload's ffn (top 2, biased router and experts, clamped SwiGLU),
    # a sink logit per head, sliding (half the sequence) and full layers alternating, YaRN as published
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": lambda w: w["hidden"] // w["heads"], "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": lambda w: w["seq"] // 2}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "head_dim": lambda w: w["hidden"] // w["heads"], "linear_num_key_heads": lambda w: w["heads"] // 2,
        "linear_num_value_heads": lambda w: w["heads"], "linear_key_head_dim": lambda w: w["hidden"] // w["heads"],
        "linear_value_head_dim": lambda w: w["hidden"] // w["heads"]}),
}


def hf_config(w: dict, family: str = "llama"):
    import transformers
    config_class, _, extra = FAMILIES[family]
    extra = {k: v(w) if callable(v) else v for k, v in extra.items()}
    return getattr(transformers, config_class)(
        vocab_size=w["vocab"], hidden_size=w["hidden"], num_hidden_layers=w["layers"], num_attention_heads=w["heads"],
        num_key_value_heads=w["kv_heads"], intermediate_size=w["ffn"], max_position_embeddings=w["seq"], **extra)


def model_config(w: dict, family: str = "llama"):
    """msllm's model for the workload, read from the same transformers config the torch side builds."""
    from interop.hf_config import to_model_config
    if family == "llama":
        from msllm.config import ModelConfig
        return ModelConfig(vocab_size=w["vocab"], hidden_size=w["hidden"], num_layers=w["layers"],
                           num_heads=w["heads"], num_kv_heads=w["kv_heads"], ffn_size=w["ffn"], max_seq_len=w["seq"])
    return to_model_config(hf_config(w, family).to_dict(), f"{family} workload")


def tokens(w: dict, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, w["vocab"], (w["batch"], w["seq"] + 1)).astype(np.int32)


def msllm_train_step(w: dict, **options):
    """The benchmarked msllm step on workload w (AdamW, clip 1.0) and its batch; also used by profile_step.py."""
    built, batch = msllm_build(w, **options)
    return built.train_step, batch


def msllm_build(w: dict, mode: str = "graph", threads: int = 2, jit_level: str = "O0",
                recompute: str = "none", fused_kernels: str = "auto", block_graph: str = "auto",
                family: str = "llama", attention: str = "auto", moe_capacity: float = 0.0, moe_dropless: str = "blocks"):
    """msllm.train.build's result (model, optimizer, step) for workload w, and its batch."""
    import mindspore as ms
    from msllm import device
    from msllm.config import Config, OptimConfig, TrainConfig
    from msllm.train.build import build_train_step

    device.setup("cpu", mode, threads, jit_level)
    cfg = Config(model=model_config(w, family), optim=OptimConfig(warmup_steps=0, grad_clip=1.0),
                 train=TrainConfig(steps=1000, batch_size=w["batch"], seed=0, mode=mode, threads=threads,
                                   jit_level=jit_level, recompute=recompute, fused_kernels=fused_kernels,
                                   block_graph=block_graph, attention=attention, moe_capacity_factor=moe_capacity,
                                   moe_dropless=moe_dropless))
    cfg.data.seq_len = w["seq"]
    return build_train_step(cfg), ms.Tensor(tokens(w))


# --ab SWITCH: the msllm_train_step keyword it flips, and its values for on and off.
AB_SWITCHES = {"fused-kernels": ("fused_kernels", "auto", "off"), "block-graph": ("block_graph", "shared", "inlined"),
               "attention": ("attention", "flash", "softmax"), "moe-dropless": ("moe_dropless", "blocks", "every")}


def ab_compare(w: dict, switch: str, rounds: int, steps_per_round: int, threads: int = 2, family: str = "llama") -> dict:
    """Median step time of msllm GRAPH with `switch` on and off, both built in one process and alternated."""
    keyword, on, off = AB_SWITCHES[switch]
    sides = [(value, msllm_train_step(w, threads=threads, family=family, **{keyword: value})) for value in (on, off)]
    times = {on: [], off: []}
    for _, (step, batch) in sides:  # compile and warm up both
        for _ in range(3):
            step(batch)[0].asnumpy()
    for r in range(rounds):
        for value, (step, batch) in sides if r % 2 == 0 else sides[::-1]:
            for _ in range(steps_per_round):
                t0 = time.perf_counter()
                step(batch)[0].asnumpy()
                times[value].append(time.perf_counter() - t0)
    on_s, off_s = statistics.median(times[on]), statistics.median(times[off])
    return {"switch": switch, "on_step_s": on_s, "off_step_s": off_s, "speedup": off_s / on_s, "steps_each": len(times[on])}


def worker_msllm(w: dict, args) -> dict:
    step, batch = msllm_train_step(w, mode=args.mode, threads=args.threads, jit_level=args.jit_level,
                                   recompute=args.recompute, fused_kernels=args.fused_kernels,
                                   block_graph=args.block_graph, family=args.family, attention=args.attention,
                                   moe_capacity=float(args.moe_capacity))
    t0 = time.perf_counter()
    if args.mode == "graph":
        step.compile(batch)  # graph compile alone; the first step then adds first-touch memory faults
    compile_s = time.perf_counter() - t0
    result = time_steps(lambda: step(batch)[0].asnumpy(), args.steps, args.warmup)
    result["compile_s"] = compile_s
    result["first_step_s"] += compile_s
    return result


def sdpa_padded_v(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention with V zero-padded to q/k's head size and the output sliced back, as HF's
    flash-attention-2 path does for MLA: torch's CPU flash kernel takes one head size for q, k and v, so
    plain SDPA falls back to its math kernel ([s, t] scores) when MLA's value heads are smaller."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    d = value.shape[-1]
    out, weights = sdpa_attention_forward(module, query, key, F.pad(value, (0, query.shape[-1] - d)), attention_mask,
                                          **kwargs)
    return out[..., :d], weights


def hf_model(w: dict, family: str = "llama", attention: str = "sdpa"):
    """The transformers model of workload w; attention: its attention implementation (sdpa, or
    sdpa_padded_v: sdpa_padded_v above)."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = hf_config(w, family)
    if attention == "sdpa_padded_v":
        transformers.AttentionInterface.register(attention, sdpa_padded_v)
        AttentionMaskInterface.register(attention, sdpa_mask)
        config._attn_implementation = attention
    return getattr(transformers, FAMILIES[family][1])(config)


def torch_train_step(w: dict, family: str = "llama", attention: str = "sdpa", compile_: bool = False,
                     threads: int = 0):
    """The benchmarked torch step on workload w (HF model, AdamW, clip 1.0), eager or torch.compile'd."""
    import torch
    torch.set_num_threads(threads or os.cpu_count())
    torch.manual_seed(0)
    model = hf_model(w, family, attention)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.from_numpy(tokens(w)).long()
    forward = torch.compile(model) if compile_ else model

    def step():
        logits = forward(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    return step


def worker_torch(w: dict, args) -> dict:
    step = torch_train_step(w, args.family, args.torch_attention, args.compile, args.threads)
    return time_steps(step, args.steps, args.warmup)


def workload(args) -> dict:
    """The --workload's shape with --layers and --seq applied."""
    w = dict(WORKLOADS[args.workload])
    w.update({key: value for key, value in (("layers", args.layers), ("seq", args.seq)) if value})
    return w


def run_worker(args) -> None:
    w = workload(args)
    result = worker_msllm(w, args) if args.worker == "msllm" else worker_torch(w, args)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def spawn(variant: str, workload: str, args, recompute: str = "none", layers: int = 0, capacity: float = 0.0) -> dict:
    if variant == "mindformers":
        return spawn_mindformers(workload, args)
    if variant == BEFORE and not args.before:
        return {"error": f"{BEFORE} needs --before CHECKOUT"}
    side = Path(args.before).resolve() if variant == BEFORE else REPO
    env = dict(kv.split("=", 1) for kv in args.env.split()) if variant == ENV else {}
    variant = "msllm-graph" if variant in (BEFORE, ENV) else variant
    common = ["--workload", workload, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--threads", str(args.threads), "--layers", str(layers), "--family", args.family, "--seq", str(args.seq)]
    if variant.startswith("msllm"):
        extra = ["--worker", "msllm", "--mode", variant.split("-")[1], "--recompute", recompute,
                 "--jit-level", args.jit_level, "--fused-kernels", args.fused_kernels,
                 "--block-graph", args.block_graph, "--attention", args.attention, "--moe-capacity", str(capacity)]
    else:
        extra = ["--worker", "torch", "--torch-attention", getattr(args, "torch_attention", "sdpa")] + (
            ["--compile"] if variant == "torch-compile" else [])
    return bench_big_vocab.run_worker([sys.executable, str(side / "tools" / "bench_train.py"), *common, *extra],
                                      str(side), env)


def spawn_mindformers(workload: str, args) -> dict:
    venv_python = Path(os.environ.get("MSLLM_MF_VENV", Path.home() / ".cache/msllm/mf-venv")) / "bin" / "python"
    if not venv_python.exists():
        return {"error": "MindFormers venv absent; create it with bash tools/mindformers_env.sh"}
    w = WORKLOADS[workload]
    cmd = [str(venv_python), str(REPO / "tools" / "mindformers_peer.py"), "bench", "--vocab", str(w["vocab"]),
           "--hidden", str(w["hidden"]), "--layers", str(w["layers"]), "--heads", str(w["heads"]),
           "--kv-heads", str(w["kv_heads"]), "--ffn", str(w["ffn"]), "--seq", str(w["seq"]),
           "--batch", str(w["batch"]), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            return {"first_step_s": r.get("compile_s"), "step_s": w["batch"] * w["seq"] / r["tokens_per_s"],
                    "peak_rss_mb": r.get("peak_rss_mb")}
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def save(args, stem: str, result: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W1", choices=list(WORKLOADS))
    p.add_argument("--family", default="llama", choices=list(FAMILIES), help="the workload's shape as this family")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--recompute", default="none", help="comma list for msllm variants: none,full,selective")
    p.add_argument("--compile-layers", default="", help="comma list of depths: report first-step compile time")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)  # MindFormers needs ~5 to reach steady state
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jit-level", default="O0")
    p.add_argument("--fused-kernels", default="auto", choices=["auto", "off"])
    p.add_argument("--block-graph", default="auto", choices=["auto", "shared", "inlined"],
                   help="train.block_graph: shared = one block graph called by every layer")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "softmax"], help="train.attention")
    p.add_argument("--seq", type=int, default=0, help="sequence length instead of the workload's")
    p.add_argument("--moe-capacity", default="0", help="comma list for msllm variants of a MoE family: "
                   "train.moe_capacity_factor (0: dropless)")
    p.add_argument("--ab", choices=list(AB_SWITCHES), help="in-process A/B of one switch, on vs off")
    p.add_argument("--rounds", type=int, help="--ab: alternations (default 12); otherwise rounds of every "
                   "variant, the order flipped each round (default 1)")
    p.add_argument("--before", help=f"checkout of msllm whose msllm-graph runs as variant {BEFORE}")
    p.add_argument("--env", default="", help=f"space-separated NAME=VALUE added to the environment of variant {ENV}")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--peak-flops", type=float, default=3.8e11)  # measured 2-thread fp32 GEMM here
    p.add_argument("--out", default="runs/bench")
    # worker-only flags
    p.add_argument("--worker", choices=["msllm", "torch"])
    p.add_argument("--mode", default="graph")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--torch-attention", default="sdpa", choices=["sdpa", "sdpa_padded_v"],
                   help="the torch side's attention (sdpa_padded_v: MLA's V padded for torch's flash kernel)")
    p.add_argument("--layers", type=int, default=0, help="--ab: depth instead of the workload's")
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0

    w = workload(args)
    tokens_per_step = w["batch"] * w["seq"]
    if args.ab:
        r = ab_compare(w, args.ab, args.rounds or 12, args.steps_per_round, args.threads, args.family)
        print(f"{args.workload}: {args.ab} on {r['on_step_s'] * 1e3:.1f} ms/step "
              f"({tokens_per_step / r['on_step_s']:,.0f} tok/s), off {r['off_step_s'] * 1e3:.1f} ms/step "
              f"({tokens_per_step / r['off_step_s']:,.0f} tok/s): on is {r['speedup']:.3f}x, "
              f"median of {r['steps_each']} alternated steps each")
        save(args, f"ab_{args.ab}_{args.workload}", {"workload": w, **r})
        return 0
    rows = []
    if args.compile_layers:
        for layers in [int(x) for x in args.compile_layers.split(",")]:
            r = spawn("msllm-graph", args.workload, args, layers=layers)
            rows.append({"variant": "msllm-graph", "layers": layers, **r})
            print(f"compile  layers {layers:>3}: graph compile {r.get('compile_s', float('nan')):.1f}s, "
                  f"first step incl. compile {r.get('first_step_s', float('nan')):.1f}s; "
                  f"later steps {r.get('step_s', float('nan')):.2f}s "
                  f"{r.get('error', '')}", flush=True)
    else:
        jobs = [(variant, recompute, float(capacity)) for variant in args.variants.split(",")
                for recompute in (args.recompute.split(",") if variant.startswith("msllm") else ["none"])
                for capacity in (args.moe_capacity.split(",") if variant.startswith("msllm") else ["0"])]
        runs = bench_big_vocab.alternate(jobs, args.rounds or 1,
                                         lambda job: spawn(job[0], args.workload, args, job[1], capacity=job[2]))
        for (variant, recompute, capacity), results in runs.items():
            ok = [r for r in results if "error" not in r]
            row = {"variant": variant, "recompute": recompute, "moe_capacity": capacity}
            if not ok:
                rows.append({**row, "error": results[-1]["error"]})
                continue
            rows.append({**row, "step_s": statistics.median(r["step_s"] for r in ok),
                         "first_step_s": statistics.median(r["first_step_s"] for r in ok),
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in ok), "round_step_s": [r["step_s"] for r in ok]})
        flops = model_config(w, args.family).flops_per_token(w["seq"])
        base = next((r for r in rows if r["variant"] == "torch-eager" and "error" not in r), None)
        print(f"\n{args.workload} {args.family} {w}, {args.threads} threads, median of {args.steps} steps after "
              f"{args.warmup} warm-up" + (f"; {args.rounds} alternated rounds, median of their medians"
                                          if (args.rounds or 1) > 1 else ""))
        print("| variant | recompute | MoE capacity | tokens/s | vs torch eager | MFU | first step s | peak RSS MB "
              "| tokens/s per round |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['variant']} | {r['recompute']} | {r['moe_capacity']} | skipped: {r['error']} | | | | | |")
                continue
            tps = tokens_per_step / r["step_s"]
            r.update(tokens_per_s=tps, mfu=tps * flops / args.peak_flops,
                     vs_torch_eager=tps * base["step_s"] / tokens_per_step if base else None)
            ratio = f"{r['vs_torch_eager']:.2f}x" if base else "n/a"
            per_round = ", ".join(f"{tokens_per_step / x:,.0f}" for x in r["round_step_s"])
            print(f"| {r['variant']} | {r['recompute']} | {r['moe_capacity'] or 'dropless'} | {tps:,.0f} | {ratio} | {r['mfu']:.1%} | "
                  f"{r['first_step_s']:.1f} | {r['peak_rss_mb']:.0f} | {per_round} |")
    save(args, f"bench_{args.workload}_{args.family}", {"workload": args.workload, "family": args.family, "shape": w,
                                                        "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
