// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `select::all` on the CUDA backend: no selection stage. Every step's splits read every sealed
/// page through the sequences' own block tables; nothing is kept, staged or launched, and no
/// selection kernel is compiled.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/kernel/decode.cuh"
#include "kvmosaic/cuda/select/selection_stage.cuh"
#include "kvmosaic/select/all.hpp"

namespace kvmosaic::cuda {

/// Reads everything. Cost: none.
template <class Shapes>
class selection_stage<select::all, Shapes> {
 public:
  static constexpr bool selects = false;

  selection_stage(const kvmosaic::detail::engine_shape&, const select::all&) noexcept {}
  std::size_t page_bytes() const noexcept { return 0; }
  void seal(const sealed_pages&, cudaStream_t) noexcept {}
  void commit() noexcept {}
  void rollback() noexcept {}
  void plan(const kvmosaic::detail::selection_request* request, const std::vector<step_sequence>& batch,
            std::vector<std::int32_t>& read_pages) const {
    kvmosaic::detail::require(request == nullptr, "cuda::engine::plan", "selection request", "given",
                              "none: select::all reads every page");
    for (std::size_t b = 0; b < batch.size(); ++b) read_pages[b] = batch[b].sealed_pages;
  }
  std::size_t staged_bytes() const noexcept { return 0; }
  void stage(std::byte*) const noexcept {}
  void reserve(std::int32_t, std::int32_t, bool = false) noexcept {}
  void use_live_masks(const std::uint32_t*) noexcept {}  // the engine's live masks serve every page
  bool planned() const noexcept { return false; }
  bool row_masks() const noexcept { return false; }
  void bind(kernel::decode_params&) const noexcept {}
  void launch(const kernel::decode_params&, const std::byte*, const float*, cudaStream_t) noexcept {}
};

}  // namespace kvmosaic::cuda
