"""What a row of a family table (interop/maps/) means, and its expansion for one model.

A table lists every msllm tensor once: its name, its shape in named dims, and how each foreign
layout (Hugging Face, MindFormers) stores it:

    "name"                        the same tensor under another name
    Concat(dim, "a", "b", ...)    stored as parts joined along `dim`; the msllm shape spells that
                                  dim as one term per part ("q+kv+kv"), which gives the split back;
                                  a part may itself be a rule (Stacked: a part stored per expert)
    Transposed("name")            stored as the 2-D transpose
    Stacked("name.{e}.w")         stored one tensor per expert e; msllm stacks them on a new dim 0
    Interleaved("name", "groups") stored as the parts of an msllm Concat interleaved in blocks: dim 0 cut
                                  into `groups` (a named dim) blocks, block g holding each part's g-th
                                  slice in turn (MindFormers' mcore linear_qkv: [q, k, v] per KV head)
    GroupedTransposed("name")     stored as one matrix: each expert's 2-D transpose, one expert after
                                  another along dim 0 ([E * in, out]: MindFormers' grouped-GEMM weight1 / weight2)
    ExpertsTransposed("name")     an expert stack [E, out, in] stored as each expert's transpose [E, in, out]
    Alternated("name")            an msllm Concat(1, gate, up) of experts stored with gate's and up's
                                  features alternating along the last dim, each expert's matrix transposed
                                  ([E, in, 2f]; biases [E, 2f]): gpt-oss's gate_up_proj
    None                          this layout has no such tensor (the family is not in that layout)

The msllm column may be a Concat too: Phi-3 stores q, k and v as one qkv_proj, so its row is
one joined tensor whose msllm parts are the separate wq / wk / wv every family shares.

Per-layer names are relative to the table's `layer_prefix` for that layout, where `{i}` is the
layer index. `when` names a condition on the model config (CONDITIONS).
msllm is the hub: converting A -> B is A -> msllm tensor -> B, one msllm tensor at a time.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from interop import InteropError
from msllm.config import ModelConfig

LAYOUTS = ("msllm", "hf", "mindformers")
# A condition on the model config and the layer index (0 outside the layers).
CONDITIONS = {"untied": lambda m, i: not m.tie_embeddings,
              "dense": lambda m, i: m.mlp_kinds()[i] == "dense",
              "moe": lambda m, i: m.mlp_kinds()[i] == "moe",
              "shared": lambda m, i: m.mlp_kinds()[i] == "moe" and m.shared_experts > 0,
              "qkv_bias": lambda m, i: m.qkv_bias,
              "qk_norm": lambda m, i: m.qk_norm,
              "q_lora": lambda m, i: m.q_lora_rank > 0,          # MLA's low-rank query
              "no_q_lora": lambda m, i: m.q_lora_rank == 0,
              "linear": lambda m, i: m.layer_kinds()[i] == "linear",      # a Gated DeltaNet layer
              "attention": lambda m, i: m.layer_kinds()[i] != "linear"}


def named_dims(m: ModelConfig) -> dict[str, int]:
    return {"vocab": m.vocab_size, "hidden": m.hidden_size, "ffn": m.ffn_size, "head": m.head_size,
            "heads": m.num_heads,
            "q": m.num_heads * m.head_size, "kv": m.num_kv_heads * m.head_size, "kv_heads": m.num_kv_heads,
            "experts": m.num_experts, "expert_ffn": m.moe_ffn_size or m.ffn_size,
            "shared_ffn": m.shared_size,
            # MLA (q is heads x (nope + rope) as head_size says)
            "q_rank": m.q_lora_rank, "kv_rank": m.kv_lora_rank, "kv_a": m.kv_lora_rank + m.qk_rope_head_dim,
            "kv_b": m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), "o": m.num_heads * m.value_size,
            "heads": m.num_heads, "one": 1,
            # Gated DeltaNet: q / k and v features, key heads, value heads and their features, the conv's taps
            "lin_k": m.linear_num_key_heads * m.linear_key_head_dim, "lin_k_heads": m.linear_num_key_heads,
            "lin_v": m.linear_num_value_heads * m.linear_value_head_dim, "lin_heads": m.linear_num_value_heads,
            "lin_head_v": m.linear_value_head_dim, "conv_kernel": m.linear_conv_kernel}


class Same:
    def __init__(self, name: str):
        self.name = name

    def expand(self, prefix: str, i: int):
        return type(self)((prefix + self.name).format(i=i))

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return {self.name: entry.shape}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        return read(self.name)

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, t)]


class Concat:
    def __init__(self, dim: int, *parts):
        self.dim, self.parts = dim, tuple(_rule(p) for p in parts)

    def expand(self, prefix: str, i: int):
        return Concat(self.dim, *(p.expand(prefix, i) for p in self.parts))

    def _pieces(self, entry: "Entry") -> list[tuple]:
        """(part's rule, the part as an entry of its own: dim `dim` cut to that part's size)."""
        d = self.dim
        return [(p, entry._replace(shape=entry.shape[:d] + (size,) + entry.shape[d + 1:],
                                   terms=entry.terms[:d] + ((size,),) + entry.terms[d + 1:]))
                for p, size in zip(self.parts, entry.terms[d], strict=True)]

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return {name: shape for p, part in self._pieces(entry) for name, shape in p.shapes(part).items()}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        return torch.cat([p.gather(part, read) for p, part in self._pieces(entry)], self.dim)

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        pieces = torch.split(t, list(entry.terms[self.dim]), self.dim)
        return [out for (p, part), piece in zip(self._pieces(entry), pieces, strict=True)
                for out in p.scatter(part, piece.contiguous())]


class Transposed(Same):
    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return {self.name: entry.shape[::-1]}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        return read(self.name).T.contiguous()

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, t.T.contiguous())]


class Stacked:
    """One stored tensor per expert, named by a pattern with {e}; msllm holds them stacked [E, ...]."""

    def __init__(self, pattern: str):
        self.pattern = pattern

    def expand(self, prefix: str, i: int):
        return Stacked((prefix + self.pattern).replace("{e}", "{{e}}").format(i=i))

    def names(self, entry: "Entry") -> list[str]:
        return [self.pattern.format(e=e) for e in range(entry.shape[0])]

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return dict.fromkeys(self.names(entry), entry.shape[1:])

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        return torch.stack([read(name) for name in self.names(entry)])

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(name, part.contiguous()) for name, part in zip(self.names(entry), t.unbind(0), strict=True)]


class Interleaved(Same):
    """The stored tensor interleaves the msllm Concat's parts along dim 0 in `groups` blocks: block g is
    part 1's g-th slice, then part 2's, ... (groups: a named dim, resolved by `entries`)."""

    def __init__(self, name: str, groups: str | int):
        super().__init__(name)
        self.groups = groups

    def expand(self, prefix: str, i: int):
        return Interleaved((prefix + self.name).format(i=i), self.groups)

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        t = read(self.name)
        blocks = t.reshape(self.groups, -1, *t.shape[1:])
        parts = torch.split(blocks, [n // self.groups for n in entry.terms[0]], 1)
        return torch.cat([p.reshape(-1, *t.shape[1:]) for p in parts], 0)

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = torch.split(t, list(entry.terms[0]), 0)
        blocks = torch.cat([p.reshape(self.groups, -1, *t.shape[1:]) for p in parts], 1)
        return [(self.name, blocks.reshape(t.shape).contiguous())]


class GroupedTransposed(Same):
    """An msllm [E, out, in] expert stack stored as one [E * in, out] matrix: expert e's transpose in rows
    e * in .. (e + 1) * in (MindFormers' FFNGroupedGEMM weight1 / weight2, Megatron's GroupedMLP)."""

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        experts, out, inp = entry.shape
        return {self.name: (experts * inp, out)}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        experts, out, inp = entry.shape
        return read(self.name).reshape(experts, inp, out).transpose(1, 2).contiguous()

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, t.transpose(1, 2).reshape(-1, t.shape[1]).contiguous())]


class ExpertsTransposed(Same):
    """An msllm [E, out, in] expert stack stored as [E, in, out], each expert's matrix transposed (gpt-oss)."""

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        experts, out, inp = entry.shape
        return {self.name: (experts, inp, out)}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        return read(self.name).transpose(1, 2).contiguous()

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, t.transpose(1, 2).contiguous())]


