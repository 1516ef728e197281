#!/usr/bin/env python
"""MindFormers peer for msllm: cross-check logits and benchmark MF's Llama train step.

Run with the MindFormers venv's python (see tools/mindformers_env.sh):

  PY=$(bash tools/mindformers_env.sh | tail -1)
  $PY tools/mindformers_peer.py logits --config cfg.json --ckpt w.safetensors \
      --tokens tok.npy --out logits.npy
  $PY tools/mindformers_peer.py bench --vocab 4096 --hidden 512 --layers 4 --heads 8 \
      --ffn 1376 --seq 256 --batch 4 --steps 10 --warmup 2 --threads 2

cfg.json keys (msllm's model_config.json): vocab_size, hidden_size, num_layers, num_heads,
num_kv_heads, ffn_size, rope_theta, norm_eps, max_seq_len, tie_embeddings; optional qkv_bias
(default: inferred from the weights, i.e. present iff `...attention.wq.bias` is in the file).
Weights use MindFormers names: its Llama (model.tok_embeddings.embedding_weight,
model.layers.N.attention.wq.weight, ..., model.norm_out.weight, lm_head.weight), or with qk_norm
(and head_dim) its mcore Qwen3 (embedding.word_embeddings.weight, decoder.layers.N.self_attention.
linear_qkv.weight, ..., decoder.final_layernorm.weight, output_layer.weight); with num_experts too
(experts_per_token, moe_ffn_size, norm_topk_prob, routed_scaling) its mcore Qwen3-MoE (... decoder.layers.N.
mlp.router.weight, mlp.experts.weight1, mlp.experts.weight2 ...), on CPU through use_cpu_moe_kernels; with
attention "mla" (q_lora_rank, kv_lora_rank, ... expert_groups, topk_groups, shared_experts) its mcore DeepSeek-V3
(... self_attention.linear_qkv / linear_qb / linear_kvb, mlp.router.expert_bias, mlp.shared_experts ...).
"""
import argparse
import json
import os
import resource
import sys
import time

# MindFormers writes logs to ./output/log by default; keep them out of the caller's cwd.
_OUT = os.path.join(os.path.expanduser("~"), ".cache", "msllm", "mf-output")
os.environ.setdefault("LOCAL_DEFAULT_PATH", _OUT)
os.environ.setdefault("LOG_MF_PATH", os.path.join(_OUT, "log"))
os.environ.pop("RUN_MODE", None)  # RUN_MODE=predict would flatten logits to [b*s, vocab]
# MindFormers' logger writes INFO lines to stdout; keep stdout for our single JSON result line.
_STDOUT, sys.stdout = sys.stdout, sys.stderr

import numpy as np  # noqa: E402


def _log(*a):
    print("[mindformers_peer]", *a, file=sys.stderr, flush=True)


def setup_ms(mode, threads=None):
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    if threads:
        ms.device_context.cpu.op_tuning.threads_num(int(threads))
    return ms


def build_llama(vocab, hidden, layers, heads, kv_heads, ffn, seq, batch, theta=10000.0, eps=1e-5,
                max_pos=None, tie=False, qkv_bias=False):
    """MindFormers' own LlamaForCausalLM, fp32 everywhere, CPU-safe flags."""
    from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    f32 = "float32"
    cfg = LlamaConfig(
        batch_size=batch, seq_length=seq, max_position_embedding=max(max_pos or seq, seq),
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        n_kv_heads=kv_heads if kv_heads != heads else None,
        intermediate_size=ffn,  # given explicitly => no multiple_of/ffn_dim_multiplier rounding
        rms_norm_eps=eps, theta=theta, tie_word_embeddings=tie, qkv_has_bias=qkv_bias,
        compute_dtype=f32, layernorm_compute_type=f32, softmax_compute_type=f32, rotary_dtype=f32,
        param_init_type=f32, embedding_init_type=f32, residual_dtype=f32,
        use_rope_slice=True,   # CPU: the default swap-matrix RoPE path is not usable here
        fused_rms_norm=False,  # CPU: no fused RmsNorm kernel
        use_flash_attention=False, use_past=False, qkv_concat=False,
        pad_token_id=-1,  # MF masks keys whose token == pad_token_id; -1 disables that
    )
    net = LlamaForCausalLM(cfg)
    got = net.model.layers[0].feed_forward.w1.weight.shape
    assert tuple(got) == (ffn, hidden), f"FFN weight is {got}, wanted {(ffn, hidden)}"
    return net


