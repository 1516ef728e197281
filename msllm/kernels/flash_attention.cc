// Flash attention for the CPU: out = softmax(q k^T, over the visible keys) v, forward and backward,
// without any [s, t] score, probability or mask tensor. Keys are visited in blocks with an online
// softmax (running row max and sum); forward keeps only each row's log-sum-exp, and backward
// recomputes the probabilities block by block from it (Dao et al., FlashAttention 1 and 2).
//
// Which keys a query sees is computed from indices, not read from a mask:
//   key slot j is visible from query row i  iff  j <= slot[i]                     (causal)
//                                          and  slot[i] - j < window (window > 0)  (sliding window)
//                                          and  sees(q_seg[i], k_seg[j])           (same sample)
// sees: the segments are equal, or the query's is a branch of the key's (q <= -2, (-q - 2) / 2 == k:
// a DPO pair's chosen and rejected completions both see their shared prompt, not each other;
// msllm.models.layers.visibility). Ids >= -1 match only when equal.
// slot[i] is the query's cache slot (i in training, start + i in a cached forward), k_seg marks
// packed samples and left padding (-1). A row that sees no key gets out 0 and lse +inf (its
// probabilities are 0 in backward). Keys after the last query's slot are never read, so a decode
// step reads only the filled part of a static cache.
// GQA: query head h reads KV head h / (heads / kv_heads); K and V are never repeated.
//
// Sinks (gpt-oss; the *Sinks entry points): a learned logit per query head joins every row's softmax
// with no value. Each row's online softmax starts from it (running max = sink, running sum = 1), so
// out and lse include its share, and a row that sees no key gets out 0, lse = sink. Backward then
// recomputes sink-inclusive probabilities from lse, which is all dq, dk, dv need (the sink adds no dP
// term: delta = rowsum(dO * O) is unchanged); the sink's own gradient is
// d sink_h = -sum over head h's rows of exp(sink_h - lse) * delta. Without sinks the rows start empty.
// V's head size d_value may differ from q / k's d (MLA: nope + rope features score, v_head_dim are read).
#include <limits>

#include "common.h"
#include "library.h"

using namespace msllm_kernels;

namespace {

constexpr int64_t kQueryBlock = 48;  // query rows per work unit (a multiple of accumulate's 3 or 6 outputs)
constexpr int64_t kKeyBlock = 64;    // keys per block (a [kKeyBlock, d] slice of K and V stays in L1/L2)
constexpr float kInf = std::numeric_limits<float>::infinity();

// Min and max of a range of ints.
struct Range {
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
  Range(const int32_t *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  }
};

enum class Cover { kNone, kSome, kAll };

// Whether no query segment of the range q sees a key segment of the range k: no id in both, and
// no branch among the queries whose prompt's id is among the keys' (a branch's prompt id falls as
// its own rises: the branches q.lo .. min(q.hi, -2) have prompts (-min(q.hi, -2) - 2) / 2 .. (-q.lo - 2) / 2).
bool unseen(const Range &q, const Range &k) {
  if (q.lo <= k.hi && k.lo <= q.hi) return false;
  if (q.lo > -2) return true;
  const int32_t first = (-std::min(q.hi, -2) - 2) / 2, last = (-q.lo - 2) / 2;
  return last < k.lo || first > k.hi;
}

// Whether queries (slots, segments) see none, some or all of keys j0 .. j0+n-1 (segments).
Cover cover(const Range &slot, const Range &q_seg, int64_t j0, int64_t n, const Range &k_seg, int32_t window) {
  const int64_t j_last = j0 + n - 1;
  if (j0 > slot.hi || (window && slot.lo - j_last >= window) || unseen(q_seg, k_seg)) return Cover::kNone;
  if (j_last <= slot.lo && (!window || slot.hi - j0 < window) && q_seg.lo == q_seg.hi && k_seg.lo == k_seg.hi &&
      sees(q_seg.lo, k_seg.lo))
    return Cover::kAll;
  return Cover::kSome;
}

// Block of keys transposed to [d][kKeyBlock] (zeros past n), so a query row's scores are an
// axpy over d of contiguous, vectorizable kKeyBlock-wide rows.
void transpose_block(const float *x, int64_t n, int64_t d, float *xt, float scale = 1.f) {
  for (int64_t c = 0; c < d; ++c) {
    float *row = xt + c * kKeyBlock;
    for (int64_t j = 0; j < n; ++j) row[j] = x[j * d + c] * scale;
    for (int64_t j = n; j < kKeyBlock; ++j) row[j] = 0.f;
  }
}

// The small matmuls' register block: kRows outputs x V vectors of accumulators, the vector width
// the build targets (16-float vectors on an AVX2 build spill to the stack). AVX-512 has 32 zmm:
// 6 x 4 (64 columns; 24 accumulators, 4 x vectors and a broadcast) where the width allows, else 6 x 2.
// AVX2 has 16 ymm: 6 x 2 (16 columns; 12 + 2 + 1), as sgemm's micro-kernel.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kRows = 6, kWideVectors = 4, kNarrowVectors = 2;
#else
constexpr int kLanes = 8, kRows = 6, kWideVectors = 2, kNarrowVectors = 2;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes)));  // GCC vector extension: one register
inline vec load(const float *p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float *p, vec v) { std::memcpy(p, &v, sizeof v); }


