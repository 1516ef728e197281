"""Multi-token prediction (msllm.models.mtp) and DeepSeek-V3's sequence-wise balance loss.

The reference is a DeepSeek-V3 checkpoint with two MTP depths, which transformers neither builds nor saves:
its tiny random model (tests/hf_models.py) plus, per depth, enorm / hnorm / eh_proj / a DeepseekV3DecoderLayer /
shared_head.norm as torch modules, written into the safetensors as layers num_hidden_layers + k with the
copies of the embedding and head the published checkpoints carry. The MTP maths the tests check against is
written here in torch around those modules (DeepSeek-V3 report §2.2): depth k joins the final-normed states of
depth k - 1 with the embedding of the token k ahead, runs its layer causally over the positions that have a
target, norms, and predicts the token k + 1 ahead through the shared head.
"""
import dataclasses
import json

import mindspore as ms
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mindspore import Tensor, ops
from safetensors.torch import load_file, save_file

from interop.convert import convert
from interop.maps import FAMILIES
from interop.maps.moe import to_saved
from interop.table import entries, stored_arrays
from interop.verify import verify
from msllm import device
from msllm.checkpoint import load_model
from msllm.config import DPOConfig, GRPOConfig, ModelConfig
from msllm.params import mtp_shapes
from tests.conftest import step_config
from tests.hf_models import build
from tests.test_families import BY_HAND

ARCH, DEPTHS, WEIGHT = "DeepseekV3ForCausalLM", 2, 0.3


# per family: the decoder layer and RMSNorm classes its MTP depths are built from (transformers' own)
MTP_MODULES = {
    "DeepseekV3ForCausalLM": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3DecoderLayer",
                              "DeepseekV3RMSNorm"),
    "Glm4MoeForCausalLM": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeDecoderLayer", "Glm4MoeRMSNorm"),
}


def torch_depths(hf, depths: int, seed: int = 1) -> list[torch.nn.ModuleDict]:
    """The MTP depths as torch modules beside the HF model: each a MoE layer like the last (index L + k)."""
    import importlib

    module, layer, norm = MTP_MODULES[type(hf).__name__]
    DecoderLayer, RMSNorm = (getattr(importlib.import_module(module), name) for name in (layer, norm))
    cfg, h = hf.config, hf.config.hidden_size
    torch.manual_seed(seed)
    out = []
    for k in range(depths):
        depth = torch.nn.ModuleDict({
            "enorm": RMSNorm(h, cfg.rms_norm_eps), "hnorm": RMSNorm(h, cfg.rms_norm_eps),
            "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
            "layer": DecoderLayer(cfg, cfg.num_hidden_layers + k),
            "shared_head": torch.nn.ModuleDict({"norm": RMSNorm(h, cfg.rms_norm_eps)})})
        with torch.no_grad():  # the experts start uninitialised outside a model's post_init
            for name, p in depth.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
            for name, b in depth.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        out.append(depth.eval())
    return out


def saved_tensors(hf, depths) -> dict:
    """Every tensor as the checkpoint names it: the model's, then each depth's as layer L + k (experts one
    tensor each, as save_pretrained writes them) with its copies of the embedding and head."""
    tensors = dict(hf.state_dict())
    for k, depth in enumerate(depths):
        prefix = f"model.layers.{hf.config.num_hidden_layers + k}."
        for name, t in depth.state_dict().items():
            tensors[prefix + name.removeprefix("layer.")] = t
        tensors[prefix + "embed_tokens.weight"] = hf.model.embed_tokens.weight
        tensors[prefix + "shared_head.head.weight"] = hf.lm_head.weight
    return {name: t.detach().clone().contiguous() for name, t in to_saved(type(hf).__name__, tensors).items()}


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]


