"""The layout table's maths proven on CPU: sharded forward and backward (tests/sharded_decoder.py)
equal to unsharded, with the softmax core's and FlashAttentionScore's attention layouts, pipeline
stages equal to the whole model, and the oracle's one-rank model equal to msllm's MindSpore Llama.

Both sides of every comparison are fp32 evaluations of the same maths in another summation order,
so losses and gradients are held to tests/numerics.py's decoder_rtol for the model compared (the
reductions along its longest path: 1.6e-4 to 2.5e-4 of each gradient's scale here), never a fixed
1e-5; test_gemma_like_sharded_forward_and_backward_equal_unsharded shows a wrong gradient is
hundreds of times past it."""
import numpy as np
import pytest

from msllm.config import ModelConfig, ParallelConfig
from msllm.layout import table as L
from tests.numerics import decoder_rtol
from tests.sharded_decoder import ShardedLlama, back_units, init_params, loss_and_grads, run_units


def tiny(**kw) -> ModelConfig:
    values = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4, ffn_size=48,
                  max_seq_len=16, qkv_bias=True)
    values.update(kw)
    return ModelConfig(**values)


def batch(m, b=4, s=8, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, m.vocab_size, size=(b, s + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tolerances(m, ids):
    """(loss, gradient) rtol for this model at this batch (tests/numerics.py decoder_rtol)."""
    return decoder_rtol(m, ids.size, ids.shape[1])


def assert_ranks_hold_the_reference(model, ref_grads, sh, rtol):
    """Every rank's gradient of every weight it holds equals the unsharded gradient's slice, to rtol
    of that slice's scale."""
    for coords, grads in zip(model.ranks.coords, model.grads):
        for name, g in grads.items():
            layout, _ = L.param_entry(name)
            want = ref_grads[name][L.shard_slices(ref_grads[name].shape, layout, sh, coords)]
            assert g.shape == want.shape, name
            assert rel(g, want) <= rtol, (name, coords, rel(g, want), rtol)


def reference(params, m, ids, labels):
    loss, model = loss_and_grads(params, m, L.sharding(m, ParallelConfig()), ids, labels)
    return loss, model.grads[0]


@pytest.mark.parametrize("kv, dp, tp, sp, vocab, o_bias", [
    (4, 1, 2, False, 64, False),   # tp 2, kv heads split
    (4, 1, 4, False, 64, True),    # tp 4 = kv heads; wo's bias (gpt-oss) added once after the row reduction
    (2, 1, 4, False, 64, False),   # GQA kv < tp: each KV head held by 2 ranks
    (1, 1, 4, True, 64, False),    # MQA under sequence parallel
    (2, 2, 4, True, 64, True),     # dp x tp, kv < tp, sequence parallel: wo's bias on each rank's tokens
    (4, 2, 2, True, 66, False),    # vocab not divisible by tp: embedding and head replicated (dp fallback)
])
def test_sharded_forward_and_backward_equal_unsharded(kv, dp, tp, sp, vocab, o_bias):
    m = tiny(num_kv_heads=kv, vocab_size=vocab, o_bias=o_bias)
    params = init_params(m, seed=3)
    ids, labels = batch(m)
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(dp=dp, tp=tp, sequence_parallel=sp))
    assert sh.vocab_split == (vocab % tp == 0)
    assert (sh.tp_kv, sh.tp_rep) == ((tp, 1) if kv % tp == 0 else (kv, tp // kv))
    loss, model = loss_and_grads(params, m, sh, ids, labels)
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)
    # the weights really were split: a rank holds 1/tp of q, and of kv unless kv < tp
    q = model.weights[0]["layers.0.attention.wq.weight"]
    k = model.weights[0]["layers.0.attention.wk.weight"]
    assert q.shape[0] == m.num_heads * m.head_size // tp
    assert k.shape[0] == m.head_size * max(kv // tp, 1)


@pytest.mark.parametrize("kv, dp, tp, sp", [
    (8, 1, 2, False),   # MHA
    (4, 1, 4, False),   # GQA, kv = tp: no copies
    (2, 1, 4, False),   # GQA kv < tp: each KV head repeated to its 2 ranks
    (1, 1, 4, True),    # MQA: one KV head, 4 copies, sequence parallel
    (2, 2, 4, True),    # dp x tp, kv < tp, sequence parallel
])
def test_flash_attention_layout_equals_unsharded(kv, dp, tp, sp):
    """Ascend's FlashAttentionScore rows: each rank's q and K/V heads (after repeat_kv) are the ones
    its projections hold, and the primitive's GQA grouping within the rank, forward and backward
    (with the copies' gradients summed), gives every rank the unsharded gradient's slice."""
    m = tiny(num_kv_heads=kv)
    params = init_params(m, seed=6)
    ids, labels = batch(m)
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(dp=dp, tp=tp, sequence_parallel=sp))
    loss, model = loss_and_grads(params, m, sh, ids, labels, flash=True)
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)


@pytest.mark.parametrize("kv, dp, cp, tp, sp, qk_norm", [
    (8, 1, 2, 1, False, False),   # MHA, two chunks
    (4, 1, 4, 2, False, True),    # four chunks, tp 2, q/k norms (Qwen3)
    (2, 2, 2, 4, True, False),    # dp x cp x tp, kv < tp (K/V copies), sequence parallel
    (1, 1, 2, 2, True, False),    # MQA under sequence parallel
])
def test_ring_attention_layout_equals_unsharded(kv, dp, cp, tp, sp, qk_norm):
    """Context parallel on Ascend (FlashAttentionScore's ring attention): each rank's rows are its
    chunk of its replica's sequence through every row-wise op, its q, k and v that chunk (checked
    against the table's ring row), its attention the ring's steps over the other chunks with the
    online-softmax merge, dK / dV shares carried back to the chunk's owner; every rank ends with the
    unsharded gradient's slice and the loss is the whole batch's."""
    m = tiny(num_kv_heads=kv, qk_norm=qk_norm)
    params = init_params(m, seed=8)
    ids, labels = batch(m, b=dp, s=16)   # one sequence per replica
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(dp=dp, cp=cp, tp=tp, sequence_parallel=sp))
    assert L.strategy_problems(m, sh, dp, 16) == []
    loss, model = loss_and_grads(params, m, sh, ids, labels, flash=True)
    assert len(model.ranks.coords) == dp * cp * tp
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)


