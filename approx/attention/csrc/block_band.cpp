// BigBird's query blocks against their neighbouring, listed and shared keys, for CPU inference: approx's block-band
// kernel (approx/attention/_blockband.py) with kernel="fused".
//
// _blockband.py prepares one batch row (its tokens in the pattern's order, the key blocks each query block lists,
// the -inf biases of keys it may not use, the shared keys) and hands this kernel the heads' query blocks [lo, hi).
// Per (head, query block t), one task of at::parallel_for: the scores against the 2a + 1 neighbouring key blocks
// (t - a .. t + a: contiguous rows, read in place), the R listed blocks (gathered into a small buffer) and the G
// shared keys (read in place) go side by side into one (block x W) buffer by BLAS products, the block's bias row is
// added, the softmax is taken row by row in vector registers (a row with no key left gives 0), and the output rows
// are the sum of the three products with the values, written in place. Read _blockband.py's docstring first.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "approx_cpu.h"

namespace {

using approx_cpu::exp_sum;
using approx_cpu::gemm;
using approx_cpu::row_max;

// Row-major scores S[:, col:col+w] (ld ldc) = scale * Q (rows x d, ld ldq) K^T (K: w x d, ld ldk).
template <typename T>
inline void scores(const T* q, int64_t ldq, const T* k, int64_t ldk, int64_t rows, int64_t w, int64_t d, T scale,
                   T* s, int64_t ldc) {
  if (w > 0) gemm('T', 'N', int(w), int(rows), int(d), scale, k, int(ldk), q, int(ldq), T(0), s, int(ldc));
}

// Row-major O (rows x dv, ld ldo) (+)= P[:, col:col+w] (ld ldp) V (w x dv, ld ldv).
template <typename T>
inline void values(const T* p, int64_t ldp, const T* v, int64_t ldv, int64_t rows, int64_t w, int64_t dv, T beta,
                   T* o, int64_t ldo) {
  if (w > 0) gemm('N', 'N', int(dv), int(rows), int(w), T(1), v, int(ldv), p, int(ldp), beta, o, int(ldo));
}

// row[j] += bias[j] for j < nb; then the softmax of row[0:n] in place (a row without a finite score gives 0).
template <typename T>
inline void biased_softmax(T* row, const T* bias, int64_t nb, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + Vec::size() <= nb; j += Vec::size()) (Vec::loadu(row + j) + Vec::loadu(bias + j)).store(row + j);
  for (; j < nb; ++j) row[j] += bias[j];
  const T m = row_max(row, n);
  if (m == neg_inf) {
    std::fill(row, row + n, T(0));
    return;
  }
  const T sum = exp_sum(row, m, n);
  const Vec inv(T(1) / sum);
  j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(row + j) * inv).store(row + j);
  for (; j < n; ++j) row[j] /= sum;
}

