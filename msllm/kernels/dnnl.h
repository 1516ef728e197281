// oneDNN's dnnl_sgemm from the libdnnl MindSpore's CPU backend has already loaded: the GEMMs of kernels that
// do their own blocking around them (grouped_matmul.cc, linear_cross_entropy.cc). It runs on the calling
// thread there, so the kernels' pool splits the work.
#pragma once

#include <dlfcn.h>

#include <cstdint>

namespace msllm_kernels {

// Row-major C = alpha op(A) op(B) + beta C; returns dnnl_status_t (0: success).
typedef int (*DnnlSgemm)(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                     int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

// nullptr when the process has no libdnnl loaded (the kernels then fail with status 1).
inline DnnlSgemm dnnl_sgemm() {
  static const DnnlSgemm fn = [] {
    void *lib = dlopen("libdnnl.so.3", RTLD_NOW | RTLD_NOLOAD);  // only the copy already in the process
    return lib ? reinterpret_cast<DnnlSgemm>(dlsym(lib, "dnnl_sgemm")) : nullptr;
  }();
  return fn;
}

}  // namespace msllm_kernels
