"""Fused CPU kernels (C++: cpu_kernels.cc, causal_conv.cc, flash_attention.cc, gated_delta_rule.cc,
grouped_matmul.cc, linear_cross_entropy.cc, sgemm.cc, cached_attention.cc) as MindSpore AOT Custom ops.

MindSpore's CPU backend runs every element-wise op as its own kernel and pass over memory:
the optimizer tail of a step (clip multiply, decay multiply, write-back, Adam) touches each
parameter-sized tensor four times, the gradient norm twice, SwiGLU forward + backward takes
~8 kernels. These do each chain in one pass: AdamW (in place) and the sum of squares, each
one call for all parameters, and RMSNorm, SwiGLU, RoPE with the head split, and the attention
softmax, each with its gradient. They are a CPU-backend accelerator only: on other backends,
without g++, or with train.fused_kernels: off, msllm uses the portable MindSpore-op
formulation of the same maths (tests hold both against each other and against torch).

build.py compiles the library once per source version, flags and CPU; op.py makes a kernel a MindSpore op
(`differentiable`: a kernel and its "Grad" kernel as one op with its gradient, in a line or two); the
other files hold the Cells the backends swap in, by what they fuse. Adding a kernel: its C++ in a .cc
listed in build.SOURCES, then a `differentiable(...)` (or `aot(...)`) line in the Cell that uses it.
"""
from msllm.kernels.attention import (CachedAttend, FlashAttention, FusedSinkSoftmaxAttention, FusedSoftmaxAttention,
                                     SinkFlashAttention, SoftmaxAttention)
from msllm.kernels.build import (KernelBuildError, cache_dir, enabled, flags, has_sgemm, library, library_path,
                                 march)
from msllm.kernels.fused import (FusedCacheTables, FusedCacheWrite, FusedClampedSwiGLU, FusedGeGLU, FusedRMSNormCore,
                                 FusedResidualNorm, FusedRope, FusedSwiGLU, LinearFewRows, PackedLinear,
                                 ProjectionsFewRows, SwiGLUFewRows, forget_packed_weights)
from msllm.kernels.gated_deltanet import FusedCausalConv, GatedDeltaRule, GatedDeltaStep
from msllm.kernels.head import FusedHead
from msllm.kernels.moe import GroupedMatmul
from msllm.kernels.optimizer import AdamWUpdate, sum_of_squares_op

__all__ = ["AdamWUpdate", "CachedAttend", "FlashAttention", "FusedCacheTables", "FusedCausalConv", "FusedCacheWrite",
           "FusedClampedSwiGLU", "FusedGeGLU", "FusedHead", "FusedRMSNormCore", "FusedResidualNorm", "FusedRope",
           "FusedSinkSoftmaxAttention", "FusedSoftmaxAttention", "FusedSwiGLU", "GatedDeltaRule", "GatedDeltaStep",
           "GroupedMatmul", "KernelBuildError", "LinearFewRows", "PackedLinear", "ProjectionsFewRows",
           "SinkFlashAttention", "SoftmaxAttention", "SwiGLUFewRows", "cache_dir", "enabled", "flags",
           "forget_packed_weights", "has_sgemm", "library", "library_path", "march", "sum_of_squares_op"]