@pytest.mark.parametrize("pp, micro, tp", [(2, 2, 1), (2, 4, 2), (3, 4, 1)])
def test_pipeline_stages_in_sequence_equal_the_whole_model(pp, micro, tp):
    m = tiny(num_layers=3)
    params = init_params(m, seed=4)
    ids, labels = batch(m, b=4)
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(tp=tp, pp=pp, micro_batches=micro, sequence_parallel=tp > 1))
    unit_cell = {"embed": "tok_embeddings", "block": "layers.{}", "head": "norm"}
    stages = []
    for k in range(pp):  # a stage holds only the weights the table puts on it
        own = {n: p for n, p in params.items() if L.stage_of(n, m.num_layers, pp) == k}
        model = ShardedLlama(own, m, sh, ids.shape[1])
        units = [u for u in model.units()
                 if L.stage_of(unit_cell[u[0]].format(*u[1:]), m.num_layers, pp) == k]
        stages.append((model, units))
    assert [len(u) for _, u in stages] == [c + (k == 0) + (k == pp - 1) for k, c in
                                           enumerate(L.stage_layer_counts(m.num_layers, pp))]
    loss = 0.0
    for mb, (i, t) in enumerate(zip(np.split(ids, micro), np.split(labels, micro))):
        x = None
        for model, units in stages:           # forward: each stage sends its activation on
            x = run_units(model, units, i, t, ids.size, mb, x)
        loss += x
        dx = None
        for model, units in reversed(stages):  # backward: gradients flow back stage by stage
            dx = back_units(model, units, i, mb, dx)
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss)
    for model, _ in stages:
        assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)
    assert sum(len(model.grads[0]) for model, _ in stages) == len(params)


