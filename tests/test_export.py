"""msllm export: MindIR and ONNX reload and match the msllm model; cached generation on every engine
equals full recompute; ONNX clean-up keeps outputs; bad inputs are one-line errors that write nothing."""
import json
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from graph_opt import export as export_mod
from graph_opt.export import export
from graph_opt.onnx_decoder import build_graph
from graph_opt.onnx_passes import clean_up
from graph_opt import ExportError
from msllm.inference import cell_engine
from msllm import checkpoint, device
from msllm.config import Config, ModelConfig
from msllm.data.tokenizer import load_tokenizer, train_tokenizer
from msllm.checkpoint import load_model
from msllm.generate import Sampling, generate, generate_ids
from msllm.models.decoder import build_model
from msllm.staged import DiskFullError
from tests.conftest import REPO, leave_free, needed_bytes, run_cli
from tests.numerics import REORDER_RTOL

LLAMA = ModelConfig(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128,
                    max_seq_len=32)
# Qwen2-style qkv bias and tied embeddings, with llama3 rope scaling: the optional paths of the builders. The
# first layer slides (Qwen2's use_sliding_window) with a window of 4, below the prompts export verifies with
# (up to 8 tokens, then decode steps): its cache is a ring of 4 slots in every engine, the full layer's all of them.
QWEN = ModelConfig(vocab_size=384, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, ffn_size=96,
                   max_seq_len=32, qkv_bias=True, tie_embeddings=True, norm_eps=1e-6,
                   rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8},
                   sliding_window=4, layer_types=["sliding", "full"])


def make_run(root, model_cfg: ModelConfig, corpus):
    """A run dir as msllm train leaves it: checkpoint (random weights, random biases) + tokenizer."""
    device.setup("cpu", "pynative")
    cfg = Config(model=model_cfg)
    cfg.data.seq_len = 16
    model = build_model(model_cfg, seed=5)
    rng = np.random.default_rng(5)
    for p in model.trainable_params():
        if p.name.endswith("bias"):
            p.set_data(ms.Tensor(rng.normal(0, 0.1, p.shape).astype(np.float32)))
    (root / "data").mkdir(parents=True)
    texts = [f.read_text() for f in sorted(corpus.glob("*.py"))[:5]]
    train_tokenizer(texts, model_cfg.vocab_size).save(str(root / "data" / "tokenizer.json"))
    checkpoint.save(root, 1, model.trainable_params(), [],
                    {"config": cfg.to_dict(), "tokenizer": str(root / "data" / "tokenizer.json")})
    return root


# llama_run and llama_exports (its fp32 exports, written once by the CLI): tests/conftest.py, shared
# with tests/test_bad_inputs.py and tests/test_cli_signals.py.


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory, corpus):
    return make_run(tmp_path_factory.mktemp("qwen"), QWEN, corpus)


@pytest.fixture(scope="module")
def qwen_exports(qwen_run, tmp_path_factory):
    """fmt -> (export dir, manifest): qwen_run's fp32 export, written once per format for the tests
    that only read it."""
    made = {}

    def get(fmt: str):
        if fmt not in made:
            out = tmp_path_factory.mktemp(f"qwen-{fmt}") / "export"
            made[fmt] = (out, export(qwen_run, fmt, out, log=lambda line: None))
        out, manifest = made[fmt]
        return out, json.loads(json.dumps(manifest))  # a copy the test may change

    return get


def reference_logits(run, ids):
    device.setup("cpu", "pynative")
    _, model, _, _ = load_model(run)
    return model(ms.Tensor(ids.astype(np.int32))).asnumpy()


INPUTS = [np.random.default_rng(1).integers(0, 384, shape) for shape in ((1, 3), (3, 17))]


