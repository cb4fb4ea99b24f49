// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `compact::none`: no compaction. The right choice with a read-less selector, which evicts nothing.

#include <string>

#include "kvmosaic/compact/compactor_traits.hpp"

namespace kvmosaic {
namespace compact {

/// Never moves a token or frees a page. Cost: none.
struct none {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::none> {
  static constexpr const char* name = "none";
  static constexpr bool frees_memory = false;
  static std::string describe(const compact::none&) { return "none"; }
};

}  // namespace kvmosaic
