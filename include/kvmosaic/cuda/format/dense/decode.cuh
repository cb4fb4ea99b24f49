// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// format::dense's split kernels: the portable SIMT kernel (`decode_partial_kernel`, sm_75+,
/// generic over a format's `page_attend` collective), the sm_90 bulk-copy pipeline
/// (`decode_partial_bulk_kernel`, page sizes that neither divide nor are multiples of 64) and the
/// sm_90 TMA + tensor-core kernel (`decode_partial_tma_kernel`). The dense tail always goes
/// through the dense collective.

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvmosaic/cuda/collective/page_attend.cuh"
#include "kvmosaic/cuda/collective/score_mma.cuh"
#include "kvmosaic/cuda/collective/warp_attend_mma.cuh"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/tma.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// format::dense's fields of its split kernels' params: the page and tail arenas as 2D tensors
/// of rows (head_dim wide) for the sm_90 TMA kernel, row ((slot * 2 + is_v) * num_kv_heads +
/// head) * rows per head + row (page_size rows per page head; a tail head's rows: the exact rows,
/// then page_size tail rows), 128-byte swizzled boxes (unused by the other kernels).
struct dense_decode_params {
  CUtensorMap page_rows;
  CUtensorMap tail_rows;
};

/// The portable split kernel (any architecture): each thread streams its K/V slices from global
/// memory into registers, `Unroll` tokens in flight. Grid: (splits capacity, num_kv_heads).
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_kernel(const split_params<dense_decode_params> p) {
  using collective = page_attend<Format, T, HeadDim, Group, Threads, Unroll>;
  using tail_collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  static_assert(collective::rows == tail_collective::rows && collective::lanes_per_row == tail_collective::lanes_per_row,
                "a format's collective must use the shared thread mapping");
  constexpr int lanes_per_row = collective::lanes_per_row;
  __shared__ decode_temp_storage<Group, HeadDim, collective::rows> temp;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);

  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  // A step with token scores: format::dense's collective writes each row's logits (others: none
  // yet; the engine refuses scores for them).
  constexpr bool writes_logits = std::is_same<Format, format::dense>::value;
  float* const logits = writes_logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;
  std::int32_t next_page = range.begin < range.end ? table[range.begin] : 0;
  for (int i = range.begin; i < range.end; ++i) {
    const std::int32_t page = next_page;
    if (i + 1 < range.end) next_page = table[i + 1];  // in flight while this page is read
    const std::byte* slot = p.pages + static_cast<std::size_t>(page) * p.page_slot_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    if constexpr (writes_logits)
      collective::fold(slot + head * p.k_page_bytes, slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                       p.page_size, s, rows_read,
                       logits != nullptr ? logits + static_cast<std::size_t>(i - range.begin) * p.page_size * Group : nullptr);
    else
      collective::fold(slot + head * p.k_page_bytes, slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                       p.page_size, s, rows_read);
  }
  if (w.with_tail) {  // the exact rows and the tail rows
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * sizeof(T);
    tail_collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s,
                          nullptr,
                          logits != nullptr ? logits + static_cast<std::size_t>(range.end - range.begin) * p.page_size * Group
                                            : nullptr);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(p, work_index, head, s, temp);
}

/// Dynamic shared memory of the bulk-copy split kernel: the split's page ids, one barrier per
/// stage, one stage of logits, and `Stages` buffers of `StageTokens` K rows and V rows. The
/// reduction at the end reuses the stage buffers.
template <class T, int HeadDim, int Group, int StageTokens, int Stages, int MaxPagesPerSplit>
struct bulk_decode_layout {
  static constexpr int row_bytes = HeadDim * static_cast<int>(sizeof(T));
  static constexpr int ids_bytes = (MaxPagesPerSplit * 4 + 127) / 128 * 128;
  static constexpr int barrier_offset = ids_bytes;
  static constexpr int logits_offset = ids_bytes + 128;
  static constexpr int logits_bytes = (Group * StageTokens * 4 + 127) / 128 * 128;
  static constexpr int stage_offset = logits_offset + logits_bytes;
  static constexpr int stage_bytes = StageTokens * row_bytes;  ///< one stage of K (or of V)
  static constexpr int bytes = stage_offset + 2 * Stages * stage_bytes;
};

/// The sm_90 split kernel: thread 0 streams the split's K and V rows (pages, then the tail) into
/// `Stages` shared-memory buffers with bulk copies completing on mbarriers, `Stages` stages ahead
/// of the CTA. Per stage, each warp scores its share of the tokens on tensor cores
/// (`mma_scorer`), then the CTA folds the logits and V rows into its online-softmax state.
/// Dense rows only (the stages are token-granular).
/// Grid: (splits capacity, num_kv_heads); dynamic shared memory: bulk_decode_layout::bytes.
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll, int StageTokens, int Stages,
          int MaxPagesPerSplit>