// K outputs of a small matmul on a V-vector slice: y[k][c] (=|+=) sum_i w[k * w_out + i * w_in] x[i][c],
// c < V * kLanes, i < n (x rows x_stride apart, y rows y_stride apart). The K x V accumulators stay in
// registers and each x load serves K outputs: without the blocking these loops were bound by loads
// and stores, not arithmetic. kAdd false overwrites y (no zero-fill and reload). The x vectors are loaded
// before the broadcasts and every loop is unrolled: otherwise GCC spills accumulators to the stack or reloads
// x for each FMA, which ran the AVX2 block at ~75 % of an FMA's peak instead of ~97 %.
template <int K, int V, bool kAdd>
inline void accumulate_block(const float *__restrict w, int64_t w_out, int64_t w_in, const float *__restrict x,
                             int64_t x_stride, int64_t n, float *__restrict y, int64_t y_stride) {
  vec acc[K][V];
#pragma GCC unroll 6
  for (int k = 0; k < K; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[k][v] = kAdd ? load(y + k * y_stride + kLanes * v) : vec{};
  for (int64_t i = 0; i < n; ++i) {
    vec xv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) xv[v] = load(x + i * x_stride + kLanes * v);
#pragma GCC unroll 6
    for (int k = 0; k < K; ++k) {
      const float wk = w[k * w_out + i * w_in];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[k][v] += wk * xv[v];
    }
  }
#pragma GCC unroll 6
  for (int k = 0; k < K; ++k)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) store(y + k * y_stride + kLanes * v, acc[k][v]);
}

// The last rows < kRows of accumulate_columns in one block (key blocks of 64 leave 4 at kRows 6).
template <int V, bool kAdd, int K = kRows - 1>
inline void accumulate_tail(int64_t rows, const float *w, int64_t w_out, int64_t w_in, const float *x,
                            int64_t x_stride, int64_t n, float *y, int64_t y_stride) {
  if constexpr (K > 0) {
    if (rows == K) return accumulate_block<K, V, kAdd>(w, w_out, w_in, x, x_stride, n, y, y_stride);
    accumulate_tail<V, kAdd, K - 1>(rows, w, w_out, w_in, x, x_stride, n, y, y_stride);
  }
}

