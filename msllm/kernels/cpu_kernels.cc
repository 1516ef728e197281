// Fused fp32 CPU kernels for msllm's train step, called through MindSpore's AOT Custom op.
//
// Each one replaces a chain of MindSpore element-wise kernels that each make a full pass over
// memory. Signature (MindSpore AOT): inputs then outputs in `params`, shapes per tensor.
// Work is split in contiguous chunks over a small persistent thread pool (one thread per core);
// small tensors stay on the calling thread.

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <memory>
#include <unordered_map>

#include "common.h"
#include "library.h"
#include "panels.h"

using namespace msllm_kernels;


// torch.optim.AdamW on n parameters, in place, one pass over each w, m, v, g:
//   g' = coef * g; m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2
//   w = w * (1 - lr wd) - lr_t * m / (sqrt(v) + eps_t)
// with lr_t = lr sqrt(1 - b2^t) / (1 - b1^t) and eps_t = eps sqrt(1 - b2^t), which is torch's
// bias-corrected update rearranged. coef carries loss-scale removal and gradient clipping.
// inputs: w[0..n), m[0..n), v[0..n), g[0..n) [any shapes, fp32], s = [lr_t, lr, b1, b2, eps_t, coef],
// wd [n] (each parameter's decay); output: [1].
extern "C" int AdamWUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  const int n = (nparam - 3) / 4;
  float **w = reinterpret_cast<float **>(params), **m = w + n, **v = w + 2 * n, **g = w + 3 * n;
  const float *s = static_cast<const float *>(params[4 * n]);
  const float *wd = static_cast<const float *>(params[4 * n + 1]);
  const float lr_t = s[0], lr = s[1], b1 = s[2], b2 = s[3], eps_t = s[4], coef = s[5];
  // the scalars captured by value: by reference, gcc reloaded them through the closure and left the loop scalar
  parallel_for_tensors(n, ndims, shapes, [=](int k, int64_t lo, int64_t hi, int) {
    float *__restrict wk = w[k], *__restrict mk = m[k], *__restrict vk = v[k];
    const float *__restrict gk = g[k];
    const float keep = 1.f - lr * wd[k];
    for (int64_t i = lo; i < hi; ++i) {
      const float gi = gk[i] * coef;
      const float mi = b1 * mk[i] + (1.f - b1) * gi;
      const float vi = b2 * vk[i] + (1.f - b2) * gi * gi;
      mk[i] = mi;
      vk[i] = vi;
      wk[i] = wk[i] * keep - lr_t * mi / (std::sqrt(vi) + eps_t);
    }
  });
  static_cast<float *>(params[4 * n + 2])[0] = 0.f;
  return 0;
}

// Sum of squares over n tensors (the global gradient norm's), one pass over each.
// 16 independent float lanes vectorize without -ffast-math; each lane sums at most 256 squares in
// float before it is added into double, so the result is as accurate as a double sum for any
// realistic size. inputs: g[0..n) [any shapes, fp32]; output: [1].
extern "C" int SumOfSquares(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  const int n = nparam - 1;
  double partial[kMaxThreads] = {0};
  parallel_for_tensors(n, ndims, shapes, [&](int k, int64_t lo, int64_t hi, int t) {
    const float *__restrict g = static_cast<const float *>(params[k]);
    constexpr int kLanes = 16, kBlock = kLanes * 256;
    double total = 0;
    int64_t i = lo;
    for (; i + kBlock <= hi; i += kBlock) {
      float lane[kLanes] = {0};
      for (int64_t b = i; b < i + kBlock; b += kLanes)
        for (int j = 0; j < kLanes; ++j) lane[j] += g[b + j] * g[b + j];
      for (int j = 0; j < kLanes; ++j) total += lane[j];
    }
    for (; i < hi; ++i) total += static_cast<double>(g[i]) * g[i];
    partial[t] += total;
  });
  double total = 0;
  for (double p : partial) total += p;
  static_cast<float *>(params[n])[0] = static_cast<float>(total);
  return 0;
}


// SwiGLU activation: h = silu(gate) * up = gate * sigmoid(gate) * up, one pass instead of the
// Sigmoid, Mul, Mul kernels. inputs: gate, up [same shape, fp32]; output: h.
void msllm_kernels::swiglu(const float *__restrict gate, const float *__restrict up, float *__restrict h, int64_t n) {
  parallel_for(n, [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) h[i] = gate[i] * sigmoid(gate[i]) * up[i];
  });
}

extern "C" int SwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra) {
  swiglu(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), static_cast<float *>(params[2]),
         numel(ndims[0], shapes[0]));
  return 0;
}

