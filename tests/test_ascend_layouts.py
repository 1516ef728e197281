"""Golden layouts for the shipped 7B/8B shapes, and msllm.backends.ascend applying the same layouts
through MindSpore's API on CPU-built tiny models (Primitive.shard and pipeline_stage are accepted
and ignored on a stand-alone CPU graph; nothing here executes a parallel step)."""
import fnmatch
import math
import re

import numpy as np
import pytest

from msllm.config_file import config_from_dict, load_config
from msllm.layout import table as L
from msllm.layout.check import check_parallel
from tests.conftest import REPO

A = "layers.*.attention."
C = A + "core.softmax_attention."
F = "layers.*.feed_forward."


def golden(dp, tp, tokens, kv_split, scores):
    """Strategies of every op for a layout with sequence parallel, vocab split, tp_rep = 1."""
    norm = {"square": ((tokens, 1),), "mean": ((tokens, 1),), "add": ((tokens, 1), (1, 1)),
            "rsqrt": ((tokens, 1),), "scale": ((tokens, 1), (tokens, 1)), "weigh": ((tokens, 1), (1,))}
    out = {f"{cell}.{prim}": {"in": s, "out": None} for cell in
           ("layers.*.attention_norm.core", "layers.*.ffn_norm.core", "norm.core") for prim, s in norm.items()}
    column, row = ((dp, 1), (tp, 1)), ((dp, tp), (1, tp))
    heads = (dp, kv_split, 1, 1)
    out.update({
        "tok_embeddings.gather": {"in": ((tp, 1), (dp,)), "out": None},
        A + "wq.matmul": {"in": column, "out": None},
        A + "wk.matmul": {"in": ((dp, 1), (kv_split, 1)), "out": None},
        A + "wv.matmul": {"in": ((dp, 1), (kv_split, 1)), "out": None},
        A + "rope.matmul": {"in": ((tokens, 1), (1, 1)), "out": None},
        C + "qk": {"in": (heads, heads), "out": None},
        C + "pv": {"in": (heads, heads), "out": None},
        C + "pt_x": {"in": (heads, heads), "out": None},
        C + "softmax": {"in": (scores,), "out": None},
        A + "wo.matmul": {"in": row, "out": ((tokens, 1),)},
        F + "w1.matmul": {"in": column, "out": None},
        F + "w3.matmul": {"in": column, "out": None},
        F + "act.sigmoid": {"in": ((dp, tp),), "out": None},
        F + "w2.matmul": {"in": row, "out": ((tokens, 1),)},
        "output.matmul": {"in": column, "out": None},
    })
    return out


# config, devices, layout, global batch, golden strategies, {param: shard shape}, layers per stage
CASES = {
    "llama2_7b@8": ("llama2_7b", 8, dict(dp=2, tp=4), 16,
                    golden(2, 4, 8, 4, (2, 4, 1, 1)),                       # MHA scores [b, h, s, t]
                    {"tok_embeddings.weight": (8000, 4096), "layers.0.attention.wq.weight": (1024, 4096),
                     "layers.0.attention.wk.weight": (1024, 4096), "layers.0.attention.wo.weight": (4096, 1024),
                     "layers.0.feed_forward.w2.weight": (4096, 2752), "norm.weight": (4096,)}, [32]),
    "llama3_8b@64": ("llama3_8b", 64, dict(dp=4, tp=8, pp=2, micro_batches=8), 32,
                     golden(4, 8, 32, 8, (4, 8, 1, 1, 1)),                  # GQA scores [b, kv, rep, s, t]
                     {"tok_embeddings.weight": (16032, 4096), "layers.0.attention.wq.weight": (512, 4096),
                      "layers.0.attention.wk.weight": (128, 4096), "layers.0.feed_forward.w1.weight": (1792, 4096),
                      "output.weight": (16032, 4096)}, [16, 16]),
    "qwen2_7b@16": ("qwen2_7b", 16, dict(dp=2, tp=4, pp=2, micro_batches=4), 8,
                    golden(2, 4, 8, 4, (2, 4, 1, 1, 1)),
                    {"tok_embeddings.weight": (38016, 3584), "layers.0.attention.wq.weight": (896, 3584),
                     "layers.0.attention.wq.bias": (896,), "layers.0.attention.wk.weight": (128, 3584),
                     "layers.0.attention.wk.bias": (128,), "layers.0.feed_forward.w3.weight": (4736, 3584)},
                    [14, 14]),
}

# Tiny CPU models with each case's attention shape (MHA; GQA with kv = tp; GQA with bias).
TINY = {
    "llama2_7b@8": dict(num_heads=8, num_kv_heads=8),
    "llama3_8b@64": dict(num_heads=16, num_kv_heads=8),
    "qwen2_7b@16": dict(num_heads=8, num_kv_heads=4, qkv_bias=True),
}


def case_config(name, path=None, model=None):
    cfg_name, devices, layout, batch, *_ = CASES[name]
    overrides = [f"parallel.{k}={v}" for k, v in layout.items()]
    overrides += ["parallel.sequence_parallel=true", "parallel.optimizer_shard=true", f"train.batch_size={batch}"]
    if model is None:
        return load_config(REPO / "configs" / f"{cfg_name}.yaml", overrides), devices
    data = {"model": model, "data": {"seq_len": 16}, "train": {"batch_size": batch}, "parallel": layout}
    data["parallel"] = {**layout, "sequence_parallel": True, "optimizer_shard": True}
    return config_from_dict(data), devices


@pytest.mark.parametrize("name", CASES)
def test_golden_strategies_for_the_real_shapes(name):
    _, _, _, _, want, shard_shapes, stage_layers = CASES[name]
    cfg, devices = case_config(name)
    check_parallel(cfg, devices)
    m = cfg.model
    sh = L.sharding(m, cfg.parallel)
    assert L.op_strategies(m, sh) == want
    shapes = L.param_shapes(m)
    for param, shape in shard_shapes.items():
        assert L.shard_shape(shapes[param], L.param_entry(param)[0], sh) == shape, param
    assert L.stage_layer_counts(m.num_layers, cfg.parallel.pp) == stage_layers
    if cfg.parallel.pp > 1:
        stages = L.stage_cells(m, cfg.parallel.pp)
        assert stages["tok_embeddings"] == 0 and stages["norm"] == stages["output"] == cfg.parallel.pp - 1
        assert [stages[f"layers.{i}"] for i in range(m.num_layers)] == sum(
            ([k] * n for k, n in enumerate(stage_layers)), [])


def applied_strategy(layout_attr: dict) -> tuple:
    """Ways each dim is cut, read back from a primitive's MindSpore layout."""
    dm = layout_attr["device_matrix"]
    ways = []
    for entry in layout_attr["tensor_map"]:
        axes = entry if isinstance(entry, tuple) else (entry,)
        ways.append(int(np.prod([dm[len(dm) - 1 - a] for a in axes if a != -1])))
    return tuple(ways)


@pytest.mark.parametrize("name", CASES)
def test_ascend_backend_applies_the_same_layouts_to_a_tiny_model(name):
    import mindspore as ms

    from msllm.backends import ascend
    from msllm.models.decoder import Llama
    from msllm.models.layers import CausalLMLoss

    ms.set_context(mode=ms.PYNATIVE_MODE)
    want = CASES[name][4]
    tp = CASES[name][2]["tp"]
    model_cfg = dict(vocab_size=32 * tp, hidden_size=64, num_layers=4, ffn_size=16 * tp, max_seq_len=16, **TINY[name])
    cfg, devices = case_config(name, model=model_cfg)
    check_parallel(cfg, devices)
    model = Llama(cfg.model)
    applied = ascend.specialise(model, cfg)
    m = cfg.model
    for op in L.ops_for(m):
        per_layer = op.cell.startswith("layers.")
        count = m.num_layers if per_layer else 1
        # optional rows belong to other formulations (the CPU rope matmul, its softmax backward)
        assert applied[op.path] in ((0, count) if op.optional else (count,)), op.path
    cells = dict(model.cells_and_names())
    for op in L.ops_for(m):
        cell = next(c for n, c in cells.items() if fnmatch.fnmatchcase(n, op.cell))
        if op.optional and getattr(cell, op.prim, None) is None:
            continue
        attrs = getattr(cell, op.prim).attrs
        assert tuple(applied_strategy(x) for x in attrs["in_layout"]) == want[op.path]["in"], op.path
        if want[op.path]["out"] is not None:
            assert tuple(applied_strategy(x) for x in attrs["out_layout"]) == want[op.path]["out"], op.path
    if cfg.parallel.pp > 1:
        stages = L.stage_cells(m, cfg.parallel.pp)
        assert sorted(set(stages.values())) == [0, 1]
        for cell_name, stage in stages.items():
            assert cells[cell_name].pipeline_stage == stage
    loss = CausalLMLoss()
    assert ascend.use_vocab_parallel_loss(loss, cfg)
    vocab_cut = applied_strategy(loss.cross_entropy.exp.attrs["in_layout"][0])
    assert vocab_cut == (cfg.parallel.dp, tp)
    wrapped = ascend.parallel_wrapper(loss, cfg, "strategy.ckpt")
    assert wrapped._dataset_strategy_config == ((cfg.parallel.dp, 1),)
    assert wrapped._enable_parallel_optimizer and wrapped._save_strategy_file_path == "strategy.ckpt"
    assert wrapped._pipeline_stages == cfg.parallel.pp


