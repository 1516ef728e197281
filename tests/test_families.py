"""Every family generates what transformers generates: 16 greedy tokens, after a prompt longer than
the sliding window, on the msllm engine (CPU backend, fused decode kernels, GRAPH_MODE) and on the
exported MindIR and ONNX graphs. (Logits and per-layer states: test_interop_convert; train steps:
test_verify_train.)"""
import mindspore as ms
import numpy as np
import pytest
import torch

from graph_opt.export import export
from graph_opt.runtime import export_engine
from interop.convert import convert
from msllm import device
from msllm.backends import specialise
from msllm.checkpoint import load_run
from msllm.generate import generate
from msllm.inference import cell_engine
from tests.hf_models import build, save_tokenizer

NEW_TOKENS, PROMPT = 16, 12
FAMILIES = ["mistral_window", "qwen3", "gemma3", "phi3"]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recompute (no EOS: every step's argmax is kept)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("families")
    texts = [f.read_text() for f in sorted(corpus.glob("*.py"))[:3]]
    out = {}
    for case in FAMILIES:
        model = build(case)
        model.save_pretrained(root / case / "hf")
        save_tokenizer(root / case / "hf", texts)
        convert(root / case / "hf", root / case / "msllm", progress=False)
        prompt = np.random.default_rng(7).integers(3, 300, PROMPT).tolist()
        out[case] = (root / case, prompt, hf_greedy(model, prompt, NEW_TOKENS))
    return out


@pytest.mark.parametrize("case", FAMILIES)
def test_msllm_engine_generates_what_transformers_does(converted, case):
    folder, prompt, want = converted[case]
    device.setup("cpu", "graph")
    cfg, model, _, _ = load_run(folder / "msllm")
    specialise(model, cfg, training=False)
    assert generate(cell_engine(model), [prompt], NEW_TOKENS).ids == [want]


@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
@pytest.mark.parametrize("case", ["qwen3", "gemma3", "phi3"])
def test_exported_graphs_generate_what_transformers_does(converted, tmp_path, case, fmt):
    folder, prompt, want = converted[case]
    manifest = export(folder / "msllm", fmt, tmp_path / fmt, log=lambda line: None)
    device.setup("cpu", "pynative")
    engine = export_engine(tmp_path / fmt, manifest)
    assert generate(engine, [prompt], NEW_TOKENS).ids == [want]


def test_sliding_layers_hide_keys_beyond_the_window(converted):
    """Gemma 3's sliding layers really attend only to their window: the same model with every layer
    full gives other logits once the sequence is longer than the window, and the same ones within it."""
    from dataclasses import replace

    from msllm.models.llama import Llama

    device.setup("cpu", "pynative")
    cfg, model, _, _ = load_run(converted["gemma3"][0] / "msllm")
    assert cfg.model.layer_kinds() == ["sliding", "full", "sliding"] and cfg.model.sliding_window == 8
    full = Llama(replace(cfg.model, layer_types=None, sliding_window=0, rope_local_theta=0.0))
    for p, q in zip(full.trainable_params(), model.trainable_params()):
        p.set_data(q.data)
    ids = ms.Tensor(np.arange(3, 23).reshape(1, 20), ms.int32)
    ours, theirs = model(ids).asnumpy(), full(ids).asnumpy()
    assert np.abs(ours[0, :1] - theirs[0, :1]).max() < 1e-5  # position 0: both RoPE bases agree (angle 0)
    assert np.abs(ours[0, 8:] - theirs[0, 8:]).max() > 1e-3
