// The output head reduced as its cross-entropy needs it, by blocks of the vocabulary (msllm.models.layers
// ChunkedHead is the same maths in MindSpore ops):
//   z = h @ w^T (optionally softcap * tanh(z / softcap)),  lse = logsumexp(z),  target = z[label]
// Neither kernel holds [N, V]: each work unit computes one block's logits [N, block_cols] into its
// thread's scratch, reduces it, and moves on. The GEMMs are dnnl_sgemm, as grouped_matmul.cc.
// MindSpore's graph form of the same chunks was measured to keep every chunk's buffers alive on the
// CPU backend (docs/big-vocab.md), which is why this kernel exists.
#include <limits>

#include "common.h"
#include "dnnl.h"

using namespace msllm_kernels;

namespace {

// Vocabulary columns per work unit: ~1M fp32 logits (4 MB of scratch per thread), a multiple of 64;
// blocks of 256K and 1M logits ran alike, 4M slower (the block no longer stays in cache).
int64_t block_cols(int64_t n, int64_t vocab) {
  const int64_t cols = std::max<int64_t>(64, std::min<int64_t>(8192, (int64_t{1} << 20) / std::max<int64_t>(n, 1) / 64 * 64));
  return std::min(cols, vocab);
}

struct Head {
  int64_t n, hidden, vocab, cols, blocks;
  const float *h, *w;
  const int32_t *labels;
  float softcap;

  Head(void **params, int64_t **shapes)
      : n(shapes[0][0]), hidden(shapes[0][1]), vocab(shapes[1][0]), cols(block_cols(n, vocab)),
        blocks((vocab + cols - 1) / cols), h(static_cast<const float *>(params[0])),
        w(static_cast<const float *>(params[1])), labels(static_cast<const int32_t *>(params[2])),
        softcap(*static_cast<const float *>(params[3])) {}

  int64_t start(int64_t b) const { return b * cols; }
  int64_t width(int64_t b) const { return std::min(cols, vocab - b * cols); }