def torch_loss(hf, depths, tokens: torch.Tensor, weight: float):
    """(main loss + weight x mean of the depths' losses, the depths' losses), in torch around the HF modules."""
    ids = tokens[:, :-1]
    h = hf.model(ids).last_hidden_state                                        # final-normed
    loss = F.cross_entropy(hf.lm_head(h).flatten(0, 1), tokens[:, 1:].flatten())
    s, losses = ids.shape[1], []
    for k, depth in enumerate(depths, 1):
        n = s - k                                                              # positions with a target
        embedded = hf.model.embed_tokens(tokens[:, k:k + n])
        x = depth["eh_proj"](torch.cat((depth["enorm"](embedded), depth["hnorm"](h[:, :n])), -1))
        positions = torch.arange(n)[None]
        x = depth["layer"](x, attention_mask=causal(n), position_ids=positions,
                           position_embeddings=hf.model.rotary_emb(x, positions))
        h = depth["shared_head"]["norm"](x)
        losses.append(F.cross_entropy(hf.lm_head(h).flatten(0, 1), tokens[:, k + 1:].flatten()))
    return loss + weight * torch.stack(losses).mean(), losses


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A DeepSeek-V3 HF checkpoint with two MTP depths, converted to msllm."""
    root = tmp_path_factory.mktemp("mtp")
    hf = build("deepseek_v3")
    hf.config._attn_implementation = "eager"
    depths = torch_depths(hf, DEPTHS)
    hf.save_pretrained(root / "hf")
    saved = saved_tensors(hf, depths)
    save_file(saved, root / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config.pop("num_mtp_layers", None)
    (root / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": DEPTHS}))
    convert(root / "hf", root / "ms", progress=False)
    return root, hf, depths, saved


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_deepseek_v3_mtp_layers_convert_both_ways_bitwise(checkpoint):
    """HF -> msllm reads both depths (no tensor left aside), -> HF writes the same file bit for bit, embedding and
    head copies included; -> MindFormers names them as Megatron-Core's MTP layers, and back is bitwise."""
    root, _, _, saved = checkpoint
    state = json.loads((root / "ms" / "state.json").read_text())
    assert state["config"]["model"]["mtp_depths"] == DEPTHS
    ours = load_file(root / "ms" / "model.safetensors")
    assert {n.split(".")[1] for n in ours if n.startswith("mtp.")} == {"0", "1"}
    assert ours["mtp.1.layer.feed_forward.experts.w1"].shape == (8, 32, 64)  # the block is MoE, like the last layer
    assert verify(root / "hf", root / "ms").ok  # the main model's logits, with the MTP layers beside it
    convert(root / "ms", root / "back", progress=False)
    assert same_state(load_file(root / "back" / "model.safetensors"), saved)
    assert json.loads((root / "back" / "config.json").read_text())["num_nextn_predict_layers"] == DEPTHS

    convert(root / "ms", root / "mf", to="mindformers", mf_format="safetensors", progress=False)
    mf = load_file(root / "mf" / "model.safetensors")
    mtp = {n for n in mf if n.startswith("mtp.layers.1.")}
    assert {"mtp.layers.1.enorm.weight", "mtp.layers.1.hnorm.weight", "mtp.layers.1.eh_proj.weight",
            "mtp.layers.1.final_layernorm.weight", "mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight",
            "mtp.layers.1.transformer_layer.mlp.experts.weight1"} <= mtp
    assert not any("embed" in n or "head" in n for n in mtp)  # Megatron's MTP shares them without copies
    assert torch.equal(mf["mtp.layers.1.eh_proj.weight"], saved["model.layers.4.eh_proj.weight"])
    convert(root / "mf", root / "ms2", progress=False)
    assert same_state(load_file(root / "ms2" / "model.safetensors"), ours)
    convert(root / "mf" / "model.safetensors", root / "direct", to="hf", progress=False)
    assert same_state(load_file(root / "direct" / "model.safetensors"), saved)


