// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `compact::hole_fill`: hole-filling compaction (TriAttention's second shape, in the eviction and
/// compaction notes).

#include <cstdint>
#include <string>
#include <vector>

#include "kvmosaic/compact/compactor_traits.hpp"
#include "kvmosaic/memory/compaction_plan.hpp"

namespace kvmosaic {
namespace compact {

/// The survivors written since a sequence's previous pass (the newest round) drop into the holes
/// eviction opened before it; the rest stays where it is. Far fewer copies than `repack`, but a
/// sequence's physical order of positions is scrambled: its position map (`cache::positions`) is
/// what position-dependent code (RoPE indices, prefix hashing) must read. Pages shared with a fork
/// are left as they are. Cost per pass: one row copy per survivor of the newest round.
struct hole_fill {
  using policy_category = compactor_tag;
};

}  // namespace compact

template <>
struct compactor_traits<compact::hole_fill> {
  static constexpr const char* name = "hole_fill";
  static constexpr bool frees_memory = true;
  static std::string describe(const compact::hole_fill&) { return "hole_fill"; }
  /// The pass over one sequence's slots (`detail::plan_hole_fill`): the round starts at the slot
  /// count the previous pass left.
  static detail::compaction_plan plan(const compact::hole_fill&, const std::vector<std::int64_t>& positions, int page_size,
                                      std::int64_t round_start, std::int32_t frozen_pages) {
    return detail::plan_hole_fill(positions, page_size, round_start, frozen_pages);
  }
};

}  // namespace kvmosaic
