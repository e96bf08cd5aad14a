// LSH attention's rounds in one pass per query cluster, for CPU inference: approx's `lsh` method, engine="fused".
//
// The computation is the one of approx/attention/_lshrounds.py (and of lsh.attend_rounds, which keeps every step
// differentiable); read the docstrings there first. Per (batch, head) row and round r, query cluster t (c queries in
// the round's sorted order) meets its key cluster u = blocks[b, t] (c keys in the round's sorted order): the cluster's
// queries, keys and values are gathered into small buffers, the scores come from one BLAS product, the pairs not to
// count are set to -inf (padded keys; pairs an earlier round found: the query's target cluster in round e equals the
// key's cluster in round e), the softmax is taken row by row in vector registers, a second product gives the
// unnormalised outputs, and each query's row is merged into its running output through its running maximum and sum
// (the rounds' log-sum-exp merge, done as flash attention does). Every (batch, head) row is one task of
// at::parallel_for, its rounds one after the other, so that its queries, keys, values and outputs stay in cache; with
// fewer rows than threads, each round's clusters are the tasks (rounds_kernel).
//
// The products call the Fortran BLAS that libtorch_cpu exports (sgemm_/dgemm_: MKL in the x86 wheels); inside a
// parallel region MKL runs on the calling thread. Built on first use by torch.utils.cpp_extension (_lshfused.py).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "approx_cpu.h"

namespace {

using approx_cpu::exp_sum;
using approx_cpu::gemm;
using approx_cpu::row_max;

// Rows fetched ahead of the one being read in the gathers and the merge (one-off, N = 16384, 4 rounds of 128, 2
// threads: the merge 35 -> 27 ms and the gathers 49 -> 45 ms of thread time; 8, 16 or 24 rows ahead alike)
constexpr int64_t kAhead = 8;

// s[j] = -inf where flag[j] == value (flags and value are small integers held exactly in T).
template <typename T>
inline void drop_where_equal(T* s, const T* flag, T value, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  const Vec target(value), neg(-std::numeric_limits<T>::infinity());
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec::blendv(Vec::loadu(s + j), neg, Vec::loadu(flag + j) == target).store(s + j);
  }
  for (; j < n; ++j) {
    if (flag[j] == value) s[j] = -std::numeric_limits<T>::infinity();
  }
}

// Asks for the cache lines of a row about to be read (the rows of a cluster lie at random places of the tables).
template <typename T>
inline void prefetch_row(const T* p, int64_t len) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < int64_t(sizeof(T)) * len; off += 64) __builtin_prefetch(bytes + off);
}

// One call's inputs and outputs (see attend below), and the step every schedule is made of.
template <typename T>
struct Rounds {
  const T *qf, *kf, *vf;
  const int64_t *q_order, *k_order, *target, *k_cluster, *blocks;
  const bool* real;
  T *out, *running_max, *running_sum;
  int64_t b_size, h_size, rounds, n, s, c, tq, d, dv;
  T scale;

  // A task's buffers: one query cluster's queries, keys, values, scores and outputs, and what the masks read.
  struct Scratch {
    std::vector<T> qs, ks, vs, sc, os, ids, padded, maxima, sums;
    std::vector<int64_t> qrow, krow;
    explicit Scratch(const Rounds& k)
        : qs(k.c * k.d), ks(k.c * k.d), vs(k.c * k.dv), sc(k.c * k.c), os(k.c * k.dv),
          ids(std::max<int64_t>(k.rounds, 1) * k.c), padded(k.c), maxima(k.c), sums(k.c), qrow(k.c), krow(k.c) {}
  };

