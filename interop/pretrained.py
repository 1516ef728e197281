"""Fine-tuning from migrated weights: what `msllm train --init-from` and `msllm lora` read and write.

msllm itself never imports interop; the CLI hands the trainer a `PretrainedWeights` (how to fill
a model's Parameters from the source, streamed one tensor at a time through the family table)
and the config a `Pretrained` description (model section, tokenizer, adapter shape).

A LoRA run's checkpoints hold only the adapters plus the base's path and sha256; `merge` folds
them into the base as a full msllm checkpoint, `export_peft` writes them un-merged in Hugging
Face PEFT's layout (names derived from the same table), `PeftAdapter` reads such a dir back.
"""
from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

import numpy as np
import torch

from interop import InteropError, read_json
from interop.convert import msllm_parameters, parameter_names, plan, write_json
from interop.layouts import Source, open_source
from interop.maps import FAMILIES
from interop.table import entries
from msllm import checkpoint
from msllm.config import Config, LoraConfig, Pretrained
from msllm.safetensors_reader import SafetensorsReader
from msllm.staged import staged_dir

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Architectures whose gate_proj / up_proj / down_proj PEFT (0.21) re-targets to the fused experts
# (its transformers v4 -> v5 MoE conversion), dense MLP layers included
PEFT_RENAMES_MLP = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model: its names sit under this prefix
BASE_SHA = "msllm_base_sha256"     # adapter_model.safetensors metadata: the base the adapter was trained on


def weight_files(source: Source) -> list[Path]:
    """The files holding a source's tensors (one, or every shard)."""
    reader = source.reader
    owners = getattr(reader, "owner", None)
    paths = {Path(r.path) for r in owners.values()} if owners else {Path(reader.path)}
    return sorted(paths)


