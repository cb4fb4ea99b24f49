// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device encode of `format::quant<Bits, ValueAxis>` pages (HACK sections 5.2-5.3): 2- or 4-bit
/// quantization of full pages of dense 16-bit rows, byte for byte what the host encoder writes
/// (tests compare the pages): the same `quant_extent`, `quant_range` (min and scale in the storage
/// dtype T, rounded outward; NaN for a partition with a non-finite value, whose codes are then 0)
/// and `quant_code`, so the same stochastic draws for the same seed. One CTA encodes one page of K
/// or of V of one KV head; K is partitioned along tokens per channel (the layout the CUDA decode
/// kernel reads), V as the format says.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/format/quant.hpp"

namespace kvmosaic::cuda::kernel {

/// Pages to encode: dense rows in `rows` (slot i = [K: heads][V: heads] x rows_head_bytes, the
/// first page_size rows 16-bit), written quantized to page `new_pages[i]` of the page arena.
struct quant_encode_params {
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;  ///< = the tail arena's (its first page_size rows used)
  std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* new_pages;
  int num_kv_heads;
  int page_size;
  int partition;
  bool stochastic;
  std::uint64_t seed;
  /// Sinks: page i with sink_slots[i] >= 0 is a sequence's first page. Its first sink_rows rows
  /// are quantized as copies of row sink_rows (the engine keeps them exact in the tail slot).
  int sink_rows;
  const std::int32_t* sink_slots;
};

constexpr int quant_encode_threads = 128;

/// Grid (pages, num_kv_heads, 2: K then V); dynamic shared memory page_size x HeadDim bytes (the
/// codes as a [token][channel] byte matrix, before they are packed into the operand tiles).
template <class T, int HeadDim, class Format>
__global__ void __launch_bounds__(quant_encode_threads) encode_quant_pages_kernel(const quant_encode_params e) {
  constexpr int bits = Format::bits, levels = Format::levels;
  constexpr bool v_per_token = Format::v_axis == format::value_axis::head_dim;
  extern __shared__ std::uint8_t quant_codes[];
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_key = blockIdx.z == 0;
  const int tid = static_cast<int>(threadIdx.x);
  const int pi = e.partition, page_size = e.page_size, per_channel = page_size / pi;
  const int partitions = page_size * HeadDim / pi;
  const int sum_bytes = kvmosaic::detail::quant_sum_bytes(bits, pi);
  const std::int64_t head_at = (static_cast<std::int64_t>(is_key ? 0 : e.num_kv_heads) + head) * e.rows_head_bytes;
  const auto* rows = reinterpret_cast<const T*>(e.rows + page_index * e.rows_slot_bytes + head_at);
  const int sinks = e.sink_slots != nullptr && e.sink_slots[page_index] >= 0 ? e.sink_rows : 0;
  // Row t as the encoder sees it: the sinks replaced by the first row after them.
  const auto row_of = [&](int t) { return rows + static_cast<std::size_t>(t < sinks ? sinks : t) * HeadDim; };
  std::byte* page = e.pages + static_cast<std::int64_t>(e.new_pages[page_index]) * e.page_slot_bytes +
                    (static_cast<std::int64_t>(is_key ? 0 : e.num_kv_heads) + head) * e.page_bytes;
  const int sums_at = partitions * 4, codes_at = partitions * (4 + sum_bytes);

  // Partition = (channel, token block) along tokens (K per channel, V per channel), or
  // (token, channel block) along head_dim (V per token).
  const bool along_tokens = is_key || !v_per_token;
  for (int part = tid; part < partitions; part += quant_encode_threads) {
    const int channel_groups = HeadDim / pi;
    const int first_token = along_tokens ? part % per_channel * pi : part / channel_groups;
    const int first_channel = along_tokens ? part / per_channel : part % channel_groups * pi;
    const int token_step = along_tokens ? 1 : 0, channel_step = along_tokens ? 0 : 1;
    const auto value = [&](int i) { return to_float(row_of(first_token + i * token_step)[first_channel + i * channel_step]); };
    // The extent in element order, as the host's: the same signed zero is kept.
    kvmosaic::detail::quant_extent extent(value(0));
    for (int i = 1; i < pi; ++i) extent.add(value(i));
    const kvmosaic::detail::quant_range_bits range = kvmosaic::detail::quant_range(extent, dtype_traits<T>::id, levels);
    unsigned sum = 0;
    for (int i = 0; i < pi; ++i) {
      const int code = extent.finite ? kvmosaic::detail::quant_code(levels, e.stochastic, e.seed,
                                                                    static_cast<std::uint64_t>(part) * pi + i, value(i),
                                                                    range.min, range.scale)
                                     : 0;
      sum += static_cast<unsigned>(code);
      quant_codes[(first_token + i * token_step) * HeadDim + first_channel + i * channel_step] = static_cast<std::uint8_t>(code);
    }
    reinterpret_cast<std::uint16_t*>(page)[part] = range.min_bits;
    reinterpret_cast<std::uint16_t*>(page + partitions * 2)[part] = range.scale_bits;
    if (!is_key && !v_per_token) {  // V per channel: the partition's code sum
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[part] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[part] = static_cast<std::uint16_t>(sum);
    }
  }
  __syncthreads();

  // V per token: per channel, the code sum of each block of Pi tokens (the token dimension's
  // Eq. 4 sums), indexed as V per channel's partitions.
  if (!is_key && v_per_token) {
    for (int index = tid; index < partitions; index += quant_encode_threads) {
      const int channel = index / per_channel, first_token = index % per_channel * pi;
      unsigned sum = 0;
      for (int i = 0; i < pi; ++i) sum += quant_codes[(first_token + i) * HeadDim + channel];
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[index] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[index] = static_cast<std::uint16_t>(sum);
    }
  }
  // K: per token, the code sum of each group of Pi channels (the channel dimension's Eq. 4 sums).
  if (is_key) {
    const int groups = HeadDim / pi;
    for (int index = tid; index < page_size * groups; index += quant_encode_threads) {
      const std::uint8_t* codes = quant_codes + (index / groups) * HeadDim + index % groups * pi;
      unsigned sum = 0;
      for (int i = 0; i < pi; ++i) sum += codes[i];
      if (sum_bytes == 1)
        reinterpret_cast<std::uint8_t*>(page + sums_at)[index] = static_cast<std::uint8_t>(sum);
      else
        reinterpret_cast<std::uint16_t*>(page + sums_at)[index] = static_cast<std::uint16_t>(sum);
    }
  }
  // Codes packed into the operand tiles (`quant_code_bit`): K as [tokens][channels], V as
  // [channels][tokens]; Bits / 2 32-bit words per (tile, lane), each packing 8 / Bits registers.
  constexpr int code_words = bits / 2, per_word = 8 / bits;
  const int columns = is_key ? HeadDim : page_size;
  const int words = page_size * HeadDim * bits / 32;
  for (int word_index = tid; word_index < words; word_index += quant_encode_threads) {
    const int tile = word_index / (32 * code_words), lane = word_index / code_words % 32, w = word_index % code_words;
    const int tile_row = tile / (columns / 32), tile_column = tile % (columns / 32);
    std::uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < per_word; ++i)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int s = w * per_word + i;
        const int row = tile_row * 16 + lane / 4 + 8 * (s % 2);
        const int column = tile_column * 32 + 16 * (s / 2) + 4 * (lane % 4) + b;
        const int token = is_key ? row : column, channel = is_key ? column : row;
        word |= static_cast<std::uint32_t>(quant_codes[token * HeadDim + channel]) << (b * 8 + i * bits);
      }
    reinterpret_cast<std::uint32_t*>(page + codes_at)[word_index] = word;
  }
  // Padding to the page's 16-byte size.
  for (int at = codes_at + words * 4 + tid; at < static_cast<int>(e.page_bytes); at += quant_encode_threads)
    page[at] = std::byte{0};
}

}  // namespace kvmosaic::cuda::kernel
