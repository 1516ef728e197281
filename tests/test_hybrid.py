"""Hybrid linear attention (Qwen3.5: Gated DeltaNet layers beside gated full-attention layers): the
chunked rule against transformers' token-by-token recurrence across chunks, packed samples against
each sample alone, the config translation both ways and the one-line refusals. (Conversion, per-layer
states and logits: test_interop_convert's qwen3_5 case; train steps: test_verify_train's.) Decode: the
recurrent cache on the msllm engine, and in the exported ONNX and MindIR graphs, against transformers'
greedy tokens."""
import dataclasses
import json
from dataclasses import replace

import mindspore as ms
import numpy as np
import onnx
import pytest
import torch
from mindspore import Tensor, ops
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from graph_opt import export as export_mod
from graph_opt.export import export
from graph_opt.runtime import export_engine
from interop import InteropError
from interop.convert import convert
from interop.hf_config import to_hf_config, to_model_config
from msllm import device, kernels
from msllm.backends import apply_recompute, cpu, specialise
from msllm.checkpoint import load_model
from msllm.config import ModelConfig
from msllm.generate import generate
from msllm.inference import cell_engine
from msllm.layout import plan
from msllm.models.decoder import build_model
from msllm.models.layers import SwiGLU
from msllm.models.mixers.gated_deltanet import ChunkedGatedDeltaRule, ShiftedTaps
from tests.hf_models import build
from tests.numerics import REORDER_RTOL
from tests.test_families import BY_HAND, hf_greedy
from tests.test_robustness import assert_same_step, train_steps

# 3 linear layers (2 key heads of 16 serving 4 value heads of 8, conv of 4 taps), then gated attention
HYBRID = ModelConfig(vocab_size=300, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                     ffn_size=96, qk_norm=True, norm_offset=1.0, attn_output_gate=True, rope_fraction=0.25,
                     layer_types=["linear", "linear", "linear", "full"], linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, norm_eps=1e-6)
CHUNK = 8  # the tests' sequences span several chunks of this size (the model's is 64)


