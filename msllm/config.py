"""The typed run configuration: a few sections of plain data (model, data, optim, train, parallel,
lora) and the constants their values are checked against. Data only: reading YAML and validating a
whole config is msllm.config_file. Every value is read once and passed down.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from msllm.errors import UserError
from msllm.params import layer_shapes, mtp_shapes, param_shapes


class ConfigError(UserError, ValueError):
    """A bad config value. str() is the one-line message shown to the user."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {key}: {message}")
        self.source, self.key = source, key


# The caches of a cached forward, two per kind of layer, in this order (ModelConfig.caches).
CACHE_NAMES = {"full": ("keys", "values"), "sliding": ("ring_keys", "ring_values"), "linear": ("states", "windows")}


def ring_length(window: int, length):
    """The slots of a sliding layer's ring cache for a cache of `length` slots: its window, or fewer when the
    whole cache is shorter. A symbolic length (a graph's dynamic dimension: None, or a name) stays symbolic."""
    if isinstance(length, int):
        return min(window, length)
    return None if length is None else f"min({length}, {window})"


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
    o_bias: bool = False              # the attention output projection has a bias (gpt-oss)
    tie_embeddings: bool = False
    max_seq_len: int = 256
    qk_norm: bool = False             # RMSNorm over q and k before RoPE (Qwen3, Gemma 3, OLMo 2/3)
    qk_norm_scope: str = "head"       # qk_norm over each head (Qwen3, Gemma 3) | projection: over all of q's and
                                      # all of k's features, one weight per feature (OLMo 2/3)
    norm_offset: float = 0.0          # every norm scales by (offset + weight): Gemma's (1 + w) is 1.0
    sandwich_norm: bool = False       # also a norm on the attention and MLP outputs before the residual add
    attention_sinks: bool = False     # a learned logit per head joins every softmax row, with no value: the
                                      # head can attend to nothing (gpt-oss's sinks)
    pre_norm: bool = True             # a norm on the attention and MLP inputs; false with sandwich_norm: the
                                      # outputs only are normed (OLMo 2/3's post-sublayer norms)
    mlp: str = "swiglu"               # swiglu: silu(gate) * up | geglu_tanh: gelu_tanh(gate) * up (Gemma) |
                                      # swiglu_clamped: gpt-oss's, gate <= limit, |up| <= limit,
                                      # gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_alpha: float = 1.702       # swiglu_clamped's alpha
    swiglu_limit: float = 7.0         # swiglu_clamped's limit
    embed_scale: float = 1.0          # embeddings x this (Gemma: sqrt(hidden_size))
    attn_scale: float = 0.0           # scores x this; 0: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    sliding_window: int = 0           # sliding layers attend to the last N positions (0: no sliding layers)
    # Per layer "full", "sliding" or "linear" (a Gated DeltaNet layer); None: every layer sliding when
    # sliding_window is set, else full.
    layer_types: Optional[list] = None
    rope_local_theta: float = 0.0     # RoPE base of sliding layers, unscaled (Gemma 3); 0: as full layers
    # Per layer "rope" or "none" (no position encoding: SmolLM3's NoPE layers); None: every layer rope.
    position_types: Optional[list] = None
    pad_token_id: int = -1            # its embedding row takes no gradient from lookups (HF padding_idx); -1: none
    num_experts: int = 0              # routed experts of each MoE layer (0: every MLP dense)
    experts_per_token: int = 2        # top-k experts each token is routed to
    moe_ffn_size: int = 0             # each expert's hidden size; 0: ffn_size
    norm_topk_prob: bool = True       # renormalise the top-k routing weights to sum to 1 (Mixtral; Qwen3-MoE's flag)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added in training (0: none; HF's, when
                                       # its output_router_logits is on)
    router_z_loss_coef: float = 0.0   # weight of the router z-loss added in training, the mean squared
                                      # log-sum-exp of the router's logits (ST-MoE); 0: none
    router_seq_aux_loss_coef: float = 0.0  # weight (DeepSeek-V3's alpha, ~1e-4) of the sequence-wise balance loss
                                           # added in training: per MoE layer and sequence, E/k x sum_e (share of
                                           # its tokens choosing e) x (e's mean normalised score), averaged over
                                           # the sequences and summed over the layers; 0: none
    # Per layer "dense" or "moe"; None: every layer moe when num_experts > 0 (Qwen3-MoE's mlp_only_layers).
    mlp_types: Optional[list] = None
    router: str = "softmax"           # softmax: top k of softmax(scores) | sigmoid_grouped: DeepSeek-V3's (sigmoid
                                      # scores, a fixed per-expert bias for the choice, top k within the best groups)
    expert_groups: int = 1            # sigmoid_grouped: experts in this many groups (DeepSeek-V3's n_group)
    topk_groups: int = 1              # sigmoid_grouped: a token's experts come from its best groups (topk_group)
    routed_scaling: float = 1.0       # the routing weights x this (DeepSeek-V3's routed_scaling_factor)
    router_bias: bool = False         # the router's logits have a learned bias per expert (gpt-oss)
    experts_bias: bool = False        # each expert's gate, up and down projections have biases (gpt-oss)
    shared_experts: int = 0           # every token also runs a gated MLP of shared_experts x moe_ffn_size
    shared_ffn_size: int = 0          # ..of this size instead, when set (Qwen3.5-MoE's shared_expert_intermediate_size)
    shared_gate: bool = False         # the shared MLP's output x sigmoid(a learned scalar of x) per token (Qwen3.5-MoE)
    attention: str = "gqa"            # gqa: q/k/v heads (MHA, GQA, MQA) | mla: multi-head latent attention (DeepSeek)
    q_lora_rank: int = 0              # mla: q through a normed rank-r bottleneck (0: one q projection)
    kv_lora_rank: int = 0             # mla: keys and values come from this latent, per token
    qk_nope_head_dim: int = 0         # mla: per-head q/k features without RoPE
    qk_rope_head_dim: int = 0         # mla: per-head q/k features with RoPE (the key's are shared by all heads)
    v_head_dim: int = 0               # mla: per-head value features
    rope_interleave: bool = False     # rotary pairs are neighbours (x0, x1), (x2, x3).. (DeepSeek), not the halves
    rope_fraction: float = 1.0        # RoPE rotates this leading fraction of each q/k head, the rest passes
                                      # (Qwen3.5 / Qwen3-Next: 0.25; GLM-4.5: 0.5)
    attn_output_gate: bool = False    # attention output x sigmoid(wg x) per head feature before wo (Qwen3.5)
    # Gated DeltaNet layers (layer_types "linear", msllm/models/mixers/gated_deltanet.py): their own
    # key / value heads and head sizes, and the depthwise causal conv over q, k, v
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # Multi-token prediction (DeepSeek-V3, GLM-4.5: num_nextn_predict_layers): depth k takes depth k-1's states
    # (depth 0: the model's final-normed ones) with the embedding of the token k ahead, through a block built
    # like the last layer, into the shared head, and predicts the token k + 1 ahead (msllm.models.mtp)
    mtp_depths: int = 0
    mtp_loss_weight: float = 0.0      # training loss = next-token loss + this x the mean over depths of their
                                      # losses; 0: the MTP blocks are carried (converted, saved) but not computed

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates: the head's leading rope_fraction (as transformers rounds
        it), or MLA's rope part."""
        return self.qk_rope_head_dim if self.mla else int(self.head_size * self.rope_fraction)

    @property
    def hybrid(self) -> bool:
        """Some layers mix with Gated DeltaNet (a recurrent state), the others with attention."""
        return "linear" in self.layer_kinds()

    def cache_shapes(self, batch, length) -> tuple[tuple, ...]:
        """Shapes of the preallocated caches a cached forward takes, in order (names: cache_names)."""
        return tuple(self.caches(batch, length).values())

    def cache_names(self) -> tuple[str, ...]:
        """The names of the caches a cached forward takes, in order (the exported graphs' past_<name> /
        present_<name>)."""
        return tuple(self.caches(1, 1))

    def caches(self, batch, length) -> dict[str, tuple]:
        """name -> shape of each preallocated cache a cached forward takes, for `length` slots (an int, or a
        graph's symbolic dimension: None or a name), in order: two per kind of layer the model has
        (layer_kinds), each stacked over the layers of its kind.
          full     keys, values [layers, batch, kv heads, length, head_dim]: every slot. MLA caches one latent
                   and one RoPE key per token instead (kv_lora_rank and qk_rope_head_dim features, one "head").
          sliding  ring_keys, ring_values: the same with min(sliding_window, length) slots, a ring: slot j is
                   kept at j % that, so the cache is flat in the context (Decoder.ring_slots).
          linear   states [layers, batch, value heads, d_k, d_v] and windows [layers, batch, kernel - 1, conv]:
                   a Gated DeltaNet layer's recurrent state and its conv's last inputs, whatever the length."""
        kinds = self.layer_kinds()
        out = {}
        for kind, names in CACHE_NAMES.items():
            layers = kinds.count(kind)
            if not layers:
                continue
            if kind == "linear":
                conv = (2 * self.linear_num_key_heads * self.linear_key_head_dim
                        + self.linear_num_value_heads * self.linear_value_head_dim)
                shapes = ((layers, batch, self.linear_num_value_heads, self.linear_key_head_dim,
                           self.linear_value_head_dim), (layers, batch, self.linear_conv_kernel - 1, conv))
            else:
                slots = length if kind == "full" else ring_length(self.sliding_window, length)
                if self.mla:
                    shapes = ((layers, batch, 1, slots, self.kv_lora_rank),
                              (layers, batch, 1, slots, self.qk_rope_head_dim))
                else:
                    shapes = ((layers, batch, self.num_kv_heads, slots, self.head_size),) * 2
            out.update(zip(names, shapes))
        return out

    @property
    def shared_size(self) -> int:
        """The hidden size of a MoE layer's shared MLP (0: none)."""
        return self.shared_ffn_size or self.shared_experts * (self.moe_ffn_size or self.ffn_size) if self.shared_experts else 0

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

    def position_kinds(self) -> list[str]:
        """"rope" or "none" for each layer."""
        return list(self.position_types) if self.position_types is not None else ["rope"] * self.num_layers

    def mixer_kinds(self) -> list[str]:
        """The token mixer of each layer (msllm.models.mixers.MIXERS): gated_deltanet for "linear" layers,
        model.attention for the others."""
        return ["gated_deltanet" if kind == "linear" else self.attention for kind in self.layer_kinds()]

    def mtp_layer_kind(self) -> tuple[str, str]:
        """(mlp kind, mixer kind) of every MTP depth's block: the last layer's (DeepSeek-V3's layer 61 is MoE
        as its layers from first_k_dense_replace on are)."""
        return self.mlp_kinds()[-1], self.mixer_kinds()[-1]

    @property
    def trains_mtp(self) -> bool:
        """The train step computes the MTP depths' losses."""
        return self.mtp_depths > 0 and self.mtp_loss_weight > 0

    def mlp_kinds(self) -> list[str]:
        """"dense" or "moe" for each layer."""
        if self.mlp_types is not None:
            return list(self.mlp_types)
        return ["moe" if self.num_experts else "dense"] * self.num_layers

    def num_params(self, active: bool = False) -> int:
        """The parameters of msllm.params but the routers' expert biases (buffers in transformers, moved by
        the balance rule, not the optimizer); `active`: those one token computes with (of a MoE layer's
        stacked [E, ...] experts, its k)."""
        def count(shapes: dict) -> int:
            total = 0
            for name, shape in shapes.items():
                size = 0 if name.endswith("router.expert_bias") else math.prod(shape)
                total += size // shape[0] * self.experts_per_token if active and ".experts." in name else size
            return total

        # Each kind of layer counted once (the planner counts a model per layout it tries), then the
        # embedding, final norm and head: the inventory of the model without its layers.
        kinds = list(zip(self.mlp_kinds(), self.mixer_kinds()))
        layers = sum(kinds.count(kind) * count(layer_shapes(self, *kind)) for kind in set(kinds))
        mtp = self.mtp_depths * count(mtp_shapes(self)) if self.mtp_depths else 0
        return layers + mtp + count(param_shapes(dataclasses.replace(self, num_layers=0, mlp_types=[], layer_types=[],
                                                                     mtp_depths=0)))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params (of MoE layers, the k experts a token uses) + attention
        scores (PaLM appendix B) of the attention layers + 3 x the chunked rule of the Gated DeltaNet layers."""
        non_embed = self.num_params(active=True) - self.vocab_size * self.hidden_size * (0 if self.tie_embeddings else 1)
        # scores q k^T over the q/k head, P v over the value head (equal but for MLA)
        linear_layers = self.layer_kinds().count("linear")
        attention = 6.0 * (self.num_layers - linear_layers) * self.num_heads * (self.head_size + self.value_size) * seq_len
        return 6.0 * non_embed + attention + 3.0 * linear_layers * self.linear_rule_flops(seq_len)

    def linear_rule_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one Gated DeltaNet layer's chunked rule as msllm computes it, in chunks of
        c = min(GATED_DELTA_CHUNK, seq_len) tokens, per value head: in a chunk (k beta) k^T, q k^T, u, w and the
        chunk's own output, 2 c (3 d_k + 2 d_v); (I + A)^-1's ceil(log2 c) - 1 squarings and products, 4 c^2 each;
        the carried state read twice and written once, 6 d_k d_v. (Backward: twice this.)"""
        c, dk, dv = min(GATED_DELTA_CHUNK, seq_len), self.linear_key_head_dim, self.linear_value_head_dim
        inverse = 4 * c * c * max(0, math.ceil(math.log2(c)) - 1)
        return float(self.linear_num_value_heads * (2 * c * (3 * dk + 2 * dv) + inverse + 6 * dk * dv))


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
                                      # from FLASH_MIN_SEQ tokens (generation: always), on Ascend whenever
                                      # FlashAttentionScore can
    precision: str = "fp32"           # fp32 | fp16 | bf16 compute; weights, norms, softmax, loss stay fp32
    accum_steps: int = 1              # micro-batches of batch_size per optimizer step
    recompute: str = "none"           # none | full | selective (attention core + MLP)
    objective: str = "auto"           # auto: next-token (lm) or SFT, as data.path holds | dpo: preference pairs
                                      # (the dpo section) | grpo: prompts, sampled and rewarded (the grpo
                                      # section); docs/post-training.md
    head_rows: str = "loss"           # which positions go through the output head: loss (SFT's labels with a
                                      # loss, DPO's and GRPO's completions, gathered into a capacity bucket per
                                      # batch that CPU data-parallel workers share; one compiled step per bucket;
                                      # context parallel keeps all) | all
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
                                                               # experts_gate, experts_up, experts_down (MoE experts'),
                                                               # linear_qkv, linear_z, linear_b, linear_a, linear_out
                                                               # (Gated DeltaNet layers' in_proj_* and out_proj)


