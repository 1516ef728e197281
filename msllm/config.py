"""Typed run configuration: YAML -> dataclasses, validated, with file+key errors.

A config is a few sections of plain data. Every value is read here once and passed
down; nothing else in msllm parses YAML.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from msllm.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad config value. str() is the one-line message shown to the user."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {key}: {message}")
        self.source, self.key = source, key


@dataclass
class ModelConfig:
    """A decoder LLM as data: sizes, then the parts that tell one family from another (the family
    spec; interop/maps/ names the values each Hugging Face architecture sets). The defaults are Llama."""
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_size: int = 352
    head_dim: int = 0                 # 0: hidden_size // num_heads (Qwen3 and Gemma 3 set it apart)
    rope_theta: float = 10000.0
    # None, or {"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} / {"type": "linear", "factor"} / {"type": "yarn", "factor",
    # "original_max_position_embeddings", optionally "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    # "attention_factor", "truncate"}
    rope_scaling: Optional[dict] = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 256
    qk_norm: bool = False             # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0          # every norm scales by (offset + weight): Gemma's (1 + w) is 1.0
    sandwich_norm: bool = False       # also a norm on the attention and MLP outputs before the residual add
    mlp: str = "swiglu"               # swiglu: silu(gate) * up | geglu_tanh: gelu_tanh(gate) * up (Gemma)
    embed_scale: float = 1.0          # embeddings x this (Gemma: sqrt(hidden_size))
    attn_scale: float = 0.0           # scores x this; 0: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    sliding_window: int = 0           # sliding layers attend to the last N positions (0: no sliding layers)
    # Per layer "full" or "sliding"; None: every layer sliding when sliding_window is set, else full.
    layer_types: Optional[list] = None
    rope_local_theta: float = 0.0     # RoPE base of sliding layers, unscaled (Gemma 3); 0: as full layers
    pad_token_id: int = -1            # its embedding row takes no gradient from lookups (HF padding_idx); -1: none
    num_experts: int = 0              # routed experts of each MoE layer (0: every MLP dense)
    experts_per_token: int = 2        # top-k experts each token is routed to
    moe_ffn_size: int = 0             # each expert's hidden size; 0: ffn_size
    norm_topk_prob: bool = True       # renormalise the top-k routing weights to sum to 1 (Mixtral; Qwen3-MoE's flag)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added in training (0: none; HF's, when
                                       # its output_router_logits is on)
    router_z_loss_coef: float = 0.0   # weight of the router z-loss added in training, the mean squared
                                      # log-sum-exp of the router's logits (ST-MoE); 0: none
    # Per layer "dense" or "moe"; None: every layer moe when num_experts > 0 (Qwen3-MoE's mlp_only_layers).
    mlp_types: Optional[list] = None
    router: str = "softmax"           # softmax: top k of softmax(scores) | sigmoid_grouped: DeepSeek-V3's (sigmoid
                                      # scores, a fixed per-expert bias for the choice, top k within the best groups)
    expert_groups: int = 1            # sigmoid_grouped: experts in this many groups (DeepSeek-V3's n_group)
    topk_groups: int = 1              # sigmoid_grouped: a token's experts come from its best groups (topk_group)
    routed_scaling: float = 1.0       # the routing weights x this (DeepSeek-V3's routed_scaling_factor)
    shared_experts: int = 0           # every token also runs a gated MLP of shared_experts x moe_ffn_size
    attention: str = "gqa"            # gqa: q/k/v heads (MHA, GQA, MQA) | mla: multi-head latent attention (DeepSeek)
    q_lora_rank: int = 0              # mla: q through a normed rank-r bottleneck (0: one q projection)
    kv_lora_rank: int = 0             # mla: keys and values come from this latent, per token
    qk_nope_head_dim: int = 0         # mla: per-head q/k features without RoPE
    qk_rope_head_dim: int = 0         # mla: per-head q/k features with RoPE (the key's are shared by all heads)
    v_head_dim: int = 0               # mla: per-head value features
    rope_interleave: bool = False     # rotary pairs are neighbours (x0, x1), (x2, x3).. (DeepSeek), not the halves

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates: the head, or MLA's rope part."""
        return self.qk_rope_head_dim if self.mla else self.head_size

    def cache_shapes(self, batch: int, length: int) -> tuple[tuple, tuple]:
        """Shapes of the preallocated keys and values a cached forward takes: per layer and row, each KV
        head's keys and values; MLA caches one latent and one RoPE key per token (kv_lora_rank +
        qk_rope_head_dim features, not every head's keys and values)."""
        if self.mla:
            return ((self.num_layers, batch, 1, length, self.kv_lora_rank),
                    (self.num_layers, batch, 1, length, self.qk_rope_head_dim))
        shape = (self.num_layers, batch, self.num_kv_heads, length, self.head_size)
        return shape, shape

    @property
    def value_size(self) -> int:
        """Features per value head: the head, or MLA's v_head_dim."""
        return self.v_head_dim if self.mla else self.head_size

    @property
    def head_size(self) -> int:
        """Features per attention head (of q and k): head_dim, or hidden_size // num_heads when it is 0;
        MLA's nope + rope parts."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_kinds(self) -> list[str]:
        """"full" or "sliding" for each layer."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["sliding" if self.sliding_window else "full"] * self.num_layers

    def mlp_kinds(self) -> list[str]:
        """"dense" or "moe" for each layer."""
        if self.mlp_types is not None:
            return list(self.mlp_types)
        return ["moe" if self.num_experts else "dense"] * self.num_layers

    def num_params(self, active: bool = False) -> int:
        """All parameters; `active`: those one token computes with (a MoE layer's k experts, not all E)."""
        h, f, v, d = self.hidden_size, self.ffn_size, self.vocab_size, self.head_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q * 2 + h * kv * 2 + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)
        if self.mla:
            r, c, n = self.q_lora_rank, self.kv_lora_rank, self.num_heads
            attn = ((h * r + r + r * q) if r else h * q) + h * (c + self.qk_rope_head_dim) + c \
                + c * n * (self.qk_nope_head_dim + self.v_head_dim) + n * self.v_head_dim * h
        experts = self.experts_per_token if active else self.num_experts
        expert = 3 * h * (self.moe_ffn_size or f)
        mlp = {"dense": 3 * h * f, "moe": (experts + self.shared_experts) * expert + self.num_experts * h}
        layers = sum(attn + mlp[kind] + (4 if self.sandwich_norm else 2) * h for kind in self.mlp_kinds())
        return v * h * (1 if self.tie_embeddings else 2) + layers + h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params (of MoE layers, the k experts a token uses) + attention
        scores (PaLM appendix B)."""
        non_embed = self.num_params(active=True) - self.vocab_size * self.hidden_size * (0 if self.tie_embeddings else 1)
        # scores q k^T over the q/k head, P v over the value head (equal but for MLA)
        return 6.0 * non_embed + 6.0 * self.num_layers * self.num_heads * (self.head_size + self.value_size) * seq_len


@dataclass
class DataConfig:
    # None: the running interpreter's standard-library sources. Otherwise a text file,
    # a directory of text files, a pretokenized shard directory (has index.json), or a
    # .jsonl file of SFT rows ({"prompt", "response"} or {"messages": [...]}, docs/fine-tuning.md).
    path: Optional[str] = None
    glob: str = "**/*.py"
    max_bytes: int = 12_000_000       # cap on corpus bytes read (0 = no cap)
    tokenizer: Optional[str] = None   # tokenizer.json to reuse; None trains one (train.init_from: the source's)
    seq_len: int = 128
    # Pretraining windows cut the EOS-joined documents; true: each token attends only within its
    # own document and positions restart at each (document-aware packing; an SFT .jsonl always is)
    document_attention: bool = False
    val_fraction: float = 0.02
    seed: int = 1234
    shuffle: bool = True


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30            # linear warmup to lr over this many steps (optim.warmup_ratio wins when set)
    warmup_ratio: Optional[float] = None  # warmup as a fraction of train.steps, rounded up (as HF trainers);
                                          # null: optim.warmup_steps
    decay: str = "cosine"             # cosine | linear | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0            # global-norm clip; 0 disables


@dataclass
class TrainConfig:
    run_dir: str = "runs/tiny"
    steps: int = 400
    batch_size: int = 16
    seed: int = 0
    device: str = "cpu"               # cpu | gpu | ascend
    mode: str = "graph"               # graph | pynative
    threads: int = 0                  # MindSpore runtime threads; 0 = number of cores
    jit_level: str = "O0"
    compile_cache: Optional[str] = None  # dir for MindSpore's compile cache (speeds up the next start)
    fused_kernels: str = "auto"       # auto: msllm.kernels' fused C++ train-step kernels on CPU (needs g++) | off
    block_graph: str = "auto"         # shared: every layer calls one compiled block graph (compile ~flat in
                                      # depth, steps ~2% slower; no recompute) | inlined | auto: shared on CPU
                                      # from 16 layers without recompute
    attention: str = "auto"           # flash: by blocks of keys, memory linear in the sequence (CPU: the fused
                                      # kernel, so fused_kernels auto; Ascend: FlashAttentionScore, fp16/bf16)
                                      # | softmax: the [s, t] scores | auto: flash on CPU with the fused kernels
                                      # from FLASH_MIN_SEQ tokens, on Ascend whenever FlashAttentionScore can
    precision: str = "fp32"           # fp32 | fp16 | bf16 compute; weights, norms, softmax, loss stay fp32
    accum_steps: int = 1              # micro-batches of batch_size per optimizer step
    recompute: str = "none"           # none | full | selective (attention core + MLP)
    moe_capacity_factor: float = 0.0  # MoE: each expert computes at most factor x its even share of the
                                      # routed choices, the rest dropped and counted (0: dropless)
    moe_dropless: str = "blocks"      # how dropless MoE layers train: blocks (the choices grouped by expert in
                                      # blocks, ~the routed FLOPs) | every (every token through every expert)
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3's aux-loss-free balance: after each step every expert's
                                       # routing bias moves this much toward even load (0: off; DeepSeek: 0.001)
    loss_scale: float = 65536.0       # initial dynamic loss scale (fp16 only)
    loss_scale_window: int = 1000     # finite steps before the scale doubles
    max_bad_steps: int = 5            # consecutive non-finite steps before the run stops
    debug_nonfinite: bool = False     # re-run the first non-finite step eagerly, name the Cell (docs/debugging.md);
                                      # always done when max_bad_steps stops a run
    keep_checkpoints: int = 3         # newest K checkpoints kept
    background_checkpoint: bool = True  # training pauses only to copy the state to host memory; a thread
                                        # writes it (one at a time); a failed write is a warning, not a stop
    max_restarts: int = 0             # msllm launch: restarts from the newest checkpoint when a worker dies
    hang_timeout_s: float = 300.0     # msllm launch: a worker without a step for the larger of this and 10x
                                      # its median step is hung: stacks dumped, group stopped (and restarted)
    log_every: int = 20
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 200
    # For MFU. Default: fp32 GEMM throughput measured with torch on this 2-core AVX-512 CI
    # machine (~380 GFLOP/s); set your device's peak (e.g. 2.8e14 for an Ascend 910B in fp16).
    peak_flops: float = 3.8e11
    sample_prompt: str = "def "
    sample_tokens: int = 48
    # Start from pretrained weights: a Hugging Face dir, an msllm checkpoint or run dir, or a
    # MindFormers dir. The model section and the tokenizer come from it; the optimizer starts fresh.
    init_from: Optional[str] = None
    lora_from: Optional[str] = None   # a PEFT LoRA adapter dir to continue training (needs init_from)


@dataclass
class ParallelConfig:
    """How a run is laid out over devices (Ascend semi-auto parallel; see docs/layouts.md).

    The global batch (sequences per optimizer step) is train.batch_size x train.accum_steps, as
    on one device: the layout splits it dp ways and micro_batches ways in time, never changes it.
    Recompute stays train.recompute.
    """
    dp: int = 1                       # data-parallel replicas
    tp: int = 1                       # tensor-parallel group: heads, ffn and vocab split over it
    cp: int = 1                       # context parallel: each sequence split over cp ranks (zig-zag chunks;
                                      # CPU over msrun: workers = dp x cp; docs/long-context.md)
    pp: int = 1                       # pipeline stages (layers split by stage)
    ep: int = 1                       # expert parallel: each MoE layer's experts split over ep data-parallel
                                      # ranks (CPU over msrun: all-gather dispatcher; msllm/parallel/ep.py)
    micro_batches: int = 1            # pipeline micro-batches per step (>= pp)
    optimizer_shard: bool = False     # ZeRO-1: Adam states (and fp32 master) split over dp
    sequence_parallel: bool = False   # norms and residual adds split over tokens within tp
    vocab_parallel: bool = True       # embedding and LM head split over vocab (falls back to dp)
    sink_size: int = 0                # Ascend data sink: steps per host call (0 = no sink)


@dataclass
class LoraConfig:
    """Low-rank adapters on the chosen projections of every layer; the base weights stay frozen
    (msllm/lora.py). y = W x + (alpha / rank) * B A x, as PEFT computes it."""
    rank: int = 0                     # 0 = off
    alpha: float = 16.0
    dropout: float = 0.0              # on the adapter's input; > 0 makes resume not bit-exact
    targets: list = field(default_factory=lambda: ["q", "v"])  # of q, k, v, o, gate, up, down (a dense MLP's),
                                                               # experts_gate, experts_up, experts_down (MoE experts')


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_CHOICES = {
    "optim.decay": ("cosine", "linear", "constant"),
    "train.device": ("cpu", "gpu", "ascend"),
    "train.mode": ("graph", "pynative"),
    "train.jit_level": ("O0", "O1", "O2"),
    "train.fused_kernels": ("auto", "off"),
    "train.block_graph": ("auto", "shared", "inlined"),
    "train.attention": ("auto", "flash", "softmax"),
    "train.precision": ("fp32", "fp16", "bf16"),
    "train.recompute": ("none", "full", "selective"),
    "train.moe_dropless": ("blocks", "every"),
    "model.mlp": ("swiglu", "geglu_tanh"),
    "model.router": ("softmax", "sigmoid_grouped"),
    "model.attention": ("gqa", "mla"),
}
LAYER_TYPES = ("full", "sliding")
MLP_TYPES = ("dense", "moe")


def _coerce(value: Any, annotation: str, source: str, key: str) -> Any:
    """Check one YAML value against a dataclass field annotation (given as a string)."""
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    if value is None:
        if optional:
            return None
        raise ConfigError(source, key, f"must not be null (expected {base})")
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML reads 1e-5 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(source, key, f"must be a finite number, got {value!r}")
            return number
    elif base == "str":
        if isinstance(value, str):
            return value
        if isinstance(value, bool):  # YAML 1.1: off / on / no / yes are booleans
            raise ConfigError(source, key, f"expected str, got bool {value!r} (YAML reads off/on/no/yes as "
                                           f"booleans: quote the value)")
    elif base == "dict":
        if isinstance(value, dict):
            return value
    elif base == "list":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    got = type(value).__name__
    raise ConfigError(source, key, f"expected {base}, got {got} {value!r}")


def _apply(cfg: Config, data: Any, source: str, origins: dict | None = None) -> None:
    """Set the values in `data` (section -> key -> value) on cfg; origins[dotted key] = source."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(source, "<top>", f"expected a mapping of sections ({', '.join(SECTIONS)})")
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(source, str(section), f"unknown section; expected one of {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(source, section, "expected a mapping")
        obj = getattr(cfg, section)
        types = {f.name: f.type for f in dataclasses.fields(obj)}
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if key not in types:
                raise ConfigError(source, dotted, f"unknown key; known keys: {', '.join(types)}")
            setattr(obj, key, _coerce(value, types[key], source, dotted))
            if origins is not None:
                origins.pop(dotted, None)  # re-inserted last: dict order is application order
                origins[dotted] = source


# What each rope_scaling type reads (msllm.models.llama.rope_inv_freq), besides its type.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts_gate", "experts_up", "experts_down")
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                     "yarn": ("factor", "original_max_position_embeddings")}
# ... and what it reads when given (absent: transformers' defaults)
ROPE_SCALING_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")}
MAX_VOCAB = 2**31 - 1   # token ids are int32


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` times the original (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


MAX_SEED = 2**32 - 1    # numpy and MindSpore seeds


def _needs(source: str, origins: dict | None):
    """need(ok, key, message, *involved): an error is blamed on where the offending value was set:
    the last-applied of the keys involved (--set after the file), or `source` for defaults."""
    order = list(origins or {})

    def need(ok: bool, key: str, message: str, *involved: str):
        if not ok:
            keys = [k for k in (key, *involved) if k in order]
            blamed = origins[max(keys, key=order.index)] if keys else source
            raise ConfigError(blamed, key, message)
    return need


def _check_lora(cfg: Config, need) -> None:
    """The lora section on its own (checked before train.init_from is read, too)."""
    lora, t = cfg.lora, cfg.train
    need(lora.rank >= 0, "lora.rank", "must be >= 0 (0 = off)")
    need(lora.alpha > 0, "lora.alpha", "must be > 0")
    need(0 <= lora.dropout < 1, "lora.dropout", "must be in [0, 1)")
    unknown = [x for x in lora.targets if x not in LORA_TARGETS]
    need(not unknown, "lora.targets", f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(LORA_TARGETS)}")
    need(bool(lora.targets) and len(set(lora.targets)) == len(lora.targets), "lora.targets",
         f"needs distinct names of {', '.join(LORA_TARGETS)}, got {lora.targets!r}")
    need(lora.rank == 0 or t.init_from is not None, "lora.rank",
         "LoRA adapts pretrained weights: set train.init_from (or --init-from)", "train.init_from")
    need(t.lora_from is None or t.init_from is not None, "train.lora_from",
         "a PEFT adapter needs its base model: set train.init_from", "train.init_from")


def _check(cfg: Config, source: str, origins: dict | None = None) -> None:
    """Validate the whole config, blaming each error on where its value was set (_needs)."""
    need = _needs(source, origins)
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "max_seq_len"):
        need(getattr(m, key) > 0, f"model.{key}", "must be > 0")
    need(m.vocab_size <= MAX_VOCAB, "model.vocab_size", f"must be <= {MAX_VOCAB} (token ids are int32)")
    need(m.head_dim >= 0, "model.head_dim", "must be >= 0 (0: hidden_size // num_heads)")
    need(m.head_dim > 0 or m.hidden_size % m.num_heads == 0, "model.num_heads",
         f"must divide model.hidden_size ({m.hidden_size} % {m.num_heads} != 0), or set model.head_dim",
         "model.hidden_size")
    need(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads",
         f"must divide model.num_heads ({m.num_heads} % {m.num_kv_heads} != 0)", "model.num_heads")
    need(m.mla or m.head_size % 2 == 0, "model.num_heads", f"head_dim {m.head_size} must be even for RoPE",
         "model.hidden_size")
    if m.mla:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(m, key) > 0, f"model.{key}", "must be > 0 with model.attention mla", "model.attention")
        need(m.q_lora_rank >= 0, "model.q_lora_rank", "must be >= 0 (0: one q projection)")
        need(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", "must be even for RoPE")
        need(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
             f"must equal model.num_heads ({m.num_heads}) with mla: every head expands its own keys", "model.attention")
    need(m.rope_theta > 0, "model.rope_theta", "must be > 0")
    need(m.norm_eps > 0, "model.norm_eps", "must be > 0")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling, need)
    need(m.embed_scale > 0, "model.embed_scale", "must be > 0")
    need(m.attn_scale >= 0, "model.attn_scale", "must be >= 0 (0: 1/sqrt(head_dim))")
    need(m.rope_local_theta >= 0, "model.rope_local_theta", "must be >= 0 (0: model.rope_theta)")
    need(m.sliding_window >= 0, "model.sliding_window", "must be >= 0 (0: no sliding layers)")
    if m.layer_types is not None:
        need(len(m.layer_types) == m.num_layers, "model.layer_types",
             f"needs one entry per layer ({m.num_layers}), got {len(m.layer_types)}", "model.num_layers")
        odd = sorted(set(m.layer_types) - set(LAYER_TYPES))
        need(not odd, "model.layer_types", f"unknown {', '.join(map(repr, odd))}; each is one of {', '.join(LAYER_TYPES)}")
    need(m.num_experts >= 0 and m.moe_ffn_size >= 0, "model.num_experts", "must be >= 0 (0: dense MLPs)")
    need(m.num_experts == 0 or 1 <= m.experts_per_token <= m.num_experts, "model.experts_per_token",
         f"must be in [1, model.num_experts ({m.num_experts})]", "model.num_experts")
    need(m.expert_groups >= 1 and m.num_experts % m.expert_groups == 0, "model.expert_groups",
         f"must be >= 1 and divide model.num_experts ({m.num_experts})", "model.num_experts")
    need(1 <= m.topk_groups <= m.expert_groups, "model.topk_groups", f"must be in [1, model.expert_groups ({m.expert_groups})]",
         "model.expert_groups")
    need(m.router == "sigmoid_grouped" or m.expert_groups == 1, "model.expert_groups",
         "groups are routed by model.router sigmoid_grouped only", "model.router")
    if m.router == "sigmoid_grouped" and m.num_experts:
        per_group = m.num_experts // m.expert_groups
        need(per_group >= 2, "model.expert_groups", "groups need at least 2 experts (each is scored by its best two)",
             "model.num_experts")
        need(m.experts_per_token <= m.topk_groups * per_group, "model.experts_per_token",
             f"must be <= the experts of model.topk_groups groups ({m.topk_groups * per_group})", "model.topk_groups")
    need(m.routed_scaling > 0, "model.routed_scaling", "must be > 0")
    need(m.shared_experts >= 0, "model.shared_experts", "must be >= 0")
    need(m.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", "must be >= 0 (0: no load-balancing loss)")
    need(m.router_z_loss_coef >= 0, "model.router_z_loss_coef", "must be >= 0 (0: no router z-loss)")
    if m.mlp_types is not None:
        need(len(m.mlp_types) == m.num_layers, "model.mlp_types",
             f"needs one entry per layer ({m.num_layers}), got {len(m.mlp_types)}", "model.num_layers")
        odd = sorted(set(m.mlp_types) - set(MLP_TYPES))
        need(not odd, "model.mlp_types", f"unknown {', '.join(map(repr, odd))}; each is one of {', '.join(MLP_TYPES)}")
        need(m.num_experts > 0 or "moe" not in m.mlp_types, "model.num_experts",
             "model.mlp_types has moe layers: set the number of experts (> 0)", "model.mlp_types")
    need(t.block_graph != "shared" or len(set(m.mlp_kinds())) == 1, "train.block_graph",
         "shared needs every block alike; model.mlp_types mixes dense and moe layers", "model.mlp_types")
    need(m.sliding_window > 0 or "sliding" not in m.layer_kinds(), "model.sliding_window",
         "model.layer_types has sliding layers: set the window (> 0)", "model.layer_types")
    need(d.seq_len > 1, "data.seq_len", "must be > 1")
    need(d.seq_len <= m.max_seq_len, "data.seq_len", f"must be <= model.max_seq_len ({m.max_seq_len})",
         "model.max_seq_len")
    need(0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
    need(d.max_bytes >= 0, "data.max_bytes", "must be >= 0")
    need(d.glob != "", "data.glob", "must not be empty (e.g. '**/*.py')")
    for key, value in (("data.path", d.path), ("data.tokenizer", d.tokenizer), ("train.run_dir", t.run_dir),
                       ("train.compile_cache", t.compile_cache), ("train.init_from", t.init_from),
                       ("train.lora_from", t.lora_from)):
        need(value is None or value.strip() != "", key, "must not be an empty path" +
             ("" if key == "train.run_dir" else " (null for none)"))
    for key, value in (("data.seed", d.seed), ("train.seed", t.seed)):
        need(0 <= value <= MAX_SEED, key, f"must be in [0, {MAX_SEED}]")
    need(o.lr > 0, "optim.lr", "must be > 0")
    need(0 <= o.min_lr <= o.lr, "optim.min_lr", "must be in [0, optim.lr]", "optim.lr")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    if o.warmup_ratio is not None:
        need(0 <= o.warmup_ratio < 1, "optim.warmup_ratio", f"must be in [0, 1), got {o.warmup_ratio!r}")
        # Both changed from their defaults: which one was meant is a guess, so ask.
        need(o.warmup_steps == OptimConfig.warmup_steps, "optim.warmup_ratio",
             f"set either optim.warmup_ratio or optim.warmup_steps ({o.warmup_steps}), not both",
             "optim.warmup_steps")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(0 <= o.beta1 < 1, "optim.beta1", "must be in [0, 1)")
    need(0 <= o.beta2 < 1, "optim.beta2", "must be in [0, 1)")
    need(o.eps > 0, "optim.eps", "must be > 0")
    need(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
    need(t.steps > 0, "train.steps", "must be > 0")
    need(t.batch_size > 0, "train.batch_size", "must be > 0")
    need(t.threads >= 0, "train.threads", "must be >= 0")
    for key in ("log_every", "eval_every", "ckpt_every", "eval_batches", "accum_steps", "loss_scale_window",
                "max_bad_steps", "keep_checkpoints"):
        need(getattr(t, key) > 0, f"train.{key}", "must be > 0")
    need(t.sample_tokens >= 0, "train.sample_tokens", "must be >= 0 (0 skips the sample)")
    need(t.max_restarts >= 0, "train.max_restarts", "must be >= 0 (0: a dead worker ends the job)")
    need(t.hang_timeout_s > 0, "train.hang_timeout_s", "must be > 0 (seconds)")
    need(t.peak_flops > 0, "train.peak_flops", "must be > 0")
    need(t.loss_scale >= 1, "train.loss_scale", "must be >= 1")
    _check_lora(cfg, need)
    if cfg.lora.rank > 0:
        kinds = set(m.mlp_kinds())
        idle = [x for x in cfg.lora.targets if x.startswith("experts_") and "moe" not in kinds
                or x in ("gate", "up", "down") and "dense" not in kinds]
        need(not idle, "lora.targets", f"{', '.join(idle)} adapt no layer of this model (its MLPs are "
             f"{' and '.join(sorted(kinds))}); gate / up / down adapt dense MLPs, experts_* MoE experts")
        unmatched = [x for x in cfg.lora.targets if m.mla and (x in ("k", "v") or x == "q" and m.q_lora_rank)]
        need(not unmatched, "lora.targets", f"{', '.join(unmatched)} adapt no layer of this model: MLA (model.attention "
             f"mla) has no wk / wv{' / wq (q_lora_rank is set)' if m.q_lora_rank else ''}; o adapts its wo")
    need(not (t.attention == "flash" and t.device == "cpu" and t.fused_kernels == "off"), "train.attention",
         "flash on CPU is a fused kernel; set train.fused_kernels: auto, or train.attention: softmax",
         "train.fused_kernels")
    if t.attention == "flash" and t.device == "ascend":  # late: msllm.backends reads Config
        from msllm.backends import SOFTMAX_INSTEAD, ascend_flash_problem, packed_samples

        problem = ascend_flash_problem(cfg, packed_samples(cfg))
        if problem is not None:
            need(False, "train.attention", problem[1] + SOFTMAX_INSTEAD, problem[0])
    need(t.moe_capacity_factor >= 0, "train.moe_capacity_factor", "must be >= 0 (0: dropless)")
    need(t.moe_bias_update_rate >= 0, "train.moe_bias_update_rate", "must be >= 0 (0: off)")
    need(t.moe_bias_update_rate == 0 or (m.router == "sigmoid_grouped" and "moe" in m.mlp_kinds()),
         "train.moe_bias_update_rate", "moves the expert biases of model.router sigmoid_grouped (DeepSeek-V3), "
         "which this model has not; set 0", "model.router")
    need(not (t.block_graph == "shared" and t.recompute != "none"), "train.block_graph",
         "shared cannot recompute (MindSpore 2.10 ignores recompute inside the shared block graph); "
         "use inlined or auto with train.recompute", "train.recompute")
    for dotted, choices in _CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        need(value in choices, dotted, f"must be one of {', '.join(choices)}, got {value!r}")
    from msllm.parallel.check import check_parallel  # late: it reads Config

    check_parallel(cfg, source=source)


def _check_rope_scaling(scaling: dict, check) -> None:
    key = "model.rope_scaling"

    def need(ok, name, message):
        check(ok, name, message, key)

    kinds = [scaling[k] for k in ("type", "rope_type") if k in scaling]
    need(kinds and all(k == kinds[0] for k in kinds), key, f"needs one type (type or rope_type), got {scaling!r}")
    kind = kinds[0]
    need(isinstance(kind, str) and kind in ROPE_SCALING_KEYS, f"{key}.type",
         f"must be one of {', '.join(ROPE_SCALING_KEYS)}, got {kind!r} (msllm computes no other rope scaling)")
    expected, optional = ROPE_SCALING_KEYS[kind], ROPE_SCALING_OPTIONAL.get(kind, ())
    unknown = sorted(map(str, set(scaling) - {"type", "rope_type", *expected, *optional}))
    need(not unknown, key, f"{kind} takes {', '.join(expected + optional)}; unknown {', '.join(map(str, unknown))}")

    def number(value, low):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low

    for name in expected:
        need(number(scaling.get(name), 1e-300), f"{key}.{name}", f"{kind} needs a finite number > 0, got {scaling.get(name)!r}")
    for name in optional:
        value = scaling.get(name)
        ok = value is None or (isinstance(value, bool) if name == "truncate" else number(value, 0))
        need(ok, f"{key}.{name}", f"must be {'true or false' if name == 'truncate' else 'a finite number >= 0'} or null, "
             f"got {value!r}")
    if kind == "llama3":
        need(scaling["high_freq_factor"] > scaling["low_freq_factor"], f"{key}.high_freq_factor",
             f"must be > low_freq_factor ({scaling['low_freq_factor']}): the band between them is blended")


def parse_override(text: str) -> tuple[str, Any]:
    """'optim.lr=3e-4' -> ('optim.lr', 0.0003). The value is read as YAML, except for text keys
    (run_dir, paths, choices), which take it as written: `train.fused_kernels=off` is "off"."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected SECTION.KEY=VALUE")
    key, raw = (part.strip() for part in text.split("=", 1))
    if key.count(".") != 1:
        raise ConfigError("--set", key, "expected SECTION.KEY=VALUE")
    section, name = key.split(".")
    fields = {f.name: f.type for f in dataclasses.fields(getattr(Config(), section))} if section in SECTIONS else {}
    if fields.get(name) in ("str", "Optional[str]") and raw not in ("null", "~"):
        return key, raw[1:-1] if len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError("--set", key, f"invalid YAML value {raw!r} ({getattr(e, 'problem', e)})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


@dataclass
class Pretrained:
    """What train.init_from (and train.lora_from) fix in a config: the model, the tokenizer, the adapter."""
    source: str
    model: ModelConfig
    tokenizer: Optional[str]          # the source's tokenizer.json, if it has one
    lora: Optional[dict] = None       # rank, alpha, targets of the adapter train.lora_from holds


def _adopt(cfg: Config, origins: dict, pretrained: Pretrained) -> None:
    """The model (and adapter) sections become the pretrained ones. A value set in the file or with
    --set that contradicts them is refused, naming both; model.max_seq_len may only shrink the context."""
    def adopt(section: str, theirs: dict, where: str):
        obj = getattr(cfg, section)
        for key, value in theirs.items():
            dotted, mine = f"{section}.{key}", getattr(obj, key)
            if dotted in origins and mine != value:
                if dotted == "model.max_seq_len" and 0 < mine <= value:
                    continue  # a shorter context keeps every weight
                raise ConfigError(origins[dotted], dotted, f"{mine!r} contradicts {value!r} of {where}; leave it unset")
            setattr(obj, key, value)

    adopt("model", dataclasses.asdict(pretrained.model), pretrained.source)
    if pretrained.lora is not None:
        adopt("lora", pretrained.lora, str(cfg.train.lora_from))
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = pretrained.tokenizer


def load_config(path: Optional[str | Path] = None, overrides: typing.Sequence[str] = (),
                pretrained: Optional[typing.Callable[[str, Optional[str]], Pretrained]] = None) -> Config:
    """Defaults <- YAML file <- --set overrides, then validate the whole. With train.init_from set,
    pretrained(init_from, lora_from) describes the source (the CLI reads it through interop)."""
    cfg, origins = Config(), {}
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(source, "<file>", f"cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(source, "<file>", f"not UTF-8 text (byte {e.start})") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark else "<file>"
            raise ConfigError(source, where, f"invalid YAML: {getattr(e, 'problem', e)}") from None
        _apply(cfg, data, source, origins)
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        _apply(cfg, {section: {name: value}}, "--set", origins)
    if pretrained is not None and cfg.train.init_from is not None:
        _check_lora(cfg, _needs(str(path) if path else "<defaults>", origins))  # before the source is read
        _adopt(cfg, origins, pretrained(cfg.train.init_from, cfg.train.lora_from))
    _check(cfg, str(path) if path else "<defaults>", origins)
    return cfg


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    cfg = Config()
    _apply(cfg, data, source)
    _check(cfg, source)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