def l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def test_chunked_rule_equals_the_token_by_token_recurrence_across_chunks():
    """20 tokens in chunks of 8 (the last padded): outputs, final state and the gradients of q, k, v, the
    decay and beta equal transformers' recurrent form run in fp64, within the fp32 reordering tolerance
    (sums of at most 64 terms per chunk product and state read). Decays as steep as the real models'
    (rates up to 16) make the state forget within a few tokens, so a wrong carry shows in the first chunk
    boundary's tokens."""
    device.setup("cpu", "pynative")
    rng = np.random.default_rng(0)
    b, s, n, dk, dv = 2, 20, 4, 16, 8
    q, k = rng.normal(size=(2, b, s, n, dk))
    v = rng.normal(size=(b, s, n, dv))
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, s, n))))
    g = -rng.uniform(0.01, 2, n) * np.log1p(np.exp(rng.normal(size=(b, s, n))))
    probe = rng.normal(size=(b, s, n, dv))

    ref = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, g, beta)]
    out, state = torch_recurrent_gated_delta_rule(*ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((out * torch.tensor(probe)).sum() + state.sum()).backward()
    want = [out.detach().numpy(), state.detach().numpy()] + [t.grad.numpy() for t in ref]

    rule = ChunkedGatedDeltaRule(CHUNK)
    heads = lambda x: ms.Tensor(np.ascontiguousarray(np.swapaxes(x, 1, 2)), ms.float32)  # noqa: E731
    probe_ms = heads(probe)

    def loss(q_, k_, v_, g_, beta_):
        out_, state_ = rule(ops_l2(q_) * dk ** -0.5, ops_l2(k_), v_, g_, beta_)
        return (out_ * probe_ms).sum() + state_.sum(), (out_, state_)

    (_, (out_, state_)), grads = ms.value_and_grad(loss, grad_position=(0, 1, 2, 3, 4), has_aux=True)(
        *(heads(x) for x in (q, k, v, g, beta)))
    got = [np.swapaxes(out_.asnumpy(), 1, 2), state_.asnumpy()] + [np.swapaxes(t.asnumpy(), 1, 2) for t in grads]
    for name, a, r in zip(("out", "state", "dq", "dk", "dv", "dg", "dbeta"), got, want):
        err = np.abs(a - r).max() / np.abs(r).max()
        assert err <= REORDER_RTOL, f"{name}: max_rel {err:.2e}"


def kept_for_backward(mixer, tokens: int) -> dict[str, float]:
    """Run a CPU-specialised Gated DeltaNet mixer over [2, tokens] (PyNative) and count, off its cells, the
    bytes its backward reads beyond its input x: every activation a Linear or a C++ kernel takes (their
    backwards read their inputs and recompute the rest; each tensor once), and the rule's chunk states (its
    third output, which its backward restarts from). `beta`: the bytes of the rule's beta input."""
    x = Tensor(np.random.default_rng(0).normal(size=(2 * tokens, HYBRID.hidden_size)).astype(np.float32))
    kept, beta = {}, {}

    def read(cell, inputs, output):
        for t in inputs:
            if isinstance(t, Tensor) and not isinstance(t, ms.Parameter) and t is not x:
                kept[id(t)] = t  # held, so no later tensor takes its id
        if isinstance(cell, kernels.GatedDeltaRule):
            q, k, v, g, b = inputs[:5]
            segments, initial = ops.zeros(g.shape, ms.int32), ops.zeros(v.shape[:2] + (q.shape[3], v.shape[3]))
            kept["states"] = cell.rule(q, k, v, g, b, segments, initial)[2]
            beta["bytes"] = b.nbytes

    handles = [cell.register_forward_hook(read) for _, cell in mixer.cells_and_names()
               if type(cell).__module__.startswith("msllm.kernels") or type(cell).__name__ == "Linear"]
    cos = Tensor(np.zeros((tokens, HYBRID.head_dim), np.float32))
    mixer(x, cos, cos, None)
    for handle in handles:
        handle.remove()
    return {"kept": sum(t.nbytes for t in kept.values()), "beta": beta["bytes"]}


def test_plan_counts_what_the_cpu_kernels_keep_of_a_linear_layer():
    """plan.linear_activations with the CPU's kernels is what a CPU-trained Gated DeltaNet layer keeps for
    backward, counted off the layer: the difference between 32 and 16 tokens a row (per-row tensors, the conv's
    window and the initial state, cancel) per token, plus the three [tokens, heads] fp32 tensors of the decay's
    and beta's graph ops (sigmoid's output, softplus's input and output: each the size of the rule's beta).
    The graph form (Ascend's, and CPU's with the kernels off) keeps more: its conv taps and [c, c] chunks."""
    device.setup("cpu", "pynative")
    model = build_model(replace(HYBRID, num_layers=1, layer_types=["linear"]), seed=3)
    cpu.specialise(model, fused=True, share_blocks=False, training=True)
    mixer = model.layers[0].attention
    mixer.rule = kernels.GatedDeltaRule(CHUNK, training=True)
    short, long = kept_for_backward(mixer, 16), kept_for_backward(mixer, 32)
    measured = (long["kept"] - short["kept"] + 3 * (long["beta"] - short["beta"])) / (2 * 16)
    assert plan.linear_activations(HYBRID, 32, 4, kernels=True, chunk=CHUNK) == measured
    assert plan.linear_activations(HYBRID, 32, 4, chunk=CHUNK) > 2 * measured
    device.setup("cpu", "graph")


def ops_l2(x):
    return x * ms.ops.rsqrt((x * x).sum(-1, keepdims=True) + 1e-6)


@pytest.fixture(scope="module")
def hybrid_model():
    device.setup("cpu", "graph")
    model = build_model(HYBRID, seed=3)
    for name, p in model.parameters_and_names():  # norms off their init, decays as Qwen3.5's range
        if name.endswith("A_log"):
            p.set_data(ms.Tensor(np.log(np.random.default_rng(1).uniform(0.5, 2.0, p.shape)), ms.float32))
        elif "norm" in name:
            p.set_data(p + ms.Tensor(np.random.default_rng(2).normal(0, 0.1, p.shape), ms.float32))
    for layer in model.layers:
        if hasattr(layer.attention, "rule"):
            layer.attention.rule.chunk = CHUNK
    model.set_train(False)
    return model


def test_a_packed_row_equals_its_samples_run_alone(hybrid_model):
    """Three samples of 7, 9 and 8 tokens packed in a row of 24 (boundaries inside a chunk and on one):
    each sample's logits equal those of the sample alone at the start of a row (one sample per row, no
    segments), within the fp32 reordering tolerance. Without the resets the later samples read the
    earlier ones' recurrent state and conv window: far off."""
    rng = np.random.default_rng(5)
    lengths = [7, 9, 8]
    s = sum(lengths)
    samples = [rng.integers(3, 300, n) for n in lengths]
    packed = np.concatenate(samples)[None]
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])[None]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    alone = np.stack([np.concatenate([x, rng.integers(3, 300, s - len(x))]) for x in samples])
    i32 = lambda x: ms.Tensor(x.astype(np.int32))  # noqa: E731
    got = hybrid_model(i32(packed), segments=i32(segments), positions=i32(positions)).asnumpy()[0]
    want = hybrid_model(i32(alone)).asnumpy()
    starts = np.cumsum([0] + lengths)
    for i, n in enumerate(lengths):
        ref = want[i, :n]
        err = np.abs(got[starts[i]:starts[i] + n] - ref).max() / np.abs(ref).max()
        assert err <= REORDER_RTOL, f"sample {i}: max_rel {err:.2e}"
    # the resets matter: the same row read as one sample puts the later samples far off
    joined = hybrid_model(i32(packed), segments=i32(np.zeros_like(segments)), positions=i32(positions)).asnumpy()[0]
    assert np.abs(joined[starts[1]:] - got[starts[1]:]).max() > 100 * REORDER_RTOL * np.abs(got).max()