template <int V, bool kAdd>
void accumulate_columns(const float *w, int64_t w_out, int64_t w_in, const float *x, int64_t n, int64_t width,
                        float *y, int64_t y_stride, int64_t outs) {
  for (int64_t c = 0; c < width; c += V * kLanes) {
    int64_t k = 0;
    for (; k + kRows <= outs; k += kRows)
      accumulate_block<kRows, V, kAdd>(w + k * w_out, w_out, w_in, x + c, width, n, y + k * y_stride + c, y_stride);
    accumulate_tail<V, kAdd>(outs - k, w + k * w_out, w_out, w_in, x + c, width, n, y + k * y_stride + c, y_stride);
  }
}

// y [outs, width] (=|+=) w-weighted sums of x [n, width] rows (as accumulate_block), in register blocks
// when width is a multiple of 32 (head sizes 32, 64, 128, 256, and the key block), else plainly.
template <bool kAdd = true>
void accumulate(const float *w, int64_t w_out, int64_t w_in, const float *x, int64_t n, int64_t width, float *y,
                int64_t y_stride, int64_t outs) {
  if (width % (kWideVectors * kLanes) == 0)
    return accumulate_columns<kWideVectors, kAdd>(w, w_out, w_in, x, n, width, y, y_stride, outs);
  if (width % (kNarrowVectors * kLanes) == 0)
    return accumulate_columns<kNarrowVectors, kAdd>(w, w_out, w_in, x, n, width, y, y_stride, outs);
  for (int64_t k = 0; k < outs; ++k) {
    if (!kAdd) std::fill(y + k * y_stride, y + k * y_stride + width, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float wk = w[k * w_out + i * w_in];
      for (int64_t c = 0; c < width; ++c) y[k * y_stride + c] += wk * x[i * width + c];
    }
  }
}

// Scores of hidden keys to -inf: keys n.. of a short last block, and (vis given) those the query
// (slot, segment) cannot see among keys j0 .. j0+n-1 (their segments k_seg).
inline void hide(float *scores, int64_t n, const Visibility *vis, int32_t slot, int32_t q_seg, int64_t j0,
                 const int32_t *k_seg) {
  if (vis)
    for (int64_t j = 0; j < n; ++j)
      if (!vis->visible(slot, q_seg, j0 + j, k_seg[j])) scores[j] = -kInf;
  for (int64_t j = n; j < kKeyBlock; ++j) scores[j] = -kInf;
}

// max of a block's kKeyBlock scores, a vector at a time.
inline float max_of_block(const float *x) {
  vec top = load(x);
  for (int64_t j = kLanes; j < kKeyBlock; j += kLanes) {
    const vec v = load(x + j);
    top = top > v ? top : v;
  }
  float m = top[0];
  for (int k = 1; k < kLanes; ++k) m = std::max(m, top[k]);
  return m;
}

typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));

// Scores are kept in base 2 (K scaled by log2(e) as it is transposed), so the softmax's exp is a
// 2^x: no range reduction by ln 2, and a degree-5 polynomial on [-1/2, 1/2] (fitted for relative
// error: at most 2.3e-7 in float) where exp_approx needs degree 7.
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
// How far (log2 units) a forward row's scores may pass the shift of its exps before it is moved.
constexpr float kStaleShift = 8.f;

