// The gated delta rule (Gated DeltaNet's linear attention) for the CPU, forward and backward, token by
// token. Per (batch, value head) a state S [dk, dv]; token t, with a = exp(g_t):
//   S' = (S at a packed sample's first token: 0)           the state entering the token
//   r  = v - a S'^T k                                       what the decayed state misses of v
//   S  = a S' + beta k r^T                                  decay, then the delta-rule correction
//   o  = S^T q
// which is msllm.models.mixers.gated_deltanet.ChunkedGatedDeltaRule's maths without the chunked (WY)
// rearrangement: no [chunk, chunk] tensor, and the state stays in L1/L2 while a head is processed.
//
// Backward, by hand (dS the gradient of the state leaving a token, from the tokens after it):
//   dS += q dO^T;  dq = S dO = a S' dO + beta k (r . dO)
//   e = dS^T k;  dk = beta dS r;  dbeta = e . r;  dr = dv = beta e
//   dP = dS - k dr^T (the gradient of a S');  dk -= a S' dr;  dg = a <dP, S'>;  dS <- a dP
//   (0 at a sample's first token: the state before it is cut)
// Forward saves the state entering every `interval`-th token (checkpoints [b, n, chunks, dk, dv]);
// backward recomputes a chunk's states S' and r from its checkpoint, then walks its tokens backwards.
#include "common.h"

using namespace msllm_kernels;

namespace {

// One (batch, head)'s rows: q, k [s, dk], v [s, dv], g, beta [s], segments [s].
struct Head {
  const float *q, *k, *v, *g, *beta;
  const int32_t *segments;
  int64_t dk, dv;

  bool starts_sample(int64_t t) const { return t > 0 && segments[t] != segments[t - 1]; }
};

// The shapes both kernels read: q [b, n, s, dk], v [b, n, s, dv], segments [b, s], checkpoints
// [b, n, chunks, dk, dv] (or [1]: the forward saves none).
struct Shapes {
  int64_t b, n, s, dk, dv, chunks, interval;

  Shapes(int64_t **shapes, int checkpoints_ndim, int64_t *checkpoints_shape)
      : b(shapes[0][0]), n(shapes[0][1]), s(shapes[0][2]), dk(shapes[0][3]), dv(shapes[2][3]) {
    chunks = checkpoints_ndim == 5 ? checkpoints_shape[2] : 0;
    interval = chunks ? (s + chunks - 1) / chunks : s;
  }
  Head head(void **params, int64_t unit) const {
    auto in = [&](int i) { return static_cast<const float *>(params[i]); };
    return {in(0) + unit * s * dk, in(1) + unit * s * dk, in(2) + unit * s * dv, in(3) + unit * s,
            in(4) + unit * s, static_cast<const int32_t *>(params[5]) + unit / n * s, dk, dv};
  }
};

// Token t forward on the state S (S' in, S out); r [dv] gets v - a S'^T k; out [dv] (if given) S^T q.
void step(const Head &h, int64_t t, float *__restrict state, float *__restrict r, float *__restrict out) {
  const int64_t dk = h.dk, dv = h.dv;
  const float a = std::exp(h.g[t]), beta = h.beta[t];
  const float *__restrict q = h.q + t * dk, *__restrict k = h.k + t * dk, *__restrict v = h.v + t * dv;
  std::fill(r, r + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i], *__restrict row = state + i * dv;
    for (int64_t c = 0; c < dv; ++c) r[c] += ki * row[c];
  }
  for (int64_t c = 0; c < dv; ++c) r[c] = v[c] - a * r[c];
  if (out) std::fill(out, out + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float write = beta * k[i], qi = q[i];
    float *__restrict row = state + i * dv;
    for (int64_t c = 0; c < dv; ++c) row[c] = a * row[c] + write * r[c];
    if (out)
      for (int64_t c = 0; c < dv; ++c) out[c] += qi * row[c];
  }
}

// Token t backward: `entering` is S' (the saved state), r its forward residual, d_state the gradient of
// the state leaving t, turned into that of the state entering it; writes dq, dk, dv, dg, dbeta of t.
struct Grads {
  float *dq, *dk, *dv, *dg, *dbeta;
};

