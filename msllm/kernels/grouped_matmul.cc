// Grouped matmul for MoE experts (msllm.models.moe.BlockDispatch): block i of rows is expert ids[i]'s,
//   y[i] = x[i] @ w[ids[i]]^T        x [B, n, in], w [E, out, in], ids [B] -> y [B, n, out]
// Adjacent blocks of one expert are one run, and a run is one GEMM that reads its expert's weights
// once: the portable form gathers [B, out, in] weight copies, one per block, and its backward
// scatters [B, out, in] gradients back into [E, out, in]. The GEMMs are oneDNN's dnnl_sgemm from
// the libdnnl MindSpore's CPU backend has already loaded (it runs on the calling thread there, so
// the pool splits the work).
#include "common.h"
#include "dnnl.h"

using namespace msllm_kernels;

namespace {

constexpr int64_t kChunkRows = 256;  // rows of x (or of dw) per work unit: two threads share a run

struct Run {
  int64_t expert, first, rows;  // rows [first, first + rows) of the flat [B * n] rows are expert's
};

// The inputs both kernels read: x [B, n, in], w [E, out, in], ids [B]; the runs of adjacent blocks of
// one expert, and their row chunks (the pool's work units).
struct Grouped {
  int64_t blocks, n, in, experts, out;
  const float *x, *w;
  const int32_t *ids;
  std::vector<Run> runs;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (run, first row within it), kChunkRows each
  bool valid = true;                                 // every id names an expert

  Grouped(void **params, int64_t **shapes)
      : blocks(shapes[0][0]), n(shapes[0][1]), in(shapes[0][2]), experts(shapes[1][0]), out(shapes[1][1]),
        x(static_cast<const float *>(params[0])), w(static_cast<const float *>(params[1])),
        ids(static_cast<const int32_t *>(params[2])) {
    for (int64_t i = 0; i < blocks; ++i) {
      valid = valid && ids[i] >= 0 && ids[i] < experts;
      if (runs.empty() || runs.back().expert != ids[i]) runs.push_back({ids[i], i * n, 0});
      runs.back().rows += n;
    }
    for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r)
      for (int64_t lo = 0; lo < runs[r].rows; lo += kChunkRows) chunks.push_back({r, lo});
  }

  // Chunk u's expert weights [out, in], first flat row and row count.
  const float *weights(int64_t u) const { return w + runs[chunks[u].first].expert * out * in; }
  int64_t row(int64_t u) const { return runs[chunks[u].first].first + chunks[u].second; }
  int64_t rows(int64_t u) const { return std::min(kChunkRows, runs[chunks[u].first].rows - chunks[u].second); }
};

}  // namespace

namespace {

// y = x @ w[ids]^T, plus bias[ids] per row when bias is given (gpt-oss's experts): the bias is written
// first and the GEMM accumulates onto it, so the bias costs no pass of its own.
int grouped_forward(const Grouped &g, const float *bias, float *y) {
  const DnnlSgemm gemm = dnnl_sgemm();
  if (!gemm || !g.valid) return 1;
  run_units(g.chunks.size(), [&](int64_t u, int) {
    float *rows = y + g.row(u) * g.out;
    if (bias) {
      const float *b = bias + g.runs[g.chunks[u].first].expert * g.out;
      for (int64_t r = 0; r < g.rows(u); ++r) std::copy(b, b + g.out, rows + r * g.out);
    }
    gemm('N', 'T', g.rows(u), g.out, g.in, 1.f, g.x + g.row(u) * g.in, g.in, g.weights(u), g.in, bias ? 1.f : 0.f,
         rows, g.out);
  });
  return 0;
}

// dx[i] = dy[i] @ w[ids[i]]; dw[e] = the sum over e's runs of dy_run^T @ x_run (0 for an expert no
// block is for); db[e] (when db is given) = the sum of dy over e's rows. A dw unit owns some of e's
// output rows across all its runs (and the same columns of db[e]): no two threads write the same rows.
int grouped_backward(const Grouped &g, const float *dy, float *dx, float *dw, float *db) {
  const DnnlSgemm gemm = dnnl_sgemm();
  if (!gemm || !g.valid) return 1;
  const int64_t dx_units = g.chunks.size(), out_chunks = (g.out + kChunkRows - 1) / kChunkRows;
  std::vector<std::vector<int64_t>> runs_of_expert(g.experts);
  for (int64_t r = 0; r < static_cast<int64_t>(g.runs.size()); ++r) runs_of_expert[g.runs[r].expert].push_back(r);
  run_units(dx_units + g.experts * out_chunks, [&](int64_t u, int) {
    if (u < dx_units) {
      gemm('N', 'N', g.rows(u), g.in, g.out, 1.f, dy + g.row(u) * g.out, g.out, g.weights(u), g.in, 0.f,
           dx + g.row(u) * g.in, g.in);
      return;
    }
    u -= dx_units;  // (expert, chunk of its output rows) of dw
    const int64_t e = u / out_chunks, o0 = u % out_chunks * kChunkRows, o_rows = std::min(kChunkRows, g.out - o0);
    float *dw_rows = dw + (e * g.out + o0) * g.in;
    float *db_cols = db ? db + e * g.out + o0 : nullptr;
    if (db_cols) std::fill(db_cols, db_cols + o_rows, 0.f);
    if (runs_of_expert[e].empty()) {
      std::fill(dw_rows, dw_rows + o_rows * g.in, 0.f);
      return;
    }
    float beta = 0.f;
    for (const int64_t r : runs_of_expert[e]) {
      const Run &run = g.runs[r];
      gemm('T', 'N', o_rows, g.in, run.rows, 1.f, dy + run.first * g.out + o0, g.out, g.x + run.first * g.in, g.in,
           beta, dw_rows, g.in);
      beta = 1.f;
      for (int64_t i = 0; db_cols && i < run.rows; ++i) {
        const float *dy_row = dy + (run.first + i) * g.out + o0;
        for (int64_t o = 0; o < o_rows; ++o) db_cols[o] += dy_row[o];
      }
    }
  });
  return 0;
}

}  // namespace

// inputs: x [B, n, in], w [E, out, in] (fp32), ids [B] (int32); output: y [B, n, out].
extern "C" int GroupedMatmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  return grouped_forward(Grouped(params, shapes), nullptr, static_cast<float *>(params[3]));
}

// inputs: x, w, ids (as GroupedMatmul), dy [B, n, out]; outputs: dx [B, n, in], dw [E, out, in].
extern "C" int GroupedMatmulGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  return grouped_backward(Grouped(params, shapes), static_cast<const float *>(params[3]),
                          static_cast<float *>(params[4]), static_cast<float *>(params[5]), nullptr);
}

// GroupedMatmul with each expert's bias: inputs x, w, ids, bias [E, out] (fp32); output y [B, n, out].
extern "C" int GroupedMatmulBias(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  return grouped_forward(Grouped(params, shapes), static_cast<const float *>(params[3]),
                         static_cast<float *>(params[4]));
}

// inputs: x, w, ids, bias (as GroupedMatmulBias), dy [B, n, out]; outputs: dx, dw, db [E, out].
extern "C" int GroupedMatmulBiasGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                     void *stream, void *extra) {
  return grouped_backward(Grouped(params, shapes), static_cast<const float *>(params[4]),
                          static_cast<float *>(params[5]), static_cast<float *>(params[6]),
                          static_cast<float *>(params[7]));
}