// 2^x for x < 128 (x <= -127, -inf included, gives exactly 0: 2^n's exponent bits are then 0).
inline vec exp2_vec(vec x) {
  const vec lo = vec{} - 127.0f, shifter = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < lo ? lo : x;  // written so that NaN passes through
  const vec n = (x + shifter) - shifter, r = x - n;
  vec p = vec{} + 1.3274837e-3f;
  p = p * r + 9.6755270e-3f;
  p = p * r + 5.5507183e-2f;
  p = p * r + 2.4022120e-1f;
  p = p * r + 6.9314694e-1f;
  p = p * r + 1.0000001f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x[j] = 2^(x[j] - shift) (0 for -inf) over a block; returns their sum (by lanes, then across).
inline float exp2_block(float *x, float shift) {
  vec sum = vec{};
  for (int64_t j = 0; j < kKeyBlock; j += kLanes) {
    const vec e = exp2_vec(load(x + j) - shift);
    store(x + j, e);
    sum += e;
  }
  float total = 0.f;
  for (int k = 0; k < kLanes; ++k) total += sum[k];
  return total;
}

// scores [rows, kKeyBlock] = q [rows, d] @ kt [d, kKeyBlock] (overwritten).
void block_scores(const float *q, int64_t rows, const float *kt, int64_t d, float *scores) {
  accumulate<false>(q, d, 1, kt, d, kKeyBlock, scores, kKeyBlock, rows);
}

template <int D>
void forward(const float *q, const float *k, const float *v, const float *sinks, const Visibility &vis, int64_t b,
             int64_t heads, int64_t kv_heads, int64_t d, int64_t d_value, float *out, float *lse) {
  const int64_t s = vis.s, t = vis.t, rep = heads / kv_heads;
  const int64_t query_blocks = (s + kQueryBlock - 1) / kQueryBlock;
  // K transposed once, block by block ([b * kv_heads][key_blocks][d][kKeyBlock]), not once per query block.
  const int64_t key_blocks = (t + kKeyBlock - 1) / kKeyBlock, block_size = d * kKeyBlock;
  std::vector<float> k_t(b * kv_heads * key_blocks * block_size);
  parallel_for(b * kv_heads * key_blocks, [&](int64_t lo, int64_t hi, int) {
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t j0 = u % key_blocks * kKeyBlock;
      transpose_block(k + (u / key_blocks * t + j0) * d, std::min(kKeyBlock, t - j0), d, k_t.data() + u * block_size,
                      kLog2e);
    }
  }, 16);
  run_units(b * heads * query_blocks, [&](int64_t unit, int) {
    // Later query blocks see more keys under a causal mask: hand them out first.
    const int64_t qb = query_blocks - 1 - unit % query_blocks, bh = unit / query_blocks;
    const int64_t batch = bh / heads, head = bh % heads, kv = batch * kv_heads + head / rep;
    const int64_t i0 = qb * kQueryBlock, rows = std::min(kQueryBlock, s - i0);
    const float *qb_rows = q + (bh * s + i0) * d, *vh = v + kv * t * d_value;
    const int32_t *slot = vis.slots(batch) + i0, *q_seg = vis.query_segments(batch) + i0;
    const int32_t *k_seg = vis.key_segments(batch);
    const Range slots(slot, rows), q_segs(q_seg, rows);
    std::vector<float> scores(kQueryBlock * kKeyBlock), acc(rows * d_value, 0.f);
    // Every row starts with the head's sink (2^(sink - sink) = 1 in the sum, no value), or empty (-inf).
    const float sink = sinks ? sinks[head] * kLog2e : -kInf;
    std::vector<float> row_max(rows, sink), row_sum(rows, sink == -kInf ? 0.f : 1.f);
    const int64_t j_end = std::min<int64_t>(t, int64_t{slots.hi} + 1);
    const int64_t j_begin = vis.window ? std::max<int64_t>(0, int64_t{slots.lo} - vis.window + 1) / kKeyBlock * kKeyBlock : 0;
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, j_end - j0);
      const Cover seen = cover(slots, q_segs, j0, n, Range(k_seg + j0, n), vis.window);
      if (seen == Cover::kNone) continue;
      block_scores(qb_rows, rows, k_t.data() + (kv * key_blocks + j0 / kKeyBlock) * block_size, d, scores.data());
      for (int64_t r = 0; r < rows; ++r) {
        float *sr = scores.data() + r * kKeyBlock;
        hide(sr, n, seen == Cover::kSome ? &vis : nullptr, slot[r], q_seg[r], j0, k_seg + j0);
        // The shift moves only when a block's max passes it by more than kStaleShift, so most blocks
        // skip rescaling the row (terms up to 2^kStaleShift are summed; fp32 keeps them exact enough).
        const float block_max = max_of_block(sr);
        if (block_max > row_max[r] + kStaleShift) {
          if (row_max[r] != -kInf) {
            const float rescale = exp_approx((row_max[r] - block_max) * kLn2);
            row_sum[r] *= rescale;
            for (float *ar = acc.data() + r * d_value, *end = ar + d_value; ar < end; ++ar) *ar *= rescale;
          }
          row_max[r] = block_max;
        }
        if (row_max[r] == -kInf) {  // nothing visible to this row yet
          std::fill(sr, sr + kKeyBlock, 0.f);
          continue;
        }
        row_sum[r] += exp2_block(sr, row_max[r]);
      }
      accumulate(scores.data(), kKeyBlock, 1, vh + j0 * d_value, n, d_value, acc.data(), d_value, rows);  // acc += PV
    }
    for (int64_t r = 0; r < rows; ++r) {
      float *o = out + (bh * s + i0 + r) * d_value;
      const float *ar = acc.data() + r * d_value;
      const bool any = row_sum[r] > 0.f;
      const float inv = any ? 1.f / row_sum[r] : 0.f;
      for (int64_t c = 0; c < d_value; ++c) o[c] = ar[c] * inv;
      lse[bh * s + i0 + r] = any ? (row_max[r] + std::log2(row_sum[r])) * kLn2 : kInf;
    }
  });
}

