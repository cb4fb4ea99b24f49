// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::all`: every token is read at every step (exact attention over the stored cache).

#include <string>

#include "kvmosaic/select/selector_traits.hpp"

namespace kvmosaic {
namespace select {

/// Reads every page and the tail. Cost: none beyond the attention itself. Source: the baseline.
struct all {
  using policy_category = selector_tag;
};

}  // namespace select

template <>
struct selector_traits<select::all> : stateless_selector_hooks {
  static constexpr const char* name = "all";
  static constexpr bool reads_all_pages = true;
  static constexpr bool evicts = false;
  static constexpr bool needs_token_ids = false;
  static std::string describe(const select::all&) { return "all"; }
  static void validate(const select::all&, int /*page_size*/) {}
  static int bounds_block_tokens(const select::all&, int) noexcept { return 0; }
};

}  // namespace kvmosaic
