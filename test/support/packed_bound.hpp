// SPDX-License-Identifier: Apache-2.0
#pragma once
// format::packed_bitmap's test helpers, shared by the host and GPU tests: the fp64 rotation of a
// row, a cache's decoded rows, and the derived bound on PackedAttention against fp64 attention
// over the decoded vectors.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// y = x B in fp64 for one row.
inline std::vector<double> rotate(const float* x, const std::vector<float>& basis, int d, int kept) {
  std::vector<double> y(static_cast<std::size_t>(kept), 0.0);
  for (int j = 0; j < kept; ++j)
    for (int c = 0; c < d; ++c) y[static_cast<std::size_t>(j)] += static_cast<double>(x[c]) * basis[static_cast<std::size_t>(c) * kept + j];
  return y;
}

/// A cache's decoded K and V (`cache::read`) as a kv_data.
template <class Cache>
synthetic::kv_data decoded(const Cache& kv, sequence_id seq, int heads, int d) {
  synthetic::kv_data out;
  out.num_tokens = static_cast<int>(kv.stored_tokens(seq));
  out.num_kv_heads = heads;
  out.head_dim = d;
  out.k.resize(static_cast<std::size_t>(out.num_tokens) * heads * d);
  out.v.resize(out.k.size());
  kv.read(seq, tensor_view<float, 3>(out.k.data(), out.num_tokens, heads, d), tensor_view<float, 3>(out.v.data(), out.num_tokens, heads, d));
  return out;
}

/// The bound on |attend - exact attention over the decoded vectors| per output element, derived
/// for the rotated computation. A logit is fl(fl(q B_k) . y): its error is at most
/// gamma_{D + kept} sum_j sum_c |q_c| |B_cj| |y_tj|, and the decoded key fl(y B_k^T) the oracle
/// reads differs from y B_k^T by gamma_kept sum_j |y_j| |B_cj| per channel, the same order: twice
/// the first term bounds both (y is recovered from the decoded rows as x B, exact in reals). A
/// logit error of delta moves the output by at most (e^{2 delta} - 1) max_t |v_tc|; p . y_v, the
/// merges and the rotation back add gamma_{kept + page + pages + 4} sum_j max_t |y_tj| |B_cj|,
/// also counted twice for the oracle's decoded V.
inline std::vector<double> rotated_bound(const std::vector<float>& q, const synthetic::kv_data& dec, int group_size, double scale,
                                  const format_traits<format::packed_bitmap>::segment& seg, int page_size) {
  const int d = dec.head_dim, kept = seg.kept, n = dec.num_tokens;
  std::vector<double> bound(q.size());
  const double pages = std::ceil(static_cast<double>(n) / page_size);
  for (int h = 0; h < dec.num_kv_heads; ++h) {
    std::vector<double> y_max(static_cast<std::size_t>(kept), 0.0), v_max(static_cast<std::size_t>(d), 0.0);
    for (int t = 0; t < n; ++t) {
      const std::vector<double> yv = rotate(dec.v_row(t, h), seg.basis[1], d, kept);
      for (int j = 0; j < kept; ++j) y_max[static_cast<std::size_t>(j)] = std::max(y_max[static_cast<std::size_t>(j)], std::abs(yv[static_cast<std::size_t>(j)]));
      for (int c = 0; c < d; ++c) v_max[static_cast<std::size_t>(c)] = std::max(v_max[static_cast<std::size_t>(c)], std::abs(static_cast<double>(dec.v_at(t, h, c))));
    }
    for (int g = 0; g < group_size; ++g) {
      const float* qg = q.data() + static_cast<std::size_t>(h * group_size + g) * d;
      std::vector<double> qb(static_cast<std::size_t>(kept), 0.0);  // sum_c |q_c| |B_cj|
      for (int j = 0; j < kept; ++j)
        for (int c = 0; c < d; ++c) qb[static_cast<std::size_t>(j)] += std::abs(static_cast<double>(qg[c])) * std::abs(seg.basis[0][static_cast<std::size_t>(c) * kept + j]);
      double delta = 0;
      for (int t = 0; t < n; ++t) {
        const std::vector<double> yk = rotate(dec.k_row(t, h), seg.basis[0], d, kept);
        double m = 0;
        for (int j = 0; j < kept; ++j) m += qb[static_cast<std::size_t>(j)] * std::abs(yk[static_cast<std::size_t>(j)]);
        delta = std::max(delta, 2 * scale * test::gamma(d + kept + 2) * m);
      }
      for (int c = 0; c < d; ++c) {
        double back = 0;
        for (int j = 0; j < kept; ++j) back += y_max[static_cast<std::size_t>(j)] * std::abs(seg.basis[1][static_cast<std::size_t>(c) * kept + j]);
        bound[static_cast<std::size_t>(h * group_size + g) * d + c] =
            std::expm1(2 * delta) * v_max[static_cast<std::size_t>(c)] + 2 * test::gamma(kept + page_size + pages + 4) * back;
      }
    }
  }
  return bound;
}

}  // namespace kvmosaic::test