def test_kv_heads_fewer_than_tp_are_grouped_in_the_layouts():
    """GQA kv = 2 on tp = 8: each KV head is cut 2 ways over tp_kv and held by the 4 tp_rep ranks
    whose query heads read it (the oracle in test_layouts.py checks the maths of this grouping)."""
    import mindspore as ms

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = config_from_dict({"model": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
                                          ffn_size=64, max_seq_len=16),
                            "data": {"seq_len": 16}, "parallel": {"tp": 8}})
    model = Llama(cfg.model)
    ascend.specialise(model, cfg)
    attn = model.layers[0].attention
    wq, wk = attn.wq.matmul.attrs["in_layout"][1], attn.wk.matmul.attrs["in_layout"][1]
    assert wq["device_matrix"] == wk["device_matrix"] == (1, 2, 4)
    assert wq["tensor_map"] == ((1, 0), -1) and wk["tensor_map"] == (1, -1)   # q: tp_kv x tp_rep; k: tp_kv
    qk = attn.core.softmax_attention.qk.attrs["in_layout"]
    assert [x["tensor_map"] for x in qk] == [(2, 1, 0, -1), (2, 1, -1, -1)]   # q rows cut by tp_rep


def test_table_and_model_agree():
    """Every parameter of the model has a placement, and each op reads the weight it multiplies as
    the parameter's placement says."""
    import mindspore as ms

    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    for tied in (False, True):
        m = config_from_dict({"model": dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                            num_kv_heads=2, ffn_size=32, max_seq_len=16, qkv_bias=True,
                                            tie_embeddings=tied), "data": {"seq_len": 16}}).model
        model = Llama(m)
        assert {n: tuple(p.shape) for n, p in model.parameters_and_names()} == L.param_shapes(m)
        ops = {op.path: op for op in L.ops_for(m)}
        for weight, op in (("attention.wq.weight", A + "wq.matmul"), ("attention.wk.weight", A + "wk.matmul"),
                           ("attention.wo.weight", A + "wo.matmul"), ("feed_forward.w2.weight", F + "w2.matmul"),
                           ("feed_forward.w1.weight", F + "w1.matmul")):
            assert L.param_entry("layers.0." + weight)[0] == ops[op].inputs[1], weight
        head = ops["lm_matmul" if tied else "output.matmul"]
        assert L.param_entry("tok_embeddings.weight")[0] == head.inputs[1] == ops["tok_embeddings.gather"].inputs[0]
        for pattern, layout, placement in L.PARAMS:
            kind = {"column": (0,), "row": (1,), "vocab parallel": (0,), "expert parallel": (0,), "replicated": ()}[placement]
            assert tuple(i for i, x in enumerate(layout) if x) == kind, pattern


def test_shardable_norm_and_vocab_parallel_loss_are_the_same_maths():
    import mindspore as ms
    from mindspore import Tensor, ops

    from msllm.backends import ascend
    from msllm.models.layers import RMSNormCore

    ms.set_context(mode=ms.PYNATIVE_MODE)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    ours = ascend.RMSNormCore(64, 1e-5)(Tensor(x), Tensor(w)).asnumpy()
    assert np.max(np.abs(ours - RMSNormCore(64, 1e-5)(Tensor(x), Tensor(w)).asnumpy())) < 1e-5
    logits = Tensor((3 * rng.standard_normal((12, 96))).astype(np.float32))
    labels = Tensor(rng.integers(0, 96, 12).astype(np.int32))
    ce, ref = ascend.VocabParallelCrossEntropy(96), ops.SparseSoftmaxCrossEntropyWithLogits()
    (l1, g1), (l2, g2) = (ms.value_and_grad(lambda z, f=f: f(z, labels))(logits) for f in (ce, ref))
    assert abs(float(l1) - float(l2)) < 1e-5 * float(l2)
    assert np.max(np.abs(g1.asnumpy() - g2.asnumpy())) < 1e-6


def test_strategy_file_travels_with_the_checkpoint(tmp_path):
    from msllm.backends import ascend

    src = ascend.strategy_file(tmp_path / "run", 3)
    with pytest.raises(FileNotFoundError, match="rank_3.ckpt"):
        ascend.save_strategy_with_checkpoint(tmp_path / "run", tmp_path, 3)
    src.parent.mkdir(parents=True)
    src.write_bytes(b"strategy")
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000010"
    ckpt.mkdir(parents=True)
    assert ascend.save_strategy_with_checkpoint(tmp_path / "run", ckpt, 3).read_bytes() == b"strategy"


def test_trainer_checkpoints_carry_the_strategy_file_under_the_parallel_wrapper(tmp_path, corpus, monkeypatch):
    """The trainer's save path on CPU with the backend seam told the wrapper is active (as on Ascend with
    a layout): the rank's strategy file lands in the checkpoint and its manifest lists and verifies it."""
    import json

    from msllm import backends, checkpoint
    from msllm.backends import ascend
    from msllm.staged import MANIFEST, check_manifest
    from msllm.train.trainer import Trainer
    from tests.conftest import tiny_overrides

    cfg = load_config(REPO / "configs" / "tiny.yaml", tiny_overrides(tmp_path / "run", corpus))
    assert not backends.uses_parallel_wrapper(cfg)
    trainer = Trainer(cfg)
    plain = trainer.save(1)
    trainer.report_checkpoints(wait=True)  # written in the background
    assert sorted(p.name for p in plain.iterdir()) == sorted(
        [checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE, checkpoint.STATE_FILE, MANIFEST])

    monkeypatch.setattr(backends, "uses_parallel_wrapper", lambda c: c is cfg)
    with pytest.raises(FileNotFoundError, match="rank_0.ckpt"):  # no strategy: no checkpoint that lacks it
        trainer.save(2)
        trainer.report_checkpoints(wait=True)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == ["step_0000001"]
    strategy = ascend.strategy_file(tmp_path / "run", 0)
    strategy.parent.mkdir()
    strategy.write_bytes(b"fake strategy of rank 0")
    saved = trainer.save(3)
    trainer.report_checkpoints(wait=True)
    assert (saved / "strategy_rank_0.ckpt").read_bytes() == b"fake strategy of rank 0"
    assert "strategy_rank_0.ckpt" in json.loads((saved / MANIFEST).read_text())
    assert check_manifest(saved) is None and checkpoint.latest(tmp_path / "run") == saved


# ---- FlashAttentionScore (train.attention auto / flash on Ascend) --------------------------------

def flash_golden(want, dp, tp, kv_split, copies=1):
    """The golden strategies with the softmax core's rows replaced by FlashAttentionScore's."""
    out = {k: v for k, v in want.items() if not k.startswith(C)}
    out[C + "repeat_kv"] = {"in": ((dp, kv_split, 1, 1, 1), (1, 1, copies, 1, 1)), "out": None}
    out[C + "flash"] = {"in": ((dp, tp, 1, 1),) * 3 + ((1, 1),), "out": None}   # flat (dp, tp) mesh; mask whole
    return out


@pytest.mark.parametrize("name", CASES)
def test_golden_flash_strategies_for_the_real_shapes(name):
    _, _, layout, _, want, _, _ = CASES[name]
    cfg, devices = case_config(name)
    m = cfg.model
    sh = L.sharding(m, cfg.parallel)
    assert L.op_strategies(m, sh, flash=True) == flash_golden(want, layout["dp"], layout["tp"], layout["tp"])
    assert L.strategy_problems(m, sh, 16, cfg.data.seq_len) == []


def gemma_like(tp: int, **train):
    """A Gemma-3-like tiny model (q/k norms, sandwich norms, GeGLU, sliding and full layers, GQA 8/2)
    laid out for Ascend with bf16 compute, where train.attention auto means FlashAttentionScore."""
    model = dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
                 ffn_size=16 * tp, max_seq_len=64, qk_norm=True, sandwich_norm=True, norm_offset=1.0,
                 mlp="geglu_tanh", sliding_window=12, layer_types=["sliding", "full", "sliding", "full"],
                 rope_local_theta=10000.0, rope_theta=1e6)
    return config_from_dict({"model": model, "data": {"seq_len": 32},
                             "train": {"device": "ascend", "precision": "bf16", "batch_size": 4, **train},
                             "parallel": {"tp": tp, "sequence_parallel": tp > 1}})


