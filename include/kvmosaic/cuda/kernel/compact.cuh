// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The row copies of a compaction pass (`cuda::engine::move_slots`), for every format: dense 16-bit
/// rows gathered from source slots (a format's unpacked pages, or format::dense's pages as they
/// are) into destination slots, by a map staged with the pass. A pass gathers every page it
/// writes into scratch slots before anything is written back, so every source is read before any
/// destination changes (the order-preserving contract of `compact::repack`).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/detail/vector_io.cuh"

namespace kvmosaic::cuda::kernel {

/// Destination slot i, row r takes source row `sources_of[i * page_size + r]` (= source slot x
/// page_size + row; null: row r of source slot i). Slots on both sides are laid out [K heads]
/// [V heads] x head bytes, rows of head_dim 16-bit values; destination slot i is `slot_ids[i]`
/// of `rows` (null: i).
struct copy_rows_params {
  const std::byte* sources;
  std::int64_t source_slot_bytes;
  std::int64_t source_head_bytes;
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::int32_t* sources_of;
  const std::int32_t* slot_ids;
  std::int32_t n;
  int num_kv_heads;
  int head_dim;
  int page_size;
};

constexpr int copy_rows_threads = 256;

/// Grid-stride over destination slots x rows x (K, V) x heads x 16-byte vectors; one 16-byte load
/// and store each. Cost: the bytes of the destination slots, read once and written once. (A
/// template, so that every translation unit may define it.)
template <class Vector = uint4>
__global__ void __launch_bounds__(copy_rows_threads) copy_rows_kernel(const copy_rows_params p) {
  static_assert(sizeof(Vector) == detail::vector_elements * 2, "a vector of 16-bit values");
  const int vectors_per_row = p.head_dim / detail::vector_elements;
  const std::int64_t per_row = static_cast<std::int64_t>(2) * p.num_kv_heads * vectors_per_row;
  const std::int64_t total = static_cast<std::int64_t>(p.n) * p.page_size * per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int vector = static_cast<int>(i % vectors_per_row);
    const std::int64_t rest = i / vectors_per_row;
    const int head_index = static_cast<int>(rest % (2 * p.num_kv_heads));  // [K heads][V heads]
    const std::int64_t row = rest / (2 * p.num_kv_heads);                  // slot * page_size + r
    const std::int64_t source = p.sources_of != nullptr ? p.sources_of[row] : row;
    const std::int64_t slot = row / p.page_size, r = row % p.page_size;
    const std::int64_t destination_slot = p.slot_ids != nullptr ? p.slot_ids[slot] : slot;
    const std::int64_t row_bytes = static_cast<std::int64_t>(p.head_dim) * 2, vector_bytes = detail::vector_elements * 2;
    const auto* from = reinterpret_cast<const Vector*>(p.sources + source / p.page_size * p.source_slot_bytes +
                                                      head_index * p.source_head_bytes + source % p.page_size * row_bytes +
                                                      vector * vector_bytes);
    auto* to = reinterpret_cast<Vector*>(p.rows + destination_slot * p.rows_slot_bytes + head_index * p.rows_head_bytes +
                                        r * row_bytes + vector * vector_bytes);
    *to = *from;
  }
}

}  // namespace kvmosaic::cuda::kernel