// Its gradient, recomputing sigmoid(gate) rather than storing it:
//   d up = dh * gate * s,  d gate = dh * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate).
// inputs: gate, up, dh; outputs: d gate, d up.
extern "C" int SwiGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  const float *__restrict gate = static_cast<const float *>(params[0]);
  const float *__restrict up = static_cast<const float *>(params[1]);
  const float *__restrict dh = static_cast<const float *>(params[2]);
  float *__restrict dgate = static_cast<float *>(params[3]);
  float *__restrict dup = static_cast<float *>(params[4]);
  parallel_for(numel(ndims[0], shapes[0]), [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const float g = gate[i], s = sigmoid(g);
      dup[i] = dh[i] * g * s;
      dgate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
    }
  });
  return 0;
}

// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// h = g * sigmoid(alpha * g) * (u + 1), one pass instead of two clamps, a scale, Sigmoid, an add and
// two Muls. inputs: gate, up [same shape], alpha_limit [2] (fp32); output: h.
extern "C" int ClampedSwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  const float *__restrict gate = static_cast<const float *>(params[0]);
  const float *__restrict up = static_cast<const float *>(params[1]);
  const float alpha = static_cast<const float *>(params[2])[0], limit = static_cast<const float *>(params[2])[1];
  float *__restrict h = static_cast<float *>(params[3]);
  parallel_for(numel(ndims[0], shapes[0]), [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const float g = std::min(gate[i], limit), u = std::min(std::max(up[i], -limit), limit);
      h[i] = g * sigmoid(alpha * g) * (u + 1.0f);
    }
  });
  return 0;
}

// Its gradient, s = sigmoid(alpha * g) recomputed; a clamp passes the gradient where its input is within
// the bounds, ends included (as MindSpore's and torch's clamp do):
//   d up = dh * g * s [|up| <= limit],  d gate = dh * (u + 1) * s * (1 + alpha * g * (1 - s)) [gate <= limit].
// inputs: gate, up, alpha_limit, dh; outputs: d gate, d up, d alpha_limit (zeros: constants).
extern "C" int ClampedSwiGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  const float *__restrict gate = static_cast<const float *>(params[0]);
  const float *__restrict up = static_cast<const float *>(params[1]);
  const float alpha = static_cast<const float *>(params[2])[0], limit = static_cast<const float *>(params[2])[1];
  const float *__restrict dh = static_cast<const float *>(params[3]);
  float *__restrict dgate = static_cast<float *>(params[4]);
  float *__restrict dup = static_cast<float *>(params[5]);
  float *__restrict dconst = static_cast<float *>(params[6]);
  dconst[0] = dconst[1] = 0.0f;
  parallel_for(numel(ndims[0], shapes[0]), [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const float g = std::min(gate[i], limit), u = std::min(std::max(up[i], -limit), limit);
      const float s = sigmoid(alpha * g);
      dup[i] = (up[i] >= -limit && up[i] <= limit) ? dh[i] * g * s : 0.0f;
      dgate[i] = gate[i] <= limit ? dh[i] * (u + 1.0f) * s * (1.0f + alpha * g * (1.0f - s)) : 0.0f;
    }
  });
  return 0;
}

// GeGLU activation with the tanh approximation (Gemma): h = gelu_tanh(gate) * up. As
// 1 + tanh(u) = 2 sigmoid(2u), gelu_tanh(g) = g * sigmoid(2u), u = c (g + 0.044715 g^3), c = sqrt(2/pi).
// inputs: gate, up [same shape, fp32]; output: h.
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

extern "C" int GeGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                     void *stream, void *extra) {
  const float *__restrict gate = static_cast<const float *>(params[0]);
  const float *__restrict up = static_cast<const float *>(params[1]);
  float *__restrict h = static_cast<float *>(params[2]);
  parallel_for(numel(ndims[0], shapes[0]), [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const float g = gate[i];
      h[i] = g * sigmoid(2.0f * kGeluC * (g + kGeluA * g * g * g)) * up[i];
    }
  });
  return 0;
}

