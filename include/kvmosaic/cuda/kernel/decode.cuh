// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The decode-attention kernels of one step: `decode_partial_kernel` (one CTA per split of one
/// (sequence, KV head): every query head of the GQA group shares each K/V load) and
/// `merge_splits_kernel` (one CTA per (sequence, query head): the flash-decoding merge of the
/// splits' partial states). Both are generic over the format through `page_attend`; the dense
/// tail always goes through the dense collective.

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvmosaic/core/softmax_state.hpp"
#include "kvmosaic/core/split_plan.hpp"
#include "kvmosaic/cuda/collective/page_attend.cuh"
#include "kvmosaic/cuda/collective/score_mma.cuh"
#include "kvmosaic/cuda/collective/warp_attend_mma.cuh"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"

namespace kvmosaic::cuda::kernel {

/// Where a step's data lives and how it is laid out (see host/backend.hpp for the layouts).
struct decode_params {
  const std::byte* pages;             ///< page arena: slot = [K: heads x k_page_bytes][V: heads x v_page_bytes]
  const std::byte* tails;             ///< tail arena: slot = [K: heads x tail_head_bytes][V: same]
  std::int64_t page_slot_bytes;
  std::int64_t k_page_bytes;
  std::int64_t v_page_bytes;
  std::int64_t tail_slot_bytes;
  std::int64_t tail_head_bytes;
  int num_kv_heads;
  int page_size;
  int stages;                         ///< sm_90 bitmap_tiles kernel: compressed pages in flight per CTA
  int group_size;                     ///< query heads per KV head (for kernels where it is a run-time value)
  int sink_rows;                      ///< dense sink rows after the tail rows of a slot (quant2), masked in
                                      ///< a sequence's first page
  int k_along_tokens;                 ///< bitmap_tiles: K tiles are one channel x 64 tokens (1) or as V (0)

  /// device: [0] splits this step, [1] row stride of `block_tables`, [2] its KV-head stride (0:
  /// one table per sequence; a selection's tables are per (sequence, KV head)), [3] row stride of
  /// `sequence_tables`
  const std::int32_t* step_header;
  const std::int32_t* block_tables;   ///< the pages each split reads: [batch][header[1]], head h at h * header[2]
  const std::int32_t* sequence_tables;///< every sealed page of each sequence, in order: [batch][header[3]]
  const std::int32_t* sealed_pages;   ///< [batch] pages each sequence has (all, selected or not)
  const std::int32_t* tail_slots;     ///< [batch]
  const std::int32_t* tail_rows;      ///< [batch]
  const split_work* work;             ///< [grid's CTAs in x]; this step's splits first (graph replay)
  /// Token-granular selections (sub-page `select::quest` blocks, `select::sentence_chunks`): per
  /// entry of `block_tables`, `mask_words` 32-bit words whose bit r of word w says page row
  /// 32 w + r is read. Null: every row of every listed page.
  const std::uint32_t* token_masks;
  int mask_words;
  /// Null, or [batch][num_kv_heads]: the entries a selection wrote in each table, at most the
  /// plan's `planned_pages[b]`; the splits of a sequence then share them in proportion.
  const std::int32_t* table_lengths;
  const std::int32_t* planned_pages;  ///< [batch] the entries the split plan covers
  const std::int32_t* partial_offset; ///< [batch + 1]

  const float* q;                     ///< [batch][num_q_heads][head_dim]
  float softmax_scale;
  float* partial_o;                   ///< [work capacity][num_q_heads][head_dim], normalized per split
  float* partial_lse;                 ///< [work capacity][num_q_heads], natural log
  float* out;                         ///< [batch][num_q_heads][head_dim]

