"""MoE dispatch and load statistics: the capacity dispatcher against the dropless reference and numpy,
and the train step's routing metrics."""
import dataclasses
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from msllm import device
from msllm.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from msllm.models.moe import (BlockDispatch, CapacityDispatch, EveryExpert, GroupedCapacityDispatch, MoE,
                              routing_metrics)

N, H, E, K = 24, 16, 4, 2
CFG = ModelConfig(vocab_size=64, hidden_size=H, num_layers=2, num_heads=2, num_kv_heads=2, ffn_size=32,
                  max_seq_len=32, num_experts=E, experts_per_token=K, moe_ffn_size=8, norm_topk_prob=False)


def random_moe(cfg: ModelConfig) -> MoE:
    layer = MoE(cfg)
    rng = np.random.default_rng(0)
    for p in layer.get_parameters():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return layer


@pytest.fixture(scope="module")
def moe():
    device.setup("cpu", "pynative")
    yield random_moe(CFG)
    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.fixture(scope="module")
def biased_moe(moe):
    """gpt-oss's MoE: biases on the router and on each expert's gate, up and down projections."""
    return random_moe(dataclasses.replace(CFG, router_bias=True, experts_bias=True, norm_topk_prob=True,
                                          mlp="swiglu_clamped"))


def run(layer, x, dispatch):
    """(out, load, gradients of sum(out * probe) by x and by every parameter) with `dispatch`."""
    layer.dispatch = dispatch
    probe = Tensor(np.random.default_rng(1).normal(size=(N, H)).astype(np.float32))
    params = layer.trainable_params()
    out, load = layer(x)
    grads = ops.grad(lambda x: ops.sum(layer(x)[0] * probe), 0, params)(x)
    return out.asnumpy(), load.asnumpy(), [grads[0].asnumpy()] + [g.asnumpy() for g in grads[1]]


