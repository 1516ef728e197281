// Shared by msllm's fused CPU kernels (cpu_kernels.cc, flash_attention.cc): the thread pool,
// parallel loops and the vectorizable exp / dot helpers. Inline, so each exists once in the library.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <string>
#include <thread>
#include <vector>

namespace msllm_kernels {


inline int64_t numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

constexpr int kMaxThreads = 64;

// A small persistent pool: starting a thread per kernel costs ~35 us, about what a
// [512, 512] AdamW update takes. Workers sleep on a condition variable between kernels (no
// spinning: MindSpore's own threads need the cores). If two kernels run at once (MindSpore
// runs independent kernels concurrently), the second one runs on its calling thread alone.
class Pool {
 public:
  explicit Pool(int workers) {
    for (int id = 1; id <= workers; ++id) threads_.emplace_back([this, id] { Work(id); });
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs task(0 .. n-1), task(0) on the caller. Returns false (running nothing) if the pool is busy.
  template <typename Task>
  bool Run(int n, const Task &task) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = [&task](int id) { task(id); };
      active_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    return true;
  }

 private:
  void Work(int id) {
    // named for tools: top -H, /proc/PID/task/*/comm, tools/profile_step.py --threads-report
    pthread_setname_np(pthread_self(), ("msllm_pool_" + std::to_string(id)).c_str());
    int64_t seen = 0;
    for (;;) {
      std::function<void(int)> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (id >= active_) continue;
        task = task_;
      }
      task(id);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_, done_;
  std::function<void(int)> task_;
  int64_t generation_ = 0;
  int active_ = 0, pending_ = 0;
};

inline Pool &pool() {
  // Never destroyed: worker threads blocked at process exit are harmless, joining them is not.
  static Pool *instance = new Pool(std::min(kMaxThreads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) - 1);
  return *instance;
}

// Runs fn(begin, end, chunk_index) over [0, n) in contiguous chunks, one per pool thread, each
// chunk at least `grain` items (default: 64K elements; below that waking a thread costs more
// than it saves).
template <typename Fn>
void parallel_for(int64_t n, Fn fn, int64_t grain = 1 << 16) {
  const int threads = static_cast<int>(std::min<int64_t>(pool().size(), std::max<int64_t>(1, n / grain)));
  const int64_t chunk = (n + threads - 1) / threads;
  auto run_chunk = [&](int t) { fn(std::min(n, t * chunk), std::min(n, (t + 1) * chunk), t); };
  if (threads == 1 || !pool().Run(threads, run_chunk)) fn(0, n, 0);
}

// Runs fn(unit, thread) for unit in [0, units), units handed out one at a time (for units that differ
// in cost), thread in [0, pool size), on at most max_threads threads. Falls back to the calling thread when
// the pool is busy.
template <typename Fn>
void run_units(int64_t units, Fn fn, int max_threads = kMaxThreads) {
  std::atomic<int64_t> next{0};
  auto work = [&](int thread) {
    for (int64_t u = next++; u < units; u = next++) fn(u, thread);
  };
  const int threads = static_cast<int>(std::min<int64_t>(std::min(pool().size(), max_threads), units));
  if (threads <= 1 || !pool().Run(threads, work)) work(0);
}

// Runs fn(unit, stripe) for every unit, unit u in stripe u % stripes and each stripe's units in order on
// one thread at a time: a per-stripe accumulator (indexed by stripe, not by the thread that ran it) sums
// the same units in the same order whichever thread takes a stripe, so results repeat bit for bit
// (run_units hands units to whichever thread is free, which varies with the machine's load).
template <typename Fn>
void run_stripes(int64_t units, int stripes, Fn fn) {
  run_units(stripes, [&](int64_t stripe, int) {
    for (int64_t u = stripe; u < units; u += stripes) fn(u, static_cast<int>(stripe));
  });
}

// Runs fn(k, lo, hi, t) over the elements of n tensors laid end to end ([lo, hi) within tensor
// k), split evenly across the pool: one kernel call serves a whole list of parameters without a
// thread wake-up per tensor, and small tensors (norm weights) share a chunk with big ones.
template <typename Fn>
void parallel_for_tensors(int n, int *ndims, int64_t **shapes, Fn fn) {
  std::vector<int64_t> start(n + 1, 0);
  for (int k = 0; k < n; ++k) start[k + 1] = start[k] + numel(ndims[k], shapes[k]);
  parallel_for(start[n], [&](int64_t lo, int64_t hi, int t) {
    int k = static_cast<int>(std::upper_bound(start.begin(), start.end(), lo) - start.begin()) - 1;
    for (; k < n && start[k] < hi; ++k) {
      const int64_t a = std::max(lo, start[k]) - start[k], b = std::min(hi, start[k + 1]) - start[k];
      if (a < b) fn(k, a, b, t);
    }
  });
}



// exp(x) for x in [-87, 88] (clamped outside; NaN stays NaN), ~1 ulp, branch-free so loops over it vectorize: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients), 2^n from bits.
inline float exp_approx(float x) {
  x = x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x);  // written so that NaN passes through
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// 8 floats as one GCC vector (an AVX2 ymm, half an AVX-512 zmm): register blocks the compiler keeps in registers.
typedef float Floats8 __attribute__((vector_size(32)));
inline Floats8 load8(const float *p) { Floats8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float *p, Floats8 v) { std::memcpy(p, &v, sizeof v); }

// The lane sums of 8 vectors as one vector, sums[j] = x[j][0] + .. + x[j][7]: halves of pairs added, then
// of quads, then of all eight (summed one vector at a time, its lanes are a chain of 7 scalar adds that the
// column's next step waits on).
inline Floats8 lane_sums(const Floats8 *x) {
  typedef int32_t vec_index __attribute__((vector_size(32)));
  Floats8 pairs[4], quads[2];
  for (int p = 0; p < 4; ++p)
    pairs[p] = __builtin_shuffle(x[2 * p], x[2 * p + 1], vec_index{0, 8, 1, 9, 4, 12, 5, 13}) +
               __builtin_shuffle(x[2 * p], x[2 * p + 1], vec_index{2, 10, 3, 11, 6, 14, 7, 15});
  for (int p = 0; p < 2; ++p)
    quads[p] = __builtin_shuffle(pairs[2 * p], pairs[2 * p + 1], vec_index{0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(pairs[2 * p], pairs[2 * p + 1], vec_index{2, 3, 10, 11, 6, 7, 14, 15});
  return __builtin_shuffle(quads[0], quads[1], vec_index{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(quads[0], quads[1], vec_index{4, 5, 6, 7, 12, 13, 14, 15});
}

// max(top, x[0 .. n)) in two 8-float vectors (GCC vector extension, AVX2's width: a wider one's compares
// gcc lowers to scalar code). Written as 16 scalar lanes it stayed scalar: gcc split the lanes into 16 select
// chains, and a float select is no max reduction to it without -ffinite-math-only. NaNs are skipped as
// `x > top ? x : top` skips them.
inline float lane_max(const float *x, int64_t n, float top) {
  Floats8 m0 = Floats8{} + top, m1 = m0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const Floats8 v0 = load8(x + j), v1 = load8(x + j + 8);
    m0 = v0 > m0 ? v0 : m0;
    m1 = v1 > m1 ? v1 : m1;
  }
  for (; j < n; ++j) top = x[j] > top ? x[j] : top;
  for (int k = 0; k < 8; ++k) top = m0[k] > top ? m0[k] : top, top = m1[k] > top ? m1[k] : top;
  return top;
}

// sum_j a[j] * b[j] (* c[j]) in 16 independent lanes, so it vectorizes without -ffast-math.
template <bool kThree>
inline float lane_dot(const float *__restrict a, const float *__restrict b, const float *__restrict c, int64_t n) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += a[j + k] * b[j + k] * (kThree ? c[j + k] : 1.f);
  float sum = 0.f;
  for (; j < n; ++j) sum += a[j] * b[j] * (kThree ? c[j] : 1.f);
  for (int k = 0; k < kLanes; ++k) sum += lane[k];
  return sum;
}


}  // namespace msllm_kernels