@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
def test_export_reloads_and_matches_at_two_lengths(qwen_run, qwen_exports, fmt):
    out, manifest = qwen_exports(fmt)
    cached = "cached.onnx" if fmt == "onnx" else "cached_graph.mindir"
    graphs = (["model.onnx", cached, "weights.onnx.data"] if fmt == "onnx" else
              ["model_graph.mindir", "model_variables", cached, "cached_variables"])
    assert sorted(p.name for p in out.iterdir()) == sorted(graphs + ["export.json", "tokenizer.json"])
    assert manifest["files"]["prefill"] == manifest["files"]["decode"] == cached  # one graph serves both
    assert json.loads((out / "export.json").read_text())["max_abs_diff"] == manifest["max_abs_diff"]
    # fp32 exports of the same maths, summed in other orders: numerics.REORDER_RTOL of the logits' scale.
    scale = manifest["tolerance"] / export_mod.TOLERANCE["fp32"]  # max(1, max|logits|) of the verification
    assert max(manifest["max_abs_diff"].values()) <= REORDER_RTOL * scale
    if fmt == "onnx":
        onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
        session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        run = lambda ids: session.run(None, {"input_ids": ids})[0]  # noqa: E731
    else:
        graph = ms.nn.GraphCell(ms.load(str(out / "model_graph.mindir")))
        run = lambda ids: graph(ms.Tensor(ids.astype(np.int32))).asnumpy()  # noqa: E731
    for ids in INPUTS:  # one file, two batch sizes and lengths
        ref = reference_logits(qwen_run, ids)
        np.testing.assert_allclose(run(ids), ref, rtol=0, atol=REORDER_RTOL * np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
def test_fp16_export_within_tolerance(llama_run, tmp_path, fmt):
    manifest = export(llama_run, fmt, tmp_path / "half", dtype="fp16", log=lambda line: None)
    assert 0 < max(manifest["max_abs_diff"].values()) <= manifest["tolerance"]
    if fmt == "onnx":
        model = onnx.load(str(tmp_path / "half" / "cached.onnx"))
        assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input}["past_keys"] == onnx.TensorProto.FLOAT16


@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
def test_cli_export_never_loads_mindspore_and_its_workers_are_quiet(llama_exports, fmt):
    """`msllm export` as tests/conftest.py's llama_exports ran it (no GLOG_v, no --verbose).
    MindSpore keeps an exported or loaded graph's memory until its process ends: the export's own
    process must not import it (nor torch); workers write and verify, their progress lines reach
    stdout in order, and their MindSpore log and Python warnings stay off the terminal."""
    out, proc = llama_exports(fmt)
    assert proc.stderr == "", proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "[]"  # the modules the exporting process imported, of mindspore and torch
    if fmt == "mindir":
        assert lines[:2] == ["wrote model_graph.mindir", "wrote cached_graph.mindir"]
    else:
        assert any(x.startswith("onnx clean-up cached:") for x in lines) and "onnx.checker ok" in proc.stdout
    assert lines[-3].startswith("verified: max|diff|") and lines[-2].startswith(f"exported {fmt} (fp32)")
    assert json.loads((out / "export.json").read_text())["max_abs_diff"]