def test_mtp_copies_that_differ_and_checkpoints_without_mtp_layers(checkpoint, tmp_path):
    """An embedding copy that differs from the embedding is refused in one line, nothing written; a config that
    counts MTP layers its weights lack (what transformers saves) reads as a model without them."""
    from interop import InteropError

    root, hf, _, saved = checkpoint
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((root / "hf" / "config.json").read_text())
    save_file({**saved, "model.layers.3.embed_tokens.weight": saved["model.embed_tokens.weight"] + 1},
              tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InteropError) as e:
        convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    assert "\n" not in str(e.value) and "model.layers.3.embed_tokens.weight differs" in str(e.value)
    assert not (tmp_path / "ms").exists()

    hf.save_pretrained(tmp_path / "plain")
    convert(tmp_path / "plain", tmp_path / "plain_ms", progress=False)
    assert json.loads((tmp_path / "plain_ms" / "state.json").read_text())["config"]["model"]["mtp_depths"] == 0


def test_mtp_loss_and_gradients_equal_torch(checkpoint):
    """msllm's train loss with model.mtp_loss_weight 0.3 on the converted checkpoint = the torch computation
    (main loss + 0.3 x the mean of the two depths' losses), each depth's loss as the step reports it, and the
    gradients of the shared embedding and head, both depths' projections, norms and MoE blocks, and a main layer."""
    from msllm.train.step import LossCell

    root, hf, depths, _ = checkpoint
    device.setup("cpu", "pynative")
    cfg, model, _, _ = load_model(root / "ms")
    model.cfg = dataclasses.replace(cfg.model, mtp_loss_weight=WEIGHT)
    tokens = np.random.default_rng(3).integers(0, 300, (2, 13)).astype(np.int32)
    params = model.trainable_params()
    cell = LossCell(model)
    (loss, _, depth_losses), grads = ops.value_and_grad(cell, None, params, has_aux=True)(
        Tensor(tokens), Tensor(1.0, ms.float32))
    ms.set_context(mode=ms.GRAPH_MODE)

    want, want_depths = torch_loss(hf, depths, torch.tensor(tokens, dtype=torch.long), WEIGHT)
    np.testing.assert_allclose(depth_losses.asnumpy(), [x.item() for x in want_depths], rtol=2e-5)
    assert float(loss.asnumpy()) == pytest.approx(want.item(), rel=2e-5)
    assert min(x.item() for x in want_depths) > 4.0  # a random model: each depth's loss ~ ln(300), not 0

    modules = {"": hf, **{f"model.layers.{3 + k}.": depth for k, depth in enumerate(depths)}}
    named = {prefix + name.replace("layer.", "", 1) if prefix else name: p
             for prefix, module in modules.items() for name, p in module.named_parameters()}
    torch.autograd.backward(want, inputs=list(named.values()))
    theirs = to_saved(ARCH, {name: p.grad for name, p in named.items()})
    ours = {p.name: torch.from_numpy(g.asnumpy()) for p, g in zip(params, grads)}
    rows = [e for e in entries(FAMILIES[ARCH].table, model.cfg)
            if e.name in ("tok_embeddings.weight", "output.weight", "layers.2.attention.wkv_b.weight",
                          "mtp.0.eh_proj.weight", "mtp.0.hnorm.weight", "mtp.1.enorm.weight", "mtp.1.norm.weight",
                          "mtp.0.layer.attention.wq_b.weight", "mtp.1.layer.feed_forward.experts.w1",
                          "mtp.1.layer.feed_forward.router.weight", "mtp.0.layer.feed_forward.shared.w2.weight")]
    assert len(rows) == 11
    for name, got in stored_arrays(rows, "hf", ours.get).items():
        if name in theirs:  # the layer's copies of the embedding and head are the shared ones in torch
            scale = theirs[name].abs().max().item()
            assert scale > 0, name
            np.testing.assert_allclose(got.numpy(), theirs[name].numpy(), atol=2e-5 * scale, err_msg=name)