// Its gradient, s = sigmoid(2u) recomputed: d up = dh * g * s,
// d gate = dh * up * (s + g * s * (1 - s) * 2c (1 + 3 * 0.044715 g^2)). inputs: gate, up, dh; outputs: d gate, d up.
extern "C" int GeGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                         void *stream, void *extra) {
  const float *__restrict gate = static_cast<const float *>(params[0]);
  const float *__restrict up = static_cast<const float *>(params[1]);
  const float *__restrict dh = static_cast<const float *>(params[2]);
  float *__restrict dgate = static_cast<float *>(params[3]);
  float *__restrict dup = static_cast<float *>(params[4]);
  parallel_for(numel(ndims[0], shapes[0]), [=](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const float g = gate[i], s = sigmoid(2.0f * kGeluC * (g + kGeluA * g * g * g));
      dup[i] = dh[i] * g * s;
      dgate[i] = dh[i] * up[i] * (s + g * s * (1.0f - s) * 2.0f * kGeluC * (1.0f + 3.0f * kGeluA * g * g));
    }
  });
  return 0;
}

// RMSNorm over the last axis: y = x * r * (offset + w) with r = 1 / sqrt(mean(x^2) + eps) per row, one pass
// instead of MindSpore's square, row-sum, rsqrt, broadcast and multiply kernels (and the offset's add).
// inputs: x [N, H], w [H], (eps, offset) [2] (fp32); output: y [N, H].
void msllm_kernels::rms_norm(const float *__restrict x, const float *__restrict w, float eps, float offset,
                             float *__restrict y, int64_t rows, int64_t h) {
  parallel_for(rows, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row) {
      const float *xr = x + row * h;
      float *yr = y + row * h;
      const float r = 1.f / std::sqrt(lane_dot<false>(xr, xr, nullptr, h) / h + eps);
      for (int64_t j = 0; j < h; ++j) yr[j] = xr[j] * r * (offset + w[j]);
    }
  }, std::max<int64_t>(1, (1 << 16) / h));
}

extern "C" int RMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       void *stream, void *extra) {
  const float *eps_offset = static_cast<const float *>(params[2]);
  const int64_t h = shapes[0][ndims[0] - 1];
  rms_norm(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), eps_offset[0], eps_offset[1],
           static_cast<float *>(params[3]), numel(ndims[0], shapes[0]) / h, h);
  return 0;
}

// Its gradient, recomputing r per row. With the scale s = offset + w and g = s * dy:
//   dx = r * g - x * r^3 * mean(x * g),  dw = sum over rows of dy * x * r.
// Each thread sums dw over its rows; the caller adds the threads' partial sums.
// inputs: x [N, H], w [H], (eps, offset) [2], dy [N, H]; outputs: dx [N, H], dw [H].
extern "C" int RMSNormGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  const float *__restrict x = static_cast<const float *>(params[0]);
  const float *__restrict w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0], offset = static_cast<const float *>(params[2])[1];
  const float *__restrict dy = static_cast<const float *>(params[3]);
  float *__restrict dx = static_cast<float *>(params[4]);
  float *__restrict dw = static_cast<float *>(params[5]);
  const int64_t h = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / h;
  std::vector<float> scale(w, w + h), partial(static_cast<size_t>(pool().size() * h), 0.f);
  for (float &s : scale) s += offset;
  const float *__restrict sc = scale.data();
  parallel_for(rows, [=, &partial](int64_t lo, int64_t hi, int t) {
    float *__restrict dw_t = partial.data() + t * h;
    for (int64_t row = lo; row < hi; ++row) {
      const float *xr = x + row * h, *dyr = dy + row * h;
      float *dxr = dx + row * h;
      const float r = 1.f / std::sqrt(lane_dot<false>(xr, xr, nullptr, h) / h + eps);
      const float c = r * r * r * lane_dot<true>(xr, sc, dyr, h) / h;
      for (int64_t j = 0; j < h; ++j) {
        dxr[j] = r * sc[j] * dyr[j] - xr[j] * c;
        dw_t[j] += dyr[j] * xr[j] * r;
      }
    }
  }, std::max<int64_t>(1, (1 << 16) / h));
  for (int64_t j = 0; j < h; ++j) {
    float sum = 0.f;
    for (int t = 0; t < pool().size(); ++t) sum += partial[t * h + j];
    dw[j] = sum;
  }
  return 0;
}

