// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What every format's split kernels share: the step's parameters (`decode_params`, and
/// `split_params` with a format's own fields), the split helpers (`detail_decode`: claiming a
/// work entry, a split's pages and row masks, writing the partial state), and
/// `merge_splits_kernel` (one CTA per (sequence, query head): the flash-decoding merge of the
/// splits' partial states). The split kernels themselves live with their format
/// (cuda/format/<name>/decode.cuh): one CTA per split of one (sequence, KV head), every query
/// head of the GQA group sharing each K/V load.

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
  int group_size;                     ///< query heads per KV head (for kernels where it is a run-time value)
  int sink_rows;                      ///< S: exact sink rows a tail head keeps (masked in a sequence's
                                      ///< first page by the step's row masks)
  int exact_rows;                     ///< S + W: the exact rows (window ring, sinks) before a tail
                                      ///< head's tail rows (host/backend.hpp's layout)

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
  void* out;                          ///< [batch][num_q_heads][head_dim] at `out_strides`, in the
                                      ///< merge kernel's output type
  std::int64_t out_strides[3];        ///< elements per batch entry, query head, channel
  float* lse;                         ///< null, or [batch][num_q_heads] at `lse_strides`: each head's
                                      ///< log-sum-exp of its scaled logits (natural log)
  std::int64_t lse_strides[2];
  /// Null, or [batch][num_kv_heads][logit_slots][group_size] fp32: a step that records token
  /// scores has each split write the scaled logit of every row it folds (-inf for a row it masks),
  /// at the row's place in its sequence's read order: block-table entry x page_size + page row,
  /// then, from sealed pages x page_size on, the run of exact and tail rows. Written for every row
  /// of [0, that run's end) the step covers; `kernel::token_scores_kernel` normalizes them.
  float* token_logits;
  std::int64_t logit_slots;
};

/// The parameters of a format's split kernel: the shared `decode_params` and the format's own
/// (`device_format<Format>::params`, cuda/format/device_format.cuh).
template <class FormatParams>
struct split_params : decode_params {
  FormatParams format;
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

/// The dense rows the split with the tail reads for sequence `batch`: the exact rows its tail
/// slot holds (min(S + W, sealed tokens)) and its tail rows, one run of `rows` rows starting at
/// row `first` of a tail head.
struct dense_run {
  int first;
  int rows;
};
__device__ __forceinline__ dense_run dense_rows_of(const decode_params& p, int batch) {
  const std::int64_t sealed = static_cast<std::int64_t>(p.sealed_pages[batch]) * p.page_size;
  const int exact = static_cast<int>(sealed < p.exact_rows ? sealed : p.exact_rows);
  return dense_run{p.exact_rows - exact, exact + p.tail_rows[batch]};
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

/// Where the split's first row (page entry `range.begin`, row 0) writes its logits, or null
/// when the step records no token scores (`decode_params::token_logits`). A split's rows are
/// consecutive in the read order, its tail run after its pages.
__device__ __forceinline__ float* split_logits(const decode_params& p, const split_work& w, int head,
                                               const split_pages& range, int group) {
  if (p.token_logits == nullptr) return nullptr;
  return p.token_logits +
         ((static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * p.logit_slots +
          static_cast<std::size_t>(range.begin) * p.page_size) * group;
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

/// The splits whose partials `merge_splits_kernel` loads before it knows their weights: a
/// register each per thread, enough for the split counts of most steps (one wave of CTAs spread
/// over a batch of 8 or more sequences).
inline constexpr int merge_ahead = 16;

/// out[b][j] = merge over the splits of b of their normalized partials (lse_s, o_s): weights
/// exp(lse_s - max lse) / sum. One CTA per (sequence, query head), a thread per channel. Each
/// thread loads its first split's lse and the first `merge_ahead` splits' partials of its channel
/// at once, before the max; the max comes from those lse (splits beyond HeadDim: more loads),
/// then, per chunk of HeadDim splits, the weights go to shared memory and every thread's loads of
/// the rest of those splits' partials are independent, so they stay in flight together: one round
/// trip to L2 after the splits' offsets for up to `merge_ahead` splits, one more per 16 after
/// that, where a loop of dependent loads per split costs one each (benchmark/README.md,
/// "Decisions the code cites": "merge"). The sums run over the splits in order either way.
/// `Out`: float, half or bfloat16 (rounded to nearest). With `p.lse`, thread 0 also writes the
/// head's log-sum-exp, max lse + log(sum of weights): what a cascade merge with attention
/// computed elsewhere needs.
template <int HeadDim, class Out>
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
  constexpr int ahead = merge_ahead;
  float early[ahead];  // the first splits' partials, in flight with the lse loads
#pragma unroll
  for (int s = 0; s < ahead; ++s) early[s] = s < splits ? partial[static_cast<std::size_t>(s) * split_stride] : 0.0f;
  const float first_lse = c < splits ? lse[static_cast<std::size_t>(c) * num_q_heads] : -HUGE_VALF;
  float max_lse = first_lse;
  for (int s = c + HeadDim; s < splits; s += HeadDim) max_lse = fmaxf(max_lse, lse[static_cast<std::size_t>(s) * num_q_heads]);
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
      const float split_lse = chunk == 0 ? first_lse : lse[static_cast<std::size_t>(chunk + c) * num_q_heads];
      weights[c] = split_lse == -HUGE_VALF ? 0.0f : __expf(split_lse - max_lse);
    }
    __syncthreads();
    int s = 0;
    if (chunk == 0) {
#pragma unroll
      for (int x = 0; x < ahead; ++x)
        if (x < count) {
          weight_sum += weights[x];
          o = fmaf(weights[x], early[x], o);
        }
      s = min(count, ahead);
    }
#pragma unroll 16
    for (; s < count; ++s) {
      weight_sum += weights[s];
      o = fmaf(weights[s], partial[static_cast<std::size_t>(chunk + s) * split_stride], o);
    }
    __syncthreads();  // the weights are read before the next chunk overwrites them
  }
  // A NaN partial (NaN input) makes the output NaN, as on the host; no token at all gives 0.
  const float value = weight_sum != 0.0f ? o / weight_sum : 0.0f;
  static_cast<Out*>(p.out)[b * p.out_strides[0] + j * p.out_strides[1] + c * p.out_strides[2]] = Out(value);
  if (p.lse != nullptr && c == 0)
    p.lse[b * p.lse_strides[0] + j * p.lse_strides[1]] = weight_sum != 0.0f ? max_lse + logf(weight_sum) : -HUGE_VALF;
}

}  // namespace kvmosaic::cuda::kernel
