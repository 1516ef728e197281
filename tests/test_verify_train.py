"""msllm verify --train: the compiled train step against HF + torch AdamW, and faults it must name."""
import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from interop import InteropError
from interop import verify_train as vt
from msllm.cli import main
from msllm.train import optim
from tests.hf_models import build
from tests.numerics import REORDER_RTOL

STEPS, SEQ = 2, 16


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    out = {}
    for case in ("llama2_mha", "llama3_gqa_rope_scaling", "qwen2_bias_tied", "mistral_window", "qwen3", "gemma3", "phi3",
                 "qwen3_moe", "mixtral", "deepseek_v3", "smollm3", "olmo3", "gpt_oss", "qwen3_5", "glm4_moe",
                 "qwen3_5_moe", "qwen3_next"):
        build(case).save_pretrained(root / case)
        out[case] = root / case
    return out


# The new families: q/k norms (Qwen3, Gemma 3), sandwich (1 + w) norms, GeGLU and sliding layers
# (Gemma 3, window 8 < SEQ), fused qkv / gate_up storage (Phi-3); Qwen3.5's Gated DeltaNet layers (the
# chunked rule's backward by autodiff) and gated attention with partial RoPE, and with Qwen3.5-MoE's and
# Qwen3-Next's experts beside a gated shared expert (Qwen3-Next: its fused in_proj_qkvz / in_proj_ba).
@pytest.mark.parametrize("case", ["llama3_gqa_rope_scaling", "qwen2_bias_tied", "mistral_window", "qwen3", "gemma3", "phi3",
                                  "qwen3_moe", "mixtral", "deepseek_v3", "olmo3", "gpt_oss", "qwen3_5", "glm4_moe",
                                  # by hand (MSLLM_BY_HAND=1; passed 2026-11-27, 12 s): Llama's step with NoPE tables;
                                  # Qwen3.5-MoE and Qwen3-Next (passed 2026-11-27, 139 s and 79 s on a loaded 2-core machine)
                                  *(pytest.param(case, marks=pytest.mark.skipif(
                                      not os.environ.get("MSLLM_BY_HAND"), reason="by hand: beyond CI's budget"))
                                    for case in ("smollm3", "qwen3_5_moe", "qwen3_next"))])
def test_train_steps_match_torch(hf_dirs, case):
    report = vt.verify_train(hf_dirs[case], steps=STEPS, seq_len=SEQ)
    assert report.ok, "\n".join(report.lines())
    names = {c.name for c in report.checks if c.kind == "grad"}
    tied = json.loads((hf_dirs[case] / "config.json").read_text())["tie_word_embeddings"]
    assert ("output.weight" in names) == (not tied)  # tied: the embedding is the head
    if case in ("qwen3", "gemma3", "olmo3", "glm4_moe"):
        assert "layers.1.attention.k_norm.weight" in names
    if case in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # the linear layers' decay, gate and conv, the attention
        # layer's output gate
        assert {"layers.0.attention.A_log", "layers.0.attention.dt_bias", "layers.2.attention.conv_k.weight",
                "layers.3.attention.wg.weight"} <= names
    if case in ("qwen3_5_moe", "qwen3_next"):  # the shared expert's sigmoid gate
        assert "layers.0.feed_forward.shared_gate.weight" in names
    assert ("layers.1.attention.wk.bias" in names) == (case in ("qwen2_bias_tied", "gpt_oss", "glm4_moe"))
    if case == "glm4_moe":  # a MoE layer's shared expert and routed experts are compared too
        assert {"layers.1.feed_forward.shared.w1.weight", "layers.2.feed_forward.experts.w2"} <= names
    # Real training happened: the weights moved by ~lr and the schedule ran.
    lrs = [c.ours for c in report.checks if c.kind == "lr"]
    assert lrs == pytest.approx([optim.lr_at(s, vt.VERIFY_OPTIM, STEPS) for s in (1, 2)], rel=1e-6)
    assert lrs[0] > lrs[1]
    # Clipping is on (norm > clip) and the two sides agree far inside the gates.
    assert all(c.ours > vt.VERIFY_OPTIM.grad_clip for c in report.checks if c.kind == "grad_norm")
    # (Gated DeltaNet's decay parameters A_log and dt_bias have 4 gradient entries each, sums over every token
    # and head that largely cancel: measured 1.2e-5 of their scale at step 2, within the gate, so held to it.)
    # (GLM-4.5's last layer: its q / k norm weights and k bias are sums over every token and head of a query / key
    # gradient the softmax largely cancels, after q / k norms and three layers: measured up to 2.5e-5 of their
    # scale, run after run, within REORDER_RTOL, the bound of two fp32 evaluations, so held to that.)
    decay = ("attention.A_log", "attention.dt_bias")
    bound = REORDER_RTOL if case == "glm4_moe" else vt.TENSOR_GATE / 10
    assert max(c.rel for c in report.checks if c.kind == "grad" and not c.name.endswith(decay)) < bound
    assert report.worst("loss") < vt.SCALAR_GATE / 10


