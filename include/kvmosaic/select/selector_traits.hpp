// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a selector is, and what it must provide.
///
/// A selector is a policy struct in `kvmosaic::select` declaring `using policy_category =
/// selector_tag;` and carrying its parameters (a budget, a window). It decides which tokens a
/// decode query sees. There are two kinds, and the difference matters to memory:
///   - *read less*: the cache keeps every token; the selector picks the pages (or token ranges)
///     one step reads. Memory is not freed. (`all`, `quest`, `sentence_chunks`.)
///   - *keep less*: tokens are evicted for good, and a compactor returns their memory.
///     (`streaming`, `h2o`, `snapkv`.)
///
/// `kvmosaic::selector_traits<Selector>` provides, as a description:
///   static constexpr const char* name;
///   static std::string describe(const Selector&);   // name plus parameters, for reports
///   static constexpr bool reads_all_pages;          // true: kernels read every page, no page list
///   static constexpr bool evicts;                   // true: a keep-less selector
///   static constexpr bool needs_token_ids;          // true: prefill and append take token ids
///   static void validate(const Selector&, int page_size);  // throws invalid_argument
///   static int bounds_block_tokens(const Selector&, int page_size);  // key bounds kept per block
///                                                   // of a page (0: none)
///   static constexpr block_summary summary;         // optional, default block_summary::bounds:
///                                                   // what each block keeps (span_score.hpp)
///   static constexpr bool keeps_token_ranges;       // optional, default false: true when the
///                                                   // selector's metadata names runs of slots
///                                                   // (sentence chunks), which a compaction
///                                                   // would move under it
///
/// and, as behaviour, the host hooks the cache calls for every selector without naming one
/// (`stateless_selector_hooks` below is the set for a selector that keeps nothing per sequence;
/// a selector's traits derive from it and replace what they need). `OnDevice` is true when the
/// backend keeps K and V rows in device memory (backend::cuda): then `k` must not be read on the
/// host, and work on the keys is the selector's device part (`cuda::selection_stage<Selector,
/// Shapes>`, cuda/select/selection_stage.cuh, reached as `engine.selection()`; the `write`,
/// `fork`, `release` hooks drive it).
///
///   using sequence_state = ...;   // per sequence, held by the cache: default-constructed by
///                                 // add_sequence (may throw), copied by fork_sequence (may throw)
///   using update = ...;           // what some rows add to a sequence_state, staged
///   template <class Cache> struct cache_members;  // public members the selector adds to the
///                                 // cache (a base of cache<...>, CRTP; they read the state with
///                                 // Cache::selector_state(seq))
///   template <bool OnDevice, class T>
///   static update stage(const Selector&, const selector_shape&, const sequence_state&,
///                       const tensor_view<const T, 3>& k, span<const std::int32_t> ids,
///                       std::int64_t first, std::int64_t n);
///                                 // what rows [first, first + n) of k (and their ids, host
///                                 // memory; empty unless needs_token_ids) add; may throw, must
///                                 // not change the state
///   static void reserve(sequence_state&, const update&);  // room, so that commit cannot throw;
///                                 // may throw (allocation), changes no observable value
///   static void commit(sequence_state&, update&) noexcept;  // applies a staged update
///   template <bool OnDevice, class Engine, class T>
///   static void write(Engine&, std::int32_t slot, const update&, const tensor_view<const T, 3>& k,
///                     std::int64_t first, std::int64_t n);
///                                 // the engine's part of an update, after the rows' write and
///                                 // before commit; may throw (the engine's rollback undoes it)
///   template <bool OnDevice, class Engine>
///   static void fork(Engine&, std::int32_t from, std::int32_t to);  // the engine's part of a
///                                 // fork (pending until the engine's commit, as write)
///   template <bool OnDevice, class Engine>
///   static void release(Engine&, std::int32_t slot);  // the engine's part of remove_sequence
///   static std::int64_t extra_bytes(const selector_shape&, const sequence_state&);  // bytes the
///                                 // selector keeps for the sequence (memory_stats)
///   static std::int64_t always_from(const sequence_state&, std::int64_t sealed);  // the first
///                                 // sealed token every step reads whatever the selection (the
///                                 // selection statistics' reuse); `sealed` when none
///   // keep-less selectors (evicts == true) also provide:
///   static std::vector<std::int64_t> evictions(const Selector&, sequence_state&,
///                       std::int64_t length, std::int64_t open_from, const eviction_view&);
///                                 // after each write: the positions to evict now (sealed, below
///                                 // `open_from`; the cache passes over those already evicted)
///   static bool compaction_due(const Selector&, sequence_state&, std::int64_t written);
///                                 // whether `written` more tokens bring the next compaction pass
///   static constexpr score_use token_scores;        // optional, default score_use::none: the
///                                 // attend path's per-token scores the selector reads
///                                 // (select/token_scores.hpp); with it
///   static group_combine score_combine(const Selector&);   // how the group's probabilities combine
///   static detail::token_score_buffer& scores(sequence_state&);  // where steps write them (and
///                                 // the const overload)
///   static score_eviction eviction_quota(const Selector&, const sequence_state&,
///                       std::int64_t length, std::int64_t open_from, std::int64_t stored);
///                                 // how many of the lowest-scored tokens below which position
///                                 // to evict after a write (`evictions` ranks them on the host;
///                                 // a device backend ranks them where its scores are)
///   // read-less selectors (reads_all_pages == false) also provide:
///   static detail::selection_request start_request(const Selector&, const selector_shape&);
///                                 // the step's fields (score combination, span kind)
///   static void request(const Selector&, const selector_shape&, const sequence_state&,
///                       std::int64_t length, std::int64_t tail_rows, detail::selection_request&);
///                                 // appends one sequence's entry (budget, always_from, spans)
///
/// A read-less selector turns each step's queries into *spans* (runs of tokens with the min and
/// max of their keys, see select/span_score.hpp), scores them and picks some within a token
/// budget. What the attend path consumes is the same for every such selector: per (sequence, KV
/// head), the pages holding a selected token and, per page, which of its tokens are selected
/// (docs/selectors.md). The dense tail (and a format's exact sink and window rows) is always read.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/select/selection_request.hpp"
#include "kvmosaic/select/span_score.hpp"
#include "kvmosaic/select/token_scores.hpp"

