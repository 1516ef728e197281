"""Where each layout keeps its files: open a checkpoint as a Source, plan a destination's files.

  hf           DIR/config.json + model.safetensors | model-0000k-of-0000N.safetensors + index
               | pytorch_model.bin | pytorch_model-0000k-of-0000N.bin + index  [+ tokenizer files];
               MXFP4 experts (quantization_config) read dequantized (formats/mxfp4.py)
  msllm        DIR/model.safetensors + state.json (a full msllm Config) [+ tokenizer.json], or a run dir
  mindformers  DIR/model.ckpt | DIR/model.safetensors + model_config.json (msllm ModelConfig keys,
               the config tools/mindformers_peer.py reads); or the weights file itself
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from interop import InteropError, read_json
from interop.formats import MultiFileReader
from interop.formats.ms_ckpt import CkptReader, CkptWriter
from interop.formats.mxfp4 import Mxfp4Reader
from interop.formats.safetensors import SafetensorsWriter
from interop.formats.torch_bin import TorchBinReader
from interop.hf_config import architecture, default_architecture, to_model_config
from interop.maps import FAMILIES
from interop.table import holds_mtp
from msllm import checkpoint
from msllm.config import Config
from msllm.config_file import config_from_dict
from msllm.errors import names_line
from msllm.safetensors_reader import SafetensorsReader, TensorInfo

HF_CONFIG, MF_CONFIG = "config.json", "model_config.json"
# (sharded index, single file), in order of preference
HF_WEIGHTS = [("model.safetensors.index.json", "model.safetensors"),
              ("pytorch_model.bin.index.json", "pytorch_model.bin")]
MF_WEIGHTS = ("model.ckpt", "model.safetensors")
# Carried along unchanged from source dir to destination dir, whatever the layouts.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja")
READERS = {".safetensors": SafetensorsReader, ".bin": TorchBinReader, ".pt": TorchBinReader,
           ".pth": TorchBinReader, ".ckpt": CkptReader}
WRITERS = {".safetensors": SafetensorsWriter, ".ckpt": CkptWriter}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # config.json's dtype


@dataclasses.dataclass
class Source:
    path: Path
    layout: str                 # "hf" | "msllm" | "mindformers"
    architecture: str           # HF class name: selects the family table
    config: Config              # full msllm config (model from the checkpoint, the rest defaults)
    reader: object              # lazy tensor reader (interop.formats)
    hf_config: dict | None      # the HF config.json this checkpoint came from, if any
    side_files: list[Path]


def open_file(path: Path):
    if not path.is_file():
        raise InteropError(f"{path}: missing")
    if path.suffix not in READERS:
        raise InteropError(f"{path}: unknown weights format (expected {', '.join(READERS)})")
    return READERS[path.suffix](path)


def detect(path: Path) -> str:
    """Which layout a checkpoint path holds: "hf", "msllm" or "mindformers"."""
    path = Path(path)
    if (path / HF_CONFIG).is_file():
        return "hf"
    if (path / checkpoint.STATE_FILE).is_file() or (path / "checkpoints").is_dir():
        return "msllm"
    if (path / MF_CONFIG).is_file() or (path.is_file() and (path.parent / MF_CONFIG).is_file()):
        return "mindformers"
    what = "does not exist" if not path.exists() else (
        f"not a Hugging Face dir ({HF_CONFIG}), msllm checkpoint ({checkpoint.STATE_FILE}) "
        f"or MindFormers checkpoint ({MF_CONFIG})")
    raise InteropError(f"{path}: {what}")


def open_source(path: str | Path, max_seq_len: int | None = None) -> Source:
    """`max_seq_len` shrinks the context of a model read from an HF config (default: its own)."""
    path = Path(path)
    opener = {"hf": _open_hf, "msllm": _open_msllm, "mindformers": _open_mindformers}[detect(path)]
    return opener(path, max_seq_len)


def model_config(model: dict, source: str) -> Config:
    """A full msllm Config around a model section (train seq_len clipped to fit the model)."""
    seq_len = min(Config().data.seq_len, model.get("max_seq_len", Config().model.max_seq_len))
    return config_from_dict({"model": model, "data": {"seq_len": seq_len}}, source)


def _side_files(folder: Path) -> list[Path]:
    return [folder / name for name in SIDE_FILES if (folder / name).is_file()]


def _open_hf(path: Path, max_seq_len: int | None) -> Source:
    hf = read_json(path / HF_CONFIG)
    model = to_model_config(hf, str(path / HF_CONFIG), max_seq_len)
    for index, single in HF_WEIGHTS:
        if (path / index).is_file():
            reader = _open_sharded(path / index)
            break
        if (path / single).is_file():
            reader = open_file(path / single)
            break
    else:
        raise InteropError(f"{path}: no weights (expected {', '.join(n for pair in HF_WEIGHTS for n in pair)})")
    if hf.get("quantization_config"):  # MXFP4: to_model_config refused the others
        # read full precision, in the dtype transformers would load the model in; written back without it
        reader = Mxfp4Reader(reader, DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"), torch.bfloat16))
        hf = {key: value for key, value in hf.items() if key != "quantization_config"}
    arch = architecture(hf, str(path / HF_CONFIG))
    if model.mtp_depths and not holds_mtp(FAMILIES[arch].table, model, "hf", reader.infos):
        # its config.json counts MTP layers its weights do not hold (transformers saves none): read without
        model = dataclasses.replace(model, mtp_depths=0)
    config = model_config(dataclasses.asdict(model), str(path / HF_CONFIG))
    return Source(path, "hf", arch, config, reader, hf, _side_files(path))


def _open_sharded(index: Path) -> MultiFileReader:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InteropError(f"{index}: no weight_map")
    listed: dict[str, set] = {}
    for name, shard in weight_map.items():
        listed.setdefault(shard, set()).add(name)
    absent = {shard: names for shard, names in listed.items() if not (index.parent / shard).is_file()}
    if absent:
        raise InteropError(f"{index}: missing shard(s) " + "; ".join(
            f"{s} (holds {names_line(n)})" for s, n in sorted(absent.items())))
    readers = [open_file(index.parent / shard) for shard in sorted(listed)]
    wrong = []
    for reader in readers:
        names, present = listed[Path(reader.path).name], set(reader.infos)
        if names != present:
            wrong.append(f"{Path(reader.path).name}: listed but absent {names_line(names - present)}, "
                         f"present but unlisted {names_line(present - names)}")
    if wrong:
        raise InteropError(f"{index}: index does not match its shards: " + "; ".join(wrong))
    return MultiFileReader(index, readers)


def _open_msllm(path: Path, max_seq_len=None) -> Source:
    ckpt = checkpoint.latest(path)
    state = checkpoint.read_state(ckpt)
    config = config_from_dict(state["config"], str(ckpt / checkpoint.STATE_FILE))
    if config.lora.rank > 0:
        raise InteropError(f"{ckpt}: holds LoRA adapters only; `msllm lora merge {path} OUT` makes a full checkpoint "
                           f"(or `msllm lora export ... --format peft` for PEFT)")
    side = _side_files(ckpt)
    trained = Path(state.get("tokenizer") or "")  # msllm train records an absolute path
    if trained.is_absolute() and trained.is_file() and trained.name not in {p.name for p in side}:
        side.append(trained)
    arch = state.get("hf_architecture") or default_architecture(config.model)
    return Source(ckpt, "msllm", arch, config, SafetensorsReader(ckpt / checkpoint.MODEL_FILE),
                  state.get("hf_config"), side)


def _open_mindformers(path: Path, max_seq_len=None) -> Source:
    weights = path if path.is_file() else next((path / n for n in MF_WEIGHTS if (path / n).is_file()), None)
    if weights is None:
        raise InteropError(f"{path}: no weights (expected {' or '.join(MF_WEIGHTS)})")
    config = model_config(read_json(weights.parent / MF_CONFIG), str(weights.parent / MF_CONFIG))
    return Source(weights.parent, "mindformers", default_architecture(config.model), config, open_file(weights),
                  None, _side_files(weights.parent))


def weight_files(layout: str, infos: dict[str, TensorInfo], mf_format: str,
                 max_shard_bytes: int) -> list[tuple[str, dict[str, TensorInfo]]]:
    """The destination's weight files in write order: (file name, the tensors it holds)."""
    if layout == "msllm":
        return [(checkpoint.MODEL_FILE, infos)]
    if layout == "mindformers":
        return [(f"model.{mf_format}", infos)]
    shards, size = [{}], 0
    for name, info in infos.items():
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = info
        size += info.nbytes
    if len(shards) == 1:
        return [("model.safetensors", infos)]
    return [(f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", shard) for k, shard in enumerate(shards)]


def hf_index(files: list[tuple[str, dict[str, TensorInfo]]]) -> dict:
    return {"metadata": {"total_size": sum(i.nbytes for _, infos in files for i in infos.values())},
            "weight_map": {name: file for file, infos in files for name in infos}}
