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

/// A part of a sequence that a kernel folds in one basis: its tokens (decoded) and the segment
/// whose rotated space they are scored and accumulated in, or null for rows folded dense in
/// head_dim space (sinks, the tail).
struct folded_part {
  const synthetic::kv_data* tokens;
  const format_traits<format::packed_bitmap>::segment* segment;
};

/// The bound on |attend - exact attention over the decoded vectors| per output element of KV
/// head h's group ([group_size][d]), derived for the rotated computation, over parts folded in
/// their own bases. A logit is fl(fl(q B_k) . y): its error is at most
/// gamma_{D + kept} sum_j sum_c |q_c| |B_cj| |y_tj|, and the decoded key fl(y B_k^T) the oracle
/// reads differs from y B_k^T by gamma_kept sum_j |y_j| |B_cj| per channel, the same order: twice
/// the first term bounds both (y is recovered from the decoded rows as x B, exact in reals); a
/// kernel that multiplies q' rounded (hi + lo 16-bit halves) adds `q_rounding` times the sum
/// once. A logit error of delta (the largest over every part's tokens) moves the output by at
/// most (e^{2 delta} - 1) max_t |v_tc|; in a part, p . y_v, the merges and the rotation back add
/// gamma_{kept + page + pages + 4} sum_j max_t |y_tj| |B_cj|, counted twice for the oracle's
/// decoded V, and `p_rounding` (p rounded the same way) times it once: the largest over the parts
/// (the output is a convex combination of theirs). Dense parts are the identity basis.
inline std::vector<double> folded_bound(const std::vector<float>& q, int h, int group_size, double scale, int page_size,
                                        double pages, const std::vector<folded_part>& parts, double q_rounding = 0.0,
                                        double p_rounding = 0.0) {
  const int d = parts.front().tokens->head_dim;
  std::vector<double> bound(static_cast<std::size_t>(group_size) * d, 0.0);
  std::vector<double> v_max(static_cast<std::size_t>(d), 0.0), extra(bound.size(), 0.0), delta(static_cast<std::size_t>(group_size), 0.0);
  for (const folded_part& part : parts) {
    const synthetic::kv_data& dec = *part.tokens;
    const int kept = part.segment != nullptr ? part.segment->kept : d, n = dec.num_tokens;
    const auto basis_at = [&](int which, int c, int j) {
      return part.segment != nullptr ? static_cast<double>(part.segment->basis[which][static_cast<std::size_t>(c) * kept + j])
                                     : (c == j ? 1.0 : 0.0);
    };
    const auto rotated = [&](const float* x, int which) {
      std::vector<double> y(static_cast<std::size_t>(kept), 0.0);
      for (int j = 0; j < kept; ++j)
        for (int c = 0; c < d; ++c) y[static_cast<std::size_t>(j)] += static_cast<double>(x[c]) * basis_at(which, c, j);
      return y;
    };
    std::vector<double> y_max(static_cast<std::size_t>(kept), 0.0);
    for (int t = 0; t < n; ++t) {
      const std::vector<double> yv = rotated(dec.v_row(t, h), 1);
      for (int j = 0; j < kept; ++j) y_max[static_cast<std::size_t>(j)] = std::max(y_max[static_cast<std::size_t>(j)], std::abs(yv[static_cast<std::size_t>(j)]));
      for (int c = 0; c < d; ++c) v_max[static_cast<std::size_t>(c)] = std::max(v_max[static_cast<std::size_t>(c)], std::abs(static_cast<double>(dec.v_at(t, h, c))));
    }
    std::vector<std::vector<double>> yk(static_cast<std::size_t>(n));
    for (int t = 0; t < n; ++t) yk[static_cast<std::size_t>(t)] = rotated(dec.k_row(t, h), 0);
    for (int g = 0; g < group_size; ++g) {
      const float* qg = q.data() + static_cast<std::size_t>(h * group_size + g) * d;
      std::vector<double> qb(static_cast<std::size_t>(kept), 0.0);  // sum_c |q_c| |B_cj|
      for (int j = 0; j < kept; ++j)
        for (int c = 0; c < d; ++c) qb[static_cast<std::size_t>(j)] += std::abs(static_cast<double>(qg[c])) * std::abs(basis_at(0, c, j));
      for (int t = 0; t < n; ++t) {
        double m = 0;
        for (int j = 0; j < kept; ++j) m += qb[static_cast<std::size_t>(j)] * std::abs(yk[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)]);
        delta[static_cast<std::size_t>(g)] = std::max(delta[static_cast<std::size_t>(g)], scale * (2 * test::gamma(d + kept + 2) + q_rounding) * m);
      }
      for (int c = 0; c < d; ++c) {
        double back = 0;
        for (int j = 0; j < kept; ++j) back += y_max[static_cast<std::size_t>(j)] * std::abs(basis_at(1, c, j));
        double& e = extra[static_cast<std::size_t>(g) * d + c];
        e = std::max(e, (2 * test::gamma(kept + page_size + pages + 4) + p_rounding) * back);
      }
    }
  }
  for (int g = 0; g < group_size; ++g)
    for (int c = 0; c < d; ++c)
      bound[static_cast<std::size_t>(g) * d + c] =
          std::expm1(2 * delta[static_cast<std::size_t>(g)]) * v_max[static_cast<std::size_t>(c)] + extra[static_cast<std::size_t>(g) * d + c];
  return bound;
}

/// `folded_bound` for every KV head of a sequence whose tokens are all folded in one segment's
/// basis (the host engine's reference): [heads][group_size][d], each head with its own `seg`
/// (`seg(h)`).
template <class SegmentOf>
std::vector<double> rotated_bound(const std::vector<float>& q, const synthetic::kv_data& dec, int group_size, double scale,
                                  const SegmentOf& seg, int page_size) {
  std::vector<double> bound;
  const double pages = std::ceil(static_cast<double>(dec.num_tokens) / page_size);
  for (int h = 0; h < dec.num_kv_heads; ++h) {
    const auto& segment = seg(h);
    const std::vector<double> b = folded_bound(q, h, group_size, scale, page_size, pages, {folded_part{&dec, &segment}});
    bound.insert(bound.end(), b.begin(), b.end());
  }
  return bound;
}

}  // namespace kvmosaic::test
