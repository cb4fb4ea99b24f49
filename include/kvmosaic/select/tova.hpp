// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::tova`: Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs",
/// 2024; the cumulative-attention family of the eviction and compaction notes): over its budget,
/// the cache drops the tokens the latest step attended to least.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/select/scored_eviction.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// Keeps at most `budget` tokens: after each write that leaves more, the sealed tokens with the
/// lowest score of the latest decode step (the attention probability each received, combined
/// over the GQA group by `combine`, then summed over the KV heads: one decision for every head,
/// as TOVA's layer-wise policy averages its heads; `select::per_kv_head<select::tova>` decides per
/// head) are evicted; every `compact_every` tokens
/// written the cache compacts the sequence. The dense tail and the format's sink tokens are never
/// evicted and count in the budget; a token no step has read yet is not a candidate (a prefill is
/// trimmed after its first decode step). Needs a compactor that frees memory.
///
/// What it computes: attention over the tokens kept; the attend path writes each read token's
/// score (select/token_scores.hpp), no eager attention. Cost: per step, the scores (4 bytes per
/// token and KV head written); per write over budget, O(tokens log evicted) on the host to rank
/// them; memory bounded by the budget once compacted, plus 4 bytes per token and KV head of scores.
struct tova {
  using policy_category = selector_tag;

  token_budget budget{};                       ///< tokens kept (tokens, or a ratio of the length)
  group_combine combine = group_combine::sum;  ///< the group's probabilities: summed, or their max
  int compact_every = 128;                     ///< tokens written between compaction passes
};

}  // namespace select

template <>
struct selector_traits<select::tova> : detail::scored_eviction_hooks<select::tova, score_use::last_step> {
  static constexpr const char* name = "tova";
  static std::string describe(const select::tova& s) {
    return std::string("tova(") + s.budget.describe() + ", " + to_string(s.combine) + ", compact every " +
           std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::tova& s, int /*page_size*/) {
    const char* where = "select::tova";
    s.budget.validate(where);
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  /// After a write that leaves `stored` live tokens: as many of the lowest-scored live sealed
  /// tokens that a step has read as the stored tokens exceed the budget.
  static score_eviction eviction_quota(const select::tova& s, const sequence_state& state, std::int64_t length,
                                       std::int64_t open_from, std::int64_t stored) {
    const std::int64_t keep = s.budget.resolve(length);
    if (stored <= keep) return {};
    return {stored - keep, std::min(open_from, state.scores.scored_tokens)};
  }
};

}  // namespace kvmosaic
