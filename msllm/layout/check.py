"""The layout checker: a config's `parallel:` section against its model, batch and device count,
before anything is compiled. The first problem found is one line naming the key (exit 2).

Runs on every config load (without a device count) and as `msllm plan --check --devices N`.
"""
from __future__ import annotations

import dataclasses

from msllm.config import Config, ConfigError
from msllm.layout.table import sharding, strategy_problems
from msllm.rules import ascend_flash_problem, packed_samples


def global_batch_of(cfg: Config) -> int:
    """Sequences per optimizer step: train.batch_size per data-parallel replica x accum_steps x dp."""
    return cfg.train.batch_size * cfg.train.accum_steps * cfg.parallel.dp


def layout_problem(cfg: Config, devices: int | None = None, global_batch: int | None = None,
                   seq_len: int | None = None) -> tuple[str, str] | None:
    """(key, message) of the first thing wrong with cfg.parallel, or None."""
    m, p = cfg.model, cfg.parallel
    batch = global_batch_of(cfg) if global_batch is None else global_batch
    seq = cfg.data.seq_len if seq_len is None else seq_len
    for key in ("dp", "tp", "pp", "cp", "ep", "micro_batches"):
        if getattr(p, key) < 1:
            return f"parallel.{key}", "must be >= 1"
    if p.sink_size < 0:
        return "parallel.sink_size", "must be >= 0 (0 = no data sink)"
    if devices is not None and p.dp * p.cp * p.tp * p.pp != devices:
        names, sizes = ("dp x cp x tp x pp", (p.dp, p.cp, p.tp, p.pp)) if p.cp > 1 else ("dp x tp x pp", (p.dp, p.tp, p.pp))
        return "parallel", (f"{names} = {' x '.join(map(str, sizes))} = {p.dp * p.cp * p.tp * p.pp} "
                            f"must equal the device count {devices}")
    for key in ("cp", "pp"):
        if m.hybrid and getattr(p, key) > 1:
            return f"parallel.{key}", ("must be 1 with Gated DeltaNet (linear) layers in model.layer_types: they are "
                                       "laid out over tp and dp only")
    problem = linear_attention_problem(cfg)
    if problem is not None:
        return problem
    problem = context_parallel_problem(cfg, seq)
    if problem is not None:
        return problem
    problem = expert_parallel_problem(cfg)
    if problem is not None:
        return problem
    if m.num_heads % p.tp:
        return "parallel.tp", f"must divide model.num_heads ({m.num_heads} % {p.tp} != 0)"
    if m.num_kv_heads % p.tp and p.tp % m.num_kv_heads:
        return "parallel.tp", (f"must divide model.num_kv_heads ({m.num_kv_heads}) or be a multiple of it "
                               f"(each KV head then serves tp / kv ranks)")
    if m.ffn_size % p.tp:
        return "parallel.tp", f"must divide model.ffn_size ({m.ffn_size} % {p.tp} != 0)"
    if p.pp > m.num_layers:
        return "parallel.pp", f"must be <= model.num_layers ({m.num_layers})"
    if p.pp > 1 and m.tie_embeddings:
        return "parallel.pp", ("tied embeddings need the table on the first and the last stage; "
                               "use pp 1 or untie (model.tie_embeddings: false)")
    if p.pp > 1 and p.micro_batches < p.pp:
        return "parallel.micro_batches", f"must be >= parallel.pp ({p.pp}) or stages sit idle"
    if p.micro_batches > 1 and cfg.train.accum_steps > 1:
        return "parallel.micro_batches", ("and train.accum_steps both split the batch in time; "
                                          "set train.accum_steps 1 (micro_batches cuts train.batch_size)")
    if batch % (p.dp * p.micro_batches):
        return "parallel", (f"the global batch {batch} (train.batch_size x accum_steps x dp) must be divisible "
                            f"by dp x micro_batches = {p.dp} x {p.micro_batches}")
    if p.sequence_parallel and p.tp == 1:
        return "parallel.sequence_parallel", "needs tp > 1 (it splits tokens within the tp group)"
    if p.sequence_parallel and seq % p.tp:
        return "parallel.sequence_parallel", f"needs data.seq_len divisible by tp ({seq} % {p.tp} != 0)"
    sh = sharding(m, p)
    if cfg.train.device != "ascend":  # CPU's context and expert parallel are msllm.parallel.cp's and .ep's
        sh = dataclasses.replace(sh, cp=1, ep=1)  # exchanges over the launched workers, not table layouts
    problems = strategy_problems(m, sh, batch // p.micro_batches, seq, cfg.train.moe_capacity_factor or 1.0)
    if problems:
        return "parallel", f"layout table: {problems[0]}"
    return None


def linear_attention_problem(cfg: Config) -> tuple[str, str] | None:
    """(key, message) when parallel.tp cannot cut a hybrid's Gated DeltaNet layers by head (msllm.layout.table):
    tp must divide their key heads (their value heads are a multiple), and the attention layers' KV heads,
    whose wk / wv rows (cut over tp_kv) the linear layers' wk / wv share."""
    p, m = cfg.parallel, cfg.model
    if not m.hybrid or p.tp == 1:
        return None
    if m.linear_num_key_heads % p.tp:
        return "parallel.tp", (f"must divide model.linear_num_key_heads ({m.linear_num_key_heads} % {p.tp} != 0): "
                               f"each rank runs whole Gated DeltaNet key heads")
    if m.num_kv_heads % p.tp:
        return "parallel.tp", (f"must divide model.num_kv_heads ({m.num_kv_heads} % {p.tp} != 0) in a hybrid: the "
                               f"Gated DeltaNet layers' wk / wv take the attention layers' KV-head cut")
    return None


def expert_parallel_problem(cfg: Config) -> tuple[str, str] | None:
    """(key, message) when parallel.ep cannot split this config's experts over its data-parallel ranks.
    On CPU the run's worker count is checked again at launch (msllm.parallel.ep.check); on Ascend the
    experts' rows move by AllToAll at a fixed capacity (msllm.models.moe.GroupedCapacityDispatch)."""
    p, m = cfg.parallel, cfg.model
    if p.ep == 1:
        return None
    if "moe" not in m.mlp_kinds():
        return "parallel.ep", f"is {p.ep} but the model has no MoE layer (model.num_experts)"
    if m.num_experts % p.ep:
        return "parallel.ep", f"must divide model.num_experts ({m.num_experts} % {p.ep} != 0)"
    if cfg.train.device == "cpu":
        return None
    if p.dp % p.ep:
        return "parallel.ep", f"must divide parallel.dp ({p.dp} % {p.ep} != 0): an ep group is ep data-parallel ranks"
    if cfg.train.moe_capacity_factor <= 0:
        return "train.moe_capacity_factor", (f"must be > 0 for expert parallel on {cfg.train.device} (e.g. 1.25): "
                                             f"the experts' rows move by AllToAll at a fixed capacity")
    return None


def context_parallel_problem(cfg: Config, seq: int) -> tuple[str, str] | None:
    """(key, message) when parallel.cp cannot split this config's sequences, else None. Executed on
    CPU (msllm.parallel.cp) with data parallel only, in zig-zag chunks (2 cp of them); on Ascend it is
    FlashAttentionScore's ring attention (msllm.layout.table), generated and checked here, not run."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return None
    if cfg.model.mla:  # its exchange (msllm.parallel.cp.ExchangeKV) joins keys and values of one shape
        return "parallel.cp", "context parallel is not built for MLA (model.attention: mla)"
    if t.debug_nonfinite:
        return "train.debug_nonfinite", ("re-runs the step in one process, which cannot take a sequence split "
                                         "over the cp group (parallel.cp); set it false")
    if t.device == "ascend":
        return ring_attention_problem(cfg, seq)
    if seq % (2 * p.cp):
        return "parallel.cp", (f"needs data.seq_len divisible by 2 x cp = {2 * p.cp} ({seq} % {2 * p.cp} != 0): "
                               f"each rank takes two of 2 x cp equal chunks (zig-zag)")
    if t.device != "cpu":
        return "parallel.cp", f"context parallel runs on CPU and Ascend only (train.device: {t.device})"
    for key, on in (("pp", p.pp > 1), ("tp", p.tp > 1), ("sequence_parallel", p.sequence_parallel)):
        if on:
            return "parallel.cp", (f"does not combine with parallel.{key} on CPU (only with data parallel: "
                                   f"workers = dp x cp)")
    return None


def ring_attention_problem(cfg: Config, seq: int) -> tuple[str, str] | None:
    """Context parallel on Ascend is FlashAttentionScore's ring attention: causal attention on cp
    chunks in natural order, so it needs the flash core, no sliding window and a sequence that cp
    divides. MoE layers' dispatch groups are per replica, not per chunk (not built)."""
    p, m = cfg.parallel, cfg.model
    if seq % p.cp:
        return "parallel.cp", f"must divide data.seq_len ({seq} % {p.cp} != 0): each rank takes one chunk"
    if cfg.train.attention == "softmax":
        return "train.attention", ("softmax cannot take context parallel on Ascend (parallel.cp): it is "
                                   "FlashAttentionScore's ring attention; set flash or auto")
    if packed_samples(cfg):
        key = "data.document_attention" if cfg.data.document_attention else "data.path"
        return "parallel.cp", f"ring attention is causal over whole chunks; packed samples ({key}) are not built with it"
    problem = ascend_flash_problem(cfg, False)
    if problem is not None:
        return problem[0], f"{problem[1]}, and parallel.cp needs it (ring attention)"
    if "sliding" in m.layer_kinds():
        return "parallel.cp", (f"ring attention is causal over whole chunks; this model's sliding-window layers "
                               f"(model.sliding_window {m.sliding_window}) are not built with it on Ascend")
    if "moe" in m.mlp_kinds():
        return "parallel.cp", "context parallel with MoE layers is not built on Ascend (dispatch groups per replica)"
    return None


def data_replicas(cfg: Config, world: int, source: str = "config") -> int:
    """Data-parallel replicas among `world` workers: world / parallel.cp (a cp group reads one replica's
    samples). ConfigError (one line) when cp does not divide the workers or parallel.dp is neither 1
    nor the replica count."""
    p = cfg.parallel
    if world % p.cp:
        raise ConfigError(source, "parallel.cp", f"is {p.cp} but {world} worker{'s' if world > 1 else ''} "
                          f"{'were' if world > 1 else 'was'} launched; cp must divide the worker count "
                          f"(workers = dp x cp: msllm launch --nproc N -- train ...)")
    replicas = world // p.cp
    if p.dp not in (1, replicas):
        split = f" / parallel.cp {p.cp} = {replicas} replicas" if p.cp > 1 else ""
        raise ConfigError(source, "parallel.dp", f"is {p.dp} but this launch starts {world} workers{split}; "
                          f"set it to {replicas} or leave it at 1 (data parallel over all replicas)")
    return replicas


def check_parallel(cfg: Config, devices: int | None = None, source: str = "<config>",
                   global_batch: int | None = None, seq_len: int | None = None) -> None:
    """Raise ConfigError (one line, exit 2 from the CLI) for the first problem of cfg.parallel."""
    problem = layout_problem(cfg, devices, global_batch, seq_len)
    if problem is not None:
        raise ConfigError(source, *problem)


def check_execution(cfg: Config, source: str = "<config>") -> None:
    """The Ascend execution profile's constraints (msllm.backends.ascend.ExecutionProfile): jit_level
    O2 sinks the whole graph (static shapes only), data sink returns to the host every sink_size steps."""
    t, p = cfg.train, cfg.parallel
    if t.jit_level == "O2" and t.device != "ascend":
        raise ConfigError(source, "train.jit_level", "O2 (whole-graph sink) exists on Ascend only; use O0 or O1")
    if t.jit_level == "O2" and t.sample_tokens > 0:
        raise ConfigError(source, "train.sample_tokens", "the end-of-run sample compiles prefill and decode with "
                          "dynamic shapes, which jit_level O2 does not take; set 0 (sample with msllm generate)")
    if p.sink_size > 0:
        if t.device != "ascend":
            raise ConfigError(source, "parallel.sink_size", "data sink needs Ascend; set 0")
        for key in ("log_every", "eval_every", "ckpt_every"):
            if getattr(t, key) % p.sink_size:
                raise ConfigError(source, f"train.{key}", f"must be a multiple of parallel.sink_size "
                                  f"({p.sink_size}): the host sees the step only every sink_size steps")
