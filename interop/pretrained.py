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
from typing import NamedTuple

import numpy as np
import torch

from interop import InteropError, read_json
from interop.convert import msllm_parameters, parameter_names, plan, write_json
from interop.layouts import Source, open_source
from interop.maps import FAMILIES
from interop.table import Concat, Entry, Interleaved, Same, entries
from msllm import checkpoint
from msllm.config import Config, LoraConfig, ModelConfig
from msllm.config_file import Pretrained
from msllm.safetensors_reader import SafetensorsReader
from msllm.staged import staged_dir

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Architectures whose gate_proj / up_proj / down_proj PEFT (0.21) re-targets to the fused experts
# (its transformers v4 -> v5 MoE conversion), dense MLP layers included
PEFT_RENAMES_MLP = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM")
# Architectures whose experts peft_experts does not lay out: gpt-oss stores each layer's as one gate_up_proj
# [E, h, 2f] with gate and up columns alternating (and down_proj [E, f, h]), not Qwen3-MoE's [E, 2f, h]
PEFT_UNWRITTEN_EXPERTS = ("GptOssForCausalLM",)
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
        lora_from = cfg.train.lora_from
        self.adapter = PeftAdapter(lora_from, self.base.architecture, self.base.model) if lora_from else None
        if self.adapter is not None:  # before anything is built or written
            self.adapter.check_base(self.base)
            self.adapter.check(cfg)

    def load_base(self, params) -> None:
        self.base.load(params)

    def load_adapter(self, params) -> None:
        if self.adapter is not None:
            self.adapter.load(params, self.cfg, self.base)

    def identity(self) -> dict:
        return self.base.identity()

    def check(self, recorded: dict, what: str) -> None:
        self.base.check(recorded, what)


def describe(init_from: str, lora_from: str | None) -> Pretrained:
    """load_config's view of train.init_from (and train.lora_from)."""
    base = PretrainedWeights(init_from)
    lora = PeftAdapter(lora_from, base.architecture, base.model).lora if lora_from else None
    tokenizer = base.tokenizer
    return Pretrained(str(init_from), base.model, str(tokenizer.resolve()) if tokenizer else None, lora)


# --- PEFT's LoRA on the experts' parameters (target_parameters, PEFT >= 0.17)
#
# transformers 5 holds a MoE layer's experts as mlp.experts.gate_up_proj [E, 2f, h] (gate rows, then up) and
# down_proj [E, h, f]. PEFT keeps one adapter per parameter, lora_A [E R, in] (expert e's rows e R .. e R + R - 1)
# and lora_B [out, R E] (expert e's columns e, E + e, ...). msllm's gate and up adapters (rank r each) become one
# of rank R = 2r on gate_up_proj: A stacks them, B is block-diagonal, and alpha doubles so the scale alpha / r
# stays (rank_pattern, alpha_pattern). PEFT wraps a module's parameters one inside another, the first listed
# innermost (`base_layer.`). Export and read back both go through the functions below.

PEFT_EXPERTS = "mlp.experts"  # a MoE layer's experts module in transformers 5
# each experts parameter PEFT adapts -> the msllm stacked weights it joins, in row order
PEFT_EXPERT_PARAMETERS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
# adapter_model.safetensors metadata: the expert targets msllm trained (gate_up_proj holds gate and up
# whether one or both were adapted; the other's block is zero)
EXPERT_TARGETS_KEY = "msllm_expert_targets"


def expert_parameters(targets: list[str]) -> list[str]:
    """The experts' parameters PEFT adapts for lora.targets, in target_parameters order."""
    from msllm.lora import EXPERT_TARGETS

    ours = {EXPERT_TARGETS[t] for t in targets if t in EXPERT_TARGETS}
    return [name for name, joined in PEFT_EXPERT_PARAMETERS.items() if ours & set(joined)]


def expert_config(parameters: list[str], rank: int, alpha: float) -> dict:
    """adapter_config.json's entries for the experts: a parameter joining n weights has rank n r and
    alpha n alpha, so its scale stays alpha / r."""
    joined = {p: len(PEFT_EXPERT_PARAMETERS[p]) for p in parameters if len(PEFT_EXPERT_PARAMETERS[p]) > 1}
    return {"target_parameters": [f"{PEFT_EXPERTS}.{p}" for p in parameters],
            "rank_pattern": {p: n * rank for p, n in joined.items()},
            "alpha_pattern": {p: n * alpha for p, n in joined.items()}}


