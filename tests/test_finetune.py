"""Fine-tuning migrated models end to end: HF dir -> train --init-from (LoRA on SFT rows, or full)
-> resume, merge, PEFT export, convert back to HF, verify, ONNX export, generate."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import run_cli
from tests.hf_models import build, save_tokenizer


def sets(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus):
    """A tiny random Qwen2 (qkv bias, tied embeddings) as users bring it: weights, config, tokenizer
    with a chat template; and SFT rows of both kinds."""
    root = tmp_path_factory.mktemp("finetune")
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))[:6]]
    build("qwen2_bias_tied").save_pretrained(root / "hf")
    save_tokenizer(root / "hf", texts)
    rows = []
    for i in range(48):
        rows.append({"prompt": f"def f{i % 7}(x):", "response": f" return x + {i % 5}"})
        rows.append({"messages": [{"role": "user", "content": f"add {i % 7} {i % 5}"},
                                  {"role": "assistant", "content": str(i % 7 + i % 5)}]})
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def lora_args(base, run, **extra):
    values = {"data.path": base / "sft.jsonl", "data.seq_len": 48, "train.run_dir": run, "train.steps": 6,
              "train.batch_size": 4, "train.log_every": 1, "train.eval_every": 3, "train.ckpt_every": 3,
              "train.sample_tokens": 0, "optim.lr": 1e-2, "optim.warmup_steps": 0, "optim.decay": "constant", "lora.rank": 4,
              "lora.targets": "[q, k, v, o, gate, up, down]", **extra}
    return ["train", "--init-from", str(base / "hf"), *sets(values)]


def train_here(*args):
    """msllm train in this process (the test session's MindSpore runtime): no second start-up."""
    from msllm.cli import main

    assert main([str(a) for a in args]) == 0


def records(run, kind):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def losses(run):
    return {r["step"]: r["loss"] for r in records(run, "train") + records(run, "compile")}


@pytest.fixture(scope="module")
def lora_run(base):
    run = base / "lora_run"
    train_here(*lora_args(base, run))
    return run


def test_lora_run_learns_the_responses_with_a_frozen_base(base, lora_run):
    curve = losses(lora_run)
    evals = [r["val_loss"] for r in records(lora_run, "eval")]
    assert curve[6] < curve[1] - 0.3 and evals[1] < evals[0]   # the response loss falls
    ckpt = lora_run / "checkpoints" / "step_0000006"
    adapters = load_file(str(ckpt / "model.safetensors"))
    assert len(adapters) == 2 * 7 * 2 and all(n.endswith((".lora_a", ".lora_b")) for n in adapters)
    assert adapters["layers.1.feed_forward.w2.lora_a"].shape == (4, 96)
    # Adam moments exist for the adapters only: the base has no optimizer state
    optim = load_file(str(ckpt / "optim.safetensors"))
    assert sorted(optim) == sorted(["optimizer.step"] + [f"exp_avg{s}.{n}" for s in ("", "_sq") for n in adapters])
    state = json.loads((ckpt / "state.json").read_text())
    assert state["lora_base"]["path"] == str((base / "hf").resolve()) and len(state["lora_base"]["sha256"]) == 64
    # what needs a full model says to merge first
    from interop import InteropError
    from interop.convert import convert
    from msllm.checkpoint import CheckpointError, load_model
    with pytest.raises(CheckpointError, match="lora merge"):
        load_model(lora_run)
    with pytest.raises(InteropError, match="lora merge"):
        convert(lora_run, base / "never", progress=False)


def test_lora_resume_is_exact(base, lora_run, tmp_path):
    run = tmp_path / "resumed"
    train_here(*lora_args(base, run, **{"train.steps": 3}))
    train_here("train", "--resume", run, "--set", "train.steps=6")
    assert losses(run) == losses(lora_run)
    a, b = (load_file(str(r / "checkpoints" / "step_0000006" / "model.safetensors")) for r in (lora_run, run))
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def msllm_logits(ckpt, ids):
    import mindspore as ms

    from msllm.checkpoint import load_model
    _, model, _, _ = load_model(ckpt)
    return model(ms.Tensor(ids.astype(np.int32))).asnumpy()


def test_merge_then_convert_export_generate_and_peft_equals_merged(base, lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from graph_opt.export import export
    from interop.convert import convert
    from interop.pretrained import export_peft, merge

    merged = merge(lora_run, tmp_path / "merged")
    ids = np.random.default_rng(0).integers(0, 300, (2, 16))
    ours = msllm_logits(merged, ids)
    convert(merged, tmp_path / "hf_out", to="hf", progress=False)
    assert json.loads((tmp_path / "hf_out" / "config.json").read_text()) == \
        json.loads((base / "hf" / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    # The un-merged adapter, loaded by PEFT on the original HF model, computes the merged model.
    export_peft(lora_run, tmp_path / "peft")
    original = AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        before = original(torch.from_numpy(ids)).logits.numpy()
        peft_logits = PeftModel.from_pretrained(original, tmp_path / "peft").eval()(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(peft_logits - ours).max() <= 1e-5 * np.abs(peft_logits).max()
    assert np.abs(before - ours).max() > 1e-2  # training moved the model: the comparison can fail
    export(merged, "onnx", tmp_path / "onnx", log=lambda line: None)
    proc = run_cli("generate", "--engine", "onnxruntime", "--ckpt", str(tmp_path / "onnx"), "--prompt", "def f1(x):",
                   "--max-new-tokens", "4")
    assert proc.returncode == 0 and proc.stdout.startswith("def f1(x):"), proc.stderr[-2000:]


def test_peft_adapter_continues_and_wrong_base_is_refused(base, lora_run, tmp_path):
    from interop import InteropError
    from interop.pretrained import InitFrom, describe, export_peft
    from msllm.config_file import load_config
    from msllm.lora import adapter_params, apply_lora
    from msllm.models.decoder import Llama

    export_peft(lora_run, tmp_path / "peft")
    cfg = load_config(None, [f"train.init_from={base / 'hf'}", f"train.lora_from={tmp_path / 'peft'}",
                             "data.seq_len=48"], pretrained=describe)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (4, 16.0, ["q", "k", "v", "o", "gate", "up", "down"])
    model = Llama(cfg.model)
    init = InitFrom(cfg)
    init.load_base(model.trainable_params())
    apply_lora(model, cfg.lora, seed=7)
    init.load_adapter(adapter_params(model))
    trained = load_file(str(lora_run / "checkpoints" / "step_0000006" / "model.safetensors"))
    assert all(np.array_equal(p.asnumpy(), trained[p.name]) for p in adapter_params(model))
    other = tmp_path / "other"
    build("qwen2_bias_tied", seed=1).save_pretrained(other)
    cfg.train.init_from = str(other)
    with pytest.raises(InteropError, match="adapter trained on another base"):
        InitFrom(cfg)


def test_full_finetune_from_hf_converts_back_and_verifies(base, corpus, tmp_path):
    from interop.convert import convert
    from interop.verify import verify

    hf = tmp_path / "llama"
    build("llama3_gqa_rope_scaling").save_pretrained(hf)
    save_tokenizer(hf, [p.read_text() for p in sorted(corpus.glob("*.py"))[:6]])
    run = tmp_path / "full"
    proc = run_cli("train", "--init-from", str(hf), *sets({
        "data.path": corpus, "data.seq_len": 32, "model.max_seq_len": 32, "train.run_dir": run, "train.steps": 3,
        "train.batch_size": 2, "train.eval_every": 3, "train.ckpt_every": 3, "train.sample_tokens": 0,
        "optim.warmup_steps": 0}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained byte-level BPE" not in proc.stderr  # the model's own tokenizer, not a new one
    convert(run, tmp_path / "back", to="hf", progress=False)
    report = verify(tmp_path / "back", run)
    assert report.ok, "\n".join(report.lines())
    # It started from the HF weights: 3 AdamW steps of lr <= 3e-3 move each weight by at most ~1e-2.
    start, end = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    moved = np.abs(end[name] - start[name]).max()
    assert 0 < moved < 2e-2


def test_config_follows_the_source(base):
    from interop.pretrained import describe
    from msllm.config import ConfigError
    from msllm.config_file import load_config

    hf = str(base / "hf")
    cfg = load_config(None, [f"train.init_from={hf}", "data.seq_len=32", "model.max_seq_len=32"], pretrained=describe)
    assert (cfg.model.hidden_size, cfg.model.qkv_bias, cfg.model.tie_embeddings, cfg.model.max_seq_len) == \
        (64, True, True, 32)
    assert cfg.data.tokenizer == str((base / "hf" / "tokenizer.json").resolve())
    with pytest.raises(ConfigError, match=r"--set: model.hidden_size: 32 contradicts 64 of .*hf"):
        load_config(None, [f"train.init_from={hf}", "data.seq_len=32", "model.hidden_size=32"], pretrained=describe)
    with pytest.raises(ConfigError, match=r"model.max_seq_len: 128 contradicts 64"):
        load_config(None, [f"train.init_from={hf}", "model.max_seq_len=128"], pretrained=describe)


def test_every_source_layout_loads_the_same_weights(base, tmp_path):
    """HF safetensors (one file, shards), .bin (sharded), an msllm checkpoint and a MindFormers dir
    all stream the same tensors into the model's Parameters."""
    from interop.convert import convert
    from interop.pretrained import PretrainedWeights
    from msllm.models.decoder import Llama
    from tests.hf_models import save_bin

    model = build("qwen2_bias_tied")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    save_bin(model, tmp_path / "bin", shards=2)
    convert(base / "hf", tmp_path / "msllm", progress=False)
    convert(base / "hf", tmp_path / "mf", to="mindformers", progress=False)
    loaded = []
    for source in (base / "hf", tmp_path / "sharded", tmp_path / "bin", tmp_path / "msllm", tmp_path / "mf"):
        weights = PretrainedWeights(source)
        target = Llama(weights.model)
        weights.load(target.trainable_params())
        loaded.append({p.name: p.asnumpy() for p in target.trainable_params()})
    hf = model.state_dict()
    assert np.array_equal(loaded[0]["layers.1.attention.wk.bias"], hf["model.layers.1.self_attn.k_proj.bias"].numpy())
    assert np.array_equal(loaded[0]["norm.weight"], hf["model.norm.weight"].numpy())
    for other in loaded[1:]:
        assert other.keys() == loaded[0].keys() and all(np.array_equal(other[n], loaded[0][n]) for n in other)