// The dots of q with 8 keys (rows of k, d apart; d a multiple of 8): 8 independent accumulators, each
// q load serving the 8 keys, then summed across lanes together by lane_sums (a dot at a
// time ends in a serial sum of its lanes and one accumulator's chain of FMAs).
inline Floats8 dots8(const float *__restrict q, const float *__restrict k, int64_t d) {
  Floats8 acc[8] = {};
  for (int64_t c = 0; c < d; c += 8) {
    const Floats8 qc = load8(q + c);
    for (int j = 0; j < 8; ++j) acc[j] += qc * load8(k + j * d + c);
  }
  return lane_sums(acc);
}

// o [width] = sum_j p[j] v[j] over n rows of v (width apart), width a multiple of 64: 64 columns at a time in
// 8 independent accumulators (accumulate's blocks for one output row are 4 vectors wide: FMA-latency bound).
inline void weighted_rows(const float *__restrict p, const float *__restrict v, int64_t n, int64_t width,
                          float *__restrict o) {
  for (int64_t c = 0; c < width; c += 64) {
    Floats8 acc[8] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j];
      for (int u = 0; u < 8; ++u) acc[u] += pj * load8(v + j * width + c + 8 * u);
    }
    for (int u = 0; u < 8; ++u) store8(o + c + 8 * u, acc[u]);
  }
}

