// The packed fp32 GEMM (the published BLIS scheme), shared by sgemm.cc (training's GEMMs) and cpu_kernels.cc
// (a decode step's projections of few rows, with B packed once and kept): B packed into 16-column panels
// [k][16], A into 6-row panels [kc][6], and a kRows x 16 micro-kernel (6 rows: 12 ymm accumulators, 2 B loads
// and 6 A broadcasts a step) over kc-deep slices, so a B panel slice stays in L1 and the A block in L2.
// A GEMM's work is units of (row block, column chunk) claimed from an atomic counter (run_units): when the
// pool is busy (MindSpore running another kernel at the same time) the calling thread takes them all.
#pragma once
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace msllm_kernels {

constexpr int64_t kMr = 6, kNr = 16;  // micro-kernel tile: rows of A x columns of B
constexpr int64_t kKc = 256;          // depth of a slice: a B micro-panel slice is 16 KB (L1 32 KB)
constexpr int64_t kMc = 144;          // rows of A per block: 144 KB packed (L2 512 KB)
constexpr int64_t kNc = 512;          // columns per unit: enough units for two threads at W1's shapes
constexpr int64_t kWholeA = 32768;    // floats of a packed A block (128 KB) that L2 holds whole: k in one slice
constexpr int64_t kPackPanels = 4;    // B's panels per unit of packing: a row of B read 256 bytes at a time
constexpr int64_t kAhead = 512;       // floats of B requested ahead of the micro-kernel (2 KB)

struct Matrix {  // element (i, j) at data[i * rows + j * cols]
  const float *data;
  int64_t rows, cols;
  float at(int64_t i, int64_t j) const { return data[i * rows + j * cols]; }
};

#if defined(__AVX2__) && defined(__FMA__)
// r[q] becomes column q of the 8 x 8 block whose rows r held.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
}
#endif

// Columns [j0, j0 + 16 count) of B's rows [0, k) into `count` panels [k][16] end to end, zeros past column n.
inline void pack_b_panels(const Matrix &b, int64_t k, int64_t n, int64_t j0, int64_t count, float *panels) {
  // rows contiguous: the whole panels along each row (one panel's rows are far apart), 16 floats at a time
  const int64_t copied = b.cols == 1 ? std::min(count, (n - j0) / kNr) : 0;
  for (int64_t p = 0; p < k; ++p)
    for (int64_t q = 0; q < copied; ++q)
      std::memcpy(panels + (q * k + p) * kNr, b.data + p * b.rows + j0 + q * kNr, kNr * sizeof(float));
  for (int64_t q = copied; q < count; ++q) {
    float *panel = panels + q * k * kNr;
    const int64_t first = j0 + q * kNr, width = std::min(kNr, n - first);
    int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (b.rows == 1 && width == kNr)  // columns contiguous (B = W^T): 8 x 8 blocks transposed
      for (; p + 8 <= k; p += 8)
        for (int64_t h = 0; h < kNr; h += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(b.data + (first + h + j) * b.cols + p);
          transpose8x8(r);
          for (int i = 0; i < 8; ++i) _mm256_store_ps(panel + (p + i) * kNr + h, r[i]);
        }
#endif
    for (; p < k; ++p)
      for (int64_t j = 0; j < kNr; ++j) panel[p * kNr + j] = j < width ? b.at(p, first + j) : 0.f;
  }
}

// Rows [i0, i0 + rows) x columns [p0, p0 + kc) of A into 6-row panels [kc][6], zeros past row m.
inline void pack_a_block(const Matrix &a, int64_t m, int64_t i0, int64_t rows, int64_t p0, int64_t kc, float *block) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMr, block += kc * kMr) {
    const int64_t height = std::min(kMr, m - i0 - r0);
    const float *first = a.data + (i0 + r0) * a.rows + p0 * a.cols;  // element (i0 + r0, p0)
    int64_t p = 0;
    if (height == kMr && a.rows == 1)  // a panel's 6 rows contiguous at each p
      for (; p < kc; ++p) std::memcpy(block + p * kMr, first + p * a.cols, kMr * sizeof(float));
#if defined(__AVX2__) && defined(__FMA__)
    if (height == kMr && a.cols == 1)  // rows contiguous: 8 x 8 blocks (2 rows zero) transposed, 6 of each kept
      for (; p + 8 <= kc; p += 8) {
        __m256 r[8];
        for (int i = 0; i < kMr; ++i) r[i] = _mm256_loadu_ps(first + i * a.rows + p);
        r[6] = r[7] = _mm256_setzero_ps();
        transpose8x8(r);
        for (int q = 0; q < 8; ++q) {
          _mm_storeu_ps(block + (p + q) * kMr, _mm256_castps256_ps128(r[q]));
          _mm_storel_pi(reinterpret_cast<__m64 *>(block + (p + q) * kMr + 4), _mm256_extractf128_ps(r[q], 1));
        }
      }
#endif
    for (; p < kc; ++p)
      for (int64_t r = 0; r < kMr; ++r) block[p * kMr + r] = r < height ? a.at(i0 + r0 + r, p0 + p) : 0.f;
  }
}