def build_qwen3(c, seq, batch):
    """MindFormers' own mcore Qwen3 (TrainingQwen3ForCausalLM: the class MindFormers trains Qwen3 with),
    or with num_experts its Qwen3-MoE (TrainingQwen3MoeForCausalLM: router, grouped experts weight1 /
    weight2), fp32, with three Ascend-only kernels given CPU stand-ins that compute the same: RmsNorm (y and
    rstd from ops), a broadcast product for Outer (RoPE's angle table) and
    softmax attention for FlashAttentionScore (BNSD, its GQA grouping, mask 1 = hidden). The fp16
    casts it puts before FlashAttentionScore (that kernel's input dtypes) are skipped, so all runs in fp32;
    the MoE's kernels without a CPU kernel are stood in for by use_cpu_moe_kernels.
    The weight layout, the q/k norms, RoPE, the MLP and the MoE routing are MindFormers' own."""
    import mindspore as ms
    from mindformers import build_context

    mode = "GRAPH_MODE" if ms.get_context("mode") == ms.GRAPH_MODE else "PYNATIVE_MODE"
    build_context({"context": {"mode": mode, "device_target": "CPU"}, "use_legacy": False, "parallel": {}})
    f32 = "float32"
    common = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["ffn_size"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
        num_key_value_heads=c.get("num_kv_heads") or c["num_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_heads"], rms_norm_eps=float(c["norm_eps"]),
        rope_theta=float(c["rope_theta"]), max_position_embeddings=max(c.get("max_seq_len") or seq, seq),
        seq_length=seq, batch_size=batch, tie_word_embeddings=bool(c.get("tie_embeddings", False)),
        pad_token_id=-1, compute_dtype=f32, params_dtype=f32, layernorm_compute_dtype=f32,
        softmax_compute_dtype=f32, rotary_dtype=f32)
    if c.get("num_experts"):
        use_cpu_moe_kernels()
        from mindformers.models.qwen3_moe import Qwen3MoeConfig
        from mindformers.models.qwen3_moe.modeling_qwen3_moe_train import TrainingQwen3MoeForCausalLM
        # Grouped GEMM is its only MoE kind. Hugging Face's Qwen3-MoE scales the routing weights by 1
        # (msllm's routed_scaling); MindFormers' own 30B-A3B yaml says 1.5.
        net = TrainingQwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=c["num_experts"], num_experts_per_tok=c["experts_per_token"],
            moe_intermediate_size=c.get("moe_ffn_size") or c["ffn_size"], norm_topk_prob=bool(c["norm_topk_prob"]),
            moe_grouped_gemm=True, routed_scaling_factor=float(c.get("routed_scaling", 1.0))))
    else:
        from mindformers.models.qwen3 import Qwen3Config
        from mindformers.models.qwen3.modeling_qwen3_train import TrainingQwen3ForCausalLM
        net = TrainingQwen3ForCausalLM(Qwen3Config(**common))
    return use_cpu_attention_kernels(net)


