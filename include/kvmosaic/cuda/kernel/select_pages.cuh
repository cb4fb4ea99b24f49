// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The page-selection kernels of a read-less step (`select::quest` with one block per page): they
/// run on the device between the step's metadata copy and the split kernel, with no host round
/// trip, so a selected step is captured in a CUDA graph like a dense one.
///   - `score_pages_kernel`: one warp per (sequence, page, KV head): Quest's bound of q . k from the
///     page's key bounds for each query head of the group, combined (select/span_score.hpp gives
///     the fp32 order, which the host backend follows to the bit).
///   - `select_pages_kernel`: one CTA per (sequence, KV head): the budget's top pages (higher
///     score first, ties to the earlier page) by a radix select on the scores' order-preserving
///     keys (4 passes of 8 bits, each a shared-memory histogram), then a block-scan compaction
///     that writes the chosen page ids in sequence order: the split kernel's per-head page table.

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvmosaic/core/dtype.hpp"

namespace kvmosaic::cuda::kernel {

/// What the selection kernels read and write. Tables and scores are rows of the step metadata.
struct select_params {
  const std::byte* bounds;            ///< [max_pages][num_kv_heads][lo row, hi row] in the storage dtype
  std::int64_t bounds_page_bytes;     ///< one page's bounds, every KV head
  const std::int32_t* step_header;    ///< [1] selected-table row stride, [2] its head stride, [3] block-table stride
  const std::int32_t* block_tables;   ///< [batch][header[3]] each sequence's page ids
  const std::int32_t* sealed_pages;   ///< [batch] pages each sequence has
  const std::int32_t* budget_pages;   ///< [batch] pages each KV head reads (at most sealed_pages)
  const float* q;                     ///< [batch][num_kv_heads * group_size][head_dim], unscaled
  int num_kv_heads;
  int group_size;
  int combine_sum;                    ///< 1: group_combine::sum, 0: group_combine::max
  float* scores;                      ///< [batch][num_kv_heads][header[3]]
  std::int32_t* selected;             ///< [batch][header[1]]: per KV head, header[2] apart, the chosen page ids
};

/// Warps per CTA of the scoring kernel, and pages per warp (their loads issued together).
inline constexpr int score_warps = 8;
inline constexpr int score_pages_per_warp = 4;

namespace detail_select {
/// `Count` consecutive 16-bit values as floats, with one vector load (Count = 2, 4 or 8).
template <class T, int Count>
__device__ __forceinline__ void load_floats(const T* source, float* out) {
  using vector = std::conditional_t<Count == 8, uint4, std::conditional_t<Count == 4, uint2, unsigned>>;
  const vector raw = *reinterpret_cast<const vector*>(source);
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Count; ++i) out[i] = to_float(values[i]);
}
}  // namespace detail_select