// tile[kRows][16] = (accumulate ? tile : 0) + a[kc][6]^T b[kc][16] over a's first kRows rows; tile rows ldt apart.
// stream: b is read once, from memory (a few rows' panels), and requested ahead.
#if defined(__AVX2__) && defined(__FMA__)
template <int kRows>
inline void micro_kernel(int64_t kc, const float *a, const float *b, float *tile, int64_t ldt, bool accumulate,
                         bool stream) {
  __m256 c[kRows][2];
  for (int r = 0; r < kRows; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
  for (int r = 0; r < kRows; ++r) {  // the tile's rows arrive while the loop runs
    _mm_prefetch(reinterpret_cast<const char *>(tile + r * ldt), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(tile + r * ldt + kNr - 1), _MM_HINT_T0);
  }
#pragma GCC unroll 4
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr) {
    // a line of B a step: the hardware prefetcher stops at each 4 KB page (a slice of B reused from L1: none)
    if (stream) _mm_prefetch(reinterpret_cast<const char *>(b + kAhead), _MM_HINT_T0);
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r);
      c[r][0] = _mm256_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
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
template <int kRows>
inline void micro_kernel(int64_t kc, const float *a, const float *b, float *tile, int64_t ldt, bool accumulate,
                         bool stream) {
  float c[kRows][kNr] = {};
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr)
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kNr; ++j) c[r][j] += a[r] * b[j];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kNr; ++j) tile[r * ldt + j] = (accumulate ? tile[r * ldt + j] : 0.f) + c[r][j];
}
#endif

// The micro-kernel for a tile of `rows` (1 .. 6) rows: a short last tile does only its own rows' work.
inline void micro_kernel_rows(int64_t rows, int64_t kc, const float *a, const float *b, float *tile, int64_t ldt,
                              bool accumulate, bool stream) {
  switch (rows) {
    case 6: micro_kernel<6>(kc, a, b, tile, ldt, accumulate, stream); break;
    case 5: micro_kernel<5>(kc, a, b, tile, ldt, accumulate, stream); break;
    case 4: micro_kernel<4>(kc, a, b, tile, ldt, accumulate, stream); break;
    case 3: micro_kernel<3>(kc, a, b, tile, ldt, accumulate, stream); break;
    case 2: micro_kernel<2>(kc, a, b, tile, ldt, accumulate, stream); break;
    case 1: micro_kernel<1>(kc, a, b, tile, ldt, accumulate, stream); break;
  }
}

inline float *aligned_floats(std::vector<float> &buffer, int64_t n) {  // 32-byte aligned start, n floats
  if (static_cast<int64_t>(buffer.size()) < n + 8) buffer.resize(n + 8);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((32 - at % 32) % 32) / sizeof(float);
}

// C [m, n] (rows ldc apart) = A [m, k] B [k, n] as units of work: B's panels (packed_b: panels x [k][16],
// 32-byte aligned) packed by pack_b or given, then C's tiles by compute. A is packed slice by slice in each
// unit, or once for them all (packed_a, from pack_a: one row block's slices end to end).
struct Gemm {
  int64_t m, n, k;
  Matrix a, b;
  float *c;
  int64_t ldc;
  int64_t chunk_panels = kNc / kNr;  // panels per unit
  float *packed_b = nullptr;
  const float *packed_a = nullptr;
  int64_t panels = (n + kNr - 1) / kNr;
  // Row blocks of equal height (a multiple of 6), column chunks of whole panels.
  int64_t row_blocks = std::max<int64_t>(1, (m + kMc - 1) / kMc);
  int64_t block_rows = ((m + row_blocks - 1) / row_blocks + kMr - 1) / kMr * kMr;
  // Slice depth: all of k when L2 holds the A block (a few rows): then B streams from memory panel after panel.
  int64_t depth = block_rows * k <= kWholeA ? std::max<int64_t>(1, k) : kKc;

