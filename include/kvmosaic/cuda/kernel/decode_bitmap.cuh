// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Decode split kernels for `format::bitmap_tiles` pages: MUSTAFAR's load-as-compressed,
/// compute-as-dense pipeline (appendix C). The compressed K and V pages of a split travel to the
/// SM as they are stored; a CTA expands each 64-token segment into a dense tile in shared memory
/// (`bitmap_segment_expand`) and runs the dense attention collective on it. No decompressed copy
/// is ever written to global memory. The dense tail goes through the same collective. The
/// partial states merge with the dense path's `merge_splits_kernel`.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/collective/bitmap_expand.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// Shared memory of the sm_90 bitmap kernel besides its compressed stages, for any head_dim.
constexpr int bitmap_decode_fixed_bytes(int head_dim) {
  return (128 + 2 * 8 * (head_dim * 2 + 16) + 1023) / 1024 * 1024 + 2 * 64 * head_dim * 2 + 1024;
}

/// Dynamic shared memory of the sm_90 bitmap kernel: barriers, the query tiles, one dense tile
/// pair (K and V, 64 tokens, swizzled), then `stages` compressed page pairs. Small on purpose:
/// expanding tiles waits on shared memory, and several CTAs per SM hide that (four at head_dim 128).
template <int HeadDim>
struct bitmap_decode_layout {
  static constexpr int segment_tokens = 64;
  static constexpr int max_stages = 4;
  static constexpr int barrier_offset = 0;
  static constexpr int query_offset = 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int dense_offset = (query_offset + query_bytes + 1023) / 1024 * 1024;
  static constexpr int tile_bytes = segment_tokens * HeadDim * 2;  ///< one dense K (or V) tile
  static constexpr int dense_bytes = 2 * tile_bytes;
  static constexpr int compressed_offset = dense_offset + dense_bytes;
  /// Total bytes for `stages` compressed stages of `stage_bytes` (a K page plus a V page).
  static constexpr int bytes(int stage_bytes, int stages) { return compressed_offset + stages * stage_bytes + 1024; }
  static_assert(compressed_offset + 1024 == bitmap_decode_fixed_bytes(HeadDim), "one formula for the fixed part");
};

/// The sm_90 bitmap_tiles split kernel. Thread 0 streams the split's compressed K and V pages into
/// `p.stages` shared-memory slots with bulk copies (one per page and cache, completing on an
/// mbarrier). Per 64-token segment, all 128 threads expand the compressed tiles into the dense
/// tile pair (`bitmap_segment_expand::expand`, 128-byte swizzled: row tiles gathered whole, K in
/// the paper's layout scattered into a zeroed tile), then each of the 4 warps runs q.k and p.v on
/// tensor cores over its 16 tokens (`warp_attend_mma`, as the dense TMA kernel) and, for a
/// scattered K tile, zeroes the 16 rows only it reads: two CTA barriers per segment. (Tried, with K
/// tiled along channels and scattered: each warp expanding only the 16 rows it folds, no CTA
/// barrier per segment, the last warp done with a slot refilling it: within 1% on H100,
/// 2026-11-24e; the
/// barriers are not what bounds it, the expansion's shared-memory work is.) `RowMasks`:
/// whether a token-granular selection's row masks are read (without, the code is what it was
/// before selections: run-time checks cost the scatter-based kernel 4-5% at batch 8).
/// Grid: (splits capacity, num_kv_heads).
template <class T, int HeadDim, int Group, bool RowMasks = false>
__global__ void __launch_bounds__(128) decode_partial_bitmap_kernel(const __grid_constant__ decode_params p) {
  constexpr int threads = 128, warps = 4;
  using layout = bitmap_decode_layout<HeadDim>;
  constexpr int segment = layout::segment_tokens;
  using expand = bitmap_segment_expand<HeadDim, segment, threads, swizzled_tile<segment>>;
  using attend = warp_attend_mma<T, HeadDim, Group, segment>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  static_assert(sizeof(temp_storage) <= layout::dense_bytes, "the reduction reuses the dense tiles");
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");
  extern __shared__ __align__(1024) std::byte bitmap_raw_shared[];
  std::byte* shared = reinterpret_cast<std::byte*>(
      (reinterpret_cast<std::uintptr_t>(bitmap_raw_shared) + 1023) & ~static_cast<std::uintptr_t>(1023));
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  std::byte* k_tile = shared + layout::dense_offset;
  std::byte* v_tile = k_tile + layout::tile_bytes;
  std::byte* compressed = shared + layout::compressed_offset;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const detail_decode::split_pages range =
      RowMasks ? detail_decode::pages_of_split(p, w, head) : detail_decode::split_pages{w.page_begin, w.page_end};
  const int num_pages = range.end - range.begin;
  const int stages = p.stages;
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int stage_bytes = k_bytes + v_bytes;
  const int tiles = p.page_size * HeadDim / 64;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  if (tid == 0)
    for (int b = 0; b < stages; ++b) detail::barrier_init(&full[b], 1);
  // Thread 0: the compressed K and V pages of split page i into slot i % stages (page ids are
  // read from the block table in global memory: one L2 hit per page, `stages` pages ahead).
  const auto issue = [&](int i) {
    const int slot = i % stages;
    const std::byte* page = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
    detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(stage_bytes));
    std::byte* destination = compressed + slot * stage_bytes;
    detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
    detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                static_cast<std::uint32_t>(v_bytes), &full[slot]);
  };
  __syncthreads();  // the barriers are initialized
  if (tid == 0)
    for (int i = 0; i < min(stages, num_pages); ++i) issue(i);
  if (p.k_along_tokens) expand::zero_tile(k_tile);  // scattered into; the row tiles are written whole
  attend::stage_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                        p.softmax_scale, query_tiles, threads);
  __syncthreads();

  const int warp = tid / 32;
  attend state;
  state.start();
  for (int i = 0; i < num_pages; ++i) {
    const int slot = i % stages;
    detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((i / stages) & 1));
    const shared_bitmap_page k_page(compressed + slot * stage_bytes, tiles);
    const shared_bitmap_page v_page(compressed + slot * stage_bytes + k_bytes, tiles);
    const std::uint32_t* rows_read = RowMasks ? detail_decode::page_rows_read(p, w.batch_index, head, range.begin + i) : nullptr;
    for (int first = 0; first < p.page_size; first += segment) {
      expand::expand(k_page, v_page, p.page_size, first, p.k_along_tokens != 0, k_tile, v_tile);
      __syncthreads();  // the tiles are complete (and, after a page's last segment, its slot is read)
      if (tid == 0 && first + segment == p.page_size && i + stages < num_pages) issue(i + stages);
      if constexpr (RowMasks) {
        const std::uint32_t warp_rows = detail_decode::sixteen_rows_read(rows_read, first + warp * 16);
        if (warp_rows != 0) state.fold(k_tile, v_tile, query_tiles, warp * 16, warp_rows);
      } else {
        state.fold(k_tile, v_tile, query_tiles, warp * 16, 0xffffu);
      }
      if (p.k_along_tokens) {  // the paper's K layout is scattered: clear what this warp read
        __syncwarp();          // every lane's ldmatrix reads of these rows are done first
        expand::zero_rows_of_warp(k_tile, warp * 16, 16);
      }
      __syncthreads();  // the tiles are read (and the scattered K tile zero again)
    }
  }
  if (w.with_tail) {
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes;
    const std::byte* k_rows = slot + head * p.tail_head_bytes;
    const std::byte* v_rows = slot + (p.num_kv_heads + head) * p.tail_head_bytes;
    const int rows = p.tail_rows[w.batch_index];
    for (int first = 0; first < rows; first += segment) {
      const int n = min(segment, rows - first);
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim * 2;
      expand::load_dense(k_rows + skip, v_rows + skip, n, k_tile, v_tile);  // every row written
      __syncthreads();
      // A warp whose rows all lie past the tail skips: p would be 0 for them anyway.
      const std::uint32_t rows = attend::rows_before(warp * 16, n);
      if (rows != 0) state.fold(k_tile, v_tile, query_tiles, warp * 16, rows);
      __syncthreads();
    }
  }
  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(k_tile));
}

