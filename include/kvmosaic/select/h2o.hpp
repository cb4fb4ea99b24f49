// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::h2o`: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient
/// Generative Inference of Large Language Models", NeurIPS 2023; the cumulative-attention family
/// of the eviction and compaction notes): the recent tokens plus the tokens that have received the
/// most attention so far.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/select/scored_eviction.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens: the most recent floor(`recent_share` x budget) positions, and of
/// the older sealed tokens those with the highest accumulated score (the attention probability
/// each received at every decode step so far, combined over the GQA group by `combine`, then
/// summed over the KV heads: one decision for every head). After each write that leaves more than
/// the budget, the lowest-scored older tokens are evicted; every `compact_every` tokens written
/// the cache compacts the sequence. The dense tail and the format's sink tokens are never evicted
/// and count in the budget; a token no step has read yet is not a candidate. Needs a compactor
/// that frees memory.
///
/// Differs from the paper's code on purpose: one decision for all KV heads, not one per head (a
/// pool page holds every head of its tokens, so only a token every head drops frees memory);
/// `select::per_kv_head<select::h2o>` decides per head, as the paper, in head pages of their own
/// (docs/architecture.md, "Per-KV-head eviction"). Tokens leave in batches after a write, not one
/// per step (the same set when each write is one token).
///
/// What it computes: attention over the tokens kept; the attend path adds each read token's score
/// (select/token_scores.hpp), no eager attention. Cost: as `select::tova`.
struct h2o {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept: heavy hitters plus the recent window
  double recent_share = 0.5;                   ///< the budget's share for the recent window (H2O: half)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
  int compact_every = 128;                     ///< tokens written between compaction passes
};

}  // namespace select

template <>
struct selector_traits<select::h2o> : detail::scored_eviction_hooks<select::h2o, score_use::cumulative> {
  static constexpr const char* name = "h2o";
  static std::string describe(const select::h2o& s) {
    return std::string("h2o(") + s.budget.describe() + ", recent " + detail::to_text(s.recent_share) + ", " +
           to_string(s.combine) + ", compact every " + std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::h2o& s, int /*page_size*/) {
    const char* where = "select::h2o";
    s.budget.validate(where);
    detail::require(s.recent_share >= 0.0 && s.recent_share <= 1.0, where, "recent_share", s.recent_share, "0 to 1");
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  /// The recent window under a budget of `keep` tokens.
  static std::int64_t recent_tokens(const select::h2o& s, std::int64_t keep) noexcept {
    return static_cast<std::int64_t>(std::floor(s.recent_share * static_cast<double>(keep)));
  }
  /// After a write that leaves `stored` live tokens: as many of the lowest-scored live sealed
  /// tokens before the recent window that a step has read as the stored tokens exceed the budget.
  static score_eviction eviction_quota(const select::h2o& s, const sequence_state& state, std::int64_t length,
                                       std::int64_t open_from, std::int64_t stored) {
    const std::int64_t keep = s.budget.resolve(length);
    if (stored <= keep) return {};
    const std::int64_t recent_from = length - recent_tokens(s, keep);
    return {stored - keep, std::min({open_from, recent_from, state.scores.scored_tokens})};
  }
};

}  // namespace kvmosaic