def test_the_cpu_kernel_rule_trains_as_the_graph_form():
    """A hybrid model's loss gradients (one Gated DeltaNet layer of HYBRID's shape, then gated attention) with
    msllm.kernels.GatedDeltaRule, FusedCausalConv and FusedSwiGLU (C++, hand-written backwards) equal those with
    the chunked graph form, the shifted taps and the SwiGLU ops (autodiff): a row of three packed samples (7, 9,
    8 tokens: resets inside a chunk of 8 and on one) beside a row of one sample, every parameter's gradient
    within REORDER_RTOL of its scale (A_log, dt_bias and the conv, whose gradients only the kernels' backwards
    carry, included)."""
    from mindspore import ops

    from msllm import kernels
    device.setup("cpu", "graph")
    model = build_model(replace(HYBRID, num_layers=2, layer_types=["linear", "full"]), seed=4)
    rng = np.random.default_rng(11)
    for name, p in model.parameters_and_names():  # decays as Qwen3.5's range (the init's A_log 0 is one rate)
        if name.endswith("A_log"):
            p.set_data(ms.Tensor(np.log(rng.uniform(0.5, 2.0, p.shape)), ms.float32))
    s = 24
    i32 = lambda x: ms.Tensor(np.asarray(x, np.int32))  # noqa: E731
    tokens = i32(rng.integers(3, 300, (2, s)))
    segments = i32([[0] * 7 + [1] * 9 + [2] * 8, [0] * s])
    positions = i32([list(range(7)) + list(range(9)) + list(range(8)), list(range(s))])
    probe = ms.Tensor(rng.normal(size=(2, s, HYBRID.vocab_size)).astype(np.float32))
    params = model.trainable_params()
    mixer = model.layers[0].attention

    def loss(tokens_):
        return (model(tokens_, segments=segments, positions=positions) * probe).sum()

    grads = []
    graph_form = ChunkedGatedDeltaRule(CHUNK, mixer.value_heads_per_key), ShiftedTaps, SwiGLU()
    fused = kernels.GatedDeltaRule(CHUNK), kernels.FusedCausalConv, kernels.FusedSwiGLU()
    for rule, conv_core, gate in (graph_form, fused):
        mixer.rule, mixer.gate = rule, gate
        for conv in (mixer.conv_q, mixer.conv_k, mixer.conv_v):
            conv.core = conv_core()
        grads.append(ms.jit(ops.value_and_grad(loss, None, params))(tokens)[1])
    assert {"layers.0.attention.A_log", "layers.0.attention.conv_v.weight"} <= {p.name for p in params}
    for p, want, got in zip(params, *grads):
        want, got = want.asnumpy(), got.asnumpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= REORDER_RTOL, f"{p.name}: max_rel {err:.2e}"


