// The gated delta rule (Gated DeltaNet's linear attention) for the CPU, forward and backward, token by
// token. Per (batch, value head) a state S [dk, dv]; token t, with a = exp(g_t):
//   S' = (S at a packed sample's first token: 0)           the state entering the token
//   r  = v - a S'^T k                                       what the decayed state misses of v
//   S  = a S' + beta k r^T                                  decay, then the delta-rule correction
//   o  = S^T q
// which is msllm.models.mixers.gated_deltanet.ChunkedGatedDeltaRule's maths without the chunked (WY)
// rearrangement: no [chunk, chunk] tensor. Every column of S (a value channel) evolves on its own, so a
// head's state is walked a block of kColumns columns at a time ([dk, 32] floats, 16 KB at dk 128): the
// block stays in L1 for the whole sequence, where the whole state (64 KB) would stream from L2 per token.
// Forward keeps a block as [dk, w] rows (its sums run over k's index: vectors of columns accumulate);
// backward transposed, [w, dk] (most of its sums run over columns: vectors of dk accumulate; each
// column's one sum over dk, a dot, is taken for 8 columns at once).
//
// Backward, by hand (dS the gradient of the state leaving a token, from the tokens after it):
//   dS += q dO^T;  dq = S dO = a S' dO + beta k (r . dO)
//   e = dS^T k;  dk = beta dS r;  dbeta = e . r;  dr = dv = beta e
//   dP = dS - k dr^T (the gradient of a S');  dk -= a S' dr;  dg = a <dP, S'>;  dS <- a dP
//   (0 at a sample's first token: the state before it is cut). dq, dk, dg and dbeta sum over columns:
//   each column block adds its part. e is taken from dS before its update (e = dS^T k + (k . q) dO), so
//   the rest is one pass over dS per token.
// Forward saves the state entering every `interval`-th token (checkpoints [b, n, chunks, dk, dv]);
// backward recomputes a chunk's states S' and r from its checkpoint, then walks its tokens backwards.
#include "common.h"

using namespace msllm_kernels;

namespace {

constexpr int64_t kColumns = 32;
#if defined(__AVX512F__)
constexpr int kSplit = 4;  // partial sums of a column block over dk: 4 x 2 zmm break the FMA latency chain
#else
constexpr int kSplit = 2;  // 2 x 4 ymm (of 16 registers)
#endif

// One (batch, head)'s rows: q, k [s, dk], v [s, dv], g, beta [s], segments [s].
struct Head {
  const float *q, *k, *v, *g, *beta;
  const int32_t *segments;
  int64_t dk, dv;

  bool starts_sample(int64_t t) const { return t > 0 && segments[t] != segments[t - 1]; }
};

// The shapes both kernels read: q, k [b, nk, s, dk] (key heads, each serving n / nk consecutive value
// heads), v [b, n, s, dv], segments [b, s], checkpoints [b, n, chunks, dk, dv] (or [1]: the forward saves none).
struct Shapes {
  int64_t b, n, nk, s, dk, dv, chunks, interval;

  Shapes(int64_t **shapes, int checkpoints_ndim, int64_t *checkpoints_shape)
      : b(shapes[0][0]), n(shapes[2][1]), nk(shapes[0][1]), s(shapes[0][2]), dk(shapes[0][3]), dv(shapes[2][3]) {
    chunks = checkpoints_ndim == 5 ? checkpoints_shape[2] : 0;
    interval = chunks ? (s + chunks - 1) / chunks : s;
  }
  // The (batch, key head) whose q and k rows (batch, value head) `unit` reads.
  int64_t key_unit(int64_t unit) const { return unit / n * nk + unit % n / (n / nk); }
  Head head(void **params, int64_t unit) const {
    auto in = [&](int i) { return static_cast<const float *>(params[i]); };
    const int64_t keys = key_unit(unit) * s * dk;
    return {in(0) + keys, in(1) + keys, in(2) + unit * s * dv, in(3) + unit * s,
            in(4) + unit * s, static_cast<const int32_t *>(params[5]) + unit / n * s, dk, dv};
  }
};

// Columns [c0, c0 + w) of a [dk, dv] state to a block and back: [dk, w] rows, or transposed [w, dk].
template <bool kTransposed>
void gather_columns(const float *state, int64_t dk, int64_t dv, int64_t c0, int64_t w, float *block) {
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t c = 0; c < w; ++c) block[kTransposed ? c * dk + i : i * w + c] = state[i * dv + c0 + c];
}

