// SPDX-License-Identifier: Apache-2.0
#pragma once
// The pruning reference of format::bitmap_tiles, written independently of the library: per token,
// a value is kept iff fewer than `keep` elements of its row beat it (a larger score, or an equal
// score at a lower channel); the cache it implies (every full page pruned, the tail left dense).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kvmosaic/support/synthetic.hpp"

namespace kvmosaic::test {

/// Rows [n][d] pruned to d - round(s d) values each; the score of element c is |x_c| (times
/// weights[c] when weights are given).
inline std::vector<float> reference_prune(const std::vector<float>& rows, int d, float sparsity,
                                          const float* weights = nullptr) {
  const int keep = d - static_cast<int>(std::lround(static_cast<double>(sparsity) * d));
  std::vector<float> out(rows.size(), 0.0f);
  for (std::size_t base = 0; base < rows.size(); base += static_cast<std::size_t>(d))
    for (int c = 0; c < d; ++c) {
      const auto score = [&](int i) { return weights ? std::abs(rows[base + i]) * weights[i] : std::abs(rows[base + i]); };
      int beaten_by = 0;
      for (int o = 0; o < d; ++o) beaten_by += score(o) > score(c) || (score(o) == score(c) && o < c);
      if (beaten_by < keep) out[base + c] = rows[base + c];
    }
  return out;
}

/// The cache a bitmap_tiles(s_k, s_v) cache holds for stored values `kv` (already rounded):
/// tokens of full pages pruned per token and head (K scored with key_weights [heads][head_dim]
/// when not empty), the tail (the last length % page_size tokens) as stored.
inline synthetic::kv_data pruned_cache(synthetic::kv_data kv, int page_size, float s_k, float s_v,
                                       const std::vector<float>& key_weights = {}) {
  const int full = kv.num_tokens / page_size * page_size, d = kv.head_dim;
  for (int t = 0; t < full; ++t)
    for (int h = 0; h < kv.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        float* row = (is_v ? kv.v.data() : kv.k.data()) + (static_cast<std::size_t>(t) * kv.num_kv_heads + h) * d;
        const float* weights = !is_v && !key_weights.empty() ? key_weights.data() + static_cast<std::size_t>(h) * d : nullptr;
        const std::vector<float> pruned = reference_prune(std::vector<float>(row, row + d), d, is_v ? s_v : s_k, weights);
        std::copy(pruned.begin(), pruned.end(), row);
      }
  return kv;
}

}  // namespace kvmosaic::test
