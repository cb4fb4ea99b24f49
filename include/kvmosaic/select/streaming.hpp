// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::streaming`: attention sinks plus a recent window (StreamingLLM, Xiao et al., ICLR
/// 2024; "sink plus recency" in the eviction and compaction notes), the rest evicted for good.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// Keeps the first `sink_tokens` tokens and the most recent ones within a token budget (the
/// window is the budget less the sinks); every other token is evicted once it is sealed in a
/// page (the dense tail is never evicted), and every `compact_every` tokens written the cache runs
/// its compactor over the sequence. Needs a compactor that frees memory
/// (`cache<F, select::streaming, compact::repack>`).
///
/// What it computes: attention over the sinks, the window and the tail; no scores are read, so the
/// attention kernels are the plain ones. Cost: eviction bookkeeping per write (O(tokens evicted));
/// a compaction pass per `compact_every` tokens; memory bounded by the budget plus a page per
/// partially dead page and the tail, once compacted.
struct streaming {
  using policy_category = selector_tag;

  int sink_tokens = 4;           ///< tokens kept from the start (StreamingLLM's attention sinks)
  token_budget budget{};         ///< tokens kept: sinks plus window (tokens, or a ratio of the length)
  int compact_every = 128;       ///< tokens written between compaction passes (TriAttention: 128)
};

/// Per sequence: the first position not yet evicted past the sinks, and tokens written since the
/// last compaction.
struct streaming_state {
  std::int64_t evicted_to = 0;
  std::int64_t since_compaction = 0;
};

}  // namespace select

template <>
struct selector_traits<select::streaming> : stateless_selector_hooks {
  static constexpr const char* name = "streaming";
  static constexpr bool reads_all_pages = true;  // every live token: eviction already dropped the rest
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = false;
  static std::string describe(const select::streaming& s) {
    return "streaming(" + std::to_string(s.sink_tokens) + " sinks, " + s.budget.describe() + ", compact every " +
           std::to_string(s.compact_every) + ")";
  }
  static void validate(const select::streaming& s, int /*page_size*/) {
    const char* where = "select::streaming";
    s.budget.validate(where);
    detail::require(s.sink_tokens >= 0 && s.sink_tokens <= 1024, where, "sink_tokens", s.sink_tokens, "0 to 1024");
    detail::require(s.compact_every >= 1, where, "compact_every", s.compact_every, ">= 1");
  }
  static int bounds_block_tokens(const select::streaming&, int) noexcept { return 0; }

  using sequence_state = select::streaming_state;
  using update = stateless_selector_hooks::update;
  // Writes stage nothing: the cache asks for evictions after each write (`evictions`).
  template <bool OnDevice, class T>
  static update stage(const select::streaming&, const selector_shape&, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t, std::int64_t) noexcept {
    return {};
  }
  static void reserve(sequence_state&, const update&) noexcept {}
  static void commit(sequence_state&, update&) noexcept {}
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state&) noexcept { return 0; }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }

  /// The positions to evict now from a sequence of `length` tokens whose tokens before `open_from`
  /// are sealed: those past the sinks and before the window, not evicted yet. Cost: O(result).
  static std::vector<std::int64_t> evictions(const select::streaming& s, sequence_state& state, std::int64_t length,
                                             std::int64_t open_from, const eviction_view& /*live*/) {
    const std::int64_t keep = std::max<std::int64_t>(s.budget.resolve(length), s.sink_tokens);
    const std::int64_t window_from = length - (keep - s.sink_tokens);
    const std::int64_t from = std::max<std::int64_t>(state.evicted_to, s.sink_tokens);
    const std::int64_t to = std::min(window_from, open_from);
    std::vector<std::int64_t> out;
    for (std::int64_t p = from; p < to; ++p) out.push_back(p);
    state.evicted_to = std::max(state.evicted_to, to);
    return out;
  }
  /// Whether `written` more tokens bring the sequence to its next compaction pass.
  static bool compaction_due(const select::streaming& s, sequence_state& state, std::int64_t written) noexcept {
    state.since_compaction += written;
    if (state.since_compaction < s.compact_every) return false;
    state.since_compaction = 0;
    return true;
  }
};

}  // namespace kvmosaic