  // The block's logits z [n, width] into scratch; with soft-capping, z = softcap * tanh(z / softcap).
  void logits(DnnlSgemm gemm, int64_t b, float *z) const {
    const int64_t c = width(b);
    gemm('N', 'T', n, c, hidden, 1.f, h, hidden, w + start(b) * hidden, hidden, 0.f, z, c);
    if (softcap > 0)
      for (int64_t i = 0; i < n * c; ++i) z[i] = softcap * std::tanh(z[i] / softcap);
  }
};

// What sum_exp leaves in the row besides the sum: nothing, exp(z - m), or exp(z - m) * (1 - tanh^2) (the row
// holds softcap * tanh: the slope of a soft-capped logit)
enum class Keep { kNothing, kExp, kCappedExp };

// sum_j exp(row[j] - m) in 16 lanes, each exp computed once whatever `keep` writes back
template <Keep keep>
inline float sum_exp(float *row, int64_t c, float m, float softcap) {
  float lane[16] = {0}, s = 0.f;
  auto term = [&](int64_t j) {
    const float e = exp_approx(row[j] - m);
    if (keep == Keep::kExp) row[j] = e;
    if (keep == Keep::kCappedExp) row[j] = e * (1.f - (row[j] / softcap) * (row[j] / softcap));
    return e;
  };
  int64_t j = 0;
  for (; j + 16 <= c; j += 16)
    for (int k = 0; k < 16; ++k) lane[k] += term(j + k);
  for (; j < c; ++j) s += term(j);
  for (int k = 0; k < 16; ++k) s += lane[k];
  return s;
}

// lse [N] and target [N] (the label's logit) and, when `expect` is given, expect [N, H] = the softmax's
// expectation of the (soft-capped) logits' gradient rows: sum_j softmax(z)_j * dz_j/dh. That is lse's
// gradient wrt h, whatever weights the loss puts on each row, so a frozen head's backward needs no second
// pass over the vocabulary. Each stripe of blocks keeps a running (max, sum of exps, expect) per row,
// rescaled when the max grows; the stripes' are merged at the end.
void forward(void **params, int64_t **shapes, float *lse, float *target, float *expect) {
  const DnnlSgemm gemm = dnnl_sgemm();
  const Head hd(params, shapes);
  const int threads = pool().size();
  const int64_t n = hd.n, hidden = hd.hidden;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> run_max(threads * n, kNegInf), run_sum(threads * n, 0.f);
  std::vector<std::vector<float>> scratch(threads), block_expect(threads), run_expect(threads);
  std::fill(target, target + n, 0.f);
  run_stripes(hd.blocks, threads, [&](int64_t b, int t) {  // t: the stripe (bit-reproducible sums)
    std::vector<float> &z = scratch[t];
    z.resize(n * hd.cols);
    hd.logits(gemm, b, z.data());
    const int64_t c = hd.width(b), lo = hd.start(b);
    std::vector<float> block_max(n), block_sum(n);
    for (int64_t r = 0; r < n; ++r) {
      float *row = z.data() + r * c;
      const int64_t label = hd.labels[r] - lo;
      if (label >= 0 && label < c) target[r] = row[label];
      const float m = lane_max(row, c, row[0]);
      // with expect the row becomes exp(z - m) * dz/dlogit: the block's share of expect, unnormalised
      const float s = !expect           ? sum_exp<Keep::kNothing>(row, c, m, hd.softcap)
                      : hd.softcap > 0 ? sum_exp<Keep::kCappedExp>(row, c, m, hd.softcap)
                                       : sum_exp<Keep::kExp>(row, c, m, hd.softcap);
      block_max[r] = m;
      block_sum[r] = s;
    }
    if (expect) {
      block_expect[t].resize(n * hidden);
      if (run_expect[t].empty()) run_expect[t].assign(n * hidden, 0.f);
      gemm('N', 'N', n, hidden, c, 1.f, z.data(), c, hd.w + lo * hidden, hidden, 0.f, block_expect[t].data(), hidden);
    }
    for (int64_t r = 0; r < n; ++r) {
      const float m = block_max[r], s = block_sum[r];
      float &M = run_max[t * n + r], &S = run_sum[t * n + r];
      const float old_scale = m > M ? exp_approx(M - m) : 1.f, new_scale = m > M ? 1.f : exp_approx(m - M);
      S = S * old_scale + s * new_scale;  // exp(-inf) = 0 on the first block
      M = std::max(M, m);
      if (expect) {
        float *e = run_expect[t].data() + r * hidden;
        const float *eb = block_expect[t].data() + r * hidden;
        for (int64_t k = 0; k < hidden; ++k) e[k] = e[k] * old_scale + eb[k] * new_scale;
      }
    }
  });
  for (int64_t r = 0; r < n; ++r) {
    float M = kNegInf;
    for (int t = 0; t < threads; ++t) M = std::max(M, run_max[t * n + r]);
    double S = 0.0;
    for (int t = 0; t < threads; ++t)
      if (run_sum[t * n + r] > 0) S += run_sum[t * n + r] * std::exp(run_max[t * n + r] - M);
    lse[r] = M + static_cast<float>(std::log(S));
    if (!expect) continue;
    float *e = expect + r * hidden;
    std::fill(e, e + hidden, 0.f);
    for (int t = 0; t < threads; ++t) {
      if (run_sum[t * n + r] <= 0) continue;
      const float scale = static_cast<float>(std::exp(run_max[t * n + r] - M) / S);
      const float *et = run_expect[t].data() + r * hidden;
      for (int64_t k = 0; k < hidden; ++k) e[k] += et[k] * scale;
    }
  }
}

}  // namespace

// inputs: h [N, H], w [V, H] (fp32), labels [N] (int32), softcap [1]; outputs: lse [N], target [N].
extern "C" int LinearCrossEntropy(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  if (!dnnl_sgemm()) return 1;
  forward(params, shapes, static_cast<float *>(params[4]), static_cast<float *>(params[5]), nullptr);
  return 0;
}

