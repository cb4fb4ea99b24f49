// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The test oracle: exact decode attention in fp64, independent of every format, page and kernel,
/// and the fidelity numbers every part reports against it (relative L2 error and cosine).
///
/// For query head j of KV head h = j / group_size: out_j = sum_t softmax_t(scale * q_j . k_t,h) v_t,h,
/// computed two-pass (max, then exp-sum) in double. Cost: 2 * tokens * Hq * D multiply-adds.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/view.hpp"

namespace kvmosaic::host {

/// Exact attention of one query token over all tokens of one sequence.
///   q   [num_q_heads][head_dim]
///   k,v [tokens][num_kv_heads][head_dim]  (float, half or bfloat16; widened exactly to double)
/// Returns out [num_q_heads][head_dim] in double. num_q_heads must be num_kv_heads * group_size.
template <class QT, class KVT>
std::vector<double> exact_attention(tensor_view<const QT, 2> q, tensor_view<const KVT, 3> k,
                                    tensor_view<const KVT, 3> v, double softmax_scale) {
  const std::int64_t tokens = k.extent(0), kv_heads = k.extent(1), head_dim = k.extent(2);
  const std::int64_t q_heads = q.extent(0);
  detail::require(tokens >= 1, "exact_attention", "k.extent(0) (tokens)", tokens, ">= 1");
  detail::require(q.extent(1) == head_dim, "exact_attention", "q.extent(1) (head_dim)", q.extent(1),
                  "k.extent(2)");
  detail::require(v.extent(0) == tokens && v.extent(1) == kv_heads && v.extent(2) == head_dim, "exact_attention",
                  "v.extents", "mismatch", "the extents of k");
  detail::require(kv_heads >= 1 && q_heads % kv_heads == 0, "exact_attention", "q.extent(0) (query heads)",
                  q_heads, "a multiple of k.extent(1)");
  const std::int64_t group = q_heads / kv_heads;

  std::vector<double> out(static_cast<std::size_t>(q_heads * head_dim), 0.0);
  std::vector<double> logits(static_cast<std::size_t>(tokens));
  for (std::int64_t j = 0; j < q_heads; ++j) {
    const std::int64_t h = j / group;
    double max_logit = -HUGE_VAL;
    for (std::int64_t t = 0; t < tokens; ++t) {
      double dot = 0.0;
      for (std::int64_t c = 0; c < head_dim; ++c)
        dot += static_cast<double>(to_float(q(j, c))) * static_cast<double>(to_float(k(t, h, c)));
      logits[static_cast<std::size_t>(t)] = dot * softmax_scale;
      max_logit = std::max(max_logit, logits[static_cast<std::size_t>(t)]);
    }
    double sum = 0.0;
    double* o = out.data() + j * head_dim;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const double p = std::exp(logits[static_cast<std::size_t>(t)] - max_logit);
      sum += p;
      for (std::int64_t c = 0; c < head_dim; ++c) o[c] += p * static_cast<double>(to_float(v(t, h, c)));
    }
    for (std::int64_t c = 0; c < head_dim; ++c) o[c] /= sum;
  }
  return out;
}

/// How close an attention output is to the exact one.
struct fidelity {
  double rel_l2_error = 0;  ///< ||got - exact||_2 / ||exact||_2
  double cosine = 1;        ///< <got, exact> / (||got|| ||exact||)
  double max_abs_error = 0; ///< max_i |got_i - exact_i|
};

/// Compares `count` values of an output with the exact reference.
template <class T>
fidelity compare(const T* got, const double* exact, std::size_t count) {
  double diff2 = 0, exact2 = 0, got2 = 0, dot = 0, max_abs = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double g = static_cast<double>(got[i]), e = exact[i];
    diff2 += (g - e) * (g - e);
    exact2 += e * e;
    got2 += g * g;
    dot += g * e;
    max_abs = std::max(max_abs, std::abs(g - e));
  }
  fidelity f;
  f.rel_l2_error = exact2 > 0 ? std::sqrt(diff2 / exact2) : std::sqrt(diff2);
  f.cosine = (got2 > 0 && exact2 > 0) ? dot / std::sqrt(got2 * exact2) : (got2 == exact2 ? 1.0 : 0.0);
  f.max_abs_error = max_abs;
  return f;
}

}  // namespace kvmosaic::host