@dataclass
class DPOConfig:
    """Direct preference optimisation (train.objective: dpo), TRL's DPOTrainer losses (msllm/train/dpo.py)."""
    loss: str = "sigmoid"             # sigmoid (DPO) | ipo (per-token-averaged log-ratios, as TRL)
    beta: float = 0.1                 # strength of the pull toward the reference model
    label_smoothing: float = 0.0      # sigmoid: the chance a pair's preference is flipped (conservative DPO)
    precompute_ref: bool = False      # the reference model's log-probs computed once before training and stored
                                      # beside the data shard (no reference forward per step); a full fine-tune
                                      # needs it, LoRA takes the base with the adapters off in the step otherwise
    share_prompt: bool = False        # a pair as one row: its prompt computed once, the two completions branching
                                      # from it (msllm/data/preference.py); CPU, full-attention layers only


@dataclass
class GRPOConfig:
    """Group-relative policy optimisation (train.objective: grpo): rollouts from msllm's compiled decoder,
    rewarded by the grpo.reward functions, TRL's clipped-ratio loss (msllm/train/grpo.py)."""
    reward: list = field(default_factory=list)         # path.py:function callables, TRL's signature
    reward_weights: list = field(default_factory=list)  # one per reward function (empty: all 1)
    group_size: int = 4               # completions sampled per prompt
    max_new_tokens: int = 32          # a completion's tokens at most (then it is cut, without EOS)
    temperature: float = 1.0          # sampling temperature (the loss scores logits / temperature, as TRL)
    top_p: float = 1.0                # nucleus sampling
    epsilon: float = 0.2              # the ratio is clipped to [1 - epsilon, 1 + epsilon]
    beta: float = 0.0                 # KL to the reference (the base with the LoRA adapters off), 0 as TRL
    num_iterations: int = 1           # optimizer steps on each rollout batch (train.steps counts them), its
                                      # sampling log-probs kept as the ratio's old ones, as TRL
    loss_type: str = "dapo"           # dapo | grpo | bnpo | dr_grpo, TRL's aggregations
    scale_rewards: str = "group"      # advantages divided by the group's reward std | batch | none


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
CHOICES = {
    "optim.decay": ("cosine", "linear", "constant"),
    "train.device": ("cpu", "gpu", "ascend"),
    "train.mode": ("graph", "pynative"),
    "train.jit_level": ("O0", "O1", "O2"),
    "train.fused_kernels": ("auto", "off"),
    "train.block_graph": ("auto", "shared", "inlined"),
    "train.attention": ("auto", "flash", "softmax"),
    "train.precision": ("fp32", "fp16", "bf16"),
    "train.recompute": ("none", "full", "selective"),
    "train.head_rows": ("loss", "all"),
    "train.objective": ("auto", "dpo", "grpo"),
    "grpo.loss_type": ("dapo", "grpo", "bnpo", "dr_grpo"),
    "grpo.scale_rewards": ("group", "batch", "none"),
    "dpo.loss": ("sigmoid", "ipo"),
    "train.moe_dropless": ("blocks", "every"),
    "model.mlp": ("swiglu", "geglu_tanh", "swiglu_clamped"),
    "model.router": ("softmax", "sigmoid_grouped"),
    "model.attention": ("gqa", "mla"),
    "model.qk_norm_scope": ("head", "projection"),
}
LAYER_TYPES = ("full", "sliding", "linear")
POSITION_TYPES = ("rope", "none")
MLP_TYPES = ("dense", "moe")
# Tokens per chunk of the Gated DeltaNet rule: [chunk, chunk] matmuls within one, the state carried across
# (msllm/models/mixers/gated_deltanet.py); the planner counts its FLOPs and memory by it.
GATED_DELTA_CHUNK = 64


# What each rope_scaling type reads (msllm.models.llama.rope_inv_freq), besides its type.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts_gate", "experts_up", "experts_down",
                "linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out")
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
