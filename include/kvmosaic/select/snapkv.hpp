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
/// head (`select::per_kv_head<select::snapkv>` decides per head, as the paper); the group's
/// query heads are combined by `combine` (sum by default) where the paper has one query head per
/// KV head; the budget counts the sinks and the tail.
///
/// What it computes: attention over the tokens kept. Cost of a snapshot: the window's votes
/// (`cache::window_votes`): on backend::cuda over format::dense, ceil(W / 8) decode steps of up to
/// 8 copies of the sequence that write their rows' logits, two small kernels over them and 4 bytes
/// per row and KV head copied back (device memory: 4 x group x 8 bytes per row and KV head);
/// elsewhere the stored keys read back (`cache::read`) and scored on the host in fp64, W x group x
/// stored x head_dim multiply-adds, keeping one query's logits at a time (no W x N matrix). Then
/// O(stored log stored) on the host to pool and rank, and one compaction. Nothing per decode step.
struct snapkv {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept (the window, sinks and tail included)
  int window = 32;                             ///< W: the observation window (SnapKV: 32)
  int pool_kernel = 7;                         ///< the max-pooling width, odd (SnapKV: 7)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
};

}  // namespace select

namespace detail {

/// SnapKV's pooling of window votes (`window_votes`, [window_start][num_kv_heads], -inf where no
/// live token is): each KV head's votes max-pooled over the live positions within
/// pool_kernel / 2 of t, then summed over the KV heads. A position with no live token scores -inf
/// and pools as nothing. Cost: O(window_start x num_kv_heads x pool_kernel).
inline std::vector<double> snapkv_pool(const std::vector<double>& vote, std::int64_t window_start, int num_kv_heads,
                                       int pool_kernel) {
  const double none = -std::numeric_limits<double>::infinity();
  const std::int64_t reach = pool_kernel / 2;
  std::vector<double> score(static_cast<std::size_t>(window_start), none);
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

/// What a snapshot of one sequence may evict: how many live tokens it holds, and its candidates,
/// the live positions in [first, before) (after the sinks, before the window and the open tail),
/// ascending. Cost: O(slots log slots).
struct snapshot_candidates {
  std::int64_t live = 0;
  std::vector<std::int64_t> positions;
};
inline snapshot_candidates candidates_of(const std::vector<std::int64_t>& slot_positions, std::int64_t first,
                                         std::int64_t before) {
  snapshot_candidates out;
  for (const std::int64_t p : slot_positions) {
    if (p < 0) continue;
    ++out.live;
    if (p >= first && p < before) out.positions.push_back(p);
  }
  std::sort(out.positions.begin(), out.positions.end());
  return out;
}

/// The SnapKV scores of one sequence in fp64: of the tokens before `window_start`, by position,
/// the window's votes (`window_votes`, the same arguments) pooled by `snapkv_pool`.
template <class Keys, class Queries>
std::vector<double> snapkv_scores(const Keys& keys, const std::vector<std::int64_t>& positions, const Queries& queries,
                                  std::int64_t window_start, int window, int num_kv_heads, int group, int head_dim,
                                  int pool_kernel, group_combine combine) {
  return snapkv_pool(window_votes(keys, positions, queries, window_start, window, num_kv_heads, group, head_dim, combine),
                     window_start, num_kv_heads, pool_kernel);
}

}  // namespace detail

template <>
struct selector_traits<select::snapkv> : stateless_selector_hooks {
  static constexpr const char* name = "snapkv";
  static constexpr bool reads_all_pages = true;  // every live token: the snapshot already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr bool reads_window_votes = true;  // cache::window_votes, computed by the device where it can
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
      const std::int64_t window_start = length - s.window;
      const std::vector<double> score = detail::snapkv_pool(cache.window_votes(seq, queries, softmax_scale, s.combine),
                                                            window_start, c.num_kv_heads, s.pool_kernel);
      // Candidates: live sealed tokens after the sinks and before the window and the open tail.
      const std::int64_t open_from = length - cache.stored_tokens(seq) % c.page_size;
      const detail::snapshot_candidates candidates =
          detail::candidates_of(cache.positions(seq), kvmosaic::sink_rows(cache.format()), std::min(window_start, open_from));
      const std::int64_t keep = cache.budget(seq).resolve(length);  // the sequence's own, if it has one
      if (candidates.live <= keep) return 0;
      const std::vector<std::int64_t> dead = detail::lowest_ranked(
          candidates.positions, candidates.live - keep, [&score](std::int64_t p) { return score[static_cast<std::size_t>(p)]; });
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