def expert_keys(model: ModelConfig, parameters: list[str]):
    """(layer, parameter, lora_A key, lora_B key) of every MoE layer's adapted parameters."""
    for i, kind in enumerate(model.mlp_kinds()):
        if kind != "moe":
            continue
        for depth, p in enumerate(parameters):
            module = f"{PEFT_PREFIX}model.layers.{i}.{PEFT_EXPERTS}." + "base_layer." * (len(parameters) - 1 - depth)
            yield i, p, module + "lora_A.weight", module + "lora_B.weight"


def expert_adapter_name(layer: int, weight: str) -> str:
    """msllm's name of an expert adapter (msllm/lora.py): layers.1.feed_forward.experts.w1 (+ .lora_a / .lora_b)."""
    return f"layers.{layer}.feed_forward.experts.{weight}"


def expert_outputs(model: ModelConfig, parameter: str) -> tuple[list[int], int]:
    """(out of each stacked weight the parameter joins, their common in): w1 / w3 [E, f, h], w2 [E, h, f]."""
    f, h = model.moe_ffn_size or model.ffn_size, model.hidden_size
    shapes = [(h, f) if w == "w2" else (f, h) for w in PEFT_EXPERT_PARAMETERS[parameter]]
    return [out for out, _ in shapes], shapes[0][1]


def expert_peft_shapes(model: ModelConfig, parameter: str, rank: int) -> tuple[tuple, tuple]:
    """The shapes of a parameter's lora_A [E R, in] and lora_B [out, R E] (R = n rank)."""
    outs, inp = expert_outputs(model, parameter)
    joined_rank = len(outs) * rank * model.num_experts
    return (joined_rank, inp), (sum(outs), joined_rank)


def _blocks(outs: list[int], rank: int) -> list[tuple[slice, slice]]:
    """Where joined weight j's B sits in the block-diagonal B [E, sum outs, n rank]: (rows, rank columns)."""
    starts = np.cumsum([0, *outs])
    return [(slice(starts[j], starts[j + 1]), slice(j * rank, (j + 1) * rank)) for j in range(len(outs))]


def join_experts(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """msllm's (A [E, r, in], B [E, out_j, r]) of the weights one PEFT parameter joins -> its (lora_A, lora_B)."""
    e, rank, _ = pairs[0][0].shape
    outs = [b.shape[1] for _, b in pairs]
    b = np.zeros((e, sum(outs), rank * len(pairs)), np.float32)
    for (rows, cols), (_, b_j) in zip(_blocks(outs, rank), pairs):
        b[:, rows, cols] = b_j
    a = np.concatenate([a for a, _ in pairs], 1)
    return (np.ascontiguousarray(a.reshape(-1, a.shape[-1])),
            np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], -1)))