def test_moe_load_balancing_loss_trains_as_transformers_adds_it(tmp_path):
    """output_router_logits on: transformers adds router_aux_loss_coef times its load-balancing loss
    (over both MoE layers' concatenated tokens) to the loss; msllm's step must match loss, gradients and
    weights with it. With a coefficient of 0.5, leaving the term out puts the loss 15% and the router's
    gradients ~100% off, far beyond the gates."""
    build("mixtral", output_router_logits=True, router_aux_loss_coef=0.5).save_pretrained(tmp_path / "hf")
    report = vt.verify_train(tmp_path / "hf", steps=STEPS, seq_len=SEQ)
    assert report.ok, "\n".join(report.lines())
    assert report.worst("grad") < vt.TENSOR_GATE / 10 and report.worst("loss") < vt.SCALAR_GATE / 10


def shard(folder, tokens, vocab_size=300):
    """A pretokenized shard dir as msllm train writes one."""
    folder.mkdir()
    np.asarray(tokens, np.uint16).tofile(folder / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "index.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": vocab_size, "eos_id": 0,
                                                   "train_tokens": len(tokens), "val_tokens": 10}))
    return folder


def test_token_batches_are_consecutive_windows_of_the_shard(tmp_path):
    tokens = np.arange(1000) % 300
    batches = vt.token_batches(shard(tmp_path / "s", tokens), 300, batch=2, seq=16, steps=3, seed=0)
    assert [b.shape for b in batches] == [(2, 17)] * 3 and batches[0].dtype == np.int32
    assert np.array_equal(batches[1][1], tokens[3 * 16:4 * 16 + 1])  # step 2, row 2: the 4th window
    with pytest.raises(InteropError, match="vocab_size 512 > the model's 300"):
        vt.token_batches(shard(tmp_path / "big", tokens, 512), 300, 2, 16, 3, 0)
    with pytest.raises(InteropError, match="1000 train tokens, --train needs 1601"):
        vt.token_batches(tmp_path / "s", 300, 2, 16, 50, 0)


