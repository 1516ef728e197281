import pytest

from msllm.config import ConfigError

from msllm.config_file import load_config
from tests.conftest import REPO, run_cli


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key", [
    ("model:\n  hiden_size: 64\n", "model.hiden_size"),
    ("model:\n  hidden_size: big\n", "model.hidden_size"),
    ("model:\n  hidden_size: 100\n  num_heads: 3\n", "model.num_heads"),
    ("model:\n  num_heads: 4\n  num_kv_heads: 3\n", "model.num_kv_heads"),
    ("optim:\n  lr: -0.1\n", "optim.lr"),
    ("train:\n  mode: eager\n", "train.mode"),
    ("trainer:\n  steps: 3\n", "trainer"),
    ("data:\n  seq_len: 4096\n", "data.seq_len"),
    ("train:\n  block_graph: shared\n  recompute: full\n", "train.block_graph"),
    ("model:\n  rope_scaling: {type: yarn, factor: 4.0}\n", "model.rope_scaling.original_max_position_embeddings"),
    ("model:\n  attention: mla\n  num_kv_heads: 4\n", "model.kv_lora_rank"),
    ("model:\n  num_experts: 8\n  router: sigmoid_grouped\n  expert_groups: 8\n", "model.expert_groups"),
    ("model:\n  num_layers: 2\n  position_types: [rope, nope]\n", "model.position_types"),
    ("model:\n  num_layers: 2\n  position_types: [none]\n", "model.position_types"),
    ("model:\n  pre_norm: false\n", "model.pre_norm"),
    ("model:\n  qk_norm: true\n  qk_norm_scope: heads\n", "model.qk_norm_scope"),
])
def test_bad_config_names_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert str(err.value).startswith(f"{path}: {key}: ")


def test_yaml_and_overrides_are_applied_in_order(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1.0e-3\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["optim.lr=3e-4", "model.qkv_bias=true"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.train.steps == 7 and cfg.model.qkv_bias is True


def test_bad_override_is_reported_against_set(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set: train.step: unknown key"):
        load_config(None, ["train.step=3"])


def test_shipped_configs_validate():
    paths = sorted((REPO / "configs").glob("*.yaml"))
    assert paths  # an empty glob would pass vacuously
    for path in paths:
        load_config(path)  # raises ConfigError naming the key if a shipped config is invalid


def test_cli_config_error_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, "model:\n  num_heads: 4\n  num_kv_heads: 3\n")
    proc = run_cli("train", "--config", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"msllm train: error: {path}: model.num_kv_heads: must divide model.num_heads (4 % 3 != 0)"]
    assert not (tmp_path / "runs").exists()