  int64_t chunks() const { return (panels + chunk_panels - 1) / chunk_panels; }
  int64_t tiles() const { return row_blocks * chunks(); }

  // B's panels [kPackPanels g, kPackPanels (g + 1)).
  int64_t pack_groups() const { return (panels + kPackPanels - 1) / kPackPanels; }
  void pack_b(int64_t g) const {
    const int64_t j = g * kPackPanels;
    pack_b_panels(b, k, n, j * kNr, std::min(kPackPanels, panels - j), packed_b + j * k * kNr);
  }

  // A, one row block (m <= kMc), packed as compute reads it: block_rows * k floats.
  int64_t packed_a_size() const { return block_rows * k; }
  void pack_a(float *to) const {
    for (int64_t p0 = 0; p0 < k; p0 += depth) pack_a_block(a, m, 0, m, p0, std::min(depth, k - p0), to + p0 * block_rows);
  }

  // Rows [i0, i0 + rows) x one column chunk of C, slice by slice of k.
  void compute(int64_t unit) const {
    thread_local std::vector<float> packed_a_buffer;
    float *a_block = aligned_floats(packed_a_buffer, block_rows * depth);
    const int64_t i0 = unit / chunks() * block_rows, rows = std::min(block_rows, m - i0);
    const int64_t first_panel = unit % chunks() * chunk_panels, last_panel = std::min(panels, first_panel + chunk_panels);
    if (k == 0) {
      const int64_t j_end = std::min(n, last_panel * kNr);
      for (int64_t i = i0; i < i0 + rows; ++i) std::fill(c + i * ldc + first_panel * kNr, c + i * ldc + j_end, 0.f);
      return;
    }
    float edge[kMr * kNr];
    for (int64_t p0 = 0; p0 < k; p0 += depth) {
      const int64_t kc = std::min(depth, k - p0);
      const float *a_slice = packed_a ? packed_a + p0 * block_rows : a_block;
      if (!packed_a) pack_a_block(a, m, i0, rows, p0, kc, a_block);
      for (int64_t j = first_panel; j < last_panel; ++j) {
        const float *b_slice = packed_b + (j * k + p0) * kNr;
        const int64_t width = std::min(kNr, n - j * kNr);
        for (int64_t r0 = 0; r0 < rows; r0 += kMr) {
          const int64_t height = std::min(kMr, rows - r0);
          float *tile = c + (i0 + r0) * ldc + j * kNr;
          if (width == kNr) {
            micro_kernel_rows(height, kc, a_slice + r0 * kc, b_slice, tile, ldc, p0 > 0, kc == k);
            continue;
          }
          for (int64_t r = 0; r < height; ++r)  // a tile past C's last column: through a full-width copy
            std::copy(tile + r * ldc, tile + r * ldc + width, edge + r * kNr);
          micro_kernel_rows(height, kc, a_slice + r0 * kc, b_slice, edge, kNr, p0 > 0, kc == k);
          for (int64_t r = 0; r < height; ++r) std::copy(edge + r * kNr, edge + r * kNr + width, tile + r * ldc);
        }
      }
    }
  }
};

// The unit of a list of GEMMs laid end to end that `unit` is: its GEMM's index, given each GEMM's first unit.
inline size_t gemm_of(const std::vector<int64_t> &starts, int64_t unit) {
  return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), unit) - starts.begin()) - 1;
}

// Computes independent GEMMs whose B is packed (packed_b set) as one list of units: one pass over the pool.
inline void compute_gemms(const std::vector<Gemm> &gemms, int threads) {
  std::vector<int64_t> tiles{0};  // units before each GEMM's
  for (const Gemm &g : gemms) tiles.push_back(tiles.back() + g.tiles());
  run_units(tiles.back(), [&](int64_t u, int) { const size_t g = gemm_of(tiles, u); gemms[g].compute(u - tiles[g]); },
            threads);
}

}  // namespace msllm_kernels
