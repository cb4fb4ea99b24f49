// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The "extract" step of MUSTAFAR's load-as-compressed, compute-as-dense pipeline (appendix C):
/// a CTA expands one segment of tokens of a compressed `format::bitmap_tiles` page (K and V of one
/// head) into a dense tile pair in shared memory, which the dense attention collectives then
/// consume (tensor cores on sm_90, SIMT elsewhere). The compressed page may sit in shared memory
/// (staged by bulk copies) or in global memory (the portable kernel reads it in place).
///
/// Cost per segment: row tiles (a token's 64 channels of V, and of K when K is tiled along
/// channels) are gathered one 16-byte dense chunk per thread: per dense element a predicated
/// 16-bit load, whatever the sparsity, and one 16-byte store per 8 elements; the dense rows are
/// written whole. K in the paper's layout (a channel's tokens per tile) is scattered down columns:
/// per kept value a bit scan, a 16-bit load and a 16-bit store, into a K tile the kernels clear
/// between segments.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/collective/row_sources.cuh"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/tile_layout.cuh"

namespace kvmosaic::cuda {

namespace detail {
__device__ __forceinline__ void store_shared_u16(std::uint32_t address, std::uint16_t value) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(address), "h"(value) : "memory");
}
__device__ __forceinline__ std::uint16_t load_shared_u16(std::uint32_t address) {
  std::uint16_t value;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(value) : "r"(address));
  return value;
}
__device__ __forceinline__ void store_shared_v4(std::uint32_t address, uint4 value) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(value.x), "r"(value.y), "r"(value.z),
               "r"(value.w)
               : "memory");
}
__device__ __forceinline__ void store_shared_zero16(std::uint32_t address) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(address), "r"(0) : "memory");
}
}  // namespace detail

/// A compressed page ([bitmaps: tiles x u64][offsets: tiles x u32][values: u16]) in shared memory,
/// read through 32-bit shared addresses.
struct shared_bitmap_page {
  std::uint32_t base;
  int tiles;
  __device__ __forceinline__ shared_bitmap_page(const std::byte* page, int tile_count)
      : base(detail::shared_address(page)), tiles(tile_count) {}
  __device__ __forceinline__ std::uint64_t bitmap(int tile) const {
    std::uint64_t bits;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(bits) : "r"(base + tile * 8));
    return bits;
  }
  __device__ __forceinline__ std::uint32_t offset(int tile) const {
    std::uint32_t offset;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(offset) : "r"(base + tiles * 8 + tile * 4));
    return offset;
  }
  /// Cursor at value `index` of the run.
  struct cursor {
    std::uint32_t address;
    __device__ __forceinline__ std::uint16_t next() {
      const std::uint16_t value = detail::load_shared_u16(address);
      address += 2;
      return value;
    }
  };
  __device__ __forceinline__ cursor values_from(std::uint32_t index) const {
    return {base + static_cast<std::uint32_t>(tiles) * 12 + index * 2};
  }
};

/// A compressed page in global memory, read in place (the portable kernel).
struct global_bitmap_page {
  const std::byte* base;
  int tiles;
  __device__ __forceinline__ std::uint64_t bitmap(int tile) const {
    return reinterpret_cast<const std::uint64_t*>(base)[tile];
  }
  __device__ __forceinline__ std::uint32_t offset(int tile) const {
    return reinterpret_cast<const std::uint32_t*>(base + tiles * 8)[tile];
  }
  struct cursor {
    const std::uint16_t* value;
    __device__ __forceinline__ std::uint16_t next() { return *value++; }
  };
  __device__ __forceinline__ cursor values_from(std::uint32_t index) const {
    return {reinterpret_cast<const std::uint16_t*>(base + tiles * 12) + index};
  }
};