def test_cli_generate_on_the_mindir_engine(llama_run, llama_exports):
    """`msllm generate --engine mindir` through the CLI, in its own process, on the CLI's export:
    the greedy continuation of the default prompt the msllm model computes (full recompute), cut at
    the run's EOS, and the one summary line on stderr."""
    out, _ = llama_exports("mindir")
    proc = run_cli("generate", "--engine", "mindir", "--ckpt", str(out), "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    device.setup("cpu", "pynative")
    _, model, _, _ = load_model(llama_run)
    tokenizer = load_tokenizer(llama_run / "data" / "tokenizer.json")
    prompt = tokenizer.encode("def ").ids
    new = generate_ids(model, prompt, 12)[len(prompt):]
    eos = tokenizer.token_to_id("<|endoftext|>")
    new = new[:new.index(eos)] if eos in new else new
    assert proc.stdout == "def " + tokenizer.decode(new, skip_special_tokens=False) + "\n"
    assert proc.stderr.strip().splitlines()[-1].startswith(f"msllm generate: {len(prompt)} prompt tokens, ")


def test_prefill_and_decode_share_one_session_and_older_exports_still_load(llama_exports, tmp_path):
    """The cached graph is loaded once for prefill and decode; an export from before it (separate
    prefill.onnx and decode.onnx, as export.json names them) still generates the same tokens."""
    import shutil

    from graph_opt.runtime import export_engine

    out, _ = llama_exports("onnx")
    manifest = json.loads((out / "export.json").read_text())
    engine = export_engine(out, manifest)
    prompts = [[5, 6, 7], [8]]
    first = engine.start(prompts, 4)
    assert engine.graph("prefill") is engine.graph("decode")
    steps = [engine.step([1, 2]) for _ in range(3)]

    old = tmp_path / "old"
    shutil.copytree(out, old)
    for kind in ("prefill", "decode"):
        shutil.copyfile(out / "cached.onnx", old / f"{kind}.onnx")
        manifest["files"][kind] = f"{kind}.onnx"
        manifest["sizes"][f"{kind}.onnx"] = (out / "cached.onnx").stat().st_size
    (old / "cached.onnx").unlink()
    del manifest["sizes"]["cached.onnx"]
    old_engine = export_engine(old, manifest)
    np.testing.assert_array_equal(old_engine.start(prompts, 4), first)
    assert old_engine.graph("prefill") is not old_engine.graph("decode")
    for want in steps:
        np.testing.assert_array_equal(old_engine.step([1, 2]), want)


def test_an_export_from_before_the_rings_is_refused_in_one_line(qwen_exports):
    """An export of a model with sliding layers written before their caches were rings (export.json names no
    caches: its graphs take every layer's keys and values) is refused before anything runs."""
    from graph_opt.runtime import export_engine

    out, manifest = qwen_exports("onnx")
    assert manifest["caches"] == ["keys", "values", "ring_keys", "ring_values"]
    del manifest["caches"]
    with pytest.raises(ExportError, match=r"takes the caches keys, values, this msllm gives keys, values, ring_keys, "
                                          r"ring_values \(sliding layers keep a ring\); export the run again$") as err:
        export_engine(out, manifest)
    assert "\n" not in str(err.value)


def test_mindir_weights_are_stored_once_outside_the_graphs(qwen_exports):
    out, manifest = qwen_exports("mindir")
    weights = [out / f"{name}_variables" / "data_0" for name in ("model", "cached")]
    assert weights[0].stat().st_size > 4 * QWEN.num_params()
    assert os.path.samefile(*weights)  # one file, linked under both graphs' names
    for name in ("model", "cached"):  # no weights inside: with them a graph file would pass data_0's size
        assert (out / f"{name}_graph.mindir").stat().st_size < weights[0].stat().st_size
    assert manifest["sizes"]["cached_variables/data_0"] == weights[0].stat().st_size


def test_onnx_weights_are_written_once_or_embedded_on_request(qwen_run, qwen_exports, tmp_path, monkeypatch):
    out, _ = qwen_exports("onnx")
    weights = (out / "weights.onnx.data").stat().st_size
    assert weights > 4 * QWEN.num_params() * 0.99
    for kind in ("model", "cached"):  # the graphs point at the one data file
        assert (out / f"{kind}.onnx").stat().st_size < weights / 10
    embedded = tmp_path / "embedded"
    export(qwen_run, "onnx", embedded, embed_weights=True, log=lambda line: None)
    assert sorted(p.name for p in embedded.glob("*.onnx*")) == ["cached.onnx", "model.onnx"]
    for kind in ("model", "cached"):  # self-contained files
        assert (embedded / f"{kind}.onnx").stat().st_size > weights
    ids = INPUTS[1]
    ref = reference_logits(qwen_run, ids)
    for folder in (out, embedded):
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        got = session.run(None, {"input_ids": ids})[0]
        np.testing.assert_allclose(got, ref, rtol=0, atol=REORDER_RTOL * np.abs(ref).max())

    monkeypatch.setattr(export_mod, "PROTOBUF_LIMIT", 1000)  # as if the weights were over 2 GB
    with pytest.raises(ExportError, match=r"^--embed-weights: .* do not fit in one ONNX file .* export without it"):
        export(qwen_run, "onnx", tmp_path / "big", embed_weights=True, log=lambda line: None)
    with pytest.raises(ExportError, match=r"^--embed-weights: only for --format onnx"):
        export(qwen_run, "mindir", tmp_path / "big", embed_weights=True, log=lambda line: None)
    assert not (tmp_path / "big").exists()


def test_clean_up_keeps_outputs(qwen_run):
    _, model, _, _ = load_model(qwen_run)
    weights = {p.name: p.asnumpy() for p in model.trainable_params()}
    raw, cleaned = build_graph(QWEN, weights, "cached"), build_graph(QWEN, weights, "cached")
    before, after = clean_up(cleaned)
    assert sum(after.values()) < sum(before.values()) and after["Constant"] == 0
    assert after["Cast"] == 1  # of the no-op casts none is left; RoPE's positions to fp32 is a real one
    rng = np.random.default_rng(2)
    feeds = {"input_ids": rng.integers(0, 384, (2, 3)), "start": np.array([3]), "pad": np.array([0, 1])}
    for name, shape in QWEN.caches(2, 7).items():  # the full layer's 7 slots, the sliding one's ring of 4
        feeds[f"past_{name}"] = rng.normal(size=shape).astype(np.float32)
    assert feeds["past_keys"].shape == (1, 2, 2, 7, 8) and feeds["past_ring_keys"].shape == (1, 2, 2, 4, 8)
    results = [ort.InferenceSession(ir.to_proto(m).SerializeToString(), providers=["CPUExecutionProvider"])
               .run(None, feeds) for m in (raw, cleaned)]
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=0, atol=REORDER_RTOL * np.abs(a).max())


