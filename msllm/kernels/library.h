// The library's kernels as typed functions, for the kernels built from several of them (cached_attention.cc). Each
// extern "C" entry point unpacks MindSpore's parameter arrays into one of these calls; a composite kernel calls them
// directly instead of building parameter arrays for another entry point.
#pragma once
#include <cstdint>

namespace msllm_kernels {

// Whether a query of segment q_segment sees a key of segment k_segment: equal ids, or the query's is a branch of
// the key's (q <= -2, (-q - 2) / 2 == k: a DPO pair's completions both see their prompt, not each other).
inline bool sees(int32_t q_segment, int32_t k_segment) {
  return q_segment == k_segment || (q_segment <= -2 && (-q_segment - 2) / 2 == k_segment);
}

// Flash attention's index inputs, from params[first .. first + 3]: q_slot [s], q_seg [s] or [b, s], k_seg [t] or
// [b, t] (int32; 1-D: shared by the batch); window [1].
struct Visibility {
  const int32_t *q_slot, *q_seg, *k_seg;
  int64_t slot_rows, q_seg_rows, k_seg_rows, s, t;
  int32_t window;

  Visibility(void **params, int *ndims, int64_t **shapes, int first) {
    q_slot = static_cast<const int32_t *>(params[first]);
    q_seg = static_cast<const int32_t *>(params[first + 1]);
    k_seg = static_cast<const int32_t *>(params[first + 2]);
    window = *static_cast<const int32_t *>(params[first + 3]);
    auto rows = [&](int i) { return ndims[i] == 2 ? shapes[i][0] : int64_t{1}; };
    slot_rows = rows(first), q_seg_rows = rows(first + 1), k_seg_rows = rows(first + 2);
    s = shapes[first][ndims[first] - 1], t = shapes[first + 2][ndims[first + 2] - 1];
  }
  const int32_t *slots(int64_t batch) const { return q_slot + batch % slot_rows * s; }
  const int32_t *query_segments(int64_t batch) const { return q_seg + batch % q_seg_rows * s; }
  const int32_t *key_segments(int64_t batch) const { return k_seg + batch % k_seg_rows * t; }
  bool visible(int32_t slot, int32_t q_segment, int64_t j, int32_t k_segment) const {
    return j <= slot && (window == 0 || slot - j < window) && sees(q_segment, k_segment);
  }
};

// FlashAttention (flash_attention.cc): q [b, heads, s, d] (scaled), k [b, kv_heads, t, d], v [b, kv_heads, t,
// d_value], sinks [heads] or null -> out [b, heads, s, d_value], lse [b, heads, s].
void flash_attention(const float *q, const float *k, const float *v, const float *sinks, const Visibility &vis,
                     int64_t b, int64_t heads, int64_t kv_heads, int64_t d, int64_t d_value, float *out, float *lse);

// RopeHeads (cpu_kernels.cc): x [b * s, n * h] -> y [b, n, s, h], each head's first d features rotated by the
// cos / sin rows of its position (table_rows: s, one table for the batch, or b * s).
void rope_heads(const float *x, const float *cos, const float *sin, float *y, int64_t b, int64_t s, int64_t n,
                int64_t h, int64_t d, int64_t table_rows);

// RMSNorm: y = x / rms(x) * (offset + w) per row of h.
void rms_norm(const float *x, const float *w, float eps, float offset, float *y, int64_t rows, int64_t h);

// SwiGLU: h = silu(gate) * up, n elements.
void swiglu(const float *gate, const float *up, float *h, int64_t n);

// CacheWriteInPlace's copy: slots start .. start + s - 1 of each of `rows` caches [t, d] set from src [rows, s, d];
// slots outside [0, t) are not written.
void write_slots(float *cache, const float *src, int64_t rows, int64_t s, int64_t t, int64_t d, int64_t start);

// LinearsFewRows: y_i [m, outs[i]] = x [m, k] w_i^T for `count` weights w_i [outs[i], k].
void linears_few_rows(const float *x, int64_t m, int64_t k, int count, const float *const *w, const int64_t *outs,
                      float *const *y);

}  // namespace msllm_kernels
