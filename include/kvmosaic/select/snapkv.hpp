// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::snapkv`: SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before
/// Generation", NeurIPS 2024; the observation-window family of the eviction and compaction notes):
/// once, at the end of a prefill, the attention the prompt's last W queries pay to the earlier
/// tokens decides which of them stay.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/span_score.hpp"
#include "kvmosaic/select/token_scores.hpp"

namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens of a prompt: the observation window (its last `window` tokens),
/// and of the tokens before it those with the highest pooled vote. The caller passes the window's
/// queries to `cache::snapshot(seq, queries)` once the prompt is stored (the cache holds no
/// queries); until then, and between snapshots, nothing is evicted. The vote of token t is
///
///     vote_h(t) = sum over the window's queries w of combine over the group's query heads j of
///                 softmax_j,w(t)
///
/// where query w (position length - W + w) attends causally to every stored token up to its own
/// position; each KV head's votes are max-pooled over the positions t - pool_kernel / 2 ...
/// t + pool_kernel / 2 (SnapKV's 1-D pooling, so that a kept token keeps its neighbours), and the
/// pooled votes are summed over the KV heads: one decision for every head, as `select::h2o` (a pool
/// page holds every head: docs/architecture.md, "Per-KV-head eviction"). The snapshot then evicts
/// the lowest (ties: the earlier position) and compacts the sequence. The dense tail, the
/// window and the format's sink tokens are never evicted and count in the budget. Needs a
/// compactor that frees memory.
///
/// Differs from the paper's code on purpose: one decision for all KV heads instead of one per
/// head; the group's query heads are combined by `combine` (sum by default) where the paper has
/// one query head per KV head; the budget counts the sinks and the tail.
///
/// What it computes: attention over the tokens kept. Cost of a snapshot: the stored K and V read
/// back as attention reads them (`cache::read`: on backend::cuda a copy of the sequence's pages to
/// the host), then per (window query, query head) one pass over the keys, W x group x stored x
/// head_dim multiply-adds in all, in fp64 on the host, keeping one query's logits at a time; then
/// O(stored log stored) to rank and one compaction. Memory: the read-back rows, 8 x stored x kv
/// heads x head_dim bytes, and 8 x stored for the logits; no W x N matrix. Nothing per decode step.
struct snapkv {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept (the window, sinks and tail included)
  int window = 32;                             ///< W: the observation window (SnapKV: 32)
  int pool_kernel = 7;                         ///< the max-pooling width, odd (SnapKV: 7)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
};

}  // namespace select

namespace detail {

/// The SnapKV scores of one sequence: of the tokens before `window_start`, by position, the votes
/// of the window's queries max-pooled per KV head over `pool_kernel` neighbouring positions and
/// summed over the KV heads (`select::snapkv`). `keys(i, h, c)` is the key of stored row i,
/// `positions[i]` its logical position (-1: evicted, skipped), `queries(w, j, c)` the query of
/// window token w (position window_start + w) and query head j, already multiplied by the
/// softmax scale. A position with no live token scores -inf and pools as nothing. Cost: one pass
/// over the keys per (query, query head), keeping its logits (8 bytes a row), in fp64.
template <class Keys, class Queries>
std::vector<double> snapkv_scores(const Keys& keys, const std::vector<std::int64_t>& positions, const Queries& queries,
                                  std::int64_t window_start, int window, int num_kv_heads, int group, int head_dim,
                                  int pool_kernel, group_combine combine) {
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
  // Max-pool each head over the live positions within pool_kernel / 2, then sum the heads.
  const std::int64_t reach = pool_kernel / 2;
  std::vector<double> score(prefix, none);
  for (std::int64_t t = 0; t < window_start; ++t) {
    if (vote[static_cast<std::size_t>(t) * num_kv_heads] == none) continue;  // no live token here
    double total = 0.0;
    for (int h = 0; h < num_kv_heads; ++h) {
      double pooled = none;
      for (std::int64_t u = std::max<std::int64_t>(0, t - reach); u <= std::min(window_start - 1, t + reach); ++u)
        pooled = std::max(pooled, vote[static_cast<std::size_t>(u) * num_kv_heads + h]);
      total += pooled;
    }
    score[static_cast<std::size_t>(t)] = total;
  }
  return score;
}

}  // namespace detail