def test_packed_row_mtp_loss_is_its_samples_run_one_by_one(checkpoint):
    """SFT samples packed in one row (msllm.data.sft.pack: prompt tokens unlearnt, segments, positions restarting)
    give the DeepSeek-V3 model with two MTP depths the main and per-depth losses of the same samples each in a
    row of its own (causal from position 0, no segments; the shorter padded after its end, unlearnt): a target
    k + 1 ahead that lies in the next sample counts nowhere, and no depth attends across samples."""
    from msllm.data.sft import pack, positions
    from msllm.train.step import LossCell

    root = checkpoint[0]
    device.setup("cpu", "pynative")
    cfg, model, _, _ = load_model(root / "ms")
    model.cfg = dataclasses.replace(cfg.model, mtp_loss_weight=WEIGHT)
    cell = LossCell(model)
    rng = np.random.default_rng(5)
    samples = [(rng.integers(3, 300, n).tolist(), [0] * p + [1] * (n - p)) for n, p in ((8, 2), (6, 1))]

    def losses(tokens, mask, segments=None):
        """(main loss, depth losses [2]): each a mean over the batch's learnt targets."""
        extra = () if segments is None else (Tensor(segments), Tensor(positions(segments)))
        loss, _, depth = cell(Tensor(tokens), Tensor(1.0, ms.float32), Tensor(mask.astype(np.float32)), *extra)
        depth = depth.asnumpy().astype(np.float64)
        return float(loss.asnumpy()) - WEIGHT * depth.mean(), depth

    tokens, mask, segments = pack(samples, 13, 0)
    assert tokens.shape == (1, 14) and segments.max() == 2  # one row holding both samples
    packed = losses(tokens, mask, segments.astype(np.int32))
    rows, learnt = np.zeros((2, 8), np.int32), np.zeros((2, 7), np.float32)
    for r, (ids, resp) in enumerate(samples):  # the label of input j is token j + 1
        rows[r, :len(ids)], learnt[r, :len(ids) - 1] = ids, resp[1:]
    main, depths = losses(rows, learnt)
    ms.set_context(mode=ms.GRAPH_MODE)
    assert packed[0] == pytest.approx(main, rel=2e-5)
    np.testing.assert_allclose(packed[1], depths, rtol=2e-5)
    assert min(depths) > 4.0  # a random model: each depth's loss ~ ln(300)