def test_generation_after_ascend_training_reads_the_ring_through_the_portable_core():
    """The end-of-run sample re-specialises the trained model for generation (backends.specialise, training
    False): on Ascend the FlashAttentionScore cores, whose masks describe one sequence from slot 0, go back to
    the portable softmax core and the decoder's additive mask, which read the decode cache's slots, padding and
    the sliding layers' rings (window 12, wrapped by 16-token left-padded prompts). Run here on CPU: the decode
    steps equal the full forward of the same model (FlashAttentionScore itself cannot run here)."""
    import mindspore as ms

    from msllm import backends
    from msllm.backends import ascend
    from msllm.models.decoder import Llama
    from tests.test_kv_cache import decode_rows, decodes_as_the_full_forward

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = gemma_like(2)
    model = Llama(cfg.model)
    assert backends.specialise(model, cfg).flash
    backends.specialise(model, cfg, training=False)
    model.set_train(False)
    assert not any(isinstance(block.attention.core.softmax_attention, ascend.FlashAttention) for block in model.layers)
    engine = decodes_as_the_full_forward(model, decode_rows(cfg.model), 0)
    assert engine.cache[2].shape[3] == 12  # ring_keys: the window's slots


@pytest.mark.parametrize("tp", [2, 8])   # kv = tp: K/V heads as they are; kv < tp: 4 copies of each
def test_flash_attention_swapped_in_per_layer_kind_with_the_table_layouts(tp):
    """Through the backend seam (built and inspected on CPU; FlashAttentionScore cannot run here):
    every layer's core is FlashAttentionScore with its kind's sparse mode, the model hands it the
    compressed causal mask instead of an [s, t] mask, and the layouts read back from the primitives
    are the table's flash rows."""
    import mindspore as ms
    from mindspore.ops.operations.nn_ops import FlashAttentionScore

    from msllm import backends
    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = gemma_like(tp)
    m = cfg.model
    sh = L.sharding(m, cfg.parallel)
    assert (sh.tp_kv, sh.tp_rep) == ((2, 1) if tp == 2 else (2, 4))
    model = Llama(m)
    spec = backends.specialise(model, cfg)
    assert spec.flash and spec.device == "ascend"
    bnsd = FlashAttentionScore(head_num=8, input_layout="BNSD").input_layout
    for i, block in enumerate(model.layers):
        core = block.attention.core.softmax_attention
        assert isinstance(core, ascend.FlashAttention), i
        prim = core.flash
        sliding = m.layer_kinds()[i] == "sliding"
        assert core.window == (12 if sliding else 0)
        assert (prim.sparse_mode, prim.pre_tokens, prim.next_tokens) == ((4, 11, 0) if sliding else
                                                                           (2, ascend.UNBOUNDED, 0)), i
        assert (prim.head_num, prim.scale_value, prim.keep_prob, prim.input_layout) == (8, 1.0, 1.0, bnsd)
        assert core.kv_copies == sh.tp_rep and hasattr(core, "repeat_kv") == (sh.tp_rep > 1)
    assert isinstance(model.attention_mask, ascend.CompressedCausalMask)
    mask = model.attention_mask(None, 4).asnumpy()
    assert mask.shape == (2048, 2048) and mask.dtype == np.uint8
    assert (mask == np.triu(np.ones((2048, 2048), np.uint8), 1)).all()

    want = L.op_strategies(m, sh, flash=True)
    assert not any(path.endswith((".qk", ".pv", ".softmax")) for path in want)
    cells = dict(model.cells_and_names())
    for op in L.ops_for(m, "flash"):
        found = [c for n, c in cells.items()
                 if fnmatch.fnmatchcase(n, op.cell) and getattr(c, op.prim, None) is not None]
        assert len(found) in ((0, m.num_layers) if op.optional and op.cell.startswith("layers.") else
                              (m.num_layers,) if op.cell.startswith("layers.") else (1,)), op.path
        for cell in found:
            attrs = getattr(cell, op.prim).attrs
            assert tuple(applied_strategy(x) for x in attrs["in_layout"]) == want[op.path]["in"], op.path
            if op.flat:
                assert all(x["device_matrix"] == (1, tp) and x["alias_name"] == ("dp", "tp")
                           for x in attrs["in_layout"])
    flash = model.layers[0].attention.core.softmax_attention.flash.attrs["in_layout"]
    assert [x["tensor_map"] for x in flash] == [(1, 0, -1, -1)] * 3 + [(-1, -1)]   # batch dp, heads tp
    if sh.tp_rep > 1:   # the copies run on CPU: each KV head repeated in place, as the oracle's np.repeat
        k = np.random.default_rng(0).standard_normal((2, 2, 5, 16)).astype(np.float32)
        copied = model.layers[0].attention.core.softmax_attention.repeat(ms.Tensor(k)).asnumpy()
        assert (copied == np.repeat(k, sh.tp_rep, axis=1)).all()
        repeat = model.layers[0].attention.core.softmax_attention.repeat_kv.attrs["in_layout"]
        # kv over tp_kv, copies over tp_rep
        assert [x["tensor_map"] for x in repeat] == [(2, 1, -1, -1, -1), (-1, -1, 0, -1, -1)]


# ---- context parallel: FlashAttentionScore as ring attention ---------------------------------------

def ring_golden(dp, cp, tp, kv_split, copies=1):
    """Golden strategies under context parallel with sequence parallel: the rows of one sequence per
    replica cut over dp x cp (tokens dp x cp x tp), the ring's q, k and v cut (dp, tp, cp, 1) with no
    mask, and no softmax-core or rope-matmul rows."""
    rows = dp * cp
    out = {k: v for k, v in golden(rows, tp, rows * tp, kv_split, None).items()
           if not k.startswith(C) and not k.endswith("rope.matmul")}
    out[C + "repeat_kv"] = {"in": ((dp, kv_split, 1, cp, 1), (1, 1, copies, 1, 1)), "out": None}
    out[C + "flash"] = {"in": ((dp, tp, cp, 1),) * 3, "out": None}
    return out


def test_golden_ring_attention_strategies_for_llama3_8b_at_64_devices():
    cfg = load_config(REPO / "configs" / "llama3_8b.yaml",
                      ["parallel.dp=2", "parallel.cp=4", "parallel.tp=8", "parallel.sequence_parallel=true",
                       "train.precision=bf16", "data.seq_len=32768", "model.max_seq_len=32768"])
    check_parallel(cfg, devices=64)
    m = cfg.model
    sh = L.sharding(m, cfg.parallel)
    assert sh.mesh_axes == ("dp", "cp", "tp_kv", "tp_rep") and sh.mesh == (2, 4, 8, 1)
    assert L.op_strategies(m, sh, flash=True) == ring_golden(2, 4, 8, 8)
    # a replica's micro-batch of two sequences would cut the rows into whole sequences, not chunks
    assert any("one sequence" in p for p in L.strategy_problems(m, sh, 4, 32768))


