// Gated DeltaNet's depthwise causal conv with its SiLU (msllm.models.mixers.gated_deltanet.CausalConv), forward
// and backward, for the CPU. Per row b and channel c, with K taps and the K - 1 inputs before the row in
// `before` (a decode's window; zeros in training):
//   a[t, c] = sum_m w[c, K-1-m] in[t-m, c]   (m = 0 .. K-1; in[t-m] counts only if it is of t's sample)
//   y[t, c] = a sigmoid(a)                   (SiLU)
// where in[u] for u < 0 is before[u + K - 1] (taken as of the row's first sample). Given x as [b, s, n, d]
// (q's and k's heads) the output is also L2-normalised per head and written head-major, [b, n, s, d]:
//   out = y r,  r = 1 / sqrt(|y_head|^2 + eps)
// The graph form keeps K shifted copies of the input and each one's gradient (a padded scatter), the
// normalisation's and the head transpose's tensors; this saves only its inputs and recomputes a in backward:
//   dy = r (dout - out (out . dout)) per head (normalised outputs; dy = dout otherwise)
//   da = dy sigmoid(a) (1 + a (1 - sigmoid(a)))
//   d in[u, c] = sum_m da[u+m, c] w[c, K-1-m],  dw[c, K-1-m] = sum_t da[t, c] in[t-m, c]
// Both walk blocks of kBlock tokens, one per thread at a time; backward keeps a block's da (plus the
// K - 1 tokens after it) in a buffer and a partial dw per stripe of blocks (common.h run_stripes), summed
// at the end in stripe order.
#include "common.h"

using namespace msllm_kernels;

namespace {

constexpr int64_t kBlock = 64;
constexpr float kL2Eps = 1e-6f;  // msllm.models.mixers.gated_deltanet.L2_EPS

// The shapes both kernels read: x [b, s, c] or [b, s, n, d] (normalised heads), w [c, K], segments [b, s],
// before [b, K - 1, c].
struct Conv {
  const float *x, *before;
  const int32_t *segments;
  std::vector<float> taps;  // w transposed, [K, c]: tap j's channel weights contiguous
  int64_t b, s, c, k, heads, d;

  Conv(void **params, int *ndims, int64_t **shapes)
      : x(static_cast<const float *>(params[0])), before(static_cast<const float *>(params[3])),
        segments(static_cast<const int32_t *>(params[2])), b(shapes[0][0]), s(shapes[0][1]),
        c(shapes[1][0]), k(shapes[1][1]), heads(ndims[0] == 4 ? shapes[0][2] : 0), d(heads ? shapes[0][3] : 0) {
    const float *w = static_cast<const float *>(params[1]);
    taps.resize(k * c);
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t j = 0; j < k; ++j) taps[j * c + ch] = w[ch * k + j];
  }
  int64_t blocks() const { return (s + kBlock - 1) / kBlock; }
  // Row `row`'s input m tokens before t, or nullptr if that token is of another sample.
  const float *input(int64_t row, int64_t t, int64_t m) const {
    const int32_t *seg = segments + row * s;
    const int64_t u = t - m;
    if (u >= 0) return seg[u] == seg[t] ? x + (row * s + u) * c : nullptr;
    return seg[t] == seg[0] ? before + (row * (k - 1) + u + k - 1) * c : nullptr;
  }
  // a[t, :] of row `row` into pre [c].
  void preactivation(int64_t row, int64_t t, float *__restrict pre) const {
    const float *__restrict w = taps.data() + (k - 1) * c;
    const float *__restrict in = x + (row * s + t) * c;
    for (int64_t ch = 0; ch < c; ++ch) pre[ch] = w[ch] * in[ch];
    for (int64_t m = 1; m < k; ++m) {
      const float *__restrict src = input(row, t, m);
      if (!src) continue;
      const float *__restrict wm = taps.data() + (k - 1 - m) * c;
      for (int64_t ch = 0; ch < c; ++ch) pre[ch] += wm[ch] * src[ch];
    }
  }
  // Where token t's head h (channels h d ..) sits in the output: [b, n, s, d] or [b, s, c].
  int64_t at(int64_t row, int64_t t, int64_t h) const {
    return heads ? ((row * heads + h) * s + t) * d : (row * s + t) * c;
  }
  // 1 / sqrt(|y|^2 + eps) of one head's d values.
  float inverse_norm(const float *__restrict y) const {
    return 1.0f / std::sqrt(lane_dot<false>(y, y, nullptr, d) + kL2Eps);
  }
};

}  // namespace

// inputs: x [b, s, c] or [b, s, n, d], w [c, K], segments [b, s] (int32), before [b, K - 1, c];
// output: out [b, s, c] or [b, n, s, d]. fp32.
extern "C" int CausalConvSiLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  const Conv conv(params, ndims, shapes);
  float *out = static_cast<float *>(params[4]);
  std::vector<float> rows(pool().size() * conv.c);
  run_units(conv.b * conv.blocks(), [&](int64_t unit, int thread) {
    const int64_t row = unit / conv.blocks(), t0 = unit % conv.blocks() * kBlock;
    float *__restrict y = rows.data() + thread * conv.c;
    for (int64_t t = t0; t < std::min(conv.s, t0 + kBlock); ++t) {
      conv.preactivation(row, t, y);
      for (int64_t ch = 0; ch < conv.c; ++ch) y[ch] *= sigmoid(y[ch]);
      if (!conv.heads) {
        std::memcpy(out + conv.at(row, t, 0), y, sizeof(float) * conv.c);
        continue;
      }
      for (int64_t h = 0; h < conv.heads; ++h) {
        const float *__restrict yh = y + h * conv.d, r = conv.inverse_norm(yh);
        float *__restrict o = out + conv.at(row, t, h);
        for (int64_t i = 0; i < conv.d; ++i) o[i] = yh[i] * r;
      }
    }
  });
  return 0;
}