/// Dynamic shared memory of the portable bitmap kernel: one dense K and V tile pair (plain rows)
/// of `segment_tokens`, which the CTA reduction reuses at the end.
template <int HeadDim, int Group, int Rows>
struct bitmap_portable_layout {
  static constexpr int segment_tokens = 64;
  static constexpr int tile_bytes = segment_tokens * HeadDim * 2;
  static constexpr int bytes = 2 * tile_bytes > static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>))
                                   ? 2 * tile_bytes
                                   : static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>));
};

/// The portable bitmap_tiles split kernel (sm_75+): per 64-token segment the CTA expands the
/// compressed tiles, read in place from global memory, into a row-major tile pair in shared memory
/// (`bitmap_segment_expand::expand`) and folds it with the dense SIMT collective. No copy pipeline: the reference path
/// for GPUs without bulk copies, not a tuned one.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_bitmap_portable_kernel(const decode_params p) {
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  using layout = bitmap_portable_layout<HeadDim, Group, collective::rows>;
  constexpr int segment = layout::segment_tokens;
  using expand = bitmap_segment_expand<HeadDim, segment, Threads, row_major_tile<HeadDim>>;
  constexpr int lanes_per_row = collective::lanes_per_row;
  extern __shared__ __align__(16) std::byte tile_shared[];
  std::byte* shared = tile_shared;
  std::byte* k_tile = shared;
  std::byte* v_tile = shared + layout::tile_bytes;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);
  const int tiles = p.page_size * HeadDim / 64;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  for (int i = range.begin; i < range.end; ++i) {
    const std::byte* slot = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    const global_bitmap_page k_page{slot + head * p.k_page_bytes, tiles};
    const global_bitmap_page v_page{slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes, tiles};
    for (int first = 0; first < p.page_size; first += segment) {
      if (p.k_along_tokens) expand::zero_tile(k_tile);  // scattered into; row tiles are written whole
      __syncthreads();
      expand::expand(k_page, v_page, p.page_size, first, p.k_along_tokens != 0, k_tile, v_tile);
      __syncthreads();
      collective::template fold<from_shared>(k_tile, v_tile, segment, s,
                                             rows_read == nullptr ? nullptr : rows_read + first / 32);
      __syncthreads();
    }
  }
  if (w.with_tail) {
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes;
    collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes,
                     p.tail_rows[w.batch_index], s);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(
      p, work_index, head, s, *reinterpret_cast<decode_temp_storage<Group, HeadDim, collective::rows>*>(shared));
}

}  // namespace kvmosaic::cuda::kernel