def sha256_of(files: list[Path]) -> str:
    """One digest over the weight files' bytes, in name order."""
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class PretrainedWeights:
    """A base checkpoint (HF dir, msllm checkpoint / run dir, MindFormers dir) as msllm tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        source = open_source(self.path)
        try:
            self.architecture, self.model, self.hf_config = source.architecture, source.config.model, source.hf_config
            self.side_files, self.files = source.side_files, weight_files(source)
            plan(source)  # every tensor the table expects, with its shape, before anything is built
        finally:
            source.reader.close()
        self._sha256 = None

    @property
    def tokenizer(self) -> Path | None:
        return next((p for p in self.side_files if p.name == "tokenizer.json"), None)

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = sha256_of(self.files)
        return self._sha256

    def identity(self) -> dict:
        return {"path": str(self.path.resolve()), "sha256": self.sha256}

    def check(self, recorded: dict, what: str) -> None:
        """Refuse a base whose weights are not the ones `recorded` (a checkpoint's lora_base) names."""
        if recorded.get("sha256") != self.sha256:
            raise InteropError(f"{self.path}: not the base {what} was trained on (sha256 {self.sha256[:12]}..., "
                               f"expected {str(recorded.get('sha256'))[:12]}... of {recorded.get('path')}); "
                               f"give the original base model")

    def load(self, params) -> None:
        """Copy the base's tensors into `params` (msllm names; model.max_seq_len may be shorter than the
        source's), one tensor at a time: no second copy of the model on disk or in RAM."""
        from mindspore import Tensor

        source = open_source(self.path)
        by_name = {p.name: p for p in params}
        try:
            rows = plan(source)
            missing = sorted(set(by_name) - set(parameter_names(rows)))
            if missing:
                raise InteropError(f"{self.path}: holds no {missing[0]} (and {len(missing) - 1} more) of the model")
            for name, t in msllm_parameters(rows, source.layout, source.reader):
                by_name[name].set_data(Tensor(t.to(torch.float32).numpy()))
        finally:
            source.reader.close()


class InitFrom:
    """What the trainer needs of train.init_from (and train.lora_from): the base weights, the adapter
    to continue, and the base's identity that LoRA checkpoints record."""

    def __init__(self, cfg: Config):
        self.cfg, self.base = cfg, PretrainedWeights(cfg.train.init_from)
        self.adapter = PeftAdapter(cfg.train.lora_from, self.base.architecture) if cfg.train.lora_from else None
        if self.adapter is not None:
            self.adapter.check_base(self.base)  # before anything is built or written

    def load_base(self, params) -> None:
        self.base.load(params)

    def load_adapter(self, params) -> None:
        if self.adapter is not None:
            self.adapter.load(params, self.base.architecture, self.cfg, self.base)

    def identity(self) -> dict:
        return self.base.identity()

    def check(self, recorded: dict, what: str) -> None:
        self.base.check(recorded, what)


def describe(init_from: str, lora_from: str | None) -> Pretrained:
    """load_config's view of train.init_from (and train.lora_from)."""
    base = PretrainedWeights(init_from)
    lora = PeftAdapter(lora_from, base.architecture).lora if lora_from else None
    tokenizer = base.tokenizer
    return Pretrained(str(init_from), base.model, str(tokenizer.resolve()) if tokenizer else None, lora)


# --- PEFT names, from the family table

def hf_module_names(arch: str, cfg: Config) -> dict[str, str]:
    """msllm module path of each adapted Linear (layers.0.attention.wq) -> its HF module
    (model.layers.0.self_attn.q_proj), read off the table's weight rows."""
    from msllm.lora import TARGETS

    modules = {}
    for e in entries(FAMILIES[arch].table, cfg.model):
        module = e.name.removesuffix(".weight")
        stored = e.stored["hf"]
        if e.name.endswith(".weight") and module.split(".", 2)[-1] in TARGETS.values() and hasattr(stored, "name"):
            modules[module] = stored.name.removesuffix(".weight")  # a joined tensor (Phi-3's qkv_proj) has none
    return modules


def peft_keys(arch: str, cfg: Config) -> dict[str, str]:
    """msllm adapter name (layers.0.attention.wq.lora_a) -> PEFT key
    (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), for the configured targets."""
    from msllm.lora import TARGETS

    wanted = {TARGETS[t] for t in cfg.lora.targets if t in TARGETS}  # experts: peft_experts
    keys = {}
    for module, hf in hf_module_names(arch, cfg).items():
        if module.split(".", 2)[-1] in wanted:
            keys[f"{module}.lora_a"] = f"{PEFT_PREFIX}{hf}.lora_A.weight"
            keys[f"{module}.lora_b"] = f"{PEFT_PREFIX}{hf}.lora_B.weight"
    return keys


def peft_experts(cfg: Config, adapters: dict) -> tuple[dict[str, np.ndarray], dict]:
    """Adapters on stacked experts as PEFT's LoRA on parameters (target_parameters, PEFT >= 0.17):
    transformers 5 holds a MoE layer's experts as mlp.experts.gate_up_proj [E, 2f, h] (gate rows, then
    up) and down_proj [E, h, f]. PEFT keeps one adapter per parameter, lora_A [E r, in] (expert e's
    rows e r .. e r + r - 1) and lora_B [out, r E] (expert e's columns e, E + e, ...). msllm's gate and
    up adapters (rank r each) become one of rank 2r on gate_up_proj: A stacks them, B is
    block-diagonal, and alpha doubles so the scale alpha / r stays (rank_pattern, alpha_pattern). PEFT
    wraps a module's parameters one inside another, the first listed innermost (`base_layer.`).
    Returns (tensors by PEFT key, the adapter_config.json entries)."""
    from msllm.lora import EXPERT_TARGETS

    r, targets = cfg.lora.rank, [t for t in cfg.lora.targets if t in EXPERT_TARGETS]
    wrapped = [w for w, wanted in (("gate_up_proj", {"experts_gate", "experts_up"} & set(targets)),
                                   ("down_proj", "experts_down" in targets)) if wanted]
    tensors = {}
    for i, kind in enumerate(cfg.model.mlp_kinds()):
        if kind != "moe":
            continue
        ours = f"layers.{i}.feed_forward.experts."

        def pair(w: str, shape_a, shape_b):
            if f"{ours}{w}.lora_a" in adapters:
                return adapters[f"{ours}{w}.lora_a"], adapters[f"{ours}{w}.lora_b"]
            return np.zeros(shape_a, np.float32), np.zeros(shape_b, np.float32)

        e, f, h = cfg.model.num_experts, cfg.model.moe_ffn_size or cfg.model.ffn_size, cfg.model.hidden_size
        for depth, w in enumerate(wrapped):
            key = f"{PEFT_PREFIX}model.layers.{i}.mlp.experts." + "base_layer." * (len(wrapped) - 1 - depth)
            if w == "gate_up_proj":
                (a1, b1), (a3, b3) = pair("w1", (e, r, h), (e, f, r)), pair("w3", (e, r, h), (e, f, r))
                a = np.concatenate([a1, a3], 1)                                           # [E, 2r, h]
                b = np.zeros((e, 2 * f, 2 * r), np.float32)
                b[:, :f, :r], b[:, f:, r:] = b1, b3                                       # [E, 2f, 2r]
            else:
                a, b = pair("w2", (e, r, f), (e, h, r))
            tensors[key + "lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, a.shape[-1]))
            tensors[key + "lora_B.weight"] = np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], -1))
    config = {"target_parameters": [f"mlp.experts.{w}" for w in wrapped]}
    if "gate_up_proj" in wrapped:
        config.update(rank_pattern={"gate_up_proj": 2 * r}, alpha_pattern={"gate_up_proj": 2 * cfg.lora.alpha})
    return tensors, config