def test_capacity_of_every_token_computes_what_the_dropless_reference_does(moe):
    x = Tensor(np.random.default_rng(2).normal(size=(N, H)).astype(np.float32))
    dense = run(moe, x, EveryExpert(E))
    roomy = run(moe, x, CapacityDispatch(E, E / K))  # C = N: no expert can overflow
    np.testing.assert_allclose(roomy[0], dense[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(roomy[1], dense[1], rtol=1e-6)
    assert roomy[1][2].sum() == 0
    for got, want in zip(roomy[2], dense[2]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layer, block", [("moe", 4), ("moe", 7), ("moe", 64), ("biased_moe", 7)])
def test_block_dispatch_is_the_dropless_sum_at_the_routed_rows(request, layer, block):
    """BlockDispatch: the choices grouped by expert into blocks (an odd block size; one larger than any
    expert's share) compute what EveryExpert computes, outputs, loads and every gradient, on
    ceil(N k / block) + E blocks instead of E x N rows; with gpt-oss's biases too (each block's expert bias
    added in its grouped matmul, the bias gradients summed from the blocks' rows)."""
    moe = request.getfixturevalue(layer)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    x = Tensor(np.random.default_rng(8).normal(size=(N, H)).astype(np.float32))
    dense = run(moe, x, EveryExpert(E))
    blocked = run(moe, x, BlockDispatch(E, block))
    rows, route = moe.dispatch.dispatch(x, *moe.router(x)[:2])
    assert rows.shape == (-(-N * K // block) + E, block, H)
    ids = route[3].asnumpy()
    assert (np.diff(ids) >= 0).all() and ids.max() < E  # blocks in expert order
    np.testing.assert_allclose(blocked[0], dense[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(blocked[1], dense[1], rtol=1e-6)
    for got, want in zip(blocked[2], dense[2]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_tight_capacity_drops_the_late_choices_and_counts_them(moe):
    factor = 0.5
    x = Tensor(np.random.default_rng(3).normal(size=(N, H)).astype(np.float32))
    out, load, _ = run(moe, x, CapacityDispatch(E, factor))
    # numpy: route, keep each expert's first C choices in token order, run the kept ones
    logits = x.asnumpy() @ moe.router.weight.asnumpy().T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, -1, kind="stable")[:, :K]
    c = math.ceil(factor * N * K / E)
    w1, w2, w3 = (getattr(moe.experts, w).asnumpy() for w in ("w1", "w2", "w3"))
    want, seen, dropped = np.zeros((N, H), np.float32), np.zeros(E, int), np.zeros(E)
    for n in range(N):
        for e in chosen[n]:
            seen[e] += 1
            if seen[e] > c:
                dropped[e] += 1
                continue
            g, u = w1[e] @ x.asnumpy()[n], w3[e] @ x.asnumpy()[n]
            want[n] += probs[n, e] * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    assert dropped.sum() > 0  # the test's routing really overflows some expert
    np.testing.assert_allclose(load[2], dropped / N, rtol=1e-6)
    np.testing.assert_allclose(load[0], np.bincount(chosen.ravel(), minlength=E) / N, rtol=1e-6)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    metrics = routing_metrics(load[None])
    assert metrics["dropped"] == pytest.approx(dropped.sum() / (N * K), abs=1e-6)
    assert metrics["expert_load_max"] == pytest.approx(seen.max() / seen.mean(), abs=1e-4)


def test_the_grouped_one_hot_dispatch_is_the_capacity_dispatch_of_each_group(moe):
    """Ascend's expert-parallel form (GroupedCapacityDispatch): one group is CapacityDispatch, outputs,
    drops and gradients; two groups are CapacityDispatch run on each half of the tokens."""
    factor = 0.5
    x = Tensor(np.random.default_rng(4).normal(size=(N, H)).astype(np.float32))
    whole = run(moe, x, CapacityDispatch(E, factor))
    one = run(moe, x, GroupedCapacityDispatch(E, factor, groups=1))
    assert whole[1][2].sum() > 0  # drops happen, so the capacity bookkeeping is exercised
    np.testing.assert_allclose(one[0], whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one[1], whole[1], rtol=1e-6)
    for got, want in zip(one[2], whole[2]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    two_out, two_load, _ = run(moe, x, GroupedCapacityDispatch(E, factor, groups=2))
    rows = moe.dispatch.dispatch(x, *moe.router(x)[:2])[0]  # each half's capacity rows, per expert
    moe.dispatch = CapacityDispatch(E, factor)
    parts = [moe(x[i * N // 2:(i + 1) * N // 2]) for i in range(2)]
    np.testing.assert_allclose(two_out, np.concatenate([p[0].asnumpy() for p in parts]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two_load[2], sum(p[1].asnumpy()[2] for p in parts) / 2, rtol=1e-6)
    assert rows.shape == (E, 2 * math.ceil(factor * (N // 2) * K / E), H)


def test_the_train_step_reports_loads_and_a_capacity_counts_its_drops():
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph")
    tokens = Tensor(np.random.default_rng(4).integers(0, 64, (2, 17)).astype(np.int32))
    dropped = {}
    for factor in (0.0, 0.5):
        cfg = Config(model=CFG, data=DataConfig(seq_len=16), optim=OptimConfig(warmup_steps=1),
                     train=TrainConfig(batch_size=2, steps=2, moe_capacity_factor=factor))
        out = build_train_step(cfg).train_step(tokens)
        loss, loads = float(out[0].asnumpy()), out[5].asnumpy()
        assert np.isfinite(loss) and loads.shape == (2, 4, E)
        np.testing.assert_allclose(loads[:, 0].sum(-1), K, rtol=1e-6)  # every token's k choices counted
        dropped[factor] = routing_metrics(loads)["dropped"]
    assert dropped[0.0] == 0 and dropped[0.5] > 0


def test_router_z_loss_is_the_mean_squared_log_sum_exp_with_its_gradient(moe):
    """The router z-loss (ST-MoE): MoE's load row 3 is mean(logsumexp(x W^T)^2) over the tokens, and its
    gradient by the router weight is (2 lse softmax / N)^T x, both as numpy computes them."""
    ms.set_context(mode=ms.PYNATIVE_MODE)  # a test before may have left graph mode
    moe.dispatch = EveryExpert(E)
    x = Tensor(np.random.default_rng(5).normal(size=(N, H)).astype(np.float32) * 3)
    logits = x.asnumpy().astype(np.float64) @ moe.router.weight.asnumpy().T.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    load = moe(x)[1].asnumpy()
    np.testing.assert_allclose(load[3], np.full(E, (lse ** 2).mean()), rtol=1e-5)
    grad = ops.grad(lambda x: moe(x)[1][3, 0], None, [moe.router.weight])(x)[0].asnumpy()
    softmax = np.exp(logits - lse[:, None])
    np.testing.assert_allclose(grad, (2 * lse[:, None] * softmax / N).T @ x.asnumpy(), rtol=1e-4, atol=1e-6)


def test_the_train_loss_adds_the_router_z_loss_times_its_coefficient():
    from msllm.train.step import LossCell
    from msllm.models.decoder import Llama

    device.setup("cpu", "pynative")
    tokens = Tensor(np.random.default_rng(6).integers(0, 64, (2, 17)).astype(np.int32))
    net = Llama(dataclasses.replace(CFG, router_z_loss_coef=0.25))
    rng = np.random.default_rng(7)
    for p in net.get_parameters():
        p.set_data(Tensor((rng.normal(0, 0.5, p.shape) + (1.0 if "norm" in p.name else 0.0)).astype(np.float32)))
    with_z, loads = LossCell(net)(tokens, Tensor(1.0, ms.float32))
    net.cfg = CFG  # the same weights, no z-loss
    plain, _ = LossCell(net)(tokens, Tensor(1.0, ms.float32))
    z = loads.asnumpy()[:, 3, 0]
    assert z.min() > 0
    assert float(with_z.asnumpy()) - float(plain.asnumpy()) == pytest.approx(0.25 * z.mean(), rel=1e-4)
    assert routing_metrics(loads.asnumpy())["router_z"] == pytest.approx(z.mean(), rel=1e-6)
    ms.set_context(mode=ms.GRAPH_MODE)


def test_the_bias_update_moves_each_expert_toward_even_load_as_numpy_says():
    """train.moe_bias_update_rate on a DeepSeek-V3 router: after each step every MoE layer's expert bias
    moves by the rate toward even load, the sign of (mean share - expert's share) of that step's routing,
    outside the gradient; at rate 0 the biases never move."""
    from msllm.train.build import build_train_step

    device.setup("cpu", "graph")
    model_cfg = dataclasses.replace(CFG, num_experts=8, router="sigmoid_grouped", expert_groups=2, topk_groups=1,
                                    routed_scaling=2.5, shared_experts=1)
    tokens = Tensor(np.random.default_rng(5).integers(0, 64, (2, 17)).astype(np.int32))
    for rate in (0.0, 0.01):
        cfg = Config(model=model_cfg, data=DataConfig(seq_len=16), optim=OptimConfig(warmup_steps=1),
                     train=TrainConfig(batch_size=2, steps=3, moe_bias_update_rate=rate))
        built = build_train_step(cfg)
        biases = [b.feed_forward.router.expert_bias for b in built.model.layers]
        for _ in range(3):
            before = np.stack([b.asnumpy().copy() for b in biases])
            shares = built.train_step(tokens)[5].asnumpy()[:, 0]                       # [layers, E]
            after = np.stack([b.asnumpy() for b in biases])
            np.testing.assert_allclose(after - before, rate * np.sign(shares.mean(-1, keepdims=True) - shares),
                                       rtol=0, atol=1e-7)
        assert (rate > 0) == bool(np.abs(after).max() > 0)


def test_zero1_cuts_dense_moments_over_the_world_and_experts_over_their_edp_group():
    """msllm.parallel.zero.ShardedAdamW at world 4, ep 2, built for each rank in one process (no
    collective runs): a checkpoint's whole moments, loaded on every rank, are cut into 4 chunks in rank
    order for a dense parameter and into 2 over the edp group (ranks r % 2 and r % 2 + 2) for a rank's
    experts, the last chunk zero-padded; no gather bucket mixes the two."""
    from mindspore import Parameter
    from msllm.parallel.zero import MOMENTS, ShardedAdamW

    dense, expert = "layers.0.attention.wq.weight", "layers.1.feed_forward.experts.w1"
    params = [Parameter(Tensor(np.zeros((7, 3), np.float32)), name=dense),       # 21: chunks of 6, the last 3 + 3 zeros
              Parameter(Tensor(np.zeros((2, 3, 5), np.float32)), name=expert)]  # 30: chunks of 15
    rng = np.random.default_rng(0)
    whole = {"optimizer.step": np.array(3, np.int32),
             **{f"{m}.{p.name}": rng.standard_normal(p.shape).astype(np.float32) for m in MOMENTS for p in params}}
    chunks = []
    for rank in range(4):
        optimizer = ShardedAdamW(params, OptimConfig(), 10, rank=rank, world=4, ep=2, edp_group=f"msllm_edp_{rank % 2}")
        optimizer.load_full_state(whole, "a checkpoint")
        assert all(len({optimizer.expert[i] for i in bucket}) == 1 for bucket in optimizer.buckets)
        chunks.append({m: [c.asnumpy() for c in getattr(optimizer, m)] for m in MOMENTS})
    for m in MOMENTS:
        assert [c[m][0].size for c in chunks] == [6] * 4 and not chunks[3][m][0][3:].any()
        np.testing.assert_array_equal(np.concatenate([c[m][0] for c in chunks])[:21], whole[f"{m}.{dense}"].reshape(-1))
        for group in ((0, 2), (1, 3)):
            np.testing.assert_array_equal(np.concatenate([chunks[r][m][1] for r in group]),
                                          whole[f"{m}.{expert}"].reshape(-1))


# --- expert parallel under msrun: tests/ep_worker.py against the whole batch in one process -------

def test_two_workers_at_ep2_train_as_one_worker_with_every_expert(msrun_workers):
    """10 steps with parallel.ep = 2 (each rank half the batch and half the experts; the all-gather
    dispatcher) against one process with the whole batch and every expert: the same losses and
    gradient norms (the experts' squares summed over the ranks), and the same weights and AdamW
    moments, experts gathered whole, up to summation order; dropless, and at a capacity that drops
    choices with ZeRO-1 (parallel.optimizer_shard), resumed halfway from the one process's state."""
    from tests.ep_worker import HALF

    out = msrun_workers / "ep_worker"  # tests/ep_worker.py: the ranks' results and the one-process runs
    whole, capped = (dict(np.load(out / f"{name}.npz")) for name in ("whole", "capped"))

    def assert_trained_as(rank, one, steps):
        np.testing.assert_allclose(rank["outs"], one["outs"][steps], rtol=2e-5)  # loss, grad norm, lr per step
        for name in (k for k in one if k.startswith("weight/")):
            np.testing.assert_allclose(rank[name], one[name], rtol=0, atol=2e-5, err_msg=name)
        for name in (k for k in one if k.startswith("state/")):  # the moments, as a checkpoint holds them
            np.testing.assert_allclose(rank[name], one[name], rtol=0, atol=2e-5 * np.abs(one[name]).max(), err_msg=name)

    zero, one = (dict(np.load(out / f"rank{r}.npz")) for r in range(2))
    for rank in (zero, one):
        assert_trained_as(rank, whole, slice(None))
    assert whole["outs"][-1, 0] < whole["outs"][0, 0] - 0.1  # it trained
    # each rank held its two of the four experts
    w1 = whole["weight/layers.1.feed_forward.experts.w1"]
    assert zero["held"].shape[0] == one["held"].shape[0] == 2
    np.testing.assert_array_equal(np.concatenate([zero["held"], one["held"]]), zero["weight/layers.1.feed_forward.experts.w1"])
    np.testing.assert_allclose(one["held"], w1[2:], rtol=0, atol=2e-5)
    # at a capacity (AllGatherCapacityDispatch): the group's choices cut as one process cuts the whole batch;
    # with ZeRO-1 (msllm.parallel.zero): dense moments split over the world, the experts' over their edp group
    zero, one = (dict(np.load(out / f"rank{r}_capacity_zero1.npz")) for r in range(2))
    assert capped["loads"][:, 2].sum() > 0  # choices were dropped
    for rank in (zero, one):
        np.testing.assert_allclose(rank["loads"][:, 2], capped["loads"][:, 2], rtol=1e-6)
        assert_trained_as(rank, capped, slice(HALF, None))
    # each rank routed its own tokens: loads differ, and average to the whole batch's
    assert not np.array_equal(zero["loads"], one["loads"])
    np.testing.assert_allclose((zero["loads"][:, 0] + one["loads"][:, 0]) / 2, capped["loads"][:, 0], rtol=1e-5)
    # the edp gather (an AllReduce of placed chunks), here over the world of 2
    np.testing.assert_array_equal(zero["group_all_gather"], [[0, 1, 2], [10, 11, 12]])


def test_plan_splits_the_experts_adam_states_over_the_ranks_holding_them_on_cpu():
    """ZeRO-1 with ep on CPU (msllm.parallel.zero): a device's E / ep experts' Adam states are split
    over the dp / ep ranks holding the same experts, the rest over dp; the CPU layouts the planner
    searches shard the optimizer with ep too."""
    from msllm.config import ParallelConfig
    from msllm.layout import plan as P
    from tests.ep_worker import CFG, SEQ

    cfg = Config(model=CFG, data=DataConfig(seq_len=SEQ), train=TrainConfig(device="cpu", batch_size=1))
    e = P.estimate(P.with_layout(cfg, ParallelConfig(dp=4, ep=2, optimizer_shard=True), global_batch=4), device="cpu")
    experts = 3 * CFG.num_experts * CFG.moe_ffn_size * CFG.hidden_size  # one MoE layer
    updated = (CFG.num_params() - experts) / 4 + experts / 2 / 2          # dense over dp 4; half the experts over 2
    assert e["optimizer"] == pytest.approx(8 * updated)
    assert e["time"]["optimizer"] == pytest.approx(updated * (2 * 4 + 4 + 2 * 8) / P.DEVICES["cpu"].hbm)
    layouts = [c.cfg.parallel for c in P.candidates(cfg, 4, 4, SEQ, P.DEVICES["cpu"], False)]
    assert any(p.ep == 2 and p.optimizer_shard for p in layouts)