template <bool kTransposed>
void scatter_columns(const float *block, int64_t dk, int64_t dv, int64_t c0, int64_t w, float *state) {
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t c = 0; c < w; ++c) state[i * dv + c0 + c] = block[kTransposed ? c * dk + i : i * w + c];
}

// Calls fn(width) with the block width as a compile-time constant for full blocks (0: w at run time).
template <typename Fn>
void by_width(int64_t w, Fn fn) {
  if (w == kColumns) return fn(std::integral_constant<int, kColumns>());
  fn(std::integral_constant<int, 0>());
}

// sums[c] = sum_i weight[i] block[i][c] over a [dk, w] block, in kSplit partial sums over interleaved
// rows so consecutive FMAs do not wait on each other.
template <int W>
void column_sums(const float *__restrict weight, const float *__restrict block, int64_t dk, int64_t w,
                 float *__restrict sums) {
  float part[kSplit][W ? W : kColumns] = {};
  int64_t i = 0;
  for (; i + kSplit <= dk; i += kSplit)
    for (int u = 0; u < kSplit; ++u) {
      const float x = weight[i + u], *__restrict row = block + (i + u) * w;
      for (int64_t c = 0; c < w; ++c) part[u][c] += x * row[c];
    }
  for (; i < dk; ++i)
    for (int64_t c = 0; c < w; ++c) part[0][c] += weight[i] * block[i * w + c];
  for (int64_t c = 0; c < w; ++c) {
    float total = 0.f;
    for (int u = 0; u < kSplit; ++u) total += part[u][c];
    sums[c] = total;
  }
}

// Token t forward on a [dk, w] block of columns c0.. (S' in, S out); r [w] gets v - a S'^T k; out (the
// token's [dv] row, if given) its columns of S^T q.
template <int W>
void step(const Head &h, int64_t t, int64_t c0, int64_t w_any, float *__restrict state, float *__restrict r,
          float *__restrict out) {
  const int64_t dk = h.dk, w = W ? W : w_any;
  const float a = std::exp(h.g[t]), beta = h.beta[t];
  const float *__restrict q = h.q + t * dk, *__restrict k = h.k + t * dk, *__restrict v = h.v + t * h.dv + c0;
  column_sums<W>(k, state, dk, w, r);
  for (int64_t c = 0; c < w; ++c) r[c] = v[c] - a * r[c];
  for (int64_t i = 0; i < dk; ++i) {
    const float write = beta * k[i];
    float *__restrict row = state + i * w;
    for (int64_t c = 0; c < w; ++c) row[c] = a * row[c] + write * r[c];
  }
  column_sums<W>(q, state, dk, w, out + c0);
}

// sum_i x[i] y[i] in partial sums (vectorizes; the lanes are added once at the end).
inline float dot(const float *__restrict x, const float *__restrict y, int64_t n) {
  return lane_dot<false>(x, y, nullptr, n);
}

// Backward's register blocks: common.h's 8-float vectors (a ymm; half a zmm on AVX-512).
constexpr int kVec = 8;
typedef Floats8 vec;

// dots[c] = block[c] . x for the w rows (dk long) of a [w, dk] block, 8 rows at a time.
void row_dots(const float *__restrict block, const float *__restrict x, int64_t dk, int64_t w,
              float *__restrict dots) {
  int64_t c = 0;
  if (dk % kVec == 0)
    for (; c + kVec <= w; c += kVec) {
      vec sums[kVec] = {};
      for (int64_t i = 0; i < dk; i += kVec) {
        const vec xv = load8(x + i);
        for (int j = 0; j < kVec; ++j) sums[j] += load8(block + (c + j) * dk + i) * xv;
      }
      store8(dots + c, lane_sums(sums));
    }
  for (; c < w; ++c) dots[c] = dot(block + c * dk, x, dk);
}

