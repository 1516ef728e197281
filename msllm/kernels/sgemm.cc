// A packed fp32 GEMM for training's three forms (C = op(A) op(B), row-major, any strides), the published
// BLIS scheme: B packed once into 16-column panels [k][16], each unit of work packs a block of A rows into
// 6-row panels [kc][6] and runs a 6 x 16 micro-kernel (12 ymm accumulators, 2 B loads and 6 A broadcasts
// a step) over kc-deep slices, so a B panel slice stays in L1 and the A block in L2.
// Units are (row block, column chunk) tiles claimed from an atomic counter (run_units): when the pool is
// busy (MindSpore running another kernel at the same time) the calling thread takes them all.
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace msllm_kernels {
namespace {

constexpr int64_t kMr = 6, kNr = 16;  // micro-kernel tile: rows of A x columns of B
constexpr int64_t kKc = 256;          // depth of a slice: a B micro-panel slice is 16 KB (L1 32 KB)
constexpr int64_t kMc = 144;          // rows of A per block: 144 KB packed (L2 512 KB)
constexpr int64_t kNc = 512;          // columns per unit: enough units for two threads at W1's shapes

struct Matrix {  // element (i, j) at data[i * rows + j * cols]
  const float *data;
  int64_t rows, cols;
  float at(int64_t i, int64_t j) const { return data[i * rows + j * cols]; }
};

// Columns [j0, j0 + 16) of B's rows [0, k) into panel[k][16], zeros past column n.
void pack_b_panel(const Matrix &b, int64_t k, int64_t n, int64_t j0, float *panel) {
  const int64_t width = std::min(kNr, n - j0);
  if (b.cols == 1 && width == kNr) {  // rows contiguous: copy 16 at a time
    for (int64_t p = 0; p < k; ++p) std::memcpy(panel + p * kNr, b.data + p * b.rows + j0, kNr * sizeof(float));
    return;
  }
  for (int64_t p = 0; p < k; ++p)
    for (int64_t j = 0; j < kNr; ++j) panel[p * kNr + j] = j < width ? b.at(p, j0 + j) : 0.f;
}

// Rows [i0, i0 + rows) x columns [p0, p0 + kc) of A into 6-row panels [kc][6], zeros past row m.
void pack_a_block(const Matrix &a, int64_t m, int64_t i0, int64_t rows, int64_t p0, int64_t kc, float *block) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMr, block += kc * kMr) {
    const int64_t height = std::min(kMr, m - i0 - r0);
    for (int64_t p = 0; p < kc; ++p)
      for (int64_t r = 0; r < kMr; ++r) block[p * kMr + r] = r < height ? a.at(i0 + r0 + r, p0 + p) : 0.f;
  }
}

// tile[6][16] = (accumulate ? tile : 0) + a[kc][6]^T b[kc][16]; tile rows ldt apart.
#if defined(__AVX2__) && defined(__FMA__)
void micro_kernel(int64_t kc, const float *a, const float *b, float *tile, int64_t ldt, bool accumulate) {
  __m256 c[kMr][2];
  for (int r = 0; r < kMr; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int r = 0; r < kMr; ++r) {  // the tile's rows arrive while the loop runs
    _mm_prefetch(reinterpret_cast<const char *>(tile + r * ldt), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(tile + r * ldt + kNr - 1), _MM_HINT_T0);
  }
#pragma GCC unroll 4
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kMr; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r);
      c[r][0] = _mm256_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  for (int r = 0; r < kMr; ++r) {
    float *row = tile + r * ldt;
    if (accumulate) {
      c[r][0] = _mm256_add_ps(c[r][0], _mm256_loadu_ps(row));
      c[r][1] = _mm256_add_ps(c[r][1], _mm256_loadu_ps(row + 8));
    }
    _mm256_storeu_ps(row, c[r][0]);
    _mm256_storeu_ps(row + 8, c[r][1]);
  }
}
#else
void micro_kernel(int64_t kc, const float *a, const float *b, float *tile, int64_t ldt, bool accumulate) {
  float c[kMr][kNr] = {};
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr)
    for (int r = 0; r < kMr; ++r)
      for (int j = 0; j < kNr; ++j) c[r][j] += a[r] * b[j];
  for (int r = 0; r < kMr; ++r)
    for (int j = 0; j < kNr; ++j) tile[r * ldt + j] = (accumulate ? tile[r * ldt + j] : 0.f) + c[r][j];
}
#endif

