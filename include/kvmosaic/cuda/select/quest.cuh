// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::quest` on the CUDA backend (Quest, Tang et al., ICML 2024): the key bounds of every
/// block of each sealed page and the per-step scoring and top-k, `page_block_selection`'s.

#include "kvmosaic/cuda/select/page_blocks.cuh"
#include "kvmosaic/select/quest.hpp"

namespace kvmosaic::cuda {

template <class Shapes>
class selection_stage<select::quest, Shapes> : public page_block_selection<select::quest, Shapes> {
 public:
  using page_block_selection<select::quest, Shapes>::page_block_selection;
};

}  // namespace kvmosaic::cuda
