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
/// and, where `reads_all_pages` is false, the per-step selection of the pages each
/// (sequence, KV head) reads; the attend kernels consume that list and never learn which selector
/// produced it. The dense tail is always read.

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