float *aligned_floats(std::vector<float> &buffer, int64_t n) {  // 32-byte aligned start, n floats
  if (static_cast<int64_t>(buffer.size()) < n + 8) buffer.resize(n + 8);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((32 - at % 32) % 32) / sizeof(float);
}

// C [m, n] (rows ldc apart) = A [m, k] B [k, n]: its work as units, B's panels first, then C's tiles.
struct Gemm {
  int64_t m, n, k;
  Matrix a, b;
  float *c;
  int64_t ldc;
  int64_t panels = (n + kNr - 1) / kNr;
  // Row blocks of equal height (a multiple of 6), column chunks of whole panels.
  int64_t row_blocks = std::max<int64_t>(1, (m + kMc - 1) / kMc);
  int64_t block_rows = ((m + row_blocks - 1) / row_blocks + kMr - 1) / kMr * kMr;
  int64_t chunk_panels = kNc / kNr, chunks = (panels + chunk_panels - 1) / chunk_panels;
  float *packed_b = nullptr;  // panels x [k][16]

  int64_t tiles() const { return row_blocks * chunks; }

  void pack_b(int64_t j) const { pack_b_panel(b, k, n, j * kNr, packed_b + j * k * kNr); }

  // Rows [i0, i0 + rows) x one column chunk of C, slice by slice of k.
  void compute(int64_t unit) const {
    thread_local std::vector<float> packed_a_buffer;
    float *packed_a = aligned_floats(packed_a_buffer, block_rows * kKc);
    const int64_t i0 = unit / chunks * block_rows, rows = std::min(block_rows, m - i0);
    const int64_t first_panel = unit % chunks * chunk_panels, last_panel = std::min(panels, first_panel + chunk_panels);
    if (k == 0) {
      const int64_t j_end = std::min(n, last_panel * kNr);
      for (int64_t i = i0; i < i0 + rows; ++i) std::fill(c + i * ldc + first_panel * kNr, c + i * ldc + j_end, 0.f);
      return;
    }
    float edge[kMr * kNr];
    for (int64_t p0 = 0; p0 < k; p0 += kKc) {
      const int64_t kc = std::min(kKc, k - p0);
      pack_a_block(a, m, i0, rows, p0, kc, packed_a);
      for (int64_t j = first_panel; j < last_panel; ++j) {
        const float *b_slice = packed_b + (j * k + p0) * kNr;
        const int64_t width = std::min(kNr, n - j * kNr);
        for (int64_t r0 = 0; r0 < rows; r0 += kMr) {
          const int64_t height = std::min(kMr, rows - r0);
          float *tile = c + (i0 + r0) * ldc + j * kNr;
          if (height == kMr && width == kNr) {
            micro_kernel(kc, packed_a + r0 * kc, b_slice, tile, ldc, p0 > 0);
            continue;
          }
          for (int64_t r = 0; r < height; ++r)  // a tile past C's edge: through a full-size copy
            std::copy(tile + r * ldc, tile + r * ldc + width, edge + r * kNr);
          micro_kernel(kc, packed_a + r0 * kc, b_slice, edge, kNr, p0 > 0);
          for (int64_t r = 0; r < height; ++r) std::copy(edge + r * kNr, edge + r * kNr + width, tile + r * ldc);
        }
      }
    }
  }
};

// Runs independent GEMMs (a backward's dx and dW) as one list of units: two passes over the pool, not two each.
void run_gemms(std::vector<Gemm> gemms, int threads) {
  std::vector<int64_t> panels{0}, tiles{0}, floats{0};  // units (and packed B floats) before each GEMM's
  for (const Gemm &g : gemms) {
    panels.push_back(panels.back() + g.panels);
    tiles.push_back(tiles.back() + g.tiles());
    floats.push_back(floats.back() + g.panels * g.k * kNr);
  }
  thread_local std::vector<float> packed_b_buffer;
  float *packed = aligned_floats(packed_b_buffer, floats.back());
  for (size_t i = 0; i < gemms.size(); ++i) gemms[i].packed_b = packed + floats[i];
  auto which = [](const std::vector<int64_t> &starts, int64_t unit) {
    return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), unit) - starts.begin()) - 1;
  };
  run_units(panels.back(), [&](int64_t u, int) { const size_t g = which(panels, u); gemms[g].pack_b(u - panels[g]); },
            threads);
  run_units(tiles.back(), [&](int64_t u, int) { const size_t g = which(tiles, u); gemms[g].compute(u - tiles[g]); },
            threads);
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