def test_ring_attention_swapped_in_under_context_parallel_with_the_table_layouts():
    """Through the backend seam (built and inspected on CPU; nothing here runs ring attention): every
    layer's core is FlashAttentionScore with the ring attributes, sparse mode 0 and no mask, and the
    layouts read back from every primitive are the table's ring rows over the (dp, cp, tp) meshes."""
    import mindspore as ms

    from msllm import backends
    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    model_cfg = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=1, head_dim=16,
                     ffn_size=32, max_seq_len=64, qk_norm=True)
    cfg = config_from_dict({"model": model_cfg, "data": {"seq_len": 32},
                            "train": {"device": "ascend", "precision": "bf16", "batch_size": 1},
                            "parallel": {"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True}})
    check_parallel(cfg, devices=8)
    m = cfg.model
    sh = L.sharding(m, cfg.parallel)
    assert (sh.tp_kv, sh.tp_rep) == (1, 2)   # MQA: the KV head repeated to both tp ranks
    model = Llama(m)
    spec = backends.specialise(model, cfg)
    assert spec.flash
    want = L.op_strategies(m, sh, flash=True)
    assert C + "flash" in want and not any(path.endswith((".qk", ".softmax", "rope.matmul")) for path in want)
    for block in model.layers:
        core = block.attention.core.softmax_attention
        assert isinstance(core, ascend.FlashAttention) and core.ring
        prim = core.flash
        assert (prim.sparse_mode, prim.pre_tokens, prim.next_tokens) == (0, ascend.UNBOUNDED, ascend.UNBOUNDED)
        assert prim.attrs["enable_ring_attention"] is True and prim.attrs["enable_ra_send_recv"] is True
        layouts = prim.attrs["in_layout"]
        assert len(layouts) == 3   # q, k, v: no mask
        assert all(x["device_matrix"] == (2, 2, 2) and x["alias_name"] == ("dp", "cp", "tp") for x in layouts)
        assert [x["tensor_map"] for x in layouts] == [(2, 0, 1, -1)] * 3   # batch dp, heads tp, sequence cp
    cells = dict(model.cells_and_names())
    for op in L.ops_for(m, "ring"):
        for name, cell in cells.items():
            if fnmatch.fnmatchcase(name, op.cell) and getattr(cell, op.prim, None) is not None:
                got = tuple(applied_strategy(x) for x in getattr(cell, op.prim).attrs["in_layout"])
                assert got == want[op.path]["in"], op.path
    wq = model.layers[0].attention.wq.matmul.attrs["in_layout"][0]
    assert wq["alias_name"] == ("dp", "cp", "tp_kv", "tp_rep") and wq["tensor_map"] == ((3, 2), -1)  # rows: dp x cp


def documented_visible(sparse_mode, pre_tokens, next_tokens, s, t):
    """Which keys FlashAttentionScore keeps, as MindSpore 2.10 documents its sparse modes: 2
    (leftUpCausal) the lower triangle from the top-left corner; 4 (band) keys from pre_tokens before
    to next_tokens after the query, counted from the bottom-right corner."""
    i, j = np.arange(s)[:, None], np.arange(t)[None, :]
    if sparse_mode == 2:
        return j <= i
    assert sparse_mode == 4
    return (j >= i + (t - s) - pre_tokens) & (j <= i + (t - s) + next_tokens)


@pytest.mark.parametrize("window, s", [(0, 16), (0, 37), (1, 16), (5, 37), (12, 16), (40, 37)])
def test_each_window_maps_to_a_sparse_mode_that_sees_what_the_model_sees(window, s):
    """flash_form(window) under the documented semantics keeps exactly the keys the model's own
    visibility (AdditiveMask, which the softmax core and the oracle use) keeps; the compressed
    mask is sparse mode 2's table."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.models import layers

    ms.set_context(mode=ms.PYNATIVE_MODE)
    slots = Tensor(np.arange(s, dtype=np.int32).reshape(1, s))
    zeros = Tensor(np.zeros((1, s), np.int32))
    seen = layers.visibility(slots, zeros, zeros, Tensor(np.array([window], np.int32)))
    model_visible = layers.AdditiveMask(4, 2)(seen, 1).asnumpy() == 0
    assert (documented_visible(*ascend.flash_form(window), s, s) == model_visible).all()
    assert (ascend.compressed_causal_mask() == ~documented_visible(2, 0, 0, 2048, 2048)).all()


def test_ascend_attention_resolves_and_refuses_in_one_line(tmp_path):
    """auto: FlashAttentionScore on Ascend whenever it can take the config (fp16 / bf16, head size a
    multiple of 16, packed samples only without sliding windows), else the softmax core; flash where it cannot: one line at load;
    softmax: never flash; Ascend inference keeps the softmax core."""
    from msllm import backends
    from msllm.config import ConfigError

    assert backends.plan(gemma_like(2)).flash
    assert not backends.plan(gemma_like(2), training=False).flash
    assert not backends.plan(gemma_like(2, attention="softmax")).flash
    assert not backends.plan(gemma_like(2, precision="fp32")).flash
    assert backends.plan(gemma_like(2, precision="fp16")).flash
    with pytest.raises(ConfigError) as err:
        gemma_like(2, attention="flash", precision="fp32")
    assert err.value.key == "train.attention" and "\n" not in str(err.value)
    assert "FlashAttentionScore, which takes fp16 / bf16 only (train.precision: fp32)" in str(err.value)
    data = {"model": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=8, ffn_size=64,
                          max_seq_len=64),
            "data": {"seq_len": 32}, "train": {"device": "ascend", "precision": "bf16", "attention": "flash"}}
    with pytest.raises(ConfigError, match="multiples of 16 up to 512 \\(this model's: 8\\)"):
        config_from_dict(data)
    data["model"]["head_dim"] = 16
    config_from_dict(data)
    data["data"]["document_attention"] = True
    assert backends.plan(config_from_dict(data)).flash   # packed samples: its TND form
    data["model"].update(sliding_window=8, layer_types=["sliding", "full"])
    with pytest.raises(ConfigError, match="packed samples \\(data.document_attention\\) causal per sample in its TND "
                                          "layout, which msllm does not build with sliding-window layers"):
        config_from_dict(data)
    data["train"]["attention"] = "auto"
    packed = config_from_dict(data)
    assert not backends.plan(packed).flash   # packed with a sliding layer: the softmax core
    import dataclasses
    asked = dataclasses.replace(packed, train=dataclasses.replace(packed.train, attention="flash"))
    with pytest.raises(ConfigError, match="train.attention: flash on Ascend .* packed samples"):
        backends.plan(asked)                 # the seam refuses it too (an SFT shard is known only there)


def test_checker_applies_flash_attention_rules(monkeypatch):
    """The checker holds the flash rows to FlashAttentionScore's own rules: a table row cutting the
    keys' sequence is reported."""
    import dataclasses

    cfg = gemma_like(2)
    sh = L.sharding(cfg.model, cfg.parallel)
    assert L.strategy_problems(cfg.model, sh, 4, 32) == []
    rows = list(L.OPS)
    i = next(i for i, op in enumerate(rows) if op.prim == "flash")
    kv = ("samples", "heads", "samples", None)
    rows[i] = dataclasses.replace(rows[i], inputs=(rows[i].inputs[0], kv, kv, rows[i].inputs[3]))
    monkeypatch.setattr(L, "OPS", tuple(rows))
    assert any("keys' sequence" in p for p in L.strategy_problems(cfg.model, sh, 4, 32))


def test_qk_norms_are_cut_on_heads_as_their_projections_and_compute_the_same():
    """q / k norms under tp (a Gemma-3-like block: q/k and sandwich norms, a sliding and a full layer):
    golden strategies with the heads axis cut as wq / wk cut their columns (q over tp, k over the KV
    split), the checker clean, the backend setting exactly those on the built model, and the model
    with Ascend's norm formulation computing the same logits."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, ffn_size=64,
                 max_seq_len=16, qk_norm=True, sandwich_norm=True, norm_offset=1.0, mlp="geglu_tanh",
                 sliding_window=4, layer_types=["sliding", "full"], rope_local_theta=10000.0, rope_theta=1e6)
    layout = {"dp": 2, "tp": 4, "sequence_parallel": True}
    cfg = config_from_dict({"model": model, "data": {"seq_len": 16}, "train": {"batch_size": 4}, "parallel": layout})
    check_parallel(cfg, 8)
    sh = L.sharding(cfg.model, cfg.parallel)
    assert (sh.tp_kv, sh.tp_rep) == (2, 2)
    got = L.op_strategies(cfg.model, sh)
    for which, heads in (("q", 4), ("k", 2)):  # q: 8 heads over tp 4; k: 2 KV heads, each held by 2 ranks
        x, r = (2, heads, 1), (2, heads, 1)
        want = {"square": (x,), "mean": (x,), "add": (r, (1, 1, 1)), "rsqrt": (r,), "scale": (x, r), "weigh": (x, (1,))}
        for prim, strategy in want.items():
            assert got[f"{A}{which}_norm.core.{prim}"] == {"in": strategy, "out": None}, (which, prim)
    # the heads a rank normalises are the heads its projection computed (same slice of the same axis)
    rows = {op.path: op for op in L.ops_for(cfg.model)}
    for which in "qk":
        assert rows[f"{A}{which}_norm.core.square"].inputs[0][1] == rows[f"{A}w{which}.matmul"].inputs[1][0]
    sandwich = [op.path for op in L.ops_for(cfg.model) if "_out_norm." in op.path]
    assert len(sandwich) == 12 and got["layers.*.ffn_out_norm.core.square"] == {"in": ((8, 1),), "out": None}

    net = Llama(cfg.model)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32))
    plain = net(ids).asnumpy()
    applied = ascend.specialise(net, cfg)
    assert applied[f"{A}q_norm.core.weigh"] == applied[f"{A}k_norm.core.weigh"] == 2
    cells = dict(net.cells_and_names())
    for op in L.ops_for(cfg.model):
        if ".q_norm." in op.path or ".k_norm." in op.path:
            attrs = getattr(cells[op.cell.replace("*", "1")], op.prim).attrs
            assert tuple(applied_strategy(a) for a in attrs["in_layout"]) == got[op.path]["in"], op.path
    assert cells["layers.0.attention.q_norm"].heads_axis
    np.testing.assert_allclose(net(ids).asnumpy(), plain, rtol=1e-5, atol=1e-5)


def test_olmo_norms_after_sublayers_and_over_whole_projections_are_laid_out_and_compute_the_same():
    """OLMo 2/3 under dp 2 x tp 4 with sequence parallel: no pre norms (no rows for them, none built),
    the post norms on tokens as the other residual-stream norms, the q / k norms over whole rows of
    their projection (columns uncut: the mean runs over every head), the checker clean, the backend
    setting those strategies, and the model with Ascend's norm formulation computing the same logits."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, ffn_size=64,
                 max_seq_len=16, qk_norm=True, qk_norm_scope="projection", sandwich_norm=True, pre_norm=False,
                 sliding_window=4, layer_types=["sliding", "full"])
    layout = {"dp": 2, "tp": 4, "sequence_parallel": True}
    cfg = config_from_dict({"model": model, "data": {"seq_len": 16}, "train": {"batch_size": 4}, "parallel": layout})
    check_parallel(cfg, 8)
    got = L.op_strategies(cfg.model, L.sharding(cfg.model, cfg.parallel))
    assert not [path for path in got if ".attention_norm." in path or ".ffn_norm." in path]
    for which in "qk":
        x, r = (2, 1), (2, 1)
        want = {"square": (x,), "mean": (x,), "add": (r, (1, 1)), "rsqrt": (r,), "scale": (x, r), "weigh": (x, (1,))}
        for prim, strategy in want.items():
            assert got[f"{A}{which}_norm.core.{prim}"] == {"in": strategy, "out": None}, (which, prim)
    assert got["layers.*.attention_out_norm.core.square"] == {"in": ((8, 1),), "out": None}

    net = Llama(cfg.model)
    assert {n: tuple(p.shape) for n, p in net.parameters_and_names()} == L.param_shapes(cfg.model)
    assert L.param_shapes(cfg.model)["layers.0.attention.k_norm.weight"] == (16,)  # 2 KV heads x 8
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32))
    plain = net(ids).asnumpy()
    applied = ascend.specialise(net, cfg)
    cells = dict(net.cells_and_names())
    for op in L.ops_for(cfg.model):
        assert applied[op.path] in ((0, 2) if op.optional else (2 if op.cell.startswith("layers.") else 1,)), op.path
        if "_norm." in op.path and op.cell.startswith("layers."):
            attrs = getattr(cells[op.cell.replace("*", "1")], op.prim).attrs
            assert tuple(applied_strategy(a) for a in attrs["in_layout"]) == got[op.path]["in"], op.path
    np.testing.assert_allclose(net(ids).asnumpy(), plain, rtol=1e-5, atol=1e-5)