__global__ void __launch_bounds__(Threads) decode_partial_bulk_kernel(const split_params<dense_decode_params> p) {
  static_assert(std::is_same<Format, format::dense>::value, "the bulk-copy pipeline stages dense rows");
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  using layout = bulk_decode_layout<T, HeadDim, Group, StageTokens, Stages, MaxPagesPerSplit>;
  constexpr int warps = Threads / 32;
  using scorer_type = mma_scorer<T, HeadDim, Group, StageTokens / warps>;
  using temp_storage = decode_temp_storage<Group, HeadDim, collective::rows>;
  static_assert(sizeof(temp_storage) <= 2 * Stages * layout::stage_bytes, "the reduction reuses the stage buffers");
  constexpr int lanes_per_row = collective::lanes_per_row;
  extern __shared__ __align__(128) std::byte shared[];
  auto* ids = reinterpret_cast<std::int32_t*>(shared);
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  auto* logits = reinterpret_cast<float*>(shared + layout::logits_offset);
  std::byte* k_stages = shared + layout::stage_offset;
  std::byte* v_stages = k_stages + Stages * layout::stage_bytes;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  detail_decode::stage_split_pages(p, w, range, head, Threads, Stages, ids, full);
  __syncthreads();

  const int page_tokens = num_pages * p.page_size;
  const detail_decode::dense_run run = w.with_tail ? detail_decode::dense_rows_of(p, w.batch_index) : detail_decode::dense_run{0, 0};
  const int tokens = page_tokens + run.rows;
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  float* const split_logits = detail_decode::split_logits(p, w, head, range, Group);
  const std::byte* tail_slot =
      w.with_tail ? p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                        static_cast<std::size_t>(run.first) * layout::row_bytes
                  : nullptr;
  // Thread 0: announce and issue the copies of one stage, one per contiguous run of rows.
  const auto issue = [&](int stage) {
    const int buffer = stage % Stages;
    const int first = stage * StageTokens;
    const int n = min(StageTokens, tokens - first);
    detail::barrier_arrive_expect(&full[buffer], static_cast<std::uint32_t>(2 * n * layout::row_bytes));
    for (int t = first; t < first + n;) {
      const std::byte *k, *v;
      int run;
      if (t < page_tokens) {
        const int row = t % p.page_size;
        run = min(p.page_size - row, first + n - t);
        const std::byte* slot = p.pages + static_cast<std::size_t>(ids[t / p.page_size]) * p.page_slot_bytes;
        k = slot + head * p.k_page_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
        v = slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
      } else {
        const int row = t - page_tokens;
        run = first + n - t;
        k = tail_slot + head * p.tail_head_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
        v = tail_slot + (p.num_kv_heads + head) * p.tail_head_bytes + static_cast<std::size_t>(row) * layout::row_bytes;
      }
      const int offset = (buffer * StageTokens + (t - first)) * layout::row_bytes;
      detail::bulk_copy_to_shared(k_stages + offset, k, static_cast<std::uint32_t>(run * layout::row_bytes), &full[buffer]);
      detail::bulk_copy_to_shared(v_stages + offset, v, static_cast<std::uint32_t>(run * layout::row_bytes), &full[buffer]);
      t += run;
    }
  };
  if (tid == 0)
    for (int stage = 0; stage < min(Stages, num_stages); ++stage) issue(stage);

  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, lanes_per_row>(p, w, head, s);
  scorer_type scorer;
  scorer.load_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                      p.softmax_scale);
  const int warp = tid / 32;
  for (int stage = 0; stage < num_stages; ++stage) {
    const int buffer = stage % Stages;
    const int n = min(StageTokens, tokens - stage * StageTokens);
    detail::barrier_wait(&full[buffer], static_cast<std::uint32_t>((stage / Stages) & 1));
    scorer.score(k_stages + buffer * layout::stage_bytes, warp * (StageTokens / warps), logits, StageTokens);
    __syncthreads();  // the stage's logits are complete
    if (p.token_masks != nullptr) {  // a token-granular selection: rows it did not pick get -inf
      const int first = stage * StageTokens;
      for (int index = tid; index < Group * n; index += Threads) {
        const int t = first + index % n;
        if (t >= page_tokens) continue;
        const std::uint32_t* rows_read =
            detail_decode::page_rows_read(p, w.batch_index, head, range.begin + t / p.page_size);
        const int row = t % p.page_size;
        if (((rows_read[row >> 5] >> (row & 31)) & 1u) == 0) logits[(index / n) * StageTokens + index % n] = -HUGE_VALF;
      }
      __syncthreads();
    }
    if (split_logits != nullptr) {  // a step with token scores: the stage's logits, [token][head]
      const int first = stage * StageTokens;
      for (int index = tid; index < Group * n; index += Threads)
        split_logits[static_cast<std::size_t>(first + index / Group) * Group + index % Group] =
            logits[(index % Group) * StageTokens + index / Group];
    }
    collective::template fold_scored<from_shared>(logits, StageTokens, v_stages + buffer * layout::stage_bytes, n, s);
    __syncthreads();  // every thread is done with this buffer (and the logits) before refills
    if (tid == 0 && stage + Stages < num_stages) issue(stage + Stages);
  }
  detail_decode::write_partial<HeadDim, Group, Threads, lanes_per_row>(p, work_index, head, s,
                                                                       *reinterpret_cast<temp_storage*>(k_stages));
}