def split_experts(lora_a: np.ndarray, lora_b: np.ndarray, e: int, outs: list[int], kept: list[bool],
                  where: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """join_experts' inverse: the (A, B) of each kept joined weight. B must be zero outside them (msllm
    adapts the joined weights separately), else `where` is refused."""
    a = lora_a.reshape(e, -1, lora_a.shape[-1])                      # [E, n r, in]
    b = lora_b.reshape(lora_b.shape[0], -1, e).transpose(2, 0, 1)    # [E, sum outs, n r]
    rest, pairs = b.copy(), []
    for (rows, cols), keep in zip(_blocks(outs, a.shape[1] // len(outs)), kept):
        if keep:
            pairs.append((np.array(a[:, cols], np.float32), np.array(b[:, rows, cols], np.float32)))
            rest[:, rows, cols] = 0
    if rest.any():
        raise InteropError(f"{where}: nonzero outside the diagonal blocks of the adapted projections (msllm keeps "
                           f"one adapter per projection); merge it (PEFT's merge_and_unload) and train from that")
    return pairs


def peft_experts(cfg: Config, adapters: dict) -> tuple[dict[str, np.ndarray], dict]:
    """A run's expert adapters as PEFT tensors (by key) and the adapter_config.json entries; a joined
    weight the run did not adapt gets a zero block."""
    r, e, parameters = cfg.lora.rank, cfg.model.num_experts, expert_parameters(cfg.lora.targets)
    tensors = {}
    for i, p, key_a, key_b in expert_keys(cfg.model, parameters):
        outs, inp = expert_outputs(cfg.model, p)
        pairs = []
        for w, out in zip(PEFT_EXPERT_PARAMETERS[p], outs):
            name = expert_adapter_name(i, w)
            pairs.append((adapters[f"{name}.lora_a"], adapters[f"{name}.lora_b"]) if f"{name}.lora_a" in adapters
                         else (np.zeros((e, r, inp), np.float32), np.zeros((e, out, r), np.float32)))
        tensors[key_a], tensors[key_b] = join_experts(pairs)
    return tensors, expert_config(parameters, r, cfg.lora.alpha)


# --- PEFT's LoRA on Linears (target_modules), from the family table
#
# A PEFT adapter sits on one Hugging Face Linear; its weight's table row says which msllm Linears that joins:
# one (q_proj: wq), or several (Qwen3.5's in_proj_qkv: wq, wk, wv; its q_proj: each head's query wq then its
# gate wg; Phi-3's qkv_proj). msllm adapts each Linear alone, so n joined adapters of rank r are one PEFT adapter
# of rank n r, as the experts' gate_up_proj above: A stacks the parts' A, B is block-diagonal with its rows in the
# stored order (a part no target adapts gets zero blocks), and alpha n alpha keeps the scale alpha / r.

# adapter_model.safetensors metadata: the lora.targets msllm trained (a joined module's parts may be fewer)
TARGETS_KEY = "msllm_targets"


class PeftModule(NamedTuple):
    """An HF Linear some lora.targets name adapts (a part of)."""
    hf: str                          # model.layers.0.linear_attn.in_proj_qkv
    parts: tuple[str, ...]           # the msllm Linears it joins, in row order: layers.0.attention.wq, ..
    targets: tuple[str | None, ...]  # the lora.targets name adapting each part (None: none does)
    entry: Entry                     # its weight's table entry: the hf rule orders lora_B's rows

    @property
    def leaf(self) -> str:
        return self.hf.rsplit(".", 1)[-1]

    def key(self, which: str) -> str:
        return f"{PEFT_PREFIX}{self.hf}.lora_{which}.weight"

    def shapes(self, rank: int) -> tuple[tuple, tuple]:
        """lora_A [n r, in], lora_B [out, n r]."""
        joined = len(self.parts) * rank
        return (joined, self.entry.shape[1]), (self.entry.shape[0], joined)

    def _b_entry(self, b) -> Entry:
        return self.entry._replace(shape=tuple(b.shape), terms=(self.entry.terms[0], (b.shape[1],)))

    def stored_rows(self, b: np.ndarray) -> np.ndarray:
        """lora_B with its rows in msllm's order (the parts one after another) -> in the HF weight's order."""
        [(_, t)] = self.entry.stored["hf"].scatter(self._b_entry(b), torch.from_numpy(b))
        return t.numpy()

    def msllm_rows(self, b: np.ndarray) -> np.ndarray:
        return self.entry.stored["hf"].gather(self._b_entry(b), lambda name: torch.from_numpy(b)).numpy()


def peft_modules(arch: str, model: ModelConfig) -> list[PeftModule]:
    """Every HF Linear of `model` PEFT can adapt for some lora.targets name, layer by layer."""
    from msllm.lora import target_of

    kinds, modules = model.layer_kinds(), []
    for e in entries(FAMILIES[arch].table, model):
        mine, stored = e.stored["msllm"], e.stored["hf"]
        parts = mine.parts if isinstance(mine, Concat) and mine.dim == 0 else (mine,)
        if type(stored) not in (Same, Interleaved) or not all(
                type(p) is Same and p.name.startswith("layers.") and p.name.endswith(".weight") for p in parts):
            continue  # not a Linear's weight rows (a transposed, per-expert or non-layer tensor)
        names = tuple(p.name.removesuffix(".weight") for p in parts)
        targets = tuple(target_of(n.split(".", 2)[2], kinds[int(n.split(".")[1])] == "linear") for n in names)
        if any(targets):
            modules.append(PeftModule(stored.name.removesuffix(".weight"), names, targets, e))
    return modules


def adapted_modules(modules: list[PeftModule], targets: list[str]) -> list[PeftModule]:
    return [m for m in modules if set(m.targets) & set(targets)]


def joined_config(modules: list[PeftModule], rank: int, alpha: float) -> dict:
    """rank_pattern / alpha_pattern of the adapted modules that join n > 1 msllm Linears (by leaf)."""
    joined = {m.leaf: len(m.parts) for m in modules if len(m.parts) > 1}
    return {"rank_pattern": {leaf: n * rank for leaf, n in joined.items()},
            "alpha_pattern": {leaf: n * alpha for leaf, n in joined.items()}}


def peft_linear(modules: list[PeftModule], cfg: Config, adapters: dict) -> dict[str, np.ndarray]:
    """A run's Linear adapters as PEFT tensors, by key."""
    r, tensors = cfg.lora.rank, {}
    for m in adapted_modules(modules, cfg.lora.targets):
        inp, pairs = m.entry.shape[1], []
        for part, target, out in zip(m.parts, m.targets, m.entry.terms[0]):
            pairs.append((adapters[f"{part}.lora_a"][None], adapters[f"{part}.lora_b"][None]) if target in cfg.lora.targets
                         else (np.zeros((1, r, inp), np.float32), np.zeros((1, out, r), np.float32)))
        a, b = join_experts(pairs)  # one "expert"
        tensors[m.key("A")], tensors[m.key("B")] = a, np.ascontiguousarray(m.stored_rows(b))
    return tensors


def peft_targets(modules: list[PeftModule], leaves: list[str]) -> list[str]:
    """The lora.targets names adapting a part of the listed target_modules leaves, in their order."""
    targets = []
    for leaf in leaves:
        for m in modules:
            if m.leaf == leaf:
                targets += [t for t in m.targets if t and t not in targets]
    return targets


class PeftAdapter:
    """A PEFT LoRA adapter dir: adapter_config.json + adapter_model.safetensors."""

    def __init__(self, path: str | Path, arch: str, model: ModelConfig):
        self.path = Path(path).expanduser()
        self.config_file, self.weights = self.path / PEFT_CONFIG, self.path / PEFT_WEIGHTS
        config = read_json(self.config_file)
        if config.get("peft_type", "LORA") != "LORA":
            raise InteropError(f"{self.config_file}: peft_type {config.get('peft_type')!r}; msllm trains LORA")
        leaves = config.get("target_modules")
        self.modules = peft_modules(arch, model)
        known = list(dict.fromkeys(m.leaf for m in self.modules))
        if isinstance(leaves, str) or not isinstance(leaves, list) or not all(m in known for m in leaves):
            raise InteropError(f"{self.config_file}: target_modules {leaves!r}: msllm adapts a list of "
                               f"{', '.join(known)}")
        for key in ("use_dora", "use_rslora"):
            if config.get(key):
                raise InteropError(f"{self.config_file}: {key} is not supported (plain LoRA)")
        self.parameters = self._expert_parameters(config.get("target_parameters"))
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        self._check_patterns(config, [m for m in self.modules if m.leaf in leaves], rank, alpha)
        if not self.weights.is_file():
            raise InteropError(f"{self.weights}: missing (msllm reads safetensors adapters)")
        self.reader = SafetensorsReader(self.weights)
        self.base_sha256 = self.reader.metadata.get(BASE_SHA)
        self.lora = {"rank": rank, "alpha": alpha, "targets": self._linear_targets(leaves) + self._expert_targets()}

    def _expert_parameters(self, listed) -> list[str]:
        """target_parameters (mlp.experts.gate_up_proj, ...) -> the experts' parameters (gate_up_proj, ...)."""
        known = {f"{PEFT_EXPERTS}.{p}": p for p in PEFT_EXPERT_PARAMETERS}
        listed = listed or []
        if not isinstance(listed, list) or not all(p in known for p in listed) or len(set(listed)) < len(listed):
            raise InteropError(f"{self.config_file}: target_parameters {listed!r}: msllm adapts a list of "
                               f"{', '.join(known)}")
        return [known[p] for p in listed]

    def _check_patterns(self, config: dict, modules: list[PeftModule], rank: int, alpha: float) -> None:
        """One rank and alpha, times n on a module joining n msllm Linears or weights (gate_up_proj), as
        export_peft writes them."""
        experts, joined = expert_config(self.parameters, rank, alpha), joined_config(modules, rank, alpha)
        for key in ("rank_pattern", "alpha_pattern"):
            expected = {**joined[key], **experts[key]}
            if (config.get(key) or {}) != expected:
                raise InteropError(f"{self.config_file}: {key} {config.get(key)!r}: msllm reads {expected!r} "
                                   f"(r {rank}, lora_alpha {alpha:g}, one pair per adapted projection)")

    def _linear_targets(self, leaves: list[str]) -> list[str]:
        """The Linears' targets the adapter holds: those msllm recorded, else every one its modules join."""
        held = peft_targets(self.modules, leaves)
        recorded = self.reader.metadata.get(TARGETS_KEY)
        if recorded is None:
            return held
        targets = [t for t in recorded.split(",") if not t.startswith("experts_")]
        idle = [leaf for leaf in leaves if not set(peft_targets(self.modules, [leaf])) & set(targets)]
        if not set(targets) <= set(held) or idle:
            raise InteropError(f"{self.weights}: metadata {TARGETS_KEY} {recorded!r} contradicts "
                               f"target_modules of {self.config_file}")
        return targets

    def _expert_targets(self) -> list[str]:
        """The expert targets the adapter holds: those msllm recorded, else every weight its parameters join."""
        from msllm.lora import EXPERT_TARGETS

        joined = {w for p in self.parameters for w in PEFT_EXPERT_PARAMETERS[p]}
        held = [t for t, w in EXPERT_TARGETS.items() if w in joined]
        recorded = self.reader.metadata.get(EXPERT_TARGETS_KEY)
        if recorded is None:
            return held
        targets = recorded.split(",")
        if not set(targets) <= set(held) or set(expert_parameters(targets)) != set(self.parameters):
            raise InteropError(f"{self.weights}: metadata {EXPERT_TARGETS_KEY} {recorded!r} contradicts "
                               f"target_parameters of {self.config_file}")
        return targets

    def check_base(self, base: PretrainedWeights) -> None:
        """An adapter msllm exported names its base's sha256; one from elsewhere is trusted."""
        if self.base_sha256 and self.base_sha256 != base.sha256:
            raise InteropError(f"{self.path}: adapter trained on another base (sha256 {self.base_sha256[:12]}...) "
                               f"than {base.path} ({base.sha256[:12]}...)")

    def check(self, cfg: Config) -> None:
        """The whole adapter fits the model, before anything is built or written: every tensor is there with
        its shape, and the joined ones with their block structure."""
        self._check_keys(cfg)
        for _ in self._adapters(cfg):  # one PEFT tensor pair in memory at a time
            pass

    def _check_keys(self, cfg: Config) -> None:
        wanted = {}
        for m in adapted_modules(self.modules, cfg.lora.targets):
            wanted[m.key("A")], wanted[m.key("B")] = m.shapes(cfg.lora.rank)
        for _, p, key_a, key_b in expert_keys(cfg.model, self.parameters):
            wanted[key_a], wanted[key_b] = expert_peft_shapes(cfg.model, p, cfg.lora.rank)
        missing = [k for k in wanted if k not in self.reader.shapes]
        if missing:
            raise InteropError(f"{self.weights}: missing {missing[0]} (and {len(missing) - 1} more)")
        wrong = [k for k, shape in wanted.items() if self.reader.shapes[k] != shape]
        if wrong:
            raise InteropError(f"{self.weights}: {wrong[0]} {list(self.reader.shapes[wrong[0]])} != "
                               f"{list(wanted[wrong[0]])}")

    def _read(self, key: str) -> np.ndarray:
        return self.reader.read(key).to(torch.float32).numpy()

    def _adapters(self, cfg: Config):
        """(msllm name, array) of every adapter, split out of one PEFT tensor pair at a time (export_peft's
        inverse)."""
        for m in adapted_modules(self.modules, cfg.lora.targets):
            kept = [t in cfg.lora.targets for t in m.targets]
            pairs = split_experts(self._read(m.key("A")), m.msllm_rows(self._read(m.key("B"))), 1,
                                  list(m.entry.terms[0]), kept, f"{self.weights}: {m.key('B')}")
            for part, (a, b) in zip([p for p, keep in zip(m.parts, kept) if keep], pairs):
                yield f"{part}.lora_a", a[0]
                yield f"{part}.lora_b", b[0]
        yield from self._expert_adapters(cfg)

    def _expert_adapters(self, cfg: Config):
        """(msllm name, array) of the experts' adapters, split out of one PEFT parameter at a time."""
        from msllm.lora import EXPERT_TARGETS

        adapted = {EXPERT_TARGETS[t] for t in cfg.lora.targets if t in EXPERT_TARGETS}
        for i, p, key_a, key_b in expert_keys(cfg.model, self.parameters):
            joined = PEFT_EXPERT_PARAMETERS[p]
            pairs = split_experts(self._read(key_a), self._read(key_b), cfg.model.num_experts,
                                  expert_outputs(cfg.model, p)[0], [w in adapted for w in joined],
                                  f"{self.weights}: {key_b}")
            for w, (a, b) in zip([w for w in joined if w in adapted], pairs):
                yield f"{expert_adapter_name(i, w)}.lora_a", a
                yield f"{expert_adapter_name(i, w)}.lora_b", b

    def load(self, params, cfg: Config, base: PretrainedWeights) -> None:
        """Copy the adapter into the model's lora_a / lora_b Parameters (InitFrom ran `check` first)."""
        from mindspore import Tensor

        self.check_base(base)
        self._check_keys(cfg)
        by_name = {p.name: p for p in params}
        for name, value in self._adapters(cfg):
            p = by_name.pop(name)
            if tuple(value.shape) != tuple(p.shape):
                raise InteropError(f"{self.weights}: the adapter of {name} {list(value.shape)} != {list(p.shape)}")
            p.set_data(Tensor(value))
        if by_name:
            raise InteropError(f"{self.weights}: holds no adapter for {sorted(by_name)[0]} "
                               f"(and {len(by_name) - 1} more)")
        self.reader.close()


# --- msllm lora merge / export

def _lora_run(run: str | Path, base: str | Path | None):
    """(ckpt dir, state, config, base weights checked against the run's recorded base, adapter arrays)."""
    from msllm.config_file import config_from_dict

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
    from msllm.models.decoder import Decoder

    ckpt, state, cfg, weights, adapters = _lora_run(run, base)
    model = Decoder(cfg.model)
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
    modules = peft_modules(weights.architecture, cfg.model)
    adapted = adapted_modules(modules, cfg.lora.targets)
    experts = [t for t in cfg.lora.targets if t.startswith("experts_")]
    unplaced = [t for t in cfg.lora.targets if t not in experts and not any(t in m.targets for m in adapted)]
    dense = [t for t in cfg.lora.targets if t in ("gate", "up", "down")]
    if dense and weights.architecture in PEFT_RENAMES_MLP:
        raise InteropError(f"{ckpt}: lora.targets {dense}: PEFT reads gate_proj / up_proj / down_proj of a "
                           f"{weights.architecture} as its experts' (transformers v4 names), so it cannot hold "
                           f"adapters on the dense MLP layers; train without them or `msllm lora merge`")
    if experts and weights.architecture in PEFT_UNWRITTEN_EXPERTS:
        raise InteropError(f"{ckpt}: lora.targets {experts}: {weights.architecture} stores its experts as one "
                           f"gate_up_proj [E, h, 2f] with gate and up columns alternating, which msllm does not "
                           f"write as a PEFT adapter yet; `msllm lora merge` makes a full model")
    if unplaced:
        raise InteropError(f"{ckpt}: lora.targets {unplaced}: {weights.architecture} stores them in no Linear "
                           f"a PEFT adapter can hold; `msllm lora merge` makes a full model")
    tensors = peft_linear(modules, cfg, adapters)
    patterns = joined_config(adapted, cfg.lora.rank, cfg.lora.alpha)
    metadata = {"format": "pt", BASE_SHA: weights.sha256, TARGETS_KEY: ",".join(cfg.lora.targets)}
    if experts:
        expert_tensors, expert_entries = peft_experts(cfg, adapters)
        tensors.update(expert_tensors)
        metadata[EXPERT_TARGETS_KEY] = ",".join(experts)
        patterns = {"target_parameters": expert_entries["target_parameters"],
                    **{key: {**patterns[key], **expert_entries[key]} for key in ("rank_pattern", "alpha_pattern")}}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
              "lora_dropout": 0.0 if experts else cfg.lora.dropout,  # PEFT's parameter LoRA refuses dropout
              "target_modules": list(dict.fromkeys(m.leaf for m in adapted)), **patterns,
              "base_model_name_or_path": str(weights.path.resolve()), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False}
    with staged_dir(out, need=sum(a.nbytes for a in tensors.values()), replace=force, sources=(run,),
                    then="free space or choose another OUT, then export again") as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata=metadata)
        write_json(tmp / PEFT_CONFIG, config)
    return Path(out)