def hf_leaves(arch: str) -> dict[str, str]:
    """lora.targets name -> the HF module leaf PEFT's target_modules names (q -> q_proj, ...)."""
    from msllm.lora import TARGETS

    one_layer = Config(model=dataclasses.replace(Config().model, num_layers=1))
    leaves = {m.split(".", 2)[-1]: hf.rsplit(".", 1)[-1] for m, hf in hf_module_names(arch, one_layer).items()}
    return {target: leaves[module] for target, module in TARGETS.items() if module in leaves}


class PeftAdapter:
    """A PEFT LoRA adapter dir: adapter_config.json + adapter_model.safetensors."""

    def __init__(self, path: str | Path, arch: str):
        self.path = Path(path).expanduser()
        config = read_json(self.path / PEFT_CONFIG)
        if config.get("peft_type", "LORA") != "LORA":
            raise InteropError(f"{self.path / PEFT_CONFIG}: peft_type {config.get('peft_type')!r}; msllm trains LORA")
        modules = config.get("target_modules")
        leaf_to_target = {leaf: target for target, leaf in hf_leaves(arch).items()}
        if isinstance(modules, str) or not isinstance(modules, list) or not all(m in leaf_to_target for m in modules):
            raise InteropError(f"{self.path / PEFT_CONFIG}: target_modules {modules!r}: msllm adapts a list of "
                               f"{', '.join(leaf_to_target)}")
        for key in ("use_dora", "use_rslora"):
            if config.get(key):
                raise InteropError(f"{self.path / PEFT_CONFIG}: {key} is not supported (plain LoRA)")
        if config.get("target_parameters"):
            raise InteropError(f"{self.path / PEFT_CONFIG}: target_parameters {config['target_parameters']!r}: "
                               f"reading adapters on experts back (train.lora_from) is not built; merge them instead")
        self.lora = {"rank": int(config["r"]), "alpha": float(config["lora_alpha"]),
                     "targets": [leaf_to_target[m] for m in modules]}
        weights = self.path / PEFT_WEIGHTS
        if not weights.is_file():
            raise InteropError(f"{weights}: missing (msllm reads safetensors adapters)")
        self.reader = SafetensorsReader(weights)
        self.base_sha256 = self.reader.metadata.get(BASE_SHA)

    def check_base(self, base: PretrainedWeights) -> None:
        """An adapter msllm exported names its base's sha256; one from elsewhere is trusted."""
        if self.base_sha256 and self.base_sha256 != base.sha256:
            raise InteropError(f"{self.path}: adapter trained on another base (sha256 {self.base_sha256[:12]}...) "
                               f"than {base.path} ({base.sha256[:12]}...)")

    def load(self, params, arch: str, cfg: Config, base: PretrainedWeights) -> None:
        """Copy the adapter into the model's lora_a / lora_b Parameters."""
        from mindspore import Tensor

        self.check_base(base)
        keys = peft_keys(arch, cfg)
        missing = [k for k in keys.values() if k not in self.reader.infos]
        if missing:
            raise InteropError(f"{self.path / PEFT_WEIGHTS}: missing {missing[0]} (and {len(missing) - 1} more)")
        for p in params:
            t = self.reader.read(keys[p.name])
            if tuple(t.shape) != tuple(p.shape):
                raise InteropError(f"{self.path / PEFT_WEIGHTS}: {keys[p.name]} {list(t.shape)} != {list(p.shape)}")
            p.set_data(Tensor(t.to(torch.float32).numpy()))
        self.reader.close()


# --- msllm lora merge / export