def test_the_decode_step_kernel_is_the_graph_forms_recurrence_written_in_place():
    """A Gated DeltaNet layer's one-token decode step, its caches Parameters written in place: the CPU's one
    kernel (msllm.kernels.GatedDeltaStep: the conv window's shift, the convs and SiLU, q's and k's norms, the
    decay and beta, the state update and read-out) against the portable graph form (the shifted taps, the
    chunked rule, assigns), from the same state and window, two rows of different ones: the layer's output, the
    state and the window it leaves are within REORDER_RTOL of their scale. Value heads of 40 columns (a block of
    32 and a part block) serving 2 key heads; the state moves by far more than the tolerance."""
    from msllm import kernels
    from msllm.models.mixers.gated_deltanet import GatedDeltaNet

    device.setup("cpu", "pynative")
    cfg = replace(HYBRID, linear_value_head_dim=40)
    mixer = GatedDeltaNet(cfg)
    rng = np.random.default_rng(12)
    for name, p in mixer.parameters_and_names():
        value = np.log(rng.uniform(0.5, 2.0, p.shape)) if name.endswith("A_log") else rng.normal(0, 0.3, p.shape)
        p.set_data(ms.Tensor(value, ms.float32))
    x = ms.Tensor(rng.normal(size=(2, cfg.hidden_size)), ms.float32)
    one = ms.Tensor(np.zeros((1, cfg.head_dim), np.float32))  # a table of one token: s = 1
    real = ms.Tensor(np.ones((2, 1), np.bool_))
    write = (ms.Tensor(np.zeros((2, 1, 1, 3), np.int32)), ms.Tensor(np.array([9], np.int32)))  # the in-place form
    state = rng.normal(size=(2, 4, cfg.linear_key_head_dim, 40)).astype(np.float32)
    window = rng.normal(size=(2, cfg.linear_conv_kernel - 1, 2 * 2 * 16 + 4 * 40)).astype(np.float32)
    got = []
    for step in (None, kernels.GatedDeltaStep()):
        mixer.decode_step = step
        caches = [ms.Parameter(ms.Tensor(c.copy()), name=f"cache{i}", requires_grad=False)
                  for i, c in enumerate((state, window))]
        out = mixer(x, one, one, real, *caches, write)[0]
        got.append([out.asnumpy(), caches[0].asnumpy(), caches[1].asnumpy()])
    for name, want, mine in zip(("out", "state", "window"), *got):
        err = np.abs(mine - want).max() / np.abs(want).max()
        assert err <= REORDER_RTOL, f"{name}: max_rel {err:.2e}"
    assert np.abs(got[1][1] - state).max() > 100 * REORDER_RTOL * np.abs(state).max()
    device.setup("cpu", "graph")


def test_qwen3_5_config_reads_the_hybrid_spec():
    m = to_model_config(build("qwen3_5").config.to_dict(), "config.json")
    assert m.layer_kinds() == ["linear", "linear", "linear", "full"] and m.mixer_kinds()[0] == "gated_deltanet"
    assert (m.rope_fraction, m.rope_dim, m.norm_offset, m.attn_output_gate) == (0.25, 4, 1.0, True)
    assert (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
            m.linear_conv_kernel) == (2, 4, 16, 8, 4)


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_config_written_from_the_model_alone_reads_back_and_transformers_builds_it(case):
    """config.json written without the source's (an msllm-trained model): msllm reads the same model back,
    and transformers' config class builds the same layer types, sizes, experts and rotary fraction."""
    model = build(case)
    hf = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    m = to_model_config(hf, "config.json")
    ours = to_hf_config(m, type(model).__name__, "float32")
    assert to_model_config(ours, "ours") == m
    theirs = type(model.config)(**{k: v for k, v in ours.items() if k not in ("architectures", "torch_dtype")})
    for key in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "num_key_value_heads", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers", "intermediate_size"):
        assert getattr(theirs, key, None) == hf.get(key), key
    assert theirs.rope_parameters["partial_rotary_factor"] == 0.25


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_hybrids_are_refused_in_one_line_and_write_nothing(tmp_path):
    hf = build("qwen3_5")
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value, why in (("linear_num_value_heads", 3, "must be a multiple of linear_num_key_heads"),
                            ("linear_conv_kernel_dim", 0, "must be a positive integer"),
                            ("linear_num_key_heads", None, "must be a positive integer")):
        with pytest.raises(InteropError) as e:
            to_model_config({**config, key: value}, "config.json")
        assert f"{key}: " in one_line(e) and why in str(e.value)
    # multi-token-prediction tensors are refused, never silently cut
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**weights, "mtp.fc.weight": torch.zeros(64, 128)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    assert "mtp.fc.weight" in one_line(e) and not (tmp_path / "ms").exists()
    # a misshaped linear-attention tensor
    weights["model.layers.1.linear_attn.A_log"] = torch.zeros(5)
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    assert "model.layers.1.linear_attn.A_log" in one_line(e) and not (tmp_path / "ms").exists()
    # no MindFormers layout (none in 1.9)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "mf", to="mindformers", progress=False)
    assert "msllm has no mindformers layout for Qwen3_5ForCausalLM" in one_line(e) and not (tmp_path / "mf").exists()


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    """case -> a tiny random hybrid of tests/hf_models.py converted to an msllm checkpoint; two prompts of 12
    and 7 tokens (one batch, left-padded to 16 unalike: the padding must change no recurrent state or conv
    window) and transformers' 16 greedy tokens after each. Made once per case."""
    made = {}

    def get(case: str):
        if case not in made:
            root = tmp_path_factory.mktemp(case)
            model = build(case)
            model.save_pretrained(root / "hf")
            convert(root / "hf", root / "ms", progress=False)
            rng = np.random.default_rng(7)
            prompts = [rng.integers(3, 300, n).tolist() for n in (12, 7)]
            made[case] = root / "ms", prompts, [hf_greedy(model, p, 16) for p in prompts]
        return made[case]

    return get


