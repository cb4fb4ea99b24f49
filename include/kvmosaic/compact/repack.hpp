// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `compact::repack`: order-preserving compaction (TriAttention's first shape, in the eviction and
/// compaction notes).

#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/compact/compactor_traits.hpp"
#include "kvmosaic/memory/compaction_plan.hpp"

namespace kvmosaic {
namespace compact {

/// Every survivor slides forward, in logical order, so a sequence's slots are dense again and its
/// emptied tail pages go back to the pool; all survivors are read before any is written. Pages
/// shared with a fork are left as they are. Cost per pass: one row copy per survivor behind the
/// first hole (the most data movement of the two compactors), no position bookkeeping beyond the
/// cache's position map.
struct repack {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::repack> {
  static constexpr const char* name = "repack";
  static constexpr bool frees_memory = true;
  static std::string describe(const compact::repack&) { return "repack"; }
  /// The pass over one sequence's slots (`detail::plan_repack`; `round_start` is unused).
  static detail::compaction_plan plan(const compact::repack&, const std::vector<std::int64_t>& positions, int page_size,
                                      std::int64_t /*round_start*/, std::int32_t frozen_pages) {
    return detail::plan_repack(positions, page_size, frozen_pages);
  }
};

}  // namespace kvmosaic
