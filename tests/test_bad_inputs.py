"""Keep it closed: a table of malformed inputs, each run through the CLI's main() as
`python -m msllm.cli` runs it: most rows one after another in one interpreter, those whose point is
a fresh process (FRESH) each in its own.

Every row must answer with exit code 2, exactly one stderr line (`msllm <cmd>: error: ...`) naming
the offending key or path, no traceback, nothing on stdout, and leave every file and directory
under the workspace as it was (nothing half-written, no run dir, no temp dir). The process runs
without GLOG_v, so MindSpore's own log lines count against the one line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import REPO

# The model every train row starts from: small enough that nothing below is slow to build.
TINY = {"model.vocab_size": 384, "model.hidden_size": 64, "model.num_layers": 2, "model.num_heads": 4,
        "model.num_kv_heads": 2, "model.ffn_size": 128, "model.max_seq_len": 64, "data.path": "{corpus}",
        "data.seq_len": 32, "train.run_dir": "{work}/run", "train.steps": 2, "train.batch_size": 2,
        "train.eval_every": 2, "train.ckpt_every": 2, "train.sample_tokens": 0}
# TINY's layers as a hybrid: a Gated DeltaNet ("linear") layer, then attention
HYBRID_SETS = ("model.layer_types=[linear, full]", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
               "model.linear_key_head_dim=16", "model.linear_value_head_dim=8")


@dataclass
class Row:
    id: str
    args: tuple          # CLI arguments; "{name}" is a fixture path, "{work}" this row's own dir
    names: tuple         # what the error line must name
    config: object = None  # dict merged into TINY, or raw text / bytes: written to {work}/c.yaml
    env: dict | None = None


def T(id, *items, names=(), env=None):
    """train with TINY; "KEY=VALUE" items become --set overrides, anything else is passed as is."""
    args = ["train"] + [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
    for item in items:
        args += ["--set", item] if "=" in item and not item.startswith("-") else [item]
    return Row(id, tuple(args), names, env=env)


FT_BASE = {"data.path": "{sftgood}", "data.seq_len": 32, "train.run_dir": "{work}/run", "train.steps": 2,
           "train.batch_size": 2, "train.sample_tokens": 0}


def FT(id, *items, names=(), init="{hftok}"):
    """train --init-from `init` on SFT rows; "KEY=VALUE" items become --set overrides."""
    args = ["train", "--init-from", init] + [a for k, v in FT_BASE.items() for a in ("--set", f"{k}={v}")]
    for item in items:
        args += ["--set", item] if "=" in item and not item.startswith("-") else [item]
    return Row(id, tuple(args), names)


def Y(id, config, *extra, names=()):
    """train --config {work}/c.yaml (TINY plus `config`, or raw text)."""
    return Row(id, ("train", "--config", "{work}/c.yaml", *extra), names, config=config)


def R(id, *args, names=()):
    return Row(id, args, names)


HF = ("convert", "{hf}", "{work}/out")


def hf_row(id, variant, *names):
    return R(id, "convert", "{hf_" + variant + "}", "{work}/out", names=("config.json",) + names)


ROWS = [
    # --- argparse: one line too, naming the option
    R("no-command", names=("command",)),
    R("unknown-command", "fly", names=("fly",)),
    R("train-unknown-flag", "train", "--bogus", names=("--bogus",)),
    R("train-mode-choice", "train", "--mode", "eager", names=("--mode",)),
    R("train-device-choice", "train", "--device", "tpu", names=("--device",)),
    R("train-set-no-value", "train", "--set", names=("--set",)),
    R("generate-no-ckpt", "generate", names=("--ckpt",)),
    R("generate-engine-choice", "generate", "--ckpt", "{run}", "--engine", "tensorrt", names=("--engine",)),
    R("generate-top-k-word", "generate", "--ckpt", "{run}", "--top-k", "many", names=("--top-k",)),
    R("generate-top-k-negative", "generate", "--ckpt", "{run}", "--top-k", "-1", names=("--top-k",)),
    R("generate-temperature-negative", "generate", "--ckpt", "{run}", "--temperature", "-1",
      names=("--temperature",)),
    R("generate-temperature-nan", "generate", "--ckpt", "{run}", "--temperature", "nan", names=("--temperature",)),
    R("generate-max-new-negative", "generate", "--ckpt", "{run}", "--max-new-tokens", "-1",
      names=("--max-new-tokens",)),
    R("generate-seed-negative", "generate", "--ckpt", "{run}", "--seed", "-1", names=("--seed",)),
    R("export-format-choice", "export", "--ckpt", "{run}", "--format", "tflite", "--out", "{work}/out",
      names=("--format",)),
    R("export-dtype-choice", "export", "--ckpt", "{run}", "--format", "onnx", "--dtype", "int8", "--out",
      "{work}/out", names=("--dtype",)),
    R("export-no-out", "export", "--ckpt", "{run}", "--format", "onnx", names=("--out",)),
    R("convert-no-dst", "convert", "{hf}", names=("dst",)),
    R("convert-to-choice", *HF, "--to", "onnx", names=("--to",)),
    R("convert-dtype-choice", *HF, "--dtype", "fp8", names=("--dtype",)),
    R("convert-mf-format-choice", *HF, "--to", "mindformers", "--mf-format", "h5", names=("--mf-format",)),
    R("convert-shard-negative", *HF, "--to", "msllm", "--max-shard-mb", "-1", names=("--max-shard-mb",)),
    R("convert-shard-zero", *HF, "--max-shard-mb", "0", names=("--max-shard-mb",)),
    R("convert-max-seq-zero", *HF, "--max-seq-len", "0", names=("--max-seq-len",)),
    R("convert-max-seq-negative", *HF, "--max-seq-len", "-5", names=("--max-seq-len",)),
    R("convert-verify-seq-zero", *HF, "--verify", "--seq-len", "0", names=("--seq-len",)),
    R("verify-no-hf", "verify", "--ckpt", "{run}", names=("--hf",)),
    R("verify-seq-zero", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--seq-len", "0", names=("--seq-len",)),
    R("verify-batch-negative", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--batch", "-1", names=("--batch",)),
    R("verify-batch-zero", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--batch", "0", names=("--batch",)),
    R("verify-tolerance-negative", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--tolerance", "-1",
      names=("--tolerance",)),
    R("verify-tolerance-nan", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--tolerance", "nan",
      names=("--tolerance",)),
    R("verify-seed-negative", "verify", "--hf", "{hf}", "--ckpt", "{run}", "--seed", "-1", names=("--seed",)),

    # --- train: --set overrides, blamed on --set, one per config section and check
    T("set-no-equals", "--set", "optim.lr", names=("--set", "optim.lr")),
    T("set-no-section", "lr=3", names=("--set", "lr")),
    T("set-three-parts", "optim.lr.x=3", names=("--set", "optim.lr.x")),
    T("set-unknown-section", "trainer.steps=3", names=("--set", "trainer")),
    T("set-bad-yaml", "optim.lr=[1", names=("--set", "optim.lr")),
    T("set-null", "model.hidden_size=", names=("--set", "model.hidden_size")),
    T("model-unknown-key", "model.hiden_size=64", names=("--set", "model.hiden_size")),
    T("model-hidden-word", "model.hidden_size=big", names=("--set", "model.hidden_size")),
    T("model-layers-zero", "model.num_layers=0", names=("--set", "model.num_layers")),
    T("model-heads-not-dividing", "model.num_heads=3", names=("--set", "model.num_heads")),
    T("model-kv-heads-not-dividing", "model.num_kv_heads=3", names=("--set", "model.num_kv_heads")),
    # a hybrid (Gated DeltaNet "linear" layers beside attention) whose linear layers cannot be built
    T("model-linear-conv-kernel-zero", *HYBRID_SETS, "model.linear_conv_kernel=0",
      names=("--set", "model.linear_conv_kernel")),
    T("model-linear-heads-not-dividing", *HYBRID_SETS, "model.linear_num_value_heads=3",
      names=("--set", "model.linear_num_value_heads", "model.linear_num_key_heads (2)")),
    T("model-linear-head-dim-missing", *[s for s in HYBRID_SETS if "key_head_dim" not in s],
      names=("model.linear_key_head_dim", "model.layer_types")),
    T("model-head-dim-odd", "model.hidden_size=20", names=("--set", "model.num_heads")),
    T("model-rope-theta-inf", "model.rope_theta=.inf", names=("--set", "model.rope_theta")),
    T("model-rope-theta-zero", "model.rope_theta=0", names=("--set", "model.rope_theta")),
    T("model-norm-eps-nan", "model.norm_eps=.nan", names=("--set", "model.norm_eps")),
    T("model-rope-scaling-dynamic", "model.rope_scaling={type: dynamic, factor: 4.0}",
      names=("--set", "model.rope_scaling")),
    T("model-rope-scaling-word", "model.rope_scaling=llama3", names=("--set", "model.rope_scaling")),
    T("model-rope-scaling-factor-inf", "model.rope_scaling={type: linear, factor: .inf}",
      names=("--set", "model.rope_scaling")),
    T("model-rope-llama3-missing-keys", "model.rope_scaling={type: llama3, factor: 8.0}",
      names=("--set", "model.rope_scaling", "low_freq_factor")),
    T("model-rope-llama3-same-band", "model.rope_scaling={type: llama3, factor: 8.0, low_freq_factor: 4.0, "
      "high_freq_factor: 4.0, original_max_position_embeddings: 64}", names=("--set", "high_freq_factor")),
    T("model-vocab-absurd", "model.vocab_size=100000000000", names=("--set", "model.vocab_size")),
    T("model-max-seq-absurd", "model.max_seq_len=10000000", names=("model.max_seq_len",)),
    T("model-too-big-for-memory", "model.hidden_size=65536", "model.ffn_size=262144", "model.num_heads=512",
      "model.num_kv_heads=512", names=("model.hidden_size",)),
    T("model-qkv-bias-word", "model.qkv_bias=maybe", names=("--set", "model.qkv_bias")),
    T("model-max-seq-below-seq-len", "model.max_seq_len=16", names=("--set", "data.seq_len")),
    T("data-path-missing", "data.path={work}/nope", names=("{work}/nope",)),
    T("data-path-empty-string", "data.path=''", names=("data.path",)),
    T("data-path-empty-dir", "data.path={empty}", names=("{empty}",)),
    T("data-glob-no-match", "data.glob='*.rs'", names=("data.glob",)),
    T("data-glob-empty", "data.glob=''", names=("data.glob",)),
    T("data-path-binary-files", "data.path={bincorpus}", names=("{bincorpus}", "UTF-8")),
    T("data-path-binary-file", "data.path={bincorpus}/blob.py", names=("{bincorpus}/blob.py", "UTF-8")),
    T("data-corpus-too-small", "data.path={tinycorpus}", names=("{tinycorpus}",)),
    T("data-tokenizer-missing", "data.tokenizer={work}/tok.json", names=("data.tokenizer", "{work}/tok.json")),
    T("data-tokenizer-garbage", "data.tokenizer={tokgarbage}", names=("data.tokenizer", "{tokgarbage}")),
    T("data-tokenizer-is-dir", "data.tokenizer={empty}", names=("data.tokenizer", "{empty}")),
    T("data-tokenizer-vocab-too-big", "data.tokenizer={tok512}", names=("{tok512}", "model.vocab_size")),
    T("data-shard-vocab-too-big", "data.path={shard512}", names=("{shard512}", "model.vocab_size")),
    T("data-shard-without-tokenizer", "data.path={shardnotok}", names=("{shardnotok}", "tokenizer.json")),
    T("data-seq-len-one", "data.seq_len=1", names=("--set", "data.seq_len")),
    T("data-val-fraction-zero", "data.val_fraction=0", names=("--set", "data.val_fraction")),
    T("data-val-fraction-nan", "data.val_fraction=.nan", names=("--set", "data.val_fraction")),
    T("data-max-bytes-negative", "data.max_bytes=-1", names=("--set", "data.max_bytes")),
    T("data-seed-word", "data.seed=abc", names=("--set", "data.seed")),
    T("data-shuffle-word", "data.shuffle=sometimes", names=("--set", "data.shuffle")),
    T("optim-lr-inf", "optim.lr=.inf", names=("--set", "optim.lr")),
    T("optim-lr-nan", "optim.lr=.nan", names=("--set", "optim.lr")),
    T("optim-lr-inf-word", "optim.lr=inf", names=("--set", "optim.lr")),
    T("optim-lr-negative", "optim.lr=-0.1", names=("--set", "optim.lr")),
    T("optim-lr-word", "optim.lr=fast", names=("--set", "optim.lr")),
    T("optim-min-lr-above-lr", "optim.min_lr=1.0", names=("--set", "optim.min_lr")),
    T("optim-warmup-negative", "optim.warmup_steps=-5", names=("--set", "optim.warmup_steps")),
    T("optim-decay-choice", "optim.decay=exp", names=("--set", "optim.decay")),
    T("optim-weight-decay-inf", "optim.weight_decay=.inf", names=("--set", "optim.weight_decay")),
    T("optim-beta1-one", "optim.beta1=1.0", names=("--set", "optim.beta1")),
    T("optim-beta2-nan", "optim.beta2=.nan", names=("--set", "optim.beta2")),
    T("optim-eps-zero", "optim.eps=0", names=("--set", "optim.eps")),
    T("optim-grad-clip-negative", "optim.grad_clip=-1", names=("--set", "optim.grad_clip")),
    T("optim-grad-clip-inf", "optim.grad_clip=.inf", names=("--set", "optim.grad_clip")),
    T("train-steps-zero", "train.steps=0", names=("--set", "train.steps")),
    T("train-batch-zero", "train.batch_size=0", names=("--set", "train.batch_size")),
    T("train-threads-negative", "train.threads=-1", names=("--set", "train.threads")),
    T("train-mode-choice-set", "train.mode=eager", names=("--set", "train.mode")),
    T("train-device-choice-set", "train.device=tpu", names=("--set", "train.device")),
    T("train-jit-level-choice", "train.jit_level=O9", names=("--set", "train.jit_level")),
    T("train-fused-kernels-choice", "train.fused_kernels=maybe", names=("--set", "train.fused_kernels")),
    T("train-shared-with-recompute", "train.block_graph=shared", "train.recompute=full",
      names=("--set", "train.block_graph")),
    T("train-precision-choice", "train.precision=fp8", names=("--set", "train.precision")),
    T("train-recompute-choice", "train.recompute=partial", names=("--set", "train.recompute")),
    T("train-loss-scale-below-one", "train.loss_scale=0.5", names=("--set", "train.loss_scale")),
    T("train-loss-scale-inf", "train.loss_scale=.inf", names=("--set", "train.loss_scale")),
    T("train-loss-scale-window-zero", "train.loss_scale_window=0", names=("--set", "train.loss_scale_window")),
    T("train-max-bad-steps-zero", "train.max_bad_steps=0", names=("--set", "train.max_bad_steps")),
    T("train-debug-nonfinite-word", "train.debug_nonfinite=maybe", names=("--set", "train.debug_nonfinite")),
    T("train-keep-zero", "train.keep_checkpoints=0", names=("--set", "train.keep_checkpoints")),
    T("train-log-every-zero", "train.log_every=0", names=("--set", "train.log_every")),
    T("train-peak-flops-nan", "train.peak_flops=.nan", names=("--set", "train.peak_flops")),
    T("train-sample-tokens-negative", "train.sample_tokens=-1", names=("--set", "train.sample_tokens")),
    T("train-run-dir-is-file", "train.run_dir={afile}", names=("train.run_dir", "{afile}")),
    T("train-run-dir-under-file", "train.run_dir={afile}/run", names=("train.run_dir", "{afile}")),
    T("train-run-dir-unwritable", "train.run_dir=/sys/msllm-bad-input-run",
      names=("train.run_dir", "/sys/msllm-bad-input-run")),
    T("train-run-dir-read-only-fs", "train.run_dir={readonly}/run", names=("train.run_dir", "{readonly}", "read-only")),
    T("train-compile-cache-uncreatable", "train.compile_cache=/sys/kernel/msllm-bad-input-cache",
      names=("train.compile_cache", "/sys/kernel/msllm-bad-input-cache")),
    T("model-vocab-below-bytes", "model.vocab_size=100", names=("model.vocab_size", "257")),
    T("data-shard-train-truncated", "data.path={shardtrunc}", names=("{shardtrunc}/train.bin",)),
    T("train-run-dir-empty", "train.run_dir=''", names=("train.run_dir",)),
    T("train-compile-cache-is-file", "train.compile_cache={afile}", names=("train.compile_cache", "{afile}")),
    T("train-bf16-on-cpu", "train.precision=bf16", names=("train.precision",)),
    T("train-rank-size", names=("RANK_SIZE",), env={"RANK_SIZE": "2"}),
    T("train-threads-absurd", "train.threads=100000", names=("train.threads",)),
    T("train-tp-on-cpu", "parallel.tp=2", names=("parallel.tp", "msllm launch")),
    T("train-pp-on-cpu", "parallel.pp=2", "parallel.micro_batches=2", names=("parallel.pp",)),
    T("train-cp-not-dividing-seq", "parallel.cp=3", names=("parallel.cp", "data.seq_len", "32 % 6")),
    T("train-cp-with-tp-on-cpu", "parallel.cp=2", "parallel.tp=2", names=("parallel.cp", "parallel.tp")),
    T("train-cp-with-pp", "parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2", names=("parallel.cp", "parallel.pp")),
    T("train-cp-debug-nonfinite", "parallel.cp=2", "train.debug_nonfinite=true",
      names=("train.debug_nonfinite", "parallel.cp")),
    T("train-cp-one-worker", "parallel.cp=2", names=("parallel.cp", "1 worker", "msllm launch")),

    # --- train: a YAML file, blamed on the file
    Y("yaml-syntax", "model: [\n", names=("{work}/c.yaml",)),
    Y("yaml-top-level-list", "- 1\n- 2\n", names=("{work}/c.yaml",)),
    Y("yaml-not-utf8", b"model:\n  hidden_size: \xff\xfe\n", names=("{work}/c.yaml",)),
    Y("yaml-duplicate-key", "optim:\n  lr: 0.1\n  lr: 0.2\n", names=("{work}/c.yaml", "lr")),
    Y("yaml-unknown-section", {"trainer": {"steps": 3}}, names=("{work}/c.yaml", "trainer")),
    Y("yaml-section-not-mapping", {"model": 5}, names=("{work}/c.yaml", "model")),
    Y("yaml-unknown-key", {"optim": {"learning_rate": 1e-3}}, names=("{work}/c.yaml", "optim.learning_rate")),
    Y("yaml-lr-inf", {"optim": {"lr": float("inf")}}, names=("{work}/c.yaml", "optim.lr")),
    Y("yaml-lr-nan", {"optim": {"lr": float("nan")}}, names=("{work}/c.yaml", "optim.lr")),
    Y("yaml-lr-null", {"optim": {"lr": None}}, names=("{work}/c.yaml", "optim.lr")),
    Y("yaml-heads-not-dividing", {"model": {"num_heads": 3}}, names=("{work}/c.yaml", "model.num_heads")),
    Y("yaml-unquoted-off", {"train": {"fused_kernels": False}}, names=("{work}/c.yaml", "train.fused_kernels")),
    Y("yaml-rope-dynamic", {"model": {"rope_scaling": {"type": "dynamic", "factor": 2.0}}},
      names=("{work}/c.yaml", "model.rope_scaling")),
    Y("yaml-ok-set-breaks-it", {}, "--set", "model.num_heads=3", names=("--set: model.num_heads",)),
    R("yaml-missing-file", "train", "--config", "{work}/nope.yaml", names=("{work}/nope.yaml",)),
    R("yaml-is-dir", "train", "--config", "{empty}", names=("{empty}",)),

    # --- train --resume
    R("resume-missing", "train", "--resume", "{work}/nope", names=("{work}/nope",)),
    R("resume-not-a-run", "train", "--resume", "{empty}", names=("{empty}", "config.yaml")),
    R("resume-model-changed", "train", "--resume", "{run}", "--set", "model.hidden_size=32",
      names=("model.hidden_size",)),
    R("resume-batch-changed", "train", "--resume", "{run}", "--set", "train.batch_size=3",
      names=("train.batch_size",)),
    R("resume-set-nan", "train", "--resume", "{run}", "--set", "optim.lr=.nan", names=("--set", "optim.lr")),
    Row("resume-with-config", ("train", "--resume", "{run}", "--config", "{work}/c.yaml"), ("--config",),
        config={}),
    R("resume-weights-other-shape", "train", "--resume", "{runshapes}", names=("model.hidden_size",)),
    R("resume-config-yaml-garbage", "train", "--resume", "{runbadyaml}", names=("config.yaml",)),
    R("resume-no-checkpoint", "train", "--resume", "{runnockpt}", names=("{runnockpt}",)),
    R("resume-all-corrupt", "train", "--resume", "{runcorrupt}", names=("{runcorrupt}", "step_0000001")),

    # --- fine-tuning: --init-from, SFT rows, LoRA
    FT("init-from-unsupported-arch", init="{hf_gpt2}", names=("{hf_gpt2}/config.json", "GPT2LMHeadModel")),
    R("init-from-with-resume", "train", "--resume", "{run}", "--init-from", "{hftok}", names=("--init-from",)),
    FT("init-from-model-contradiction", "model.hidden_size=32", names=("--set", "model.hidden_size", "32", "64")),
    FT("sft-row-missing-fields", "data.path={sftmissing}", names=("{sftmissing}:2", "response")),
    FT("sft-sample-too-long", "data.path={sftlong}", names=("{sftlong}:1", "data.seq_len 32")),
    T("sft-without-tokenizer", "data.path={sftgood}", names=("data.path", "{sftgood}", "train.init_from")),
    FT("lora-unknown-target", "lora.rank=4", "lora.targets=[q, qkv]", names=("--set", "lora.targets", "'qkv'")),
    FT("lora-rank-negative", "lora.rank=-2", names=("--set", "lora.rank")),
    FT("lora-alpha-zero", "lora.rank=4", "lora.alpha=0", names=("--set", "lora.alpha")),
    FT("lora-linear-target-without-linear-layers", "lora.rank=4", "lora.targets=[q, linear_qkv]",
       names=("--set", "lora.targets", "linear_qkv")),
    T("lora-without-init-from", "lora.rank=4", names=("lora.rank", "train.init_from")),
    FT("lora-from-wrong-base", "train.lora_from={peft}", init="{hfother}", names=("{peft}", "another base")),
    R("lora-merge-wrong-base", "lora", "merge", "{lorarun}", "{work}/out", "--base", "{hfother}",
      names=("{hfother}", "sha256")),
    R("lora-merge-out-exists", "lora", "merge", "{lorarun}", "{empty}", names=("{empty}",)),
    R("lora-export-format", "lora", "export", "{lorarun}", "{work}/out", "--format", "gguf", names=("--format",)),

    # --- generate
    R("generate-ckpt-missing", "generate", "--ckpt", "{work}/nope", names=("{work}/nope",)),
    R("generate-ckpt-empty-dir", "generate", "--ckpt", "{empty}", names=("{empty}",)),
    R("generate-top-k-above-vocab", "generate", "--ckpt", "{run}", "--top-k", "1000", names=("--top-k", "384")),
    R("generate-no-tokenizer", "generate", "--ckpt", "{runnotok}", names=("tokenizer.json",)),
    R("generate-onnx-engine-on-run", "generate", "--engine", "onnxruntime", "--ckpt", "{run}",
      names=("export.json",)),
    R("generate-mindir-engine-on-onnx", "generate", "--engine", "mindir", "--ckpt", "{onnx}", names=("{onnx}",)),
    R("generate-truncated-cached-onnx", "generate", "--engine", "onnxruntime", "--ckpt", "{onnxtrunc}",
      names=("{onnxtrunc}/cached.onnx",)),
    R("generate-truncated-decode-mindir", "generate", "--engine", "mindir", "--ckpt", "{mindirtrunc}",
      names=("{mindirtrunc}/cached_graph.mindir",)),
    R("generate-truncated-weights-onnx", "generate", "--engine", "onnxruntime", "--ckpt", "{onnxtruncweights}",
      names=("{onnxtruncweights}/weights.onnx.data",)),
    R("generate-truncated-weights-mindir", "generate", "--engine", "mindir", "--ckpt", "{mindirtruncweights}",
      names=("{mindirtruncweights}/cached_variables/data_0",)),
    R("generate-missing-weights-mindir", "generate", "--engine", "mindir", "--ckpt", "{mindirnoweights}",
      names=("{mindirnoweights}/model_variables/data_0",)),
    R("generate-export-json-garbage", "generate", "--engine", "onnxruntime", "--ckpt", "{exportgarbage}",
      names=("export.json",)),
    R("generate-truncated-weights", "generate", "--ckpt", "{ckpttrunc}", names=("model.safetensors",)),
    R("generate-state-garbage", "generate", "--ckpt", "{ckptbadstate}", names=("state.json",)),
    R("generate-weights-other-shape", "generate", "--ckpt", "{runshapes}", names=("{runshapes}",)),
    R("generate-chat-without-template", "generate", "--ckpt", "{run}", "--chat", "hi", names=("{run}", "chat template")),
    R("generate-stop-empty", "generate", "--ckpt", "{run}", "--stop", "", names=("--stop", "empty")),
    R("generate-prompt-beyond-context", "generate", "--ckpt", "{run}", "--prompt", "x = 1\n" * 40,
      names=("--prompt", "context of 32 tokens")),
    R("generate-system-without-chat", "generate", "--ckpt", "{run}", "--system", "be brief", names=("--system",)),
    R("generate-chat-and-prompt", "generate", "--ckpt", "{run}", "--chat", "hi", "--prompt", "x",
      names=("--prompt", "--chat")),
    R("generate-top-p-zero", "generate", "--ckpt", "{run}", "--top-p", "0", names=("--top-p",)),

    # --- export
    R("export-ckpt-missing", "export", "--ckpt", "{work}/nope", "--format", "onnx", "--out", "{work}/out",
      names=("{work}/nope",)),
    R("export-out-exists", "export", "--ckpt", "{run}", "--format", "onnx", "--out", "{empty}", names=("{empty}",)),
    R("export-out-parent-missing", "export", "--ckpt", "{run}", "--format", "onnx", "--out", "{work}/a/b/out",
      names=("{work}/a/b",)),
    R("export-out-under-file", "export", "--ckpt", "{run}", "--format", "onnx", "--out", "{afile}/out",
      names=("{afile}",)),
    R("export-out-unwritable", "export", "--ckpt", "{run}", "--format", "onnx", "--out", "/sys/msllm-bad-export",
      names=("/sys",)),
    R("export-out-read-only-fs", "export", "--ckpt", "{run}", "--format", "onnx", "--out", "{readonly}/out",
      names=("{readonly}",)),
    R("export-out-is-the-run", "export", "--ckpt", "{runvictim}", "--format", "onnx", "--out", "{runvictim}", "--force",
      names=("{runvictim}", "input")),
    R("export-out-is-cwd", "export", "--ckpt", "{run}", "--format", "onnx", "--out", ".", "--force",
      names=("current directory",)),
    R("export-weights-other-shape", "export", "--ckpt", "{runshapes}", "--format", "onnx", "--out", "{work}/out",
      names=("{runshapes}",)),

    # --- convert
    R("convert-src-missing", "convert", "{work}/nope", "{work}/out", names=("{work}/nope",)),
    R("convert-src-empty-dir", "convert", "{empty}", "{work}/out", names=("{empty}",)),
    R("convert-dst-exists", "convert", "{hf}", "{empty}", names=("{empty}",)),
    R("convert-dst-parent-missing", "convert", "{hf}", "{work}/a/b/out", names=("{work}/a/b",)),
    R("convert-dst-under-file", "convert", "{hf}", "{afile}/out", names=("{afile}",)),
    R("convert-dst-unwritable", "convert", "{hf}", "/sys/msllm-bad-convert", names=("/sys",)),
    R("convert-dst-inside-src", "convert", "{hf}", "{hf}/sub", names=("{hf}/sub",)),
    R("convert-dst-holds-src", "convert", "{nested}/hf", "{nested}", "--force", names=("{nested}", "input")),
    R("convert-dst-root", "convert", "{hf}", "/", "--force", names=("/: holds", "would delete")),
    R("convert-src-symlink-loop", "convert", "{loop}", "{work}/out", names=("{loop}",)),
    R("convert-verify-without-hf", "convert", "{run}", "{work}/out", "--to", "mindformers", "--verify",
      names=("--verify",)),
    hf_row("hf-rope-parameters-dynamic", "dynamic_parameters", "dynamic"),
    hf_row("hf-rope-scaling-dynamic", "dynamic", "dynamic"),
    hf_row("hf-rope-scaling-longrope", "longrope", "longrope"),
    hf_row("hf-rope-scaling-dynamic-beside-default", "dynamic_beside_default", "dynamic"),
    hf_row("hf-rope-type-wins-over-type", "type_and_rope_type", "dynamic"),
    hf_row("hf-rope-llama3-missing-keys", "llama3_missing", "low_freq_factor"),
    hf_row("hf-partial-rotary", "partial_rotary", "partial_rotary_factor"),
    hf_row("hf-rope-theta-word", "theta_word", "rope_theta"),
    hf_row("hf-rope-scaling-list", "scaling_list", "rope_scaling"),
    hf_row("hf-activation", "gelu", "hidden_act"),
    hf_row("hf-attention-bias", "attention_bias", "attention_bias"),
    hf_row("hf-head-dim", "head_dim", "head_dim"),
    hf_row("hf-softcapping", "softcapping", "final_logit_softcapping"),
    hf_row("hf-layer-types", "layer_types", "layer_types"),
    hf_row("hf-sliding-window-word", "window_word", "sliding_window"),
    hf_row("hf-architecture", "gpt2", "GPT2LMHeadModel"),
    hf_row("hf-heads-zero", "heads_zero", "num_attention_heads"),
    hf_row("hf-hidden-word", "hidden_word", "hidden_size"),
    hf_row("hf-vocab-missing", "vocab_missing", "vocab_size"),
    hf_row("hf-layers-fraction", "layers_fraction", "num_hidden_layers"),
    hf_row("hf-eps-word", "eps_word", "rms_norm_eps"),
    hf_row("hf-config-garbage", "garbage"),
    hf_row("hf-config-list", "list"),
    R("hf-weights-truncated", "convert", "{hf_truncated}", "{work}/out", names=("{hf_truncated}/model.safetensors",)),
    R("hf-bin-garbage", "convert", "{hf_bin_garbage}", "{work}/out", names=("{hf_bin_garbage}/pytorch_model.bin",)),
    R("hf-no-weights", "convert", "{hf_no_weights}", "{work}/out", names=("{hf_no_weights}",)),
    hf_row("hf-hybrid-heads-not-dividing", "hybrid_value_heads", "linear_num_value_heads", "linear_num_key_heads"),
    hf_row("hf-hybrid-conv-kernel-zero", "hybrid_conv_zero", "linear_conv_kernel_dim"),
    hf_row("hf-hybrid-key-heads-missing", "hybrid_key_heads_missing", "linear_num_key_heads"),
    R("hf-hybrid-tensor-missing", "convert", "{hf_hybrid_missing}", "{work}/out",
      names=("{hf_hybrid_missing}/model.safetensors", "missing", "model.layers.1.linear_attn.in_proj_z.weight")),
    R("hf-hybrid-tensor-misshaped", "convert", "{hf_hybrid_misshaped}", "{work}/out",
      names=("{hf_hybrid_misshaped}/model.safetensors", "wrong shape", "model.layers.0.linear_attn.conv1d.weight")),

    # --- verify
    R("verify-hf-missing", "verify", "--hf", "{work}/nope", "--ckpt", "{run}", names=("{work}/nope",)),
    R("verify-hf-not-hf", "verify", "--hf", "{run}", "--ckpt", "{run}", names=("--hf",)),
    R("verify-other-model", "verify", "--hf", "{hf}", "--ckpt", "{run}", names=("{run}", "vocab_size")),
    R("verify-rope-dynamic", "verify", "--hf", "{hf_dynamic_parameters}", "--ckpt", "{run}",
      names=("config.json", "dynamic")),
    R("verify-no-ckpt", "verify", "--hf", "{hf}", names=("--ckpt",)),
    R("verify-train-family", "verify", "--train", "--hf", "{hf_gpt2}", names=("config.json", "GPT2LMHeadModel")),
    R("verify-train-steps-zero", "verify", "--train", "--hf", "{hf}", "--steps", "0", names=("--steps",)),
    R("verify-train-hf-missing", "verify", "--train", "--hf", "{work}/nope", names=("{work}/nope",)),
    R("verify-train-data-missing", "verify", "--train", "--hf", "{hf}", "--data", "{work}/nope",
      names=("{work}/nope",)),
    R("verify-train-data-vocab", "verify", "--train", "--hf", "{hf}", "--data", "{shard512}",
      names=("{shard512}/index.json", "vocab_size 512")),
    R("verify-train-other-model", "verify", "--train", "--hf", "{hf}", "--ckpt", "{run}",
      names=("{run}", "vocab_size")),
    # --- launch: refused before any worker starts
    R("launch-no-command", "launch", "--nproc", "2", names=("-- train",)),
    R("launch-not-train", "launch", "--nproc", "2", "--", "generate", "{run}", names=("-- train",)),
    R("launch-nproc-zero", "launch", "--nproc", "0", "--", "train", names=("--nproc",)),
    R("launch-timeout-small", "launch", "--nproc", "1", "--timeout", "1", "--", "train", names=("--timeout",)),
    R("launch-node-rank-out-of-range", "launch", "--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--master",
      "127.0.0.1:8118", "--", *T("x").args, names=("--node-rank",)),
    R("launch-nodes-without-master", "launch", "--nproc", "1", "--nnodes", "2", "--", *T("x").args,
      names=("--master",)),
    R("launch-master-without-port", "launch", "--nproc", "1", "--master", "10.0.0.1", "--", *T("x").args,
      names=("--master",)),
    R("launch-bad-config", "launch", "--nproc", "2", "--", *T("x", "optim.lr=.inf").args, names=("optim.lr",)),
    R("launch-dp-mismatch", "launch", "--nproc", "2", "--", *T("x", "parallel.dp=4").args, names=("parallel.dp",)),
    R("launch-cp-not-dividing-workers", "launch", "--nproc", "3", "--", *T("x", "parallel.cp=2").args,
      names=("parallel.cp", "3 workers")),
    R("launch-cp-dp-mismatch", "launch", "--nproc", "4", "--", *T("x", "parallel.cp=2", "parallel.dp=4").args,
      names=("parallel.dp", "2 replicas")),
]

HF_EDITS = {  # variant -> config.json keys to set (None deletes), or raw text
    "dynamic_parameters": {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}},
    "dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    "longrope": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 32}},
    # transformers takes a non-empty rope_scaling over rope_parameters (convert_rope_params_to_dict)
    "dynamic_beside_default": {"rope_scaling": {"type": "dynamic", "factor": 4.0},
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "type_and_rope_type": {"rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0}},
    "llama3_missing": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "partial_rotary": {"partial_rotary_factor": 0.5},
    "theta_word": {"rope_parameters": {"rope_type": "default", "rope_theta": "big"}},
    "scaling_list": {"rope_scaling": [1, 2]},
    "gelu": {"hidden_act": "gelu"},
    "attention_bias": {"attention_bias": True},
    "head_dim": {"head_dim": 12.5},
    "softcapping": {"final_logit_softcapping": 30.0},
    "layer_types": {"layer_types": ["full_attention"]},
    "window_word": {"sliding_window": "wide"},
    "gpt2": {"architectures": ["GPT2LMHeadModel"]},
    "heads_zero": {"num_attention_heads": 0},
    "hidden_word": {"hidden_size": "big"},
    "vocab_missing": {"vocab_size": None},
    "layers_fraction": {"num_hidden_layers": 2.5},
    "eps_word": {"rms_norm_eps": "tiny"},
    "garbage": "{not json",
    "list": "[1, 2]",
}
HYBRID_EDITS = {  # variant -> config.json keys of the Qwen3.5 hybrid to set (None deletes)
    "hybrid_value_heads": {"linear_num_value_heads": 3},
    "hybrid_conv_zero": {"linear_conv_kernel_dim": 0},
    "hybrid_key_heads_missing": {"linear_num_key_heads": None},
}


def _fixtures(root: Path, corpus: Path, exports) -> dict[str, str]:
    """Everything the rows point at, built in-process once: runs, exports (copies of the session's
    CLI exports of tests/test_export.py's LLAMA run, tests/conftest.py llama_exports), HF dirs, corpora."""
    import numpy as np
    from safetensors.torch import load_file, save_file

    from msllm import checkpoint, device
    from msllm.config_file import config_from_dict, save_config
    from msllm.data.tokenizer import train_tokenizer
    from msllm.models.decoder import build_model
    from tests.hf_models import build
    from tests.test_export import LLAMA

    root.mkdir()
    f = {"corpus": corpus}
    f["empty"] = root / "empty"
    f["empty"].mkdir()
    f["afile"] = root / "afile"
    f["afile"].write_text("not a directory\n")
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))[:8]]

    device.setup("cpu", "pynative")
    tokenizer = root / "tok384.json"
    train_tokenizer(texts, LLAMA.vocab_size).save(str(tokenizer))

    def make_run(name, weights=LLAMA, tokenizer=tokenizer):
        """A run dir as msllm train leaves it: config.yaml, a checkpoint of `weights`, the tokenizer."""
        folder = f[name] = root / name
        cfg = config_from_dict({"model": dataclasses.asdict(LLAMA), "data": {"path": str(corpus), "seq_len": 16},
                                "train": {"run_dir": str(folder), "batch_size": 2, "steps": 4}})
        folder.mkdir()
        save_config(cfg, folder / "config.yaml")
        checkpoint.save(folder, 1, build_model(weights, seed=5).trainable_params(), [],
                        {"config": cfg.to_dict(), "tokenizer": tokenizer and str(tokenizer)})

    make_run("run")
    make_run("runshapes", weights=dataclasses.replace(LLAMA, hidden_size=32))  # a mixed-up checkpoint
    make_run("runnotok", tokenizer=None)
    f["runbadyaml"] = root / "runbadyaml"
    shutil.copytree(f["run"], f["runbadyaml"])
    (f["runbadyaml"] / "config.yaml").write_text("model: [\n")
    f["runcorrupt"] = root / "runcorrupt"
    shutil.copytree(f["run"], f["runcorrupt"])
    (f["runcorrupt"] / "checkpoints" / "step_0000001" / checkpoint.MODEL_FILE).write_bytes(b"garbage")
    f["runvictim"] = root / "runvictim"  # export --out RUN --force must refuse, not replace it
    shutil.copytree(f["run"], f["runvictim"])
    f["runnockpt"] = root / "runnockpt"
    f["runnockpt"].mkdir()
    shutil.copy(f["run"] / "config.yaml", f["runnockpt"] / "config.yaml")

    ckpt = checkpoint.latest(f["run"])
    f["ckpttrunc"] = root / "ckpttrunc"
    shutil.copytree(ckpt, f["ckpttrunc"])
    weights = f["ckpttrunc"] / checkpoint.MODEL_FILE
    weights.write_bytes(weights.read_bytes()[:-4096])
    f["ckptbadstate"] = root / "ckptbadstate"
    shutil.copytree(ckpt, f["ckptbadstate"])
    (f["ckptbadstate"] / checkpoint.STATE_FILE).write_text("{not json")

    for fmt in ("onnx", "mindir"):
        f[fmt] = root / fmt
        shutil.copytree(exports(fmt)[0], f[fmt])
        files = json.loads((f[fmt] / "export.json").read_text())["files"]
        weights = "weights.onnx.data" if fmt == "onnx" else "cached_variables/data_0"
        for case, name in (("trunc", files["decode"]), ("truncweights", weights)):
            f[fmt + case] = root / (fmt + case)
            shutil.copytree(f[fmt], f[fmt + case])
            target = f[fmt + case] / name
            target.chmod(0o644)
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    f["mindirnoweights"] = root / "mindirnoweights"
    shutil.copytree(f["mindir"], f["mindirnoweights"])
    (f["mindirnoweights"] / "model_variables" / "data_0").unlink()
    f["exportgarbage"] = root / "exportgarbage"
    shutil.copytree(f["onnx"], f["exportgarbage"])
    (f["exportgarbage"] / "export.json").write_text("{not json")

    # Corpora and tokenizers.
    f["bincorpus"] = root / "bincorpus"
    f["bincorpus"].mkdir()
    rng = np.random.default_rng(0)
    for k in range(3):
        (f["bincorpus"] / ("blob.py" if k == 0 else f"blob{k}.py")).write_bytes(rng.bytes(20000) + b"\xff\xfe")
    f["tinycorpus"] = root / "tinycorpus"
    f["tinycorpus"].mkdir()
    (f["tinycorpus"] / "a.py").write_text("x = 1\n")
    f["tok512"] = root / "tok512.json"
    tok512 = train_tokenizer(texts, 512)
    tok512.save(str(f["tok512"]))
    assert tok512.get_vocab_size() == 512
    f["tokgarbage"] = root / "tokgarbage.json"
    f["tokgarbage"].write_text("{not a tokenizer")
    for name, tok in (("shard512", f["tok512"]), ("shardnotok", None), ("shardtrunc", tokenizer)):
        f[name] = root / name
        f[name].mkdir()
        np.arange(4000, dtype=np.uint16).tofile(f[name] / "train.bin")
        np.arange(400, dtype=np.uint16).tofile(f[name] / "val.bin")
        (f[name] / "index.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 512 if name == "shard512" else 300,
                                                        "eos_id": 0, "val_tokens": 400,
                                                        "train_tokens": 5000 if name == "shardtrunc" else 4000}))
        if tok:
            shutil.copy(tok, f[name] / "tokenizer.json")

    # Hugging Face dirs: one good, one per bad config.json, broken weights; the same of a Qwen3.5 hybrid.
    def edited_copies(base: Path, edits: dict) -> None:
        config = json.loads((base / "config.json").read_text())
        for variant, edit in edits.items():
            folder = f["hf_" + variant] = root / ("hf_" + variant)
            shutil.copytree(base, folder)
            if isinstance(edit, str):
                text = edit
            else:
                text = json.dumps({k: v for k, v in {**config, **edit}.items() if v is not None})
            (folder / "config.json").write_text(text)

    f["hf"] = root / "hf"
    build("llama2_mha").save_pretrained(f["hf"])
    edited_copies(f["hf"], HF_EDITS)
    hybrid = root / "hf_hybrid"
    build("qwen3_5").save_pretrained(hybrid)
    edited_copies(hybrid, HYBRID_EDITS)
    tensors = load_file(hybrid / "model.safetensors")
    z, conv = "model.layers.1.linear_attn.in_proj_z.weight", "model.layers.0.linear_attn.conv1d.weight"
    for variant, edited in (("hybrid_missing", {k: v for k, v in tensors.items() if k != z}),
                            ("hybrid_misshaped", {**tensors, conv: tensors[conv][..., :-1].contiguous()})):
        f["hf_" + variant] = root / ("hf_" + variant)
        shutil.copytree(hybrid, f["hf_" + variant])
        save_file(edited, f["hf_" + variant] / "model.safetensors", metadata={"format": "pt"})
    f["hf_truncated"] = root / "hf_truncated"
    shutil.copytree(f["hf"], f["hf_truncated"])
    weights = f["hf_truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])
    f["hf_bin_garbage"] = root / "hf_bin_garbage"
    f["hf_bin_garbage"].mkdir()
    shutil.copy(f["hf"] / "config.json", f["hf_bin_garbage"])
    (f["hf_bin_garbage"] / "pytorch_model.bin").write_bytes(b"\x80\x02garbage" * 10)
    f["nested"] = root / "nested"
    shutil.copytree(f["hf"], f["nested"] / "hf")
    f["loop"] = root / "loop"
    f["loop"].symlink_to(f["loop"])
    f["hf_no_weights"] = root / "hf_no_weights"
    f["hf_no_weights"].mkdir()
    shutil.copy(f["hf"] / "config.json", f["hf_no_weights"])
    _finetune_fixtures(root, f, texts)
    return {k: str(v) for k, v in f.items()}


def _finetune_fixtures(root: Path, f: dict, texts: list[str]) -> None:
    """HF dirs with tokenizers, SFT rows good and bad, a LoRA run (adapters + base sha256) and its PEFT export."""
    from interop.pretrained import InitFrom, PretrainedWeights, export_peft
    from msllm import checkpoint
    from msllm.config_file import config_from_dict
    from msllm.lora import adapter_params, apply_lora
    from msllm.models.decoder import Llama
    from tests.hf_models import build, save_tokenizer

    f["hftok"] = root / "hftok"
    shutil.copytree(f["hf"], f["hftok"])
    save_tokenizer(f["hftok"], texts)
    f["hfother"] = root / "hfother"
    build("llama2_mha", seed=1).save_pretrained(f["hfother"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f["hftok"] / name, f["hfother"] / name)
    rows = {"sftgood": [{"prompt": f"x{i} = ", "response": str(i)} for i in range(40)],
            "sftmissing": [{"prompt": "a", "response": "b"}, {"prompt": "a", "answer": "b"}],
            "sftlong": [{"prompt": "def " * 60, "response": "b"}]}
    for name, content in rows.items():
        f[name] = root / f"{name}.jsonl"
        f[name].write_text("".join(json.dumps(r) + "\n" for r in content))

    f["lorarun"] = root / "lorarun"
    tokenizer = str(f["hftok"] / "tokenizer.json")
    cfg = config_from_dict({"data": {"path": str(f["sftgood"]), "seq_len": 32, "tokenizer": tokenizer},
                            "model": dataclasses.asdict(PretrainedWeights(f["hftok"]).model),
                            "train": {"run_dir": str(f["lorarun"]), "init_from": str(f["hftok"])},
                            "lora": {"rank": 2}})
    init = InitFrom(cfg)
    model = Llama(cfg.model)
    apply_lora(model, cfg.lora, 0)
    f["lorarun"].mkdir()
    checkpoint.save(f["lorarun"], 1, adapter_params(model), [],
                    {"config": cfg.to_dict(), "tokenizer": tokenizer, "lora_base": init.identity()})
    f["peft"] = root / "peft"
    export_peft(f["lorarun"], f["peft"])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, corpus, llama_exports):
    root = tmp_path_factory.mktemp("bad_inputs")
    paths = _fixtures(root / "fixtures", corpus, llama_exports)
    readonly = root / "fixtures" / "readonly"  # a read-only file system: as root, permission bits stop nothing
    readonly.mkdir()
    mounted = not subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(readonly)]).returncode
    yield root, {**paths, "readonly": str(readonly) if mounted else None}
    if mounted:
        subprocess.run(["umount", str(readonly)], check=True)