/// Quest scores of every sealed page. Each warp scores `score_pages_per_warp` pages: their page
/// ids, then all their bounds, are loaded before any arithmetic, so a warp keeps 4 x 512 bytes in
/// flight (head_dim 128); the group's queries are staged in shared memory once per CTA (every warp
/// of the CTA reads the same (sequence, KV head)). Grid: (num_kv_heads, ceil(pages / (score_warps
/// x score_pages_per_warp)), batch): the KV heads of the same pages side by side, so the CTAs in
/// flight read each page's bounds (every head's, contiguous) together (measured: no change from
/// heads outermost, 43 us at batch 8, 128K under Nsight Compute; kept as the natural order).
template <class T, int HeadDim>
__global__ void __launch_bounds__(score_warps * 32) score_pages_kernel(const select_params p) {
  constexpr int width = HeadDim / 32;  // contiguous channels per lane: the canonical order
  constexpr int per_warp = score_pages_per_warp;
  __shared__ float queries[8 * HeadDim];  // the group's queries (at most 8 heads)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.z);
  const int pages = p.sealed_pages[b];
  const int cta_first = static_cast<int>(blockIdx.y) * score_warps * per_warp;
  if (cta_first >= pages) return;  // the whole CTA: before the barrier below
  const float* q = p.q + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.group_size * HeadDim;
  for (int i = static_cast<int>(threadIdx.x); i < p.group_size * HeadDim; i += score_warps * 32) queries[i] = q[i];
  const int first = cta_first + warp * per_warp;
  const int stride = p.step_header[3];
  std::int32_t ids[per_warp];
#pragma unroll
  for (int k = 0; k < per_warp; ++k) ids[k] = p.block_tables[static_cast<std::size_t>(b) * stride + min(first + k, pages - 1)];
  float low[per_warp][width], high[per_warp][width];
#pragma unroll
  for (int k = 0; k < per_warp; ++k) {
    const T* lo = reinterpret_cast<const T*>(p.bounds + static_cast<std::size_t>(ids[k]) * p.bounds_page_bytes) +
                  static_cast<std::size_t>(head) * 2 * HeadDim + lane * width;
    detail_select::load_floats<T, width>(lo, low[k]);
    detail_select::load_floats<T, width>(lo + HeadDim, high[k]);
  }
  __syncthreads();  // the queries are staged
  if (first >= pages) return;
  float combined[per_warp] = {};
  for (int g = 0; g < p.group_size; ++g) {
    float qc[width];
#pragma unroll
    for (int j = 0; j < width; ++j) qc[j] = queries[g * HeadDim + lane * width + j];
#pragma unroll
    for (int k = 0; k < per_warp; ++k) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < width; ++j) {  // no fused multiply-add: the host's order, to the bit
        const float a = __fmul_rn(qc[j], low[k][j]), c = __fmul_rn(qc[j], high[k][j]);
        s = __fadd_rn(s, a > c ? a : c);
      }
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
      combined[k] = g == 0 ? s : p.combine_sum ? __fadd_rn(combined[k], s) : (s > combined[k] ? s : combined[k]);
    }
  }
  if (lane < per_warp && first + lane < pages) {
    float mine = combined[0];
#pragma unroll
    for (int k = 1; k < per_warp; ++k) mine = lane == k ? combined[k] : mine;
    p.scores[(static_cast<std::size_t>(b) * p.num_kv_heads + head) * stride + first + lane] = mine;
  }
}

namespace detail_select {
/// An unsigned key with the order of the scores: NaN as -infinity, -0 as +0 (equal scores tie).
__device__ __forceinline__ std::uint32_t order_key(float score) {
  std::uint32_t u = __float_as_uint(score);
  if (score != score) u = 0xff800000u;
  if (score == 0.0f) u = 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
}  // namespace detail_select

/// Threads per CTA of the selection kernel: one per radix bin.
inline constexpr int select_threads = 256;

/// Dynamic shared memory of the selection kernel for sequences of up to `max_pages` pages: their
/// keys, up to 48 KB (12288 pages: 786K tokens at pages of 64; every architecture allows it
/// without opting in). Longer sequences re-read their scores from L2 at each pass.
inline int select_shared_bytes(int max_pages) noexcept { return max_pages <= 12 * 1024 ? max_pages * 4 : 0; }

/// The top budget_pages[b] pages of each (sequence b, KV head), in sequence order.
/// Grid: (batch, num_kv_heads); dynamic shared memory: select_shared_bytes(header[3]) (0: keys
/// recomputed from the scores in global memory at each pass).
template <int Threads>
__global__ void __launch_bounds__(Threads) select_pages_kernel(const select_params p, int keys_in_shared) {
  static_assert(Threads == 256, "one thread per radix bin");
  using scan = cub::BlockScan<int, Threads>;
  __shared__ typename scan::TempStorage scan_storage;
  __shared__ int histogram[256];
  __shared__ std::uint32_t shared_digit;
  __shared__ int shared_remaining;
  extern __shared__ std::uint32_t shared_keys[];
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int n = p.sealed_pages[b];
  const int k = min(p.budget_pages[b], n);
  if (k <= 0) return;
  const int stride = p.step_header[3];
  const float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * stride;
  const std::int32_t* table = p.block_tables + static_cast<std::size_t>(b) * stride;
  std::int32_t* out = p.selected + static_cast<std::size_t>(b) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2];
  if (keys_in_shared) {
    for (int i = tid; i < n; i += Threads) shared_keys[i] = detail_select::order_key(scores[i]);
    __syncthreads();
  }
  const auto key_at = [&](int i) { return keys_in_shared ? shared_keys[i] : detail_select::order_key(scores[i]); };

