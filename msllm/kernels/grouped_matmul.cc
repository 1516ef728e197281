// Grouped matmul for MoE experts (msllm.models.moe.BlockDispatch): block i of rows is expert ids[i]'s,
//   y[i] = x[i] @ w[ids[i]]^T        x [B, n, in], w [E, out, in], ids [B] -> y [B, n, out]
// Adjacent blocks of one expert are one run, and a run is one GEMM that reads its expert's weights
// once: the portable form gathers [B, out, in] weight copies, one per block, and its backward
// scatters [B, out, in] gradients back into [E, out, in]. The GEMMs are oneDNN's dnnl_sgemm from
// the libdnnl MindSpore's CPU backend has already loaded (it runs on the calling thread there, so
// the pool splits the work).
#include <dlfcn.h>

#include "common.h"

using namespace msllm_kernels;

namespace {

// dnnl_sgemm: row-major C = alpha op(A) op(B) + beta C; returns dnnl_status_t (0: success).
typedef int (*Sgemm)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                     int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

Sgemm sgemm() {
  static const Sgemm fn = [] {
    void *lib = dlopen("libdnnl.so.3", RTLD_NOW | RTLD_NOLOAD);  // only the copy already in the process
    return lib ? reinterpret_cast<Sgemm>(dlsym(lib, "dnnl_sgemm")) : nullptr;
  }();
  return fn;
}

constexpr int64_t kChunkRows = 256;  // rows of x (or of dw) per work unit: two threads share a run

struct Run {
  int64_t expert, first, rows;  // rows [first, first + rows) of the flat [B * n] rows are expert's
};

std::vector<Run> runs_of(const int32_t *ids, int64_t blocks, int64_t n) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < blocks; ++i) {
    if (runs.empty() || runs.back().expert != ids[i]) runs.push_back({ids[i], i * n, 0});
    runs.back().rows += n;
  }
  return runs;
}

// Row chunks of the runs: (run, first row within it), kChunkRows each.
std::vector<std::pair<int64_t, int64_t>> chunks_of(const std::vector<Run> &runs) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r)
    for (int64_t lo = 0; lo < runs[r].rows; lo += kChunkRows) chunks.push_back({r, lo});
  return chunks;
}

bool ids_valid(const int32_t *ids, int64_t blocks, int64_t experts) {
  for (int64_t i = 0; i < blocks; ++i)
    if (ids[i] < 0 || ids[i] >= experts) return false;
  return true;
}

}  // namespace

// inputs: x [B, n, in], w [E, out, in] (fp32), ids [B] (int32); output: y [B, n, out].
extern "C" int GroupedMatmul(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  const Sgemm gemm = sgemm();
  const int64_t blocks = shapes[0][0], n = shapes[0][1], in = shapes[0][2], experts = shapes[1][0];
  const int64_t out = shapes[1][1];
  const auto *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const auto *ids = static_cast<const int32_t *>(params[2]);
  auto *y = static_cast<float *>(params[3]);
  if (!gemm || !ids_valid(ids, blocks, experts)) return 1;
  const auto runs = runs_of(ids, blocks, n);
  const auto chunks = chunks_of(runs);
  run_units(chunks.size(), [&](int64_t u, int) {
    const Run &run = runs[chunks[u].first];
    const int64_t row = run.first + chunks[u].second, rows = std::min(kChunkRows, run.rows - chunks[u].second);
    gemm('N', 'T', rows, out, in, 1.f, x + row * in, in, w + run.expert * out * in, in, 0.f, y + row * out, out);
  });
  return 0;
}

// inputs: x, w, ids (as GroupedMatmul), dy [B, n, out]; outputs: dx [B, n, in], dw [E, out, in].
// dx[i] = dy[i] @ w[ids[i]]; dw[e] = the sum over e's runs of dy_run^T @ x_run (0 for an expert no
// block is for). A dw unit owns some of e's output rows across all its runs: no two threads write
// the same rows.
extern "C" int GroupedMatmulGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *stream, void *extra) {
  const Sgemm gemm = sgemm();
  const int64_t blocks = shapes[0][0], n = shapes[0][1], in = shapes[0][2], experts = shapes[1][0];
  const int64_t out = shapes[1][1];
  const auto *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  const auto *ids = static_cast<const int32_t *>(params[2]);
  const auto *dy = static_cast<const float *>(params[3]);
  auto *dx = static_cast<float *>(params[4]), *dw = static_cast<float *>(params[5]);
  if (!gemm || !ids_valid(ids, blocks, experts)) return 1;
  const auto runs = runs_of(ids, blocks, n);
  const auto chunks = chunks_of(runs);
  std::vector<std::vector<int64_t>> runs_of_expert(experts);
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) runs_of_expert[runs[r].expert].push_back(r);
  const int64_t out_chunks = (out + kChunkRows - 1) / kChunkRows;
  // units: the dx row chunks, then (expert, output-row chunk) of dw
  run_units(chunks.size() + experts * out_chunks, [&](int64_t u, int) {
    if (u < static_cast<int64_t>(chunks.size())) {
      const Run &run = runs[chunks[u].first];
      const int64_t row = run.first + chunks[u].second, rows = std::min(kChunkRows, run.rows - chunks[u].second);
      gemm('N', 'N', rows, in, out, 1.f, dy + row * out, out, w + run.expert * out * in, in, 0.f, dx + row * in, in);
      return;
    }
    u -= chunks.size();
    const int64_t e = u / out_chunks, o0 = u % out_chunks * kChunkRows, o_rows = std::min(kChunkRows, out - o0);
    float *dw_rows = dw + (e * out + o0) * in;
    if (runs_of_expert[e].empty()) {
      std::fill(dw_rows, dw_rows + o_rows * in, 0.f);
      return;
    }
    float beta = 0.f;
    for (const int64_t r : runs_of_expert[e]) {
      gemm('T', 'N', o_rows, in, runs[r].rows, 1.f, dy + runs[r].first * out + o0, out, x + runs[r].first * in, in,
           beta, dw_rows, in);
      beta = 1.f;
    }
  });
  return 0;
}