# Qwen3.5-MoE and Qwen3-Next by hand (MSLLM_BY_HAND=1; passed 2026-11-27, 125 s and 133 s on a loaded 2-core
# machine, mostly the graphs' compile; PyNative took longer): beyond CI's budget
@pytest.mark.parametrize("case", ["qwen3_5", pytest.param("qwen3_5_moe", marks=BY_HAND), pytest.param("qwen3_next", marks=BY_HAND)])
def test_msllm_engine_decodes_with_recurrent_state_what_transformers_generates(hybrid_runs, case):
    """Two prompts of 12 and 7 tokens in one batch, 16 greedy tokens each on the msllm engine (CPU backend's
    decode kernels, GRAPH_MODE): the chunked prefill hands its state and conv window to one-token recurrent
    steps, and the tokens are transformers' greedy ones. Qwen3.5-MoE: every MLP routed, with a gated shared
    expert; Qwen3-Next: its fused in_proj_qkvz / in_proj_ba and a dense layer among the MoE ones."""
    run, prompts, want = hybrid_runs(case)
    device.setup("cpu", "graph")
    cfg, ours, _, _ = load_model(run)
    specialise(ours, cfg, training=False)
    # the gated attention layers' keys and values go in by the fused cache write, their partial RoPE by the fused
    # rope; a Gated DeltaNet layer's decode step is the one kernel
    attention = [cell for _, cell in ours.cells_and_names() if hasattr(cell, "cache_write")]
    assert attention and all(isinstance(cell.cache_write, kernels.FusedCacheWrite)
                             and isinstance(cell.rope, kernels.FusedRope) for cell in attention)
    assert all(isinstance(cell.decode_step, kernels.GatedDeltaStep) for _, cell in ours.cells_and_names()
               if hasattr(cell, "decode_step"))
    assert generate(cell_engine(ours), prompts, 16).ids == want


# --- fine-tuning a migrated hybrid: LoRA on every projection, the linear layers' included

# lora.targets of every Linear: attention's, the Gated DeltaNet layers' (in_proj_qkv / z / b / a, out_proj), the MLPs'
EVERY_TARGET = ["q", "k", "v", "o", "linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out", "gate", "up", "down"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus):
    """msllm train --init-from a Qwen3.5 HF dir on packed SFT rows, LoRA rank 4 on every projection, 4 steps."""
    from msllm.cli import main
    from tests.hf_models import save_tokenizer

    root = tmp_path_factory.mktemp("hybrid_lora")
    build("qwen3_5").save_pretrained(root / "hf")
    save_tokenizer(root / "hf", [f.read_text() for f in sorted(corpus.glob("*.py"))[:3]])
    rows = [{"prompt": f"def f{i % 7}(x):", "response": f" return x + {i % 5}"} for i in range(32)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {"data.path": root / "sft.jsonl", "data.seq_len": 32, "train.run_dir": root / "run", "train.steps": 4,
              "train.batch_size": 2, "train.eval_every": 4, "train.ckpt_every": 4, "train.sample_tokens": 0,
              "optim.lr": 1e-2, "optim.warmup_steps": 0, "lora.rank": 4, "lora.targets": f"[{', '.join(EVERY_TARGET)}]"}
    args = ["train", "--init-from", root / "hf"] + [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    assert main([str(a) for a in args]) == 0
    return root


def test_lora_on_linear_attention_merges_and_exports_to_peft(lora_run, tmp_path):
    """The adapted run merged and converted back to HF computes in transformers what msllm's merged model does;
    its adapter exported un-merged is one PEFT loads on the original model with the same logits: in_proj_qkv
    (msllm's wq, wk, wv: three adapters) and q_proj (each head's query wq, adapted, then its gate wg) as one
    adapter each, of rank 3 r and 2 r, B block-diagonal in the stored row order. train.lora_from reads it back
    bit for bit."""
    from peft import PeftModel
    from safetensors.numpy import load_file as load_arrays
    from transformers import AutoModelForCausalLM

    from interop.pretrained import InitFrom, describe, export_peft, merge
    from msllm.checkpoint import latest, load_run
    from msllm.config_file import load_config
    from msllm.lora import adapter_params, apply_lora
    from msllm.models.decoder import Decoder

    trained = load_arrays(str(latest(lora_run / "run") / "model.safetensors"))
    for name in ("layers.0.attention.wq", "layers.1.attention.wz", "layers.2.attention.wa", "layers.0.attention.wo",
                 "layers.3.attention.wq", "layers.3.attention.wo"):  # linear layers 0-2, attention layer 3
        assert np.abs(trained[f"{name}.lora_b"]).max() > 0, name  # trained, so the comparisons below can fail
    assert "layers.3.attention.wz.lora_a" not in trained and "layers.0.attention.wg.lora_a" not in trained

    merged = merge(lora_run / "run", tmp_path / "merged")
    convert(merged, tmp_path / "back", to="hf", progress=False)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 300, (2, 20)))
    device.setup("cpu", "pynative")
    _, model, _, _ = load_run(merged)
    ours = model(ms.Tensor(ids.numpy(), ms.int32)).asnumpy()
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # noqa: E731
    with torch.no_grad():
        theirs, before = (load(path)(ids).logits.numpy() for path in (tmp_path / "back", lora_run / "hf"))
        export_peft(lora_run / "run", tmp_path / "peft")
        peft_logits = PeftModel.from_pretrained(load(lora_run / "hf"), tmp_path / "peft").eval()(ids).logits.numpy()
    scale = np.abs(theirs).max()
    assert np.abs(before - ours).max() > 1e-2 * scale  # training moved the model
    for got in (theirs, peft_logits):
        err = np.abs(got - ours).max() / scale
        assert err <= 1e-5, f"max_rel {err:.2e}"
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                             "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"}
    assert config["rank_pattern"] == {"q_proj": 8, "in_proj_qkv": 12}

    cfg = load_config(None, [f"train.init_from={lora_run / 'hf'}", f"train.lora_from={tmp_path / 'peft'}",
                             "data.seq_len=32"], pretrained=describe)
    assert cfg.lora.targets == EVERY_TARGET
    continued = Decoder(cfg.model)
    init = InitFrom(cfg)
    init.load_base(continued.trainable_params())
    apply_lora(continued, cfg.lora, seed=7)
    init.load_adapter(adapter_params(continued))
    assert {p.name for p in adapter_params(continued)} == set(trained)
    assert all(np.array_equal(p.asnumpy(), trained[p.name]) for p in adapter_params(continued))


