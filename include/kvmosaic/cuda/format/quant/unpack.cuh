// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device unpack of `format::quant<Bits, ValueAxis>` pages, the inverse of
/// `encode_quant_pages_kernel`: every element x = min + scale * code of its partition, rounded to
/// the storage dtype, exactly what the host's `format_traits<quant<...>>::decode_k/v` give rounded
/// the same way (the product of a code of at most 4 bits and a 16-bit scale is exact in fp32, so a
/// fused multiply-add rounds as the host's two operations do). A compaction unpacks the pages it touches, moves rows and encodes the pages it writes.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/format/quant.hpp"

namespace kvmosaic::cuda::kernel {

/// Pages `page_ids[i]` of the page arena unpacked to dense rows in `rows` (slot i = [K: heads]
/// [V: heads] x rows_head_bytes, the first page_size rows 16-bit).
struct quant_unpack_params {
  std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* page_ids;
  int num_kv_heads;
  int page_size;
  int partition;
  dtype storage;
};

constexpr int quant_unpack_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V). Partition = (channel, token block of Pi) for K and V
/// per channel, (token, channel block) for V per token, as the encoder writes them. Cost per page:
/// one read of the page, one write of its rows.
template <int HeadDim, class Format>
__global__ void __launch_bounds__(quant_unpack_threads) unpack_quant_pages_kernel(const quant_unpack_params u) {
  constexpr int bits = Format::bits;
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const bool along_tokens = is_key || Format::v_axis == format::value_axis::tokens;
  const int pi = u.partition, page_size = u.page_size, per_channel = page_size / pi;
  const int partitions = page_size * HeadDim / pi;
  const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, pi);
  const int head_index = (is_key ? 0 : u.num_kv_heads) + head;
  const std::byte* page = u.pages + static_cast<std::int64_t>(u.page_ids[page_index]) * u.page_slot_bytes + head_index * u.page_bytes;
  auto* rows = reinterpret_cast<std::uint16_t*>(u.rows + page_index * u.rows_slot_bytes + head_index * u.rows_head_bytes);
  const auto* mins = reinterpret_cast<const std::uint16_t*>(page);
  const auto* scales = reinterpret_cast<const std::uint16_t*>(page + partitions * 2);
  const std::byte* codes = page + partitions * (4 + sum_bytes);
  for (int index = static_cast<int>(threadIdx.x); index < page_size * HeadDim; index += quant_unpack_threads) {
    const int token = index / HeadDim, channel = index % HeadDim;
    const int part = along_tokens ? channel * per_channel + token / pi : token * (HeadDim / pi) + channel / pi;
    const std::size_t bit = is_key ? kvmosaic::detail::quant_code_bit(bits, HeadDim, token, channel)
                                   : kvmosaic::detail::quant_code_bit(bits, page_size, channel, token);
    const int code = (static_cast<int>(codes[bit / 8]) >> (bit % 8)) & Format::levels;
    const float x = kvmosaic::detail::storage_value(mins[part], u.storage) +
                    kvmosaic::detail::storage_value(scales[part], u.storage) * static_cast<float>(code);
    rows[index] = kvmosaic::detail::storage_bits(x, u.storage);
  }
}

}  // namespace kvmosaic::cuda::kernel
