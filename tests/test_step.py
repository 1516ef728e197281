"""The compiled train step: GRAPH == PYNATIVE, and both == torch AdamW + clipping on the same model.

Every test runs twice: with the portable MindSpore-op optimizer and with the fused C++ kernels.
"""
from typing import NamedTuple

import mindspore as ms
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from msllm import device, rules
from msllm.config import ModelConfig, OptimConfig
from msllm.models.decoder import build_model
from msllm.train.build import build_train_step
from msllm.train.optim import lr_at
from tests.conftest import step_config
from tests.numerics import REORDER_RTOL, U32, Recorded, assert_adamw_first_step, assert_close_to_scale, weights
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


class Run(NamedTuple):
    outs: list       # per step: loss, grad norm, lr, finite, loss scale
    grads1: dict     # name -> gradient AdamW applied at step 1 (clipped)
    weights1: dict   # name -> value after step 1
    weights: dict    # name -> value after the last step


def run_msllm(mode, fused, block_graph=False) -> Run:
    device.setup("cpu", mode)
    cfg = step_config(CFG, OPT, steps=TOTAL, fused_kernels="auto" if fused else "off",
                      block_graph="shared" if block_graph else "inlined")
    built = build_train_step(cfg, build_model(CFG, seed=3), wrap_optimizer=Recorded)
    assert built.spec.fused_kernels == fused
    model, optimizer, step = built.model, built.train_step.optimizer, built.train_step
    outs, first = [], None
    for b in batches():
        outs.append(tuple(float(x.asnumpy()) for x in step(ms.Tensor(b))))
        first = first or (optimizer.gradients(), weights(model.trainable_params()))
    return Run(outs, *first, weights(model.trainable_params()))


@pytest.fixture(scope="module", params=[False, True], ids=["portable", "fused"])
def graph_run(request):
    return request.param, run_msllm("graph", request.param)


def assert_same_training(run: Run, ref_outs, ref_grads1, ref_weights1) -> None:
    """Two fp32 implementations of one training run (numerics.REORDER_RTOL: they may differ in
    summation order only). Step 1 starts from the same weights: the gradient AdamW applies must
    agree, and the weights after it as numerics.adamw_step_bound allows (up to 2 lr where a
    gradient is within rounding of 0). Later steps start from weights that differ only there, so
    they are compared through loss and gradient norm, which moving a weight whose gradient is ~0
    changes only to second order."""
    assert_close_to_scale(run.grads1, ref_grads1, REORDER_RTOL)
    assert_adamw_first_step(run.weights1, ref_weights1, run.grads1, ref_grads1, lr_at(1, OPT, TOTAL), OPT.eps)
    np.testing.assert_allclose([o[0] for o in run.outs], [o[0] for o in ref_outs], rtol=REORDER_RTOL)  # loss
    np.testing.assert_allclose([o[1] for o in run.outs], [o[1] for o in ref_outs], rtol=REORDER_RTOL)  # grad norm


def test_graph_and_pynative_agree(graph_run):
    fused, graph = graph_run
    eager = run_msllm("pynative", fused)
    assert_same_training(eager, graph.outs, graph.grads1, graph.weights1)
    assert graph.outs[-1][0] < graph.outs[0][0] - 0.5  # the same batch each step: the loss falls


def test_block_graph_computes_the_same_step(graph_run):
    """Every layer calling one compiled block graph gives the same losses, norms and weights as
    the block inlined per layer: the same kernels run on the same data."""
    fused, inlined = graph_run
    shared = run_msllm("graph", fused, block_graph=True)
    np.testing.assert_array_equal(shared.outs, inlined.outs)
    for name in inlined.weights:
        np.testing.assert_array_equal(shared.weights[name], inlined.weights[name], err_msg=name)


def test_block_graph_is_shared_for_deep_models_on_cpu():
    def shares(mode, layers, recompute="none", device="cpu"):
        model = ModelConfig(num_layers=layers)
        return rules.shares_block_graph(step_config(model, block_graph=mode, recompute=recompute, device=device))

    assert [shares("auto", n) for n in (2, 8, 16, 32)] == [False, False, True, True]
    assert not shares("auto", 32, recompute="full")  # recompute needs the blocks inlined
    assert not shares("auto", 32, device="ascend")   # other backends keep them inlined under auto
    assert shares("shared", 2) and not shares("inlined", 32)


def test_lr_schedule_in_graph_matches_reference(graph_run):
    _, graph = graph_run
    # Warmup 2 of 5 steps to lr 1e-2, then cosine to 1e-3: lr/2, lr, then a third of the way down
    # the cosine, min_lr + (lr - min_lr) (1 + cos(pi/3)) / 2 = 1e-3 + 9e-3 * 0.75.
    want = [5e-3, 1e-2, 7.75e-3]
    assert [lr_at(s, OPT, TOTAL) for s in range(1, STEPS + 1)] == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose([g[2] for g in graph.outs], want, rtol=8 * U32)  # a few fp32 ops in-graph


def test_matches_torch_adamw_with_clipping(graph_run):
    """Same init, same data: torch AdamW (decoupled decay, none on norms) + clip_grad_norm_ takes
    the same steps (compared as in assert_same_training: torch and MindSpore sum in other orders)."""
    _, graph = graph_run
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
    outs, first = [], None
    for b in batches():
        t = torch.from_numpy(b).long()
        logits = hf(t[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), OPT.grad_clip))  # p.grad is now clipped
        grads = {msllm_name(n): p.grad.numpy().copy() for n, p in hf.named_parameters()}
        opt.step()
        sched.step()
        outs.append((float(loss.detach()), norm))
        first = first or (grads, {msllm_name(n): p.detach().numpy().copy() for n, p in hf.named_parameters()})
    assert_same_training(graph, outs, *first)