// One query row per (row, head): a decode step. Its scores are plain dots with each visible key
// (K read once, in place), so nothing is transposed; forward's key blocks would transpose every key
// of the cache, filled or not, for a single row. Each pass over a row's keys is a vector loop: the dots,
// their max (lane_max), the 2^x of base-2 scores (exp2_vec: hidden keys give exactly 0) and P V in
// register blocks straight into the output row. The same out and lse as forward.
void forward_one_query(const float *q, const float *k, const float *v, const float *sinks, const Visibility &vis,
                       int64_t b, int64_t heads, int64_t kv_heads, int64_t d, int64_t d_value, float *out, float *lse) {
  const int64_t t = vis.t, rep = heads / kv_heads;
  // one scores row per thread, whole vectors long (the tail past a row's keys -inf: 2^-inf adds 0)
  const int64_t width = (t + kLanes - 1) / kLanes * kLanes;
  std::vector<float> scores_of(pool().size() * width);
  run_units(b * heads, [&](int64_t unit, int thread) {
    const int64_t batch = unit / heads, head = unit % heads, kv = batch * kv_heads + head / rep;
    const int32_t slot = vis.slots(batch)[0], q_seg = vis.query_segments(batch)[0];
    const int32_t *k_seg = vis.key_segments(batch);
    const int64_t j_end = std::min<int64_t>(t, int64_t{slot} + 1);
    const int64_t j_begin = vis.window ? std::max<int64_t>(0, int64_t{slot} - vis.window + 1) : 0;
    const int64_t n = std::max<int64_t>(0, j_end - j_begin), n_vectors = (n + kLanes - 1) / kLanes * kLanes;
    const float *qr = q + unit * d, *kh = k + (kv * t + j_begin) * d, *vh = v + (kv * t + j_begin) * d_value;
    float *scores = scores_of.data() + thread * width, *o = out + unit * d_value;
    int64_t j = 0;
    if (d % 8 == 0)
      for (; j + 8 <= n; j += 8) store8(scores + j, dots8(qr, kh + j * d, d) * kLog2e);
    for (; j < n; ++j) scores[j] = lane_dot<false>(qr, kh + j * d, nullptr, d) * kLog2e;
    for (j = 0; j < n; ++j)
      if (!vis.visible(slot, q_seg, j_begin + j, k_seg[j_begin + j])) scores[j] = -kInf;
    std::fill(scores + n, scores + n_vectors, -kInf);
    const float sink = sinks ? sinks[head] * kLog2e : -kInf, top = lane_max(scores, n, sink);
    if (top == -kInf) {  // no visible key and no sink
      std::fill(o, o + d_value, 0.f);
      lse[unit] = kInf;
      return;
    }
    vec sums = vec{};
    for (int64_t j = 0; j < n_vectors; j += kLanes) {
      const vec e = exp2_vec(load(scores + j) - top);
      store(scores + j, e);
      sums += e;
    }
    float sum = sinks ? std::exp2(sink - top) : 0.f;
    for (int l = 0; l < kLanes; ++l) sum += sums[l];
    if (d_value % 64 == 0)  // o = P V
      weighted_rows(scores, vh, n, d_value, o);
    else
      accumulate<false>(scores, 0, 1, vh, n, d_value, o, d_value, 1);
    const float inv = 1.f / sum;
    for (int64_t c = 0; c < d_value; ++c) o[c] *= inv;
    lse[unit] = (top + std::log2(sum)) * kLn2;
  });
}