// Token t forward on a transposed [w, dk] block (backward's recompute: no output): per column c,
// r[c] = v[c] - a S'[:, c] . k and, given `leaving`, there S[:, c] = a S'[:, c] + beta r[c] k.
void step_transposed(const Head &h, int64_t t, int64_t c0, int64_t w, const float *__restrict entering,
                     float *__restrict leaving, float *__restrict r) {
  const int64_t dk = h.dk;
  const float a = std::exp(h.g[t]), beta = h.beta[t];
  const float *__restrict k = h.k + t * dk, *__restrict v = h.v + t * h.dv + c0;
  row_dots(entering, k, dk, w, r);
  for (int64_t c = 0; c < w; ++c) r[c] = v[c] - a * r[c];
  if (!leaving) return;
  for (int64_t c = 0; c < w; ++c) {
    const float write = beta * r[c], *__restrict from = entering + c * dk;
    float *__restrict to = leaving + c * dk;
    for (int64_t i = 0; i < dk; ++i) to[i] = a * from[i] + write * k[i];
  }
}

// The gradients of one (batch, head): dq, dk [s, dk], dv [s, dv], dg, dbeta [s].
struct Grads {
  float *dq, *dk, *dv, *dg, *dbeta;
};

// step_back's one pass over C columns c.. of the state gradient dS ([C, dk] at `columns`; S' at `entering`),
// their dr known: dS[:, c] += q dO[c]; dq += a dO[c] S'[:, c]; dP = dS[:, c] - k dr[c];
// dk += beta r[c] dS[:, c] - a dr[c] S'[:, c]; da += dP * S'[:, c] (by lanes); dS[:, c] = a dP. dq's and dk's
// rows stay in registers across the C columns (not loaded and stored again for every column).
template <int C>
__attribute__((noinline)) void columns_back(int64_t dk, float a, float beta, const float *d_out, const float *r,
                                            const float *dr, const float *__restrict q, const float *__restrict k,
                                            const float *__restrict entering, float *__restrict columns,
                                            float *__restrict dq, float *__restrict dkt, float *__restrict da) {
  int64_t i = 0;
  vec da_lanes = load8(da);
  for (; i + kVec <= dk; i += kVec) {
    const vec qv = load8(q + i), kv = load8(k + i);
    vec dqv = load8(dq + i), dkv = load8(dkt + i);
    for (int c = 0; c < C; ++c) {
      const vec s = load8(entering + c * dk + i), d = load8(columns + c * dk + i) + qv * d_out[c];
      const vec p = d - kv * dr[c];
      dqv += (a * d_out[c]) * s;
      dkv += (beta * r[c]) * d - (a * dr[c]) * s;
      da_lanes += p * s;
      store8(columns + c * dk + i, a * p);
    }
    store8(dq + i, dqv);
    store8(dkt + i, dkv);
  }
  store8(da, da_lanes);
  for (; i < dk; ++i)
    for (int c = 0; c < C; ++c) {
      const float s = entering[c * dk + i], d = columns[c * dk + i] + q[i] * d_out[c], p = d - k[i] * dr[c];
      dq[i] += a * d_out[c] * s;
      dkt[i] += beta * r[c] * d - a * dr[c] * s;
      da[0] += p * s;
      columns[c * dk + i] = a * p;
    }
}

