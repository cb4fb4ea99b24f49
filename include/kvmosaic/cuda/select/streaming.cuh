// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::streaming` on the CUDA backend: no selection stage. Its evictions are the cache's
/// (host bookkeeping, live-row masks staged with each step, compaction passes on the device), so
/// every step reads every live row of every page, as `select::all` does.

#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/select/streaming.hpp"

namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::streaming, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::streaming&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