  // Round r of query cluster t of (batch, head) row bh: gathered, scored, masked, exponentiated, multiplied by the
  // values, and merged into its queries' running rows. A query is in one cluster of a round, so the clusters of one
  // round write disjoint rows; the rounds of a row must run in order.
  void cluster(int64_t bh, int64_t r, int64_t t, Scratch& w) const {
    const int64_t bh_size = b_size * h_size, batch = bh / h_size;
    const T neg_inf = -std::numeric_limits<T>::infinity();
    T* o_rows = out + bh * n * dv;
    T* m_rows = running_max + bh * n;
    T* l_rows = running_sum + bh * n;
    const int64_t* qo = q_order + (r * bh_size + bh) * n;
    const int64_t* ko = k_order + (r * bh_size + bh) * s;
    const bool last_round = r + 1 == rounds;
    const int64_t u = blocks[batch * tq + t];
    const int64_t mq = std::min(c, n - t * c), mk = std::min(c, s - u * c);
    for (int64_t a = 0; a < std::min(kAhead, mq); ++a) prefetch_row(qf + (bh * n + qo[t * c + a]) * d, d);
    for (int64_t a = 0; a < mq; ++a) {
      if (a + kAhead < mq) prefetch_row(qf + (bh * n + qo[t * c + a + kAhead]) * d, d);
      w.qrow[a] = qo[t * c + a];
      std::memcpy(&w.qs[a * d], qf + (bh * n + w.qrow[a]) * d, sizeof(T) * d);
    }
    bool any_padded = false;
    for (int64_t j = 0; j < std::min(kAhead, mk); ++j) {
      prefetch_row(kf + (bh * s + ko[u * c + j]) * d, d);
      prefetch_row(vf + (bh * s + ko[u * c + j]) * dv, dv);
    }
    for (int64_t j = 0; j < mk; ++j) {
      if (j + kAhead < mk) {
        prefetch_row(kf + (bh * s + ko[u * c + j + kAhead]) * d, d);
        prefetch_row(vf + (bh * s + ko[u * c + j + kAhead]) * dv, dv);
      }
      w.krow[j] = ko[u * c + j];
      std::memcpy(&w.ks[j * d], kf + (bh * s + w.krow[j]) * d, sizeof(T) * d);
      std::memcpy(&w.vs[j * dv], vf + (bh * s + w.krow[j]) * dv, sizeof(T) * dv);
      const bool pad = real != nullptr && !real[batch * s + w.krow[j]];
      w.padded[j] = pad ? T(1) : T(0);
      any_padded = any_padded || pad;
    }
    for (int64_t e = 0; e < r; ++e) {  // each key's cluster in the earlier rounds
      const int64_t* kc = k_cluster + (e * bh_size + bh) * s;
      for (int64_t j = 0; j < mk; ++j) w.ids[e * c + j] = T(kc[w.krow[j]]);
    }
    // scores (row-major mq x mk, row stride c): column-major (mk x mq) = K Q^T
    gemm('T', 'N', int(mk), int(mq), int(d), scale, w.ks.data(), int(d), w.qs.data(), int(d), T(0), w.sc.data(),
         int(c));
    for (int64_t a = 0; a < mq; ++a) {
      T* row = &w.sc[a * c];
      if (any_padded) drop_where_equal(row, w.padded.data(), T(1), mk);
      for (int64_t e = 0; e < r; ++e) {
        drop_where_equal(row, &w.ids[e * c], T(target[(e * bh_size + bh) * n + w.qrow[a]]), mk);
      }
      const T m = row_max(row, mk);
      if (m == neg_inf) {  // every pair found before: nothing in this round
        std::fill(row, row + mk, T(0));
        w.maxima[a] = neg_inf;
        w.sums[a] = 0;
      } else {
        w.maxima[a] = m;
        w.sums[a] = exp_sum(row, m, mk);
      }
    }
    // unnormalised outputs (row-major mq x dv): column-major (dv x mq) = V^T P^T
    gemm('N', 'N', int(dv), int(mq), int(mk), T(1), w.vs.data(), int(dv), w.sc.data(), int(c), T(0), w.os.data(),
         int(dv));
    for (int64_t a = 0; a < std::min(kAhead, mq); ++a) prefetch_row(o_rows + w.qrow[a] * dv, dv);
    for (int64_t a = 0; a < mq; ++a) {
      if (a + kAhead < mq) {
        prefetch_row(o_rows + w.qrow[a + kAhead] * dv, dv);
        __builtin_prefetch(m_rows + w.qrow[a + kAhead]);
        __builtin_prefetch(l_rows + w.qrow[a + kAhead]);
      }
      const int64_t i = w.qrow[a];
      T* o = o_rows + i * dv;
      const T* o_new = &w.os[a * dv];
      T weight_new = 1, weight_old = 0;
      if (r == 0) {
        m_rows[i] = w.maxima[a];
        l_rows[i] = w.sums[a];
      } else if (w.sums[a] > 0) {
        const T top = std::max(m_rows[i], w.maxima[a]);
        weight_old = std::exp(m_rows[i] - top);
        weight_new = std::exp(w.maxima[a] - top);
        m_rows[i] = top;
        l_rows[i] = l_rows[i] * weight_old + w.sums[a] * weight_new;
      } else {
        weight_new = 0;
        weight_old = 1;
      }
      // the last round divides by the sum (0 rows, impossible here, give 0 rather than 0 / 0)
      const T norm = last_round ? (l_rows[i] > 0 ? T(1) / l_rows[i] : T(0)) : T(1);
      if (r == 0) {
        for (int64_t j = 0; j < dv; ++j) o[j] = o_new[j] * norm;
      } else {
        for (int64_t j = 0; j < dv; ++j) o[j] = (o[j] * weight_old + o_new[j] * weight_new) * norm;
      }
    }
  }
};

