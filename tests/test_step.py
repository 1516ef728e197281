"""The compiled train step: GRAPH == PYNATIVE, and both == torch AdamW + clipping on the same model.

Every test runs twice: with the portable MindSpore-op optimizer and with the fused C++ kernels.
"""
import mindspore as ms
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from msllm import backends, device
from msllm.config import ModelConfig, OptimConfig
from msllm.models.llama import build_model
from msllm.train.build import build_train_step
from msllm.train.optim import lr_at
from tests.conftest import step_config
from tests.test_model import msllm_name

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64)
OPT = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, decay="cosine", weight_decay=0.1, grad_clip=0.5)
STEPS = 3
TOTAL = 5


def batches():
    """The same batch each step, so the loss must fall."""
    batch = np.random.default_rng(7).integers(0, CFG.vocab_size, (4, 33)).astype(np.int32)
    return [batch] * STEPS


def run_msllm(mode, fused, block_graph=False):
    device.setup("cpu", mode)
    cfg = step_config(CFG, OPT, steps=TOTAL, fused_kernels="auto" if fused else "off",
                      block_graph="shared" if block_graph else "inlined")
    built = build_train_step(cfg, build_model(CFG, seed=3))
    assert built.spec.fused_kernels == fused
    out = [tuple(float(x.asnumpy()) for x in built.train_step(ms.Tensor(b))) for b in batches()]
    return out, {p.name: p.asnumpy() for p in built.model.trainable_params()}


@pytest.fixture(scope="module", params=[False, True], ids=["portable", "fused"])
def graph_run(request):
    return request.param, run_msllm("graph", request.param)


def test_graph_and_pynative_agree(graph_run):
    fused, (graph, graph_w) = graph_run
    eager, eager_w = run_msllm("pynative", fused)
    np.testing.assert_allclose([g[0] for g in graph], [e[0] for e in eager], rtol=1e-5)  # loss
    np.testing.assert_allclose([g[1] for g in graph], [e[1] for e in eager], rtol=1e-5)  # grad norm
    # Adam divides by sqrt(v): for near-zero gradients an ulp of difference moves a weight by
    # up to ~lr * 1e-3, hence the weight tolerance is absolute 1e-5 at lr 1e-2 while losses agree to 1e-5.
    for name in graph_w:
        np.testing.assert_allclose(graph_w[name], eager_w[name], atol=1e-5, err_msg=name)
    assert graph[-1][0] < graph[0][0]


def test_block_graph_computes_the_same_step(graph_run):
    """Every layer calling one compiled block graph gives the same losses, norms and weights as
    the block inlined per layer: the same kernels run on the same data."""
    fused, (inlined, inlined_w) = graph_run
    shared, shared_w = run_msllm("graph", fused, block_graph=True)
    np.testing.assert_array_equal(shared, inlined)
    for name in inlined_w:
        np.testing.assert_array_equal(shared_w[name], inlined_w[name], err_msg=name)


def test_block_graph_is_shared_for_deep_models_on_cpu():
    def shares(mode, layers, recompute="none", device="cpu"):
        model = ModelConfig(num_layers=layers)
        return backends.shares_block_graph(step_config(model, block_graph=mode, recompute=recompute, device=device))

    assert [shares("auto", n) for n in (2, 8, 16, 32)] == [False, False, True, True]
    assert not shares("auto", 32, recompute="full")  # recompute needs the blocks inlined
    assert not shares("auto", 32, device="ascend")   # other backends keep them inlined under auto
    assert shares("shared", 2) and not shares("inlined", 32)


def test_lr_schedule_in_graph_matches_reference(graph_run):
    _, (graph, _) = graph_run
    np.testing.assert_allclose([g[2] for g in graph], [lr_at(s, OPT, TOTAL) for s in range(1, STEPS + 1)], rtol=1e-6)


def test_matches_torch_adamw_with_clipping(graph_run):
    """Same init, same data: torch AdamW (decoupled decay, none on norms) + clip_grad_norm_ gives the same losses."""
    _, (graph, graph_w) = graph_run
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False))
    init = {p.name: p.asnumpy() for p in build_model(CFG, seed=3).trainable_params()}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.from_numpy(init[msllm_name(name)]))
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=OPT.lr, betas=(OPT.beta1, OPT.beta2), eps=OPT.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_at(i + 1, OPT, TOTAL) / OPT.lr)
    losses, norms = [], []
    for b in batches():
        t = torch.from_numpy(b).long()
        logits = hf(t[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), OPT.grad_clip)))
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    np.testing.assert_allclose([g[0] for g in graph], losses, rtol=2e-5)
    np.testing.assert_allclose([g[1] for g in graph], norms, rtol=1e-4)
    for name, p in hf.named_parameters():
        np.testing.assert_allclose(graph_w[msllm_name(name)], p.detach().numpy(), atol=2e-5, err_msg=name)