  /// sm_90 TMA kernel only: the page and tail arenas as 2D tensors of rows (head_dim wide), row
  /// ((slot * 2 + is_v) * num_kv_heads + head) * page_size + row, 128-byte swizzled boxes.
  CUtensorMap page_rows;
  CUtensorMap tail_rows_map;
};

/// Shared memory of the CTA-level reduction across token rows.
template <int Group, int HeadDim, int Rows>
struct decode_temp_storage {
  float o[Rows][Group][HeadDim];
  float m[Rows][Group];
  float l[Rows][Group];
};

namespace detail_decode {

/// Every split kernel's first step. Waits for the kernel before it in the stream (the metadata
/// pull, or the selection), which it may overlap (programmatic dependent launch on sm_90); lets
/// the merge kernel be scheduled (it waits for this grid to complete); loads this CTA's work
/// entry `w`; and says whether the CTA has a split: the grid is sized for the largest plan (graph
/// replay), a step may use fewer. The split count and the entry are loaded together (one round
/// trip, not two: the work array is sized for the grid, so the load is in bounds either way).
__device__ __forceinline__ bool start_split(const decode_params& p, int work_index, split_work& w) {
  detail::wait_for_prior_grid();
  detail::allow_dependent_grids();
  const int planned = p.step_header[0];
  w = p.work[work_index];
  return work_index < planned;
}

/// The page table a split of sequence `batch` reads for KV head `head`: the sequence's block
/// table, or the pages a selection chose for that head.
__device__ __forceinline__ const std::int32_t* page_table(const decode_params& p, int batch, int head) {
  return p.block_tables + static_cast<std::size_t>(batch) * p.step_header[1] +
         static_cast<std::size_t>(head) * p.step_header[2];
}

/// The entries [begin, end) of its page table that a split reads: the plan's, or, when a
/// selection wrote fewer entries than planned, the same share of those it wrote.
struct split_pages {
  int begin;
  int end;
};
__device__ __forceinline__ split_pages pages_of_split(const decode_params& p, const split_work& w, int head) {
  if (p.table_lengths == nullptr) return {w.page_begin, w.page_end};
  const std::int64_t planned = p.planned_pages[w.batch_index];
  const std::int64_t written = p.table_lengths[static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head];
  if (planned == 0) return {0, 0};
  return {static_cast<int>(w.page_begin * written / planned), static_cast<int>(w.page_end * written / planned)};
}

/// The row mask of entry `entry` of the page table of (`batch`, `head`) (null: every row read).
__device__ __forceinline__ const std::uint32_t* page_rows_read(const decode_params& p, int batch, int head, int entry) {
  if (p.token_masks == nullptr) return nullptr;
  return p.token_masks + (static_cast<std::size_t>(batch) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2] +
                          static_cast<std::size_t>(entry)) * p.mask_words;
}

/// The 16 bits of a row mask for rows [first, first + 16) (first a multiple of 16); all set for
/// a null mask.
__device__ __forceinline__ std::uint32_t sixteen_rows_read(const std::uint32_t* rows_read, int first) {
  return rows_read == nullptr ? 0xffffu : (rows_read[first >> 5] >> (first & 31)) & 0xffffu;
}

/// Loads this thread's slice of the group's queries, pre-multiplied by the softmax scale, and
/// starts its state empty.
template <int HeadDim, int Group, int LanesPerRow>
__device__ __forceinline__ void start_state(const decode_params& p, const split_work& w, int head,
                                            thread_state<Group>& s) {
  constexpr int vec = detail::vector_elements;
  const int lane = static_cast<int>(threadIdx.x) % LanesPerRow;
  const int num_q_heads = p.num_kv_heads * Group;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
    const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group + g) * HeadDim + lane * vec;
    const float4 a = *reinterpret_cast<const float4*>(q);
    const float4 b = *reinterpret_cast<const float4*>(q + 4);
    const float qs[vec] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < vec; ++i) {
      s.q[g][i] = qs[i] * p.softmax_scale;
      s.o[g][i] = 0.0f;
    }
    s.m[g] = -HUGE_VALF;
    s.l[g] = 0.0f;
  }
}

/// Merges the `Rows` states the CTA left in shared memory `temp` (token rows of the SIMT kernels,
/// or warps of the tensor-core kernels) and writes this split's normalized partial output and
/// log-sum-exp, for the first `group` (at most Group, the default) query heads. Starts with a
/// barrier: the caller has just written `temp`.
template <int HeadDim, int Group, int Threads, int Rows>
__device__ __forceinline__ void merge_and_write_partial(const decode_params& p, int work_index, int head,
                                                        const decode_temp_storage<Group, HeadDim, Rows>& temp,
                                                        int group = Group) {
  __syncthreads();
  const int num_q_heads = p.num_kv_heads * group;
  const std::size_t partial_base = static_cast<std::size_t>(work_index) * num_q_heads + head * group;
  for (int index = static_cast<int>(threadIdx.x); index < group * HeadDim; index += Threads) {
    const int g = index / HeadDim, c = index % HeadDim;
    softmax_state<float> total;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      softmax_state<float> part;
      part.m = temp.m[r][g];
      part.l = temp.l[r][g];
      const merge_weights<float> mw = total.merge(part);
      o = o * mw.self + temp.o[r][g][c] * mw.other;
    }
    // A split that a selection left without a token is the empty state: it merges as nothing.
    p.partial_o[(partial_base + g) * HeadDim + c] = total.l > 0.0f ? o / total.l : 0.0f;
    if (c == 0) p.partial_lse[partial_base + g] = total.log_sum_exp();
  }
}

