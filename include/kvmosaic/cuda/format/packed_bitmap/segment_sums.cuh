// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap`'s segment sums on the device: the sums a segment's plan is made of
/// (`detail::packed_segment_sums`: K's and V's covariances, K's per-channel squared norms and
/// intra-block deviations), in the host's order to the bit, so that the host only solves the
/// eigenproblems (MosaicKV computes the SVD rotation from the segment's covariance, section 5.4).
/// A segment's rows are cut into tiles of `detail::packed_sum_tile_rows`; one pass computes the
/// sums of a run of tiles into a scratch area, each from zero in token order, and a second adds
/// them, in tile order, to the running totals.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/format/packed_bitmap.hpp"

namespace kvmosaic::cuda::kernel {

/// Where the rows of a segment about to be planned are, for every KV head: segment row i < tail_rows
/// is row first_row + i of the sequence's tail page (`tail`: its K tail row 0 of head 0; head h's
/// K at h x tail_head_bytes, V at (num_kv_heads + h) x tail_head_bytes); a later row i is row
/// call_offset + i of the call's rows (`k`, `v`: [rows][num_kv_heads][head_dim], contiguous),
/// rounded to the storage dtype for i < page_rows (the rows of the page being sealed, which the
/// host plans from the tail as it will be stored).
struct packed_sum_rows {
  const std::byte* tail;
  std::int64_t tail_head_bytes;
  std::int64_t tail_row_bytes;
  dtype tail_type;             ///< the storage dtype
  const std::byte* k;
  const std::byte* v;
  dtype call_type;             ///< f32, f16 or bf16
  int first_row;
  int tail_rows;
  int page_rows;
  std::int64_t call_offset;
  std::int64_t n;              ///< the segment's rows
  int num_kv_heads;
};

/// A pass over tiles [first_tile, first_tile + gridDim.x) of a segment: `scratch` holds
/// [tile - first_tile][num_kv_heads][packed_sum_count] doubles.
struct packed_sum_params {
  packed_sum_rows rows;
  int first_tile;
  double* scratch;
  double* totals;              ///< [num_kv_heads][packed_sum_count]
  int tiles;                   ///< tiles in this pass (the add kernel)
  bool first_pass;             ///< the add kernel starts the totals from zero
};

namespace detail_packed {

__device__ __forceinline__ float load_as_float(const std::byte* base, std::int64_t index, dtype type) {
  switch (type) {
    case dtype::f32: return reinterpret_cast<const float*>(base)[index];
    case dtype::f16: return to_float(reinterpret_cast<const half*>(base)[index]);
    default: return to_float(reinterpret_cast<const bfloat16*>(base)[index]);
  }
}

/// Element c of segment row i of head `head`'s K (`which` 0) or V (1), as the host's fp32 row holds it.
__device__ __forceinline__ float segment_element(const packed_sum_rows& r, int head_dim, int which, int head, std::int64_t i, int c) {
  if (i < r.tail_rows) {
    const std::byte* row = r.tail + (static_cast<std::int64_t>(which) * r.num_kv_heads + head) * r.tail_head_bytes +
                           (r.first_row + i) * r.tail_row_bytes;
    return load_as_float(row, c, r.tail_type);
  }
  const std::int64_t at = ((r.call_offset + i) * r.num_kv_heads + head) * head_dim + c;
  const float x = load_as_float(which == 0 ? r.k : r.v, at, r.call_type);
  if (i >= r.page_rows) return x;
  return r.tail_type == dtype::f16 ? to_float(half(x)) : to_float(bfloat16(x));  // as the page's tail row stores it
}

}  // namespace detail_packed

inline constexpr int packed_covariance_threads = 256;
inline constexpr int packed_covariance_block = 64;   ///< a CTA's entries: a 64 x 64 block of the lower triangle
inline constexpr int packed_covariance_rows = 32;    ///< rows staged in shared memory at a time

/// One tile's covariance of one KV head's K or V (`detail::packed_tile_sums`, to the bit): a CTA
/// per (tile, head x 2 + which, 64 x 64 block at or below the diagonal), a thread per 4 x 4
/// entries, each a chain of fused multiply-adds from zero in token order (the products of fp32
/// values are exact in fp64). Entries above the diagonal are not written. Grid: (tiles of the
/// pass, 2 x num_kv_heads, blocks x (blocks + 1) / 2 for blocks = head_dim / 64). Cost: 16 fp64
/// multiply-adds a row and thread; 32 KB of static shared memory.
template <int HeadDim>
__global__ void __launch_bounds__(packed_covariance_threads) packed_tile_covariance_kernel(const packed_sum_params p) {
  static_assert(HeadDim % packed_covariance_block == 0, "head_dim is a multiple of 64");
  constexpr int width = packed_covariance_block, rows_at_once = packed_covariance_rows;
  __shared__ __align__(16) double xi[rows_at_once][width];
  __shared__ __align__(16) double xj[rows_at_once][width];
  const int tile = p.first_tile + static_cast<int>(blockIdx.x);
  const int head = static_cast<int>(blockIdx.y) / 2, which = static_cast<int>(blockIdx.y) % 2;
  int block_i = 0, block = static_cast<int>(blockIdx.z);  // the z-th block of the lower triangle, by rows
  while (block > block_i) block -= ++block_i;
  const int block_j = block;
  const int tid = static_cast<int>(threadIdx.x), ty = tid / 16, tx = tid % 16;
  const std::int64_t first = static_cast<std::int64_t>(tile) * ::kvmosaic::detail::packed_sum_tile_rows;
  const std::int64_t rows = min(static_cast<std::int64_t>(::kvmosaic::detail::packed_sum_tile_rows), p.rows.n - first);
  double acc[4][4] = {};
  for (std::int64_t r0 = 0; r0 < rows; r0 += rows_at_once) {
    const int count = static_cast<int>(min(static_cast<std::int64_t>(rows_at_once), rows - r0));
    __syncthreads();  // the previous rows are read
    for (int x = tid; x < rows_at_once * width; x += packed_covariance_threads) {
      const int t = x / width, c = x % width;
      double a = 0, b = 0;
      if (t < count) {
        a = detail_packed::segment_element(p.rows, HeadDim, which, head, first + r0 + t, block_i * width + c);
        b = detail_packed::segment_element(p.rows, HeadDim, which, head, first + r0 + t, block_j * width + c);
      }
      xi[t][c] = a;
      xj[t][c] = b;
    }
    __syncthreads();
    for (int t = 0; t < count; ++t) {
      const double2 a01 = *reinterpret_cast<const double2*>(&xi[t][4 * ty]);
      const double2 a23 = *reinterpret_cast<const double2*>(&xi[t][4 * ty + 2]);
      const double2 b01 = *reinterpret_cast<const double2*>(&xj[t][4 * tx]);
      const double2 b23 = *reinterpret_cast<const double2*>(&xj[t][4 * tx + 2]);
      const double a[4] = {a01.x, a01.y, a23.x, a23.y}, b[4] = {b01.x, b01.y, b23.x, b23.y};
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int w = 0; w < 4; ++w) acc[u][w] = __fma_rn(a[u], b[w], acc[u][w]);
    }
  }
  const std::size_t count = ::kvmosaic::detail::packed_sum_count(HeadDim);
  double* out = p.scratch + (static_cast<std::size_t>(blockIdx.x) * p.rows.num_kv_heads + head) * count +
                static_cast<std::size_t>(which) * HeadDim * HeadDim;
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int i = block_i * width + 4 * ty + u, j = block_j * width + 4 * tx + w;
      if (j <= i) out[static_cast<std::size_t>(i) * HeadDim + j] = acc[u][w];
    }
}