// A frozen head (LoRA): as LinearCrossEntropy, plus expect [N, H], from which the backward is
// dh = g_lse * expect + g_target * dz_label/dh (msllm.kernels.FusedHead), no second vocabulary pass.
extern "C" int LinearCrossEntropyFrozen(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                        void *stream, void *extra) {
  if (!dnnl_sgemm()) return 1;
  forward(params, shapes, static_cast<float *>(params[4]), static_cast<float *>(params[5]),
          static_cast<float *>(params[6]));
  return 0;
}

// inputs: h, w, labels, softcap (as LinearCrossEntropy), lse [N], g_softmax [N], g_label [N];
// outputs: dh [N, H], dw [V, H] (a frozen head takes LinearCrossEntropyFrozen's path instead). The
// logits' gradient is
//   dz = g_softmax * softmax(z) - g_label * onehot(label)   (times 1 - tanh^2 under soft-capping)
// block by block: dw's block rows = dz^T h (each block's rows written by one unit), dh = sum of dz w_block,
// accumulated per stripe of blocks and summed at the end.
extern "C" int LinearCrossEntropyGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  const DnnlSgemm gemm = dnnl_sgemm();
  if (!gemm) return 1;
  const Head hd(params, shapes);
  const auto *lse = static_cast<const float *>(params[4]), *g_softmax = static_cast<const float *>(params[5]),
             *g_label = static_cast<const float *>(params[6]);
  auto *dh = static_cast<float *>(params[7]), *dw = static_cast<float *>(params[8]);
  const int threads = pool().size();
  std::vector<std::vector<float>> scratch(threads), dh_part(threads);
  std::vector<char> used(threads, 0);
  run_stripes(hd.blocks, threads, [&](int64_t b, int t) {  // t: the stripe (bit-reproducible sums)
    std::vector<float> &z = scratch[t];
    z.resize(hd.n * hd.cols);
    hd.logits(gemm, b, z.data());
    const int64_t c = hd.width(b), lo = hd.start(b);
    const float softcap = hd.softcap;  // a local: read through the captured hd, gcc reloaded it every element
    for (int64_t r = 0; r < hd.n; ++r) {
      float *row = z.data() + r * c;
      const float shift = lse[r], g = g_softmax[r];
      const int64_t label = hd.labels[r] - lo;
      const bool here = label >= 0 && label < c;
      if (softcap > 0) {  // row holds softcap * tanh: its slope is 1 - tanh^2
        const float t_label = here ? row[label] / softcap : 0.f;
        for (int64_t j = 0; j < c; ++j) {
          const float t = row[j] / softcap;
          row[j] = exp_approx(row[j] - shift) * g * (1.f - t * t);
        }
        if (here) row[label] -= g_label[r] * (1.f - t_label * t_label);
      } else {
        for (int64_t j = 0; j < c; ++j) row[j] = exp_approx(row[j] - shift) * g;
        if (here) row[label] -= g_label[r];
      }
    }
    gemm('T', 'N', c, hd.hidden, hd.n, 1.f, z.data(), c, hd.h, hd.hidden, 0.f, dw + lo * hd.hidden, hd.hidden);
    if (!used[t]) dh_part[t].assign(hd.n * hd.hidden, 0.f);
    used[t] = 1;
    gemm('N', 'N', hd.n, hd.hidden, c, 1.f, z.data(), c, hd.w + lo * hd.hidden, hd.hidden, 1.f, dh_part[t].data(),
         hd.hidden);
  });
  // the stripes' sums in stripe order, one stripe at a time: the used test inside the element loop kept it scalar
  parallel_for(hd.n * hd.hidden, [&](int64_t a, int64_t b, int) {
    std::fill(dh + a, dh + b, 0.f);
    for (int t = 0; t < threads; ++t) {
      if (!used[t]) continue;
      const float *__restrict part = dh_part[t].data();
      for (int64_t i = a; i < b; ++i) dh[i] += part[i];
    }
  });
  return 0;
}