/// The SIMT kernels' epilogue: each token row's state to `temp`, then the merge.
template <int HeadDim, int Group, int Threads, int LanesPerRow>
__device__ __forceinline__ void write_partial(const decode_params& p, int work_index, int head,
                                              const thread_state<Group>& s,
                                              decode_temp_storage<Group, HeadDim, Threads / LanesPerRow>& temp) {
  constexpr int vec = detail::vector_elements;
  const int lane = static_cast<int>(threadIdx.x) % LanesPerRow;
  const int row = static_cast<int>(threadIdx.x) / LanesPerRow;
#pragma unroll
  for (int g = 0; g < Group; ++g) {
#pragma unroll
    for (int i = 0; i < vec; ++i) temp.o[row][g][lane * vec + i] = s.o[g][i];
    if (lane == 0) {
      temp.m[row][g] = s.m[g];
      temp.l[row][g] = s.l[g];
    }
  }
  merge_and_write_partial<HeadDim, Group, Threads, Threads / LanesPerRow>(p, work_index, head, temp);
}

/// The sm_90 kernels' prologue: the split's page ids to shared memory (all threads) and one
/// mbarrier per stage (thread 0). A barrier must follow before either is used.
__device__ __forceinline__ void stage_split_pages(const decode_params& p, const split_work& w, const split_pages& range,
                                                  int head, int threads, int stages, std::int32_t* ids,
                                                  std::uint64_t* full) {
  const int num_pages = range.end - range.begin;
  const std::int32_t* table = page_table(p, w.batch_index, head) + range.begin;
  for (int i = static_cast<int>(threadIdx.x); i < num_pages; i += threads) ids[i] = table[i];
  if (threadIdx.x == 0)
    for (int b = 0; b < stages; ++b) detail::barrier_init(&full[b], 1);
}

/// The tensor-core kernels' epilogue: each warp's `warp_attend_mma` state to `temp`
/// (`Attend::store`), then the CTA merge. `temp` may alias the stage buffers: the caller has
/// passed a barrier after its last read of them.
template <class Attend, int HeadDim, int Group, int Warps>
__device__ __forceinline__ void write_warp_partial(const decode_params& p, int work_index, int head,
                                                   const Attend& state,
                                                   decode_temp_storage<Group, HeadDim, Warps>& temp) {
  state.store(temp, static_cast<int>(threadIdx.x) / 32);
  merge_and_write_partial<HeadDim, Group, Warps * 32, Warps>(p, work_index, head, temp);
}

}  // namespace detail_decode