/// One tile's per-channel sums of one KV head's K (`detail::packed_tile_sums`, to the bit): the
/// CTA stages 32 rows at a time in shared memory (every row's loads in flight at once), and a
/// thread per channel runs its chains over them: the squared norms, then for blocks of 16, 8 and 4
/// rows each block's mean (an fp64 sum in token order over the count) and its squared deviations
/// by fused multiply-adds. Grid: (tiles of the pass, num_kv_heads); head_dim threads. Cost: one
/// read of the tile's K; 32 x head_dim x 4 bytes of static shared memory.
template <int HeadDim>
__global__ void __launch_bounds__(HeadDim) packed_tile_key_sums_kernel(const packed_sum_params p) {
  constexpr int rows_at_once = 32;  // a multiple of 16: no block straddles two stagings
  __shared__ float staged[rows_at_once][HeadDim];
  const int tile = p.first_tile + static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  const std::int64_t first = static_cast<std::int64_t>(tile) * ::kvmosaic::detail::packed_sum_tile_rows;
  const std::int64_t rows = min(static_cast<std::int64_t>(::kvmosaic::detail::packed_sum_tile_rows), p.rows.n - first);
  constexpr int sizes[3] = {16, 8, 4};
  double norm = 0, deviations[3] = {};
  for (std::int64_t r0 = 0; r0 < rows; r0 += rows_at_once) {
    const int count = static_cast<int>(min(static_cast<std::int64_t>(rows_at_once), rows - r0));
    __syncthreads();  // the previous rows are read
#pragma unroll 8
    for (int t = 0; t < rows_at_once; ++t)
      if (t < count) staged[t][c] = detail_packed::segment_element(p.rows, HeadDim, 0, head, first + r0 + t, c);
    __syncthreads();
    for (int t = 0; t < count; ++t) {
      const double x = staged[t][c];
      norm += x * x;
    }
#pragma unroll
    for (int s = 0; s < 3; ++s) {
      const int b = sizes[s];
      for (int block = 0; block + b <= count; block += b) {  // whole blocks of the tile (r0 is a multiple of 16)
        double mean = 0;
        for (int t = block; t < block + b; ++t) mean += staged[t][c];
        mean /= b;
        for (int t = block; t < block + b; ++t) {
          const double e = staged[t][c] - mean;
          deviations[s] = __fma_rn(e, e, deviations[s]);
        }
      }
    }
  }
  const std::size_t count = ::kvmosaic::detail::packed_sum_count(HeadDim);
  double* out = p.scratch + (static_cast<std::size_t>(blockIdx.x) * p.rows.num_kv_heads + head) * count +
                2 * static_cast<std::size_t>(HeadDim) * HeadDim;
  out[c] = norm;
#pragma unroll
  for (int s = 0; s < 3; ++s) out[static_cast<std::size_t>(1 + s) * HeadDim + c] = deviations[s];
}

/// totals += the pass's tiles' sums, in tile order (from zero on the first pass); the entries
/// above a covariance's diagonal are zero. A thread per (head, sum).
template <int HeadDim>
__global__ void packed_add_tile_sums_kernel(const packed_sum_params p) {
  const std::size_t count = ::kvmosaic::detail::packed_sum_count(HeadDim);
  const std::size_t index = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= count * p.rows.num_kv_heads) return;
  const std::size_t e = index % count;
  if (e < 2 * static_cast<std::size_t>(HeadDim) * HeadDim) {
    const std::size_t in_matrix = e % (static_cast<std::size_t>(HeadDim) * HeadDim);
    if (in_matrix % HeadDim > in_matrix / HeadDim) {  // above the diagonal
      p.totals[index] = 0.0;
      return;
    }
  }
  double total = p.first_pass ? 0.0 : p.totals[index];
  const std::size_t stride = count * p.rows.num_kv_heads;
  for (int tile = 0; tile < p.tiles; ++tile) total += p.scratch[tile * stride + index];
  p.totals[index] = total;
}

}  // namespace kvmosaic::cuda::kernel