namespace {

// One row of attention probabilities, pr = softmax(sr + mr) over t entries, with an extra logit `sink` that
// takes its share of the row and has no entry (-inf: none). Returns the sink's probability. The row sum
// in 16 independent lanes (blocks of 16, then the tail), so it vectorizes.
inline float masked_softmax_row(const float *__restrict sr, const float *__restrict mr, float *__restrict pr,
                                int64_t t, float sink) {
  constexpr int kLanes = 16;
  const int64_t body = t - t % kLanes;
  float lane_sum[kLanes] = {0};
  for (int64_t j = 0; j < t; ++j) pr[j] = sr[j] + mr[j];
  const float top = lane_max(pr, t, sink);
  for (int64_t j = 0; j < t; ++j) pr[j] = exp_approx(pr[j] - top);  // <= 0; -inf gives exp(-87) ~ 1e-38
  for (int64_t j = 0; j < body; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane_sum[k] += pr[j + k];
  const float sink_exp = sink == -INFINITY ? 0.f : exp_approx(sink - top);
  float sum = sink_exp;
  for (int64_t j = body; j < t; ++j) sum += pr[j];
  for (int k = 0; k < kLanes; ++k) sum += lane_sum[k];
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < t; ++j) pr[j] *= inv;
  return sink_exp * inv;
}

// The [s, t] block of the mask that serves score row `row`: the mask may have fewer rows than the scores,
// broadcast over its missing leading axes.
struct MaskRows {
  const float *mask;
  int64_t s, t, rows_per_mask;
  MaskRows(void *m, int ndim, const int64_t *shape, int64_t score_rows)
      : mask(static_cast<const float *>(m)), s(shape[ndim - 2]), t(shape[ndim - 1]),
        rows_per_mask(score_rows / (numel(ndim, shape) / t / s)) {}
  const float *of(int64_t row) const { return mask + ((row / rows_per_mask) * s + row % s) * t; }
};

}  // namespace

// Attention probabilities: p = softmax(scores + mask) over the last axis, in one pass instead of
// an Add and a Softmax kernel. The mask may have fewer rows than the scores, broadcast over its
// missing leading axes: [s, t] shared by every row of [b, h, s, t] scores, or [b, 1, s, t] (packed
// samples, DPO branches: each batch row its own) read by all its heads. -inf in the mask is allowed;
// a row must keep at least one finite entry. inputs: scores [.., s, t], mask [.., s, t] (fp32); output: p.
extern "C" int MaskedSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  const float *__restrict scores = static_cast<const float *>(params[0]);
  float *__restrict p = static_cast<float *>(params[2]);
  const int64_t t = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / t;
  const MaskRows mask(params[1], ndims[1], shapes[1], rows);
  parallel_for(rows, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row)
      masked_softmax_row(scores + row * t, mask.of(row), p + row * t, t, -INFINITY);
  }, std::max<int64_t>(1, (1 << 14) / t));
  return 0;
}

// MaskedSoftmax with a sink logit per head (gpt-oss): each row's softmax also holds its head's sink, which
// has no entry in p; sink_p is the share it took (the sinks' gradient reads it). The scores' rows are in
// (batch, head, query) order, heads grouped by KV head ([b, nkv, rep * s, t]): row r is head (r / s) % heads.
// inputs: scores [.., t], mask (as MaskedSoftmax), sinks [heads] (fp32); outputs: p [.., t], sink_p [..].
extern "C" int MaskedSinkSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  const float *__restrict scores = static_cast<const float *>(params[0]);
  const float *__restrict sinks = static_cast<const float *>(params[2]);
  float *__restrict p = static_cast<float *>(params[3]);
  float *__restrict sink_p = static_cast<float *>(params[4]);
  const int64_t t = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / t, heads = shapes[2][0];
  const MaskRows mask(params[1], ndims[1], shapes[1], rows);
  parallel_for(rows, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row)
      sink_p[row] = masked_softmax_row(scores + row * t, mask.of(row), p + row * t, t, sinks[row / mask.s % heads]);
  }, std::max<int64_t>(1, (1 << 14) / t));
  return 0;
}

// Softmax backward in attention, using rowsum(dP * P) = rowsum(dO * O) (a sum over head_dim,
// as FlashAttention does): ds = p * (dp - delta), delta = rowsum(do * o).
// inputs: p, dp [R, t], do, o [R, d] (any leading shape with R rows; fp32); output: ds [R, t].
extern "C" int SoftmaxAttentionGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  const float *__restrict p = static_cast<const float *>(params[0]);
  const float *__restrict dp = static_cast<const float *>(params[1]);
  const float *__restrict d_out = static_cast<const float *>(params[2]);
  const float *__restrict out = static_cast<const float *>(params[3]);
  float *__restrict ds = static_cast<float *>(params[4]);
  const int64_t t = shapes[0][ndims[0] - 1], rows = numel(ndims[0], shapes[0]) / t;
  const int64_t d = shapes[2][ndims[2] - 1];
  parallel_for(rows, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row) {
      const float delta = lane_dot<false>(d_out + row * d, out + row * d, nullptr, d);
      const float *pr = p + row * t, *dpr = dp + row * t;
      float *dsr = ds + row * t;
      for (int64_t j = 0; j < t; ++j) dsr[j] = pr[j] * (dpr[j] - delta);
    }
  }, std::max<int64_t>(1, (1 << 14) / t));
  return 0;
}

