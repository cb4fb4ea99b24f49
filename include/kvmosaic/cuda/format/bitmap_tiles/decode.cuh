// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Decode split kernels for `format::bitmap_tiles` pages: MUSTAFAR's load-as-compressed,
/// compute-as-dense pipeline (appendix C). The compressed K and V pages of a split travel to the
/// SM as they are stored. On sm_90 each warp gathers its tokens' rows from the compressed page
/// straight into tensor-core fragments (`bitmap_page_rows`, `warp_attend_mma::fold_chunks`); the
/// portable kernel expands each 64-token segment into a dense shared tile
/// (`bitmap_segment_expand`) for the SIMT collective. No decompressed copy is ever written to
/// global memory. The partial states merge with the dense path's `merge_splits_kernel`.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/format/bitmap_tiles/expand.cuh"
#include "kvmosaic/cuda/collective/row_sources.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// bitmap_tiles' fields of its split kernels' params.
struct bitmap_decode_params {
  int stages;          ///< sm_90 kernel: compressed page pairs in flight per CTA
  int k_along_tokens;  ///< K tiles are one channel x 64 tokens (1) or per token as V (0)
};

/// Dynamic shared memory of the sm_90 bitmap kernel: barriers, the query tiles, a dense K tile
/// (only with K in the paper's layout, which is scattered), then `stages` compressed page pairs,
/// which the CTA's final reduction reuses (the region is at least its size). One formula for the
/// kernel (`bitmap_decode_layout`) and for the host's choice of stages.
constexpr int bitmap_decode_shared_bytes(int head_dim, int group, int stage_bytes, int stages, bool k_along_tokens) {
  const int query_end = 128 + 2 * 8 * (head_dim * 2 + 16);
  const int k_tile = (query_end + 1023) / 1024 * 1024;
  const int compressed = k_tile + (k_along_tokens ? 64 * head_dim * 2 : 0);
  const int reduction = 4 * group * head_dim * 4 + 2 * 4 * group * 4;  // decode_temp_storage<group, head_dim, 4>
  return compressed + (stages * stage_bytes > reduction ? stages * stage_bytes : reduction) + 1024;
}

/// CTAs per SM the sm_90 bitmap kernel's registers are bounded for (`__launch_bounds__`).
constexpr int bitmap_decode_min_ctas(int head_dim, int group) {
  return head_dim == 128 && group <= 4 ? 5 : 0;
}

/// Where the sm_90 bitmap kernel's shared memory goes (`bitmap_decode_shared_bytes`).
template <int HeadDim, int Group>
struct bitmap_decode_layout {
  static constexpr int segment_tokens = 64;
  static constexpr int max_stages = 4;
  static constexpr int barrier_offset = 0;  ///< `max_stages` mbarriers: a slot's pages have landed
  static constexpr int empty_offset = 64;   ///< `max_stages` mbarriers: the 4 warps are done with a slot
  static constexpr int query_offset = 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int k_tile_offset = (query_offset + query_bytes + 1023) / 1024 * 1024;
  static constexpr int tile_bytes = segment_tokens * HeadDim * 2;  ///< the dense K tile
  __host__ __device__ static constexpr int compressed_offset(bool k_along_tokens) {
    return k_tile_offset + (k_along_tokens ? tile_bytes : 0);
  }
  static_assert(sizeof(decode_temp_storage<Group, HeadDim, 4>) ==
                    static_cast<std::size_t>(bitmap_decode_shared_bytes(HeadDim, Group, 0, 0, false) -
                                             compressed_offset(false) - 1024),
                "one formula for the reduction's storage");
};