def test_onnx_initializers_are_the_checkpoint_parameters(qwen_run):
    """The ONNX initializers are the checkpoint's parameters under their own names (plus RoPE's
    inverse frequencies); a parameter the graph does not compute is refused rather than exported as another model."""
    _, model, _, _ = load_model(qwen_run)
    weights = {p.name: p.asnumpy() for p in model.trainable_params()}
    frequencies = {"rope_inv_freq", "rope_inv_freq_1"}  # the full and the sliding kind's
    assert set(build_graph(QWEN, weights, "model").graph.initializers) == set(weights) | frequencies

    weights.update({f"layers.{i}.attention.extra_norm.weight": np.ones(64, np.float32) for i in range(2)})
    with pytest.raises(ValueError, match=r"does not use \['layers.0.attention.extra_norm.weight'"):
        build_graph(QWEN, weights, "model")


def test_cached_generation_equals_full_recompute(qwen_run):
    """Greedy, top-k and top-p, up to the last position of the context."""
    device.setup("cpu", "pynative")
    _, model, _, _ = load_model(qwen_run)
    prompt = np.random.default_rng(3).integers(0, QWEN.vocab_size, QWEN.max_seq_len - 6).tolist()  # 6 short of full
    for sampling in (Sampling(), Sampling(top_k=5), Sampling(top_p=0.9, temperature=0.7, seed=1)):
        full = generate_ids(model, prompt, 6, sampling)
        cached = generate(cell_engine(model), [prompt], 6, sampling)
        assert prompt + cached.ids[0] == full


@pytest.mark.skipif(not os.environ.get("MSLLM_BY_HAND"), reason="by hand (MSLLM_BY_HAND=1): beyond CI's budget "
                    "(CI runs the mindir engine's CLI: test_cli_generate_on_the_mindir_engine)")
