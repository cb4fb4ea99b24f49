// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device unpack of `format::bitmap_tiles` pages, the inverse of `encode_bitmap_pages_kernel`:
/// every kept value back at its (token, channel), zeros elsewhere, exactly the host's
/// `format_traits<bitmap_tiles>::decode_k/v`. A compaction unpacks the pages it touches, moves
/// rows and encodes the pages it writes again, which keeps the same values (a token keeps as many
/// values as it had, and the pruned zeros never outrank them).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/format/bitmap_tiles.hpp"

namespace kvmosaic::cuda::kernel {

/// Pages `page_ids[i]` of the page arena unpacked to dense rows in `rows` (slot i = [K: heads]
/// [V: heads] x rows_head_bytes, the first page_size rows 16-bit).
struct bitmap_unpack_params {
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  const std::int32_t* page_ids;
  int num_kv_heads;
  int page_size;
  int k_along_tokens;  ///< K tiled along tokens (a channel's 64 tokens per tile), not along channels
};

constexpr int bitmap_unpack_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V): the CTA clears its page's rows, then each thread
/// scatters the kept values of its tiles ([bitmaps: tiles x u64][offsets: tiles x u32][values]).
/// Cost per page: one read of the page, one write of its rows.
template <int HeadDim>
__global__ void __launch_bounds__(bitmap_unpack_threads) unpack_bitmap_pages_kernel(const bitmap_unpack_params u) {
  constexpr int tile = kvmosaic::detail::tile_length;
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const bool along_tokens = is_key && u.k_along_tokens != 0;
  const std::int64_t page_at = is_key ? head * u.k_page_bytes : u.num_kv_heads * u.k_page_bytes + head * u.v_page_bytes;
  const std::byte* page = u.pages + static_cast<std::int64_t>(u.page_ids[page_index]) * u.page_slot_bytes + page_at;
  auto* rows = reinterpret_cast<std::uint16_t*>(u.rows + page_index * u.rows_slot_bytes +
                                                ((is_key ? 0 : u.num_kv_heads) + head) * u.rows_head_bytes);
  const int elements = u.page_size * HeadDim, tiles = elements / tile;
  for (int i = static_cast<int>(threadIdx.x); i < elements; i += bitmap_unpack_threads) rows[i] = 0;
  __syncthreads();
  const auto* bitmaps = reinterpret_cast<const std::uint64_t*>(page);
  const auto* offsets = reinterpret_cast<const std::uint32_t*>(page + tiles * 8);
  const auto* values = reinterpret_cast<const std::uint16_t*>(page + tiles * 12);
  const int tiles_per_line = along_tokens ? u.page_size / tile : HeadDim / tile;
  for (int t = static_cast<int>(threadIdx.x); t < tiles; t += bitmap_unpack_threads) {
    std::uint64_t bits = bitmaps[t];
    std::uint32_t offset = offsets[t];
    const int line = t / tiles_per_line, part = t % tiles_per_line;
    while (bits != 0) {
      const int b = __ffsll(static_cast<long long>(bits)) - 1;
      bits &= bits - 1;
      const int token = along_tokens ? part * tile + b : line, channel = along_tokens ? line : part * tile + b;
      rows[token * HeadDim + channel] = values[offset++];
    }
  }
}

}  // namespace kvmosaic::cuda::kernel
