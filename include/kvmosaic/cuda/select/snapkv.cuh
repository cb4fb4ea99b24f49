// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::snapkv` on the CUDA backend: no selection stage. Its snapshot is the cache's
/// (`cache::snapshot`: the window's votes, `cache::window_votes`, computed by the decode kernels
/// and `kernel/window_votes.cuh` where the format writes logits, ranked on the host, then the
/// cache's eviction and a compaction pass on the device), so every step reads every live row of
/// every page, as `select::all` does.

#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/select/snapkv.hpp"

namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the cache's snapshot, eviction and compaction.
template <class Shapes>
class selection_stage<select::snapkv, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::snapkv&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