// RoPE (rotate-half) fused with the split into heads: x [b*s, n*h] (a q or k projection, rows in
// (batch, position) order) -> y [b, n, s, h] with y = x * cos + rotate_half(x) * sin over each head's first
// d features (the tables' width; d < h: partial RoPE, the rest passed as they are), where rotate_half(x) =
// [-x2, x1] over the two halves of d. One pass instead of a Transpose, a MatMul (the rotation) and three
// element-wise kernels (partial: slices and concats too). inputs: x, cos, sin [s, d], or [b, 1, s, d] with
// each row's own positions (a cached forward over left-padded rows, packed samples) (fp32); output: y.
void msllm_kernels::rope_heads(const float *__restrict x, const float *__restrict cos, const float *__restrict sin,
                               float *__restrict y, int64_t b, int64_t s, int64_t n, int64_t h, int64_t d,
                               int64_t table_rows) {
  const int64_t width = n * h, half = d / 2;
  parallel_for(b * n * s, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t batch = row / (n * s), head = (row / s) % n, pos = row % s;
      const int64_t at = (batch * s + pos) % table_rows * d;
      const float *src = x + (batch * s + pos) * width + head * h, *c = cos + at, *sn = sin + at;
      float *dst = y + row * h;
      for (int64_t j = 0; j < half; ++j) dst[j] = src[j] * c[j] - src[j + half] * sn[j];
      for (int64_t j = half; j < d; ++j) dst[j] = src[j] * c[j] + src[j - half] * sn[j];
      for (int64_t j = d; j < h; ++j) dst[j] = src[j];
    }
  }, std::max<int64_t>(1, (1 << 14) / h));
}

extern "C" int RopeHeads(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                         void *stream, void *extra) {
  const int64_t s = shapes[1][ndims[1] - 2], d = shapes[1][ndims[1] - 1], h = shapes[3][3];
  const int64_t n = shapes[0][ndims[0] - 1] / h, b = numel(ndims[0], shapes[0]) / (n * h * s);
  rope_heads(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
             static_cast<const float *>(params[2]), static_cast<float *>(params[3]), b, s, n, h, d,
             numel(ndims[1], shapes[1]) / d);  // table rows: s or b * s
  return 0;
}

// Its gradient, back to the projection's layout: with g = dy,
//   dx[j] = g[j] cos[j] + g[j + d/2] sin[j + d/2]   (j < d/2)
//   dx[j] = g[j] cos[j] - g[j - d/2] sin[j - d/2]   (d/2 <= j < d; dx[j] = g[j] past d)
// inputs: dy [b, n, s, h], cos, sin [s, d] or [b, 1, s, d] (packed rows' own positions); output: dx [b*s, n*h].
extern "C" int RopeHeadsGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  const float *__restrict dy = static_cast<const float *>(params[0]);
  const float *__restrict cos = static_cast<const float *>(params[1]);
  const float *__restrict sin = static_cast<const float *>(params[2]);
  float *__restrict dx = static_cast<float *>(params[3]);
  const int64_t s = shapes[1][ndims[1] - 2], d = shapes[1][ndims[1] - 1], half = d / 2, h = shapes[0][3];
  const int64_t n = shapes[0][1], width = n * h, table_rows = numel(ndims[1], shapes[1]) / d;  // s or b * s
  const int64_t rows = numel(ndims[0], shapes[0]) / h;
  parallel_for(rows, [=](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t batch = row / (n * s), head = (row / s) % n, pos = row % s;
      const int64_t at = (batch * s + pos) % table_rows * d;
      const float *g = dy + row * h, *c = cos + at, *sn = sin + at;
      float *dst = dx + (batch * s + pos) * width + head * h;
      for (int64_t j = 0; j < half; ++j) dst[j] = g[j] * c[j] + g[j + half] * sn[j + half];
      for (int64_t j = half; j < d; ++j) dst[j] = g[j] * c[j] - g[j - half] * sn[j - half];
      for (int64_t j = d; j < h; ++j) dst[j] = g[j];
    }
  }, std::max<int64_t>(1, (1 << 14) / h));
  return 0;
}

// The lanes [lo, hi) of the 8 floats at p, the others 0; lanes outside are not read (a masked load), so p may
// point before an array's start or run past its end.
static inline Floats8 load_lanes(const float *p, int lo, int hi) {
#if defined(__AVX__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1)),
                                      _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
  return (Floats8)_mm256_maskload_ps(p, in);
#else
  Floats8 v = {};
  for (int l = lo; l < hi; ++l) v[l] = p[l];
  return v;
#endif
}