def test_glm4_moe_mtp_layer_converts_both_ways_and_trains_as_torch(tmp_path):
    """GLM-4.5 names its MTP layer as DeepSeek-V3 does (layer L, enorm / hnorm / eh_proj / shared_head and the
    copies) around its own decoder layer (GQA with biases, partial RoPE): HF -> msllm -> HF is bitwise and the
    step's loss with model.mtp_loss_weight 0.3 equals the torch computation, depth loss included."""
    from msllm.train.step import LossCell

    hf = build("glm4_moe")
    hf.config._attn_implementation = "eager"
    depths = torch_depths(hf, 1)
    hf.save_pretrained(tmp_path / "hf")
    saved = saved_tensors(hf, depths)
    save_file(saved, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("num_mtp_layers", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    convert(tmp_path / "hf", tmp_path / "ms", progress=False)
    convert(tmp_path / "ms", tmp_path / "back", progress=False)
    assert same_state(load_file(tmp_path / "back" / "model.safetensors"), saved)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    device.setup("cpu", "pynative")
    cfg, model, _, _ = load_model(tmp_path / "ms")
    assert cfg.model.mtp_depths == 1 and cfg.model.rope_fraction == 0.5 and cfg.model.qkv_bias
    model.cfg = dataclasses.replace(cfg.model, mtp_loss_weight=WEIGHT)
    tokens = np.random.default_rng(4).integers(0, hf.config.vocab_size, (2, 13)).astype(np.int32)
    loss, _, depth_losses = LossCell(model)(Tensor(tokens), Tensor(1.0, ms.float32))
    ms.set_context(mode=ms.GRAPH_MODE)
    want, want_depths = torch_loss(hf, depths, torch.tensor(tokens, dtype=torch.long), WEIGHT)
    np.testing.assert_allclose(depth_losses.asnumpy(), [x.item() for x in want_depths], rtol=2e-5)
    assert float(loss.asnumpy()) == pytest.approx(want.item(), rel=2e-5)


def objective_step(objective: str, model_cfg):
    """A step config of `objective` on model_cfg, and a batch of its inputs (two sequences or pairs of 13
    tokens): next-token (auto), DPO with precomputed reference log-probs, GRPO on fixed completions."""
    rng = np.random.default_rng(4)
    cfg = step_config(model_cfg, steps=4, batch_size=2, objective=objective, head_rows="all")
    if objective == "auto":
        return cfg, [rng.integers(0, 64, (2, 13))]
    mask = (rng.random((2, 2, 12)) < 0.6).astype(np.float32)
    if objective == "dpo":
        cfg.dpo = DPOConfig(beta=0.1, precompute_ref=True)
        return cfg, [rng.integers(0, 64, (2, 2, 13)), mask, -np.log(64.0) * mask.sum(-1)]
    cfg.grpo, cfg.train.batch_size = GRPOConfig(max_new_tokens=8, group_size=2, reward=["r.py:f"]), 1
    return cfg, [rng.integers(0, 64, (2, 13)), mask[0], np.array([0.7, -0.7])]


# DPO and GRPO by hand: two compiled steps each (~30 s and ~24 s on a loaded 2-core machine)
@pytest.mark.parametrize("objective", ["auto", pytest.param("dpo", marks=BY_HAND), pytest.param("grpo", marks=BY_HAND)])
def test_mtp_weight_zero_is_the_step_without_mtp(objective):
    """A model carrying two MTP depths with model.mtp_loss_weight 0 takes the very step of the same model without
    them (loss, gradient norm, updated weights bit for bit, no statistics of theirs) and leaves the depths
    untouched (no gradient, no weight decay), under every objective: DPO and GRPO carry the depths of a
    DeepSeek-V3 or GLM-4.5 checkpoint they fine-tune (and refuse a weight > 0, test_what_mtp_and_the_sequence_loss_
    do_not_take_is_refused_in_one_line). (Weight > 0: test_mtp_loss_and_gradients_equal_torch, and the logged
    mtp_loss/1 of test_training_logs_each_depths_loss_and_the_sequence_balance_loss.)"""
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph")
    plain = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                        max_seq_len=16)

    def step(model_cfg, start=None):
        cfg, inputs = objective_step(objective, model_cfg)
        built = build_train_step(cfg)
        for p in built.model.trainable_params():
            if start is not None and p.name in start:
                p.set_data(Tensor(start[p.name]))
        before = {p.name: p.asnumpy().copy() for p in built.model.trainable_params()}
        out = built.train_step(*(Tensor(x.astype(np.int32 if x.dtype.kind == "i" else np.float32)) for x in inputs))
        return built.model, before, out

    base, start, out = step(plain)
    carried, before, out0 = step(dataclasses.replace(plain, mtp_depths=DEPTHS), start)
    assert len(out0) == len(out) and all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(out0, out))
    assert objective != "auto" or len(out0) == 5  # loss, norm, lr, finite, scale: no statistics
    after = {p.name: p.asnumpy() for p in carried.trainable_params()}
    for p in base.trainable_params():
        assert np.array_equal(after[p.name], p.asnumpy()), p.name
    mtp = [name for name in after if name.startswith("mtp.")]
    assert mtp and all(np.array_equal(after[name], before[name]) for name in mtp)


