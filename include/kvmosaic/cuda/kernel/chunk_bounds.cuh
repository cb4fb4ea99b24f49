// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device side of `select::sentence_chunks`' chunks. The host cuts the token stream (Algorithm
/// 2 needs only the ids); the keys never leave the device. Per sequence the engine keeps the K rows
/// of its open chunk (at most L + Delta rows: a chunk is final once its window exists), so a chunk
/// that began in an earlier call, whose rows may since have been sealed into a compressed page,
/// still has its exact keys. A call's rows extend that stream:
///   - `chunk_bounds_kernel`: the channel-wise min and max key of each chunk the call finalized
///     (the same values as the host's), written to the chunk arena with the chunk's token range;
///   - `keep_open_rows_kernel`: the rows still open, to the sequence's other open-row buffer.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::kernel {

/// One call's chunk work for one sequence. The stream is the open rows then the call's rows:
/// row r is open row r for r < open_rows, else the call's row r - open_rows.
struct chunk_params {
  const std::byte* open;              ///< [open_rows][num_kv_heads][head_dim] storage dtype
  std::byte* next_open;               ///< stream row r >= copy_from goes to its row r - keep_from
  const void* rows;                   ///< the call's K rows, [new_rows][num_kv_heads][head_dim] (input type)
  int open_rows;
  int new_rows;
  int keep_from;                      ///< the first stream row still open after the call
  int copy_from;                      ///< keep_from, or open_rows when no chunk closed (next_open == open)
  const int4* chunks;                 ///< [finalized] {stream begin, stream end, arena slot, first token}
  std::byte* bounds;                  ///< arena: [block][num_kv_heads][chunks_per_block][lo row, hi row]
  int2* ranges;                       ///< arena: [slot] {first token, end token}
  int chunks_per_block;
  int num_kv_heads;
};

namespace detail_chunks {
/// Channel c of KV head h of stream row r, as the stored value.
template <class S, class In, int HeadDim>
__device__ __forceinline__ float stream_value(const chunk_params& p, int r, int head, int c) {
  if (r < p.open_rows)
    return to_float(reinterpret_cast<const S*>(p.open)[(static_cast<std::size_t>(r) * p.num_kv_heads + head) * HeadDim + c]);
  const In x = static_cast<const In*>(p.rows)[(static_cast<std::size_t>(r - p.open_rows) * p.num_kv_heads + head) * HeadDim + c];
  return to_float(S(to_float(x)));  // rounded to storage, as the row kernels store it
}
}  // namespace detail_chunks

/// The key bounds of each finalized chunk, per KV head. Grid: (finalized chunks, num_kv_heads),
/// one thread per channel.
template <class S, class In, int HeadDim>
__global__ void __launch_bounds__(HeadDim) chunk_bounds_kernel(const chunk_params p) {
  const int4 chunk = p.chunks[blockIdx.x];
  const int head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  float lo = detail_chunks::stream_value<S, In, HeadDim>(p, chunk.x, head, c), hi = lo;
  for (int r = chunk.x + 1; r < chunk.y; ++r) {
    const float x = detail_chunks::stream_value<S, In, HeadDim>(p, r, head, c);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  const int block = chunk.z / p.chunks_per_block, in_block = chunk.z % p.chunks_per_block;
  S* out = reinterpret_cast<S*>(p.bounds) +
           ((static_cast<std::size_t>(block) * p.num_kv_heads + head) * p.chunks_per_block + in_block) * 2 * HeadDim;
  out[c] = S(lo);  // exact: stored values
  out[HeadDim + c] = S(hi);
  if (head == 0 && c == 0) p.ranges[chunk.z] = make_int2(chunk.w, chunk.w + (chunk.y - chunk.x));
}

/// Stores the rows still open: stream rows [copy_from, open_rows + new_rows) to `next_open` (the
/// other buffer when chunks closed, else the call's rows after the open ones, in place).
/// Grid: (rows copied, num_kv_heads), one thread per channel.
template <class S, class In, int HeadDim>
__global__ void __launch_bounds__(HeadDim) keep_open_rows_kernel(const chunk_params p) {
  const int r = p.copy_from + static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  reinterpret_cast<S*>(p.next_open)[(static_cast<std::size_t>(r - p.keep_from) * p.num_kv_heads + head) * HeadDim + c] =
      S(detail_chunks::stream_value<S, In, HeadDim>(p, r, head, c));
}

}  // namespace kvmosaic::cuda::kernel