/// Calls f(bit) for each set bit of `bits`, lowest first (32-bit scans: cheaper than 64-bit ones).
template <class F>
__device__ __forceinline__ void for_each_set_bit(std::uint64_t bits, F&& f) {
  auto low = static_cast<std::uint32_t>(bits);
  auto high = static_cast<std::uint32_t>(bits >> 32);
  while (low != 0) {
    f(static_cast<std::uint32_t>(__ffs(static_cast<int>(low)) - 1));
    low &= low - 1;
  }
  while (high != 0) {
    f(static_cast<std::uint32_t>(__ffs(static_cast<int>(high)) + 31));
    high &= high - 1;
  }
}

/// Stores the values at `cursor` to tile_base + address.at(bit) for each set bit of `bits`, in
/// order. (The variants tried and their cost: benchmark/README.md, "Decisions the code cites".)
template <class Cursor, class Address>
__device__ __forceinline__ void scatter_set_bits(std::uint64_t bits, Cursor& cursor, const Address& address,
                                                 std::uint32_t tile_base) {
  for_each_set_bit(bits, [&](std::uint32_t bit) { detail::store_shared_u16(tile_base + address.at(bit), cursor.next()); });
}

/// Gathers the 8 dense values of channels [8 c, 8 c + 8) of a 1x64 row tile (one 16-byte chunk of
/// a dense row): value j is the tile's next kept value where bit 8 c + j of its bitmap is set, else
/// 0. A thread is bound to one chunk position c, so the masks of the bits before its chunk are
/// computed once. Cost per chunk: two broadcast loads (bitmap, offset), two popcounts and
/// `load_chunk_values`.
class row_chunk_gather {
 public:
  __device__ __forceinline__ explicit row_chunk_gather(int chunk)
      : below_low_(chunk >= 4 ? ~0u : (1u << (8 * chunk)) - 1u),
        below_high_(chunk >= 4 ? (1u << (8 * (chunk - 4))) - 1u : 0u),
        shift_(static_cast<std::uint32_t>(8 * (chunk % 4))),
        upper_(chunk >= 4) {}

  template <class Page>
  __device__ __forceinline__ uint4 operator()(const Page& page, int tile) const {
    const std::uint64_t bits = page.bitmap(tile);
    const auto low = static_cast<std::uint32_t>(bits), high = static_cast<std::uint32_t>(bits >> 32);
    const auto before = static_cast<std::uint32_t>(__popc(low & below_low_) + __popc(high & below_high_));
    const std::uint32_t mask = ((upper_ ? high : low) >> shift_) & 0xffu;
    std::uint32_t v[8];
    load_chunk_values(mask, page.values_from(page.offset(tile) + before), v);
    return pack_pairs(v);
  }

 private:
  std::uint32_t below_low_, below_high_, shift_;
  bool upper_;
};

/// One head's compressed rows (V, or K tiled along channels) of a page, from token `first` on, as
/// a row source of `warp_attend_mma::fold_chunks`: chunk c of row t is gathered from tile
/// (first + t) * D / 64 + c / 8. Cost per chunk: a bitmap and an offset load (per two chunks for
/// `pairs`), two popcounts and `load_chunk_values`.
template <class Page, int HeadDim>
struct bitmap_page_rows {
  Page page;
  int first;

  __device__ __forceinline__ void values(int token, int chunk, std::uint32_t (&v)[8]) const {
    const int tile = (first + token) * (HeadDim / 64) + chunk / 8;
    const std::uint64_t bits = page.bitmap(tile);
    const int shift = 8 * (chunk % 8);
    const auto before = static_cast<std::uint32_t>(__popcll(bits & ((std::uint64_t{1} << shift) - 1u)));
    const auto mask = static_cast<std::uint32_t>(bits >> shift) & 0xffu;
    load_chunk_values(mask, page.values_from(page.offset(tile) + before), v);
  }
  /// Chunks `chunk` and `chunk + 1` (chunk even) of a row: one bitmap and offset load for both.
  __device__ __forceinline__ void pairs(int token, int chunk, uint4 (&x)[2]) const {
    const int tile = (first + token) * (HeadDim / 64) + chunk / 8;
    const std::uint64_t bits = page.bitmap(tile);
    const int shift = 8 * (chunk % 8);
    const auto before = static_cast<std::uint32_t>(__popcll(bits & ((std::uint64_t{1} << shift) - 1u)));
    const auto mask = static_cast<std::uint32_t>(bits >> shift) & 0xffffu;
    const std::uint32_t start = page.offset(tile) + before;
    std::uint32_t v[8];
    load_chunk_values(mask & 0xffu, page.values_from(start), v);
    x[0] = pack_pairs(v);
    load_chunk_values(mask >> 8, page.values_from(start + static_cast<std::uint32_t>(__popc(mask & 0xffu))), v);
    x[1] = pack_pairs(v);
  }
};

