// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the metrics examples (selector_metrics.cpp, eviction_metrics.cpp) compare against: the
// fp64 attention weights of one query head over every token of a synthetic sequence, and how many
// of the top-k tokens by weight, and how much of the weight, a set of tokens holds.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic_examples {

/// Exact softmax weights (fp64) of query head j (of `q`, [query heads][head_dim]) over tokens
/// [0, n) of kv, scaled by 1 / sqrt(head_dim).
inline std::vector<double> exact_weights(const float* q, int j, const kvmosaic::synthetic::kv_data& kv, int n, int group) {
  const int d = kv.head_dim, h = j / group;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> w(static_cast<std::size_t>(n));
  double m = -INFINITY;
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(q[static_cast<std::size_t>(j) * d + c]) * kv.k_at(t, h, c);
    w[static_cast<std::size_t>(t)] = s * scale;
    m = std::max(m, s * scale);
  }
  double l = 0;
  for (double& x : w) l += (x = std::exp(x - m));
  for (double& x : w) x /= l;
  return w;
}

/// Of the k tokens of largest weight, the share `held` holds (1 when k = 0); and the weight
/// `held` holds in all.
struct held_share {
  double topk_recall = 0, mass = 0;
};
inline held_share share_held(const std::vector<double>& weights, const std::vector<char>& held, std::size_t k) {
  const int n = static_cast<int>(weights.size());
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int t = 0; t < n; ++t) order[static_cast<std::size_t>(t)] = t;
  k = std::min(k, order.size());
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                   [&](int a, int z) { return weights[static_cast<std::size_t>(a)] > weights[static_cast<std::size_t>(z)]; });
  held_share r;
  double hit = 0;
  for (std::size_t i = 0; i < k; ++i) hit += held[static_cast<std::size_t>(order[i])];
  for (int t = 0; t < n; ++t) r.mass += held[static_cast<std::size_t>(t)] * weights[static_cast<std::size_t>(t)];
  r.topk_recall = k > 0 ? hit / static_cast<double>(k) : 1.0;
  return r;
}

}  // namespace kvmosaic_examples