# --- a fresh hybrid

FRESH_HYBRID = {"model.layer_types": "[linear, full]", "model.num_layers": 2, "model.head_dim": 16,
                "model.qk_norm": "true", "model.norm_offset": 1.0, "model.attn_output_gate": "true",
                "model.rope_fraction": 0.25, "model.linear_num_key_heads": 2, "model.linear_num_value_heads": 4,
                "model.linear_key_head_dim": 16, "model.linear_value_head_dim": 8}


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory, corpus):
    """msllm train from scratch on FRESH_HYBRID (tests/conftest.py's tiny run: 6 steps of 4 rows, checkpoints
    at steps 3 and 6): the run dir."""
    from msllm.cli import main

    run = tmp_path_factory.mktemp("fresh_hybrid") / "run"
    assert main(["train", *[a for kv in fresh_overrides(run, corpus) for a in ("--set", kv)]]) == 0
    return run


def fresh_overrides(run, corpus, **extra) -> list[str]:
    from tests.conftest import tiny_overrides

    return tiny_overrides(run, corpus, **FRESH_HYBRID, **{"optim.lr": 1e-2, "optim.warmup_steps": 0,
                                                         "optim.decay": "constant", **extra})


def records(run, *kinds) -> dict:
    """step -> the record of `kinds` logged last for that step (a step re-run after a resume keeps its last)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] in kinds}


def test_a_fresh_hybrid_starts_as_transformers_does_and_learns(tmp_path, fresh_run):
    """init_weights: dt_bias, every (1 + w) norm and the linear layers' output norm hold what a fresh
    transformers Qwen3.5 holds (1, 0 and 1), the decay rates exp(A_log) spread over its U(0.01, 16), the conv
    weights drawn with its std 0.02. msllm train from scratch on that hybrid config: the loss falls."""
    from tests.hf_models import CASES

    cls, hf_config = CASES["qwen3_5"]
    torch.manual_seed(0)
    cls(hf_config).save_pretrained(tmp_path / "hf")  # as transformers initialises it
    convert(tmp_path / "hf", tmp_path / "hf_init", progress=False)
    device.setup("cpu", "pynative")
    _, hf_init, _, _ = load_model(tmp_path / "hf_init")
    theirs = {p.name: p.asnumpy() for p in hf_init.trainable_params()}
    ours = {p.name: p.asnumpy() for p in build_model(HYBRID, seed=0).trainable_params()}
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        if name.endswith(("norm.weight", "dt_bias")):
            assert np.array_equal(value, theirs[name]), name
    for rates in (np.exp(np.concatenate([v[n] for n in v if n.endswith("A_log")])) for v in (ours, theirs)):
        assert 0.01 <= rates.min() and rates.max() <= 16 and rates.max() - rates.min() > 4
    for layer in (0, 2):  # the three convs together: Hugging Face's one conv1d
        for weights in (ours, theirs):
            conv = np.concatenate([weights[f"layers.{layer}.attention.conv_{part}.weight"] for part in "qkv"])
            assert conv.std() == pytest.approx(0.02, rel=0.15)

    loss = {step: r["loss"] for step, r in records(fresh_run, "train", "compile").items()}
    assert loss[1] == pytest.approx(np.log(384), abs=0.3)  # a fresh model guesses evenly
    assert loss[6] < loss[1] - 0.5, loss


def test_a_hybrid_run_resumed_equals_the_uninterrupted_run_bit_for_bit(fresh_run, tmp_path):
    """fresh_run cut back to its step-3 checkpoint (and its log to step 3), then `msllm train --resume` to
    step 6 from what the checkpoint holds (weights, AdamW moments, data position): the losses of steps 4-6,
    the held-out loss and the step-6 weights and optimizer state equal the uninterrupted run's exactly. (Its
    weight check read the attention's settings from layer 0, a Gated DeltaNet layer, and refused every hybrid.)"""
    import shutil

    from safetensors.numpy import load_file as load_arrays

    from msllm.cli import main
    from msllm.config import ConfigError
    from msllm.config_file import load_config
    from msllm.train.compat import check_weights

    run = tmp_path / "resumed"
    shutil.copytree(fresh_run, run)
    shutil.rmtree(run / "checkpoints" / "step_0000006")
    log = run / "metrics.jsonl"
    kept = [line for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= 3]
    log.write_text("".join(line + "\n" for line in kept))
    assert main(["train", "--resume", str(run), "--set", "train.steps=6"]) == 0
    for kinds in (("train", "compile"), ("eval",)):
        key = "val_loss" if kinds == ("eval",) else "loss"
        want, got = records(fresh_run, *kinds), records(run, *kinds)
        assert max(want) == 6 and {s: r[key] for s, r in got.items()} == {s: r[key] for s, r in want.items()}
    for name in ("model.safetensors", "optim.safetensors"):
        a, b = (load_arrays(str(r / "checkpoints" / "step_0000006" / name)) for r in (fresh_run, run))
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a), name
    # resume's weight check reads the attention's settings from the first attention layer (layer 0 is linear)
    m = load_config(run / "config.yaml").model
    weights = run / "checkpoints" / "step_0000006" / "model.safetensors"
    check_weights(m, weights, "resumed")
    with pytest.raises(ConfigError, match=r"holds weights of another model: model.qk_norm True \(config: False\)"):
        check_weights(dataclasses.replace(m, qk_norm=False), weights, "resumed")