class Alternated(Same):
    """An msllm Concat(1, gate, up) of experts [E, f+f, in] (or of their biases, [E, f+f]) stored with gate's
    and up's features alternating along the last dim (gate 0, up 0, gate 1, ..), each expert's matrix
    transposed: [E, in, 2f] (gpt-oss's gate_up_proj and gate_up_proj_bias)."""

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return {self.name: entry.shape[:1] + entry.shape[2:] + entry.shape[1:2]}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        t = torch.movedim(read(self.name), -1, 1)                      # [E, 2f, (in)]
        pairs = t.reshape(t.shape[0], -1, 2, *t.shape[2:])             # feature j: gate j, up j
        return torch.cat((pairs[:, :, 0], pairs[:, :, 1]), 1).contiguous()

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        gate, up = torch.split(t, list(entry.terms[1]), 1)
        alternated = torch.stack((gate, up), 2).reshape(t.shape)
        return [(self.name, torch.movedim(alternated, 1, -1).contiguous())]


class Copies:
    """One msllm tensor a layout stores more than once (DeepSeek-V3's MTP layer keeps its own copies of the shared
    embedding and head): every copy is written; on read the copies must hold the same values, which the first gives."""

    def __init__(self, *rules):
        self.rules = rules

    def shapes(self, entry: "Entry") -> dict[str, tuple]:
        return {name: shape for rule in self.rules for name, shape in rule.shapes(entry).items()}

    def gather(self, entry: "Entry", read: Callable) -> torch.Tensor:
        first, *others = self.rules
        t = first.gather(entry, read)
        for rule in others:
            if not torch.equal(rule.gather(entry, read), t):
                raise InteropError(f"{next(iter(rule.shapes(entry)))} differs from {next(iter(first.shapes(entry)))}: "
                                   f"msllm holds one {entry.name} for both (the copies must be equal)")
        return t

    def scatter(self, entry: "Entry", t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [out for rule in self.rules for out in rule.scatter(entry, t)]


class Row(NamedTuple):
    msllm: str | Concat
    shape: str                         # named dims, e.g. "vocab, hidden" or "q+kv+kv, hidden"
    hf: str | Concat | Transposed | Stacked
    mindformers: str | Concat | Transposed | Interleaved | GroupedTransposed | None
    when: str | None = None            # a key of CONDITIONS


class Table(NamedTuple):
    before: list[Row]                  # rows before the layers, in file order
    layer_prefix: dict[str, str]       # layout -> what per_layer names sit under, with {i}
    per_layer: list[Row]               # repeated for each layer
    after: list[Row]
    ignore: dict[str, list[str]]       # layout -> fnmatch patterns of stored names msllm does not need
    # Multi-token prediction (ModelConfig.mtp_depths): each depth's own rows under mtp_prefix, then its block's
    # rows (per_layer's, conditions read as for the last layer, which the block is built like) under
    # mtp_layer_prefix; {k} is the depth (0-based) and {n} num_layers + k (HF numbers the MTP layers after the
    # others). mtp_copies: a layout's copies, under mtp_prefix, of msllm tensors outside the depth (the shared
    # embedding and head), written with them and read once (Copies).
    mtp: list[Row] = []
    mtp_copies: list[Row] = []
    mtp_prefix: dict[str, str] = {}
    mtp_layer_prefix: dict[str, str] = {}


class Entry(NamedTuple):
    """One msllm tensor of a concrete model (or several joined, see Row), and the rule by which each
    layout stores it; a layout without it has None."""
    name: str                           # the msllm name; joined parts: their names with "+"
    shape: tuple[int, ...]
    terms: tuple[tuple[int, ...], ...]  # per dim, the sizes of its "+" terms
    stored: dict[str, Same | Concat | Transposed | None]


def entries(table: Table, m: ModelConfig) -> list[Entry]:
    """Every msllm tensor of model `m` in file order, with its rules expanded."""
    if m.mtp_depths and not table.mtp:
        raise InteropError(f"model.mtp_depths {m.mtp_depths}: this family's checkpoints have no multi-token-prediction "
                           f"layers (DeepSeek-V3's have); set it to 0")
    sizes = named_dims(m)
    no_prefix = dict.fromkeys(LAYOUTS, "")
    placed = ([(row, no_prefix, 0) for row in table.before]
              + [(row, table.layer_prefix, i) for i in range(m.num_layers) for row in table.per_layer]
              + [(row, no_prefix, 0) for row in table.after])
    for k in range(m.mtp_depths):
        own, block = (_depth_prefix(prefixes, k, m.num_layers) for prefixes in (table.mtp_prefix, table.mtp_layer_prefix))
        placed += ([(row, own, 0) for row in table.mtp] + [(row, {**own, "msllm": ""}, 0) for row in table.mtp_copies]
                   + [(row, block, m.num_layers - 1) for row in table.per_layer])
    out = []
    for row, prefix, i in placed:
        if row.when and not CONDITIONS[row.when](m, i):
            continue
        terms = tuple(tuple(sizes[t.strip()] for t in dim.split("+")) for dim in row.shape.split(","))
        stored = {layout: _rule(getattr(row, layout)) for layout in LAYOUTS}
        stored = {layout: rule and rule.expand(prefix[layout], i) for layout, rule in stored.items()}
        for layout, rule in stored.items():  # a table bug, caught when the table is first used
            if isinstance(rule, Interleaved):
                rule.groups = sizes[rule.groups]
                if any(n % rule.groups for n in terms[0]):
                    raise ValueError(f"table row {row.msllm}: {layout} interleaves {row.shape!r} in "
                                     f"{rule.groups} blocks, which do not divide its parts")
            if isinstance(rule, Concat) and len(rule.parts) != len(terms[rule.dim]):
                raise ValueError(f"table row {row.msllm}: {layout} joins {len(rule.parts)} parts but "
                                 f"dim {rule.dim} of {row.shape!r} has {len(terms[rule.dim])} terms")
        mine = stored["msllm"]
        name = "+".join(p.name for p in mine.parts) if isinstance(mine, Concat) else mine.name
        same = next((j for j, e in enumerate(out) if e.name == name), None) if row in table.mtp_copies else None
        if same is not None:  # another copy of a tensor already placed (an MTP layer's shared embedding / head)
            first = out[same].stored
            out[same] = out[same]._replace(stored={
                layout: Copies(first[layout], stored[layout]) if layout != "msllm" and first[layout] and stored[layout]
                else first[layout] for layout in LAYOUTS})
            continue
        out.append(Entry(name, tuple(map(sum, terms)), terms, stored))
    return out


def _depth_prefix(prefixes: dict[str, str], k: int, num_layers: int) -> dict[str, str]:
    """An MTP depth's prefix in every layout ({k}: the depth, {n}: its HF layer index)."""
    return {layout: prefixes.get(layout, "").format(k=k, n=num_layers + k) for layout in LAYOUTS}


def holds_mtp(table: Table, m: ModelConfig, layout: str, names) -> bool:
    """A checkpoint in `layout` holding `names` holds model m's MTP depths (their first tensor is there);
    never for a family whose table maps no MTP rows."""
    if not table.mtp:
        return False
    first = table.mtp[0]
    return _rule(getattr(first, layout)).expand(_depth_prefix(table.mtp_prefix, 0, m.num_layers)[layout], 0).name in names


def msllm_arrays(rows: list[Entry], layout: str, read: Callable) -> dict[str, torch.Tensor]:
    """msllm parameter name -> tensor, from tensors stored in `layout` (read by name)."""
    return {name: part for e in rows for name, part in e.stored["msllm"].scatter(e, e.stored[layout].gather(e, read))}


def stored_arrays(rows: list[Entry], layout: str, read: Callable) -> dict[str, torch.Tensor]:
    """Tensors as `layout` names and stores them, from msllm parameters (read by msllm name)."""
    return {name: part for e in rows for name, part in e.stored[layout].scatter(e, e.stored["msllm"].gather(e, read))}


def _rule(spec) -> Same | Concat | Transposed | None:
    return Same(spec) if isinstance(spec, str) else spec
