// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a selector is, and what it must provide.
///
/// A selector is a policy struct in `kvmosaic::select` declaring `using policy_category =
/// selector_tag;` and carrying its parameters (a budget, a window). It decides which tokens a
/// decode query sees. There are two kinds, and the difference matters to memory:
///   - *read less*: the cache keeps every token; the selector picks the pages (or token ranges)
///     one step reads. Memory is not freed. (`all`, and later `quest`, `sentence_chunks`.)
///   - *keep less*: tokens are evicted for good, and a compactor returns their memory.
///     (`streaming`, `h2o`, `snapkv`.)
///
/// `kvmosaic::selector_traits<Selector>` provides:
///   static constexpr const char* name;
///   static std::string describe(const Selector&);   // name plus parameters, for reports
///   static constexpr bool reads_all_pages;          // true: kernels read every page, no page list
///   static constexpr bool evicts;                   // true: a keep-less selector
///   static constexpr bool needs_token_ids;          // true: prefill and append take token ids
///   static void validate(const Selector&, int page_size);  // throws invalid_argument
///   static int bounds_block_tokens(const Selector&, int page_size);  // key bounds kept per block
///                                                   // of a page (0: none)
///
/// A read-less selector turns each step's queries into *spans* (runs of tokens with the min and
/// max of their keys, see select/span_score.hpp), scores them and picks some within a token
/// budget. What the attend path consumes is the same for every such selector: per (sequence, KV
/// head), the pages holding a selected token and, per page, which of its tokens are selected
/// (docs/selectors.md). The dense tail (and a format's sink rows) is always read.

#include <string>

#include "kvmosaic/core/policy.hpp"

namespace kvmosaic {

template <class Selector>
struct selector_traits {
  static_assert(sizeof(Selector) == 0,
                "kvmosaic: this type is not a selector: use one of kvmosaic::select::all, or "
                "specialize kvmosaic::selector_traits<YourSelector> as described in "
                "kvmosaic/select/selector_traits.hpp");
};

}  // namespace kvmosaic