// Gradients for one block of keys at a time (its dk, dv owned by one thread), every query that
// can see it; dq rows are summed in one buffer per thread, then added up.
template <int D>
void backward(const float *q, const float *k, const float *v, const float *sinks, const float *out, const float *lse,
              const float *d_out, const Visibility &vis, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
              int64_t d_value, float *dq, float *dk, float *dv, float *d_sinks) {
  const int64_t s = vis.s, t = vis.t, rep = heads / kv_heads;
  const int64_t q_size = b * heads * s * d;
  std::vector<float> delta(b * heads * s);  // rowsum(dO * O) = rowsum(dP * P)
  parallel_for(b * heads * s, [&](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row)
      delta[row] = lane_dot<false>(d_out + row * d_value, out + row * d_value, nullptr, d_value);
  }, std::max<int64_t>(1, (1 << 14) / d_value));
  if (sinks) {  // d sink_h = -sum of P_sink * delta over head h's rows (every batch), P_sink = exp(sink_h - lse)
    parallel_for(heads, [&](int64_t lo, int64_t hi, int) {
      for (int64_t h = lo; h < hi; ++h) {
        double total = 0;
        for (int64_t batch = 0; batch < b; ++batch)
          for (int64_t row = (batch * heads + h) * s, end = row + s; row < end; ++row)
            total += std::exp(double{sinks[h]} - lse[row]) * delta[row];
        d_sinks[h] = static_cast<float>(-total);
      }
    }, 1);
  }
  const int threads = pool().size();
  std::vector<std::vector<float>> dq_partial(threads - 1);
  std::fill(dq, dq + q_size, 0.f);
  const int64_t key_blocks = (t + kKeyBlock - 1) / kKeyBlock;
  run_units(b * kv_heads * key_blocks, [&](int64_t unit, int thread) {
    float *dq_rows = dq;
    if (thread > 0) {
      auto &mine = dq_partial[thread - 1];
      if (mine.empty()) mine.assign(q_size, 0.f);
      dq_rows = mine.data();
    }
    const int64_t kb = unit / (b * kv_heads), bk = unit % (b * kv_heads), batch = bk / kv_heads;
    const int64_t j0 = kb * kKeyBlock, n = std::min(kKeyBlock, t - j0);
    const float *kh = k + (bk * t + j0) * d, *vh = v + (bk * t + j0) * d_value;
    const int32_t *k_seg = vis.key_segments(batch) + j0;
    const Range k_segs(k_seg, n);
    std::vector<float> kt(d * kKeyBlock), vt(d_value * kKeyBlock);
    // P, dP and dS of one query block's rows against this key block
    std::vector<float> p(kQueryBlock * kKeyBlock), dp(kQueryBlock * kKeyBlock), ds(kQueryBlock * kKeyBlock);
    std::vector<float> dk_acc(n * d, 0.f), dv_acc(n * d_value, 0.f);
    transpose_block(kh, n, d, kt.data(), kLog2e);
    transpose_block(vh, n, d_value, vt.data());
    const int32_t *slot_all = vis.slots(batch), *q_seg_all = vis.query_segments(batch);
    for (int64_t i0 = 0; i0 < s; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, s - i0);
      const int32_t *slot = slot_all + i0, *q_seg = q_seg_all + i0;
      const Cover seen = cover(Range(slot, rows), Range(q_seg, rows), j0, n, k_segs, vis.window);
      if (seen == Cover::kNone) continue;
      for (int64_t h = (bk % kv_heads) * rep, h_end = h + rep; h < h_end; ++h) {
        const int64_t first = (batch * heads + h) * s + i0;  // the block's first row of q, out, lse
        // P and dS = P * (dP - delta) of the block's rows against the key block (0 where hidden).
        block_scores(q + first * d, rows, kt.data(), d, p.data());
        block_scores(d_out + first * d_value, rows, vt.data(), d_value, dp.data());
        for (int64_t r = 0; r < rows; ++r) {
          float *pr = p.data() + r * kKeyBlock, *dpr = dp.data() + r * kKeyBlock, *dsr = ds.data() + r * kKeyBlock;
          const float row_lse = lse[first + r], row_delta = delta[first + r];
          if (row_lse == kInf) {  // the row sees no key: its P is 0
            std::fill(pr, pr + kKeyBlock, 0.f);
            std::fill(dsr, dsr + kKeyBlock, 0.f);
            continue;
          }
          hide(pr, n, seen == Cover::kSome ? &vis : nullptr, slot[r], q_seg[r], j0, k_seg);
          exp2_block(pr, row_lse * kLog2e);
          for (int64_t j = 0; j < kKeyBlock; ++j) dsr[j] = pr[j] * (dpr[j] - row_delta);
        }
        // dV += P^T dO
        accumulate(p.data(), 1, kKeyBlock, d_out + first * d_value, rows, d_value, dv_acc.data(), d_value, n);
        accumulate(ds.data(), 1, kKeyBlock, q + first * d, rows, d, dk_acc.data(), d, n);     // dK += dS^T Q
        accumulate(ds.data(), kKeyBlock, 1, kh, n, d, dq_rows + first * d, d, rows);          // dQ += dS K
      }
    }
    std::memcpy(dk + (bk * t + j0) * d, dk_acc.data(), sizeof(float) * n * d);
    std::memcpy(dv + (bk * t + j0) * d_value, dv_acc.data(), sizeof(float) * n * d_value);
  });
  for (auto &partial : dq_partial) {
    if (partial.empty()) continue;
    parallel_for(q_size, [&](int64_t lo, int64_t hi, int) {
      for (int64_t i = lo; i < hi; ++i) dq[i] += partial[i];
    });
  }
}