template <>
struct selector_traits<select::snapkv> : stateless_selector_hooks {
  static constexpr const char* name = "snapkv";
  static constexpr bool reads_all_pages = true;  // every live token: the snapshot already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static std::string describe(const select::snapkv& s) {
    return std::string("snapkv(") + s.budget.describe() + ", window " + std::to_string(s.window) + ", pool " +
           std::to_string(s.pool_kernel) + ", " + to_string(s.combine) + ")";
  }
  static void validate(const select::snapkv& s, int /*page_size*/) {
    const char* where = "select::snapkv";
    s.budget.validate(where);
    detail::require(s.window >= 1, where, "window", s.window, ">= 1");
    detail::require(s.pool_kernel >= 1 && s.pool_kernel % 2 == 1, where, "pool_kernel", s.pool_kernel, "an odd number >= 1");
  }
  static int bounds_block_tokens(const select::snapkv&, int) noexcept { return 0; }

  /// `cache::snapshot(seq, queries, softmax_scale)`.
  template <class Cache>
  struct cache_members {
    /// Scores the tokens of `seq` by the attention its last `window` queries pay them and keeps
    /// the budget (`select::snapkv`): evicts the rest, then compacts the sequence. `queries` is
    /// [window][num_q_heads][head_dim] in host memory (float, half or bfloat16), row w the query of
    /// position length(seq) - window + w; `softmax_scale` 0 means 1 / sqrt(head_dim). Returns the
    /// tokens evicted. Call it once the prompt is stored (the window must lie within it); calling it
    /// again scores what is left. Throws `invalid_argument` for a window longer than the sequence
    /// or queries of the wrong extents, before anything changes.
    template <class Q>
    std::int64_t snapshot(std::int32_t seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f) {
      Cache& cache = static_cast<Cache&>(*this);
      const char* where = "cache::snapshot";
      const select::snapkv& s = cache.selector();
      const auto& c = cache.config();
      const std::int64_t length = cache.length(seq);
      detail::require(queries.extent(0) == s.window, where, "queries.extent(0) (window)", queries.extent(0),
                      "select::snapkv::window");
      detail::require(s.window <= length, where, "select::snapkv::window", s.window,
                      "at most length(seq): the window's tokens must be stored");
      detail::require(queries.extent(1) == c.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                      "num_kv_heads x group_size");
      detail::require(queries.extent(2) == c.head_dim, where, "queries.extent(2) (head_dim)", queries.extent(2),
                      "cache_config::head_dim");
      const std::int64_t stored = cache.stored_tokens(seq);
      const std::vector<std::int64_t> positions = cache.positions(seq);
      std::vector<float> k(static_cast<std::size_t>(stored) * c.num_kv_heads * c.head_dim), v(k.size());
      cache.read(seq, tensor_view<float, 3>(k.data(), stored, c.num_kv_heads, c.head_dim),
                 tensor_view<float, 3>(v.data(), stored, c.num_kv_heads, c.head_dim));
      const float scale = softmax_scale != 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      const auto key = [&](std::int64_t i, int h, int ch) {
        return k[(static_cast<std::size_t>(i) * c.num_kv_heads + h) * c.head_dim + ch];
      };
      const auto query = [&](int w, int j, int ch) { return static_cast<double>(to_float(queries(w, j, ch))) * scale; };
      const std::int64_t window_start = length - s.window;
      const std::vector<double> score = detail::snapkv_scores(key, positions, query, window_start, s.window, c.num_kv_heads,
                                                              c.group_size, c.head_dim, s.pool_kernel, s.combine);
      // Candidates: live sealed tokens after the sinks and before the window and the open tail.
      const std::int64_t open_from = length - stored % c.page_size;
      const std::int64_t before = std::min(window_start, open_from);
      const std::int64_t first = kvmosaic::sink_rows(cache.format());
      std::int64_t live = 0;
      std::vector<std::int64_t> candidates;
      for (const std::int64_t p : positions) {
        if (p < 0) continue;
        ++live;
        if (p >= first && p < before) candidates.push_back(p);
      }
      std::sort(candidates.begin(), candidates.end());
      const std::int64_t keep = s.budget.resolve(length);
      if (live <= keep) return 0;
      const std::vector<std::int64_t> dead = detail::lowest_ranked(
          candidates, live - keep, [&score](std::int64_t p) { return score[static_cast<std::size_t>(p)]; });
      if (dead.empty()) return 0;
      cache.evict(seq, span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())));
      cache.compact(seq);
      return static_cast<std::int64_t>(dead.size());
    }
  };

  /// No eviction after a write: the snapshot evicts.
  static std::vector<std::int64_t> evictions(const select::snapkv&, sequence_state&, std::int64_t, std::int64_t,
                                             const eviction_view&) {
    return {};
  }
  static bool compaction_due(const select::snapkv&, sequence_state&, std::int64_t) noexcept { return false; }
};

}  // namespace kvmosaic