# ---- expert parallel ------------------------------------------------------------------------------

MOE = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=32, max_seq_len=16,
           num_experts=4, experts_per_token=2, moe_ffn_size=8, norm_topk_prob=False)


# gpt-oss's MoE: a bias on the router's logits, biases on each expert's gate, up and down, the clamped SwiGLU
# (a limit the gates and ups cross here), top k renormalised
GPT_OSS_MOE = dict(router_bias=True, experts_bias=True, mlp="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=1.0,
                   norm_topk_prob=True)


def moe_config(factor=1.25, model=None, **layout):
    return config_from_dict({"model": {**MOE, **(model or {})}, "data": {"seq_len": 8}, "train": {"batch_size": 2,
                             "moe_capacity_factor": factor}, "parallel": layout})


def test_expert_parallel_golden_strategies_and_the_backend_applies_them():
    """dp 4 with ep 2, tp 2 on 8 devices: experts cut over ep, their rows over the other ep group, the
    one-hot dispatch and combine per data-parallel group; the built model carries exactly these and
    computes what the CPU model computes (a capacity no expert overflows: the dropless sum)."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    cfg = moe_config(dp=4, ep=2, tp=2)
    check_parallel(cfg, 8)
    sh = L.sharding(cfg.model, cfg.parallel)
    assert (sh.mesh, sh.mesh_axes) == ((2, 2, 2, 1), ("dp", "ep", "tp_kv", "tp_rep"))
    got = L.op_strategies(cfg.model, sh)
    want = {F + "dispatch.dispatch_rows": ((4, 1, 1), (4, 1, 1)), F + "dispatch.to_experts": ((4, 1, 1, 1),),
            F + "experts.matmul": ((2, 2, 1), (2, 1, 1)), F + "dispatch.from_experts": ((2, 2, 1, 1),),
            F + "dispatch.combine_rows": ((4, 1, 1), (4, 1, 1))}
    assert {k: v["in"] for k, v in got.items() if k in want} == want
    assert not any(k.startswith(F + "w") for k in got)  # no dense MLP rows for an all-MoE model
    experts_row = next(op for op in L.ops_for(cfg.model) if op.cell.endswith(".experts"))
    assert L.param_entry("layers.0.feed_forward.experts.w2")[0] == experts_row.inputs[1]  # weights as the matmul reads them
    w1 = "layers.0.feed_forward.experts.w1"
    assert L.shard_shape(L.param_shapes(cfg.model)[w1], L.param_entry(w1)[0], sh) == (2, 8, 16)
    assert [L.shard_slices((4, 8, 16), ("experts", None, None), sh, {"dp": r})[0] for r in range(4)] == \
        [slice(0, 2), slice(2, 4)] * 2  # an ep group is 2 consecutive replicas, each holding half the experts

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (4, 8)).astype(np.int32))
    roomy = moe_config(factor=2.0, dp=4, ep=2, tp=2)  # C = n: every choice kept
    net = Llama(roomy.model)
    rng = np.random.default_rng(1)
    for p in net.get_parameters():
        p.set_data(Tensor((rng.normal(0, 0.3, p.shape) + (1.0 if "norm" in p.name else 0.0)).astype(np.float32)))
    plain = net(ids).asnumpy()
    applied = ascend.specialise(net, roomy)
    assert all(applied[k] == 2 for k in want)
    cells = dict(net.cells_and_names())
    for path, strategy in want.items():
        cell, prim = path.rsplit(".", 1)
        attrs = getattr(cells[cell.replace("*", "1")], prim).attrs
        assert tuple(applied_strategy(a) for a in attrs["in_layout"]) == strategy, path
    np.testing.assert_allclose(net(ids).asnumpy(), plain, rtol=1e-5, atol=1e-5)


def test_expert_parallel_checker_rules():
    from msllm.config import ConfigError

    for layout, factor, key, text in (
            (dict(dp=4, ep=3), 1.25, "parallel.ep", "must divide model.num_experts (4 % 3 != 0)"),
            (dict(dp=2, ep=4), 1.25, "parallel.ep", "must divide parallel.dp (2 % 4 != 0)"),
            (dict(dp=4, ep=2), 0.0, "train.moe_capacity_factor", "must be > 0 for expert parallel on ascend")):
        with pytest.raises(ConfigError) as err:
            check_parallel(config_from_dict({"model": MOE, "data": {"seq_len": 8},
                                             "train": {"batch_size": 2, "moe_capacity_factor": factor, "device": "ascend"},
                                             "parallel": layout}), layout["dp"])
        assert err.value.key == key and text in str(err.value), str(err.value)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_expert_parallel_oracle_all_to_all_ranks_equal_the_whole_layer(gpt_oss):
    """The one-process oracle of Ascend's expert parallel: 4 data-parallel ranks in ep groups of 2, each
    dispatching its own tokens ([E, C, h], numpy), an all-to-all within its ep group handing each rank
    the rows of the experts the table gives it, each rank computing only those experts with its slice of
    the weights, the all-to-all back and a local combine, equal the whole MoE layer as MindSpore
    computes it with one dispatch group per rank (GroupedCapacityDispatch, groups 4). The rows a rank
    receives are the slice the table's layout of the experts' BatchMatMul gives it. gpt-oss's MoE: the
    router's bias whole on every rank, each rank's experts' biases the table's slice of them."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.models.moe import GroupedCapacityDispatch, MoE

    cfg = moe_config(factor=0.75, model=GPT_OSS_MOE if gpt_oss else None, dp=4, ep=2)
    m, sh = cfg.model, L.sharding(cfg.model, cfg.parallel)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    layer = MoE(m)
    rng = np.random.default_rng(2)
    for p in layer.get_parameters():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    ranks, n, e, k, h = 4, 6, m.num_experts, m.experts_per_token, m.hidden_size
    c = math.ceil(0.75 * n * k / e)
    x = rng.normal(size=(ranks * n, h)).astype(np.float32)
    layer.dispatch = GroupedCapacityDispatch(e, 0.75, groups=ranks)
    whole, load = (t.asnumpy() for t in layer(Tensor(x)))
    assert load[2].sum() > 0  # the capacity drops choices: the oracle must drop the same ones

    router = layer.router.weight.asnumpy()
    router_bias = layer.router.bias.asnumpy() if gpt_oss else 0.0
    weights = {w: getattr(layer.experts, w).asnumpy() for w in ("w1", "w2", "w3")}
    biases = {b: getattr(layer.experts, b).bias.asnumpy() if gpt_oss else np.zeros((e, 1), np.float32)
              for b in ("b1", "b2", "b3")}

    def act(gate, up):
        if not gpt_oss:
            return gate / (1 + np.exp(-gate)) * up
        gate, up = np.minimum(gate, m.swiglu_limit), np.clip(up, -m.swiglu_limit, m.swiglu_limit)
        return gate / (1 + np.exp(-m.swiglu_alpha * gate)) * (up + 1)

    def route(xr):  # softmax top-k (renormalised for gpt-oss), and each expert's first c choices in token order
        logits = xr @ router.T + router_bias
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        chosen = np.argsort(-probs, -1, kind="stable")[:, :k]
        if gpt_oss:
            probs = probs / np.take_along_axis(probs, chosen, -1).sum(-1, keepdims=True)
        rows, slots, seen = np.zeros((e, c, h), np.float32), [], np.zeros(e, int)
        for t in range(n):
            for ex in chosen[t]:
                if seen[ex] < c:
                    rows[ex, seen[ex]] = xr[t]
                    slots.append((t, ex, seen[ex], probs[t, ex]))
                seen[ex] += 1
        return rows, slots

    routed = [route(x[r * n:(r + 1) * n]) for r in range(ranks)]
    global_rows = np.stack([rows for rows, _ in routed], 1).reshape(e, ranks * c, h)  # [E, G*C, h] as the graph
    layout = next(op for op in L.ops_for(m) if op.cell.endswith(".experts")).inputs[0]
    back = [np.zeros((e, c, h), np.float32) for _ in range(ranks)]
    for r in range(ranks):
        group = [q for q in range(ranks) if q // sh.ep == r // sh.ep]
        mine = L.shard_slices((e, 1, 1), ("experts", None, None), sh, {"dp": r})[0]
        received = np.concatenate([routed[q][0][mine] for q in group], 1)            # all-to-all in
        table_slice = L.shard_slices(global_rows.shape, layout, sh, {"dp": r})
        np.testing.assert_array_equal(received, global_rows[table_slice])
        w1, w2, w3 = (weights[w][mine] for w in ("w1", "w2", "w3"))
        cuts = {b: L.param_entry(f"layers.0.feed_forward.experts.{b}.bias")[0] for b in biases}
        b1, b2, b3 = (biases[b][L.shard_slices(biases[b].shape, cuts[b], sh, {"dp": r})][:, None]
                      for b in ("b1", "b2", "b3"))
        gate, up = received @ w1.transpose(0, 2, 1) + b1, received @ w3.transpose(0, 2, 1) + b3
        out = act(gate, up) @ w2.transpose(0, 2, 1) + b2                              # [E/ep, ep*C, h]
        for i, q in enumerate(group):                                                 # all-to-all back
            back[q][mine] = out[:, i * c:(i + 1) * c]
    oracle = np.zeros_like(x)
    for r, (_, slots) in enumerate(routed):
        for t, ex, slot, weight in slots:
            oracle[r * n + t] += weight * back[r][ex, slot]
    np.testing.assert_allclose(oracle, whole, rtol=1e-4, atol=1e-5)


# ---- MLA under tensor parallel ---------------------------------------------------------------------

MLA = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4, ffn_size=32, max_seq_len=16,
           attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def test_mla_golden_strategies_for_deepseek_v3_and_the_backend_applies_them():
    """DeepSeek-V3's MLA at tp 8: the down-projections to the latents and their norms whole on every
    rank, the up-projections cut by heads as wq, wo by heads (row); a tiny MLA model carries exactly the
    table's rows (every required one found)."""
    import mindspore as ms

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    cfg = load_config(REPO / "configs" / "deepseek_v3.yaml",
                      ["parallel.dp=8", "parallel.tp=8", "parallel.ep=8", "parallel.sequence_parallel=true",
                       "train.precision=bf16", "train.moe_capacity_factor=1.25"])
    check_parallel(cfg, devices=64)
    sh = L.sharding(cfg.model, cfg.parallel)
    got = L.op_strategies(cfg.model, sh)
    rows = ((8, 1), (1, 1))
    assert {k: got[A + k]["in"] for k in ("wq_a.matmul", "wq_b.matmul", "wkv_a.matmul", "wkv_b.matmul", "wo.matmul")} \
        == {"wq_a.matmul": rows, "wq_b.matmul": ((8, 1), (8, 1)), "wkv_a.matmul": rows,
            "wkv_b.matmul": ((8, 1), (8, 1)), "wo.matmul": ((8, 8), (1, 8))}
    assert got[A + "kv_norm.core.square"]["in"] == ((8, 1),) and got[A + "q_norm.core.weigh"]["in"] == ((8, 1), (1,))
    assert got[C + "qk"]["in"] == ((8, 8, 1, 1),) * 2 and not any(".wk." in k or ".flash" in k for k in got)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    tiny = config_from_dict({"model": {**MLA, "q_lora_rank": 12}, "data": {"seq_len": 8},
                             "train": {"device": "ascend", "precision": "bf16", "batch_size": 2},
                             "parallel": {"tp": 2, "sequence_parallel": True}})
    model = Llama(tiny.model)
    applied = ascend.specialise(model, tiny)
    assert applied[A + "wkv_b.matmul"] == applied[A + "q_norm.core.square"] == 1 and applied[C + "pv"] == 1
    want = L.op_strategies(tiny.model, L.sharding(tiny.model, tiny.parallel))
    got = tuple(applied_strategy(x) for x in model.layers[0].attention.wq_b.matmul.attrs["in_layout"])
    assert got == want[A + "wq_b.matmul"]["in"] == ((1, 1), (2, 1))


@pytest.mark.parametrize("tp, q_rank", [(2, 12), (4, 0)])
def test_mla_heads_cut_over_tp_equal_the_whole_layer(tp, q_rank):
    """The one-process proof of the MLA rows: tp ranks, each an MLA of num_heads / tp heads holding the
    table's slices of the weights (the latent projections whole, wq_b / wq and wkv_b cut by heads, wo by
    heads), run by MindSpore. Their outputs and input gradients summed (the row-parallel all-reduce and
    the column-parallel input's) equal the whole layer's; each rank's gradient of a cut weight is the
    slice of the whole gradient, and of a replicated weight a share that sums to it over the ranks."""
    import dataclasses

    import mindspore as ms
    from mindspore import Tensor, ops

    from msllm.config import ModelConfig, ParallelConfig
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    m = ModelConfig(**MLA, q_lora_rank=q_rank)
    sh = L.sharding(m, ParallelConfig(tp=tp))
    rng = np.random.default_rng(5)
    b, s = 2, 8
    x = Tensor(rng.normal(size=(b * s, m.hidden_size)).astype(np.float32))
    up = Tensor(rng.normal(size=(b * s, m.hidden_size)).astype(np.float32))
    prefix = "layers.0.attention."

    def run(cfg, weights=None):
        model = Llama(cfg)
        attention = model.layers[0].attention
        params = {p.name: p for p in model.get_parameters() if p.name.startswith(prefix)}
        for name, p in params.items():
            value = weights[name] if weights else rng.normal(0, 0.3, p.shape).astype(np.float32)
            p.set_data(Tensor(value + (1.0 if name.endswith("norm.weight") else 0.0) * (weights is None)))
        cos, sin, mask = model.tables(0, b, s, s, None, None, None, None)
        loss = lambda inp: (attention(inp, cos, sin, mask)[0] * up).sum()  # noqa: E731
        out = attention(x, cos, sin, mask)[0].asnumpy()
        dx, grads = ms.value_and_grad(loss, grad_position=0, weights=list(params.values()))(x)[1]
        return ({n: p.asnumpy() for n, p in params.items()}, out, dx.asnumpy(),
                {n: g.asnumpy() for n, g in zip(params, grads)})

    whole_w, whole_out, whole_dx, whole_g = run(m)
    rank_cfg = dataclasses.replace(m, num_heads=m.num_heads // tp, num_kv_heads=m.num_kv_heads // tp)
    outs, dxs, shares = [], [], {}
    for j in range(tp):
        cut = {n: L.shard_slices(w.shape, L.param_entry(n)[0], sh, {"tp_kv": j}) for n, w in whole_w.items()}
        _, out, dx, grads = run(rank_cfg, {n: w[cut[n]] for n, w in whole_w.items()})
        outs.append(out)
        dxs.append(dx)
        for n, g in grads.items():
            if L.param_entry(n)[1] == "replicated":
                shares[n] = shares.get(n, 0) + g
            else:
                np.testing.assert_allclose(g, whole_g[n][cut[n]], rtol=1e-4, atol=1e-5, err_msg=n)
    assert {L.param_entry(n)[1] for n in whole_w} == {"replicated", "column", "row"}
    np.testing.assert_allclose(sum(outs), whole_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sum(dxs), whole_dx, rtol=1e-4, atol=1e-5)
    for n, g in shares.items():
        np.testing.assert_allclose(g, whole_g[n], rtol=1e-4, atol=1e-5, err_msg=n)


def test_mla_on_flash_attention_score_pads_values_to_the_qk_heads():
    """MLA on FlashAttentionScore (built and inspected on CPU; the primitive cannot run here), which takes
    one head size for q, k and v: V zero-padded to the q/k heads (pad_v), the output sliced back to the
    value heads (value_part). DeepSeek-V3 at dp 8 x tp 8 resolves to it (bf16, heads of 192) with golden
    strategies (batch over dp, heads over tp, features whole) and a clean checker; a tiny MLA model
    specialised through the backend seam carries those rows; and its pad and slice, run on CPU around the
    softmax core in the primitive's place (what FlashAttentionScore computes at scale 1), give the unpadded
    core's output and hand the primitive V with exactly the padded features zero."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm import backends
    from msllm.backends import ascend
    from msllm.models import layers
    from msllm.models.decoder import Llama

    cfg = load_config(REPO / "configs" / "deepseek_v3.yaml",
                      ["parallel.dp=8", "parallel.tp=8", "parallel.ep=8", "parallel.sequence_parallel=true",
                       "train.precision=bf16", "train.moe_capacity_factor=1.25"])
    assert backends.plan(cfg).flash
    sh = L.sharding(cfg.model, cfg.parallel)
    got = L.op_strategies(cfg.model, sh, flash=True)
    heads = (8, 8, 1, 1)
    assert {k: got[C + k]["in"] for k in ("pad_v", "flash", "value_part")} == {
        "pad_v": (heads, heads), "flash": (heads,) * 3 + ((1, 1),), "value_part": (heads,)}
    assert not any(path.endswith((".qk", ".pv", ".softmax", ".repeat_kv")) for path in got)
    assert L.strategy_problems(cfg.model, sh, 8, 4096) == []
    assert L.op_input_shapes(cfg.model, 8, 4096)[C + "pad_v"][1] == (8, 128, 4096, 192 - 128)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    tiny = config_from_dict({"model": {**MLA, "qk_nope_head_dim": 12, "q_lora_rank": 12}, "data": {"seq_len": 8},
                             "train": {"device": "ascend", "precision": "bf16", "batch_size": 2},
                             "parallel": {"tp": 2, "sequence_parallel": True}})
    m = tiny.model
    model = Llama(m)
    spec = backends.specialise(model, tiny)
    assert spec.flash and (m.head_size, m.v_head_dim) == (16, 6)
    want = L.op_strategies(m, L.sharding(m, tiny.parallel), flash=True)
    core = model.layers[0].attention.core.softmax_attention
    assert isinstance(core, ascend.FlashAttention) and core.value_pad == 10 and core.flash.head_num == m.num_heads
    for prim in ("pad_v", "flash", "value_part"):
        assert tuple(applied_strategy(x) for x in getattr(core, prim).attrs["in_layout"]) == want[C + prim]["in"], prim

    rng = np.random.default_rng(2)
    b, n, s = 2, m.num_heads, 8
    q, k = (Tensor(rng.normal(size=(b, n, s, 16)).astype(np.float32)) for _ in range(2))
    v = Tensor(rng.normal(size=(b, n, s, 6)).astype(np.float32))
    causal = Tensor(np.triu(np.full((s, s), -1e9, np.float32), 1))
    softmax = layers.SoftmaxAttention(n, n)
    handed = []

    def primitive(q, k, v, mask):  # FlashAttentionScore's maths on what it would be handed
        handed.append(v.asnumpy())
        return softmax(q, k, v, causal)[0], None

    core.attend = primitive
    out = core(q, k, v, None)[0].asnumpy()
    assert handed[0].shape == (b, n, s, 16) and (handed[0][..., 6:] == 0).all()
    assert (handed[0][..., :6] == v.asnumpy()).all()
    np.testing.assert_allclose(out, softmax(q, k, v, causal)[0].asnumpy(), rtol=1e-6, atol=1e-6)


def test_mla_flash_on_ascend_refuses_value_heads_larger_than_qk_heads():
    """Padding goes one way (V up to the q/k heads): MLA value heads larger than its q/k heads take the
    softmax core under auto, and train.attention: flash is one line naming the key."""
    from msllm import backends
    from msllm.config import ConfigError

    data = {"model": {**MLA, "qk_nope_head_dim": 12, "v_head_dim": 32}, "data": {"seq_len": 8},
            "train": {"device": "ascend", "precision": "bf16", "batch_size": 2}}
    assert not backends.plan(config_from_dict(data)).flash
    with pytest.raises(ConfigError, match=r"train.attention: flash on Ascend is FlashAttentionScore, which takes one "
                                          r"head size .* \(32\)") as err:
        config_from_dict({**data, "train": {**data["train"], "attention": "flash"}})
    assert "\n" not in str(err.value)


# ---- packed samples: FlashAttentionScore's TND form ------------------------------------------------

def packed_config(dp=2, tp=2):
    model = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                 ffn_size=64, max_seq_len=64, qk_norm=True)
    return config_from_dict({"model": model, "data": {"seq_len": 16, "document_attention": True},
                             "train": {"device": "ascend", "precision": "bf16", "batch_size": 2},
                             "parallel": {"dp": dp, "tp": tp, "sequence_parallel": tp > 1}})


def test_sample_ends_give_each_rank_the_samples_the_visibility_describes():
    """SampleEnds (run here by MindSpore on CPU) turns packed rows' segments into the ends the TND
    kernel reads. Each data-parallel rank's slice of them, as the table's varlen row cuts them, is
    increasing, ends at its own row count, and delimits exactly its rows' samples: attention causal
    within [previous end, end) per sample, as the TND form computes it (emulated in numpy), equals
    msllm's attention under the same visibility (the softmax core's additive mask) on that rank's rows."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends.ascend import SampleEnds
    from msllm.models.layers import AdditiveMask, visibility

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = packed_config(dp=2, tp=1)
    sh = L.sharding(cfg.model, cfg.parallel)
    rng = np.random.default_rng(4)
    b, t, d = 4, 16, 8                                    # 4 rows over dp 2: 2 rows per shard
    lengths = [[5, 3, 8], [16], [1, 1, 7, 7], [2, 9, 5]]
    segments = np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]).astype(np.int32)
    slots = Tensor(np.arange(t, dtype=np.int32))
    seen = visibility(slots, Tensor(segments), Tensor(segments), Tensor(np.zeros(1, np.int32)))
    _, ends = SampleEnds(rows_per_shard=b // sh.dp)(seen, b)
    ends = ends.asnumpy()
    mask = AdditiveMask(1, 1)(seen, b).asnumpy().reshape(b, t, t)
    varlen = next(op for op in L.ops_for(cfg.model, "packed") if op.prim == "varlen")
    q, k, v = (rng.normal(size=(b * t, d)).astype(np.float32) for _ in range(3))
    for r in range(sh.dp):
        rows = L.shard_slices((b * t, 1, d), varlen.inputs[0], sh, {"dp": r}, flat=True)[0]
        mine = ends[L.shard_slices(ends.shape, varlen.inputs[4], sh, {"dp": r}, flat=True)[0]]
        n = rows.stop - rows.start
        assert (np.diff(mine) >= 0).all() and mine[-1] == n
        own = [e for row in lengths[r * 2:(r + 1) * 2] for e in np.cumsum(row)]
        assert sorted(set(mine)) == sorted(set(np.array(own) + np.repeat([0, t], [len(lengths[r * 2]),
                                                                                   len(lengths[r * 2 + 1])])))
        tnd = np.zeros((n, d), np.float32)
        for start, end in zip(np.concatenate([[0], mine[:-1]]), mine):   # one sample at a time, causal
            if end > start:
                scores = q[rows][start:end] @ k[rows][start:end].T + np.triu(np.full((end - start,) * 2, -1e9), 1)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                tnd[start:end] = (p / p.sum(-1, keepdims=True)) @ v[rows][start:end]
        for i in range(2):                                   # msllm's attention on the rank's rows
            row = r * 2 + i
            scores = q[row * t:(row + 1) * t] @ k[row * t:(row + 1) * t].T + mask[row]
            p = np.exp(scores - scores.max(-1, keepdims=True))
            want = (p / p.sum(-1, keepdims=True)) @ v[row * t:(row + 1) * t]
            np.testing.assert_allclose(tnd[i * t:(i + 1) * t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 4)])   # kv = tp; kv < tp: each KV head repeated to 2 ranks