// A loaded vector kept in a register: gcc would otherwise fold a vector used by several FMAs into each as a
// memory operand, a load per FMA, and loads, not FMAs, bound these tiles on the AMD VM.
static inline Floats8 in_register(Floats8 v) {
#if defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}

// y[0..3] = the lane sums of 4 vectors.
static inline void store_lane_sums4(float *y, Floats8 a, Floats8 b, Floats8 c, Floats8 d) {
#if defined(__AVX__)
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b), _mm256_hadd_ps((__m256)c, (__m256)d));
  _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
#else
  const Floats8 v[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    float sum = 0.f;
    for (int l = 0; l < 8; ++l) sum += v[i][l];
    y[i] = sum;
  }
#endif
}

// y[r, o] for kRows rows of x and kOuts weight rows (a multiple of 4): per 8 columns the kRows x vectors are
// loaded once and each weight vector serves them all, (kRows + kOuts) loads for kRows * kOuts FMAs (3 x 4: 12
// sums + 3 x + 1 w = AVX2's 16 registers). The first vector stops at w's 32-byte boundary, so the rest load
// aligned (MindSpore's CPU tensors start 16 bytes past one; a load across cache lines costs two); the first
// and last are masked loads, so any k works.
template <int kRows, int kOuts>
static void dot_tile(const float *__restrict x, const float *__restrict w, float *__restrict y, int64_t k,
                     int64_t n) {
  Floats8 acc[kRows][kOuts] = {};
  // From 2 rows, the next tile's weights (the kOuts rows after these) requested while this one runs, kOuts / 2
  // lines per 8 columns: the hardware prefetcher stops at 4 KB pages (a lone row ran slower with them).
  const char *next = reinterpret_cast<const char *>(w + kOuts * k);
  auto columns = [&](int64_t j, auto load) {  // the 8 columns from j
#if defined(__AVX__)
    for (int q = 0; kRows > 1 && q < kOuts / 2; ++q, next += 64) _mm_prefetch(next, _MM_HINT_T0);
#endif
    Floats8 xv[kRows];
    for (int r = 0; r < kRows; ++r) xv[r] = in_register(load(x + r * k + j));
    for (int o = 0; o < kOuts; ++o) {
      const Floats8 wv = in_register(load(w + o * k + j));
      for (int r = 0; r < kRows; ++r) acc[r][o] += xv[r] * wv;
    }
  };
  const int64_t head = (0 - reinterpret_cast<uintptr_t>(w) / sizeof(float)) % 8;  // floats to the boundary
  int64_t j = std::min(head, k);
  if (j > 0) columns(j - 8, [&](const float *p) { return load_lanes(p, 8 - j, 8); });
  for (; j + 8 <= k; j += 8) columns(j, [](const float *p) { return load8(p); });
  if (j < k) columns(j, [&](const float *p) { return load_lanes(p, 0, k - j); });
  for (int r = 0; r < kRows; ++r)
    for (int o = 0; o < kOuts; o += 4)
      store_lane_sums4(y + r * n + o, acc[r][o], acc[r][o + 1], acc[r][o + 2], acc[r][o + 3]);
}

constexpr int kTileOuts = 4;

// Weight rows [lo, hi) of one weight against all m rows of x, into y [m, n]: tiles of 3 x rows (2 + 2 for
// the last 4) by kTileOuts weight rows; a lone row (a single-stream decode step, bound by reading the
// weights) by 8 weight rows, more reads in flight; the leftover weight rows by the plain dot.
static void few_rows_block(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t lo,
                           int64_t hi) {
  int64_t o = lo;
  if (m == 1)
    for (; o + 2 * kTileOuts <= hi; o += 2 * kTileOuts) dot_tile<1, 2 * kTileOuts>(x, w + o * k, y + o, k, n);
  for (; o + kTileOuts <= hi; o += kTileOuts) {
    int64_t r = 0;
    for (; r + 3 <= m && m - r != 4; r += 3) dot_tile<3, kTileOuts>(x + r * k, w + o * k, y + r * n + o, k, n);
    for (; r + 2 <= m; r += 2) dot_tile<2, kTileOuts>(x + r * k, w + o * k, y + r * n + o, k, n);
    if (r < m) dot_tile<1, kTileOuts>(x + r * k, w + o * k, y + r * n + o, k, n);
  }
  for (; o < hi; ++o)
    for (int64_t r = 0; r < m; ++r) y[r * n + o] = lane_dot<false>(x + r * k, w + o * k, nullptr, k);
}

