"""Tolerances for comparing training numerics, derived from what is compared (not from one
machine's numbers), and a recorder of the gradient the optimizer applies.

Two fp32 evaluations of the same maths that differ only in summation order (micro-batch split,
another CPU's GEMM blocking, graph vs eager kernels, torch vs MindSpore) each carry a rounding
error of at most K * u * sum|terms| for a K-term sum (u = 2^-24; Higham, Accuracy and Stability
of Numerical Algorithms, 4.2). The longest sums in the tests' tiny models have K = 256 (the
vocabulary softmax; weight gradients sum over 4 x 32 = 128 tokens), so two such evaluations
agree to REORDER_RTOL = 2 * 256 * u = 3.1e-5 of the compared tensor's scale. Each gradient tensor
is compared against its own max|g|, not element by element: one element can cancel to ~0 while
its rounding error stays at the scale of the terms that cancelled.

AdamW then divides by sqrt(v): an element whose gradient is within rounding of 0 can move by up
to 2 * lr on any machine (the sign of a rounding error decides), so weights are compared with
adamw_step_bound, never with a fixed atol.
"""
from __future__ import annotations

import dataclasses

import mindspore as ms
import numpy as np

from interop.verify_train import RecordGradients
from msllm import checkpoint
from msllm.train.build import build_train_step

U32 = 2.0 ** -24                  # fp32 unit roundoff
U16 = 2.0 ** -11                  # fp16 unit roundoff
REORDER_RTOL = 2 * 256 * U32      # see the module docstring
# fp16 compute (fp32 master weights): every matmul, activation and residual-add output is rounded
# to fp16 (relative error <= U16; the arithmetic inside is fp32, so this rounding dominates and is
# the same on every CPU). Along a path through one block a value is rounded at most 10 times
# (projection, scores, probabilities, weighted values, output projection, residual; gate / up,
# product, down projection, residual), its gradient as often again on the way back: 40 roundings
# in the 2-layer test models, each adding <= U16 of the tensor's scale to first order.
FP16_RTOL = 40 * U16

Recorded = RecordGradients  # the applied-gradient recorder verify --train uses


def weights(params) -> dict:
    """name -> a copy of the values (asnumpy() can share memory the next step updates in place)."""
    return {p.name: p.asnumpy().copy() for p in params}


def assert_close_to_scale(got: dict, want: dict, rtol: float, what: str = "gradient") -> None:
    """Every tensor of `got` within rtol * max|want[name]| of `want`, element-wise."""
    assert got.keys() == want.keys()
    for name in want:
        scale = float(np.abs(want[name]).max())
        err = float(np.abs(got[name].astype(np.float64) - want[name]).max())
        assert err <= rtol * scale, f"{name}: max|diff| {err:.3g} > {rtol:.3g} * max|{what}| {scale:.3g}"


def adamw_step_bound(g_a, g_b, w, lr: float, eps: float = 1e-8):
    """How far apart AdamW's FIRST step may put a weight when two runs start from the same weight
    w and compute its gradient as g_a and g_b (both as applied: clipped, unscaled).

    At step 1 the bias-corrected moments are m = g, v = g^2, so AdamW (torch's form; msllm's
    portable and fused paths compute the same) sets w <- w (1 - lr wd) - lr f(g) with
    f(x) = x / (|x| + eps). Decay is identical in both runs, and
    |f(a) - f(b)| <= min(2, |a - b| / (min(|a|, |b|) + eps)):
    same signs: |f(a) - f(b)| = eps |a - b| / ((|a| + eps)(|b| + eps)) <= |a - b| / (min + eps);
    opposite signs: |f(a) - f(b)| = |a|/(|a| + eps) + |b|/(|b| + eps) <= (|a| + |b|) / (min + eps).
    Rounding: the update is a few fp32 operations on values <= lr, subtracted from w: <= 8 u (|w| + lr).
    So an element with a well-determined gradient agrees to ~lr * (relative gradient difference),
    and only one whose gradient is within rounding of 0 may move by up to 2 lr.
    """
    a, b = np.asarray(g_a, np.float64), np.asarray(g_b, np.float64)
    sensitivity = np.minimum(2.0, np.abs(a - b) / (np.minimum(np.abs(a), np.abs(b)) + eps))
    return lr * sensitivity + 8 * U32 * (np.abs(w) + lr)


def assert_adamw_first_step(w_a: dict, w_b: dict, g_a: dict, g_b: dict, lr: float, eps: float = 1e-8) -> None:
    """Weights after one AdamW step from the same start differ only as their gradients explain."""
    assert w_a.keys() == w_b.keys() == g_a.keys() == g_b.keys()
    for name in w_a:
        bound = adamw_step_bound(g_a[name], g_b[name], w_b[name], lr, eps)
        diff = np.abs(w_a[name].astype(np.float64) - w_b[name])
        worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
        assert np.all(diff <= bound), (f"{name}{list(worst)}: weights differ by {diff[worst]:.3g} > {bound[worst]:.3g} "
                                       f"(gradients {g_a[name][worst]:.6g} vs {g_b[name][worst]:.6g}, lr {lr:.3g})")


