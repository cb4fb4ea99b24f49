// SPDX-License-Identifier: Apache-2.0
#pragma once
// select::snapkv's GPU test helper: the evictions a snapshot must make, by brute force over the
// window's votes (SnapKV's pooling written out again, then a full sort).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace kvmosaic::test {

/// The positions a snapshot of budget `keep` must evict, by brute force over `votes`: SnapKV's
/// pooling written out again, then a full sort of the candidates by (score, position).
inline std::vector<std::int64_t> brute_force_evictions(const std::vector<double>& votes, const std::vector<std::int64_t>& positions,
                                                std::int64_t window_start, std::int64_t candidates_before, int sinks,
                                                int heads, int pool, std::int64_t keep) {
  std::vector<std::pair<double, std::int64_t>> ranked;
  std::int64_t live = 0;
  for (const std::int64_t t : positions) {
    if (t < 0) continue;
    ++live;
    if (t < sinks || t >= candidates_before) continue;
    double score = 0.0;
    for (int h = 0; h < heads; ++h) {
      double pooled = -std::numeric_limits<double>::infinity();
      for (std::int64_t u = std::max<std::int64_t>(0, t - pool / 2); u <= std::min(window_start - 1, t + pool / 2); ++u)
        pooled = std::max(pooled, votes[static_cast<std::size_t>(u) * heads + h]);
      score += pooled;
    }
    ranked.emplace_back(score, t);
  }
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::int64_t> dead;
  for (std::int64_t i = 0; i < std::min<std::int64_t>(live - keep, static_cast<std::int64_t>(ranked.size())); ++i)
    dead.push_back(ranked[static_cast<std::size_t>(i)].second);
  std::sort(dead.begin(), dead.end());
  return dead;
}

}  // namespace kvmosaic::test
