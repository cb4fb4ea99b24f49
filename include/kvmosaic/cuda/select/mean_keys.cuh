// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::mean_keys` on the CUDA backend (MosaicKV's stage 2): the mean key of every block of
/// each sealed page and the per-step scoring (q . mean) and top-k, `page_block_selection`'s.

#include "kvmosaic/cuda/select/page_blocks.cuh"
#include "kvmosaic/select/mean_keys.hpp"

namespace kvmosaic::cuda {

template <class Shapes>
class selection_stage<select::mean_keys, Shapes> : public page_block_selection<select::mean_keys, Shapes> {
 public:
  using page_block_selection<select::mean_keys, Shapes>::page_block_selection;
};

}  // namespace kvmosaic::cuda
