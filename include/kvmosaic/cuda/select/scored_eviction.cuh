// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::tova` and `select::h2o` on the CUDA backend: no selection stage. Every step reads
/// every live row, as `select::all` does; the step's token scores come from the split kernels'
/// logits (`cuda::engine::plan` with score_settings, kernel/token_scores.cuh), and the evictions
/// they drive are the cache's (host bookkeeping, live-row masks, compaction on the device).

#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/select/h2o.hpp"
#include "kvmosaic/select/tova.hpp"

namespace kvmosaic::cuda {

/// Reads every live row. Cost: none beyond the scores and the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::tova, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::tova&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

/// Reads every live row. Cost: none beyond the scores and the cache's eviction and compaction.
template <class Shapes>
class selection_stage<select::h2o, Shapes> : public selection_stage<select::all, Shapes> {
 public:
  selection_stage(const kvmosaic::detail::engine_shape& shape, const select::h2o&) noexcept
      : selection_stage<select::all, Shapes>(shape, select::all{}) {}
};

}  // namespace kvmosaic::cuda