def assert_oracle_is_msllms_model(m: ModelConfig, seed: int):
    """The oracle's one-rank model against msllm's (MindSpore, PyNative) on the same weights: loss and every
    gradient. Returns (the oracle's loss, the weights, ids, labels)."""
    import mindspore as ms
    from mindspore import Tensor
    from msllm.models.decoder import Llama
    from msllm.models.layers import CausalLMLoss

    ms.set_context(mode=ms.PYNATIVE_MODE)
    params = init_params(m, seed=seed)
    ids, labels = batch(m, b=2)
    ours, ref_grads = reference(params, m, ids, labels)
    model = Llama(m)
    for name, p in model.parameters_and_names():
        p.set_data(Tensor(params[name]))
    loss_fn, weights = CausalLMLoss(), model.trainable_params()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(model(x), y), None, weights)
    want, grads = grad_fn(Tensor(ids.astype(np.int32)), Tensor(labels.astype(np.int32)))
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(ours - float(want)) <= loss_tol * float(want)
    assert {p.name for p in weights} == set(ref_grads)
    for p, g in zip(weights, grads):
        assert rel(ref_grads[p.name], g.asnumpy()) <= grad_tol, (p.name, rel(ref_grads[p.name], g.asnumpy()))
    return ours, params, ids, labels


def test_oracle_at_one_rank_is_msllms_llama():
    """The oracle's unsharded model is msllm's: loss and every gradient against MindSpore (PyNative), the
    q / k / v / o biases' included."""
    assert_oracle_is_msllms_model(tiny(num_kv_heads=2, o_bias=True), seed=5)


def gemma_like(**kw) -> ModelConfig:
    """q/k norms, (1 + w) sandwich norms, GeGLU, scaled embeddings and scores, a sliding layer (window 3
    < the 8 tokens) with its own RoPE base, then a full one."""
    values = dict(qkv_bias=False, head_dim=8, qk_norm=True, sandwich_norm=True, norm_offset=1.0, mlp="geglu_tanh",
                  embed_scale=32 ** 0.5, attn_scale=0.3, sliding_window=3, layer_types=["sliding", "full"],
                  rope_local_theta=10000.0, rope_theta=1e6)
    return tiny(**{**values, **kw})


def partial_grads(params, m, ids, labels, n_total):
    """The unsharded gradient of only these rows' share of a loss averaged over n_total tokens."""
    model = ShardedLlama(params, m, L.sharding(m, ParallelConfig()), ids.shape[1])
    run_units(model, model.units(), ids, labels, n_total, "all")
    back_units(model, model.units(), ids, "all")
    return model.grads[0]


def forward_loss(params, m, sh, ids, labels):
    model = ShardedLlama(params, m, sh, ids.shape[1])
    return run_units(model, model.units(), ids, labels, ids.size, "all")


def test_gemma_like_oracle_at_one_rank_is_msllms_llama():
    """The oracle's Gemma-3-like model is msllm's (MindSpore, PyNative): loss and every gradient, the
    q/k and sandwich norms', GeGLU's and the scaled embedding's included. Its window and RoPE bases
    matter: the same weights with only full layers give another loss."""
    m = gemma_like()
    ours, params, ids, labels = assert_oracle_is_msllms_model(m, seed=7)
    full = gemma_like(layer_types=["full", "full"])
    assert abs(forward_loss(params, full, L.sharding(full, ParallelConfig()), ids, labels) - ours) > 1e-3 * ours


@pytest.mark.parametrize("kv, dp, tp, sp", [
    (2, 1, 2, False),   # tp 2: q and k norms on each rank's own heads
    (1, 1, 2, True),    # one KV head held by both ranks (tp_rep 2), sequence parallel sandwich norms
    (2, 2, 2, True),    # dp x tp
])
def test_gemma_like_sharded_forward_and_backward_equal_unsharded(kv, dp, tp, sp):
    """A Gemma-3-like model computed as the layout splits it (the q/k norm rows' heads checked against
    each rank's projection slices inside the oracle) gives the unsplit loss, and every rank the unsplit
    gradient's slice: the q/k norm weights' gradients summed over the ranks' heads, the sandwich
    norms' over the sequence-parallel rows."""
    m = gemma_like(num_kv_heads=kv)
    params = init_params(m, seed=8)
    ids, labels = batch(m)
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(dp=dp, tp=tp, sequence_parallel=sp))
    loss, model = loss_and_grads(params, m, sh, ids, labels)
    loss_tol, grad_tol = tolerances(m, ids)   # 9.9e-5, 2.5e-4
    assert abs(loss - ref_loss) <= loss_tol * ref_loss
    # Measured: <= 6.6e-6 on an AVX2 EPYC, 1.075e-5 (k_norm) on an AVX-512 one: the bound is ~23x above.
    assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)
    # ... and far below what wrong sharded maths gives: a replica's (half the batch's) or a quarter
    # of the batch's share dropped from the sum, as a missing dp all-reduce or a lost shard would,
    # moves every weight's gradient by >= 0.2 of its scale (800x the bound; a single token's share,
    # 1/32 of the batch, would still be ~100x). So the bound cannot hide a dropped contribution.
    for keep in (slice(0, 2), slice(1, 4)):
        wrong = partial_grads(params, m, ids[keep], labels[keep], ids.size)
        for name in ref_grads:
            assert rel(wrong[name], ref_grads[name]) > 100 * grad_tol, (name, keep)