def test_cli_generate_on_every_engine(llama_run, llama_exports):
    device.setup("cpu", "pynative")
    _, model, _, _ = load_model(llama_run)
    outputs = {}
    for fmt, engine in (("onnx", "onnxruntime"), ("mindir", "mindir")):
        out, _ = llama_exports(fmt)  # written by the CLI (test_cli_export_never_loads_mindspore_and_...)
        outputs[engine] = run_cli("generate", "--engine", engine, "--ckpt", str(out), "--max-new-tokens", "12")
    # the onnxruntime engine's process never imports MindSpore (~0.4 GB and ~2 s of start-up)
    script = ("import sys; from msllm.cli import main; code = main(['generate', '--engine', 'onnxruntime', '--ckpt', "
              f"{str(llama_exports('onnx')[0])!r}, '--max-new-tokens', '12']); "
              "print(sorted(m for m in ('mindspore', 'torch') if m in sys.modules)); sys.exit(code)")
    alone = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and alone.stdout.splitlines()[-1] == "[]", alone.stderr[-2000:]
    assert alone.stdout.splitlines()[:-1] == outputs["onnxruntime"].stdout.splitlines()
    outputs["msllm"] = run_cli("generate", "--engine", "msllm", "--ckpt", str(llama_run), "--max-new-tokens", "12")
    assert all(p.returncode == 0 for p in outputs.values()), [p.stderr[-1000:] for p in outputs.values()]
    assert len({p.stdout for p in outputs.values()}) == 1
    tokenizer = load_tokenizer(llama_run / "data" / "tokenizer.json")
    prompt = tokenizer.encode("def ").ids
    new = generate_ids(model, prompt, 12)[len(prompt):]
    eos = tokenizer.token_to_id("<|endoftext|>")  # the run's EOS ends generation
    new = new[:new.index(eos)] if eos in new else new
    assert outputs["msllm"].stdout == "def " + tokenizer.decode(new, skip_special_tokens=False) + "\n"


def one_line_error(proc, command="export"):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) >= 1, proc.stderr[-2000:]
    assert lines[-1].startswith(f"msllm {command}: error: ")
    assert "Traceback" not in proc.stderr
    return lines[-1]


def test_bad_inputs_are_one_line_and_write_nothing(llama_run, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run_cli("export", "--ckpt", str(tmp_path / "missing"), "--format", "onnx", "--out", str(out)))
    assert "no checkpoint found" in line
    line = one_line_error(run_cli("export", "--ckpt", str(llama_run), "--format", "tflite", "--out", str(out)))
    assert "argument --format: invalid choice: 'tflite'" in line
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    line = one_line_error(run_cli("export", "--ckpt", str(llama_run), "--format", "onnx",
                                  "--out", str(blocker / "export")))
    assert f"parent {blocker} is a file, not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    out.mkdir()
    line = one_line_error(run_cli("export", "--ckpt", str(llama_run), "--format", "onnx", "--out", str(out)))
    assert "already exists (--force replaces it)" in line and not list(out.iterdir())
    line = one_line_error(run_cli("generate", "--engine", "onnxruntime", "--ckpt", str(llama_run)), "generate")
    assert "not an msllm export (no export.json)" in line


def test_failed_verification_writes_nothing(llama_run, tmp_path, monkeypatch):
    monkeypatch.setitem(export_mod.TOLERANCE, "fp32", 0.0)
    with pytest.raises(ExportError, match="verification failed"):
        export(llama_run, "onnx", tmp_path / "out", log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["onnx", "mindir"])
def test_full_disk_keeps_the_previous_export(llama_run, small_disk, fmt):
    """Out of space while writing the graphs (--force over an earlier export): one line naming OUT
    and at least the space of the fp32 weights (written once in ONNX, under both graphs' names in MindIR),
    no temporary dir, the earlier export kept."""
    out = small_disk / "out"
    out.mkdir()
    (out / "export.json").write_text("an earlier export")
    leave_free(small_disk, 64 * 1024)
    with pytest.raises(DiskFullError) as e:
        export(llama_run, fmt, out, force=True, log=lambda line: None)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{out}: no space left on the device")
    assert needed_bytes(message) >= (1 if fmt == "onnx" else 2) * 4 * LLAMA.num_params()
    assert (out / "export.json").read_text() == "an earlier export" and len(list(out.iterdir())) == 1
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out"]
