"""Bad inputs stop with one line naming the file and the tensors, and nothing is written."""
import json
import os

import pytest
import torch

from interop import InteropError
from interop.convert import convert
from msllm.cli import main
from msllm.errors import UserError
from msllm.staged import DiskFullError, OutputError
from tests.conftest import leave_free, needed_bytes
from tests.hf_models import build, save_bin


class Payload:
    """Unpickling this runs a shell command, as a malicious checkpoint would."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def model():
    return build("llama2_mha")


@pytest.fixture
def hf(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def fails(src, dst, match, **kw) -> str:
    """Conversion raises one line matching `match`, and leaves no destination or temp dir behind."""
    with pytest.raises(UserError, match=match) as err:
        convert(src, dst, progress=False, **kw)
    assert "\n" not in str(err.value)
    assert not dst.exists() and not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp")]
    return str(err.value)


def test_malicious_pickle_executes_nothing(model, tmp_path):
    marker = tmp_path / "pwned"
    folder = save_bin(model, tmp_path / "evil")
    state = dict(model.state_dict(), extra=Payload(marker))
    torch.save(state, folder / "pytorch_model.bin")
    message = fails(folder, tmp_path / "out", "refused by torch.load\\(weights_only=True\\)")
    assert "pytorch_model.bin" in message and "posix.system" in message
    assert not marker.exists()


def test_truncated_safetensors(hf, tmp_path):
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    message = fails(hf, tmp_path / "out", "truncated")
    assert message.startswith(f"{path}: truncated (") and "lies past the end" in message


def test_wrong_index_and_missing_shard(model, tmp_path):
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = dict(index, weight_map={**index["weight_map"], "model.norm.weight": shards[0]})
    index_path.write_text(json.dumps(wrong))
    fails(tmp_path / "hf", tmp_path / "out", f"index does not match its shards: .*{shards[0]}: listed but absent "
                                             r"\[model.norm.weight\]")
    index_path.write_text(json.dumps(index))
    (tmp_path / "hf" / shards[1]).unlink()
    fails(tmp_path / "hf", tmp_path / "out", f"missing shard\\(s\\) {shards[1]} \\(holds \\[model")


@pytest.mark.parametrize("edit, match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"),
    ({"attention_bias": True}, "attention_bias: msllm has no o_proj or MLP biases"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
])
def test_unsupported_configs(hf, tmp_path, edit, match):
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **edit}))
    assert "config.json" in fails(hf, tmp_path / "out", match)


def test_missing_unexpected_and_misshaped_tensors_are_listed(model, tmp_path):
    state = dict(model.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:8]
    state["model.layers.0.mystery.weight"] = torch.zeros(2)
    model.save_pretrained(tmp_path / "hf", state_dict=state)
    message = fails(tmp_path / "hf", tmp_path / "out", "does not match LlamaForCausalLM")
    assert "missing [model.layers.1.mlp.up_proj.weight]" in message
    assert "unexpected [model.layers.0.mystery.weight]" in message
    assert "wrong shape [model.layers.0.self_attn.k_proj.weight [8, 64] != [64, 64]]" in message


def test_failure_while_writing_leaves_nothing(hf, tmp_path, monkeypatch):
    from msllm.safetensors_reader import SafetensorsReader
    real, calls = SafetensorsReader.read, []

    def flaky(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise InteropError(f"{self.path}: simulated read failure at {name}")
        return real(self, name)

    monkeypatch.setattr(SafetensorsReader, "read", flaky)
    fails(hf, tmp_path / "out", "simulated read failure")


def test_existing_destination_needs_force(hf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    with pytest.raises(OutputError, match="already exists"):
        convert(hf, tmp_path / "out", progress=False)
    convert(hf, tmp_path / "out", progress=False, force=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["generation_config.json", "manifest.json", "model.safetensors",
                                                                    "state.json"]


def test_truncated_ckpt(hf, tmp_path):
    convert(hf, tmp_path / "mf", to="mindformers", progress=False)
    path = tmp_path / "mf" / "model.ckpt"
    path.write_bytes(path.read_bytes()[:-100])
    fails(tmp_path / "mf", tmp_path / "out", f"{path}: truncated or not a MindSpore checkpoint")


def test_cli_prints_one_error_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"msllm convert: error: {tmp_path / 'nothing'}: does not exist"]


@pytest.mark.parametrize("command", ["convert", "export", "generate"])
def test_a_step_dir_given_directly_is_verified_against_its_manifest(tmp_path, capsys, command):
    """Overwritten weight bytes in a checkpoint step dir are refused by every reader, not only resume."""
    from msllm import checkpoint
    from msllm.config import ModelConfig
    from msllm.models.decoder import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_size=48,
                      max_seq_len=16)
    step = checkpoint.save(tmp_path / "run", 3, build_model(cfg, seed=0).trainable_params(), [],
                           {"config": {"model": vars(cfg), "data": {"seq_len": 8}}})
    weights = step / checkpoint.MODEL_FILE
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\x00\x00\x80\x7f" * 2  # two float32 +inf in place of the last weights: same size
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    args = {"convert": ["convert", str(step), str(out)],
            "export": ["export", "--ckpt", str(step), "--format", "onnx", "--out", str(out)],
            "generate": ["generate", "--ckpt", str(step), "--max-new-tokens", "2"]}[command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checksum mismatch" in err[0] and str(step) in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("to", ["msllm", "hf", "mindformers"])
def test_full_disk_keeps_the_previous_output(hf, small_disk, to):
    """Out of space mid-conversion (--force over an earlier output): one line naming the destination
    and the space the tensors need, no temporary dir, the earlier output untouched."""
    out = small_disk / "out"
    convert(hf, out, to=to, dtype="bf16", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    leave_free(small_disk, 64 * 1024)
    with pytest.raises(DiskFullError) as e:
        convert(hf, out, to=to, dtype="fp32", force=True, progress=False)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{out}: no space left on the device")
    weights = sum(len(b) for name, b in before.items() if name.startswith("model."))
    assert needed_bytes(message) >= 2 * weights * 0.99  # fp32 is twice the bf16 weights (size_text rounds)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "out"]


def test_fp16_overflow_is_refused_not_written_as_inf(model, tmp_path):
    state = {name: t.clone() for name, t in model.state_dict().items()}
    state["model.norm.weight"][3] = 1e6  # finite in fp32 and bf16, inf in fp16
    model.save_pretrained(tmp_path / "hf", state_dict=state)
    message = fails(tmp_path / "hf", tmp_path / "out", "norm.weight has values beyond the float16 range", dtype="fp16")
    assert "1e+06" in message and "--dtype bf16 or fp32" in message
    convert(tmp_path / "hf", tmp_path / "out", dtype="bf16", progress=False)  # bf16 holds it