def build_deepseek_v3(c, seq, batch):
    """MindFormers' own mcore DeepSeek-V3 (TrainingDeepseekV3ForCausalLM: MLA with linear_qkv / linear_qb /
    linear_kvb and its q / k layernorms, dense first layers, the sigmoid group-limited router with its expert
    bias, shared experts, grouped experts), fp32, on CPU with build_qwen3's stand-ins. No multi-token
    prediction (msllm has none); RoPE unscaled, so MindFormers' yarn mscale (factor 40 by default) is 1."""
    import mindspore as ms
    from mindformers import build_context

    if c.get("rope_scaling") or c.get("attn_scale"):
        raise SystemExit("mindformers_peer: DeepSeek-V3 with scaled RoPE is not set up here")
    mode = "GRAPH_MODE" if ms.get_context("mode") == ms.GRAPH_MODE else "PYNATIVE_MODE"
    build_context({"context": {"mode": mode, "device_target": "CPU"}, "use_legacy": False, "parallel": {}})
    use_cpu_moe_kernels()
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config
    from mindformers.models.deepseek3.modeling_deepseek_v3_train import TrainingDeepseekV3ForCausalLM
    f32 = "float32"
    dense = (c.get("mlp_types") or []).count("dense")
    net = TrainingDeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["ffn_size"],
        moe_intermediate_size=c.get("moe_ffn_size") or c["ffn_size"], num_hidden_layers=c["num_layers"],
        num_nextn_predict_layers=0, num_attention_heads=c["num_heads"], num_key_value_heads=c["num_heads"],
        n_shared_experts=c["shared_experts"], n_routed_experts=c["num_experts"],
        routed_scaling_factor=float(c["routed_scaling"]), kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c["q_lora_rank"] or None, qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        qk_nope_head_dim=c["qk_nope_head_dim"], n_group=c["expert_groups"], topk_group=c["topk_groups"],
        num_experts_per_tok=c["experts_per_token"], first_k_dense_replace=dense,
        norm_topk_prob=bool(c["norm_topk_prob"]), rms_norm_eps=float(c["norm_eps"]), rope_theta=float(c["rope_theta"]),
        max_position_embeddings=max(c.get("max_seq_len") or seq, seq), tie_word_embeddings=bool(c["tie_embeddings"]),
        seq_length=seq, batch_size=batch, pad_token_id=-1, compute_dtype=f32, params_dtype=f32,
        layernorm_compute_dtype=f32, softmax_compute_dtype=f32, rotary_dtype=f32, router_dense_type=f32,
        moe_grouped_gemm=True, qk_layernorm=True, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0))
    return use_cpu_attention_kernels(net)


def use_cpu_attention_kernels(net):
    """build_qwen3's CPU stand-ins for RmsNorm, Outer and FlashAttentionScore, set on `net`."""
    import mindspore as ms
    from mindspore import nn, ops

    class Outer(nn.Cell):
        def construct(self, a, b):
            return a.reshape(-1, 1) * b.reshape(1, -1)

    class SoftmaxAttentionScore(nn.Cell):
        """FlashAttentionScore's outputs (max, sum, unused, attention) with only the attention computed."""

        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def construct(self, q, k, v, alibi, drop, padding, mask, prefix):
            rep = q.shape[1] // k.shape[1]
            k, v = ops.repeat_interleave(k, rep, 1), ops.repeat_interleave(v, rep, 1)
            scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale
            scores = scores + ops.cast(mask, ms.float32) * -1e9
            out = ops.matmul(ops.softmax(scores, -1), v)
            return out, out, out, out

    class RmsNorm(nn.Cell):
        def __init__(self, eps):
            super().__init__()
            self.eps = eps

        def construct(self, x, w):
            rstd = ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)
            return x * rstd * w, rstd

    class KeepFp32(nn.Cell):
        def construct(self, x, dtype):
            return x if dtype == ms.float16 else ops.cast(x, dtype)

    for _, cell in net.cells_and_names():
        if isinstance(getattr(cell, "norm", None), ops.RmsNorm):
            cell.norm = RmsNorm(cell.eps)
        if hasattr(cell, "outer_for_eod"):
            cell.outer, cell.outer_for_eod = Outer(), Outer()
        if hasattr(cell, "flash_attention") and hasattr(cell.flash_attention, "scale_value"):
            cell.flash_attention = SoftmaxAttentionScore(cell.flash_attention.scale_value)
        if hasattr(cell, "core_attention"):
            cell.cast = KeepFp32()
    return net