def test_moe_dispatch_groups_are_each_ranks_tokens_cut_to_bound_the_one_hot_masks():
    """GroupedCapacityDispatch's groups: one per data-parallel rank, halved while a half keeps at least
    DISPATCH_GROUP_TOKENS tokens, so a group holds its rank's tokens or 1024..2047 of them."""
    assert L.dispatch_groups(4, 512) == 4
    assert L.dispatch_groups(4, 2048) == 8 and L.dispatch_groups(2, 4096) == 8
    assert L.dispatch_groups(2, 3 * 1024) == 4  # halves of 1536 tokens; quarters (768) would be too small
    for dp, tokens in ((4, 512), (4, 2048), (2, 4096), (8, 65536), (2, 1536)):
        g = L.dispatch_groups(dp, tokens)
        per_group = dp * tokens // g
        assert g % dp == 0 and (per_group == tokens or L.DISPATCH_GROUP_TOKENS <= per_group < 2 * L.DISPATCH_GROUP_TOKENS)


def hybrid(**kw) -> ModelConfig:
    """A Gated DeltaNet layer (2 key heads of 8 serving 4 value heads of 8, conv of 4 taps), then attention."""
    values = dict(qkv_bias=False, layer_types=["linear", "full"], linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4)
    return tiny(**{**values, **kw})


@pytest.mark.parametrize("dp, tp, sp", [
    (1, 2, False),   # a key head (and its two value heads) a rank
    (2, 2, True),    # dp x tp, sequence parallel
])
def test_hybrid_sharded_forward_and_backward_equal_unsharded(dp, tp, sp):
    """A hybrid's Gated DeltaNet layer as the table cuts it over tp: each rank runs the delta rule on the key
    heads its wq / wk slices hold, with those heads' value heads, gates, decays and conv channels (every
    slice checked against the heads of wq's), and gives every rank the unsharded gradient's slice."""
    m = hybrid()
    params = init_params(m, seed=9)
    ids, labels = batch(m)
    ref_loss, ref_grads = reference(params, m, ids, labels)
    sh = L.sharding(m, ParallelConfig(dp=dp, tp=tp, sequence_parallel=sp))
    assert L.strategy_problems(m, sh, ids.shape[0], ids.shape[1]) == []
    loss, model = loss_and_grads(params, m, sh, ids, labels)
    loss_tol, grad_tol = tolerances(m, ids)
    assert abs(loss - ref_loss) <= loss_tol * ref_loss
    assert_ranks_hold_the_reference(model, ref_grads, sh, grad_tol)
    # each rank holds one key head's rows of everything per head: q and k (8 features), its two value heads'
    p, (dk, nv) = "layers.0.attention.", (m.linear_key_head_dim, m.linear_num_value_heads)
    for r, coords in enumerate(model.ranks.coords):
        head = coords["tp_kv"] * sh.tp_rep + coords["tp_rep"]
        w = model.weights[r]
        assert np.array_equal(w[p + "wk.weight"], params[p + "wk.weight"][head * dk:(head + 1) * dk])
        assert np.array_equal(w[p + "conv_v.weight"], params[p + "conv_v.weight"][head * 16:(head + 1) * 16])
        assert np.array_equal(w[p + "A_log"], params[p + "A_log"][head * 2:(head + 1) * 2])
        assert w[p + "wo.weight"].shape == (m.hidden_size, nv // tp * m.linear_value_head_dim)


def test_hybrid_oracle_at_one_rank_is_msllms_model():
    """The oracle's Gated DeltaNet layer (token by token, torch) is msllm's (chunked, MindSpore PyNative):
    loss and every gradient, the convs', decays' and gated norm's included."""
    assert_oracle_is_msllms_model(hybrid(), seed=10)