# One msrun launch is ~70 s on CI's 2 cores (tests/test_distributed.py's budget): by hand (MSLLM_BY_HAND=1).
@BY_HAND
def test_a_hybrid_on_two_workers_trains_as_on_one(fresh_run, tmp_path, corpus):
    """fresh_run's settings on 2 data-parallel workers of one msrun launch at train.batch_size 2 (the same
    global batch of 4 rows a step): each step's loss and gradient norm, and the held-out loss, are the
    one-worker run's. The first step differs only in summation order (tests.numerics.REORDER_RTOL: two means
    of 2 rows all-reduced instead of one mean of 4); later steps carry that through AdamW at lr 1e-2 (measured
    2026-11-27: losses within 2.9e-7 relative, gradient norms within 2.0e-6, held-out losses 1.4e-7)."""
    from tests.conftest import msllm_under_msrun

    run = tmp_path / "run"
    # eval: each worker takes the first eval_batches batches of its own batch size: 4 of 2 = the 2 of 4 held out
    overrides = fresh_overrides(run, corpus, **{"train.batch_size": 2, "train.threads": 1, "train.eval_batches": 4})
    msllm_under_msrun(tmp_path, [["train", *[a for kv in overrides for a in ("--set", kv)]]])
    want, got = records(fresh_run, "train", "compile"), records(run, "train", "compile")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=REORDER_RTOL)
    for key, steps in (("loss", range(1, 7)), ("grad_norm", range(2, 7))):  # step 1's record: the compile's
        np.testing.assert_allclose([got[s][key] for s in steps], [want[s][key] for s in steps], rtol=1e-4, err_msg=key)
    assert records(run, "eval")[6]["val_loss"] == pytest.approx(records(fresh_run, "eval")[6]["val_loss"], rel=1e-4)