// Every (batch, head) row is one task of at::parallel_for, its rounds and clusters one after the other, so that its
// queries, keys, values and outputs stay in cache. With fewer rows than threads (one sequence of a few heads on a
// machine of many cores) the rows would leave threads idle: then each round's clusters are the tasks (one
// at::parallel_for per round), the same arithmetic in the same order for every query's row. `split`: 0 chooses so,
// 1 always rows, 2 always clusters (the tests run both).
template <typename T>
void rounds_kernel(const Rounds<T>& k, int64_t split) {
  using Scratch = typename Rounds<T>::Scratch;
  const int64_t bh_size = k.b_size * k.h_size;
  const bool by_cluster = split == 2 || (split == 0 && bh_size < at::get_num_threads() && k.tq > 1);
  if (!by_cluster) {
    at::parallel_for(0, bh_size, 1, [&](int64_t bh0, int64_t bh1) {
      Scratch w(k);
      for (int64_t bh = bh0; bh < bh1; ++bh) {
        for (int64_t r = 0; r < k.rounds; ++r) {
          for (int64_t t = 0; t < k.tq; ++t) k.cluster(bh, r, t, w);
        }
      }
    });
    return;
  }
  for (int64_t r = 0; r < k.rounds; ++r) {
    at::parallel_for(0, bh_size * k.tq, 1, [&](int64_t i0, int64_t i1) {
      Scratch w(k);
      for (int64_t i = i0; i < i1; ++i) k.cluster(i / k.tq, r, i % k.tq, w);
    });
  }
}

}  // namespace

// qf (B H N, d), kf (B H S, d), vf (B H S, dv): contiguous, float32 or float64, padded keys and values zeroed;
// q_order (R, B H, N), k_order (R, B H, S): each round's sorted positions; target (R, B H, N): the key cluster each
// query attends in each round; k_cluster (R, B H, S): each key's cluster; blocks (B, Tq): the key cluster of each query
// cluster; real (B, S) bool, or an empty tensor for no padding. Returns (B H N, dv).
torch::Tensor attend(const torch::Tensor& qf, const torch::Tensor& kf, const torch::Tensor& vf,
                     const torch::Tensor& q_order, const torch::Tensor& k_order, const torch::Tensor& target,
                     const torch::Tensor& k_cluster, const torch::Tensor& blocks, const torch::Tensor& real,
                     int64_t heads, int64_t c, double scale, int64_t split) {
  TORCH_CHECK(qf.device().is_cpu(), "lsh fused kernel: CPU tensors only");
  for (const auto* t : {&qf, &kf, &vf, &q_order, &k_order, &target, &k_cluster, &blocks}) {
    TORCH_CHECK(t->is_contiguous(), "lsh fused kernel: contiguous inputs only");
  }
  TORCH_CHECK(kf.scalar_type() == qf.scalar_type() && vf.scalar_type() == qf.scalar_type(), "lsh fused kernel: one dtype");
  const int64_t rounds = q_order.size(0), bh = q_order.size(1), n = q_order.size(2), s = k_order.size(2);
  const int64_t b = blocks.size(0), tq = blocks.size(1), d = qf.size(1), dv = vf.size(1);
  TORCH_CHECK(bh == b * heads && tq == (n + c - 1) / c, "lsh fused kernel: shapes do not agree");
  TORCH_CHECK(real.numel() == 0 || (real.scalar_type() == at::kBool && real.is_contiguous() && real.numel() == b * s),
              "lsh fused kernel: real must be a contiguous (B, S) bool tensor or empty");
  auto out = torch::empty({bh * n, dv}, qf.options());
  auto maxima = torch::empty({bh * n}, qf.options());
  auto sums = torch::empty({bh * n}, qf.options());
  const bool* real_ptr = real.numel() ? real.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES(qf.scalar_type(), "lsh_rounds", [&] {
    const Rounds<scalar_t> k{qf.data_ptr<scalar_t>(), kf.data_ptr<scalar_t>(), vf.data_ptr<scalar_t>(),
                             q_order.data_ptr<int64_t>(), k_order.data_ptr<int64_t>(), target.data_ptr<int64_t>(),
                             k_cluster.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), real_ptr,
                             out.data_ptr<scalar_t>(), maxima.data_ptr<scalar_t>(), sums.data_ptr<scalar_t>(), b, heads,
                             rounds, n, s, c, tq, d, dv, static_cast<scalar_t>(scale)};
    rounds_kernel<scalar_t>(k, split);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "LSH attention's rounds merged, CPU inference (approx/attention/_lshfused.py)");
}
