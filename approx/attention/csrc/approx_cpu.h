// What approx's C++ kernels share (lsh_rounds.cpp, block_band.cpp): the BLAS products and the vectorised row
// reductions of a softmax. See approx/attention/_cpp.py for how the kernels are built.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

// The Fortran BLAS that libtorch_cpu exports (MKL in torch's x86 wheels)
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*);
}

namespace approx_cpu {

// Column-major BLAS: C (m x n) = alpha op(A) op(B) + beta C.
inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// The largest of s[0:n] (-inf for none).
template <typename T>
inline T row_max(const T* s, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  T m = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= Vec::size()) {
    Vec acc(m);
    for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(s + j));
    m = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, acc);
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - m) in place (torch's fast vector exp, documented within 20 ulp; measured as accurate as the
// plain-torch paths' softmax here); returns their sum.
template <typename T>
inline T exp_sum(T* s, T m, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const Vec top(m);
  T sum = 0;
  int64_t j = 0;
  if (n >= Vec::size()) {
    Vec acc(T(0));
    for (; j + Vec::size() <= n; j += Vec::size()) {
      const Vec p = (Vec::loadu(s + j) - top).exp_u20();
      p.store(s + j);
      acc = acc + p;
    }
    sum = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc);
  }
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

}  // namespace approx_cpu
