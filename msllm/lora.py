"""LoRA: low-rank adapters on a built model's projections, applied at the specialisation seam.

    y = W x (+ b) + (alpha / rank) * B (A x)        A [rank, in], B [out, rank]

as PEFT computes it (A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0, so training starts at the base model).
The base Linear keeps its Parameters and their names; every base weight is frozen (no gradient,
no optimizer state) and the adapters are named `<module>.lora_a` / `<module>.lora_b`, e.g.
`layers.0.attention.wq.lora_a`. A run's checkpoints hold the adapters only.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from msllm.config import LoraConfig
from msllm.models.llama import Linear, Llama, cast

# lora.targets name -> the Linear it adapts inside each block
TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}


class LoRALinear(nn.Cell):
    """base(x) + scale * (dropout(x) @ A^T) @ B^T."""

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float, rng: np.random.Generator):
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

    def construct(self, x):
        y = self.base(x)
        h = x.reshape(-1, self.in_features)
        if self.dropout > 0 and self.training:
            h = ops.dropout(h, p=self.dropout)
        low = self.matmul(h, cast(self.lora_a, h.dtype))
        return y + (self.matmul(low, cast(self.lora_b, h.dtype)) * self.scale).reshape(y.shape)


def targets(model: Llama, names: list[str]):
    """(module path, parent Cell, attribute) of each targeted Linear, layer by layer."""
    for i, block in enumerate(model.layers):
        for name in names:
            *parents, attr = TARGETS[name].split(".")
            parent = block
            for p in parents:
                parent = getattr(parent, p)
            yield f"layers.{i}.{TARGETS[name]}", parent, attr


def _replace(parent, attr: str, cell, names: dict) -> None:
    """Set parent.attr = cell, then give every Parameter its full name back (MindSpore re-prefixes
    the Parameters of a Cell assigned after construction)."""
    setattr(parent, attr, cell)
    for p in cell.get_parameters():
        p.name = names[id(p)]


def apply_lora(model: Llama, cfg: LoraConfig, seed: int) -> None:
    """Freeze every weight of `model` and put adapters on the configured projections (in place)."""
    if any(isinstance(c, LoRALinear) for _, c in model.cells_and_names()):
        return  # already adapted (the seam runs again when a trained model is specialised for inference)
    for p in model.get_parameters():
        p.requires_grad = False
    rng = np.random.default_rng([seed, 0x10A])
    for path, parent, attr in targets(model, cfg.targets):
        base = getattr(parent, attr)
        names = {id(p): p.name for p in base.get_parameters()}
        cell = LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout, rng)
        names.update({id(cell.lora_a): f"{path}.lora_a", id(cell.lora_b): f"{path}.lora_b"})
        _replace(parent, attr, cell, names)


def adapter_params(model: Llama) -> list:
    return [p for p in model.get_parameters() if p.name.endswith((".lora_a", ".lora_b"))]


def merge_lora(model: Llama) -> None:
    """W += scale * B A in every adapted Linear, then drop the adapters: a plain model again."""
    for path, cell in list(model.cells_and_names()):
        if not isinstance(cell, LoRALinear):
            continue
        a, b, w = cell.lora_a.asnumpy(), cell.lora_b.asnumpy(), cell.base.weight.asnumpy()
        cell.base.weight.set_data(Tensor((w + cell.scale * (b @ a)).astype(np.float32)))
        *parents, attr = path.split(".")
        parent = model
        for p in parents:
            parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
        names = {id(p): p.name for p in cell.base.get_parameters()}
        _replace(parent, attr, cell.base, names)
    for p in model.get_parameters():
        p.requires_grad = True
