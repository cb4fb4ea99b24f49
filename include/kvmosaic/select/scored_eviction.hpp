// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host hooks the score-based keep-less selectors share (`select::tova`, `select::h2o`): a
/// per-sequence token score buffer (select/token_scores.hpp) grown with every write and written by
/// every attend step, the ranking that turns a selector's `eviction_quota` into positions, and the
/// compaction cadence of `select::streaming`. Each selector adds its description and its
/// `eviction_quota`. On a device backend the scores stay in device memory and the ranking runs
/// there (cuda/select/scored_eviction.cuh); the cache asks the quota, not the positions.

#include <cstdint>
#include <vector>

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
/// whose state is `select::scored_state`, and whose traits provide
///
///     static score_eviction eviction_quota(const S&, const sequence_state&, std::int64_t length,
///                                          std::int64_t open_from, std::int64_t stored);
///
/// (how many of the lowest-scored tokens below which position to evict after a write that leaves
/// `stored` live tokens). Cost per write: the buffer grows by 4 bytes per token and KV head
/// (amortized O(1)); per step, the attend path writes the scores of the tokens it reads.
template <class S, score_use Use>
struct scored_eviction_hooks {
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static constexpr score_use token_scores = Use;
  static int bounds_block_tokens(const S&, int) noexcept { return 0; }

  using sequence_state = select::scored_state;
  struct update {
    std::int64_t added;   ///< tokens the write adds to the sequence
    std::int64_t length;  ///< the sequence's positions after the write
    int heads;
    bool on_device;       ///< the scores live in device memory
  };
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class T>
  static update stage(const S&, const selector_shape& shape, const sequence_state& state, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t /*first row*/, std::int64_t n) noexcept {
    return {n, state.scores.tokens() + n, shape.num_kv_heads, OnDevice};
  }
  static void reserve(sequence_state& state, const update& u) {
    state.scores.on_device = u.on_device;  // fixed by the backend: the same on every write
    state.scores.reserve(u.length, u.heads);
  }
  static void commit(sequence_state& state, update& u) noexcept { state.scores.grow_to(u.length, u.heads); }
  /// On a device backend the selection stage makes room for the new positions' scores (zero).
  template <bool OnDevice, class Engine, class T>
  static void write(Engine& engine, std::int32_t slot, const update& u, const tensor_view<const T, 3>&, std::int64_t,
                    std::int64_t) {
    if constexpr (OnDevice) engine.selection().reserve_scores(slot, u.length, engine.stream());
  }
  /// On a device backend the child's scores are a copy of the parent's.
  template <bool OnDevice, class Engine>
  static void fork(Engine& engine, std::int32_t from, std::int32_t to) {
    if constexpr (OnDevice) engine.selection().copy_scores(from, to, engine.stream());
  }
  /// On a device backend the slot's score storage is freed.
  template <bool OnDevice, class Engine>
  static void release(Engine& engine, std::int32_t slot) {
    if constexpr (OnDevice) engine.selection().release_scores(slot);
  }
  /// The score buffer: 4 bytes per token and KV head, wherever it lives.
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state& state) noexcept {
    return state.scores.tokens() * state.scores.heads * static_cast<std::int64_t>(sizeof(float));
  }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  static group_combine score_combine(const S& s) noexcept { return s.combine; }
  static token_score_buffer& scores(sequence_state& state) noexcept { return state.scores; }
  static const token_score_buffer& scores(const sequence_state& state) noexcept { return state.scores; }

  /// The host ranking of `S::eviction_quota`: the live sealed positions in [first_evictable,
  /// quota.before) with the lowest shared scores. Cost: O(slots log slots) on the host.
  static std::vector<std::int64_t> evictions(const S& s, sequence_state& state, std::int64_t length, std::int64_t open_from,
                                             const eviction_view& live) {
    const score_eviction quota = selector_traits<S>::eviction_quota(s, state, length, open_from, live.stored);
    if (quota.count <= 0) return {};
    return lowest_scored(state.scores, live.evictable(quota.before), quota.count);
  }

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