/// Expands tokens [first, first + SegmentTokens) of one head's compressed K page and V page into
/// dense tiles (layout `Tile`, SegmentTokens rows). `first` is a multiple of SegmentTokens, which
/// is 64 or 32, so a segment never straddles a K tile.
template <int HeadDim, int SegmentTokens, int Threads, class Tile>
struct bitmap_segment_expand {
  static_assert(SegmentTokens == 64 || SegmentTokens == 32, "segments are whole or half 1x64 tiles");
  static_assert(Threads % 8 == 0, "a thread gathers the same 16-byte chunk position of every row tile");
  static constexpr int tile_bytes = SegmentTokens * HeadDim * 2;  ///< one dense tile (K or V)
  static constexpr int v_tiles_per_token = HeadDim / 64;

  /// Zeroes one dense tile. Every thread of the CTA calls it.
  __device__ __forceinline__ static void zero_tile(std::byte* tile) {
    const std::uint32_t base = detail::shared_address(tile);
    for (int i = static_cast<int>(threadIdx.x); i < tile_bytes / 16; i += Threads)
      detail::store_shared_zero16(base + i * 16);
  }

  /// Zeroes rows [first, first + rows) of a swizzled tile (whole 128-byte rows per 64-channel
  /// block). A warp calls it for the rows only it reads.
  __device__ __forceinline__ static void zero_rows_of_warp(std::byte* tile, int first, int rows) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    constexpr int blocks = HeadDim / 64;
    const int chunks = rows * 8;  // 16-byte chunks per block
    for (int i = lane; i < blocks * chunks; i += 32) {
      const int block = i / chunks, chunk = i % chunks;
      detail::store_shared_zero16(detail::shared_address(tile) + block * SegmentTokens * 128 + first * 128 + chunk * 16);
    }
  }

  /// Writes the segment's K and V into the tiles `k_tile`, `v_tile`. Row tiles (a token's 64
  /// channels: V always, K when tiled along channels, `k_along_tokens` false) are gathered chunk by
  /// chunk (`row_chunk_gather`): every element of their dense rows is written, zeros included, so
  /// they need no clearing. K in the paper's layout (`k_along_tokens`: tile c * tiles_per_channel +
  /// first / 64 holds channel c's tokens) is scattered down each channel's column, one work item
  /// per channel, into a K tile the caller keeps zero where nothing is kept. Every thread calls it.
  /// (The scatter variants the gather replaced: benchmark/README.md, "Decisions the code cites".)
  template <class Page>
  __device__ __forceinline__ static void expand(const Page& k_page, const Page& v_page, int page_size, int first,
                                                bool k_along_tokens, std::byte* k_tile, std::byte* v_tile) {
    const std::uint32_t k_base = detail::shared_address(k_tile), v_base = detail::shared_address(v_tile);
    if (k_along_tokens)
      scatter_columns(k_page, page_size, first, k_tile);
    else
      gather_rows(k_page, first, k_base);
    gather_rows(v_page, first, v_base);
  }

  /// K in the paper's layout (tile c * page_size / 64 + first / 64 holds channel c's tokens): the
  /// segment's kept values scattered down each channel's column of `k_tile`, one work item per
  /// channel; the caller keeps the tile zero where nothing is kept. Every thread calls it.
  template <class Page>
  __device__ __forceinline__ static void scatter_columns(const Page& k_page, int page_size, int first,
                                                         std::byte* k_tile) {
    const std::uint32_t k_base = detail::shared_address(k_tile);
    for (int channel = static_cast<int>(threadIdx.x); channel < HeadDim; channel += Threads) {
      const int k_part = first / 64, shift = first % 64;
      const int tile = channel * (page_size / 64) + k_part;
      const std::uint64_t all = k_page.bitmap(tile);
      std::uint64_t bits = all >> shift;
      if constexpr (SegmentTokens < 64) bits &= (std::uint64_t{1} << (SegmentTokens % 64)) - 1;
      // Values of the tile's tokens before the segment precede it in the run.
      const std::uint32_t skipped = shift == 0 ? 0u : __popcll(all & ((std::uint64_t{1} << shift) - 1));
      auto value = k_page.values_from(k_page.offset(tile) + skipped);
      scatter_set_bits(bits, value, Tile::column(channel), k_base);
    }
  }

 private:
  /// Row tiles of the segment into the dense tile at `tile_base`, one 16-byte chunk per thread
  /// per pass: thread x gathers chunk x mod 8 of row tile pass * (Threads / 8) + x / 8, so the 8
  /// lanes of a row tile share its bitmap and offset loads, a warp reads 4 consecutive value
  /// runs, and a thread's 64-channel block and swizzle key are the same in every pass.
  template <class Page>
  __device__ __forceinline__ static void gather_rows(const Page& page, int first, std::uint32_t tile_base) {
    constexpr int rows_per_pass = Threads / 8;
    constexpr int tokens_per_pass = rows_per_pass / v_tiles_per_token;
    static_assert(rows_per_pass % v_tiles_per_token == 0 && SegmentTokens % tokens_per_pass == 0,
                  "whole tokens per pass, whole passes per segment");
    const int thread = static_cast<int>(threadIdx.x);
    const int chunk = thread % 8, block = (thread / 8) % v_tiles_per_token;
    const int token_in_pass = (thread / 8) / v_tiles_per_token;
    const row_chunk_gather gather(chunk);
    const int first_tile = first * v_tiles_per_token + thread / 8;
#pragma unroll
    for (int pass = 0; pass < SegmentTokens / tokens_per_pass; ++pass) {
      const int token = pass * tokens_per_pass + token_in_pass;
      detail::store_shared_v4(tile_base + Tile::chunk(token, block * 8 + chunk),
                              gather(page, first_tile + pass * rows_per_pass));
    }
  }

 public:
  /// Copies rows [0, n) of dense K and V rows (global memory, head_dim 16-bit values each) into
  /// the tiles and zeroes rows [n, SegmentTokens): the dense tail's segments. Every thread calls it.
  __device__ __forceinline__ static void load_dense(const std::byte* k_rows, const std::byte* v_rows, int n,
                                                    std::byte* k_tile, std::byte* v_tile) {
    constexpr int chunks_per_row = HeadDim / 8;
    for (int i = static_cast<int>(threadIdx.x); i < 2 * SegmentTokens * chunks_per_row; i += Threads) {
      const int is_v = i / (SegmentTokens * chunks_per_row);
      const int rest = i % (SegmentTokens * chunks_per_row);
      const int token = rest / chunks_per_row, chunk = rest % chunks_per_row;
      const std::byte* source = (is_v ? v_rows : k_rows) + (static_cast<std::size_t>(token) * HeadDim + chunk * 8) * 2;
      const uint4 x = token < n ? *reinterpret_cast<const uint4*>(source) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>((is_v ? v_tile : k_tile) + Tile::chunk(token, chunk)) = x;
    }
  }
};

}  // namespace kvmosaic::cuda
