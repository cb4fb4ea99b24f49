// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device encode of `format::bitmap_tiles` pages (MUSTAFAR sections 2-3): per-token pruning and
/// compression of full pages of dense 16-bit rows, byte for byte what the host encoder writes
/// (tests compare the pages). One CTA encodes one page of K or of V of one KV head.
///
/// Pruning: a warp per token finds the `keep`-th largest score by a bitwise search over the
/// scores' bit patterns (non-negative floats order as their bits), keeps every score above it and
/// the lowest channels among those equal to it (the host's tie rule). Compression: each thread
/// builds the bitmaps of its run of tiles, a block scan turns their counts into tile offsets, and
/// the kept values are written in bit order; the run's padding is zeroed. (The scan is written
/// here rather than taken from CUB: CUB brings libcu++'s global `::cuda` namespace into every
/// user's translation unit, where it collides with `kvmosaic::cuda` under `using namespace`.)

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::kernel {

/// Pages to encode: dense rows in `rows` (slot i = [K: heads][V: heads] x rows_head_bytes, the
/// first page_size rows 16-bit), written compressed to page `new_pages[i]` of the page arena.
struct bitmap_encode_params {
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;  ///< = the tail arena's: page_size rows plus the exact rows
  std::byte* pages;
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  const std::int32_t* new_pages;
  int num_kv_heads;
  int page_size;
  int keep_k;  ///< values each K vector keeps
  int keep_v;  ///< values each V vector keeps
  int k_along_tokens;  ///< K tiles: 1 = one channel, 64 tokens (the paper's); 0 = as V
  /// Output-aware K scores (MUSTAFAR section 2.1): page i uses weights row weight_rows[i] of
  /// key_weights ([rows][head][head_dim]), the score of K element c being |k_c| * weight_c; a row
  /// of -1 (or null arrays) scores |k_c|.
  const float* key_weights;
  const std::int32_t* weight_rows;
};

constexpr int encode_threads = 128;

namespace detail_encode {
__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

/// Exclusive prefix sum of x over the CTA's `Threads` threads (`warp_totals`: Threads / 32 ints
/// of shared memory). Every thread calls it; it ends with a barrier.
template <int Threads>
__device__ __forceinline__ int block_exclusive_sum(int x, int* warp_totals) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int inclusive = x;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += y;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  __syncthreads();
  return before + inclusive - x;
}
}  // namespace detail_encode

