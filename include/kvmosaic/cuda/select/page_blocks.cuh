// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CUDA part every selector that scores fixed blocks of each page from a summary kept with the
/// page shares (`select::quest`: key bounds; `select::mean_keys`: mean keys; `block_summary`): the
/// summary of every block of each sealed page, written on the device when the page is sealed (from
/// its exact dense rows, before a format encodes them), and per step a scoring and top-k pass over
/// them (`span_selection`) that writes each KV head's page table, with row masks when blocks are
/// smaller than a page.
///
/// Cost: `summary_rows` x head_dim 16-bit values per block, KV head and page of device memory
/// (counted in `memory_stats`); per sealed page one pass over its K rows; per step the span
/// selection's.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/kernel/select_pages.cuh"
#include "kvmosaic/cuda/select/selection_stage.cuh"
#include "kvmosaic/cuda/select/span_selection.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/select/selector_traits.hpp"

namespace kvmosaic::cuda {

/// The spans are the blocks of the pages; staging, outputs, the launch and the read-back are
/// `span_selection`'s. `Selector` has `block_for(page_size)`; its traits' `summary` says what a
/// block keeps.
template <class Selector, class Shapes>
class page_block_selection : public span_selection<Shapes> {
  using spans = span_selection<Shapes>;
  static constexpr block_summary summary = kvmosaic::detail::block_summary_of<Selector>::value;

 public:
  /// Summaries for every page of the pool, `selector.block_for(page_size)` tokens per block:
  /// dense rows, or (mean keys, `block_key_bytes` > 0) a format's block keys, which the engine has
  /// its format write at each seal (`block_key_arena`) and score from its queries
  /// (`use_block_keys`).
  page_block_selection(const kvmosaic::detail::engine_shape& shape, const Selector& selector, std::size_t block_key_bytes = 0)
      : spans(shape, selector.block_for(shape.page_size) < shape.page_size),
        shape_(shape),
        geometry_(shape, selector.block_for(shape.page_size), summary, summary == block_summary::mean ? block_key_bytes : 0),
        bounds_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_bytes) {
    kvmosaic::detail::require(geometry_.block_tokens % 8 == 0 && shape.page_size % geometry_.block_tokens == 0,
                              "cuda::engine", "block_tokens", geometry_.block_tokens,
                              "a multiple of 8 that divides the page size");
    span_source source{bounds_.as<const std::byte>(), static_cast<std::int64_t>(geometry_.page_bytes),
                       geometry_.blocks_per_page, geometry_.block_tokens, nullptr, geometry_.block_tokens, false};
    source.summary_rows = geometry_.rows_per_block;
    source.key_bytes = geometry_.format_keys ? static_cast<int>(geometry_.block_bytes) : 0;
    spans::use_source(source);
  }

  /// Whether the blocks keep a format's block keys (which the engine writes) rather than rows.
  bool format_block_keys() const noexcept { return geometry_.format_keys; }
  /// The block keys' arena, [max_pages][num_kv_heads][blocks][block_key_bytes], and its geometry.
  std::byte* block_key_arena() noexcept { return bounds_.as<std::byte>(); }
  const kvmosaic::detail::bounds_geometry& geometry() const noexcept { return geometry_; }

  /// Device summaries of each page: [max_pages][num_kv_heads][blocks][summary rows], storage dtype.
  std::size_t page_bytes() const noexcept { return geometry_.page_bytes; }
  const std::byte* bounds_data() const noexcept { return bounds_.as<const std::byte>(); }

  /// The summary of every block of the sealed pages, from their dense rows. One CTA per page, KV
  /// head and block; one thread per channel.
  void seal(const sealed_pages& sealed, cudaStream_t stream) {
    if (sealed.n == 0 || geometry_.format_keys) return;  // block keys: the engine's format writes them
    kernel::bounds_params b{};
    b.rows = sealed.rows;
    b.rows_slot_bytes = sealed.rows_slot_bytes;
    b.rows_head_bytes = sealed.rows_head_bytes;
    b.row_slots = sealed.row_slots;
    b.new_pages = sealed.page_ids;
    b.bounds = bounds_.as<std::byte>();
    b.bounds_page_bytes = static_cast<std::int64_t>(geometry_.page_bytes);
    b.block_tokens = geometry_.block_tokens;
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto dim, auto) {
      constexpr int head_dim = decltype(dim)::value;
      kernel::page_bounds_kernel<decltype(element), head_dim, summary == block_summary::mean>
          <<<dim3(static_cast<unsigned>(sealed.n), static_cast<unsigned>(shape_.num_kv_heads),
                  static_cast<unsigned>(geometry_.blocks_per_page)),
             head_dim, 0, stream>>>(b);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
  // Bounds are written only to pages not yet committed: nothing to undo or apply.
  void commit() noexcept {}
  void rollback() noexcept {}

  /// Pages each sequence's splits cover: whole pages, min(budget / page_size, sealed pages); with
  /// sub-page blocks at most min(budget / block, sealed pages), which the splits share as the
  /// device marks them.
  void plan(const kvmosaic::detail::selection_request* request, const std::vector<step_sequence>& batch,
            std::vector<std::int32_t>& read_pages) {
    if (request == nullptr) {
      for (std::size_t b = 0; b < batch.size(); ++b) read_pages[b] = batch[b].sealed_pages;
      spans::start_unselected();
      return;
    }
    const bool masks = geometry_.block_tokens < shape_.page_size;
    spans::start(*request, batch.size(), masks, 0);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t spans_read = std::max<std::int64_t>(request->budget[b], 0) / (masks ? geometry_.block_tokens : shape_.page_size);
      read_pages[b] = static_cast<std::int32_t>(std::min<std::int64_t>(spans_read, batch[b].sealed_pages));
      spans::add(b, batch[b].sealed_pages * geometry_.blocks_per_page, *request, read_pages[b]);
    }
  }

 private:
  kvmosaic::detail::engine_shape shape_;
  kvmosaic::detail::bounds_geometry geometry_;
  device_buffer bounds_;  ///< [max_pages][num_kv_heads][blocks][summary rows]
};

}  // namespace kvmosaic::cuda
