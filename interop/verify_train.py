"""Does msllm's compiled train step compute what Hugging Face + torch compute? `msllm verify --train`.

Both sides start from the same weights (the HF checkpoint, msllm's converted in memory through the
family table; or --ckpt, an msllm / MindFormers checkpoint of the same model, e.g. a trained run, whose
weights torch is given) and train in fp32 on the same token batches (random, or --data) with the same AdamW,
LR schedule (msllm's lr_at, set per step on torch) and global-norm clip:

  msllm   the GRAPH train step from build_train_step (fused CPU kernels and all); the gradient
          its optimizer applies is recorded on the way in (RecordGradients, the wrap_optimizer hook)
  torch   transformers' model, loss.backward(), clip_grad_norm_, torch.optim.AdamW

They run in lockstep: before each step the torch side is given msllm's weights and AdamW moments,
and torch's AdamW is applied to the gradient msllm applied. So every comparison is between two
evaluations of one step from identical inputs, and the first one that exceeds its gate names the
piece that is wrong:

  forward    each layer's output and the logits (msllm's model run eagerly, hooks on the layers),
             then the loss of the compiled step
  backward   each parameter's gradient before clipping, from the loss towards the embeddings (the
             first that differs is the closest to the fault), then the global norm and the clip
             coefficient (clipping scales all gradients by one factor, so it is checked once)
  optimizer  the learning rate, then each parameter's updated weight

Gates, on max_rel = max|msllm - torch| / max|torch| per tensor (as interop/verify.py). Both sides
compute the same fp32 maths in another order (MindSpore vs oneDNN / MKL kernels, and on another CPU
another blocking: AVX-512 and AVX2 differ). A K-term fp32 sum reordered differs by at most
2 K u sum|terms| (u = 2^-24, Higham 4.2), whatever the order, so the gates are bounds on reordering,
not one machine's measurement:

  TENSOR_GATE 1e-4  layer outputs, gradients, weights. The longest sums of a step (vocab softmax,
                    hidden / ffn dot products, weight gradients over batch x seq tokens) hold
                    K <= 840 terms for 2K u <= 1e-4 worst case; the tests' models have K <= 300
                    (3.6e-5). Larger models' sums are longer, but their rounding errors add up as a
                    random walk (~sqrt(K) u: 2e-5 at K = 128K), far inside the gate.
                    Weights: one AdamW update from the same weights, moments and gradient is a
                    dozen fp32 operations per element, <= 8 u (|w| + lr) apart (tests/numerics.py):
                    ~1e-6 of the tensor's scale.
  SCALAR_GATE 1e-5  loss, gradient norm, clip coefficient, LR. The loss is a mean of log-sum-exp
                    minus the label's logit: it moves by <= 2 max|d logits| plus the log-sum-exp's
                    own rounding (<= K u, K = vocab, 1.8e-5 absolute at 300). A logit is a dot
                    product over hidden (64 in the tests: 2 * 64 u sum|h w| ~ 1e-5 absolute for
                    a normed h and 0.02-scale weights), so for an untrained model (loss ~ ln vocab
                    = 5.7) the loss agrees to ~1e-5 relative worst case, ~sqrt(K) u typically
                    (measured 2.5e-7). A trained checkpoint with a loss of ~2 and logits of ~20
                    has less margin: pass --tolerance. The norm is a square root of a sum of
                    squares (positive terms): <= K u / 2 relative. The LR is a few fp32 operations
                    against Python's double: ~u; the clip coefficient clip / (norm + 1e-6) is as
                    close as the norm.

The verification optimizer (VERIFY_OPTIM) is chosen so a wrong piece is visible: lr 1e-2 with weight
decay 0.1 moves weights by lr * wd = 1e-3 of their scale per step, 10x the gate; warmup 1 and
cosine decay over the N steps exercise the schedule; clip 1.0 is below the random models' norms
(~3), so clipping is on.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import mindspore as ms
import numpy as np
import torch
from mindspore import Parameter, Tensor, nn, ops

from interop import InteropError
from interop.convert import parameter_names, plan
from interop.layouts import open_source
from interop.maps import moe
from interop.table import Entry, msllm_arrays, stored_arrays
from interop.verify import hf_states, max_rel, msllm_model, msllm_states, open_hf, same_model
from msllm.config import Config, OptimConfig, TrainConfig

TENSOR_GATE, SCALAR_GATE = 1e-4, 1e-5
VERIFY_OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, decay="cosine", weight_decay=0.1, grad_clip=1.0)


_hyper_map, _assign = ops.HyperMap(), ops.Assign()


class RecordGradients(nn.Cell):
    """Wraps an AdamW for TrainStep (build_train_step's wrap_optimizer) and keeps what the optimizer is
    given: the summed gradients (`raw`, loss-scaled) and grad_coef (unscale, micro-batch mean and clip
    in one factor). The optimizer itself is called with (grads, grad_coef) unchanged."""

    def __init__(self, optimizer):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.params = optimizer.params
        self.fused = optimizer.fused
        self.raw = self.params.clone(prefix="seen", init="zeros")
        self.coef = Parameter(Tensor(np.ones((), np.float32)), name="seen.coef")

    def construct(self, grads, grad_coef=None):
        _hyper_map(_assign, self.raw, grads)
        if grad_coef is not None:
            _assign(self.coef, grad_coef)
        return self.optimizer(grads, grad_coef)

    def coefficient(self) -> float:
        return float(self.coef.asnumpy())

    def raw_gradients(self) -> dict:
        return {p.name: g.asnumpy().copy() for p, g in zip(self.params, self.raw)}

    def gradients(self) -> dict:
        """The gradients applied: grad_coef * grads, the same fp32 product the optimizer forms."""
        coef = self.coef.asnumpy()
        return {name: g * coef for name, g in self.raw_gradients().items()}


@dataclasses.dataclass
class Check:
    step: int
    kind: str        # "layer" | "loss" | "grad" | "grad_norm" | "clip" | "lr" | "weight"
    name: str        # "layer 1", "logits", "loss", a parameter's msllm name
    ours: float | None
    theirs: float | None
    rel: float
    gate: float

    @property
    def ok(self) -> bool:
        return self.rel <= self.gate  # False for NaN too


@dataclasses.dataclass
class TrainReport:
    checks: list[Check]          # per step, in the order a failure is named (see the docstring)
    steps: int
    tokens: tuple[int, int]
    source: str
    tensor_gate: float = TENSOR_GATE
    scalar_gate: float = SCALAR_GATE

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def worst(self, kind: str) -> float:
        return max((c.rel for c in self.checks if c.kind == kind), default=0.0)

    def lines(self) -> list[str]:
        by = {(c.step, c.kind, c.name): c for c in self.checks}
        steps = range(1, self.steps + 1)
        out = [f"{'step':>4} {'loss msllm':>12} {'loss torch':>12} {'max_rel':>8}  {'gnorm msllm':>11} "
               f"{'gnorm torch':>11} {'max_rel':>8}  {'lr':>8}  {'layers':>8} {'grads':>8} {'weights':>8}"]
        for s in steps:
            loss, norm, lr = by[(s, "loss", "loss")], by[(s, "grad_norm", "grad_norm")], by[(s, "lr", "lr")]
            worst = {k: max((c.rel for c in self.checks if c.step == s and c.kind == k), default=0.0)
                     for k in ("layer", "grad", "weight")}
            out.append(f"{s:>4} {loss.ours:12.6f} {loss.theirs:12.6f} {loss.rel:8.1e}  {norm.ours:11.6f} "
                       f"{norm.theirs:11.6f} {norm.rel:8.1e}  {lr.ours:8.2e}  {worst['layer']:8.1e} "
                       f"{worst['grad']:8.1e} {worst['weight']:8.1e}")
        names = [c.name for c in self.checks if c.step == 1 and c.kind == "weight"]
        span = f"steps 1..{self.steps}"
        out.append(f"{'max_rel per parameter':40} {'gradient, ' + span:>24}  weight, {span}")
        for n in names:
            g = " ".join(f"{by[(s, 'grad', n)].rel:7.1e}" if (s, "grad", n) in by else f"{'-':>7}" for s in steps)
            w = " ".join(f"{by[(s, 'weight', n)].rel:7.1e}" if (s, "weight", n) in by else f"{'-':>7}" for s in steps)
            out.append(f"{n:40} {g:>24}  {w}")
        bad = self.first_failure
        verdict = "PASS" if bad is None else (
            f"FAIL: step {bad.step}: {_what(bad)} (max_rel {bad.rel:.3e} > {bad.gate:.0e})")
        out.append(f"{verdict}  [{self.steps} steps of {self.tokens[0]}x{self.tokens[1]} tokens, fp32; gates max_rel "
                   f"<= {self.scalar_gate:.0e} loss / grad norm / clip / lr, <= {self.tensor_gate:.0e} layers / "
                   f"gradients / weights]")
        return out


def _what(c: Check) -> str:
    return {"layer": f"forward diverges at {c.name}", "loss": "the loss differs (the layer outputs of the eager "
            "model agree: the compiled step computes something else)", "grad_norm": "the gradient norm differs",
            "grad": f"gradient of {c.name} (the first in backward order)",
            "clip": "the clipping coefficient differs", "lr": "the learning rate differs",
            "weight": f"updated weight {c.name} (the optimizer)"}[c.kind]


def to_msllm(rows: list[Entry], hf_tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF-named tensors -> msllm-named arrays, through the family table."""
    return {name: t.numpy() for name, t in msllm_arrays(rows, "hf", hf_tensors.__getitem__).items()}


def to_hf(rows: list[Entry], arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return stored_arrays(rows, "hf", lambda name: torch.from_numpy(arrays[name]))


def rel(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / max(abs(theirs), 1e-30)


def tensor_checks(step: int, kind: str, names: list[str], ours: dict, theirs: dict, gate: float) -> list[Check]:
    return [Check(step, kind, n, None, None, max_rel(ours[n], theirs[n])[1], gate) for n in names]


class TorchSide:
    """The Hugging Face model with torch's AdamW (decay on matrices, as msllm and nanoGPT) and clipping."""

    def __init__(self, hf_dir: Path, rows: list[Entry], optim: OptimConfig):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
        self.rows, self.optim, self.arch = rows, optim, type(self.model).__name__
        self.params = dict(self.model.named_parameters())  # tied embeddings appear once
        # Saved buffers msllm holds as parameters that never train (DeepSeek-V3's expert bias): no gradient
        saved = self.model.state_dict()
        self.buffers = {n: b for n, b in self.model.named_buffers() if n in saved}
        matrices = [p for p in self.params.values() if p.dim() >= 2]
        others = [p for p in self.params.values() if p.dim() < 2]
        self.adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": optim.weight_decay},
                                        {"params": others, "weight_decay": 0.0}],
                                       lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)

    def load(self, weights: dict, exp_avg: dict, exp_avg_sq: dict, step: int) -> None:
        """Take msllm's weights and AdamW state after `step` steps (msllm names)."""
        with torch.no_grad():
            for name, t in self.in_memory(weights).items():
                self.params[name].copy_(t)
            second = self.in_memory(exp_avg_sq)
            for name, first in self.in_memory(exp_avg).items():
                self.adamw.state[self.params[name]] = {"step": torch.tensor(float(step)), "exp_avg": first.clone(),
                                                       "exp_avg_sq": second[name].clone()}

    def forward_backward(self, tokens: np.ndarray):
        """(layer outputs + logits, loss, gradients by msllm name, norm, clip coefficient)."""
        self.adamw.zero_grad()
        states = []
        out = hf_states(self.model, tokens[:, :-1], states)
        logits, labels = out.logits, torch.from_numpy(tokens[:, 1:]).long()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if getattr(out, "aux_loss", None) is not None:  # a MoE model with output_router_logits on
            loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        grads = self.msllm_named({**{n: p.grad.clone() for n, p in self.params.items()},
                                  **{n: torch.zeros_like(b) for n, b in self.buffers.items()}})
        clip = self.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params.values(), clip if clip > 0 else float("inf")).item()
        coef = min(clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0  # what clip_grad_norm_ multiplied by
        return states + [logits.detach().numpy()], loss.item(), grads, norm, coef

    def update(self, grads: dict, lr: float) -> dict:
        """torch AdamW applied to `grads` (msllm names, already clipped) at `lr`; the new weights."""
        with torch.no_grad():
            for name, g in self.in_memory(grads).items():
                self.params[name].grad = g.clone()
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        return self.msllm_named({**{n: p.detach() for n, p in self.params.items()}, **self.buffers})

    def in_memory(self, arrays: dict) -> dict:
        """msllm-named arrays -> tensors by the in-memory parameter names of the HF model."""
        return moe.from_saved(self.arch, to_hf(self.rows, arrays), list(self.params))

    def msllm_named(self, tensors: dict) -> dict:
        return to_msllm(self.rows, moe.to_saved(self.arch, tensors))


def verify_train(hf_dir: str | Path, ckpt: str | Path | None = None, steps: int = 3, seq_len: int = 32,
                 batch: int = 2, seed: int = 0, tolerance: float | None = None, data: str | Path | None = None,
                 optim: OptimConfig = VERIFY_OPTIM) -> TrainReport:
    from msllm import device
    from msllm.train.build import build_train_step
    from msllm.train.optim import lr_at

    tensor_gate = TENSOR_GATE if tolerance is None else tolerance
    scalar_gate = SCALAR_GATE if tolerance is None else tolerance / 10
    hf = open_hf(hf_dir)
    rows = plan(hf)  # also checks the HF dir holds exactly the table's tensors
    source = hf
    if ckpt is not None:
        source = open_source(ckpt)
        same_model(hf, source)
        hf.reader.close()
    m = hf.config.model
    seq = min(seq_len, m.max_seq_len - 1, source.config.model.max_seq_len - 1)
    batches = token_batches(data, m.vocab_size, batch, seq, steps, seed)
    device.setup("cpu", "graph")
    model = load_msllm(source)
    cfg = Config(model=source.config.model, optim=optim,
                 train=TrainConfig(steps=steps, batch_size=batch, seed=seed, device="cpu", mode="graph"))
    built = build_train_step(cfg, model, wrap_optimizer=RecordGradients)
    recorder, adamw = built.train_step.optimizer, built.optimizer
    theirs = TorchSide(Path(hf_dir), rows, optim)
    names = parameter_names(rows)
    backward_order = names[::-1]  # from the loss towards the embeddings
    checks = []
    for step, tokens in enumerate(batches, 1):
        # Lockstep: the torch side starts each step from msllm's weights and moments; at step 1 too
        # when they come from --ckpt (without it, both loaded the HF dir: the in-memory conversion
        # is checked by step 1's forward).
        if step > 1 or ckpt is not None:
            theirs.load(_arrays(adamw.params), _arrays(adamw.exp_avg, adamw.params),
                        _arrays(adamw.exp_avg_sq, adamw.params), step - 1)
        ms.set_context(mode=ms.PYNATIVE_MODE)  # the layer outputs: the same model, eagerly, with hooks
        our_states = msllm_states(model, tokens[:, :-1])
        ms.set_context(mode=ms.GRAPH_MODE)
        loss, norm, lr, finite = (float(x.asnumpy()) for x in built.train_step(ms.Tensor(tokens))[:4])
        their_states, their_loss, their_grads, their_norm, their_coef = theirs.forward_backward(tokens)
        layer_names = [f"layer {k}" for k in range(m.num_layers)] + ["logits"]
        checks += [Check(step, "layer", n, None, None, max_rel(a, b)[1], tensor_gate)
                   for n, a, b in zip(layer_names, our_states, their_states)]
        checks.append(Check(step, "loss", "loss", loss, their_loss, rel(loss, their_loss), scalar_gate))
        # Before clipping: clipping scales every gradient by one factor, which would blur where a fault is.
        ours = recorder.raw_gradients() if finite else {n: np.full_like(g, np.nan) for n, g in their_grads.items()}
        checks += tensor_checks(step, "grad", backward_order, ours, their_grads, tensor_gate)
        checks.append(Check(step, "grad_norm", "grad_norm", norm, their_norm, rel(norm, their_norm), scalar_gate))
        coef = recorder.coefficient() if finite else float("nan")
        checks.append(Check(step, "clip", "clip", coef, their_coef, rel(coef, their_coef), scalar_gate))
        our_grads = recorder.gradients() if finite else ours
        want_lr = lr_at(step, optim, steps)
        checks.append(Check(step, "lr", "lr", lr, want_lr, rel(lr, want_lr), scalar_gate))
        their_weights = theirs.update(our_grads, want_lr)
        checks += tensor_checks(step, "weight", names, _arrays(adamw.params), their_weights, tensor_gate)
    where = f"{ckpt}" if ckpt is not None else "msllm (converted in memory)"
    return TrainReport(checks, steps, (batch, seq), where, tensor_gate, scalar_gate)


def token_batches(data: str | Path | None, vocab: int, batch: int, seq: int, steps: int, seed: int) -> list:
    """`steps` batches [batch, seq + 1] of int32 tokens: random (seeded), or consecutive windows from the
    start of a pretokenized shard dir's train split (what msllm train writes to RUN_DIR/data)."""
    if data is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32) for _ in range(steps)]
    from msllm.data import shards

    folder = Path(data)
    index = shards.read_index(folder)
    if index.get("vocab_size", 0) > vocab:
        raise InteropError(f"{folder / shards.INDEX}: vocab_size {index['vocab_size']} > the model's {vocab}")
    tokens = shards.open_tokens(folder, "train")
    need = steps * batch * seq + 1
    if len(tokens) < need:
        raise InteropError(f"{folder}: {len(tokens)} train tokens, --train needs {need} "
                           f"(--steps x --batch x --seq-len + 1)")
    starts = np.arange(steps * batch) * seq
    windows = np.stack([tokens[k:k + seq + 1] for k in starts]).astype(np.int32)
    return list(windows.reshape(steps, batch, seq + 1))


def load_msllm(source):
    """The msllm model under test (a seam: tests wrap it to inject a fault on the msllm side)."""
    model = msllm_model(source)
    model.set_train(True)
    return model


def _arrays(params, names_from=None) -> dict[str, np.ndarray]:
    """name -> copy of the values; moments are keyed by the name of the weight they belong to."""
    keys = [p.name for p in (names_from if names_from is not None else params)]
    return {k: p.asnumpy().copy() for k, p in zip(keys, params)}
