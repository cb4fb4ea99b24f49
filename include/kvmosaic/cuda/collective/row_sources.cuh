// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Dense row sources of `warp_attend_mma::fold_chunks`: K or V rows that a lane reads one 16-byte
/// chunk (8 channels) at a time straight into its MMA fragments. A row source has
///   void pairs(int row, int chunk, uint4 (&x)[2])           channels 8 chunk .. 8 chunk + 15 of
///                                                           a row (chunk even), 16-bit pairs,
///                                                           lower channel in the low half
///   void values(int row, int chunk, std::uint32_t (&v)[8])  channels 8 chunk .. 8 chunk + 7,
///                                                           one value per register
/// and reads rows past its data as zeros. A source whose `pairs` costs about one `values` (one
/// locate for both chunks) says so with `static constexpr bool gathers_value_pairs = true`, and
/// `fold_chunks` then reads its V rows by `pairs` too.
///
/// A source may instead locate a row once for all the chunks a lane reads of it
/// (`locates_rows`):
///   Row  locate(int row)                                  the row, located for this lane
///   uint4 chunk(const Row&, int pair)                     K: the lane's chunk of k-step pair
///                                                         `pair` (fold chunk 8 (pair / 2) + 2 q
///                                                         + pair mod 2), 16-bit pairs
///   uint4 value_chunk(const Row&, int part)               V: the lane group's chunk `part`
///                                                         (fold chunk g head_dim / 64 + part),
///                                                         16-bit pairs
///   int  key_pairs()   (K)    k-step pairs [0, n) that may be nonzero: the others are skipped
///   int  value_tiles() (V)    output tiles [0, n) that may be nonzero: the others are skipped
/// A format adds its own sources next to its kernels (bitmap_tiles: `bitmap_page_rows`,
/// cuda/format/bitmap_tiles/expand.cuh; packed_bitmap: cuda/format/packed_bitmap/rows.cuh).

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvmosaic/cuda/detail/tile_layout.cuh"

namespace kvmosaic::cuda {

/// Whether row source `Rows` asks to be read two chunks at a time for V (`gathers_value_pairs`;
/// false where it does not say).
template <class Rows, class = void>
struct gathers_value_pairs : std::false_type {};
template <class Rows>
struct gathers_value_pairs<Rows, std::void_t<decltype(Rows::gathers_value_pairs)>>
    : std::integral_constant<bool, Rows::gathers_value_pairs> {};

/// Whether row source `Rows` locates a row once for its chunks (`locate`; the contract above).
template <class Rows, class = void>
struct locates_rows : std::false_type {};
template <class Rows>
struct locates_rows<Rows, std::void_t<decltype(std::declval<const Rows&>().locate(0))>> : std::true_type {};

/// Splits 4 registers of 16-bit pairs into 8 zero-extended values.
__device__ __forceinline__ void unpack_pairs(const uint4& x, std::uint32_t (&v)[8]) {
  const std::uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = words[i] & 0xffffu;
    v[2 * i + 1] = words[i] >> 16;
  }
}

/// The N dense values of a chunk (8) or run: v[j] = the next value at `cursor` where bit j of
/// `mask` is set, else 0 (16-bit values, zero-extended). Per value a predicated 16-bit load and
/// cursor step, whatever the sparsity: every lane runs the same instructions and the loads are
/// independent.
template <class Cursor, int N>
__device__ __forceinline__ void load_chunk_values(std::uint32_t mask, Cursor cursor, std::uint32_t (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = (mask >> j) & 1u ? cursor.next() : 0u;
}

/// 8 values (zero-extended 16-bit) as 4 registers of pairs, the lower channel in the low half.
__device__ __forceinline__ uint4 pack_pairs(const std::uint32_t (&v)[8]) {
  return make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410), __byte_perm(v[4], v[5], 0x5410),
                    __byte_perm(v[6], v[7], 0x5410));
}

/// `rows` dense rows of `HeadDim` 16-bit values at `base` in global memory (the dense tail):
/// one 16-byte load per chunk, zeros past the last row.
template <int HeadDim>
struct global_dense_rows {
  const std::byte* base;
  int rows;

  __device__ __forceinline__ uint4 chunk_at(int row, int chunk) const {
    return row < rows ? *reinterpret_cast<const uint4*>(base + (static_cast<std::size_t>(row) * HeadDim + chunk * 8) * 2)
                      : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void pairs(int row, int chunk, uint4 (&x)[2]) const {
    x[0] = chunk_at(row, chunk);
    x[1] = chunk_at(row, chunk + 1);
  }
  __device__ __forceinline__ void values(int row, int chunk, std::uint32_t (&v)[8]) const {
    unpack_pairs(chunk_at(row, chunk), v);
  }
};

/// A dense tile in shared memory in the 128-byte-swizzled layout `swizzled_tile<Tokens>` (K
/// scattered from the paper's layout): one conflict-free 16-byte shared load per chunk.
template <int Tokens>
struct swizzled_tile_rows {
  std::uint32_t base;  ///< shared address of the tile

  __device__ __forceinline__ uint4 chunk_at(int row, int chunk) const {
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(base + swizzled_tile<Tokens>::chunk(row, chunk)));
    return x;
  }
  __device__ __forceinline__ void pairs(int row, int chunk, uint4 (&x)[2]) const {
    x[0] = chunk_at(row, chunk);
    x[1] = chunk_at(row, chunk + 1);
  }
  __device__ __forceinline__ void values(int row, int chunk, std::uint32_t (&v)[8]) const {
    unpack_pairs(chunk_at(row, chunk), v);
  }
};

}  // namespace kvmosaic::cuda
