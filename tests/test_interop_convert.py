"""HF / .bin / MindFormers <-> msllm conversion: verified numerics, bitwise round trips, loadable outputs."""
import json

import mindspore as ms
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from interop.convert import convert
from interop.verify import verify
from tests.conftest import run_cli
from tests.numerics import REORDER_RTOL
from tests.hf_models import CASES, build, save_bin


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for case in CASES:
        model = build(case)
        model.save_pretrained(root / case)
        out[case] = (model, root / case)
    return out


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", list(CASES))
def test_convert_then_verify_passes(hf_dirs, tmp_path, case):
    _, hf = hf_dirs[case]
    convert(hf, tmp_path / "ms", progress=False)
    report = verify(hf, tmp_path / "ms")
    assert report.ok, "\n".join(report.lines())
    assert report.precision == "fp32" and max(report.max_rel) <= REORDER_RTOL  # same weights, fp32 sums reordered
    state = json.loads((tmp_path / "ms" / "state.json").read_text())
    assert state["hf_architecture"] == CASES[case][0].__name__
    if case == "mistral_window":  # the window is computed, not a cap on the context
        assert state["config"]["model"]["max_seq_len"] == 64 and state["config"]["model"]["sliding_window"] == 8


@pytest.mark.parametrize("case", list(CASES))
def test_hf_msllm_hf_round_trip_is_bitwise_and_loads(hf_dirs, tmp_path, case):
    model, hf = hf_dirs[case]
    convert(hf, tmp_path / "ms", progress=False)
    convert(tmp_path / "ms", tmp_path / "back", progress=False)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert same_state(reloaded.state_dict(), model.state_dict())
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_deepseek_v3_with_yarn_rope_verifies_and_round_trips(tmp_path):
    """YaRN as DeepSeek-V3 uses it: interpolated / extrapolated frequencies, cos and sin times the attention
    factor (mscale / mscale_all_dim), and the scores times mscale_all_dim's scale squared (attn_scale)."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    model = build("deepseek_v3", rope_parameters=yarn)
    assert model.model.rotary_emb.attention_scaling != 1.0
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    report = verify(tmp_path / "hf", tmp_path / "ms")
    assert report.ok and max(report.max_rel) <= REORDER_RTOL, "\n".join(report.lines())
    convert(tmp_path / "ms", tmp_path / "back", progress=False)
    for name, read in (("config.json", lambda f: json.loads(f.read_text())), ("model.safetensors", load_file)):
        back, source = read(tmp_path / "back" / name), read(tmp_path / "hf" / name)
        assert back == source if name == "config.json" else same_state(back, source), name


@pytest.mark.parametrize("mf_format", ["ckpt", "safetensors"])
def test_mindformers_layout_round_trip(hf_dirs, tmp_path, mf_format):
    model, hf = hf_dirs["qwen2_bias_tied"]
    convert(hf, tmp_path / "mf", to="mindformers", mf_format=mf_format, progress=False)
    weights = tmp_path / "mf" / f"model.{mf_format}"
    loaded = ms.load_checkpoint(str(weights), format=mf_format)  # MindSpore itself reads what we wrote
    src = model.state_dict()
    assert "lm_head.weight" not in loaded  # tied: MindFormers shares the embedding
    np.testing.assert_array_equal(loaded["model.layers.1.attention.wk.bias"].asnumpy(),
                                  src["model.layers.1.self_attn.k_proj.bias"].numpy())
    assert verify(hf, tmp_path / "mf").ok
    convert(weights, tmp_path / "back", to="hf", progress=False)  # the weights file alone also works
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert same_state(back, {k: v for k, v in src.items() if k != "lm_head.weight"})


# MindFormers 1.9.0's TrainingQwen3ForCausalLM, built in its own venv (tools/mindformers_peer.py), holds
# these parameters for tests/hf_models.py's qwen3 shapes (hidden 64, 4 heads and 2 KV heads of 32, ffn 96).
MF_QWEN3_LAYER = {"input_layernorm.weight": (64,), "self_attention.linear_qkv.weight": (256, 64),
                  "self_attention.linear_proj.weight": (64, 128), "self_attention.q_layernorm.weight": (32,),
                  "self_attention.k_layernorm.weight": (32,), "pre_mlp_layernorm.weight": (64,),
                  "mlp.linear_fc1.weight": (192, 64), "mlp.linear_fc2.weight": (64, 96)}


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_to_mindformers_mcore_layout_and_back_is_bitwise(tmp_path, tied):
    """HF -> msllm -> MindFormers -> msllm -> HF. MindFormers' mcore Qwen3 joins q, k, v per KV head
    ([q heads of the group, k, v]) and alternates gate / up rows; its logits on this file were checked
    against transformers by tools/mindformers_check.py (MindFormers 1.9.0, MindSpore 2.9.0)."""
    model = build("qwen3", tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    convert(tmp_path / "ms", tmp_path / "mf", to="mindformers", mf_format="safetensors", progress=False)
    mf = load_file(tmp_path / "mf" / "model.safetensors")
    want = {"embedding.word_embeddings.weight": (300, 64), "decoder.final_layernorm.weight": (64,),
            **{f"decoder.layers.{i}.{k}": v for i in range(2) for k, v in MF_QWEN3_LAYER.items()}}
    if not tied:
        want["output_layer.weight"] = (300, 64)
    assert {k: tuple(v.shape) for k, v in mf.items()} == want

    src = model.state_dict()
    a, d = "model.layers.1.self_attn", 32
    q, k, v = (src[f"{a}.{p}_proj.weight"] for p in "qkv")
    group = [q[0:2 * d], k[0:d], v[0:d], q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]]  # KV head 0's, then 1's
    assert torch.equal(mf["decoder.layers.1.self_attention.linear_qkv.weight"], torch.cat(group))
    fc1 = mf["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[0::2], src["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[1::2], src["model.layers.1.mlp.up_proj.weight"])
    assert verify(tmp_path / "hf", tmp_path / "mf").ok

    convert(tmp_path / "mf", tmp_path / "ms2", progress=False)
    assert same_state(load_file(tmp_path / "ms2" / "model.safetensors"), load_file(tmp_path / "ms" / "model.safetensors"))
    convert(tmp_path / "ms2", tmp_path / "back", progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert same_state(reloaded.state_dict(), src)


def test_qwen3_with_sliding_layers_is_refused_for_mindformers_which_ignores_the_window(tmp_path):
    """MindFormers 1.9's Qwen3 marks sliding_window unused: a Qwen3 whose layers slide would attend to every
    position there, so the conversion stops in one line and writes nothing (to hf it goes on)."""
    from interop import InteropError

    build("qwen3", use_sliding_window=True, sliding_window=8,
          layer_types=["full_attention", "sliding_attention"]).save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "mf", to="mindformers", progress=False)
    assert "\n" not in str(e.value) and "1 of its layers attend to a sliding window of 8 positions" in str(e.value)
    assert not (tmp_path / "mf").exists()
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)  # msllm computes the window: fine


# MindFormers 1.9.0's TrainingQwen3MoeForCausalLM, built in its own venv (tools/mindformers_peer.py), holds these
# parameters for tests/hf_models.py's qwen3_moe every layer MoE with expert ffn 24 (hidden 64, 4 heads and 2 KV
# heads of 16, 4 experts), beside a router.fi_accu [4] aux-loss counter that is no weight.
MF_QWEN3_MOE_LAYER = {"input_layernorm.weight": (64,), "self_attention.linear_qkv.weight": (128, 64),
                      "self_attention.linear_proj.weight": (64, 64), "self_attention.q_layernorm.weight": (16,),
                      "self_attention.k_layernorm.weight": (16,), "pre_mlp_layernorm.weight": (64,),
                      "mlp.router.weight": (4, 64), "mlp.experts.weight1": (256, 48), "mlp.experts.weight2": (96, 64)}


def _mindformers_back_is_bitwise(tmp_path, model, saved):
    """tmp_path/mf (from tmp_path/ms) -> msllm -> HF, and -> HF directly, equal bit for bit."""
    convert(tmp_path / "mf", tmp_path / "ms2", progress=False)
    assert same_state(load_file(tmp_path / "ms2" / "model.safetensors"), load_file(tmp_path / "ms" / "model.safetensors"))
    convert(tmp_path / "ms2", tmp_path / "back", progress=False)
    assert same_state(AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict(), model.state_dict())
    convert(tmp_path / "mf" / "model.safetensors", tmp_path / "direct", to="hf", progress=False)
    assert same_state(load_file(tmp_path / "direct" / "model.safetensors"), saved)


def test_qwen3_moe_to_mindformers_grouped_experts_and_back_is_bitwise(tmp_path):
    """HF -> msllm -> MindFormers -> msllm -> HF, and MindFormers -> HF directly. MindFormers' grouped-GEMM
    experts: weight1 holds expert e's [gate; up] transposed in rows e*h.., weight2 its down transposed in
    rows e*f..; its logits on this file were checked against transformers by tools/mindformers_check.py."""
    model = build("qwen3_moe", mlp_only_layers=[], moe_intermediate_size=24)
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    convert(tmp_path / "ms", tmp_path / "mf", to="mindformers", mf_format="safetensors", progress=False)
    mf = load_file(tmp_path / "mf" / "model.safetensors")
    want = {"embedding.word_embeddings.weight": (300, 64), "decoder.final_layernorm.weight": (64,),
            "output_layer.weight": (300, 64),
            **{f"decoder.layers.{i}.{k}": v for i in range(2) for k, v in MF_QWEN3_MOE_LAYER.items()}}
    assert {k: tuple(v.shape) for k, v in mf.items()} == want

    saved, h, f = load_file(tmp_path / "hf" / "model.safetensors"), 64, 24  # one tensor per expert
    experts = "decoder.layers.1.mlp.experts"
    for e in (0, 3):
        hf = f"model.layers.1.mlp.experts.{e}"
        block = mf[f"{experts}.weight1"][e * h:(e + 1) * h]
        assert torch.equal(block[:, :f], saved[f"{hf}.gate_proj.weight"].T)
        assert torch.equal(block[:, f:], saved[f"{hf}.up_proj.weight"].T)
        assert torch.equal(mf[f"{experts}.weight2"][e * f:(e + 1) * f], saved[f"{hf}.down_proj.weight"].T)
    assert torch.equal(mf["decoder.layers.1.mlp.router.weight"], saved["model.layers.1.mlp.gate.weight"])
    assert verify(tmp_path / "hf", tmp_path / "mf").ok

    _mindformers_back_is_bitwise(tmp_path, model, saved)


def test_qwen3_moe_with_dense_layers_is_refused_for_mindformers_which_builds_every_layer_moe(hf_dirs, tmp_path):
    from interop import InteropError

    _, hf = hf_dirs["qwen3_moe"]  # mlp_only_layers [0]
    with pytest.raises(InteropError) as e:
        convert(hf, tmp_path / "mf", to="mindformers", progress=False)
    assert "\n" not in str(e.value) and "1 of its layers are dense MLPs" in str(e.value)
    assert not (tmp_path / "mf").exists()


def test_mindformers_checkpoint_with_a_missing_or_misshaped_expert_tensor_is_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file

    from interop import InteropError

    build("qwen3_moe", mlp_only_layers=[]).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mf", to="mindformers", mf_format="safetensors", progress=False)
    tensors = load_file(tmp_path / "mf" / "model.safetensors")
    del tensors["decoder.layers.1.mlp.experts.weight1"]
    tensors["decoder.layers.0.mlp.experts.weight2"] = tensors["decoder.layers.0.mlp.experts.weight2"][:-1]
    save_file(tensors, tmp_path / "mf" / "model.safetensors")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "mf", tmp_path / "ms", progress=False)
    message = str(e.value)
    assert "\n" not in message and "missing [decoder.layers.1.mlp.experts.weight1]" in message
    assert "wrong shape [decoder.layers.0.mlp.experts.weight2 [127, 64] != [128, 64]]" in message
    assert not (tmp_path / "ms").exists()


# MindFormers 1.9.0's TrainingDeepseekV3ForCausalLM (qk_layernorm, no MTP), built in its own venv, holds these
# parameters for tests/hf_models.py's deepseek_v3 (hidden 64, 4 heads, q_lora_rank 24, kv_lora_rank 16, nope 12,
# rope 8, v 10; layer 0 dense ffn 96, then 8 experts of 32 and one shared), beside the routers' expert_load and
# fi_accu [8] counters, which are no weights.
MF_DEEPSEEK_V3_ATTENTION = {
    "input_layernorm.weight": (64,), "self_attention.linear_qkv.weight": (48, 64),
    "self_attention.q_layernorm.weight": (24,), "self_attention.linear_qb.weight": (80, 24),
    "self_attention.k_layernorm.weight": (16,), "self_attention.linear_kvb.weight": (88, 16),
    "self_attention.linear_proj.weight": (64, 40), "pre_mlp_layernorm.weight": (64,)}
MF_DEEPSEEK_V3_MOE = {"mlp.router.weight": (8, 64), "mlp.router.expert_bias": (8,), "mlp.experts.weight1": (512, 64),
                      "mlp.experts.weight2": (256, 64), "mlp.shared_experts.linear_fc1.weight": (64, 64),
                      "mlp.shared_experts.linear_fc2.weight": (64, 32)}


def test_deepseek_v3_to_mindformers_mla_and_experts_and_back_is_bitwise(tmp_path):
    """HF -> msllm -> MindFormers -> msllm -> HF, and MindFormers -> HF directly. MindFormers' MLA joins
    q_a_proj and kv_a_proj_with_mqa in linear_qkv; its dense and shared linear_fc1 alternate gate and up rows;
    its routed experts are grouped like Qwen3-MoE's; its MTP block and router counters are ignored on read.
    Its logits on this file were checked against transformers by tools/mindformers_check.py."""
    from safetensors.torch import save_file

    model = build("deepseek_v3")
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    convert(tmp_path / "ms", tmp_path / "mf", to="mindformers", mf_format="safetensors", progress=False)
    mf = load_file(tmp_path / "mf" / "model.safetensors")

    def layer(i, rows):
        return {f"decoder.layers.{i}.{k}": v for k, v in rows.items()}

    want = {"embedding.word_embeddings.weight": (300, 64), "decoder.final_layernorm.weight": (64,),
            "output_layer.weight": (300, 64), **{k: v for i in range(3) for k, v in layer(i, MF_DEEPSEEK_V3_ATTENTION).items()},
            **layer(0, {"mlp.linear_fc1.weight": (192, 64), "mlp.linear_fc2.weight": (64, 96)}),
            **layer(1, MF_DEEPSEEK_V3_MOE), **layer(2, MF_DEEPSEEK_V3_MOE)}
    assert {k: tuple(v.shape) for k, v in mf.items()} == want

    saved, h, f = load_file(tmp_path / "hf" / "model.safetensors"), 64, 32
    hf, ours = "model.layers.{}.", "decoder.layers.{}."
    qkv = mf[ours.format(2) + "self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[:24], saved[hf.format(2) + "self_attn.q_a_proj.weight"])
    assert torch.equal(qkv[24:], saved[hf.format(2) + "self_attn.kv_a_proj_with_mqa.weight"])
    assert torch.equal(mf[ours.format(2) + "self_attention.k_layernorm.weight"], saved[hf.format(2) + "self_attn.kv_a_layernorm.weight"])
    dense, shared = mf[ours.format(0) + "mlp.linear_fc1.weight"], mf[ours.format(1) + "mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(dense[0::2], saved[hf.format(0) + "mlp.gate_proj.weight"])
    assert torch.equal(dense[1::2], saved[hf.format(0) + "mlp.up_proj.weight"])
    assert torch.equal(shared[0::2], saved[hf.format(1) + "mlp.shared_experts.gate_proj.weight"])
    assert torch.equal(shared[1::2], saved[hf.format(1) + "mlp.shared_experts.up_proj.weight"])
    assert torch.equal(mf[ours.format(1) + "mlp.router.expert_bias"], saved[hf.format(1) + "mlp.gate.e_score_correction_bias"])
    block = mf[ours.format(1) + "mlp.experts.weight1"][7 * h:8 * h]
    assert torch.equal(block[:, :f], saved[hf.format(1) + "mlp.experts.7.gate_proj.weight"].T)
    assert torch.equal(block[:, f:], saved[hf.format(1) + "mlp.experts.7.up_proj.weight"].T)
    assert torch.equal(mf[ours.format(1) + "mlp.experts.weight2"][7 * f:], saved[hf.format(1) + "mlp.experts.7.down_proj.weight"].T)
    assert verify(tmp_path / "hf", tmp_path / "mf").ok

    # A MindFormers training checkpoint's MTP block and router counters: ignored on read.
    save_file({**mf, "mtp.layers.0.enorm.weight": torch.ones(64), "decoder.layers.1.mlp.router.fi_accu": torch.zeros(8),
               "decoder.layers.1.mlp.router.expert_load": torch.zeros(8)}, tmp_path / "mf" / "model.safetensors")
    _mindformers_back_is_bitwise(tmp_path, model, saved)


@pytest.mark.parametrize("changes, why", [
    ({"tie_word_embeddings": True}, "builds apart (it ignores tie_word_embeddings)"),
    ({"rope_interleave": False}, "rope_interleave is false"),
    ({"num_experts_per_tok": 4}, "num_experts_per_tok // topk_group is 4")])
def test_deepseek_v3_that_mindformers_computes_differently_is_refused_in_one_line(tmp_path, changes, why):
    from interop import InteropError

    build("deepseek_v3", **changes).save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "mf", to="mindformers", progress=False)
    assert "\n" not in str(e.value) and why in str(e.value)
    assert not (tmp_path / "mf").exists()


@pytest.mark.parametrize("case", ["gemma3", "phi3", "mixtral"])
def test_families_without_mindformers_names_are_refused_in_one_line(hf_dirs, tmp_path, case):
    from interop import InteropError

    model, hf = hf_dirs[case]
    with pytest.raises(InteropError) as e:
        convert(hf, tmp_path / "mf", to="mindformers", progress=False)
    message = str(e.value)
    assert "\n" not in message and f"msllm has no mindformers layout for {type(model).__name__}" in message
    assert not (tmp_path / "mf").exists()


def test_sharded_sources_and_outputs(hf_dirs, tmp_path):
    model, _ = hf_dirs["llama3_gqa_rope_scaling"]
    src = model.state_dict()
    model.save_pretrained(tmp_path / "st", max_shard_size="100KB")
    save_bin(model, tmp_path / "bin1")
    save_bin(model, tmp_path / "bin3", shards=3)
    for name in ("st", "bin1", "bin3"):
        convert(tmp_path / name, tmp_path / f"ms_{name}", progress=False)
        assert same_state(load_file(tmp_path / f"ms_{name}" / "model.safetensors"),
                          load_file(tmp_path / "ms_st" / "model.safetensors")), name
    convert(tmp_path / "ms_bin3", tmp_path / "out", max_shard_bytes=100_000, progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and index["weight_map"].keys() == src.keys()
    assert same_state(AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict(), src)


@pytest.mark.parametrize("dtype, want", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_conversion_verifies_at_that_precision(hf_dirs, tmp_path, dtype, want):
    _, hf = hf_dirs["llama3_gqa_rope_scaling"]
    convert(hf, tmp_path / "ms", dtype=dtype, progress=False)
    assert {t.dtype for t in load_file(tmp_path / "ms" / "model.safetensors").values()} == {want}
    report = verify(hf, tmp_path / "ms")
    assert report.ok and report.precision == dtype, "\n".join(report.lines())
    assert max(report.max_rel) > REORDER_RTOL  # beyond fp32 reordering: the rounding is real, and inside the tolerance
    convert(tmp_path / "ms", tmp_path / "hf_keep", progress=False)  # keep: the HF copy is bf16 / fp16 too
    assert verify(tmp_path / "hf_keep", tmp_path / "ms").precision == "fp32"  # identical weights


def test_verify_names_the_first_divergent_layer(hf_dirs, tmp_path):
    model, hf = hf_dirs["llama2_mha"]
    convert(hf, tmp_path / "ms", progress=False)
    path = tmp_path / "ms" / "model.safetensors"
    tensors = load_file(path)
    tensors["layers.1.feed_forward.w2.weight"] *= 1.01
    from safetensors.torch import save_file

    from msllm.staged import write_manifest
    save_file(tensors, path)
    write_manifest(tmp_path / "ms")  # a deliberate edit
    report = verify(hf, tmp_path / "ms")
    assert not report.ok and report.names[report.first_failure] == "layer 1"
    assert "FAIL: first divergence at layer 1" in report.lines()[-1]


def test_cli_convert_verify_and_generate(hf_dirs, tmp_path, capsys):
    from msllm.cli import main
    from msllm.data.tokenizer import train_tokenizer

    _, hf = hf_dirs["llama3_gqa_rope_scaling"]
    with_tok = tmp_path / "hf"
    with_tok.mkdir()
    for f in hf.iterdir():
        (with_tok / f.name).write_bytes(f.read_bytes())
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300).save(str(with_tok / "tokenizer.json"))

    proc = run_cli("convert", str(with_tok), str(tmp_path / "ms"), "--verify")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PASS" in proc.stdout and "layer 1" in proc.stdout and "hf -> msllm" in proc.stdout
    assert main(["generate", "--ckpt", str(tmp_path / "ms"), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def ")

    (tmp_path / "ms" / "tokenizer.json").unlink()
    assert main(["generate", "--ckpt", str(tmp_path / "ms"), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("msllm generate: error: ") and "tokenizer" in err[0]


def test_ckpt_written_by_mindspore_and_sliced_ckpt(hf_dirs, tmp_path, monkeypatch):
    """Our .ckpt reader takes MindSpore's own files (with CRC trailer); MindSpore takes our sliced ones."""
    from interop.formats import ms_ckpt
    model, hf = hf_dirs["llama2_mha"]
    monkeypatch.setattr(ms_ckpt, "SLICE", 4096)  # every tensor above 4 KB is written as several Values
    convert(hf, tmp_path / "mf", to="mindformers", progress=False)
    params = ms.load_checkpoint(str(tmp_path / "mf" / "model.ckpt"))
    resaved = tmp_path / "ms_saved"
    resaved.mkdir()
    (resaved / "model_config.json").write_text((tmp_path / "mf" / "model_config.json").read_text())
    ms.save_checkpoint([{"name": n, "data": p} for n, p in params.items()], str(resaved / "model.ckpt"),
                       crc_check=True)
    convert(resaved, tmp_path / "back", to="hf", progress=False)
    assert same_state(load_file(tmp_path / "back" / "model.safetensors"), model.state_dict())


def test_msllm_trained_run_to_hf(tmp_path):
    """A run dir from msllm train (no HF origin) becomes an HF dir that computes the same logits."""
    from msllm import checkpoint
    from msllm.config import ModelConfig
    from msllm.data.tokenizer import train_tokenizer
    from msllm.models.decoder import build_model

    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                      max_seq_len=32, qkv_bias=True, tie_embeddings=True)
    tokenizer = tmp_path / "run" / "data" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True)
    train_tokenizer(["x = 1\n"] * 10, 300).save(str(tokenizer))
    state = {"config": {"model": vars(cfg), "data": {"seq_len": 16}}, "tokenizer": str(tokenizer)}
    checkpoint.save(tmp_path / "run", 7, build_model(cfg, seed=3).trainable_params(), [], state)
    convert(tmp_path / "run", tmp_path / "hf", progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    report = verify(tmp_path / "hf", tmp_path / "run")
    assert report.ok and max(report.max_rel) <= REORDER_RTOL, "\n".join(report.lines())