def _lora_run(run: str | Path, base: str | Path | None):
    """(ckpt dir, state, config, base weights checked against the run's recorded base, adapter arrays)."""
    from msllm.config import config_from_dict

    ckpt = checkpoint.latest(Path(run))
    state = checkpoint.read_state(ckpt)
    cfg = config_from_dict(state["config"], str(ckpt / checkpoint.STATE_FILE))
    recorded = state.get("lora_base")
    if cfg.lora.rank == 0 or not recorded:
        raise InteropError(f"{ckpt}: not a LoRA run (lora.rank 0); its model.safetensors is already a full model")
    weights = PretrainedWeights(base or recorded["path"])
    weights.check(recorded, str(ckpt))
    return ckpt, state, cfg, weights, checkpoint.load_arrays(ckpt / checkpoint.MODEL_FILE)


def merge(run: str | Path, out: str | Path, base: str | Path | None = None, force: bool = False) -> Path:
    """A full msllm checkpoint dir: base + scale * B A folded into each adapted weight."""
    from msllm.lora import adapter_params, apply_lora, merge_lora
    from msllm.models.llama import Llama

    ckpt, state, cfg, weights, adapters = _lora_run(run, base)
    model = Llama(cfg.model)
    weights.load(model.trainable_params())
    apply_lora(model, cfg.lora, cfg.train.seed)
    checkpoint.load_into(adapter_params(model), adapters, str(ckpt))
    merge_lora(model)
    merged = dataclasses.replace(cfg, lora=LoraConfig(), train=dataclasses.replace(cfg.train, init_from=None,
                                                                                  lora_from=None))
    from safetensors.numpy import save_file

    arrays = checkpoint.params_to_numpy(model.trainable_params())
    with staged_dir(out, need=sum(a.nbytes for a in arrays.values()), replace=force, manifest=True,
                    sources=(run, weights.path), then="free space or choose another OUT, then merge again") as tmp:
        save_file(arrays, str(tmp / checkpoint.MODEL_FILE))
        tokenizer = checkpoint.find_tokenizer(ckpt, state)
        for side in weights.side_files + ([tokenizer] if tokenizer else []):
            shutil.copyfile(side, tmp / side.name)
        write_json(tmp / checkpoint.STATE_FILE, {
            "step": 0, "config": merged.to_dict(),
            "tokenizer": "tokenizer.json" if (tmp / "tokenizer.json").is_file() else None,
            "hf_architecture": weights.architecture, "hf_config": weights.hf_config,
            "merged_from": {"run": str(ckpt.resolve()), "step": state["step"], "base": weights.identity()}})
    return Path(out)


def export_peft(run: str | Path, out: str | Path, base: str | Path | None = None, force: bool = False) -> Path:
    """The run's adapter, un-merged, as a PEFT dir that PeftModel.from_pretrained loads on the base."""
    from safetensors.numpy import save_file

    ckpt, state, cfg, weights, adapters = _lora_run(run, base)
    leaves = hf_leaves(weights.architecture)
    experts = [t for t in cfg.lora.targets if t.startswith("experts_")]
    fused = [t for t in cfg.lora.targets if t not in leaves and t not in experts]
    dense = [t for t in cfg.lora.targets if t in ("gate", "up", "down")]
    if dense and weights.architecture in PEFT_RENAMES_MLP:
        raise InteropError(f"{ckpt}: lora.targets {dense}: PEFT reads gate_proj / up_proj / down_proj of a "
                           f"{weights.architecture} as its experts' (transformers v4 names), so it cannot hold "
                           f"adapters on the dense MLP layers; train without them or `msllm lora merge`")
    if fused:
        raise InteropError(f"{ckpt}: lora.targets {fused}: {weights.architecture} stores them inside a fused "
                           f"projection, which a PEFT adapter cannot hold; `msllm lora merge` makes a full model")
    keys = peft_keys(weights.architecture, cfg)
    tensors = {keys[n]: np.ascontiguousarray(a) for n, a in adapters.items() if n in keys}
    expert_config = {}
    if experts:
        expert_tensors, expert_config = peft_experts(cfg, adapters)
        tensors.update(expert_tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
              "lora_dropout": 0.0 if experts else cfg.lora.dropout,  # PEFT's parameter LoRA refuses dropout
              "target_modules": [leaves[t] for t in cfg.lora.targets if t not in experts], **expert_config,
              "base_model_name_or_path": str(weights.path.resolve()), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    with staged_dir(out, need=sum(a.nbytes for a in adapters.values()), replace=force, sources=(run,),
                    then="free space or choose another OUT, then export again") as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt", BASE_SHA: weights.sha256})
        write_json(tmp / PEFT_CONFIG, config)
    return Path(out)
