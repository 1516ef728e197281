"""The optimizer's tail in one kernel call each for all parameters: AdamW in place and the sum of squares
of the gradients (one graph node for the whole optimizer instead of one per parameter, which keeps compile
time flat in depth)."""
from __future__ import annotations

from mindspore import ops
from mindspore.ops import signature as sig

from msllm.kernels.build import library
from msllm.kernels.op import aot, float32, one_float


class AdamWUpdate(ops.Custom):
    """(w_1..w_n, m_1..m_n, v_1..v_n, g_1..g_n, [lr_t, lr, beta1, beta2, eps_t, grad_coef], weight_decay [n]) -> [1].

    Updates the n parameters and their moments in place, all in one kernel call.
    """

    def __init__(self, n: int):
        super().__init__(f"{library()}:AdamWUpdate", out_shape=one_float, out_dtype=float32, func_type="aot")
        # Marking w, m, v as written makes MindSpore order this op like its own Adam kernel
        # (after every read of the old values, before the next step).
        written = [sig.make_sig(f"{name}{i}", sig.sig_rw.RW_WRITE, dtype=sig.sig_dtype.T)
                   for name in ("w", "m", "v") for i in range(n)]
        read = [sig.make_sig(f"g{i}", dtype=sig.sig_dtype.T) for i in range(n)]
        self.__mindspore_signature__ = tuple(written + read + [sig.make_sig("scalars", dtype=sig.sig_dtype.T),
                                                               sig.make_sig("weight_decay", dtype=sig.sig_dtype.T)])
        self.add_prim_attr("side_effect_mem", True)


def sum_of_squares_op():
    """(g_1, .., g_n) (fp32, any shapes) -> [1] the sum of all their squares, in one kernel call."""
    return aot("SumOfSquares", one_float, float32)