# --- the compiled train step of a hybrid: fused kernels, selective recompute

STEP_HYBRID = dataclasses.replace(HYBRID, num_layers=2, layer_types=["linear", "full"])


def test_a_hybrid_trains_with_selective_recompute_and_the_fused_kernels_as_plainly():
    """train.recompute: selective marks every layer's MLP and the attention layers' cores for recomputation in
    backward (MindSpore's recompute scope on each of their Cells) and no part of a Gated DeltaNet layer's mixer
    (it has no core: kept whole; marking it crashed before). One fp32 step of STEP_HYBRID on
    tests/test_robustness.py's batch of 4 x 32 tokens so recomputed, with msllm.kernels' fused CPU kernels
    (linear, norms, SwiGLU, attention core, AdamW), is the plain step on the portable MindSpore ops up to
    summation order: loss, gradient norm, every applied gradient and the updated weights. (Two compiled steps,
    not four: CI's budget.)"""
    model = build_model(STEP_HYBRID)
    apply_recompute(model, "selective")
    marked = lambda cell: (cell._scope or "").startswith("recompute_")  # noqa: E731
    linear, full = model.layers
    for cell in (linear.feed_forward, full.feed_forward, full.attention.core):
        assert all(marked(c) for _, c in cell.cells_and_names())
    assert not any(marked(c) for _, c in linear.attention.cells_and_names()) and not marked(full.attention.wq)
    plain = train_steps(fused=False, model=STEP_HYBRID)
    assert_same_step(train_steps(recompute="selective", fused=True, model=STEP_HYBRID), plain, REORDER_RTOL)


# --- export

@pytest.mark.parametrize("case, fmt", [("qwen3_5", "onnx"), ("qwen3_5", "mindir"),
                                       pytest.param("qwen3_5_moe", "onnx", marks=BY_HAND),
                                       pytest.param("qwen3_5_moe", "mindir", marks=BY_HAND),
                                       pytest.param("qwen3_next", "onnx", marks=BY_HAND),
                                       pytest.param("qwen3_next", "mindir", marks=BY_HAND)])
def test_exported_hybrid_carries_its_state_and_generates_transformers_greedy(hybrid_runs, tmp_path, case, fmt):
    """msllm export of a hybrid: the recurrent states and conv windows are inputs and outputs of the cached
    graph beside the keys and values; export's own verification (its graphs' logits against msllm's fp32
    model, prefill and 3 decode steps; ONNX's full-sequence graph too) is within the fp32 reordering
    tolerance; the exported graph, loaded by onnxruntime / MindSpore, generates transformers' greedy tokens;
    and the state it hands on is what decoding reads (a zeroed state changes the next logits)."""
    run, prompts, want = hybrid_runs(case)
    out = tmp_path / fmt
    manifest = export(run, fmt, out, log=lambda line: None)
    scale = manifest["tolerance"] / export_mod.TOLERANCE["fp32"]  # max(1, max|logits|) of the verification
    assert max(manifest["max_abs_diff"].values()) <= REORDER_RTOL * scale, manifest["max_abs_diff"]
    linear, conv = 3, 2 * 2 * 16 + 4 * 8
    if fmt == "onnx":
        graph = onnx.load(str(out / "cached.onnx"), load_external_data=False).graph
        shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                  for v in [*graph.input, *graph.output]}
        for way in ("past", "present"):
            assert shapes[f"{way}_states"] == [linear, "batch", 4, 16, 8]
            assert shapes[f"{way}_windows"] == [linear, "batch", 3, conv]
            assert shapes[f"{way}_keys"][0] == 1  # the one attention layer's
        assert "model" in manifest["files"]
    else:  # one graph of one token per call; prefill feeds the prompt through it
        assert manifest["tokens_per_call"] == 1 and "model" not in manifest["files"]
        assert manifest["files"]["prefill"] == manifest["files"]["decode"] == "cached_graph.mindir"
    device.setup("cpu", "pynative")
    engine = export_engine(out, manifest)
    assert generate(engine, prompts, 16).ids == want

    engine.start(prompts, 2)
    saved = [c.asnumpy() if isinstance(c, ms.Tensor) else c.copy() for c in engine.cache]
    token = [5, 6]
    carried = engine.step(token)
    engine.cache, engine.next_slot = [*saved[:2], np.zeros_like(saved[2]), saved[3]], engine.next_slot - 1
    forgotten = engine.step(token)
    assert np.abs(carried - forgotten).max() > 100 * REORDER_RTOL * np.abs(carried).max()
