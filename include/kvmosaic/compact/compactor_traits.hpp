// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a compactor is, and what it must provide.
///
/// A compactor is a policy struct in `kvmosaic::compact` declaring `using policy_category =
/// compactor_tag;`. It turns tokens a keep-less selector evicted into freed pages: it moves
/// surviving tokens between slots, updates block tables and logical positions together, never
/// moves or frees a page whose reference count is above one, and reports pages freed, slot copies
/// and tokens evicted per pass. `kvmosaic::compactor_traits<Compactor>` provides
///   static constexpr const char* name;
///   static std::string describe(const Compactor&);
///   static constexpr bool frees_memory;   // false for compact::none
/// and, for compactors that free memory, the compaction pass over one sequence.

#include <string>

#include "kvmosaic/core/policy.hpp"

namespace kvmosaic {

template <class Compactor>
struct compactor_traits {
  static_assert(sizeof(Compactor) == 0,
                "kvmosaic: this type is not a compactor: use one of kvmosaic::compact::none, or "
                "specialize kvmosaic::compactor_traits<YourCompactor> as described in "
                "kvmosaic/compact/compactor_traits.hpp");
};

}  // namespace kvmosaic
