"""Non-finite localisation: the failing step re-run eagerly names the Cell where values overflowed."""
import dataclasses
import json

import mindspore as ms
import numpy as np

from msllm import checkpoint
from msllm.config import ModelConfig, OptimConfig
from msllm.train import nonfinite
from msllm.train.build import build_train_step
from tests.conftest import step_config

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=96,
                  max_seq_len=64)
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 17)).astype(np.int32)


def failing_step(tmp_path, precision="fp32", **train):
    cfg = step_config(CFG, OptimConfig(), steps=3, run_dir=str(tmp_path / "run"), precision=precision, **train)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16))  # as saved: a valid config
    built = build_train_step(cfg)
    return cfg, built


def test_forward_overflow_names_the_layer_and_writes_a_reproduction(tmp_path, capsys):
    cfg, built = failing_step(tmp_path)
    wv = built.model.layers[1].attention.wv.weight  # its output overflows: |x| ~ 3 times 1e38
    wv.set_data(ms.Tensor(np.sign(wv.asnumpy()) * np.float32(1e38)))
    *_, finite, scale = built.train_step(ms.Tensor(TOKENS))
    assert not bool(finite.asnumpy())  # the compiled step saw it and skipped the update
    result = nonfinite.report(cfg.train.run_dir, 7, built.model, TOKENS, float(scale.asnumpy()), cfg)
    assert ms.get_context("mode") == ms.GRAPH_MODE  # restored: training goes on with the compiled step
    assert not bool(built.train_step(ms.Tensor(TOKENS))[3].asnumpy())
    assert (result["phase"], result["cell"], result["layer"], result["type"]) == ("forward", "layers.1.attention.wv",
                                                                                   1, "Linear")
    (inputs,) = result["inputs"]  # the normed residual stream: finite and small
    assert inputs["nonfinite"] == 0 and 0.5 < inputs["absmax"] < 10
    assert result["params"]["layers.1.attention.wv.weight"]["absmax"] == np.float32(1e38)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("non-finite: step 7: first non-finite forward value at "
                                                   "layers.1.attention.wv (Linear, layer 1)")
    folder = tmp_path / "run" / nonfinite.REPORT_DIR
    assert json.loads((folder / nonfinite.REPORT_FILE).read_text()) == json.loads(json.dumps(result))
    # Reproduce from what was written: the checkpoint's weights and the batch in its state.json.
    _, model, path, state = checkpoint.load_model(folder)
    assert path.name == "step_0000007" and np.array_equal(state["batch"], TOKENS)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        again = nonfinite.locate(model, np.array(state["batch"], np.int32), state["loss_scale"])
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert (again["phase"], again["cell"]) == ("forward", "layers.1.attention.wv")


def test_fp16_backward_overflow_is_located_after_the_loss(tmp_path):
    # (the compiled step's skip on this overflow is tested in test_robustness.py)
    cfg, built = failing_step(tmp_path, "fp16", loss_scale=2.0 ** 100)
    result = nonfinite.report(cfg.train.run_dir, 1, built.model, TOKENS, 2.0 ** 100, cfg)
    # The loss gradient times 2^100 is finite in fp32 and overflows when cast to fp16 for the LM head.
    assert (result["phase"], result["cell"]) == ("backward", "output")
    assert result["tensor"].endswith("already non-finite after loss: the ops between them overflowed")
    assert result["loss_scale"] == 2.0 ** 100 and "loss scale 1.26765e+30" in result["summary"]


def test_finite_step_reports_nothing_and_a_non_finite_weight_is_named_first(tmp_path):
    cfg, built = failing_step(tmp_path)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        assert nonfinite.locate(built.model, TOKENS) is None
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    norm = built.model.layers[0].ffn_norm.weight
    values = norm.asnumpy().copy()
    values[3] = np.nan
    norm.set_data(ms.Tensor(values))
    result = nonfinite.report(cfg.train.run_dir, 2, built.model, TOKENS, 1.0, cfg)
    assert (result["phase"], result["cell"], result["tensor"]) == ("weights", "layers.0.ffn_norm",
                                                                   "layers.0.ffn_norm.weight")
    assert result["params"]["layers.0.ffn_norm.weight"]["nonfinite"] == 1
    assert result["reproduce"]["checkpoint"] is None and "non-finite" in result["reproduce"]["why"]
