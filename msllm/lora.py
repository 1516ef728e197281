"""LoRA: low-rank adapters on a built model's projections, applied at the specialisation seam.

    y = W x (+ b) + (alpha / rank) * B (A x)        A [rank, in], B [out, rank]

as PEFT computes it (A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0, so training starts at the base model).
The base Linear keeps its Parameters and their names; every base weight is frozen (no gradient,
no optimizer state) and the adapters are named `<module>.lora_a` / `<module>.lora_b`, e.g.
`layers.0.attention.wq.lora_a`. A run's checkpoints hold the adapters only.

A MoE layer's stacked experts take one adapter per expert and projection (targets experts_gate,
experts_up, experts_down): A [E, rank, in], B [E, out, rank], named after the stacked weight
(`layers.1.feed_forward.experts.w1.lora_a`). They adapt the weights, W_e + scale B_e A_e, which
is the same maths as adding scale B_e A_e x to each expert's output.

A hybrid's Gated DeltaNet layers take their own targets (LINEAR_TARGETS: linear_qkv, linear_z,
linear_b, linear_a, linear_out); q, k, v and o adapt its attention layers only.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from msllm.config import LoraConfig
from msllm.models.decoder import Decoder
from msllm.models.layers import Linear, cast
from msllm.models.moe import Experts

# lora.targets name -> the Linear it adapts inside each block (a dense MLP's; attention's)
TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
# lora.targets name -> the Linears it adapts inside a Gated DeltaNet block (a "linear" layer), whose
# attention.* are its own: Hugging Face's in_proj_qkv feeds the conv as msllm's wq, wk and wv (one adapter
# each), in_proj_z is wz, in_proj_b wb, in_proj_a wa, out_proj wo. q, k, v and o adapt no linear layer.
LINEAR_TARGETS = {"linear_qkv": ("attention.wq", "attention.wk", "attention.wv"), "linear_z": ("attention.wz",),
                  "linear_b": ("attention.wb",), "linear_a": ("attention.wa",), "linear_out": ("attention.wo",)}
ATTENTION_TARGETS = ("q", "k", "v", "o")
# lora.targets name -> the stacked weight it adapts in a MoE layer's experts
EXPERT_TARGETS = {"experts_gate": "w1", "experts_up": "w3", "experts_down": "w2"}


SWITCH = "lora.on"  # the name of the adapters' shared on/off Parameter


class AdapterSwitch:
    """One frozen scalar Parameter every adapter of a model multiplies its output by: 1 (on) as trained
    and exported; a step sets it to 0 to run the base model on the same weights (DPO's reference,
    msllm.train.dpo). Not a trainable Parameter, so checkpoints and exports never hold it."""

    def __init__(self):
        self.on = Parameter(Tensor(np.ones((), np.float32)), name=SWITCH, requires_grad=False)


def switch_of(model: Decoder) -> AdapterSwitch | None:
    """The adapters' switch of a LoRA model, or None without adapters."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, (LoRALinear, LoRAExperts)):
            return cell.switch
    return None


class LoRALinear(nn.Cell):
    """base(x) + on * scale * (dropout(x) @ A^T) @ B^T (on: the model's AdapterSwitch, 1 but in a
    reference pass)."""

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float, rng: np.random.Generator,
                 switch: AdapterSwitch):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        bound = 1.0 / np.sqrt(base.in_features)
        self.lora_a = Parameter(Tensor(rng.uniform(-bound, bound, (rank, base.in_features)).astype(np.float32)),
                                name="lora_a")
        self.lora_b = Parameter(Tensor(np.zeros((base.out_features, rank), np.float32)), name="lora_b")
        self.scale = alpha / rank
        self.dropout = dropout
        self.matmul = ops.MatMul(transpose_b=True)
        self.switch, self.on = switch, switch.on

    def construct(self, x):
        y = self.base(x)
        h = x.reshape(-1, self.in_features)
        if self.dropout > 0 and self.training:
            h = ops.dropout(h, p=self.dropout)
        # scaled at rank width ([N, r], not [N, out]): one small multiply forward and backward
        low = self.matmul(h, cast(self.lora_a, h.dtype)) * cast(self.scale * self.on, h.dtype)
        return y + self.matmul(low, cast(self.lora_b, h.dtype)).reshape(y.shape)


class LoRAExperts(nn.Cell):
    """Stacked experts (msllm.models.moe.Experts) computing with W + scale * B A for the adapted
    projections `which` (of w1 / w2 / w3), one adapter per expert."""

    PROJECTIONS = ("w1", "w2", "w3")

    def __init__(self, base: Experts, which: list[str], rank: int, alpha: float, rng: np.random.Generator,
                 switch: AdapterSwitch):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.switch, self.on = switch, switch.on
        # for w1, w2, w3: the index of its adapter, or -1 when it keeps its weight
        self.slots = tuple(which.index(w) if w in which else -1 for w in self.PROJECTIONS)
        self.matmul = ops.BatchMatMul()
        a, b = [], []
        for w in which:
            e, out, inp = getattr(base, w).shape
            bound = 1.0 / np.sqrt(inp)
            a.append(Parameter(Tensor(rng.uniform(-bound, bound, (e, rank, inp)).astype(np.float32)), name=f"{w}.lora_a"))
            b.append(Parameter(Tensor(np.zeros((e, out, rank), np.float32)), name=f"{w}.lora_b"))
        self.lora_a, self.lora_b = ParameterTuple(a), ParameterTuple(b)

    def construct(self, xs, ids=None):
        weights = (self.base.w1, self.base.w2, self.base.w3)
        adapted = ()
        for j in range(3):
            i = self.slots[j]
            if i < 0:
                adapted += (weights[j],)
            else:
                adapted += (weights[j] + self.matmul(self.lora_b[i], self.lora_a[i]) * (self.scale * self.on),)
        return self.base.compute(xs, adapted[0], adapted[1], adapted[2], ids)

    def merged(self, name: str) -> np.ndarray:
        """The projection's weight with its adapter folded in (numpy)."""
        i = self.slots[self.PROJECTIONS.index(name)]
        w = getattr(self.base, name).asnumpy()
        if i < 0:
            return w
        return w + self.scale * np.matmul(self.lora_b[i].asnumpy(), self.lora_a[i].asnumpy())


