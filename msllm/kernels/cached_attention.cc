// A cached forward's kernels (inference, fp32). CachedAttention: the attention of the q, k, v projections in one
// kernel: RoPE of q and k into heads, q's scale, v into heads, the new keys and values written into the caches in
// place, then flash attention over the caches, each part by the function behind the library's RopeHeads,
// CacheWriteInPlace and FlashAttention (library.h): one launch instead of five, as MindSpore's CPU runtime costs more
// per kernel launched than a decode step's rope and write take. CacheTables: the rope tables and visibility every
// layer reads, in one; AddRMSNorm: a residual add and the norm of the sum; SwiGLULinear: a gated MLP's activation
// and down projection.
#include <vector>

#include "common.h"
#include "library.h"

using namespace msllm_kernels;

// inputs: q [b*s, heads*h], k, v [b*s, kv_heads*h], cos, sin [s, d] or [b, 1, s, d] (d <= h: partial RoPE),
// cache_k, cache_v [b, kv_heads, t, h] (written at slots start .. start+s-1), start [1], q_slot, q_seg, k_seg,
// window (FlashAttention's visibility, int32), scale [1] (fp32); outputs: out [b, heads, s, h], lse [b, heads, s].
extern "C" int CachedAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  const int64_t b = shapes[13][0], heads = shapes[13][1], s = shapes[13][2], h = shapes[13][3];
  const int64_t kv_heads = shapes[5][1], t = shapes[5][2], d = shapes[3][ndims[3] - 1];
  const int64_t table_rows = numel(ndims[3], shapes[3]) / d;  // s, or b * s
  // the heads of q, k and v, kept between calls (a decode step's are a few KB)
  thread_local std::vector<float> q_heads, k_heads, v_heads;
  q_heads.resize(b * heads * s * h), k_heads.resize(b * kv_heads * s * h), v_heads.resize(b * kv_heads * s * h);
  const float *cos = static_cast<const float *>(params[3]), *sin = static_cast<const float *>(params[4]);
  rope_heads(static_cast<const float *>(params[0]), cos, sin, q_heads.data(), b, s, heads, h, d, table_rows);
  rope_heads(static_cast<const float *>(params[1]), cos, sin, k_heads.data(), b, s, kv_heads, h, d, table_rows);
  const float scale = *static_cast<const float *>(params[12]);
  for (float &x : q_heads) x *= scale;
  const float *v = static_cast<const float *>(params[2]);  // [b, s, kv_heads, h] -> [b, kv_heads, s, h]
  for (int64_t row = 0; row < b; ++row)
    for (int64_t head = 0; head < kv_heads; ++head)
      for (int64_t pos = 0; pos < s; ++pos)
        std::memcpy(&v_heads[((row * kv_heads + head) * s + pos) * h], v + ((row * s + pos) * kv_heads + head) * h,
                    sizeof(float) * h);
  float *cache_k = static_cast<float *>(params[5]), *cache_v = static_cast<float *>(params[6]);
  const int64_t start = *static_cast<const int32_t *>(params[7]);
  write_slots(cache_k, k_heads.data(), b * kv_heads, s, t, h, start);
  write_slots(cache_v, v_heads.data(), b * kv_heads, s, t, h, start);
  flash_attention(q_heads.data(), cache_k, cache_v, nullptr, Visibility(params, ndims, shapes, 8), b, heads, kv_heads,
                  h, shapes[6][3], static_cast<float *>(params[13]), static_cast<float *>(params[14]));
  return 0;
}

// layers.CacheTables of a full cache (first 0) in one kernel, for b rows of s new tokens at slots start .. over t
// keys: cos / sin of each row's positions max(slot - pad, 0) (angle position * inv_freq in fp32, as HF), the new
// tokens' slots, and each key's segment, 0 once the row's padding is past, -1 before. Eleven kernels of MindSpore
// (the positions' subtract and max, the angles' cast, multiply and concat, cos, sin, the segments' compare and
// select) in one. inputs: start [1], pad [b] (int32), inv_freq [d / 2] (fp32), query segments [s] and key slots
// [t] (int32, read for their lengths); outputs: cos, sin [b, 1, s, d] (fp32), slots [s], key segments [b, t].
extern "C" int CacheTables(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  const int32_t start = *static_cast<const int32_t *>(params[0]);
  const int32_t *pad = static_cast<const int32_t *>(params[1]);
  const float *inv_freq = static_cast<const float *>(params[2]);
  const int64_t b = shapes[1][0], half = shapes[2][0], d = 2 * half, s = shapes[3][0], t = shapes[4][0];
  float *cos = static_cast<float *>(params[5]), *sin = static_cast<float *>(params[6]);
  int32_t *slots = static_cast<int32_t *>(params[7]), *key_segments = static_cast<int32_t *>(params[8]);
  for (int64_t i = 0; i < s; ++i) slots[i] = start + static_cast<int32_t>(i);
  for (int64_t row = 0; row < b; ++row) {
    for (int64_t i = 0; i < s; ++i) {
      const float position = static_cast<float>(std::max(start + static_cast<int32_t>(i) - pad[row], 0));
      float *c = cos + (row * s + i) * d, *sn = sin + (row * s + i) * d;
      for (int64_t j = 0; j < half; ++j) {
        const float angle = position * inv_freq[j];
        c[j] = c[j + half] = std::cos(angle);
        sn[j] = sn[j + half] = std::sin(angle);
      }
    }
    for (int64_t j = 0; j < t; ++j) key_segments[row * t + j] = j >= pad[row] ? 0 : -1;
  }
  return 0;
}

// layers.ResidualNorm with an RMSNorm: sum = x + delta, then the library's RMSNorm of it, in one launch instead of
// an Add and the norm's. inputs: x, delta [N, H], w [H], (eps, offset) [2] (fp32); outputs: sum, y [N, H].
extern "C" int AddRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  const float *x = static_cast<const float *>(params[0]), *delta = static_cast<const float *>(params[1]);
  const float *eps_offset = static_cast<const float *>(params[3]);
  float *sum = static_cast<float *>(params[4]);
  const int64_t n = numel(ndims[0], shapes[0]), h = shapes[0][ndims[0] - 1];
  for (int64_t i = 0; i < n; ++i) sum[i] = x[i] + delta[i];
  rms_norm(sum, static_cast<const float *>(params[2]), eps_offset[0], eps_offset[1], static_cast<float *>(params[5]),
           n / h, h);
  return 0;
}

// layers.ActivatedLinear of a decode step's few rows with SwiGLU: the library's SwiGLU, then its LinearsFewRows of
// the result, in one launch instead of two. inputs: gate, up [m, f], w [n, f] (fp32); output: y [m, n].
extern "C" int SwiGLULinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  const int64_t m = shapes[0][0], f = shapes[0][1];
  thread_local std::vector<float> activated;  // [m, f], kept between calls
  activated.resize(m * f);
  swiglu(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), activated.data(), m * f);
  const float *w = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  linears_few_rows(activated.data(), m, f, 1, &w, &shapes[2][0], &y);
  return 0;
}