/// Grid: (pages, num_kv_heads, 2: K then V); dynamic shared memory: page_size x head_dim / 8
/// bytes (the kept-element masks). T: the 16-bit storage type.
template <class T, int HeadDim>
__global__ void __launch_bounds__(encode_threads) encode_bitmap_pages_kernel(const bitmap_encode_params p) {
  static_assert(HeadDim % 64 == 0, "head_dim is whole 1x64 tiles");
  constexpr int per_lane = HeadDim / 32;  // lane l holds channels l + 32 e
  constexpr int words = HeadDim / 32;     // mask words per token
  __shared__ int warp_totals[encode_threads / 32];
  extern __shared__ std::uint32_t masks[];  // [page_size][words]

  const int ordinal = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const bool is_v = blockIdx.z == 1;
  const int page_size = p.page_size, keep = is_v ? p.keep_v : p.keep_k;
  const auto* rows = reinterpret_cast<const std::uint16_t*>(
      p.rows + ordinal * p.rows_slot_bytes + (static_cast<std::int64_t>(is_v) * p.num_kv_heads + head) * p.rows_head_bytes);
  const int weight_row = !is_v && p.weight_rows != nullptr ? p.weight_rows[ordinal] : -1;
  const float* weights =
      weight_row >= 0 ? p.key_weights + (static_cast<std::size_t>(weight_row) * p.num_kv_heads + head) * HeadDim : nullptr;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;

  // Pruning: the kept elements of each token, as bit masks.
  for (int t = warp; t < page_size; t += encode_threads / 32) {
    std::uint32_t score[per_lane];
#pragma unroll
    for (int e = 0; e < per_lane; ++e) {
      const int c = lane + 32 * e;
      const std::uint16_t bits = rows[t * HeadDim + c];
      const float magnitude = fabsf(to_float(T::from_bits(bits)));
      score[e] = __float_as_uint(weights != nullptr ? magnitude * weights[c] : magnitude);
    }
    std::uint32_t threshold = 0;  // the largest value with at least `keep` scores >= it
    for (int bit = 30; bit >= 0; --bit) {
      const std::uint32_t candidate = threshold | (1u << bit);
      int count = 0;
#pragma unroll
      for (int e = 0; e < per_lane; ++e) count += score[e] >= candidate;
      if (detail_encode::warp_sum(count) >= keep) threshold = candidate;
    }
    int above = 0;
#pragma unroll
    for (int e = 0; e < per_lane; ++e) above += score[e] > threshold;
    int ties_left = keep - detail_encode::warp_sum(above);  // equal scores kept, lowest channels first
#pragma unroll
    for (int e = 0; e < per_lane; ++e) {
      const std::uint32_t equal = __ballot_sync(0xffffffffu, score[e] == threshold);
      const int rank = __popc(equal & ((1u << lane) - 1));
      const bool kept = score[e] > threshold || (score[e] == threshold && rank < ties_left);
      ties_left -= __popc(equal);
      const std::uint32_t mask = __ballot_sync(0xffffffffu, kept);
      if (lane == 0) masks[t * words + e] = mask;
    }
  }
  __syncthreads();

  // Compression: thread j owns tiles [j * per_thread, (j + 1) * per_thread).
  const int tiles = page_size * HeadDim / 64, tiles_per_channel = page_size / 64;
  const int per_thread = (tiles + encode_threads - 1) / encode_threads;
  const int begin = min(tiles, static_cast<int>(threadIdx.x) * per_thread), end = min(tiles, begin + per_thread);
  const bool along_channels = is_v || p.k_along_tokens == 0;
  const auto tile_bitmap = [&](int tile) {
    std::uint64_t bits = 0;
    if (along_channels) {  // token t, channels 64 j ..: mask words 2 j and 2 j + 1
      const int t = tile / (HeadDim / 64), j = tile % (HeadDim / 64);
      bits = masks[t * words + 2 * j] | static_cast<std::uint64_t>(masks[t * words + 2 * j + 1]) << 32;
    } else {     // channel c, tokens 64 j ..
      const int c = tile / tiles_per_channel, j = tile % tiles_per_channel;
      for (int b = 0; b < 64; ++b)
        bits |= static_cast<std::uint64_t>((masks[(64 * j + b) * words + c / 32] >> (c % 32)) & 1u) << b;
    }
    return bits;
  };
  int count = 0;
  for (int tile = begin; tile < end; ++tile) count += __popcll(tile_bitmap(tile));
  int offset = detail_encode::block_exclusive_sum<encode_threads>(count, warp_totals);

  std::byte* page = p.pages + static_cast<std::int64_t>(p.new_pages[ordinal]) * p.page_slot_bytes +
                    (is_v ? p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes : head * p.k_page_bytes);
  auto* bitmaps = reinterpret_cast<std::uint64_t*>(page);
  auto* offsets = reinterpret_cast<std::uint32_t*>(page + tiles * 8);
  auto* values = reinterpret_cast<std::uint16_t*>(page + tiles * 12);
  for (int tile = begin; tile < end; ++tile) {
    const std::uint64_t bits = tile_bitmap(tile);
    bitmaps[tile] = bits;
    offsets[tile] = static_cast<std::uint32_t>(offset);
    for (int b = 0; b < 64; ++b) {
      if (!((bits >> b) & 1u)) continue;
      const int t = along_channels ? tile / (HeadDim / 64) : 64 * (tile % tiles_per_channel) + b;
      const int c = along_channels ? 64 * (tile % (HeadDim / 64)) + b : tile / tiles_per_channel;
      values[offset++] = rows[t * HeadDim + c];
    }
  }
  // The run of values ends padded to 16 bytes with zeros.
  const int total = page_size * keep;
  const int padded = (total * 2 + 15) / 16 * 16 / 2;
  for (int i = total + static_cast<int>(threadIdx.x); i < padded; i += encode_threads) values[i] = 0;
}

}  // namespace kvmosaic::cuda::kernel