/// The portable split kernel (any architecture): each thread streams its K/V slices from global
/// memory into registers, `Unroll` tokens in flight. Grid: (splits capacity, num_kv_heads).
template <class Format, class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_kernel(const decode_params p) {
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
  std::int32_t next_page = range.begin < range.end ? table[range.begin] : 0;
  for (int i = range.begin; i < range.end; ++i) {
    const std::int32_t page = next_page;
    if (i + 1 < range.end) next_page = table[i + 1];  // in flight while this page is read
    const std::byte* slot = p.pages + static_cast<std::size_t>(page) * p.page_slot_bytes;
    collective::fold(slot + head * p.k_page_bytes, slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                     p.page_size, s, detail_decode::page_rows_read(p, w.batch_index, head, i));
  }
  if (w.with_tail) {
    const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes;
    tail_collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes,
                          p.tail_rows[w.batch_index], s);
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
__global__ void __launch_bounds__(Threads) decode_partial_bulk_kernel(const decode_params p) {
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
  const int tokens = page_tokens + (w.with_tail ? p.tail_rows[w.batch_index] : 0);
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  const std::byte* tail_slot =
      w.with_tail ? p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes : nullptr;
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
__global__ void __launch_bounds__(128) decode_partial_tma_kernel(const __grid_constant__ decode_params p) {
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
    detail::tma_prefetch_map(&p.page_rows);
    detail::tma_prefetch_map(&p.tail_rows_map);
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
  const int tokens = page_tokens + (w.with_tail ? p.tail_rows[w.batch_index] : 0);
  const int num_stages = (tokens + StageTokens - 1) / StageTokens;
  const int tail_slot = w.with_tail ? p.tail_slots[w.batch_index] : 0;
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
        map = &p.page_rows;
        row_k = ((page * 2 + 0) * p.num_kv_heads + head) * page_size + row;
        row_v = ((page * 2 + 1) * p.num_kv_heads + head) * page_size + row;
      } else {
        const int row = t - page_tokens;
        map = &p.tail_rows_map;
        row_k = ((tail_slot * 2 + 0) * p.num_kv_heads + head) * page_size + row;
        row_v = ((tail_slot * 2 + 1) * p.num_kv_heads + head) * page_size + row;
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
  for (int stage = 0; stage < num_stages; ++stage) {
    const int buffer = stage % Stages;
    const int n = min(StageTokens, tokens - stage * StageTokens);
    detail::barrier_wait(&full[buffer], static_cast<std::uint32_t>((stage / Stages) & 1));
    // A warp whose 16 rows start past the stage's last token skips it: no box wrote those rows,
    // and stale shared memory could hold non-finite bits that p = 0 would not cancel (0 x NaN).
    // So does a warp none of whose rows a token-granular selection picked.
    const int row0 = stage * StageTokens + warp * 16;
    const std::uint32_t rows_read =
        row0 < page_tokens ? detail_decode::sixteen_rows_read(
                                 detail_decode::page_rows_read(p, w.batch_index, head, range.begin + row0 / page_size),
                                 row0 % page_size)
                           : 0xffffu;
    const std::uint32_t rows = rows_read & attend::rows_before(warp * 16, n);
    if (rows != 0)
      state.fold(k_tiles + buffer * layout::tile_bytes, v_tiles + buffer * layout::tile_bytes, query_tiles, warp * 16, rows);
    __syncthreads();  // every warp is done with this buffer before it is refilled
    if (tid == 0 && stage + Stages < num_stages) issue(stage + Stages);
  }

  detail_decode::write_warp_partial<attend, HeadDim, Group, warps>(p, work_index, head, state,
                                                                   *reinterpret_cast<temp_storage*>(k_tiles));
}

/// out[b][j] = merge over the splits of b of their normalized partials (lse_s, o_s): weights
/// exp(lse_s - max lse) / sum. One CTA per (sequence, query head), a thread per channel. The
/// max comes from one load per thread (splits beyond HeadDim: more), then, per chunk of HeadDim
/// splits, the weights go to shared memory and every thread's loads of those splits' partials are
/// independent, so they stay in flight together: about 2 + splits / 16 round trips to L2, where a
/// loop of dependent loads per split cost one each (8.7 us at batch 1, 34 splits, on H100).
template <int HeadDim>
__global__ void __launch_bounds__(HeadDim) merge_splits_kernel(const decode_params p, int num_q_heads) {
  static_assert(HeadDim % 32 == 0, "merge_splits_kernel: whole warps");
  constexpr int warps = HeadDim / 32;
  __shared__ float weights[HeadDim];
  __shared__ float warp_max[warps];
  detail::wait_for_prior_grid();  // the split kernel's partials (it may still run: dependent launch)
  const int b = static_cast<int>(blockIdx.x) / num_q_heads;
  const int j = static_cast<int>(blockIdx.x) % num_q_heads;
  const int c = static_cast<int>(threadIdx.x);
  const int begin = p.partial_offset[b], splits = p.partial_offset[b + 1] - begin;
  const float* lse = p.partial_lse + static_cast<std::size_t>(begin) * num_q_heads + j;
  const float* partial = p.partial_o + (static_cast<std::size_t>(begin) * num_q_heads + j) * HeadDim + c;
  const std::size_t split_stride = static_cast<std::size_t>(num_q_heads) * HeadDim;
  float max_lse = -HUGE_VALF;
  for (int s = c; s < splits; s += HeadDim) max_lse = fmaxf(max_lse, lse[static_cast<std::size_t>(s) * num_q_heads]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  if (c % 32 == 0) warp_max[c / 32] = max_lse;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < warps; ++w) max_lse = fmaxf(max_lse, warp_max[w]);
  float weight_sum = 0.0f, o = 0.0f;
  for (int chunk = 0; chunk < splits; chunk += HeadDim) {
    const int count = min(HeadDim, splits - chunk);
    // A split without a token (lse = -inf) weighs 0; so does every split if none has one.
    if (c < count) {
      const float split_lse = lse[static_cast<std::size_t>(chunk + c) * num_q_heads];
      weights[c] = split_lse == -HUGE_VALF ? 0.0f : __expf(split_lse - max_lse);
    }
    __syncthreads();
#pragma unroll 16
    for (int s = 0; s < count; ++s) {
      weight_sum += weights[s];
      o = fmaf(weights[s], partial[static_cast<std::size_t>(chunk + s) * split_stride], o);
    }
    __syncthreads();  // the weights are read before the next chunk overwrites them
  }
  // A NaN partial (NaN input) makes the output NaN, as on the host; no token at all gives 0.
  p.out[(static_cast<std::size_t>(b) * num_q_heads + j) * HeadDim + c] = weight_sum != 0.0f ? o / weight_sum : 0.0f;
}

}  // namespace kvmosaic::cuda::kernel