// inputs: x, w, segments, before, dout (as out); outputs: dx (as x), dw [c, K], d before [b, K - 1, c].
extern "C" int CausalConvSiLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  const Conv conv(params, ndims, shapes);
  const float *dout = static_cast<const float *>(params[4]);
  float *dx = static_cast<float *>(params[5]), *dw = static_cast<float *>(params[6]);
  float *d_before = static_cast<float *>(params[7]);
  const int64_t c = conv.c, k = conv.k, span = kBlock + k - 1;
  const int threads = pool().size();
  // per stripe: da, the SiLU's sigmoid(a) and output y of one token, dw's part
  std::vector<float> da_buffers(threads * span * c), gates(threads * 2 * c), dw_parts(threads * k * c, 0.0f);
  std::memset(d_before, 0, sizeof(float) * conv.b * (k - 1) * c);
  run_stripes(conv.b * conv.blocks(), threads, [&](int64_t unit, int stripe) {  // dw_parts: per stripe
    const int64_t row = unit / conv.blocks(), t0 = unit % conv.blocks() * kBlock;
    const int64_t t1 = std::min(conv.s, t0 + kBlock), end = std::min(conv.s, t1 + k - 1);
    float *da = da_buffers.data() + stripe * span * c, *dw_part = dw_parts.data() + stripe * k * c;
    float *__restrict sg = gates.data() + stripe * 2 * c, *__restrict y = sg + c;
    for (int64_t t = t0; t < end; ++t) {  // da of the block and of the K - 1 tokens that read it
      float *__restrict a = da + (t - t0) * c;
      conv.preactivation(row, t, a);
      // the sigmoids first, in a loop of their own (inside the per-head loops below they kept those scalar)
      for (int64_t ch = 0; ch < c; ++ch) {
        sg[ch] = sigmoid(a[ch]);
        y[ch] = a[ch] * sg[ch];
      }
      for (int64_t h = 0; h < std::max<int64_t>(1, conv.heads); ++h) {
        const int64_t width = conv.heads ? conv.d : c, first = h * width;
        const float *__restrict g = dout + conv.at(row, t, h);
        float r = 1.0f, dot = 0.0f;  // the normalisation's: out . dout = r^2 (y . dout)
        if (conv.heads) {
          r = 1.0f / std::sqrt(lane_dot<false>(y + first, y + first, nullptr, width) + kL2Eps);
          dot = lane_dot<false>(y + first, g, nullptr, width) * r * r;
        }
        for (int64_t i = 0; i < width; ++i) {
          const int64_t ch = first + i;
          a[ch] = r * (g[i] - y[ch] * dot) * sg[ch] * (1.0f + a[ch] * (1.0f - sg[ch]));
        }
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      const float *__restrict da_t = da + (t - t0) * c;
      float *__restrict dx_t = dx + (row * conv.s + t) * c;
      for (int64_t ch = 0; ch < c; ++ch) dx_t[ch] = 0.0f;
      for (int64_t m = 0; m < k; ++m) {
        const float *__restrict w = conv.taps.data() + (k - 1 - m) * c;
        const float *__restrict src = conv.input(row, t, m);
        if (src) {  // tap m of token t: its weight's gradient
          float *__restrict dwm = dw_part + (k - 1 - m) * c;
          for (int64_t ch = 0; ch < c; ++ch) dwm[ch] += da_t[ch] * src[ch];
        }
        if (t + m < end && conv.input(row, t + m, m)) {  // token t + m reads t through tap m
          const float *__restrict da_later = da + (t + m - t0) * c;
          for (int64_t ch = 0; ch < c; ++ch) dx_t[ch] += da_later[ch] * w[ch];
        }
      }
    }
    if (t0 > 0) return;
    for (int64_t i = 0; i < k - 1; ++i) {  // before[i] is token i - (K - 1), read by t = i - (K - 1) + m
      float *__restrict db = d_before + (row * (k - 1) + i) * c;
      for (int64_t m = k - 1 - i; m < k; ++m) {
        const int64_t t = i - (k - 1) + m;
        if (t >= end || !conv.input(row, t, m)) continue;
        const float *__restrict w = conv.taps.data() + (k - 1 - m) * c, *__restrict da_t = da + t * c;
        for (int64_t ch = 0; ch < c; ++ch) db[ch] += da_t[ch] * w[ch];
      }
    }
  });
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t j = 0; j < k; ++j) {
      float sum = 0.0f;
      for (int stripe = 0; stripe < threads; ++stripe) sum += dw_parts[(stripe * k + j) * c + ch];
      dw[ch * k + j] = sum;
    }
  return 0;
}
