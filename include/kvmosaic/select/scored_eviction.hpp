// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host hooks the score-based keep-less selectors share (`select::tova`, `select::h2o`): a
/// per-sequence token score buffer (select/token_scores.hpp) grown with every write and written by
/// every attend step, and the compaction cadence of `select::streaming`. Each selector adds its
/// description and its `evictions`.

#include <cstdint>

#include "kvmosaic/core/view.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/token_scores.hpp"

namespace kvmosaic {
namespace select {

/// Per sequence: the token scores, and tokens written since the last compaction.
struct scored_state {
  kvmosaic::detail::token_score_buffer scores;
  std::int64_t since_compaction = 0;
};

}  // namespace select

namespace detail {

/// Hooks of a selector `S` with members `combine` (group_combine) and `compact_every` (int)
/// whose state is `select::scored_state`. Cost per write: the buffer grows by 4 bytes per token
/// and KV head (amortized O(1)); per step, the attend path writes the scores of the tokens it reads.
template <class S, score_use Use>
struct scored_eviction_hooks {
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr score_use token_scores = Use;
  static int bounds_block_tokens(const S&, int) noexcept { return 0; }

  using sequence_state = select::scored_state;
  struct update {
    std::int64_t added;  ///< tokens the write adds to the sequence
    int heads;
  };
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class T>
  static update stage(const S&, const selector_shape& shape, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t /*first row*/, std::int64_t n) noexcept {
    return {n, shape.num_kv_heads};
  }
  static void reserve(sequence_state& state, const update& u) {
    state.scores.reserve(state.scores.tokens() + u.added, u.heads);
  }
  static void commit(sequence_state& state, update& u) noexcept {
    state.scores.grow_to(state.scores.tokens() + u.added, u.heads);
  }
  template <bool OnDevice, class Engine, class T>
  static void write(Engine&, std::int32_t, const update&, const tensor_view<const T, 3>&, std::int64_t, std::int64_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void fork(Engine&, std::int32_t, std::int32_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void release(Engine&, std::int32_t) noexcept {}
  /// The score buffer: 4 bytes per token and KV head.
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state& state) noexcept {
    return static_cast<std::int64_t>(state.scores.values.size() * sizeof(float));
  }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  static group_combine score_combine(const S& s) noexcept { return s.combine; }
  static token_score_buffer& scores(sequence_state& state) noexcept { return state.scores; }
  static const token_score_buffer& scores(const sequence_state& state) noexcept { return state.scores; }

  /// Whether `written` more tokens bring the sequence to its next compaction pass.
  static bool compaction_due(const S& s, sequence_state& state, std::int64_t written) noexcept {
    state.since_compaction += written;
    if (state.since_compaction < s.compact_every) return false;
    state.since_compaction = 0;
    return true;
  }
};

}  // namespace detail
}  // namespace kvmosaic