def test_sequence_wise_balance_loss_equals_its_formula_and_gradient():
    """DeepSeek-V3's sequence-wise balance loss on its grouped sigmoid router (8 experts in 2 groups, top 2 from
    the best group, expert bias): MoE's load row 4 = mean over sequences of E/k sum_e f_e P_e, f from the biased
    top-k choices, P the mean normalised scores (numpy), and its router-weight gradient = torch autograd's of the
    same formula; the routing losses add alpha x its sum over the layers."""
    from msllm.models.moe import MoE, RoutingLosses

    device.setup("cpu", "pynative")
    e, k, b, t, h = 8, 2, 3, 8, 16
    cfg = ModelConfig(hidden_size=h, num_experts=e, experts_per_token=k, moe_ffn_size=8, router="sigmoid_grouped",
                      expert_groups=2, topk_groups=1, router_seq_aux_loss_coef=1e-3)
    rng = np.random.default_rng(5)
    moe = MoE(cfg)
    for p in moe.get_parameters():
        p.set_data(Tensor(rng.normal(0, 0.3, p.shape).astype(np.float32)))
    moe.sequence_rows = t
    x = Tensor(rng.normal(size=(b * t, h)).astype(np.float32))
    load = moe(x)[1].asnumpy()
    assert load.shape == (5, e)

    w, bias = moe.router.weight.asnumpy().astype(np.float64), moe.router.expert_bias.asnumpy().astype(np.float64)
    scores = 1 / (1 + np.exp(-x.asnumpy().astype(np.float64) @ w.T))
    biased = (scores + bias).reshape(b * t, 2, e // 2)
    best = np.argmax(np.sort(biased, -1)[..., -2:].sum(-1), -1)               # each token's best group
    allowed = np.where(np.arange(2)[None, :, None] == best[:, None, None], biased, -np.inf).reshape(b * t, e)
    picked = np.zeros((b * t, e))
    np.put_along_axis(picked, np.argsort(-allowed, -1)[:, :k], 1.0, -1)
    f = picked.reshape(b, t, e).mean(1) * e / k
    p = (scores / scores.sum(-1, keepdims=True)).reshape(b, t, e).mean(1)
    want = (f * p).sum(-1).mean()
    assert want > 1.0  # 1 when every sequence is balanced: these are not
    np.testing.assert_allclose(load[4], np.full(e, want), rtol=1e-5)

    grad = ops.grad(lambda x: moe(x)[1][4, 0], None, [moe.router.weight])(x)[0].asnumpy()
    tw = torch.tensor(w, requires_grad=True)
    s = torch.sigmoid(torch.tensor(x.asnumpy(), dtype=torch.float64) @ tw.T)
    ((torch.tensor(f) * (s / s.sum(-1, keepdim=True)).reshape(b, t, e).mean(1)).sum(-1).mean()).backward()
    np.testing.assert_allclose(grad, tw.grad.numpy(), rtol=1e-4, atol=1e-7)

    loads = [Tensor(load), Tensor(load * 2)]
    added = RoutingLosses(cfg).add_to(Tensor(1.0, ms.float32), loads)
    assert float(added.asnumpy()) == pytest.approx(1.0 + 1e-3 * 3 * want, rel=1e-5)
    ms.set_context(mode=ms.GRAPH_MODE)


def test_training_logs_each_depths_loss_and_the_sequence_balance_loss(tmp_path, corpus):
    """msllm train of a MoE model (DeepSeek-V3's router) with one MTP depth at weight 0.3 and the sequence-wise
    balance loss: each train row logs mtp_loss/1 (a next-token-like loss, ~ln(vocab) at the start) and
    seq_aux_loss (~1 per layer at init: 1 is an even load, the scores all ~0.5); val_loss stays the next-token loss; the checkpoint holds
    the depth."""
    from tests.conftest import run_cli, tiny_overrides

    run = tmp_path / "run"
    moe = {"model.num_experts": 4, "model.experts_per_token": 2, "model.moe_ffn_size": 32,
           "model.router": "sigmoid_grouped", "model.expert_groups": 2, "model.mtp_depths": 1,
           "model.mtp_loss_weight": 0.3, "model.router_seq_aux_loss_coef": 0.001, "train.steps": 3,
           "train.eval_every": 3, "train.ckpt_every": 3}
    args = [a for kv in tiny_overrides(run, corpus, **moe) for a in ("--set", kv)]
    done = run_cli("train", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 3] and "  mtp " in done.stdout
    assert all(4.0 < r["mtp_loss/1"] < 7.0 and "mtp_loss/2" not in r for r in train)  # ln 384 = 5.95
    assert all(1.9 < r["seq_aux_loss"] < 2.5 for r in train)  # 2 MoE layers
    val = [r["val_loss"] for r in rows if r["kind"] == "eval"]
    assert len(val) == 1 and 4.0 < val[0] < 7.0
    names = load_file(run / "checkpoints" / "step_0000003" / "model.safetensors").keys()
    assert "mtp.0.eh_proj.weight" in names and "mtp.0.layer.feed_forward.router.expert_bias" in names


def test_carried_depths_are_laid_out_under_tensor_and_pipeline_parallel():
    """With model.mtp_loss_weight 0 the depths are carried under any layout (generated and checked here, not
    executed: Ascend): at tp 2 x pp 2 the checker passes, each depth's block is cut as the last layer is, its
    other tensors are whole, and they all sit on the last stage beside the head (their Cell's pipeline_stage
    set by the Ascend backend), which plan counts."""
    from msllm.backends import ascend
    from msllm.config_file import config_from_dict
    from msllm.layout import plan as P
    from msllm.layout import table as L
    from msllm.layout.check import check_parallel
    from msllm.models.decoder import build_model

    spec = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48,
                max_seq_len=16, mtp_depths=2)
    cfg = config_from_dict({"model": spec, "data": {"seq_len": 8}, "train": {"batch_size": 2, "device": "ascend"},
                            "parallel": {"tp": 2, "pp": 2, "micro_batches": 2}})
    check_parallel(cfg, 4)
    m, sh = cfg.model, L.sharding(cfg.model, cfg.parallel)
    shapes = L.param_shapes(m)
    held = {name: L.shard_shape(shape, L.param_entry(name)[0], sh) for name, shape in shapes.items()}
    carried = [name for name in shapes if name.startswith("mtp.")]
    assert len(carried) == 2 * len(mtp_shapes(m)) and all(L.stage_of(n, 2, 2) == 1 for n in carried)
    for name in carried:
        if ".layer." in name:
            assert held[name] == held["layers.1." + name.split(".layer.", 1)[1]], name
        else:
            assert held[name] == shapes[name], name
    assert held["mtp.1.layer.attention.wq.weight"] == (16, 32)   # its heads over tp, as the layers'
    plain = dataclasses.replace(m, mtp_depths=0)
    assert P.stage_parameters(m, sh)[1] - P.stage_parameters(plain, sh)[1] == sum(
        np.prod(held[n]) for n in carried)
    assert P.stage_parameters(m, sh)[0] == P.stage_parameters(plain, sh)[0]
    model = build_model(m)
    ascend.use_shardable_norms(model)
    ascend.apply_layout(model, cfg)
    assert model.mtp.pipeline_stage == 1 and model.norm.pipeline_stage == 1