template <typename T>
void band_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks,
                 const torch::Tensor& vs, const torch::Tensor& ids, const torch::Tensor& bias, torch::Tensor& out,
                 int64_t lo, int64_t hi, int64_t a, int64_t blk, int64_t kv_offset, int64_t rows_limit, T scale) {
  const int64_t heads = q.size(0), d = q.size(2), dv = v.size(2), r = ids.size(2), g = ks.size(1);
  const int64_t near = (2 * a + 1) * blk, listed = r * blk, width = near + listed + g;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* ksp = g ? ks.data_ptr<T>() : nullptr;
  const T* vsp = g ? vs.data_ptr<T>() : nullptr;
  const int64_t* idp = ids.data_ptr<int64_t>();
  const T* bp = bias.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qh = q.stride(0), qr = q.stride(1), kh = k.stride(0), kr = k.stride(1), vh = v.stride(0),
                vr = v.stride(1), oh = out.stride(0), orow = out.stride(1);
  const int64_t ksh = g ? ks.stride(0) : 0, ksr = g ? ks.stride(1) : 0, vsh = g ? vs.stride(0) : 0,
                vsr = g ? vs.stride(1) : 0;
  const bool shared_ids = ids.size(0) == 1, shared_bias = bias.size(0) == 1;
  const int64_t blocks = hi - lo;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t x0, int64_t x1) {
    std::vector<T> sc(blk * width), kl(std::max<int64_t>(listed, 1) * d), vl(std::max<int64_t>(listed, 1) * dv),
        ob(blk * dv);
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t h = x / blocks, t = lo + x % blocks;
      const T* qb = qp + h * qh + t * blk * qr;
      const T* kn = kp + h * kh + ((t - a) * blk + kv_offset) * kr;  // the neighbouring blocks' rows
      const T* vn = vp + h * vh + ((t - a) * blk + kv_offset) * vr;
      const int64_t* id = idp + ((shared_ids ? 0 : h) * ids.size(1) + t) * r;
      for (int64_t i = 0; i < r; ++i) {  // the listed blocks, gathered
        const int64_t row0 = id[i] * blk + kv_offset;
        for (int64_t j = 0; j < blk; ++j) {
          std::memcpy(&kl[(i * blk + j) * d], kp + h * kh + (row0 + j) * kr, sizeof(T) * d);
          std::memcpy(&vl[(i * blk + j) * dv], vp + h * vh + (row0 + j) * vr, sizeof(T) * dv);
        }
      }
      T* s = sc.data();
      scores(qb, qr, kn, kr, blk, near, d, scale, s, width);
      scores(qb, qr, kl.data(), d, blk, listed, d, scale, s + near, width);
      if (g) scores(qb, qr, ksp + h * ksh, ksr, blk, g, d, scale, s + near + listed, width);
      const T* brow = bp + ((shared_bias ? 0 : h) * bias.size(1) + t) * (near + listed);
      for (int64_t i = 0; i < blk; ++i) biased_softmax(s + i * width, brow, near + listed, width);
      const int64_t rows = std::min(blk, rows_limit - t * blk);  // rows past the limit are not written
      if (rows <= 0) continue;
      // all rows into a buffer when some are past the limit, else straight into the output
      const bool direct = rows == blk;
      T* o = direct ? op + h * oh + t * blk * orow : ob.data();
      const int64_t ldo = direct ? orow : dv;
      values(s, width, vn, vr, blk, near, dv, T(0), o, ldo);
      values(s + near, width, vl.data(), dv, blk, listed, dv, T(1), o, ldo);
      if (g) values(s + near + listed, width, vsp + h * vsh, vsr, blk, g, dv, T(1), o, ldo);
      if (!direct) {
        for (int64_t i = 0; i < rows; ++i) std::memcpy(op + h * oh + (t * blk + i) * orow, &ob[i * dv], sizeof(T) * dv);
      }
    }
  });
}

}  // namespace

// One batch row. q (H, Lq, d), k and v (H, Lk, d / dv), ks and vs (H, G, d / dv) or (H, 0, ...): strided, last
// dimension contiguous, in the output's dtype; ids (Hb, T, R) int64 listed blocks; bias (Hb, T, (2a + 1 + R) block)
// 0 or -inf; out (H, Lo, dv), last dimension contiguous: rows t block .. of query blocks lo <= t < hi are written,
// those below rows_limit. The neighbouring blocks of query block t are rows (t - a) block + kv_offset onwards of k and
// v, listed block j rows j block + kv_offset onwards.
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& ks,
            const torch::Tensor& vs, const torch::Tensor& ids, const torch::Tensor& bias, torch::Tensor out, int64_t lo,
            int64_t hi, int64_t a, int64_t blk, int64_t kv_offset, int64_t rows_limit, double scale) {
  const torch::Tensor* tensors[] = {&q, &k, &v, &ks, &vs, &out};
  for (const torch::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3, "block-band kernel: 3-d CPU tensors");
    TORCH_CHECK(t->size(1) == 0 || t->size(2) <= 1 || t->stride(2) == 1, "block-band kernel: rows must be contiguous");
    // BLAS takes the row stride as a leading dimension: at least a row long, and an int
    TORCH_CHECK(t->size(1) <= 1 || (t->stride(1) >= std::max<int64_t>(1, t->size(2)) && t->stride(1) <= INT32_MAX),
                "block-band kernel: rows must follow one another (a stride of at least the row's length)");
    TORCH_CHECK(t->scalar_type() == out.scalar_type(), "block-band kernel: one dtype");
  }
  TORCH_CHECK(ids.is_contiguous() && bias.is_contiguous() && ids.scalar_type() == at::kLong &&
                  bias.scalar_type() == out.scalar_type(),
              "block-band kernel: contiguous int64 ids and bias in the output's dtype");
  TORCH_CHECK(bias.size(2) == (2 * a + 1 + ids.size(2)) * blk, "block-band kernel: bias width");
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "block_band", [&] {
    band_kernel<scalar_t>(q, k, v, ks, vs, ids, bias, out, lo, hi, a, blk, kv_offset, rows_limit,
                          static_cast<scalar_t>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "BigBird's block-band attention of one batch row, CPU inference (_blockband.py)");
}
