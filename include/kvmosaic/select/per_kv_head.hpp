// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::per_kv_head<S>`: a keep-less selector run by each KV head on its own tokens, with a
/// budget per head (H2O, TOVA and SnapKV as their papers score, one decision per head; budgets
/// that differ across heads, set or, for SnapKV, allocated by Ada-KV's rule), and memory freed
/// per head. A cache of it is
/// `cache<Format, select::per_kv_head<S>, Compactor, Backend>` (per_kv_head_cache.hpp), which
/// stores each KV head of a sequence in pages of its own: docs/architecture.md, "Per-KV-head
/// eviction".

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/snapkv.hpp"
#include "kvmosaic/select/span_score.hpp"
#include "kvmosaic/select/token_scores.hpp"

namespace kvmosaic {
namespace select {

/// Runs the keep-less selector `S` (select::h2o, tova, snapkv, streaming) on each KV head alone:
/// head h keeps the tokens that S keeps when it sees head h's scores only, within `budgets[h]`
/// (every head `selector.budget` when `budgets` is empty). The sinks and the dense tail are each
/// head's, as a cache's are.
///
/// What it computes: for each KV head, attention over the tokens that head keeps. Cost: a head's
/// tokens, scores and evictions cost what a one-head sequence's cost under S; a step plans
/// num_kv_heads times as many (one-head) sequences, and block tables hold one entry per head page
/// (4 bytes per head and page instead of per page). Kernels are those of S's cache, unchanged.
template <class S>
struct per_kv_head {
  using policy_category = selector_tag;
  using selector_type = S;

  S selector{};                         ///< the policy each KV head runs, with its default budget
  std::vector<token_budget> budgets{};  ///< per KV head, num_kv_heads of them; empty: selector.budget
  /// select::snapkv only: Ada-KV's allocation (Feng et al., "Ada-KV: Optimizing KV Cache
  /// Eviction by Adaptive Budget Allocation"): a snapshot evicts as many tokens as the heads'
  /// budgets ask in all, the lowest pooled votes of all heads ranked together, so that a head
  /// whose attention is spread keeps more than one whose attention is concentrated.
  bool adaptive = false;
  /// With `adaptive`: the share of the tokens a head would keep under its own budget that it keeps
  /// whatever the other heads score (Ada-KV's safeguard; kvpress's default 0.2).
  double safeguard = 0.2;

  /// Head `head`'s budget.
  const token_budget& budget_of(int head) const noexcept {
    return budgets.empty() ? selector.budget : budgets[static_cast<std::size_t>(head)];
  }
};

}  // namespace select

namespace detail {
template <class S>
struct is_per_kv_head : std::false_type {};
template <class S>
struct is_per_kv_head<select::per_kv_head<S>> : std::true_type {};

/// The policy a cache of `Selector` runs per sequence, and access to it: `Selector` itself, or S
/// of `select::per_kv_head<S>` (each head's lane runs it).
template <class Selector>
struct policy_of {
  using type = Selector;
  static Selector& get(Selector& s) noexcept { return s; }
};
template <class S>
struct policy_of<select::per_kv_head<S>> {
  using type = S;
  static S& get(select::per_kv_head<S>& s) noexcept { return s.selector; }
};
}  // namespace detail

/// `select::per_kv_head<S>`'s traits: its name, description and checks, and S's properties
/// (what it reads, whether it evicts, which scores its lanes record), so that code reading a
/// selector's properties reads these. It declares no per-sequence hooks: S's run in each lane
/// (per_kv_head_cache.hpp), and the primary cache template does not take it.
template <class S>
struct selector_traits<select::per_kv_head<S>> {
  static_assert(selector_traits<S>::evicts && detail::has_token_budget<S>::value,
                "kvmosaic::select::per_kv_head<S>: S must be a keep-less selector with a token budget "
                "(select::h2o, select::tova, select::snapkv, select::streaming); read-less selectors "
                "(select::quest, select::mean_keys) already choose per KV head at each step");
  static constexpr const char* name = "per_kv_head";
  static constexpr bool reads_all_pages = selector_traits<S>::reads_all_pages;
  static constexpr bool evicts = true;
  static constexpr bool needs_token_ids = selector_traits<S>::needs_token_ids;
  static constexpr score_use token_scores = detail::token_scores_of<S>::value;
  static constexpr bool reads_window_votes = detail::reads_window_votes<S>::value;
  template <class Cache>
  struct cache_members {};  // the specialization's own members (snapshot) stand in

  static std::string describe(const select::per_kv_head<S>& s) {
    std::string text = std::string("per_kv_head(") + selector_traits<S>::describe(s.selector);
    if (s.adaptive) text += ", adaptive, safeguard " + detail::to_text(s.safeguard);
    if (!s.budgets.empty()) {
      text += ", budgets";
      for (const select::token_budget& b : s.budgets) text += " " + b.describe() + ";";
      text.pop_back();
    }
    return text + ")";
  }
  /// Throws `invalid_argument` naming `budgets` unless it is empty or has one budget per KV head,
  /// each valid, or naming S's field that S's own checks reject.
  static void validate(const select::per_kv_head<S>& s, int num_kv_heads, int page_size) {
    const char* where = "select::per_kv_head";
    selector_traits<S>::validate(s.selector, page_size);
    detail::require(s.budgets.empty() || static_cast<int>(s.budgets.size()) == num_kv_heads, where, "budgets.size()",
                    static_cast<std::int64_t>(s.budgets.size()), "0 (selector.budget for every head) or num_kv_heads");
    for (const select::token_budget& b : s.budgets) b.validate(where);
    detail::require(!s.adaptive || std::is_same<S, select::snapkv>::value, where, "adaptive", "true",
                    "false unless S is select::snapkv (Ada-KV ranks one snapshot's votes of every head together)");
    detail::require(s.safeguard >= 0.0 && s.safeguard <= 1.0, where, "safeguard", s.safeguard, "0 to 1");
  }
};

}  // namespace kvmosaic