// Token t backward on a transposed block of columns c0..: `entering` [w, dk] is S', r [w] its forward
// residual, d_state [w, dk] the gradient of the state leaving t, turned into that of the state entering
// it. Writes the block's columns of dv; adds its part of dq, dk, dg, dbeta (sums over columns). Column
// by column: dS[:, c] += q dO[c]; e[c] = k . dS[:, c]; dr[c] = beta e[c]; dP[:, c] = dS[:, c] - k dr[c].
void step_back(const Head &h, int64_t t, int64_t c0, int64_t w, const float *__restrict entering,
               const float *__restrict r, const float *__restrict d_out, float *__restrict d_state, const Grads &grad) {
  const int64_t dk = h.dk;
  const float a = std::exp(h.g[t]), beta = h.beta[t];
  const float *__restrict q = h.q + t * dk, *__restrict k = h.k + t * dk;
  float *__restrict dq = grad.dq + t * dk, *__restrict dkt = grad.dk + t * dk;
  float *__restrict dr = grad.dv + t * h.dv + c0;
  d_out += t * h.dv + c0;
  row_dots(d_state, k, dk, w, dr);  // e = dS^T k of dS before the token's q dO^T, then dr = beta e
  const float kq = dot(k, q, dk);
  float da[kVec] = {}, dbeta = 0.f;
  for (int64_t c = 0; c < w; ++c) {
    const float e = dr[c] + kq * d_out[c];
    dbeta += e * r[c];
    dr[c] = beta * e;
  }
  constexpr int kGroup = 4;
  int64_t c = 0;
  for (; c + kGroup <= w; c += kGroup)
    columns_back<kGroup>(dk, a, beta, d_out + c, r + c, dr + c, q, k, entering + c * dk, d_state + c * dk, dq, dkt, da);
  for (; c < w; ++c)
    columns_back<1>(dk, a, beta, d_out + c, r + c, dr + c, q, k, entering + c * dk, d_state + c * dk, dq, dkt, da);
  const float r_dout = beta * dot(r, d_out, w);
  for (int64_t i = 0; i < dk; ++i) dq[i] += k[i] * r_dout;
  float da_total = 0.f;
  for (int l = 0; l < kVec; ++l) da_total += da[l];
  grad.dg[t] += a * da_total;
  grad.dbeta[t] += dbeta;
  if (h.starts_sample(t)) std::fill(d_state, d_state + dk * w, 0.f);
}

// One (batch, value head)'s backward: its gradients of q and k added into grad.dq and grad.dk (a key head's
// value heads share them), of v, g and beta written; `checkpoints` its saved states [chunks, dk, dv],
// `d_out` [s, dv] and `d_final` [dk, dv] its output gradients; d_initial [dk, dv] the initial state's.
// `scratch`: the thread's working memory (a chunk's states, residuals and dS), reused by its units: allocated
// and zeroed per column block, its page faults and memset showed in the backward's profile.
void rule_back(const Shapes &dims, const Head &h, const Grads &grad, const float *checkpoints, const float *d_out,
               const float *d_final, float *d_initial, std::vector<float> &scratch) {
  const int64_t dk = dims.dk, dv = dims.dv, s = dims.s, state_size = dk * dv;
  std::fill(grad.dg, grad.dg + s, 0.f);
  std::fill(grad.dbeta, grad.dbeta + s, 0.f);
  for (int64_t c0 = 0; c0 < dv; c0 += kColumns) {
    const int64_t w = std::min(kColumns, dv - c0), block = dk * w;
    scratch.resize((dims.interval + 1) * block + dims.interval * w);
    float *entering = scratch.data(), *d_state = entering + dims.interval * block, *r = d_state + block;
    gather_columns<true>(d_final, dk, dv, c0, w, d_state);
    for (int64_t chunk = dims.chunks - 1; chunk >= 0; --chunk) {
      const int64_t t0 = chunk * dims.interval, n = std::min(dims.interval, s - t0);
      gather_columns<true>(checkpoints + chunk * state_size, dk, dv, c0, w, entering);
      for (int64_t j = 0; j < n; ++j) {  // the chunk's entering states again, each from the one before
        float *state = entering + j * block;
        if (h.starts_sample(t0 + j)) std::fill(state, state + block, 0.f);
        step_transposed(h, t0 + j, c0, w, state, j + 1 < n ? state + block : nullptr, r + j * w);
      }
      for (int64_t j = n - 1; j >= 0; --j)
        step_back(h, t0 + j, c0, w, entering + j * block, r + j * w, d_out, d_state, grad);
    }
    scatter_columns<true>(d_state, dk, dv, c0, w, d_initial);
  }
}

}  // namespace

