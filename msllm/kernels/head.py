"""The LM head and its cross-entropy in C++ (linear_cross_entropy.cc), with no [N, V] logits buffer."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from msllm.kernels.op import aot, differentiable
from msllm.models.layers import cast


def _lse_and_target_shapes(h, *_):
    return h[:1], h[:1]


def _lse_and_its_grads(out, dout):
    """dlogits = dlse * softmax + dtarget * onehot(label): the backward reads lse, dlse and -dtarget."""
    return out[0], dout[0], -dout[1]


class FusedHead(nn.Cell):
    """msllm.models.layers.ChunkedHead in C++ (linear_cross_entropy.cc): hidden [N, H], weight [V, H],
    labels [N] -> (lse [N], target [N]) of the logits hidden @ weight^T (soft-capped with `softcap`),
    by blocks of ~1M logits per thread (4 MB), forward and backward: no [N, V] buffer, one graph node
    each way. Runs in fp32 (dnnl_sgemm: needs has_sgemm()). weight_grad False (a frozen head: LoRA):
    the forward also returns lse's gradient rows (expect [N, H], the softmax's mean of dz/dh), so the
    backward is dh = dlse * expect + dtarget * dz_label/dh, without a second pass over the vocabulary;
    the weight's gradient is returned as zeros, which nothing reads."""

    def __init__(self, softcap: float = 0.0, weight_grad: bool = True):
        super().__init__()
        self.softcap, self.weight_grad = softcap, weight_grad
        self.cap = ms.Tensor([softcap], ms.float32)
        if weight_grad:
            self.head = differentiable("LinearCrossEntropy", "h w labels cap", _lse_and_target_shapes,
                                       lambda h, *_: (h, h), constant="labels cap", reads=_lse_and_its_grads)
        else:
            def bprop(h, w, labels, cap, out, dout):
                label_slope = dout[1]  # d target / d h = w[label] * (1 - tanh^2 of the capped label logit)
                if softcap > 0:
                    label_slope = label_slope * (1 - ops.square(out[1] / softcap))
                dh = dout[0].reshape(-1, 1) * out[2] + label_slope.reshape(-1, 1) * ops.gather(w, labels, 0)
                return dh, ops.zeros_like(w), ops.zeros_like(labels), ops.zeros_like(cap)

            self.head = aot("LinearCrossEntropyFrozen", lambda h, *_: (h[:1], h[:1], h), lambda h, *_: (h, h, h),
                            bprop=bprop)

    def construct(self, h, weight, labels):
        out = self.head(cast(h, ms.float32), weight, labels.astype(ms.int32), self.cap)
        return out[0], out[1]
