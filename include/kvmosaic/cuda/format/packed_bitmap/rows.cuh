// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap` records as a row source of `warp_attend_mma::fold_chunks`
/// (collective/row_sources.cuh): a lane gathers the 8 or 16 rotated channels its MMA fragment
/// holds straight from a token's record (its bitmap of one bit per group of g channels, then its
/// retained 16-bit values, packed in channel order), zeros where no bit is set. No dense tile is
/// written. Cost per chunk pair: the record's bitmap words before the chunk's (popcounts), the
/// group bits spread to one bit per channel, and 16 predicated 16-bit loads.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/collective/row_sources.cuh"

namespace kvmosaic::cuda {

namespace detail {

/// The low 16 / 2^shift group bits of `groups` spread to one bit per channel: bit i becomes bits
/// [i 2^shift, (i + 1) 2^shift) (shift 0, 1, 2: groups of 1, 2, 4 channels). Morton spreads.
__device__ __forceinline__ std::uint32_t spread_groups(std::uint32_t groups, int shift) {
  if (shift == 0) return groups & 0xffffu;
  if (shift == 1) {
    std::uint32_t x = groups & 0xffu;
    x = (x | (x << 4)) & 0x0f0fu;
    x = (x | (x << 2)) & 0x3333u;
    x = (x | (x << 1)) & 0x5555u;
    return x | (x << 1);
  }
  std::uint32_t x = groups & 0xfu;
  x = (x | (x << 6)) & 0x0303u;
  x = (x | (x << 3)) & 0x1111u;
  return x * 0xfu;
}

}  // namespace detail

/// One head's K or V records of a packed_bitmap page (`kvmosaic::detail::packed_geometry`: the
/// bitmaps [page_size][stride] words, then the values [page_size][retained]), from token `first`
/// on, in the rotated space of the segment the page was sealed in: channel c is kept where bit
/// c >> group_shift of the record is set, and its value is the record's value number
/// (set bits before c's group) << group_shift + c mod g. Channels past the segment's `words`
/// (its kept channels) read as zeros.
template <int HeadDim>
struct packed_page_rows {
  const std::uint32_t* bits;    ///< the page's bitmaps
  const std::uint16_t* page_values;  ///< the page's values
  int stride;                   ///< bitmap words per record of the slot
  int retained;                 ///< values per record of the slot
  int words;                    ///< bitmap words the segment's groups fill (kept / g, rounded up)
  int group_shift;              ///< log2 g
  int first;
  /// `pairs` locates its 16 channels once: `fold_chunks` reads V by it too.
  static constexpr bool gathers_value_pairs = true;

  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint32_t next() { return *value++; }
  };

  /// Channels [8 chunk, 8 chunk + 16) of `token`'s record: the per-channel mask (16 bits) and
  /// the cursor at the value of its first kept channel.
  __device__ __forceinline__ std::uint32_t locate(int token, int chunk, cursor& at) const {
    const int row = first + token;
    const std::uint32_t* record = bits + static_cast<std::size_t>(row) * stride;
    const int bit = (8 * chunk) >> group_shift, word = bit >> 5, shift = bit & 31;
    int before = 0;
#pragma unroll
    for (int w = 0; w < HeadDim / 32; ++w)
      if (w < word && w < words) before += __popc(record[w]);
    const std::uint32_t x = word < words ? record[word] : 0u;
    before += __popc(x & ((1u << shift) - 1u));
    at.value = page_values + static_cast<std::size_t>(row) * retained + (before << group_shift);
    return detail::spread_groups(x >> shift, group_shift);
  }
  __device__ __forceinline__ void pairs(int token, int chunk, uint4 (&x)[2]) const {
    cursor at;
    const std::uint32_t mask = locate(token, chunk, at);
    std::uint32_t v[8];
    load_chunk_values(mask & 0xffu, at, v);
    x[0] = pack_pairs(v);
    at.value += __popc(mask & 0xffu);
    load_chunk_values(mask >> 8, at, v);
    x[1] = pack_pairs(v);
  }
  __device__ __forceinline__ void values(int token, int chunk, std::uint32_t (&v)[8]) const {
    cursor at;
    const std::uint32_t mask = locate(token, chunk, at);
    load_chunk_values(mask & 0xffu, at, v);
  }
};

}  // namespace kvmosaic::cuda