// inputs: q, k [b, n, s, dk] (normalised, q scaled), v [b, n, s, dv], g, beta [b, n, s] (fp32), segments
// [b, s] (int32: packed samples), initial [b, n, dk, dv]; outputs: out [b, n, s, dv], final state [b, n, dk,
// dv], checkpoints [b, n, chunks, dk, dv] (the state entering tokens 0, interval, 2 interval, ..; [1]: none).
extern "C" int GatedDeltaRule(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  const Shapes dims(shapes, ndims[9], shapes[9]);
  const int64_t dk = dims.dk, dv = dims.dv, state_size = dk * dv;
  const int64_t blocks = (dv + kColumns - 1) / kColumns;
  const float *initial = static_cast<const float *>(params[6]);
  float *out = static_cast<float *>(params[7]), *final_state = static_cast<float *>(params[8]);
  float *checkpoints = static_cast<float *>(params[9]);
  run_units(dims.b * dims.n * blocks, [&](int64_t task, int) {  // a (batch, head)'s column block each
    const int64_t unit = task / blocks, c0 = task % blocks * kColumns, w = std::min(kColumns, dv - c0);
    const Head h = dims.head(params, unit);
    std::vector<float> state(dk * w), r(w);
    gather_columns<false>(initial + unit * state_size, dk, dv, c0, w, state.data());
    by_width(w, [&](auto width) {
      for (int64_t t = 0; t < dims.s; ++t) {
        if (dims.chunks && t % dims.interval == 0)
          scatter_columns<false>(state.data(), dk, dv, c0, w,
                                 checkpoints + (unit * dims.chunks + t / dims.interval) * state_size);
        if (h.starts_sample(t)) std::fill(state.begin(), state.end(), 0.f);
        step<decltype(width)::value>(h, t, c0, w, state.data(), r.data(), out + (unit * dims.s + t) * dv);
      }
    });
    scatter_columns<false>(state.data(), dk, dv, c0, w, final_state + unit * state_size);
  });
  return 0;
}

// inputs: q, k, v, g, beta, segments, initial (as GatedDeltaRule), checkpoints, d_out, d_final;
// outputs: dq, dk, dv, dg, dbeta, d_initial.
extern "C" int GatedDeltaRuleGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  const Shapes dims(shapes, ndims[7], shapes[7]);
  const int64_t dk = dims.dk, dv = dims.dv, s = dims.s, state_size = dk * dv;
  auto in = [&](int i) { return static_cast<const float *>(params[i]); };
  auto result = [&](int i) { return static_cast<float *>(params[i]); };
  const float *checkpoints = in(7), *d_out = in(8), *d_final = in(9);
  // A (batch, key head) a unit: its value heads' column blocks add into the same dq and dk rows, each
  // value head's into its dg and dbeta rows.
  const int64_t per_key = dims.n / dims.nk;
  std::vector<std::vector<float>> scratch(pool().size());
  run_units(dims.b * dims.nk, [&](int64_t key, int thread) {
    std::fill(result(10) + key * s * dk, result(10) + (key + 1) * s * dk, 0.f);
    std::fill(result(11) + key * s * dk, result(11) + (key + 1) * s * dk, 0.f);
    for (int64_t unit = key / dims.nk * dims.n + key % dims.nk * per_key, last = unit + per_key; unit < last; ++unit)
      rule_back(dims, dims.head(params, unit),
                {result(10) + key * s * dk, result(11) + key * s * dk, result(12) + unit * s * dv,
                 result(13) + unit * s, result(14) + unit * s},
                checkpoints + unit * dims.chunks * state_size, d_out + unit * s * dv, d_final + unit * state_size,
                result(15) + unit * state_size, scratch[thread]);
  });
  return 0;
}

