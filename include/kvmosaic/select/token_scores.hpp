// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the score-based keep-less selectors share (`select::tova`, `select::h2o`): the attention
/// probability each attended token received at a decode step, per (sequence, KV head), computed
/// by the attend path itself (no eager attention, no N x N matrix), and the per-sequence buffer
/// that keeps it by logical position. Source: the eviction and compaction notes ("Wall 1": a fused
/// kernel never writes the scores; H2O's reference code falls back to eager attention for them).
///
/// A token's score at a step is, for each query head j of the KV head's group, its probability
/// p_j = exp(s_j - m_j) / l_j under the step's whole softmax (every page, sink and tail row the
/// step reads: normalized after the merge of the blocks, as the split-KV merge would), combined
/// over the group by `group_combine` (sum: the group's attention mass on the token; max). A token
/// the step does not read (evicted, or masked by a read-less selection) gets no score that step.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {

/// How a selector uses the attend path's token scores (`selector_traits<S>::token_scores`):
///   - `none`: it reads none, and the attend path computes none (every selector but the two below);
///   - `last_step`: each step overwrites the scores of the tokens it reads (TOVA);
///   - `cumulative`: each step adds them (H2O's accumulated attention).
enum class score_use { none, last_step, cumulative };

/// What an attend step records: how the group's probabilities combine and whether they replace
/// or add to the buffer. `use == score_use::none`: nothing is recorded.
struct score_settings {
  score_use use = score_use::none;
  group_combine combine = group_combine::sum;
};

/// What a score-based selector evicts after a write: the `count` live sealed tokens with the
/// lowest shared score (`token_score_buffer::shared`; ties to the earlier position, NaN highest)
/// among positions [first_evictable, before), or every such token when there are fewer.
struct score_eviction {
  std::int64_t count = 0;
  std::int64_t before = 0;
};

namespace detail {

/// One sequence's token scores, by logical position: [position][num_kv_heads] fp32, zero until a
/// step reads the token. Evicted positions keep their last value and are never read again. Cost:
/// 4 bytes per token and KV head (counted by the selector's `extra_bytes`), in host memory on
/// backend::host; on a device backend (`on_device`) the values live with the selector's device
/// part (cuda/select/scored_eviction.cuh) and this buffer keeps only the length.
struct token_score_buffer {
  std::vector<float> values;  ///< host memory; empty when `on_device`
  int heads = 0;
  std::int64_t length = 0;         ///< positions held
  std::int64_t scored_tokens = 0;  ///< tokens the sequence held at its last step with scores
  bool on_device = false;          ///< the values live in device memory (backend::cuda)

  std::int64_t tokens() const noexcept { return length; }
  float at(std::int64_t position, int head) const noexcept {
    return values[static_cast<std::size_t>(position) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(head)];
  }
  /// Room for `tokens` positions of `num_heads` heads (growing geometrically: appends cost
  /// amortized O(1)); may throw (allocation), changes no score.
  void reserve(std::int64_t tokens, int num_heads) {
    if (on_device) return;
    const std::size_t needed = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (needed > values.capacity()) values.reserve(std::max(needed, 2 * values.capacity()));
  }
  /// Grows to `tokens` positions (new ones 0) within the room `reserve` made: cannot throw.
  void grow_to(std::int64_t tokens, int num_heads) noexcept {
    heads = num_heads;
    length = std::max(length, tokens);
    if (on_device) return;
    const std::size_t size = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_heads);
    if (size > values.size()) values.resize(size, 0.0f);  // capacity reserved: no allocation
  }
  /// The score of `position` for the eviction decision of one slot layout shared by every KV
  /// head: the sum over the heads in head order, in fp32 (their mean, up to a constant factor that
  /// no ranking sees). The device ranking (cuda/kernel/token_scores.cuh) sums in the same order.
  float shared(std::int64_t position) const noexcept {
    float total = 0.0f;
    for (int h = 0; h < heads; ++h) total += at(position, h);
    return total;
  }
};