def test_packed_samples_take_the_tnd_form_with_the_table_layouts(dp, tp):
    """Through the backend seam (built and inspected on CPU; FlashAttentionScore cannot run here):
    packed samples on Ascend get the primitive in its TND layout, causal per sample (sparse mode 3),
    the model's attention_mask gives it the samples' ends, and the layouts read back are the table's
    varlen rows: rows over dp, heads over tp, the ends over dp, the compressed mask whole."""
    import mindspore as ms

    from msllm import backends
    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = packed_config(dp, tp)
    check_parallel(cfg, devices=4)
    m, sh = cfg.model, L.sharding(cfg.model, cfg.parallel)
    assert (sh.tp_kv, sh.tp_rep) == ((2, 1) if tp == 2 else (2, 2))
    model = Llama(m)
    spec = backends.specialise(model, cfg)
    assert spec.flash and spec.packed
    want = L.op_strategies(m, sh, flash=True, packed=True)
    assert want[C + "varlen"]["in"] == ((dp, tp, 1),) * 3 + ((1, 1), (dp,), (dp,))
    assert not any(path.endswith((".flash", ".qk", ".softmax")) for path in want)
    assert isinstance(model.attention_mask, ascend.SampleEnds) and model.attention_mask.rows_per_shard == 2
    tnd = ascend.FlashAttentionScore(head_num=8, input_layout="TND").input_layout
    for block in model.layers:
        core = block.attention.core.softmax_attention
        assert isinstance(core, ascend.FlashAttention) and core.packed and not hasattr(core, "flash")
        assert hasattr(core, "repeat_kv") == (sh.tp_rep > 1)   # K/V copies made before the TND rows
        prim = core.varlen
        assert (prim.input_layout, prim.sparse_mode, prim.head_num) == (tnd, ascend.PACKED_SPARSE_MODE, 8)
        got = tuple(applied_strategy(x) for x in prim.attrs["in_layout"])
        assert got == want[C + "varlen"]["in"]
        assert prim.attrs["in_layout"][0]["alias_name"] == ("dp", "tp")
    assert L.strategy_problems(m, sh, 2 * dp, 16) == []


