// Training's three GEMM forms (C = op(A) op(B), row-major, any strides) by panels.h's packed GEMM, B packed
// per call.
#include "panels.h"

namespace msllm_kernels {
namespace {

// Runs independent GEMMs (a backward's dx and dW) as one list of units: two passes over the pool, not two each.
void run_gemms(std::vector<Gemm> gemms, int threads) {
  std::vector<int64_t> groups{0}, floats{0};  // packing units (and packed B floats) before each GEMM's
  for (const Gemm &g : gemms) {
    groups.push_back(groups.back() + g.pack_groups());
    floats.push_back(floats.back() + g.panels * g.k * kNr);
  }
  thread_local std::vector<float> packed_b_buffer;
  float *packed = aligned_floats(packed_b_buffer, floats.back());
  for (size_t i = 0; i < gemms.size(); ++i) gemms[i].packed_b = packed + floats[i];
  run_units(groups.back(), [&](int64_t u, int) { const size_t g = gemm_of(groups, u); gemms[g].pack_b(u - groups[g]); },
            threads);
  compute_gemms(gemms, threads);
}

}  // namespace

}  // namespace msllm_kernels

using namespace msllm_kernels;

// inputs: x [m, k], w [n, k] (fp32); output: y [m, n] = x w^T (layers.Linear's matmul).
extern "C" int PackedLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1], n = shapes[1][0];
  if (shapes[1][1] != k) return 1;
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  run_gemms({Gemm{m, n, k, {x, k, 1}, {w, 1, k}, static_cast<float *>(params[2]), n}}, kMaxThreads);
  return 0;
}

// inputs: x, w (as PackedLinear), dy [m, n]; outputs: dx [m, k] = dy w, dw [n, k] = dy^T x.
extern "C" int PackedLinearGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                void *stream, void *extra) {
  const int64_t m = shapes[0][0], k = shapes[0][1], n = shapes[1][0];
  const float *x = static_cast<const float *>(params[0]), *w = static_cast<const float *>(params[1]);
  if (shapes[1][1] != k || shapes[2][0] != m || shapes[2][1] != n) return 1;
  const float *dy = static_cast<const float *>(params[2]);
  run_gemms({Gemm{m, k, n, {dy, n, 1}, {w, k, 1}, static_cast<float *>(params[3]), k},
             Gemm{n, k, m, {dy, 1, n}, {x, k, 1}, static_cast<float *>(params[4]), k}}, kMaxThreads);
  return 0;
}

// For tests and tools/bench_gemm.py: C [m, n] (rows ldc apart) = A B, A's element (i, p) at
// a[i * a_rows + p * a_cols], B's (p, j) at b[p * b_rows + j * b_cols]; on at most `threads` threads.
extern "C" void Sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t a_rows, int64_t a_cols,
                      const float *b, int64_t b_rows, int64_t b_cols, float *c, int64_t ldc, int threads) {
  run_gemms({Gemm{m, n, k, {a, a_rows, a_cols}, {b, b_rows, b_cols}, c, ldc}}, threads);
}
