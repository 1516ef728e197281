#!/usr/bin/env python
"""Cross-check the MindFormers layout for real: MindFormers' own model runs our checkpoint (its
LlamaForCausalLM for Llama / Qwen2, its mcore TrainingQwen3ForCausalLM for Qwen3 and
TrainingQwen3MoeForCausalLM for Qwen3-MoE, TrainingDeepseekV3ForCausalLM for DeepSeek-V3).

For each case, a tiny random Hugging Face model is converted by `msllm convert --to mindformers`
(.ckpt, and safetensors), then tools/mindformers_peer.py runs that MindFormers model on it in
the separate MindFormers venv (mindformers 1.9 + mindspore 2.9, tools/mindformers_env.sh) and the
logits are compared with the HF model's and with msllm's on the same tokens.

    python tools/mindformers_check.py              # creates the MindFormers venv on first use
    python tools/mindformers_check.py --mf-python ~/.cache/msllm/mf-venv/bin/python

Exit 0 when every max-abs logits diff is <= --tol. Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# MindFormers' Llama runs plain RoPE here (its llama3 scaling is another code path), so the Llama 3
# case keeps GQA 8/2 and theta 5e5 but not the scaling. Values: tests/hf_models.py case, config changes.
CASES = {
    "llama2_mha": ("llama2_mha", {}),
    "llama3_gqa": ("llama3_gqa_rope_scaling", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "qwen2_bias_tied": ("qwen2_bias_tied", {}),
    "qwen3": ("qwen3", {}),                                # tied, head_dim 32 != 64 / 4: MindFormers' mcore Qwen3
    "qwen3_untied": ("qwen3", {"tie_word_embeddings": False}),
    # MindFormers' Qwen3-MoE builds every layer MoE; expert ffn 24 keeps weight1 [4 * 64, 48] apart from
    # its transpose's shape. Untied without renormalising the top 2, then tied with it.
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 24}),
    "qwen3_moe_norm_tied": ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 24,
                                          "norm_topk_prob": True, "tie_word_embeddings": True}),
    # MindFormers' DeepSeek-V3: MLA with q_lora_rank, one dense layer, grouped sigmoid router with its expert
    # bias, a shared expert; then without q_lora_rank (linear_qkv holds q_proj), not renormalised, 4 groups
    # of 2 choosing 2 for top-4. (Its output layer is never tied: tied models are refused.)
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None, "norm_topk_prob": False, "n_group": 4,
                                              "topk_group": 2, "num_experts_per_tok": 4}),
}


def mf_python(given: str | None) -> str:
    if given:
        return given
    proc = subprocess.run(["bash", str(REPO / "tools" / "mindformers_env.sh")], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"mindformers_check: tools/mindformers_env.sh failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mf-python", default=None, help="python of the MindFormers venv")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args()
    import torch

    from interop.convert import convert
    from interop.layouts import open_source
    from interop.verify import run_msllm
    from tests.hf_models import build

    python, rows = mf_python(a.mf_python), []
    with tempfile.TemporaryDirectory(prefix="mf_check_") as tmp:
        tmp = Path(tmp)
        for case in a.cases.split(","):
            name, changes = CASES[case]
            model = build(name, **changes)
            model.save_pretrained(tmp / case / "hf")
            ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 16))
            np.save(tmp / case / "tokens.npy", ids)
            with torch.no_grad():
                ref = model(torch.from_numpy(ids)).logits.numpy()
            ours = run_msllm(open_source(tmp / case / "hf"), ids)[-1]
            for fmt in ("ckpt", "safetensors"):
                out = tmp / case / f"mf_{fmt}"
                convert(tmp / case / "hf", out, to="mindformers", mf_format=fmt, progress=False)
                proc = subprocess.run([python, str(REPO / "tools" / "mindformers_peer.py"), "logits",
                                       "--config", str(out / "model_config.json"), "--ckpt", str(out / f"model.{fmt}"),
                                       "--tokens", str(tmp / case / "tokens.npy"), "--out", str(out / "logits.npy")],
                                      capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"mindformers_check: {case} {fmt}: peer failed:\n{proc.stderr[-3000:]}")
                mf = np.load(out / "logits.npy")
                rows.append({"case": case, "format": fmt, "mf_vs_hf": float(np.abs(mf - ref).max()),
                             "mf_vs_msllm": float(np.abs(mf - ours).max()),
                             "msllm_vs_hf": float(np.abs(ours - ref).max()), "logit_scale": float(np.abs(ref).max())})
    print(f"{'case':22} {'format':12} {'MF vs HF':>10} {'MF vs msllm':>12} {'msllm vs HF':>12}  (max-abs logits)")
    for r in rows:
        print(f"{r['case']:22} {r['format']:12} {r['mf_vs_hf']:10.2e} {r['mf_vs_msllm']:12.2e} "
              f"{r['msllm_vs_hf']:12.2e}")
    ok = all(r["mf_vs_hf"] <= a.tol for r in rows)
    print(json.dumps({"ok": ok, "tol": a.tol, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