/// The sm_90 bitmap_tiles split kernel. Thread 0 streams the split's compressed K and V pages into
/// `p.format.stages` shared-memory slots with bulk copies (one per page and cache, completing on an
/// mbarrier). Each of the 4 warps folds its 16 tokens of every 64-token segment straight from the
/// compressed slot: its lanes gather the 16-byte row chunks their MMA fragments hold
/// (`bitmap_page_rows`, `warp_attend_mma::fold_chunks`), so no dense tile is written or read and
/// no barrier separates the warps within a page; one CTA barrier per page frees its slot for the
/// page `stages` ahead. K in the paper's layout (columns) is first scattered by the CTA into a
/// zeroed dense K tile (two barriers per segment), which the warps read as rows. The dense tail is
/// read as rows from global memory. `RowMasks`: whether a token-granular selection's row masks are
/// read; `Logits`: whether a step with token scores writes each row's logits
/// (`decode_params::token_logits`; without, the kernel has no store). Grid: (splits capacity,
/// num_kv_heads).
/// Why no dense tile: gathering each segment into dense K and V tiles first costs 32 KB of shared
/// stores and loads per segment, and shared-memory bandwidth bounded that kernel
/// (benchmark/README.md, "Decisions the code cites").
template <class T, int HeadDim, int Group, bool RowMasks = false, bool Logits = false>
__global__ void __launch_bounds__(128, bitmap_decode_min_ctas(HeadDim, Group))
    decode_partial_bitmap_kernel(const __grid_constant__ split_params<bitmap_decode_params> p) {
  constexpr int threads = 128, warps = 4;
  using layout = bitmap_decode_layout<HeadDim, Group>;
  constexpr int segment = layout::segment_tokens;
  using expand = bitmap_segment_expand<HeadDim, segment, threads, swizzled_tile<segment>>;
  using attend = warp_attend_mma<T, HeadDim, Group, segment, operand_path::row_chunks>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  using page_rows = bitmap_page_rows<shared_bitmap_page, HeadDim>;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");
  extern __shared__ __align__(1024) std::byte bitmap_raw_shared[];
  std::byte* shared = reinterpret_cast<std::byte*>(
      (reinterpret_cast<std::uintptr_t>(bitmap_raw_shared) + 1023) & ~static_cast<std::uintptr_t>(1023));
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  auto* empty = reinterpret_cast<std::uint64_t*>(shared + layout::empty_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  std::byte* k_tile = shared + layout::k_tile_offset;  // only with p.format.k_along_tokens
  const bool k_along_tokens = p.format.k_along_tokens != 0;
  std::byte* compressed = shared + layout::compressed_offset(k_along_tokens);

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const detail_decode::split_pages range =
      RowMasks ? detail_decode::pages_of_split(p, w, head) : detail_decode::split_pages{w.page_begin, w.page_end};
  const int num_pages = range.end - range.begin;
  const int stages = p.format.stages;
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int stage_bytes = k_bytes + v_bytes;
  const int tiles = p.page_size * HeadDim / 64;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  if (tid == 0)
    for (int b = 0; b < stages; ++b) {
      detail::barrier_init(&full[b], 1);
      detail::barrier_init(&empty[b], warps);
    }
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
  if (k_along_tokens) expand::zero_tile(k_tile);  // scattered into
  attend::stage_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                        p.softmax_scale, query_tiles, threads);
  __syncthreads();

  const int warp = tid / 32, lane = tid % 32;
  const int rows_first = warp * 16;  // the warp's rows of every segment
  attend state;
  state.start();
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;
  // The warp's 16 rows of segment `first` of split page i: their logits, or -inf where it folds none.
  const auto fold_rows = [&](const auto& k_rows, const auto& v_rows, int i, int first, std::uint32_t rows) {
    float* const warp_logits =
        Logits && split_logits != nullptr
            ? split_logits + (static_cast<std::size_t>(i) * p.page_size + first + rows_first) * Group
            : nullptr;
    if (rows != 0)
      state.fold_chunks(k_rows, v_rows, query_tiles, rows_first, rows, warp_logits, 0xffffu);
    else if (warp_logits != nullptr)
      attend::write_masked_logits(warp_logits, 0xffffu);
  };
  for (int i = 0; i < num_pages; ++i) {
    const int slot = i % stages;
    detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((i / stages) & 1));
    const shared_bitmap_page k_page(compressed + slot * stage_bytes, tiles);
    const shared_bitmap_page v_page(compressed + slot * stage_bytes + k_bytes, tiles);
    const std::uint32_t* rows_read = RowMasks ? detail_decode::page_rows_read(p, w.batch_index, head, range.begin + i) : nullptr;
    if (!k_along_tokens) {
      for (int first = 0; first < p.page_size; first += segment) {
        const std::uint32_t rows =
            RowMasks ? detail_decode::sixteen_rows_read(rows_read, first + rows_first) : 0xffffu;
        fold_rows(page_rows{k_page, first}, page_rows{v_page, first}, i, first, rows);
      }
      // Each warp releases the slot; thread 0 refills it once all four have, while warps 1-3 go on.
      __syncwarp();
      if (lane == 0) detail::barrier_arrive(&empty[slot]);
      if (tid == 0 && i + stages < num_pages) {
        detail::barrier_wait(&empty[slot], static_cast<std::uint32_t>((i / stages) & 1));
        issue(i + stages);
      }
    } else {
      for (int first = 0; first < p.page_size; first += segment) {
        const std::uint32_t rows =
            RowMasks ? detail_decode::sixteen_rows_read(rows_read, first + rows_first) : 0xffffu;
        expand::scatter_columns(k_page, p.page_size, first, k_tile);
        __syncthreads();  // the K tile is complete
        fold_rows(swizzled_tile_rows<segment>{detail::shared_address(k_tile)}, page_rows{v_page, first}, i, first, rows);
        __syncwarp();  // every lane's reads of these rows are done
        expand::zero_rows_of_warp(k_tile, rows_first, 16);
        __syncthreads();  // the K tile is zero again (and, after the last segment, the slot is read)
      }
      if (tid == 0 && i + stages < num_pages) issue(i + stages);
    }
  }
  __syncthreads();  // every warp is done with the slots, which the reduction reuses
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    const std::byte* k_rows = slot + head * p.tail_head_bytes;
    const std::byte* v_rows = slot + (p.num_kv_heads + head) * p.tail_head_bytes;
    const int rows = run.rows;
    for (int first = 0; first < rows; first += segment) {
      // A warp whose rows all lie past the tail skips: p would be 0 for them anyway.
      const std::uint32_t warp_rows = attend::rows_before(first + rows_first, rows);
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim * 2;
      float* const warp_logits =
          Logits && split_logits != nullptr
              ? split_logits + (static_cast<std::size_t>(num_pages) * p.page_size + first + rows_first) * Group
              : nullptr;
      if (warp_rows != 0)
        state.fold_chunks(global_dense_rows<HeadDim>{k_rows + skip, rows - first},
                          global_dense_rows<HeadDim>{v_rows + skip, rows - first}, query_tiles, rows_first, warp_rows,
                          warp_logits, warp_rows);
    }
  }
  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(compressed));
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
__global__ void __launch_bounds__(Threads) decode_partial_bitmap_portable_kernel(const split_params<bitmap_decode_params> p) {
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
  float* const logits = detail_decode::split_logits(p, w, head, range, Group);  // a step with token scores
  for (int i = range.begin; i < range.end; ++i) {
    const std::byte* slot = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    const global_bitmap_page k_page{slot + head * p.k_page_bytes, tiles};
    const global_bitmap_page v_page{slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes, tiles};
    for (int first = 0; first < p.page_size; first += segment) {
      if (p.format.k_along_tokens) expand::zero_tile(k_tile);  // scattered into; row tiles are written whole
      __syncthreads();
      expand::expand(k_page, v_page, p.page_size, first, p.format.k_along_tokens != 0, k_tile, v_tile);
      __syncthreads();
      collective::template fold<from_shared>(
          k_tile, v_tile, segment, s, rows_read == nullptr ? nullptr : rows_read + first / 32,
          logits != nullptr ? logits + (static_cast<std::size_t>(i - range.begin) * p.page_size + first) * Group : nullptr);
      __syncthreads();
    }
  }
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s,
                     nullptr, logits != nullptr ? logits + static_cast<std::size_t>(range.end - range.begin) * p.page_size * Group : nullptr);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(
      p, work_index, head, s, *reinterpret_cast<decode_temp_storage<Group, HeadDim, collective::rows>*>(shared));
}

}  // namespace kvmosaic::cuda::kernel