/// The `count` positions of `candidates` with the lowest `score_of(position)` (float or double),
/// lowest first; ties to the earlier position (the same order on every backend); a NaN score (a
/// NaN query) ranks highest, so it never evicts. Cost: O(n log count).
template <class ScoreOf>
std::vector<std::int64_t> lowest_ranked(const std::vector<std::int64_t>& candidates, std::int64_t count, ScoreOf score_of) {
  using score = decltype(score_of(std::int64_t{}));
  count = std::max<std::int64_t>(0, std::min<std::int64_t>(count, static_cast<std::int64_t>(candidates.size())));
  std::vector<std::pair<score, std::int64_t>> ranked;
  ranked.reserve(candidates.size());
  for (const std::int64_t p : candidates) {
    const score x = score_of(p);
    ranked.emplace_back(std::isnan(x) ? std::numeric_limits<score>::infinity() : x, p);
  }
  std::partial_sort(ranked.begin(), ranked.begin() + count, ranked.end());
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) out.push_back(ranked[static_cast<std::size_t>(i)].second);
  return out;
}

/// The attention an observation window pays the tokens before it (SnapKV's vote; the window
/// families of the eviction notes), in fp64: for every position t < `window_start` that holds a
/// live token and every KV head h,
///
///     vote(t, h) = sum over w < window of combine over the group's query heads j of softmax_w,j(t)
///
/// where window query w (position window_start + w) attends causally to every live stored token up
/// to its own position. `keys(i, h, c)` is the key of stored row i, `positions[i]` its logical
/// position (-1: evicted, skipped), `queries(w, j, c)` query head j of window query w, already
/// multiplied by the softmax scale. Returns [window_start][num_kv_heads], -inf where no live
/// token is. Cost: one pass over the keys per (query, query head), keeping its logits (8 bytes a
/// row); no W x N matrix.
template <class Keys, class Queries>
std::vector<double> window_votes(const Keys& keys, const std::vector<std::int64_t>& positions, const Queries& queries,
                                 std::int64_t window_start, int window, int num_kv_heads, int group, int head_dim,
                                 group_combine combine) {
  const std::size_t rows = positions.size(), prefix = static_cast<std::size_t>(window_start);
  const double none = -std::numeric_limits<double>::infinity();
  std::vector<double> vote(prefix * static_cast<std::size_t>(num_kv_heads), none);  // [position][head]
  for (std::size_t i = 0; i < rows; ++i)
    if (positions[i] >= 0 && positions[i] < window_start)
      for (int h = 0; h < num_kv_heads; ++h) vote[static_cast<std::size_t>(positions[i]) * num_kv_heads + h] = 0.0;
  std::vector<double> logits(rows), combined(rows);
  for (int h = 0; h < num_kv_heads; ++h) {
    for (int w = 0; w < window; ++w) {
      const std::int64_t last = window_start + w;  // causal: the query sees positions up to its own
      std::fill(combined.begin(), combined.end(), 0.0);
      for (int g = 0; g < group; ++g) {
        const int j = h * group + g;
        double m = none;
        for (std::size_t i = 0; i < rows; ++i) {
          if (positions[i] < 0 || positions[i] > last) continue;
          double dot = 0.0;
          for (int c = 0; c < head_dim; ++c)
            dot += static_cast<double>(queries(w, j, c)) * static_cast<double>(keys(static_cast<std::int64_t>(i), h, c));
          logits[i] = dot;
          m = std::max(m, dot);
        }
        double l = 0.0;
        for (std::size_t i = 0; i < rows; ++i)
          if (positions[i] >= 0 && positions[i] <= last) l += std::exp(logits[i] - m);
        for (std::size_t i = 0; i < rows; ++i) {
          if (positions[i] < 0 || positions[i] >= window_start) continue;
          const double p = std::exp(logits[i] - m) / l;
          combined[i] = combine == group_combine::sum ? combined[i] + p : (g == 0 ? p : std::max(combined[i], p));
        }
      }
      for (std::size_t i = 0; i < rows; ++i)
        if (positions[i] >= 0 && positions[i] < window_start)
          vote[static_cast<std::size_t>(positions[i]) * num_kv_heads + h] += combined[i];
    }
  }
  return vote;
}

/// `lowest_ranked` by the shared score of `scores` (the sum over the KV heads).
inline std::vector<std::int64_t> lowest_scored(const token_score_buffer& scores, const std::vector<std::int64_t>& candidates,
                                               std::int64_t count) {
  return lowest_ranked(candidates, count, [&scores](std::int64_t p) { return scores.shared(p); });
}

}  // namespace detail
}  // namespace kvmosaic