namespace kvmosaic {

template <class Selector>
struct selector_traits {
  static_assert(sizeof(Selector) == 0,
                "kvmosaic: this type is not a selector: use one of kvmosaic::select::all, or "
                "specialize kvmosaic::selector_traits<YourSelector> as described in "
                "kvmosaic/select/selector_traits.hpp");
};

/// What a selector's hooks know of the cache they serve (from its validated cache_config).
struct selector_shape {
  int num_kv_heads;
  int head_dim;
  int page_size;
  dtype storage;  ///< f16 or bf16: the dtype keys are stored (and bounded) in
};

/// What a keep-less selector's `evictions` may read of its sequence besides its own state.
struct eviction_view {
  std::int64_t stored = 0;                  ///< live tokens, the tail's rows included
  const std::int64_t* slot_positions = nullptr;  ///< per sealed slot, its logical position (-1: evicted)
  std::int64_t slots = 0;                   ///< sealed slots
  std::int64_t first_evictable = 0;         ///< the format's sink tokens (always kept) end here

  /// The live sealed positions in [first_evictable, before), ascending. Cost: O(slots log slots).
  std::vector<std::int64_t> evictable(std::int64_t before) const {
    std::vector<std::int64_t> out;
    for (std::int64_t i = 0; i < slots; ++i) {
      const std::int64_t p = slot_positions[i];
      if (p >= first_evictable && p < before) out.push_back(p);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

/// The host hooks of a selector that keeps nothing per sequence (`select::all`, `select::quest`):
/// an empty state, nothing staged, nothing kept in the engine, no bytes counted. Cost: none.
struct stateless_selector_hooks {
  struct sequence_state {};
  struct update {};
  template <class Cache>
  struct cache_members {};
  template <bool OnDevice, class Selector, class T>
  static update stage(const Selector&, const selector_shape&, const sequence_state&, const tensor_view<const T, 3>&,
                      span<const std::int32_t>, std::int64_t, std::int64_t) noexcept {
    return {};
  }
  static void reserve(sequence_state&, const update&) noexcept {}
  static void commit(sequence_state&, update&) noexcept {}
  template <bool OnDevice, class Engine, class T>
  static void write(Engine&, std::int32_t, const update&, const tensor_view<const T, 3>&, std::int64_t,
                    std::int64_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void fork(Engine&, std::int32_t, std::int32_t) noexcept {}
  template <bool OnDevice, class Engine>
  static void release(Engine&, std::int32_t) noexcept {}
  static std::int64_t extra_bytes(const selector_shape&, const sequence_state&) noexcept { return 0; }
  static std::int64_t always_from(const sequence_state&, std::int64_t sealed) noexcept { return sealed; }
};

namespace detail {
/// The members `Selector` adds to `Cache` (`selector_traits<Selector>::cache_members<Cache>`), or
/// none when `Selector` is not a selector (the cache then fails with one sentence naming it).
template <class Selector, class Cache, bool = is_selector_v<Selector>>
struct selector_cache_members {
  struct type {};
};
template <class Selector, class Cache>
struct selector_cache_members<Selector, Cache, true> {
  using type = typename selector_traits<Selector>::template cache_members<Cache>;
};

/// `selector_traits<Selector>::summary`, block_summary::bounds when the traits do not declare it.
template <class Selector, class = void>
struct block_summary_of {
  static constexpr block_summary value = block_summary::bounds;
};
template <class Selector>
struct block_summary_of<Selector, std::void_t<decltype(selector_traits<Selector>::summary)>> {
  static constexpr block_summary value = selector_traits<Selector>::summary;
};

/// `selector_traits<Selector>::token_scores`, score_use::none when the traits do not declare it.
template <class Selector, class = void>
struct token_scores_of {
  static constexpr score_use value = score_use::none;
};
template <class Selector>
struct token_scores_of<Selector, std::void_t<decltype(selector_traits<Selector>::token_scores)>> {
  static constexpr score_use value = selector_traits<Selector>::token_scores;
};

/// `selector_traits<Selector>::reads_window_votes` (the selector ranks by `cache::window_votes`:
/// select::snapkv), false when the traits do not declare it. An engine takes the kernels that
/// write logits for such a selector, so that the votes are computed where the keys are.
template <class Selector, class = void>
struct reads_window_votes : std::false_type {};
template <class Selector>
struct reads_window_votes<Selector, std::void_t<decltype(selector_traits<Selector>::reads_window_votes)>>
    : std::bool_constant<selector_traits<Selector>::reads_window_votes> {};

/// `selector_traits<Selector>::keeps_token_ranges`, false when the traits do not declare it.
template <class Selector, class = void>
struct keeps_token_ranges : std::false_type {};
template <class Selector>
struct keeps_token_ranges<Selector, std::void_t<decltype(selector_traits<Selector>::keeps_token_ranges)>>
    : std::bool_constant<selector_traits<Selector>::keeps_token_ranges> {};

/// Whether `Selector` has a `budget` member of type `select::token_budget` (every selector of this
/// library but select::all): what a per-sequence budget replaces.
template <class Selector, class = void>
struct has_token_budget : std::false_type {};
template <class Selector>
struct has_token_budget<Selector, std::void_t<decltype(std::declval<Selector&>().budget)>>
    : std::is_same<std::remove_reference_t<decltype(std::declval<Selector&>().budget)>, select::token_budget> {};
}  // namespace detail

}  // namespace kvmosaic