// From this many rows of x a projection is a small GEMM (panels.h): each weight, packed once into panels, is read
// once per group of 6 rows with no lane sums. Fewer rows (a lone decode stream) are bound by reading the weights:
// the dot tiles above read them as they are.
constexpr int64_t kPackedRows = 4;

// A weight [n, k] packed as B = W^T's panels (pack_b_panels: [panel][j][16 outputs], outputs past n zero), 64-byte
// aligned. `probe`: weight values at 16 spread places when packed, checked on each use, so a
// weight rewritten at the same address (a test's new array) is repacked; the engine's prefill marks every
// packed copy stale (ForgetPackedWeights), as a weight update may change values the probe does not see.
struct Panels {
  std::unique_ptr<float, decltype(&std::free)> data{nullptr, &std::free};
  int64_t n = 0, k = 0;
  float probe[16];
  bool stale = true, used = false;  // used: since the last ForgetPackedWeights
};

static void probe_of(const float *w, int64_t size, float *probe) {
  for (int i = 0; i < 16; ++i) probe[i] = w[(size - 1) * i / 15];
}

static std::mutex packed_mutex;
static std::unordered_map<const float *, std::shared_ptr<Panels>> packed_weights;  // by weight address

// The panels of w [n, k], packed now if stale or w's probed values changed: into the buffer it had, or else a
// stale one of its size unused since the last ForgetPackedWeights (new weights at new addresses, as a GRPO
// step's copy to the generator), a fresh buffer only failing both (one costs a page fault per 4 KB, as much as
// the copy).
static std::shared_ptr<Panels> panels_of(const float *w, int64_t n, int64_t k) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  float probe[16];
  probe_of(w, n * k, probe);
  if (!packed_weights.count(w))
    for (auto it = packed_weights.begin(); it != packed_weights.end(); ++it)
      if (it->second->stale && !it->second->used && it->second->n == n && it->second->k == k) {
        auto buffer = it->second;
        packed_weights.erase(it);
        packed_weights[w] = buffer;
        break;
      }
  std::shared_ptr<Panels> &held = packed_weights[w];
  if (!held || held->n != n || held->k != k) {
    held = std::make_shared<Panels>();
    held->n = n;
    held->k = k;
    held->data.reset(static_cast<float *>(std::aligned_alloc(64, sizeof(float) * (n + kNr - 1) / kNr * kNr * k)));
  }
  held->used = true;
  if (!held->stale && std::memcmp(held->probe, probe, sizeof probe) == 0) return held;
  std::memcpy(held->probe, probe, sizeof probe);
  held->stale = false;
  float *dst = held->data.get();
  parallel_for((n + kNr - 1) / kNr, [=](int64_t lo, int64_t hi, int) {
    pack_b_panels(Matrix{w, 1, k}, k, n, lo * kNr, hi - lo, dst + lo * kNr * k);
  }, 1);
  return held;
}

// Marks every packed weight stale (the weights may have changed; the engine calls it at each prefill) and frees
// those not used since the last call.
extern "C" void ForgetPackedWeights() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  for (auto it = packed_weights.begin(); it != packed_weights.end();) {
    if (!it->second->used) {
      it = packed_weights.erase(it);
      continue;
    }
    it->second->stale = true;
    it->second->used = false;
    ++it;
  }
}

// Panels per unit of work of LinearsFewRows: ~10 units a weight for two threads to share.
constexpr int64_t kFewRowsChunk = 8;

// LinearsFewRows from kPackedRows rows: a GEMM per weight with its kept panels, all as one list of units, x
// packed once for them all.
static void linears_packed(const float *x, int64_t m, int64_t k, int count, const float *const *w,
                           const int64_t *outs, float *const *y) {
  std::vector<std::shared_ptr<Panels>> packed(count);
  std::vector<Gemm> gemms;
  for (int i = 0; i < count; ++i) {
    packed[i] = panels_of(w[i], outs[i], k);
    gemms.push_back(Gemm{m, outs[i], k, {x, k, 1}, {nullptr, 1, k}, y[i], outs[i], kFewRowsChunk,
                         packed[i]->data.get()});
  }
  thread_local std::vector<float> packed_x_buffer;
  if (gemms[0].row_blocks == 1) {
    float *packed_x = aligned_floats(packed_x_buffer, gemms[0].packed_a_size());
    gemms[0].pack_a(packed_x);
    for (Gemm &g : gemms) g.packed_a = packed_x;
  }
  compute_gemms(gemms, kMaxThreads);
}