  // The k-th largest key, 8 bits at a time from the top; then how many keys equal to it the
  // selection takes (the first ones in sequence order).
  std::uint32_t threshold = 0;
  int ties_to_take = 0;
  if (k < n) {
    std::uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
      histogram[tid] = 0;
      __syncthreads();
      for (int i = tid; i < n; i += Threads) {
        const std::uint32_t key = key_at(i);
        if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], 1);
      }
      __syncthreads();
      // Thread t holds bin 255 - t: an inclusive scan counts the keys at or above each bin.
      const int count = histogram[255 - tid];
      int at_or_above = 0;
      scan(scan_storage).InclusiveSum(count, at_or_above);
      if (at_or_above >= remaining && at_or_above - count < remaining) {
        shared_digit = static_cast<std::uint32_t>(255 - tid);
        shared_remaining = remaining - (at_or_above - count);
      }
      __syncthreads();
      prefix |= shared_digit << shift;
      remaining = shared_remaining;
      mask |= 255u << shift;
      __syncthreads();  // the histogram and shared_digit are rewritten by the next pass
    }
    threshold = prefix;
    ties_to_take = remaining;
  }
  // Compaction in sequence order.
  int ties_before = 0, written = 0;
  for (int base = 0; base < n; base += Threads) {
    const int i = base + tid;
    const std::uint32_t key = i < n ? key_at(i) : 0u;
    const int is_tie = i < n && k < n && key == threshold;
    int tie_rank = 0, ties = 0;
    scan(scan_storage).ExclusiveSum(is_tie, tie_rank, ties);
    __syncthreads();
    const int chosen = i < n && (k >= n || key > threshold || (is_tie && ties_before + tie_rank < ties_to_take));
    int position = 0, count = 0;
    scan(scan_storage).ExclusiveSum(chosen, position, count);
    if (chosen) out[written + position] = table[i];
    ties_before += ties;
    written += count;
    __syncthreads();
  }
}

}  // namespace kvmosaic::cuda::kernel

namespace kvmosaic::cuda::kernel {

/// Where the key bounds of newly sealed pages come from and go.
struct bounds_params {
  const std::byte* rows;              ///< dense rows of the new pages: their page slots, or scratch slots
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;       ///< K rows of KV head h start h * rows_head_bytes into a slot
  const std::int32_t* row_slots;      ///< [n] the slot of `rows` holding new page i
  const std::int32_t* new_pages;      ///< [n] page ids
  std::byte* bounds;                  ///< [max_pages][num_kv_heads][lo row, hi row]
  std::int64_t bounds_page_bytes;
  int page_size;
};

/// The channel-wise min and max of each new page's keys, per KV head (`select::quest` with one
/// block per page); the same values as the host's `store_key_bounds`. Grid: (n, num_kv_heads),
/// one thread per channel.
template <class T, int HeadDim>
__global__ void __launch_bounds__(HeadDim) page_bounds_kernel(const bounds_params p) {
  const int i = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  const T* rows = reinterpret_cast<const T*>(p.rows + static_cast<std::size_t>(p.row_slots[i]) * p.rows_slot_bytes +
                                             static_cast<std::size_t>(head) * p.rows_head_bytes);
  float lo = to_float(rows[c]), hi = lo;
  for (int t = 1; t < p.page_size; ++t) {
    const float x = to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  T* out = reinterpret_cast<T*>(p.bounds + static_cast<std::size_t>(p.new_pages[i]) * p.bounds_page_bytes) +
           static_cast<std::size_t>(head) * 2 * HeadDim;
  out[c] = T(lo);  // exact: lo and hi are stored values
  out[HeadDim + c] = T(hi);
}

}  // namespace kvmosaic::cuda::kernel