def snapshot(root: Path) -> dict:
    """Every path under root with its size and modification time: a write anywhere changes it."""
    return {str(p.relative_to(root)): (p.is_dir(), p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def fill(text: str, values: dict) -> str:
    """Replace {name} by a fixture path; other braces (YAML flow mappings) stay."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def prepare(row: Row, root: Path, paths: dict) -> tuple[Path, dict]:
    """The row's own work dir (with its c.yaml) and the values its "{name}"s take."""
    work = root / "work" / row.id
    work.mkdir(parents=True)
    values = {**paths, "work": str(work)}
    if isinstance(row.config, dict):
        merged = {}
        for dotted, value in TINY.items():
            section, key = dotted.split(".")
            merged.setdefault(section, {})[key] = fill(value, values) if isinstance(value, str) else value
        for section, entries in row.config.items():
            merged[section] = {**merged.get(section, {}), **entries} if isinstance(entries, dict) else entries
        (work / "c.yaml").write_text(yaml.safe_dump(merged))
    elif isinstance(row.config, bytes):
        (work / "c.yaml").write_bytes(row.config)
    elif isinstance(row.config, str):
        (work / "c.yaml").write_text(row.config)
    return work, values


def quiet_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG")}  # the CLI must quiet MindSpore itself
    env.update(PYTHONPATH=str(REPO), **(extra or {}))
    return env


def changes(before: dict, after: dict) -> list:
    return sorted(set(before.items()) ^ set(after.items()))


def run_row(row: Row, root: Path, paths: dict) -> tuple[SimpleNamespace, list, dict]:
    """The row in a process of its own: `python -m msllm.cli ARGS`, as a user runs it."""
    work, values = prepare(row, root, paths)
    before = snapshot(root)
    proc = subprocess.run([sys.executable, "-m", "msllm.cli", *[fill(a, values) for a in row.args]],
                          cwd=work, env=quiet_env(row.env), capture_output=True, text=True, timeout=300)
    return SimpleNamespace(returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr), \
        changes(before, snapshot(root)), values


# Rows run each in a fresh interpreter, where that is what they test: an environment variable read
# as the process starts (RANK_SIZE), and for each command one row that fails late, after the
# command's heavy imports (MindSpore for train, generate, verify, convert and lora: the CLI must keep
# its start-up log and warnings off stderr itself, without GLOG_v), so a fresh process is held to
# the one line too. Every other row runs in one shared interpreter (serve_rows): the CLI's main()
# called row after row, each from its own working dir with its stdout / stderr file descriptors
# captured, so MindSpore's C++ log counts against the one line there as well; what it does not
# repeat is the interpreter's start and MindSpore's import, ~1-3 s a row (213 rows: 339 s -> 84 s
# for this file, 2026-11-27, 2 shared cores).
FRESH = {"train-rank-size", "resume-model-changed", "generate-top-k-above-vocab", "export-weights-other-shape",
         "hf-weights-truncated", "verify-other-model", "lora-merge-wrong-base", "launch-bad-config"}


def serve_rows(jobs_file: str) -> None:
    """Run the jobs of `jobs_file` (JSON: id, args, cwd, root) one after another in this interpreter,
    through msllm.cli.main as `python -m msllm.cli` would; each row's exit code, stdout, stderr and the
    files it changed under root are written as one JSON line to jobs_file + ".out" as it ends."""
    import tempfile
    import traceback

    from msllm.cli import main

    jobs = json.loads(Path(jobs_file).read_text())
    with open(jobs_file + ".out", "w") as results:
        for job in jobs:
            root = Path(job["root"])
            before = snapshot(root)
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.chdir(job["cwd"])
                try:
                    code = main(job["args"])
                except SystemExit as e:  # argparse; as the interpreter would exit
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if isinstance(e.code, str):
                        print(e.code, file=sys.stderr)
                except BaseException:  # as an uncaught exception ends the process
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
                    for fd in saved:
                        os.close(fd)
                os.chdir(root)
                texts = []
                for f in (out, err):
                    f.seek(0)
                    texts.append(f.read().decode(errors="replace"))
            results.write(json.dumps({"id": job["id"], "returncode": code, "stdout": texts[0], "stderr": texts[1],
                                      "changed": [list(map(str, c)) for c in changes(before, snapshot(root))]}) + "\n")
            results.flush()


@pytest.fixture(scope="module")
def shared_runs(fixtures, tmp_path_factory):
    """id -> (result, changed, values) of every row that is not FRESH, run in one interpreter."""
    root, paths = fixtures
    jobs, values = [], {}
    for row in ROWS:
        if row.id in FRESH or (paths["readonly"] is None and any("{readonly}" in a for a in row.args)):
            continue
        assert row.env is None, f"{row.id}: a row with its own environment runs in a fresh process (FRESH)"
        work, values[row.id] = prepare(row, root, paths)
        jobs.append({"id": row.id, "args": [fill(a, values[row.id]) for a in row.args], "cwd": str(work),
                     "root": str(root)})
    jobs_file = tmp_path_factory.mktemp("bad_input_jobs") / "jobs.json"  # outside root: no row sees it grow
    jobs_file.write_text(json.dumps(jobs))
    script = "import sys; from tests.test_bad_inputs import serve_rows; serve_rows(sys.argv[1])"
    out = Path(str(jobs_file) + ".out")
    proc = subprocess.run([sys.executable, "-c", script, str(jobs_file)], cwd=root, env=quiet_env(),
                          capture_output=True, text=True, timeout=1800)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done[r["id"]] = (SimpleNamespace(**{k: r[k] for k in ("returncode", "stdout", "stderr")}), r["changed"],
                             values[r["id"]])
    return done, proc


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line_exit_2_nothing_written(row, fixtures, shared_runs):
    root, paths = fixtures
    if paths["readonly"] is None and any("{readonly}" in a for a in row.args):
        pytest.skip("needs permission to mount a read-only tmpfs")
    if row.id in FRESH:
        proc, changed, values = run_row(row, root, paths)
    else:
        done, batch = shared_runs
        assert row.id in done, f"the shared interpreter ended before this row: {batch.stderr[-3000:]}"
        proc, changed, values = done[row.id]
    lines = proc.stderr.splitlines()
    commands = ("train", "generate", "export", "convert", "verify", "launch")
    command = row.args[0] if row.args and row.args[0] in commands else ""
    if row.args[:1] == ("lora",):
        command = " ".join(row.args[:2])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"msllm {command}: error: " if command else "msllm: error: "), lines[0]
    for name in row.names:
        assert fill(name, values) in lines[0], lines[0]
    assert proc.stdout == ""
    assert not changed, changed[:10]
    assert not Path("/sys/msllm-bad-input-run").exists() and not Path("/sys/kernel/msllm-bad-input-cache").exists()


def test_row_ids_are_unique_and_many():
    assert len({r.id for r in ROWS}) == len(ROWS) > 100


def test_help_documents_every_option_with_an_example():
    from msllm.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("train", "generate", "export", "convert", "verify"):
        sub = commands[name]
        for action in sub._actions:
            assert action.help, f"msllm {name}: {action.option_strings or action.dest} has no help"
        assert f"msllm {name} " in (sub.epilog or ""), f"msllm {name} --help has no example"
        proc = subprocess.run([sys.executable, "-m", "msllm.cli", name, "--help"], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert proc.returncode == 0 and "example" in proc.stdout.lower()