// y_i = x W_i^T for every weight W_i of a layer's projections of one input x (a decode step's few rows),
// in one kernel: the weights' rows laid end to end are split across the pool, each read once from memory
// and dotted with every row of x while it is in L1. MindSpore's MatMul packs a weight into its own layout
// first, a second pass over it per call; from kPackedRows rows the weights are packed here once (kept until the
// engine's next prefill) and read as panels.
void msllm_kernels::linears_few_rows(const float *x, int64_t m, int64_t k, int count, const float *const *w,
                                     const int64_t *outs, float *const *y) {
  if (m >= kPackedRows) {
    linears_packed(x, m, k, count, w, outs, y);
    return;
  }
  std::vector<int64_t> start(count + 1, 0);  // the first row of each weight, the weights end to end
  for (int i = 0; i < count; ++i) start[i + 1] = start[i] + outs[i];
  // chunks of whole tiles, so a weight's tiles are cut only at its end
  const int64_t tiles = (start[count] + kTileOuts - 1) / kTileOuts;
  parallel_for(tiles, [&](int64_t tile_lo, int64_t tile_hi, int) {
    const int64_t lo = tile_lo * kTileOuts, hi = std::min(start[count], tile_hi * kTileOuts);
    for (int i = 0; i < count; ++i) {
      const int64_t a = std::max(lo, start[i]), b = std::min(hi, start[i + 1]);
      if (a < b) few_rows_block(x, w[i], y[i], m, k, outs[i], a - start[i], b - start[i]);
    }
  }, std::max<int64_t>(1, (1 << 14) / k));
}

// inputs: x [m, k], w_1 .. w_N [n_i, k] (fp32); outputs: y_1 .. y_N [m, n_i].
extern "C" int LinearsFewRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  const int count = (nparam - 1) / 2;
  std::vector<const float *> w(count);
  std::vector<int64_t> outs(count);
  std::vector<float *> y(count);
  for (int i = 0; i < count; ++i) {
    w[i] = static_cast<const float *>(params[1 + i]);
    outs[i] = shapes[1 + i][0];
    y[i] = static_cast<float *>(params[1 + count + i]);
  }
  linears_few_rows(static_cast<const float *>(params[0]), shapes[0][0], shapes[0][1], count, w.data(), outs.data(),
                   y.data());
  return 0;
}

// Slots start .. start+s-1 of every (row, kv head) of a cache [rows, t, d] set to src [rows, s, d]; slots
// outside [0, t) are not written.
void msllm_kernels::write_slots(float *cache, const float *src, int64_t rows, int64_t s, int64_t t, int64_t d,
                                int64_t start) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < s; ++i)
      if (start + i >= 0 && start + i < t)
        std::memcpy(cache + (r * t + start + i) * d, src + (r * s + i) * d, sizeof(float) * d);
}

// The cache write of a cached forward: new_k = cache_k with slots start .. start+s-1 of every
// (row, kv head) replaced by k, the same for v. One copy of each cache instead of MindSpore's
// gather of the new keys into slot order and a select over the whole cache, per layer.
// inputs: k, v [b, h, s, d], cache_k, cache_v [b, h, t, d] (fp32), start [1] (int32);
// outputs: new_k, new_v [b, h, t, d].
extern "C" int CacheWrite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  const int64_t rows = shapes[0][0] * shapes[0][1], s = shapes[0][2], d = shapes[0][3], t = shapes[2][2];
  const int64_t start = *static_cast<const int32_t *>(params[4]);
  for (int which = 0; which < 2; ++which) {
    float *out = static_cast<float *>(params[5 + which]);
    std::memcpy(out, params[2 + which], sizeof(float) * rows * t * d);
    write_slots(out, static_cast<const float *>(params[which]), rows, s, t, d, start);
  }
  return 0;
}

// CacheWrite into the caches themselves (Parameters the op's signature marks as written): only the new
// slots move. inputs as CacheWrite's; output: [1], 0.
extern "C" int CacheWriteInPlace(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  const int64_t rows = shapes[0][0] * shapes[0][1], s = shapes[0][2], d = shapes[0][3], t = shapes[2][2];
  const int64_t start = *static_cast<const int32_t *>(params[4]);
  for (int which = 0; which < 2; ++which)
    write_slots(static_cast<float *>(params[2 + which]), static_cast<const float *>(params[which]), rows, s, t, d,
                start);
  *static_cast<float *>(params[5]) = 0.f;
  return 0;
}