void step_back(const Head &h, int64_t t, const float *__restrict entering, const float *__restrict r,
               const float *__restrict d_out, float *__restrict d_state, float *__restrict e, const Grads &grad) {
  const int64_t dk = h.dk, dv = h.dv;
  const float a = std::exp(h.g[t]), beta = h.beta[t];
  const float *__restrict q = h.q + t * dk, *__restrict k = h.k + t * dk;
  float *__restrict dq = grad.dq + t * dk, *__restrict dkt = grad.dk + t * dk, *__restrict dr = grad.dv + t * dv;
  const float r_dout = beta * lane_dot<false>(r, d_out, nullptr, dv);
  std::fill(e, e + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float *__restrict row = d_state + i * dv;
    const float qi = q[i], ki = k[i];
    for (int64_t c = 0; c < dv; ++c) row[c] += qi * d_out[c];
    dq[i] = a * lane_dot<false>(entering + i * dv, d_out, nullptr, dv) + ki * r_dout;
    dkt[i] = beta * lane_dot<false>(row, r, nullptr, dv);
    for (int64_t c = 0; c < dv; ++c) e[c] += ki * row[c];
  }
  grad.dbeta[t] = lane_dot<false>(e, r, nullptr, dv);
  for (int64_t c = 0; c < dv; ++c) dr[c] = beta * e[c];
  float da = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float *__restrict row = d_state + i * dv;
    const float *__restrict s = entering + i * dv;
    const float ki = k[i];
    dkt[i] -= a * lane_dot<false>(s, dr, nullptr, dv);
    for (int64_t c = 0; c < dv; ++c) row[c] -= ki * dr[c];
    da += lane_dot<false>(row, s, nullptr, dv);
    for (int64_t c = 0; c < dv; ++c) row[c] *= a;
  }
  grad.dg[t] = a * da;
  if (h.starts_sample(t)) std::fill(d_state, d_state + dk * dv, 0.f);
}

}  // namespace

// inputs: q, k [b, n, s, dk] (normalised, q scaled), v [b, n, s, dv], g, beta [b, n, s] (fp32), segments
// [b, s] (int32: packed samples), initial [b, n, dk, dv]; outputs: out [b, n, s, dv], final state [b, n, dk,
// dv], checkpoints [b, n, chunks, dk, dv] (the state entering tokens 0, interval, 2 interval, ..; [1]: none).
extern "C" int GatedDeltaRule(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  const Shapes dims(shapes, ndims[9], shapes[9]);
  const int64_t state_size = dims.dk * dims.dv;
  const float *initial = static_cast<const float *>(params[6]);
  float *out = static_cast<float *>(params[7]), *final_state = static_cast<float *>(params[8]);
  float *checkpoints = static_cast<float *>(params[9]);
  run_units(dims.b * dims.n, [&](int64_t unit, int) {
    const Head h = dims.head(params, unit);
    float *state = final_state + unit * state_size;
    std::copy(initial + unit * state_size, initial + (unit + 1) * state_size, state);
    std::vector<float> r(dims.dv);
    for (int64_t t = 0; t < dims.s; ++t) {
      if (dims.chunks && t % dims.interval == 0)
        std::copy(state, state + state_size, checkpoints + (unit * dims.chunks + t / dims.interval) * state_size);
      if (h.starts_sample(t)) std::fill(state, state + state_size, 0.f);
      step(h, t, state, r.data(), out + (unit * dims.s + t) * dims.dv);
    }
  });
  return 0;
}

// inputs: q, k, v, g, beta, segments, initial (as GatedDeltaRule), checkpoints, d_out, d_final;
// outputs: dq, dk, dv, dg, dbeta, d_initial.
extern "C" int GatedDeltaRuleGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  const Shapes dims(shapes, ndims[7], shapes[7]);
  const int64_t state_size = dims.dk * dims.dv, dv = dims.dv;
  auto in = [&](int i) { return static_cast<const float *>(params[i]); };
  auto result = [&](int i) { return static_cast<float *>(params[i]); };
  const float *checkpoints = in(7), *d_out = in(8), *d_final = in(9);
  run_units(dims.b * dims.n, [&](int64_t unit, int) {
    const Head h = dims.head(params, unit);
    const Grads grad{result(10) + unit * dims.s * dims.dk, result(11) + unit * dims.s * dims.dk,
                     result(12) + unit * dims.s * dv, result(13) + unit * dims.s, result(14) + unit * dims.s};
    float *d_state = result(15) + unit * state_size;  // the gradient of the state, walked back to the initial one
    std::copy(d_final + unit * state_size, d_final + (unit + 1) * state_size, d_state);
    std::vector<float> entering(dims.interval * state_size), r(dims.interval * dv), state(state_size), e(dv);
    for (int64_t chunk = dims.chunks - 1; chunk >= 0; --chunk) {
      const int64_t t0 = chunk * dims.interval, n = std::min(dims.interval, dims.s - t0);
      const float *start = checkpoints + (unit * dims.chunks + chunk) * state_size;
      std::copy(start, start + state_size, state.data());
      for (int64_t j = 0; j < n; ++j) {  // the chunk's entering states again
        if (h.starts_sample(t0 + j)) std::fill(state.begin(), state.end(), 0.f);
        std::copy(state.begin(), state.end(), entering.data() + j * state_size);
        step(h, t0 + j, state.data(), r.data() + j * dv, nullptr);
      }
      for (int64_t j = n - 1; j >= 0; --j)
        step_back(h, t0 + j, entering.data() + j * state_size, r.data() + j * dv,
                  d_out + (unit * dims.s + t0 + j) * dv, d_state, e.data(), grad);
    }
  });
  return 0;
}
