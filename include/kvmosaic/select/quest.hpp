// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::quest`: query-aware block selection (Quest, Tang et al., ICML 2024; the stage-2 page
/// selection of MosaicKV, section 4.2; "page selection without eviction" in the eviction notes).

#include <algorithm>
#include <cstdint>
#include <string>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/select/selection_request.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace select {

/// Reads, per (sequence, KV head) and step, the blocks of sealed pages with the highest upper
/// bound of q . k, within a token budget, plus the dense tail (always read).
///
/// What it computes: each block of `block_tokens` tokens of a page keeps the channel-wise min and
/// max of its keys (`lo`, `hi`, in the storage dtype: exact), written when the page is sealed (at
/// prefill or when an append fills the tail), never recomputed. A step scores every block with
/// sum_c max(q_c hi_c, q_c lo_c), combines the group's query heads (`combine`), and reads the
/// top floor(budget / block_tokens) blocks (higher score first, ties to the earlier block). The
/// keys are the exact rows before the format encodes them, so for lossy formats the bound is on
/// the original keys (as in Quest, whose metadata is taken before anything else).
///
/// Cost: 2 x head_dim 16-bit values per block and KV head of memory (1/32 of a dense K page at
/// block 64: counted in `memory_stats`); per step, reading those bounds (1/64 of the dense K+V
/// bytes at block 64) and a top-k per (sequence, KV head). Memory is not freed: a read-less
/// selector (size the pool as if uncompressed).
///
/// Blocks: `block_tokens` tokens (default 16, Quest's own block; 0 = the page size). A block
/// smaller than a page makes the selection token-granular: both backends read the selected pages
/// with the unselected tokens masked, which costs more time per step than whole-page blocks and
/// recovers most of the fidelity whole pages lose at small budgets (docs/defaults.md,
/// docs/selectors.md).
struct quest {
  using policy_category = selector_tag;

  token_budget budget{};                      ///< tokens picked per (sequence, KV head) and step
  int block_tokens = 16;                      ///< tokens per block: 0 = the page size, or a multiple of 8
                                              ///< dividing it
  group_combine combine = group_combine::max; ///< how the group's scores select for its KV head

  /// The block size for pages of `page_size` tokens.
  int block_for(int page_size) const noexcept { return block_tokens == 0 ? page_size : block_tokens; }
};

}  // namespace select

namespace detail {
/// The traits of a selector that scores fixed blocks of every page from a summary kept with the
/// page (`select::quest`, `select::mean_keys`): a `Selector` with `budget`, `block_tokens`,
/// `combine` and `block_for`; `Name` its name ("quest"). Keeps nothing per sequence: the
/// summaries live with each page, in the engine.
template <class Selector, const char* Name, block_summary Summary>
struct page_block_selector_traits : stateless_selector_hooks {
  static constexpr const char* name = Name;
  static constexpr bool reads_all_pages = false;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = false;
  static constexpr block_summary summary = Summary;
  static std::string describe(const Selector& s) {
    std::string text = std::string(Name) + "(";
    text += s.budget.describe();
    if (s.block_tokens != 0) text += ", block " + std::to_string(s.block_tokens);
    text += std::string(", ") + to_string(s.combine) + ")";
    return text;
  }
  /// Checks the parameters against the cache's page size (throws `invalid_argument` naming
  /// select::<name>).
  static void validate(const Selector& s, int page_size) {
    const std::string where = std::string("select::") + Name;
    s.budget.validate(where.c_str());
    const int block = s.block_for(page_size);
    require(block >= 8 && block % 8 == 0 && page_size % block == 0, where.c_str(), "block_tokens", s.block_tokens,
            "0 (the page size) or a multiple of 8 that divides page_size");
  }
  /// Tokens per block whose summary the cache keeps with each page.
  static int bounds_block_tokens(const Selector& s, int page_size) noexcept { return s.block_for(page_size); }
  /// A step scores the page blocks of every sequence.
  static selection_request start_request(const Selector& s, const selector_shape& shape) {
    selection_request r;
    r.combine = s.combine;
    r.block_tokens = s.block_for(shape.page_size);
    return r;
  }
  /// One sequence's entry: the budget for its length, and nothing read besides the selection but
  /// the tail. A sequence whose tail is empty reads at least one block, so that every step attends
  /// to a token. Cost: O(1).
  static void request(const Selector& s, const selector_shape&, const sequence_state&, std::int64_t length,
                      std::int64_t tail_rows, selection_request& r) {
    const std::int64_t budget = s.budget.resolve(length);
    r.budget.push_back(tail_rows == 0 ? std::max<std::int64_t>(budget, r.block_tokens) : budget);
    r.always_from.push_back(length);
  }
};
inline constexpr char quest_name[] = "quest";
}  // namespace detail

/// Quest's bounds live with each page, in the engine.
template <>
struct selector_traits<select::quest>
    : detail::page_block_selector_traits<select::quest, detail::quest_name, block_summary::bounds> {};

}  // namespace kvmosaic