def test_cli_verify_train_without_ckpt_on_data(hf_dirs, tmp_path, capsys):
    data = shard(tmp_path / "data", np.random.default_rng(1).integers(0, 300, 200))
    assert main(["verify", "--train", "--hf", str(hf_dirs["llama2_mha"]), "--steps", "2", "--seq-len", "16",
                 "--data", str(data)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("msllm verify --train: Hugging Face") and "converted in memory" in out[0]
    assert out[-1].startswith("PASS")
    assert any(line.startswith("layers.1.feed_forward.w2.weight ") for line in out)  # per-parameter rows


def faulty(monkeypatch, fault):
    """Apply `fault` to the msllm model verify_train builds (the torch side is untouched)."""
    load = vt.load_msllm

    def load_with_fault(source):
        model = load(source)
        fault(model)
        return model
    monkeypatch.setattr(vt, "load_msllm", load_with_fault)


def test_mis_scaled_attention_is_named_at_its_layer(hf_dirs, monkeypatch):
    def scale(model):
        # Every layer: the blocks share one compiled graph (lazy_inline), built from layer 0's attributes.
        for layer in model.layers:
            layer.attention.core.scale *= 1.25
    faulty(monkeypatch, scale)
    report = vt.verify_train(hf_dirs["llama2_mha"], steps=1, seq_len=SEQ)
    bad = report.first_failure
    assert (bad.step, bad.kind, bad.name) == (1, "layer", "layer 0"), "\n".join(report.lines())
    assert "FAIL: step 1: forward diverges at layer 0" in report.lines()[-1]


def test_swapped_norm_is_named_at_its_layer(hf_dirs, monkeypatch):
    def swap(model):
        block = model.layers[1]
        a, b = block.attention_norm.weight, block.ffn_norm.weight
        a_value, b_value = a.asnumpy().copy(), b.asnumpy().copy()
        a.set_data(ms.Tensor(b_value))
        b.set_data(ms.Tensor(a_value))
    faulty(monkeypatch, swap)
    report = vt.verify_train(hf_dirs["llama2_mha"], steps=1, seq_len=SEQ)
    bad = report.first_failure
    assert (bad.kind, bad.name) == ("layer", "layer 1"), "\n".join(report.lines())
    layer0 = next(c for c in report.checks if c.name == "layer 0")
    assert layer0.ok and bad.rel > 100 * vt.TENSOR_GATE


def test_wrong_weight_decay_is_named_at_the_parameter(hf_dirs, monkeypatch, capsys):
    monkeypatch.setattr(optim, "decays", lambda name, param: True)  # decays the norms too
    assert main(["verify", "--train", "--hf", str(hf_dirs["llama2_mha"]), "--steps", "1", "--seq-len", "16"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("FAIL: step 1: updated weight layers.0.attention_norm.weight (the optimizer)")
    row = next(line for line in out if line.startswith("layers.0.attention_norm.weight "))
    grad_rel, weight_rel = map(float, row.split()[1:])
    # Forward and gradients still agree; the norm weight moved by lr * wd = 1e-3 of itself.
    assert grad_rel < vt.TENSOR_GATE and weight_rel == pytest.approx(1e-3, rel=0.3)
    assert np.isfinite(weight_rel)


class GateGradientTimes(nn.Cell):
    """SwiGLU whose backward scales the gate's gradient: the forward is right, only w1 (and what lies
    below it) gets a wrong gradient."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor
        self.sigmoid = ops.Sigmoid()

    def construct(self, gate, up):
        return gate * self.sigmoid(gate) * up

    def bprop(self, gate, up, out, dout):
        s = self.sigmoid(gate)
        return dout * up * (s + gate * s * (1 - s)) * self.factor, dout * gate * s


def test_wrong_backward_is_named_at_the_first_parameter_it_reaches(hf_dirs, monkeypatch):
    from msllm import kernels

    monkeypatch.setattr(kernels, "FusedSwiGLU", lambda: GateGradientTimes(1.01))  # what the CPU backend swaps in
    report = vt.verify_train(hf_dirs["llama2_mha"], steps=1, seq_len=SEQ)
    bad = report.first_failure
    # Backward order in layer 1: w3 and w2 are untouched (w2 sees the right activation), w1 is not.
    assert (bad.kind, bad.name) == ("grad", "layers.1.feed_forward.w1.weight"), "\n".join(report.lines())
    grads = {c.name: c for c in report.checks if c.kind == "grad"}
    assert grads["layers.1.feed_forward.w3.weight"].ok and grads["layers.1.feed_forward.w2.weight"].ok
    assert all(c.ok for c in report.checks if c.kind in ("layer", "loss"))
    assert bad.rel == pytest.approx(0.01, rel=0.2)


def test_ckpt_weights_are_given_to_both_sides(hf_dirs, tmp_path):
    """--ckpt: a checkpoint of the same model whose weights differ from the HF dir (as after training)
    is checked as a train step from its own weights."""
    from safetensors.numpy import load_file, save_file

    from interop.convert import convert
    from msllm import checkpoint
    from msllm.staged import write_manifest

    convert(hf_dirs["llama2_mha"], tmp_path / "ms", progress=False)
    weights = tmp_path / "ms" / checkpoint.MODEL_FILE
    tensors = load_file(weights)
    tensors["layers.1.feed_forward.w2.weight"] *= 1.5
    save_file(tensors, weights)
    write_manifest(tmp_path / "ms")
    report = vt.verify_train(hf_dirs["llama2_mha"], tmp_path / "ms", steps=1, seq_len=SEQ)
    assert report.ok, "\n".join(report.lines())
    assert report.source == str(tmp_path / "ms")