/// Dynamic shared memory of the TMA split kernel: page ids, barriers, then `Stages` K tiles and
/// `Stages` V tiles of `StageTokens` rows, each a column of 64-channel swizzled blocks, 1024-byte
/// aligned. The reduction at the end reuses the tiles.
template <class T, int HeadDim, int StageTokens, int Stages, int MaxPagesPerSplit>
struct tma_decode_layout {
  static constexpr int ids_bytes = (MaxPagesPerSplit * 4 + 1023) / 1024 * 1024;
  static constexpr int barrier_offset = ids_bytes;
  static constexpr int query_offset = ids_bytes + 128;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int tile_offset = (query_offset + query_bytes + 1023) / 1024 * 1024;
  static constexpr int tile_bytes = StageTokens * HeadDim * static_cast<int>(sizeof(T));
  static constexpr int bytes = tile_offset + 2 * Stages * tile_bytes + 1024;  ///< + slack to align the base
};

/// The sm_90 tensor-core split kernel: thread 0 issues 2D TMA copies of the split's K and V rows
/// (128-byte swizzled) `Stages` stages ahead, completing on mbarriers; each of the 4 warps runs
/// q.k and p.v on tensor cores over its 16 tokens of every 64-token stage (`warp_attend_mma`);
/// the warps' states merge at the end. Needs page_size dividing or
/// divided by the stage (the engine checks). Grid: (splits capacity, num_kv_heads).
template <class T, int HeadDim, int Group, int StageTokens, int Stages, int MaxPagesPerSplit>
__global__ void __launch_bounds__(128) decode_partial_tma_kernel(const __grid_constant__ split_params<dense_decode_params> p) {
  constexpr int threads = 128, warps = 4;
  static_assert(StageTokens == warps * 16, "each warp takes 16 tokens of a stage");
  using layout = tma_decode_layout<T, HeadDim, StageTokens, Stages, MaxPagesPerSplit>;
  using attend = warp_attend_mma<T, HeadDim, Group, StageTokens>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  static_assert(sizeof(temp_storage) <= 2 * Stages * layout::tile_bytes, "the reduction reuses the tiles");
  extern __shared__ __align__(1024) std::byte raw_shared[];
  // The swizzle pattern is a function of the address: align the base to 1024 bytes.
  std::byte* shared = reinterpret_cast<std::byte*>(
      (reinterpret_cast<std::uintptr_t>(raw_shared) + 1023) & ~static_cast<std::uintptr_t>(1023));
  auto* ids = reinterpret_cast<std::int32_t*>(shared);
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::barrier_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  std::byte* k_tiles = shared + layout::tile_offset;
  std::byte* v_tiles = k_tiles + Stages * layout::tile_bytes;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");

  const int work_index = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {  // before the wait: the maps do not depend on the kernel before this one
    detail::tma_prefetch_map(&p.format.page_rows);
    detail::tma_prefetch_map(&p.format.tail_rows);
  }
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  detail_decode::stage_split_pages(p, w, range, head, threads, Stages, ids, full);
  __syncthreads();

  const int page_size = p.page_size;
  const int box_rows = min(page_size, StageTokens);
  const int page_tokens = num_pages * page_size;
  const detail_decode::dense_run run = w.with_tail ? detail_decode::dense_rows_of(p, w.batch_index) : detail_decode::dense_run{0, 0};
  const int tokens = page_tokens + run.rows;
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  const int tail_slot = w.with_tail ? p.tail_slots[w.batch_index] : 0;
  const int tail_head_rows = static_cast<int>(p.tail_head_bytes / (HeadDim * static_cast<int>(sizeof(T))));
  // Thread 0: one stage = whole boxes of rows (a page segment or the tail), K and V, every
  // 64-channel block.
  const auto issue = [&](int stage) {
    const int buffer = stage % Stages;
    const int first = stage * StageTokens;
    const int n = min(StageTokens, tokens - first);
    const int boxes = (n + box_rows - 1) / box_rows;
    detail::barrier_arrive_expect(&full[buffer],
                                  static_cast<std::uint32_t>(boxes * box_rows * 128 * (HeadDim / 64) * 2));
    for (int box = 0; box < boxes; ++box) {
      const int t = first + box * box_rows;
      const CUtensorMap* map;
      int row_k, row_v;
      if (t < page_tokens) {
        const int page = ids[t / page_size];
        const int row = t % page_size;
        map = &p.format.page_rows;
        row_k = ((page * 2 + 0) * p.num_kv_heads + head) * page_size + row;
        row_v = ((page * 2 + 1) * p.num_kv_heads + head) * page_size + row;
      } else {
        const int row = run.first + t - page_tokens;
        map = &p.format.tail_rows;
        row_k = ((tail_slot * 2 + 0) * p.num_kv_heads + head) * tail_head_rows + row;
        row_v = ((tail_slot * 2 + 1) * p.num_kv_heads + head) * tail_head_rows + row;
      }
#pragma unroll
      for (int block = 0; block < HeadDim / 64; ++block) {
        const int offset = buffer * layout::tile_bytes + block * StageTokens * 128 + box * box_rows * 128;
        detail::tma_load_2d(k_tiles + offset, map, block * 64, row_k, &full[buffer]);
        detail::tma_load_2d(v_tiles + offset, map, block * 64, row_v, &full[buffer]);
      }
    }
  };
  if (tid == 0)
    for (int stage = 0; stage < min(Stages, num_stages); ++stage) issue(stage);
  // The queries are staged while the first copies are in flight.
  attend::stage_queries(p.q + (static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * Group * HeadDim,
                        p.softmax_scale, query_tiles, threads);
  __syncthreads();

  const int warp = tid / 32;
  attend state;
  state.start();
  float* const split_logits = detail_decode::split_logits(p, w, head, range, Group);
  // The warp's 16 rows of a stage that the step reads (row masks: evicted rows, a token-granular
  // selection; all 16 without masks, with no load). Loaded a stage ahead, so the mask's global
  // load is not on the path from the stage's copy to its fold.
  const auto rows_read_of = [&](int stage) -> std::uint32_t {
    const int row0 = stage * StageTokens + warp * 16;
    return row0 < page_tokens ? detail_decode::sixteen_rows_read(
                                    detail_decode::page_rows_read(p, w.batch_index, head, range.begin + row0 / page_size),
                                    row0 % page_size)
                              : 0xffffu;
  };
  std::uint32_t next_rows_read = num_stages > 0 ? rows_read_of(0) : 0u;
  for (int stage = 0; stage < num_stages; ++stage) {
    const int buffer = stage % Stages;
    const int n = min(StageTokens, tokens - stage * StageTokens);
    const std::uint32_t rows_read = next_rows_read;
    if (stage + 1 < num_stages) next_rows_read = rows_read_of(stage + 1);
    detail::barrier_wait(&full[buffer], static_cast<std::uint32_t>((stage / Stages) & 1));
    // A warp whose 16 rows start past the stage's last token skips it: no box wrote those rows,
    // and stale shared memory could hold non-finite bits that p = 0 would not cancel (0 x NaN).
    // So does a warp none of whose rows a token-granular selection picked.
    const int row0 = stage * StageTokens + warp * 16;
    const std::uint32_t covered = attend::rows_before(warp * 16, n);
    const std::uint32_t rows = rows_read & covered;
    float* const warp_logits =
        split_logits != nullptr ? split_logits + static_cast<std::size_t>(row0) * Group : nullptr;
    if (rows != 0)
      state.fold(k_tiles + buffer * layout::tile_bytes, v_tiles + buffer * layout::tile_bytes, query_tiles, warp * 16, rows,
                 warp_logits, covered);
    else if (warp_logits != nullptr)
      attend::write_masked_logits(warp_logits, covered);
    __syncthreads();  // every warp is done with this buffer before it is refilled
    if (tid == 0 && stage + Stages < num_stages) issue(stage + Stages);
  }

  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(k_tiles));
}

}  // namespace kvmosaic::cuda::kernel