TRAINED = ["model.mtp_depths=1", "model.mtp_loss_weight=0.3"]


@pytest.mark.parametrize("sets, key, why", [
    (["model.mtp_loss_weight=0.3"], "model.mtp_loss_weight", "needs model.mtp_depths in [1"),
    ([*TRAINED, "parallel.tp=2"], "parallel.tp", "no tensor-parallel strategy"),
    ([*TRAINED, "parallel.pp=2", "parallel.micro_batches=2"], "parallel.pp", "which the first stage holds"),
    ([*TRAINED, "parallel.cp=2"], "parallel.cp", "lie in the next rank's chunk"),
    (["model.num_experts=4", "model.mtp_depths=1", "parallel.dp=2", "parallel.ep=2"], "parallel.ep",
     "does not split the MTP blocks' experts"),
    ([*TRAINED, "train.objective=dpo"], "train.objective", "MTP's is next-token prediction"),
    ([*TRAINED, "train.objective=grpo", "grpo.reward=[r.py:f]"], "train.objective", "set model.mtp_loss_weight 0"),
    (["model.num_experts=4", "model.router_seq_aux_loss_coef=0.001", "parallel.cp=2"], "parallel.cp",
     "the loss needs it whole")])
def test_what_mtp_and_the_sequence_loss_do_not_take_is_refused_in_one_line(sets, key, why):
    from msllm.config import ConfigError
    from msllm.config_file import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert e.value.key == key and why in str(e.value) and "\n" not in str(e.value)