def decoder_path_terms(m, tokens: int, seq: int) -> tuple[int, int]:
    """(forward, backward) term counts along the longest path through a dense GQA decoder (the
    sharded oracle's and msllm's models in tests/test_layouts.py): the sum of K over every K-term
    reduction a value passes through. Forward, from the embedding to the loss; backward, from the
    loss to a layer-0 weight's gradient, which also carries the whole forward (its cached
    activations and the softmax it starts from) and ends in the weight gradient's own sum.

    To first order each K-term sum adds <= K u of its output's scale (the module docstring), and
    the norms, softmaxes and residual adds on the path pass relative errors on unamplified at these
    scales, so along the path they add: two evaluations that differ only in summation order (tp
    partial sums then an all-reduce, split token rows, another CPU's GEMM blocking) agree to
    2 * terms * u of the compared tensor's scale (decoder_rtol)."""
    h, f, d, v = m.hidden_size, m.ffn_size, m.head_size, m.vocab_size
    nq, nkv = m.num_heads * d, m.num_kv_heads * d
    group = m.num_heads // m.num_kv_heads
    sandwich, qk = int(m.sandwich_norm), int(m.qk_norm)
    # forward per block: input norm, q/k/v projections, q/k norms, scores, softmax sum, p @ v, wo,
    # sandwich norm; MLP norm, gate/up, down, sandwich norm
    block = h + h + qk * d + d + seq + seq + nq + sandwich * h + h + h + f + sandwich * h
    forward = m.num_layers * block + h + h + v + tokens          # final norm, logits, logsumexp, mean
    # backward per block: sandwich norm, down^T, gate^T + up^T, MLP norm, sandwich norm, wo^T,
    # dP = dO V^T, the softmax's row dot, dQ = dS K, dK = dS^T Q over the group's query heads,
    # q/k norms, q^T + k^T + v^T, input norm
    block_back = (sandwich * h + h + 2 * f + h + sandwich * h + h + d + d + seq + group * seq + qk * d
                  + nq + 2 * nkv + h)
    weight = tokens * (m.num_heads if m.qk_norm else 1)         # a weight's sum over tokens (q_norm: x heads)
    backward = forward + v + h + m.num_layers * block_back + weight  # + logits^T, final norm
    return forward, backward


def decoder_rtol(m, tokens: int, seq: int) -> tuple[float, float]:
    """(loss, gradient) relative tolerances for two fp32 evaluations of a decoder's step that differ
    only in summation order: 2 * path terms * u (decoder_path_terms), each against the compared
    tensor's own scale (max|g|, as assert_close_to_scale)."""
    forward, backward = decoder_path_terms(m, tokens, seq)
    return 2 * forward * U32, 2 * backward * U32


def step_variants(cfg, weights: dict, inputs: list, **variants) -> dict:
    """One compiled step of cfg's objective on `inputs` for each variant (name -> train.* overrides:
    precision, recompute, ...), each on a new model holding `weights`: name -> (outputs as floats: loss, grad
    norm, lr, finite, loss scale, then the loss cell's statistics; the gradients applied; the Built step)."""
    out = {}
    for name, train in variants.items():
        varied = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
        built = build_train_step(varied, wrap_optimizer=Recorded,
                                 load_weights=lambda params: checkpoint.load_into(params, weights, "the weights"))
        *outs, stats = built.train_step(*(ms.Tensor(x) for x in inputs))
        out[name] = ([float(x.asnumpy()) for x in outs] + stats.asnumpy().tolist(),
                     built.train_step.optimizer.gradients(), built)
    return out


def assert_overflow_is_skipped(built, inputs: list) -> None:
    """An fp16 step (`built`, build_train_step's) at a loss scale of 2^40, whose gradients overflow fp16 in
    backward: reported non-finite, weights and optimizer state untouched, the scale halved."""
    scaler = built.train_step.loss_scaler
    scaler.scale_value.set_data(ms.Tensor(2.0 ** 40, ms.float32))
    before = weights(built.model.trainable_params() + built.optimizer.state_parameters())
    _, _, lr, finite, scale, *_ = built.train_step(*(ms.Tensor(x) for x in inputs))
    assert (bool(finite.asnumpy()), float(scale.asnumpy()), float(lr.asnumpy())) == (False, 2.0 ** 40, 0.0)
    assert float(scaler.scale_value.asnumpy()) == 2.0 ** 39
    after = weights(built.model.trainable_params() + built.optimizer.state_parameters())
    assert all(np.array_equal(before[n], after[n]) for n in before)