def block_targets(linear: bool) -> dict[str, tuple[str, ...]]:
    """lora.targets name -> the Linears it adapts in a block (linear: a Gated DeltaNet block)."""
    plain = {t: (module,) for t, module in TARGETS.items() if not (linear and t in ATTENTION_TARGETS)}
    return {**plain, **LINEAR_TARGETS} if linear else plain


def target_of(module: str, linear: bool) -> str | None:
    """The lora.targets name that adapts `module` (attention.wq) of a block, or None."""
    return next((t for t, modules in block_targets(linear).items() if module in modules), None)


def targets(model: Decoder, names: list[str]):
    """(module path, parent Cell, attribute) of each targeted Linear, layer by layer: a dense MLP's
    targets skip MoE layers (whose experts take experts_* targets), attention's skip linear layers."""
    for i, (block, kind) in enumerate(zip(model.layers, model.cfg.layer_kinds())):
        adapted = block_targets(kind == "linear")
        for name in names:
            for module in adapted.get(name, ()):
                *parents, attr = module.split(".")
                parent = block
                for p in parents:
                    parent = getattr(parent, p, None)
                if parent is not None and hasattr(parent, attr):
                    yield f"layers.{i}.{module}", parent, attr


def _replace(parent, attr: str, cell, names: dict) -> None:
    """Set parent.attr = cell, then give every Parameter its full name back (MindSpore re-prefixes
    the Parameters of a Cell assigned after construction)."""
    setattr(parent, attr, cell)
    for p in cell.get_parameters():
        p.name = names[id(p)]


def apply_lora(model: Decoder, cfg: LoraConfig, seed: int) -> None:
    """Freeze every weight of `model` and put adapters on the configured projections (in place)."""
    if any(isinstance(c, (LoRALinear, LoRAExperts)) for _, c in model.cells_and_names()):
        return  # already adapted (the seam runs again when a trained model is specialised for inference)
    for p in model.get_parameters():
        p.requires_grad = False
    rng = np.random.default_rng([seed, 0x10A])
    switch = AdapterSwitch()
    for path, parent, attr in targets(model, cfg.targets):
        base = getattr(parent, attr)
        names = {id(p): p.name for p in base.get_parameters()}
        cell = LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout, rng, switch)
        names.update({id(cell.lora_a): f"{path}.lora_a", id(cell.lora_b): f"{path}.lora_b", id(switch.on): SWITCH})
        _replace(parent, attr, cell, names)
    which = [EXPERT_TARGETS[t] for t in cfg.targets if t in EXPERT_TARGETS]
    for i, block in enumerate(model.layers):
        if which and block.routed:
            base, path = block.feed_forward.experts, f"layers.{i}.feed_forward.experts"
            names = {id(p): p.name for p in base.get_parameters()}
            cell = LoRAExperts(base, which, cfg.rank, cfg.alpha, rng, switch)
            names.update({id(p): f"{path}.{p.name}" for p in (*cell.lora_a, *cell.lora_b)})
            names[id(switch.on)] = SWITCH
            _replace(block.feed_forward, "experts", cell, names)


def adapter_params(model: Decoder) -> list:
    return [p for p in model.get_parameters() if p.name.endswith((".lora_a", ".lora_b"))]


def merged_weights(model: Decoder) -> dict:
    """Each adapted weight's name -> W + scale * B A (fp32 numpy), the model left as it is: what the
    merged model computes with (GRPO's generator takes them, a plain model for decoding)."""
    out = {}
    for _, cell in model.cells_and_names():
        if isinstance(cell, LoRAExperts):
            out.update({getattr(cell.base, w).name: cell.merged(w).astype(np.float32) for w in cell.PROJECTIONS})
        elif isinstance(cell, LoRALinear):
            a, b, w = cell.lora_a.asnumpy(), cell.lora_b.asnumpy(), cell.base.weight.asnumpy()
            out[cell.base.weight.name] = (w + cell.scale * (b @ a)).astype(np.float32)
    return out


def merge_lora(model: Decoder) -> None:
    """W += scale * B A in every adapted Linear, then drop the adapters: a plain model again."""
    merged = merged_weights(model)
    for path, cell in list(model.cells_and_names()):
        if isinstance(cell, LoRAExperts):
            for w in cell.PROJECTIONS:
                getattr(cell.base, w).set_data(Tensor(merged[getattr(cell.base, w).name]))
        elif isinstance(cell, LoRALinear):
            cell.base.weight.set_data(Tensor(merged[cell.base.weight.name]))
        else:
            continue
        *parents, attr = path.split(".")
        parent = model
        for p in parents:
            parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
        names = {id(p): p.name for p in cell.base.get_parameters()}
        _replace(parent, attr, cell.base, names)
    for p in model.get_parameters():
        p.requires_grad = True