def use_cpu_moe_kernels():
    """MindFormers' MoE (router, token dispatcher, grouped-GEMM experts) calls eight primitives that have no
    CPU kernel in MindSpore 2.9 ("Unsupported op [TopkExt] on CPU" is the first): swap them, in the modules
    that call them, for stand-ins computing what their documentation says. The routing, the token
    permutation and the experts' weight1 / weight2 reshape stay MindFormers' own."""
    import mindspore as ms
    from mindspore import ops
    from mindformers.parallel_core.training_graph.transformer.moe import ffn, router, token_dispatcher

    class Kernel:
        def __init__(self, *args, **kwargs):
            pass

        def recompute(self, *args, **kwargs):  # what MindFormers sets on the primitives: nothing to do here
            return self

        add_prim_attr = shard = recompute

    def stand_in(call):
        return ms.jit_class(type(call.__name__, (Kernel,), {"__call__": call}))

    def TopkExt(self, x, k, dim=-1, largest=True, sorted=True):
        return ops.topk(x, k, dim, largest, sorted)

    def SortExt(self, x, dim=-1, descending=False, stable=False):
        return ops.sort(x, dim, descending)

    def IndexSelect(self, x, dim, index):
        return ops.gather(x, index, dim)

    def OneHotExt(self, x, num_classes, on_value, off_value, axis=-1):
        return ops.one_hot(x, num_classes, on_value, off_value, axis)

    def CumsumExt(self, x, dim, dtype=None):
        return ops.cumsum(x, dim)

    def FmodScalar(self, x, y):  # of non-negative indices: floor_mod is fmod
        return ops.floor_mod(x, y)

    def Swiglu(self, x, dim=-1):  # silu(first half) * second half
        gate, up = ops.split(x, x.shape[dim] // 2, dim)
        return ops.silu(gate) * up

    def GroupedMatmul(self, x, weight, bias=None, scale=None, offset=None, antiquant_scale=None,
                      antiquant_offset=None, group_list=None):
        """split_item 3, group_type 0: row r times weight[e] for group_list[e - 1] <= r < group_list[e]
        (group_list: cumulative row counts)."""
        x, w = x[0], weight[0]
        rows = ops.arange(x.shape[0]).astype(ms.int64).reshape(-1, 1)
        group = (rows >= group_list.reshape(1, -1)).astype(ms.int32).sum(1)
        return [ops.bmm(x.reshape(x.shape[0], 1, -1), ops.gather(w, group, 0)).reshape(x.shape[0], -1)]

    for call in (TopkExt, SortExt, IndexSelect, OneHotExt, CumsumExt, FmodScalar, Swiglu, GroupedMatmul):
        for module in (ffn, router, token_dispatcher):
            if hasattr(module, call.__name__):
                setattr(module, call.__name__, stand_in(call))


def read_weights(path):
    """name -> fp32 numpy array, from a MindSpore .ckpt or a .safetensors file."""
    import mindspore as ms
    fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
    params = ms.load_checkpoint(path, format=fmt)
    return {k: v.astype(ms.float32).asnumpy() for k, v in params.items()}


def load_strict(net, weights):
    import mindspore as ms
    net_params = net.parameters_dict()  # tied params appear once
    # Buffers that are not weights (MoE routers' fi_accu: the aux loss's running expert load) keep their init.
    buffers = sorted(k for k, p in net_params.items() if not p.requires_grad and k not in weights)
    missing = sorted(set(net_params) - set(weights) - set(buffers))
    unexpected = sorted(set(weights) - set(net_params))
    bad_shape = sorted(f"{k}: file {weights[k].shape} vs model {tuple(net_params[k].shape)}"
                       for k in set(net_params) & set(weights)
                       if tuple(weights[k].shape) != tuple(net_params[k].shape))
    if missing or unexpected or bad_shape:
        raise SystemExit("strict load failed:\n  missing: %s\n  unexpected: %s\n  shape: %s"
                         % (missing, unexpected, bad_shape))
    for k in weights:
        net_params[k].set_data(ms.Tensor(weights[k], ms.float32))
    _log(f"loaded {len(weights)} tensors strictly" + (f" (buffers left at init: {buffers})" if buffers else ""))


def cmd_logits(a):
    c = json.load(open(a.config))
    mcore = c.get("qk_norm") or c.get("attention") == "mla"
    ms = setup_ms("graph" if mcore else a.mode, a.threads)  # mcore's logits reshape is graph-only
    tokens = np.load(a.tokens).astype(np.int32)
    assert tokens.ndim == 2, f"tokens must be [batch, seq], got {tokens.shape}"
    weights = read_weights(a.ckpt)
    qkv_bias = c.get("qkv_bias", any(k.endswith("attention.wq.bias") for k in weights))
    if c.get("attention") == "mla":
        net = build_deepseek_v3(c, seq=tokens.shape[1], batch=tokens.shape[0])
    elif c.get("qk_norm"):
        net = build_qwen3(c, seq=tokens.shape[1], batch=tokens.shape[0])
    else:
        net = build_llama(c["vocab_size"], c["hidden_size"], c["num_layers"], c["num_heads"],
                      c.get("num_kv_heads") or c["num_heads"], c["ffn_size"],
                      seq=tokens.shape[1], batch=tokens.shape[0], theta=float(c["rope_theta"]),
                      eps=float(c["norm_eps"]), max_pos=c.get("max_seq_len"),
                          tie=bool(c.get("tie_embeddings", False)), qkv_bias=bool(qkv_bias))
    load_strict(net, weights)
    # Eval mode, no labels, no batch_valid_length: LlamaForCausalLM returns
    # (logits [b, s, vocab] fp32, tokens, input_mask) -- full-sequence logits, no loss.
    net.set_train(False)
    out = net(ms.Tensor(tokens, ms.int32))
    logits = (out[0] if isinstance(out, (tuple, list)) else out).asnumpy().astype(np.float32)
    logits = logits.reshape(tokens.shape[0], tokens.shape[1], c["vocab_size"])
    np.save(a.out, logits)
    _log(f"saved logits {logits.shape} to {a.out}")


def cpu_train_step_cls():
    """MF's default runner_wrapper (MFTrainOneStepCell), made runnable on CPU.

    Its loss-scale base class checks grad overflow with NPU/GPU-only ops (NPUGetFloatStatusV2
    on non-GPU targets, FloatStatus on GPU); neither has a CPU kernel. Same check via isfinite.
    """
    from mindspore import ops
    from mindformers.wrapper import MFTrainOneStepCell

    class CPUTrainOneStepCell(MFTrainOneStepCell):
        def get_overflow_status(self, status, compute_output):
            finite = [ops.isfinite(g).all() for g in compute_output]
            return ops.logical_not(ops.stack(finite).all())

    return CPUTrainOneStepCell


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def cmd_bench(a):
    ms = setup_ms("graph", a.threads)
    from mindformers.core.optim import AdamW
    net = build_llama(a.vocab, a.hidden, a.layers, a.heads, a.kv_heads or a.heads, a.ffn,
                      seq=a.seq, batch=a.batch)
    net.set_train(True)
    decay = [p for p in net.trainable_params() if p.ndim > 1]
    no_decay = [p for p in net.trainable_params() if p.ndim <= 1]
    opt = AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                learning_rate=3e-4, betas=(0.9, 0.95), eps=1e-8)
    step = cpu_train_step_cls()(net, opt, use_clip_grad=True, max_grad_norm=1.0)
    step.set_train(True)
    rng = np.random.default_rng(0)
    # MF's train path takes seq+1 ids and shifts internally (inputs = ids[:, :-1], labels = ids[:, 1:]).
    batches = [ms.Tensor(rng.integers(0, a.vocab, (a.batch, a.seq + 1), dtype=np.int32))
               for _ in range(4)]
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = step(batches[i % len(batches)])[0].asnumpy()  # asnumpy syncs
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.reshape(-1)[0]))
        _log(f"step {i}: {times[-1]:.3f}s loss {losses[-1]:.4f}")
    measured = times[a.warmup:]
    med = float(np.median(measured))
    print(json.dumps({
        "framework": "mindformers", "tokens_per_s": a.batch * a.seq / med,
        "step_times": [round(t, 4) for t in measured], "compile_s": round(times[0], 3),
        "peak_rss_mb": round(peak_rss_mb(), 1), "threads": a.threads, "losses": losses,
        "shape": {k: getattr(a, k) for k in
                  ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch")},
    }), file=_STDOUT, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="full-sequence fp32 logits from MF's LlamaForCausalLM")
    lg.add_argument("--config", required=True)
    lg.add_argument("--ckpt", required=True)
    lg.add_argument("--tokens", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--mode", choices=("pynative", "graph"), default="pynative")
    lg.add_argument("--threads", type=int, default=None)
    b = sub.add_parser("bench", help="time MF's Llama train step (GRAPH mode, fp32, AdamW)")
    for name, default in (("vocab", 4096), ("hidden", 512), ("layers", 4), ("heads", 8),
                          ("kv_heads", None), ("ffn", 1376), ("seq", 256), ("batch", 4),
                          ("steps", 10), ("warmup", 2), ("threads", None)):
        b.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    a = p.parse_args(argv)
    (cmd_logits if a.cmd == "logits" else cmd_bench)(a)


if __name__ == "__main__":
    main()