// The head sizes compiled with a fixed inner loop length; others take the generic loop.
template <typename Fn>
void by_head_size(int64_t d, Fn fn) {
  switch (d) {
    case 64: fn(std::integral_constant<int, 64>()); break;
    case 128: fn(std::integral_constant<int, 128>()); break;
    case 256: fn(std::integral_constant<int, 256>()); break;
    default: fn(std::integral_constant<int, 0>());
  }
}

// The entry points' bodies. With sinks, sinks [heads] (fp32) is input 7 and every later param moves one on.
int attention_forward(void **params, int *ndims, int64_t **shapes, bool with_sinks) {
  const Visibility vis(params, ndims, shapes, 3);
  const int64_t b = shapes[0][0], heads = shapes[0][1], d = shapes[0][3], kv_heads = shapes[1][1];
  const int64_t d_value = shapes[2][3];  // V's head size (MLA: smaller than q/k's)
  const float *sinks = with_sinks ? static_cast<const float *>(params[7]) : nullptr;
  auto in = [&](int i) { return static_cast<const float *>(params[i]); };
  auto result = [&](int i) { return static_cast<float *>(params[i + with_sinks]); };
  flash_attention(in(0), in(1), in(2), sinks, vis, b, heads, kv_heads, d, d_value, result(7), result(8));
  return 0;
}

int attention_backward(void **params, int *ndims, int64_t **shapes, bool with_sinks) {
  const Visibility vis(params, ndims, shapes, 3);
  const int64_t b = shapes[0][0], heads = shapes[0][1], d = shapes[0][3], kv_heads = shapes[1][1];
  const int64_t d_value = shapes[2][3];  // V's head size (MLA: smaller than q/k's)
  const float *sinks = with_sinks ? static_cast<const float *>(params[7]) : nullptr;
  auto in = [&](int i) { return static_cast<const float *>(params[i < 7 ? i : i + with_sinks]); };
  auto result = [&](int i) { return static_cast<float *>(params[i + with_sinks]); };
  by_head_size(d, [&](auto head_size) {
    backward<decltype(head_size)::value>(in(0), in(1), in(2), sinks, in(7), in(8), in(9), vis,
                                         b, heads, kv_heads, d, d_value, result(10), result(11), result(12),
                                         with_sinks ? result(13) : nullptr);
  });
  return 0;
}

}  // namespace

void msllm_kernels::flash_attention(const float *q, const float *k, const float *v, const float *sinks,
                                    const Visibility &vis, int64_t b, int64_t heads, int64_t kv_heads, int64_t d,
                                    int64_t d_value, float *out, float *lse) {
  if (vis.s == 1) return forward_one_query(q, k, v, sinks, vis, b, heads, kv_heads, d, d_value, out, lse);
  by_head_size(d, [&](auto head_size) {
    forward<decltype(head_size)::value>(q, k, v, sinks, vis, b, heads, kv_heads, d, d_value, out, lse);
  });
}

// inputs: q [b, heads, s, d] (already scaled), k [b, kv_heads, t, d], v [b, kv_heads, t, d_value], q_slot [s],
// q_seg [s] or [b, s], k_seg [t] or [b, t], window [1] (int32; fp32 otherwise); outputs: out [b, heads, s, d_value],
// lse [b, heads, s].
extern "C" int FlashAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  return attention_forward(params, ndims, shapes, false);
}

// inputs: q, k, v, q_slot, q_seg, k_seg, window (as FlashAttention), out, lse, d_out [b, heads, s, d_value];
// outputs: dq, dk, dv (the shapes of q, k, v).
extern "C" int FlashAttentionGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  return attention_backward(params, ndims, shapes, false);
}

// FlashAttention with a sink logit per head: inputs q .. window (as FlashAttention), sinks [heads];
// outputs out, lse (the sink's share included).
extern "C" int FlashAttentionSinks(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  return attention_forward(params, ndims, shapes, true);
}

// inputs: q .. window, sinks (as FlashAttentionSinks), out, lse, d_out; outputs: dq, dk, dv, d_sinks [heads].
extern "C" int FlashAttentionSinksGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  return attention_backward(params, ndims, shapes, true);
}
