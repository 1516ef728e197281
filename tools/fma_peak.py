"""This CPU's fp32 multiply-add peak: the ceiling a GEMM's GFLOP/s is read against (benchmarks name it).

Compiles a loop of independent fused multiply-adds on the widest vectors the kernel build targets (-march as
msllm/kernels/build.py: 8 floats with AVX2, 16 with AVX-512) and runs it on one thread, then on every core at
once (an all-core run shows a frequency drop that one core does not). 12 independent chains hide the FMA
latency on the cores we run on (4-5 cycles, 2 FMA units).

    python tools/fma_peak.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from msllm.kernels import build  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__)
typedef __m512 vec;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#define LANES 16
#else
typedef __m256 vec;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#define LANES 8
#endif
enum { CHAINS = 12 };
static const long kSteps = 200000000L;
static double seconds(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *run(void *out) {
  vec acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = SET(1.0f + 0.1f * c);  /* distinct, or the compiler merges chains */
  const vec x = SET(0.999999f), y = SET(1e-7f);
  const double start = seconds();
  for (long i = 0; i < kSteps; ++i)
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = FMA(acc[c], x, y);
  const double took = seconds() - start;
  float sink[LANES];
  vec sum = acc[0];
  for (int c = 1; c < CHAINS; ++c) sum = sum + acc[c];
  memcpy(sink, &sum, sizeof sink);
  *(double *)out = 2.0 * LANES * CHAINS * kSteps / took / 1e9 + 0.0 * sink[0];
  return NULL;
}
int main(int argc, char **argv) {
  const int threads = atoi(argv[1]);
  pthread_t id[256];
  double rate[256];
  for (int t = 0; t < threads; ++t) pthread_create(&id[t], NULL, run, &rate[t]);
  double total = 0;
  for (int t = 0; t < threads; ++t) { pthread_join(id[t], NULL); total += rate[t]; }
  printf("%.1f\n", total);
  return 0;
}
"""


def peak(binary: Path, threads: int) -> float:
    return float(subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout)


def main() -> int:
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "fma.c", Path(tmp) / "fma"
        source.write_text(SOURCE)
        arch = [f for f in build.flags() if f.startswith("-march")]
        subprocess.run(["gcc", "-O3", *arch, str(source), "-o", str(binary), "-pthread"], check=True)
        one, every = peak(binary, 1), peak(binary, cores)
    print(f"fp32 FMA peak (-march={build.march()}): one core {one:.0f} GFLOP/s; {cores} cores at once {every:.0f} "
          f"GFLOP/s ({every / cores:.0f} a core)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