// One decode token of a Gated DeltaNet layer, from its projections to the rule's read-out, with the layer's
// caches written in place (msllm.models.mixers.gated_deltanet.GatedDeltaNet's decode step). Per row:
//   the causal conv of each channel over the window's K - 1 inputs and the token's, then SiLU (q, k, v);
//   the window shifted by the token's projections; q and k L2-normalised per key head, q scaled by dk^-1/2;
//   beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) per value head (softplus linear above 20);
//   each value head's state takes the token (`step`, with the q and k of its key head) and reads out S^T q.
// inputs: q, k [b, nk dk], v [b, nv dv], a, b [b, nv] (the projections), conv weights q, k [nk dk, (1,) K], v
// [nv dv, (1,) K], A_log, dt_bias [nv], state [b, nv, dk, dv], window [b, K - 1, 2 nk dk + nv dv] (fp32; the
// last two written); output: out [b, nv, dv].
extern "C" int GatedDeltaStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  auto in = [&](int i) { return static_cast<const float *>(params[i]); };
  const int64_t rows = shapes[0][0], keys = shapes[0][1], values = shapes[2][1], taps = shapes[5][ndims[5] - 1];
  const int64_t nv = shapes[10][1], dk = shapes[10][2], dv = shapes[10][3], nk = keys / dk;
  const int64_t channels = 2 * keys + values, blocks = (dv + kColumns - 1) / kColumns;
  float *state = static_cast<float *>(params[10]), *window = static_cast<float *>(params[11]);
  float *out = static_cast<float *>(params[12]);
  // per row: conv outputs q | k | v [channels], then g and beta [nv] each
  std::vector<float> mixed(rows * (channels + 2 * nv));
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  parallel_for(rows, [&](int64_t lo, int64_t hi, int) {
    for (int64_t row = lo; row < hi; ++row) {
      float *y = mixed.data() + row * (channels + 2 * nv), *g = y + channels, *beta = g + nv;
      float *held = window + row * (taps - 1) * channels;
      const int64_t widths[3] = {keys, keys, values};
      for (int part = 0, first = 0; part < 3; first += widths[part++]) {
        const float *x = in(part) + row * widths[part], *weight = in(5 + part);
        for (int64_t c = 0; c < widths[part]; ++c) {
          const float *w = weight + c * taps;
          float pre = w[taps - 1] * x[c];
          for (int64_t j = 0; j + 1 < taps; ++j) pre += w[j] * held[j * channels + first + c];
          y[first + c] = pre * sigmoid(pre);
        }
      }
      if (taps > 1) {  // the window moves on by the token's (unconvolved) projections
        std::memmove(held, held + channels, sizeof(float) * (taps - 2) * channels);
        for (int part = 0, first = 0; part < 3; first += widths[part++])
          std::memcpy(held + (taps - 2) * channels + first, in(part) + row * widths[part],
                      sizeof(float) * widths[part]);
      }
      for (int64_t head = 0; head < 2 * nk; ++head) {  // q's heads, then k's
        float *x = y + head * dk;
        const float norm = 1.0f / std::sqrt(dot(x, x, dk) + 1e-6f) * (head < nk ? scale : 1.0f);
        for (int64_t i = 0; i < dk; ++i) x[i] *= norm;
      }
      for (int64_t h = 0; h < nv; ++h) {
        const float z = in(3)[row * nv + h] + in(9)[h];
        g[h] = -std::exp(in(8)[h]) * (z > 20.0f ? z : std::log1p(std::exp(z)));
        beta[h] = sigmoid(in(4)[row * nv + h]);
      }
    }
  }, 1);
  parallel_for(rows * nv * blocks, [&](int64_t lo, int64_t hi, int) {  // a (row, value head)'s column block each
    std::vector<float> block(dk * kColumns), r(kColumns);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t unit = task / blocks, row = unit / nv, h = unit % nv, c0 = task % blocks * kColumns;
      const int64_t w = std::min(kColumns, dv - c0);
      const float *y = mixed.data() + row * (channels + 2 * nv);
      const float *q = y + h / (nv / nk) * dk;
      const Head head{q, q + keys, y + 2 * keys + h * dv, y + channels + h, y + channels + nv + h, nullptr, dk, dv};
      float *own = state + unit * dk * dv;
      gather_columns<false>(own, dk, dv, c0, w, block.data());
      by_width(w, [&](auto width) {
        step<decltype(width)::value>(head, 0, c0, w, block.data(), r.data(), out + unit * dv);
      });
      scatter_columns<false>(block.data(), dk, dv, c0, w, own);
    }
  }, std::max<int64_t>(1, (1 << 16) / (dk * kColumns)));
  return 0;
}