# ---- GLM-4.5 MoE ------------------------------------------------------------------------------------

def test_glm4_5_air_is_laid_out_by_the_table_and_the_backend_applies_it():
    """GLM-4.5-Air on 64 devices (dp 8 with ep 8, tp 8, sequence parallel) passes the checker: q / k / v and
    their biases cut by heads (8 KV heads, one per tp rank), the dense layer's MLP by features, the experts
    over ep, the router's expert bias and the shared expert whole. A tiny model of its spec (q/k/v biases,
    partial RoPE, layer 0 dense, grouped sigmoid router, shared expert) carries every row the table requires
    and computes the same logits with the strategies set (a capacity no expert overflows)."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.models.decoder import Llama

    cfg = load_config(REPO / "configs" / "glm4_5_air.yaml",
                      ["parallel.dp=8", "parallel.tp=8", "parallel.ep=8", "parallel.sequence_parallel=true"])
    check_parallel(cfg, devices=64)
    sh, shapes = L.sharding(cfg.model, cfg.parallel), L.param_shapes(cfg.model)
    want = {"layers.0.attention.wq.weight": (1536, 4096), "layers.0.attention.wq.bias": (1536,),
            "layers.0.attention.wk.bias": (128,), "layers.0.attention.wo.weight": (4096, 1536),
            "layers.0.feed_forward.w1.weight": (1368, 4096), "layers.1.feed_forward.experts.w1": (16, 1408, 4096),
            "layers.1.feed_forward.router.expert_bias": (128,), "layers.1.feed_forward.shared.w2.weight": (4096, 1408)}
    assert {p: L.shard_shape(shapes[p], L.param_entry(p)[0], sh) for p in want} == want

    ms.set_context(mode=ms.PYNATIVE_MODE)
    spec = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=32,
                max_seq_len=16, qkv_bias=True, rope_fraction=0.5, num_experts=4, experts_per_token=2, moe_ffn_size=8,
                shared_experts=1, router="sigmoid_grouped", expert_groups=2, topk_groups=1, routed_scaling=2.5,
                mlp_types=["dense", "moe"])
    tiny = config_from_dict({"model": spec, "data": {"seq_len": 8}, "train": {"batch_size": 2, "moe_capacity_factor": 2.0},
                             "parallel": {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}})
    check_parallel(tiny, 4)
    net = Llama(tiny.model)
    rng = np.random.default_rng(3)
    for p in net.get_parameters():
        p.set_data(Tensor((rng.normal(0, 0.3, p.shape) + (1.0 if "norm" in p.name else 0.0)).astype(np.float32)))
    ids = Tensor(rng.integers(0, 64, (4, 8)).astype(np.int32))
    plain = net(ids).asnumpy()
    applied = ascend.specialise(net, tiny)  # raises on a required row the model lacks
    assert applied[A + "wq.matmul"] == applied[A + "wo.matmul"] == 2 and applied[F + "experts.matmul"] == 1
    assert applied[F + "w1.matmul"] == 1  # the dense layer only
    np.testing.assert_allclose(net(ids).asnumpy(), plain, rtol=1e-5, atol=1e-5)


def test_qwen3_5_hybrid_golden_strategies_and_the_backend_applies_them():
    """Qwen3.5-9B on 8 devices (dp 2 x tp 4, sequence parallel) passes the checker: its Gated DeltaNet
    layers' 16 key heads (each serving 2 value heads) cut 4 a rank with every per-head tensor (the three
    convs, dt_bias, A_log, z / beta / decay inputs), wo row-parallel, the gated norm whole; the attention
    layers as Qwen3's plus the output gate's columns. tp must divide the key heads and the KV heads (one
    line each). A tiny hybrid carries every row the table requires and computes the same logits with the
    strategies set."""
    import mindspore as ms
    from mindspore import Tensor

    from msllm.backends import ascend
    from msllm.config import ConfigError
    from msllm.models.decoder import Llama

    overrides = ["parallel.dp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "train.batch_size=8"]
    cfg = load_config(REPO / "configs" / "qwen3_5_9b.yaml", overrides)
    check_parallel(cfg, devices=8)
    m, sh = cfg.model, L.sharding(cfg.model, cfg.parallel)
    head_norm = {"square": ((2, 4, 1),), "mean": ((2, 4, 1),), "add": ((2, 4, 1), (1, 1, 1)), "rsqrt": ((2, 4, 1),),
                 "scale": ((2, 4, 1), (2, 4, 1)), "weigh": ((2, 4, 1), (1,))}
    column = {"in": ((2, 1), (4, 1)), "out": None}
    want = {**golden(2, 4, 8, 4, (2, 4, 1, 1, 1)), A + "wg.matmul": column, A + "wz.matmul": column,
            A + "wb.matmul": column, A + "wa.matmul": column,
            **{f"{A}{w}_norm.core.{prim}": {"in": s, "out": None} for w in "qk" for prim, s in head_norm.items()}}
    assert L.op_strategies(m, sh) == want
    shapes = L.param_shapes(m)
    held = {"layers.0.attention.wq.weight": (512, 4096), "layers.0.attention.wk.weight": (512, 4096),
            "layers.0.attention.wv.weight": (1024, 4096), "layers.0.attention.wz.weight": (1024, 4096),
            "layers.0.attention.wb.weight": (8, 4096), "layers.0.attention.conv_q.weight": (512, 1, 4),
            "layers.0.attention.conv_v.weight": (1024, 1, 4), "layers.0.attention.A_log": (8,),
            "layers.0.attention.dt_bias": (8,), "layers.0.attention.norm.weight": (128,),
            "layers.0.attention.wo.weight": (4096, 1024), "layers.3.attention.wk.weight": (256, 4096),
            "layers.3.attention.wg.weight": (1024, 4096)}
    assert {p: L.shard_shape(shapes[p], L.param_entry(p)[0], sh) for p in held} == held
    for tp, why in ((32, "model.linear_num_key_heads (16 % 32"), (8, "model.num_kv_heads (4 % 8")):
        with pytest.raises(ConfigError, match=rf"parallel.tp: must divide {re.escape(why)}"):
            check_parallel(load_config(REPO / "configs" / "qwen3_5_9b.yaml", [f"parallel.tp={tp}"]), devices=tp)

    ms.set_context(mode=ms.PYNATIVE_MODE)
    spec = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=32,
                max_seq_len=16, qk_norm=True, attn_output_gate=True, norm_offset=1.0, layer_types=["linear", "full"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    tiny = config_from_dict({"model": spec, "data": {"seq_len": 8}, "train": {"batch_size": 2},
                             "parallel": {"dp": 2, "tp": 2, "sequence_parallel": True}})
    check_parallel(tiny, 4)
    net = Llama(tiny.model)
    rng = np.random.default_rng(4)
    for p in net.get_parameters():
        p.set_data(Tensor(rng.normal(0, 0.3, p.shape).astype(np.float32)))
    ids = Tensor(rng.integers(0, 64, (4, 8)).astype(np.int32))
    plain = net(ids).asnumpy()
    applied = ascend.specialise(net, tiny)  # raises on a required row the model lacks
    assert applied[A + "wz.matmul"] == applied[A + "wg.matmul"] == 1 and applied[A + "wo.matmul"] == 2
    np.testing.assert_allclose(net(ids).asnumpy(), plain, rtol=1e-5, atol=1e-5)


def test_gpt_oss_is_laid_out_over_tp_and_ep_and_its_sinks_stay_refused_on_ascend():
    """gpt-oss-20b on 64 devices (dp 8 with ep 8, tp 8, sequence parallel): q / k / v and their biases cut by
    heads (8 KV heads, one a tp rank), wo's bias whole (added once after the row reduction), the router and
    its bias whole, the experts and their biases over ep (4 of 32 a rank). Its attention sinks stay refused
    on Ascend in one line with the reason: FlashAttentionScore takes no sink column."""
    from msllm.config import ConfigError

    overrides = ["train.device=ascend", "parallel.dp=8", "parallel.tp=8", "parallel.ep=8",
                 "parallel.sequence_parallel=true", "train.batch_size=1", "train.moe_capacity_factor=1.25"]
    with pytest.raises(ConfigError, match="model.attention_sinks: not built for Ascend: MindSpore 2.10's "
                                          "FlashAttentionScore takes no sink logit per head"):
        load_config(REPO / "configs" / "gpt_oss_20b.yaml", overrides)
    cfg = load_config(REPO / "configs" / "gpt_oss_20b.yaml", overrides + ["model.attention_sinks=false"])
    check_parallel(cfg, devices=64)
    sh, shapes = L.sharding(cfg.model, cfg.parallel), L.param_shapes(cfg.model)
    want = {"layers.0.attention.wq.weight": (512, 2880), "layers.0.attention.wq.bias": (512,),
            "layers.0.attention.wk.bias": (64,), "layers.0.attention.wo.weight": (2880, 512),
            "layers.0.attention.wo.bias": (2880,), "layers.0.feed_forward.router.weight": (32, 2880),
            "layers.0.feed_forward.router.bias": (32,), "layers.0.feed_forward.experts.w1": (4, 2880, 2880),
            "layers.0.feed_forward.experts.b1.bias": (4, 2880), "layers.0.feed_forward.experts.b2.bias": (4, 2880)}
    assert {p: L.shard_shape(shapes[p], L.param_entry(p)[0], sh) for p in want} == want
    got = {k: v["in"] for k, v in L.op_strategies(cfg.model, sh).items()}
    assert got[F + "experts.matmul"] == ((8, 1, 1), (8, 1, 1)) and got[A + "wk.matmul"] == ((8, 1), (8, 1))
