// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The page-selection kernels of a read-less step (`select::quest` with one block per page): they
/// run on the device between the step's metadata copy and the split kernel, with no host round
/// trip, so a selected step is captured in a CUDA graph like a dense one.
///   - `score_pages_kernel`: one warp per 4 or 8 spans of a (sequence, KV head): Quest's bound of
///     q . k from each span's key bounds, or q . mean key, for each query head of the group,
///     combined (select/span_score.hpp gives the fp32 order, which the host backend follows to the
///     bit).
///   - `select_pages_kernel`: one CTA per (sequence, KV head): the budget's top pages (higher
///     score first, ties to the earlier page) by a radix select on the scores' order-preserving
///     keys (4 passes of 8 bits, each a shared-memory histogram), then a compaction by warp
///     ballots over a run of pages per warp that writes the chosen page ids in sequence order:
///     the split kernel's per-head page table.

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/fast_divisor.hpp"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic::cuda::kernel {

/// What the selection kernels read and write. Tables and scores are rows of the step metadata.
///
/// The scoring kernel sees a sequence as `span_counts[b]` spans with key bounds: span i lies in
/// entry i / spans_per_entry of its span table, whose bounds are a block of `bounds_entry_bytes`:
/// [num_kv_heads][spans_per_entry][lo row, hi row] (or one mean row, `summary_rows` = 1, scored as
/// lo = hi). For `select::quest` and `select::mean_keys` the entries are the pages (spans_per_entry
/// = blocks per page); for `select::sentence_chunks`, blocks of chunk bounds.
struct select_params {
  const std::byte* bounds;            ///< bounds arena, in the storage dtype
  std::int64_t bounds_entry_bytes;    ///< one entry's bounds, every KV head
  int spans_per_entry;
  int summary_rows;                   ///< rows per span: 2 (lo, hi) or 1 (mean)
  const std::int32_t* span_tables;    ///< [batch][span_table_stride] entry ids
  int span_table_stride;
  const std::int32_t* span_counts;    ///< [batch] spans of each sequence
  int score_stride;                   ///< scores of (b, head) at (b * num_kv_heads + head) * score_stride
  const std::int32_t* step_header;    ///< [1] selected-table row stride, [2] its head stride, [3] block-table stride
  const std::int32_t* block_tables;   ///< [batch][header[3]] each sequence's page ids
  const std::int32_t* sealed_pages;   ///< [batch] pages each sequence has
  const std::int32_t* budget_pages;   ///< [batch] pages each KV head reads (at most sealed_pages; whole pages)
  const float* q;                     ///< [batch][num_kv_heads * group_size][head_dim], unscaled
  int num_kv_heads;
  int group_size;
  int combine_sum;                    ///< 1: group_combine::sum, 0: group_combine::max
  float* scores;                      ///< [batch][num_kv_heads][score_stride]
  std::int32_t* selected;             ///< [batch][header[1]]: per KV head, header[2] apart, the chosen page ids

  // Token-granular selection (`select_spans_kernel`) only.
  int span_tokens;                    ///< > 0: span i is tokens [i * span_tokens, (i + 1) * span_tokens)
  const int2* span_ranges;            ///< span_tokens == 0: {begin, end} per span slot (entry * spans_per_entry + k)
  const std::int32_t* budget_tokens;  ///< [batch] tokens each KV head's chosen spans may hold
  const std::int32_t* always_from;    ///< [batch] sealed tokens from here on are read whatever the selection
  int page_size;
  int mask_words;                     ///< 32-bit row-mask words per page
  std::uint32_t* marks;               ///< scratch: [batch][num_kv_heads][header[3]][mask_words]
  std::uint32_t* token_masks;         ///< [batch][header[1]] entries of `selected` (head h at h * header[2]) x mask_words
  std::int32_t* table_lengths;        ///< [batch][num_kv_heads] entries written to `selected`

  /// Evicted tokens (null: none): per (sequence, block-table entry), its live rows
  /// ([batch][header[3]][mask_words]). Both kernels then write each chosen page's row mask ANDed
  /// with its live rows to `token_masks` (page-granular steps too) and the entries to
  /// `table_lengths`, and drop a page left with no row.
  const std::uint32_t* live_masks;

  // Block keys (`score_block_keys_kernel`): each span's summary is a format's block key
  // (`block_key_layout` of r pairs; `bounds_entry_bytes` per entry as above, `key_bytes` per
  // span), scored against the step's queries in the span's segment.
  int key_bytes;                      ///< one span's block key
  int key_retained;                   ///< r: values a block key holds
  int key_kept;                       ///< channels of the segments' rotated space
  int key_query_copies;               ///< `block_key_launch::copies` (a power of 2)
  int key_stride;                     ///< `block_key_launch::key_stride`
  int segments_per_sequence;
  kvmosaic::detail::fast_divisor entry_of_span;    ///< span / spans_per_entry: the span's entry
  kvmosaic::detail::fast_divisor segment_of_span;  ///< span / (spans_per_entry x pages a segment holds): its segment
  kvmosaic::detail::fast_divisor key_of_chunk;     ///< 16-byte chunk / (key_bytes / 16): the key it is in
  const float* q_key;                 ///< [batch][num_kv_heads][segments_per_sequence][kept][score_heads(group)]
  int q_key_ready;                    ///< 1: q_key is complete at launch (a plain launch), else after wait_for_prior_grid
};

/// Query heads the scoring kernels take at a time for a group of `group` heads: 4 for groups of
/// up to 4, else 8; also the width of a block-key query row (`block_key_source`).
__host__ __device__ constexpr int score_heads(int group) noexcept { return group <= 4 ? 4 : 8; }

/// Warps per CTA of the scoring kernel.
inline constexpr int score_warps = 8;
namespace detail_select {
/// `Count` consecutive 16-bit values as they are stored, with one vector load (Count = 2, 4 or 8).
template <int Count>
using raw_vector = std::conditional_t<Count == 8, uint4, std::conditional_t<Count == 4, uint2, unsigned>>;
template <class T, int Count>
__device__ __forceinline__ raw_vector<Count> load_raw(const T* source) {
  return *reinterpret_cast<const raw_vector<Count>*>(source);
}
/// The values of a `load_raw` as floats.
template <class T, int Count>
__device__ __forceinline__ void to_floats(const raw_vector<Count>& raw, float* out) {
  const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Count; ++i) out[i] = to_float(values[i]);
}

/// One level of `reduce_scatter`: of v[0, 2 Half) the lane keeps one half (the upper where bit
/// Half of its lane is set) and adds the other's, sent by lane ^ Half, into v[0, Half).
template <int Half>
__device__ __forceinline__ void reduce_half(float (&v)[16], int lane) {
  const bool upper = (lane & Half) != 0;
#pragma unroll
  for (int i = 0; i < Half; ++i) {
    const float send = upper ? v[i] : v[i + Half];
    const float keep = upper ? v[i + Half] : v[i];
    v[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, Half));
  }
}

/// A warp's reduce-scatter of 32 values per lane, `value(i)` giving value i: afterwards lane l
/// holds the sum over the 32 lanes of value l, added in the butterfly order of the canonical
/// reduction (offsets 16, 8, 4, 2, 1: select/span_score.hpp), so each sum has the bits a
/// per-value butterfly would give (addition commutes), for 31 shuffles instead of 160. Values i
/// and i + 16 are asked for together and exchanged at once, so 16 are live at a time.
template <class Value>
__device__ __forceinline__ float reduce_scatter(const Value& value) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float v[16];
  const bool upper16 = (lane & 16) != 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float low = value(i), high = value(i + 16);
    v[i] = __fadd_rn(upper16 ? high : low, __shfl_xor_sync(0xffffffffu, upper16 ? low : high, 16));
  }
  reduce_half<8>(v, lane);
  reduce_half<4>(v, lane);
  reduce_half<2>(v, lane);
  reduce_half<1>(v, lane);
  return v[0];
}
}  // namespace detail_select

/// Spans each warp of `score_pages_kernel` scores, for groups of up to `heads` heads (4 or 8): as
/// many as keep their raw summaries (head_dim / 32 channels of `summary_rows` 16-bit rows a span
/// and lane) in the registers left of a budget by the lane's queries, one reduction's floats and
/// its 16 partial sums, so that a warp has them all in flight at once; at most 32 (one per lane
/// locates them), at least one reduction (32 / heads), whole reductions. The budget: 96 for groups
/// of up to 4, which fits three CTAs an SM (at head_dim 128, 24 mean-key spans a warp rather than
/// 32 at two CTAs: the faster by measurement, benchmark/README.md, "Span scoring at three CTAs an
/// SM"), 112 for groups of 5 to 8.
__host__ __device__ constexpr int score_spans_per_warp(int head_dim, int summary_rows, int heads) noexcept {
  const int width = head_dim / 32, per_reduction = 32 / heads;
  const int budget = heads == 4 ? 96 : 112;
  const int free_registers = budget - heads * width - per_reduction * summary_rows * width;
  const int spans = free_registers / (summary_rows * width / 2);
  return spans >= 32 ? 32 : (spans <= per_reduction ? per_reduction : spans / per_reduction * per_reduction);
}

/// Quest bounds (`SummaryRows` 2: lo and hi rows) or mean-key scores (1: one row, scored as
/// lo = hi) of every span, for groups of up to `Heads` query heads (4 or 8). Each warp scores
/// S = score_spans_per_warp(HeadDim, SummaryRows, Heads) consecutive spans: lane k locates span k
/// (its entry's id and the address of its summary rows), every lane takes each span's address
/// from lane k by a shuffle, and all S spans' summaries are loaded before anything waits on them;
/// only then are the group's queries staged in shared memory (every warp of the CTA reads the
/// same (sequence, KV head)), so a CTA waits on two loads for S x score_warps spans. Lane l holds
/// channels [l w, (l + 1) w), w = head_dim / 32, and accumulates them in order by fused
/// multiply-adds; the 32 lanes' partial sums of 32 / Heads spans (the Heads heads of each) are
/// then reduced at once (`reduce_scatter`), S Heads / 32 reductions a warp: the canonical order of
/// select/span_score.hpp, which the host backend follows to the bit. Grid: (num_kv_heads,
/// ceil(spans / (score_warps x S)), batch): the KV heads of the same entries side by side, so the
/// CTAs in flight read each entry's summaries (every head's, contiguous) together.
template <class T, int HeadDim, int SummaryRows, int Heads>
__global__ void __launch_bounds__(score_warps * 32) score_pages_kernel(const select_params p) {
  static_assert(SummaryRows == 1 || SummaryRows == 2, "a span's summary: a mean row, or lo and hi rows");
  static_assert(Heads == 4 || Heads == 8, "heads per reduction: 4 (groups of up to 4) or 8");
  constexpr int width = HeadDim / kvmosaic::detail::span_score_lanes;  // contiguous channels per lane
  constexpr int per_reduction = 32 / Heads;
  constexpr int per_warp = score_spans_per_warp(HeadDim, SummaryRows, Heads);
  static_assert(per_warp % per_reduction == 0, "whole reductions a warp");
  using raw = detail_select::raw_vector<width>;
  __shared__ float queries[8 * HeadDim];  // the group's queries (at most 8 heads)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.z);
  const int spans = p.span_counts[b];  // pages, page blocks or chunks
  const int cta_first = static_cast<int>(blockIdx.y) * score_warps * per_warp;
  if (cta_first >= spans) return;  // the whole CTA: before the barrier below
  const int first = cta_first + warp * per_warp, last = spans - 1;
  // Lane k locates span first + k (the last span past the end): block `slot` of entry `entry`,
  // this head's summary rows; the warp's lanes then take each span's row from lane k, so the
  // division, the entry's id and the 64-bit address are one per lane, not one per span and lane.
  std::uintptr_t lane_summary;
  {
    const int per_entry = p.spans_per_entry, span = min(first + lane, last);
    const int entry = span / per_entry, slot = span % per_entry;
    const std::int32_t id = p.span_tables[static_cast<std::size_t>(b) * p.span_table_stride + entry];
    lane_summary = reinterpret_cast<std::uintptr_t>(
        reinterpret_cast<const T*>(p.bounds + static_cast<std::size_t>(id) * p.bounds_entry_bytes) +
        (static_cast<std::size_t>(head) * per_entry + slot) * SummaryRows * HeadDim);
  }
  raw low[per_warp], high[SummaryRows == 2 ? per_warp : 1];
#pragma unroll
  for (int k = 0; k < per_warp; ++k) {
    const T* row = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, static_cast<unsigned long long>(lane_summary), k)) +
                   lane * width;
    low[k] = detail_select::load_raw<T, width>(row);
    if constexpr (SummaryRows == 2) high[k] = detail_select::load_raw<T, width>(row + HeadDim);
  }
  const float* q = p.q + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.group_size * HeadDim;
  const int group = p.group_size;
  for (int i = static_cast<int>(threadIdx.x); i < group * HeadDim; i += score_warps * 32) queries[i] = q[i];
  __syncthreads();  // the queries are staged
  if (first >= spans) return;
  float qc[Heads][width];  // this lane's channels of each head (zero past the group: never combined)
#pragma unroll
  for (int g = 0; g < Heads; ++g)
#pragma unroll
    for (int j = 0; j < width; ++j) qc[g][j] = g < group ? queries[g * HeadDim + lane * width + j] : 0.0f;
  float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride;
#pragma unroll
  for (int r = 0; r < per_warp / per_reduction; ++r) {
    const int reduction_first = first + r * per_reduction;
    if (reduction_first >= spans) break;  // the same for the whole warp
    float lo[per_reduction][width], hi[per_reduction][width];
#pragma unroll
    for (int k = 0; k < per_reduction; ++k) {
      detail_select::to_floats<T, width>(low[r * per_reduction + k], lo[k]);
      if constexpr (SummaryRows == 2) detail_select::to_floats<T, width>(high[r * per_reduction + k], hi[k]);
    }
    // Value s x Heads + g: this lane's channels of span s of the reduction, head g.
    const auto partial = [&](int index) {
      const int s = index / Heads, g = index % Heads;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < width; ++j) {
        const float bound = SummaryRows == 2 ? (qc[g][j] >= 0.0f ? hi[s][j] : lo[s][j]) : lo[s][j];
        sum = __fmaf_rn(qc[g][j], bound, sum);  // the host's std::fma, in the same order
      }
      return sum;
    };
    const float total = detail_select::reduce_scatter(partial);  // span lane / Heads, head lane % Heads
    // The group's heads combined in head order, from the span's first lane.
    const int span_lane = lane / Heads * Heads;
    float combined = __shfl_sync(0xffffffffu, total, span_lane);
#pragma unroll
    for (int g = 1; g < Heads; ++g) {
      const float s = __shfl_sync(0xffffffffu, total, span_lane + g);
      if (g < group) combined = p.combine_sum ? __fadd_rn(combined, s) : (s > combined ? s : combined);
    }
    const int span = reduction_first + lane / Heads;
    if (lane % Heads == 0 && span < spans) scores[span] = combined;
  }
}

/// How `score_block_keys_kernel` is launched: spans (threads) per CTA, the copies of the staged
/// queries, each key's stride in shared memory (16-byte chunks, odd) and the dynamic shared
/// memory: kept x copies x heads floats of queries, then a key per thread.
struct block_key_launch {
  int threads;
  int copies;
  int key_stride;
  int shared_bytes;
};

/// The launch of `score_block_keys_kernel` for keys of `key_bytes` (a multiple of 16) in a space
/// of `kept` channels, `heads` (4 or 8) query heads a thread: 128 spans a CTA with 8 copies of
/// the queries (one per lane of a quarter warp, so that a warp's 16-byte loads of random
/// channels fall in distinct banks), halving the copies, then the spans, until it fits
/// `max_shared` bytes. The last, 32 spans and one copy, takes at most 33 KB (kept <= 256, keys
/// of at most 3 x 256 bytes: formats with block keys validate head_dim <= 256), which every
/// device has.
inline block_key_launch plan_block_key_scoring(int kept, int heads, int key_bytes, int max_shared) {
  const int key_stride = (key_bytes / 16) | 1;  // odd: a quarter warp's keys in distinct banks
  const auto bytes = [&](int threads, int copies) { return kept * copies * heads * 4 + threads * key_stride * 16; };
  for (int threads = 128; threads > 32; threads /= 2)
    for (int copies = 8; copies >= 1; copies /= 2)
      if (bytes(threads, copies) <= max_shared) return block_key_launch{threads, copies, key_stride, bytes(threads, copies)};
  return block_key_launch{32, 1, key_stride, bytes(32, 1)};
}

/// Block-key scores (`select::mean_keys` over a format with block keys, e.g. packed_bitmap) of
/// every span, for groups of up to `Heads` query heads (4 or 8), a thread per span. The CTA
/// stages the queries of its first span's segment (q' [kept][Heads], `key_query_copies` copies
/// side by side) and its spans' keys in shared memory (on sm_90 one bulk copy a key, issued by its
/// thread; elsewhere each warp's 32 keys by coalesced 16-byte loads), each span's entry id loaded
/// with the sequence's span count (two dependent round trips before the keys land, not three);
/// then each thread sums q'[channel][g] x value over its key's r pairs in stored order by fused
/// multiply-adds from 0 for each head g of the group (the host's
/// `format_traits::score_block_key`), 16 channels and 8 values a 16-byte load, in whole runs of
/// 16 pairs with no bound check between them (their query loads issue together), and the heads
/// combine in head order. A span in a later segment than the CTA's first reads its queries from
/// global memory (L1). No reduction across lanes, whose shuffles would cost more than the
/// products. Cost per span: its key's bytes from memory, r loads of a channel's Heads queries from
/// shared memory and r x group fused multiply-adds; per CTA, kept x Heads x 4 bytes of queries.
/// Launched as a programmatic dependent of the stream's last kernel, which completes after the
/// one that writes q_key (`q_key_ready` 0: where the grid fits on the device at once,
/// `block_key_source::after_queries`), it stages its keys while that kernel runs and reads q_key
/// only after `wait_for_prior_grid`. Grid: (num_kv_heads,
/// ceil(spans / threads), batch), `plan_block_key_scoring`'s launch.
template <class T, int HeadDim, int Heads>
__global__ void __launch_bounds__(128, 6) score_block_keys_kernel(const select_params p) {
  static_assert(Heads == 4 || Heads == 8, "heads a thread scores: 4 (groups of up to 4) or 8");
  constexpr int quads = Heads / 4;  // 16-byte loads of a channel's heads
  extern __shared__ float4 staged_queries[];  // [kept][copies][quads], then [threads][key_stride] keys
  const int threads = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const bool ready = p.q_key_ready != 0;
  detail::allow_dependent_grids();  // the top-k may be scheduled meanwhile; it reads the scores after this grid
  const int head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.z);
  const int first = static_cast<int>(blockIdx.y) * threads, span = first + tid;
  // The thread's span's entry id, loaded together with the sequence's span count (one round trip,
  // not two): the entry is clamped to the table's row, so the load is in bounds whatever the count.
  const auto entry = min(static_cast<int>(p.entry_of_span.divide(static_cast<std::uint32_t>(span))), p.span_table_stride - 1);
  const auto slot = static_cast<int>(p.entry_of_span.remainder(static_cast<std::uint32_t>(span), static_cast<std::uint32_t>(entry)));
  const std::int32_t id = p.span_tables[static_cast<std::size_t>(b) * p.span_table_stride + entry];
  const int spans = p.span_counts[b];
  if (first >= spans) return;
  const bool live = span < spans;  // else no key of its own: nothing is scored
  const int kept = p.key_kept, copies = p.key_query_copies, r = p.key_retained;
  const auto* head_queries = reinterpret_cast<const float4*>(p.q_key) +
                             (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.segments_per_sequence * kept * quads;
  const int staged_segment = static_cast<int>(p.segment_of_span.divide(static_cast<std::uint32_t>(first)));
  const float4* staged_from = head_queries + static_cast<std::size_t>(staged_segment) * kept * quads;
  const int staged_items = kept * quads;
  const float4 first_queries = ready && tid < staged_items ? __ldg(staged_from + tid) : float4{};
  // The segment's queries (a channel's heads, stored `copies` times side by side below) and the
  // thread's key, at keys + tid x key_stride. The queries are loaded with the keys where they are
  // complete (`ready`), else once the kernel that writes them is done (a launch as its
  // programmatic dependent stages the keys while it runs).
  const std::byte* key = p.bounds + static_cast<std::size_t>(id) * p.bounds_entry_bytes +
                         (static_cast<std::size_t>(head) * p.spans_per_entry + slot) * p.key_bytes;
  const int stride = p.key_stride;
  uint4* keys = reinterpret_cast<uint4*>(staged_queries + kept * copies * quads) + (tid - lane) * stride;
#if KVMOSAIC_HAS_BULK_COPY
  // sm_90: one bulk copy a live thread's key, completing on the CTA's barrier.
  __shared__ std::uint64_t keys_landed;
  if (tid == 0) detail::barrier_init(&keys_landed, static_cast<std::uint32_t>(threads));
  __syncthreads();
  if (live) {
    detail::barrier_arrive_expect(&keys_landed, static_cast<std::uint32_t>(p.key_bytes));
    detail::bulk_copy_to_shared(keys + lane * stride, key, static_cast<std::uint32_t>(p.key_bytes), &keys_landed);
  } else {
    detail::barrier_arrive(&keys_landed);
  }
#else
  // Elsewhere the warp's 32 keys by 16-byte loads: chunk c of key s from item s x chunks + c
  // (consecutive lanes, consecutive chunks), eight loads in flight before their stores. A thread
  // past the end copies its warp's first key (lane 0's span is live where any is).
  const auto* own_key = reinterpret_cast<const std::byte*>(
      __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(key), live ? lane : 0));
  const int chunks = p.key_bytes / 16;
  const auto keys_per_round = static_cast<int>(p.key_of_chunk.divide(32u));  // item += 32 in (key, chunk)
  const auto chunks_past = static_cast<int>(p.key_of_chunk.remainder(32u, static_cast<std::uint32_t>(keys_per_round)));
  auto s = static_cast<int>(p.key_of_chunk.divide(static_cast<std::uint32_t>(lane)));
  auto c = static_cast<int>(p.key_of_chunk.remainder(static_cast<std::uint32_t>(lane), static_cast<std::uint32_t>(s)));
  for (int round = 0; round < chunks && __any_sync(0xffffffffu, live); round += 8) {
    uint4 loaded[8];
    int at[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (round + u < chunks) {  // uniform across the warp
        const auto* from = reinterpret_cast<const uint4*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(own_key), s));
        loaded[u] = __ldg(from + c);
        at[u] = s * stride + c;
        s += keys_per_round;
        c += chunks_past;
        if (c >= chunks) c -= chunks, ++s;
      }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (round + u < chunks) keys[at[u]] = loaded[u];
  }
#endif
  detail::wait_for_prior_grid();
  for (int x = tid; x < staged_items; x += threads) {
    const float4 q = ready && x == tid ? first_queries : __ldg(staged_from + x);
    float4* to = staged_queries + x / quads * copies * quads + x % quads;
    // Copy (k + x) mod copies at step k: a quarter warp's stores in distinct banks.
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (k < copies) to[((k + x) & (copies - 1)) * quads] = q;
  }
  __syncthreads();
#if KVMOSAIC_HAS_BULK_COPY
  detail::barrier_wait(&keys_landed, 0u);
#endif
  if (!live) return;
  const uint4* own = keys + lane * stride;
  const int values_chunk = block_key_layout{r}.values_offset() / 16;
  float sum[Heads] = {};
  // Pair i of a run of 16: q'[channel][heads] x value into the heads' chains.
  const auto add_pair = [&](const auto& queries_of, const std::uint8_t* channel, const T* value, int i) {
    const float x = to_float(value[i % 8]);
    const int c = channel[i];
#pragma unroll
    for (int h = 0; h < quads; ++h) {
      const float4 q = queries_of(c, h);
      sum[4 * h + 0] = __fmaf_rn(q.x, x, sum[4 * h + 0]);  // the host's std::fma
      sum[4 * h + 1] = __fmaf_rn(q.y, x, sum[4 * h + 1]);
      sum[4 * h + 2] = __fmaf_rn(q.z, x, sum[4 * h + 2]);
      sum[4 * h + 3] = __fmaf_rn(q.w, x, sum[4 * h + 3]);
    }
  };
  // Whole runs of 16 pairs without a bound check between them (so their query loads issue
  // together), then the rest pair by pair; the pairs stay in stored order.
  const auto score = [&](const auto& queries_of) {
    int v = 0;
    for (; v + 16 <= r; v += 16) {
      const uint4 channel_bytes = own[v / 16];
      const uint4 value_bits[2] = {own[values_chunk + v / 8], own[values_chunk + v / 8 + 1]};
      const auto* channel = reinterpret_cast<const std::uint8_t*>(&channel_bytes);
#pragma unroll
      for (int i = 0; i < 16; ++i) add_pair(queries_of, channel, reinterpret_cast<const T*>(&value_bits[i / 8]), i);
    }
    if (v < r) {
      const uint4 channel_bytes = own[v / 16];
      const auto* channel = reinterpret_cast<const std::uint8_t*>(&channel_bytes);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (v + 8 * half >= r) break;
        const uint4 value_bits = own[values_chunk + v / 8 + half];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (v + 8 * half + i >= r) break;
          add_pair(queries_of, channel, reinterpret_cast<const T*>(&value_bits), 8 * half + i);
        }
      }
    }
  };
  const auto segment = static_cast<int>(p.segment_of_span.divide(static_cast<std::uint32_t>(span)));
  if (segment == staged_segment) {
    const float4* queries = staged_queries + (lane & (copies - 1)) * quads;
    const int channel_stride = copies * quads;
    score([&](int c, int h) { return queries[c * channel_stride + h]; });
  } else {
    const float4* queries = head_queries + static_cast<std::size_t>(segment) * kept * quads;
    score([&](int c, int h) { return __ldg(queries + c * quads + h); });
  }
  float combined = sum[0];
#pragma unroll
  for (int g = 1; g < Heads; ++g)
    if (g < p.group_size) combined = p.combine_sum ? __fadd_rn(combined, sum[g]) : (sum[g] > combined ? sum[g] : combined);
  p.scores[(static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride + span] = combined;
}

namespace detail_select {
/// An unsigned key with the order of the scores: NaN as -infinity, -0 as +0 (equal scores tie).
__device__ __forceinline__ std::uint32_t order_key(float score) {
  std::uint32_t u = __float_as_uint(score);
  if (score != score) u = 0xff800000u;
  if (score == 0.0f) u = 0u;
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

/// Inclusive prefix sum over a warp of one int per lane.
__device__ __forceinline__ int warp_inclusive_sum(int value) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += below;
  }
  return value;
}

/// Shared memory of `budget_threshold`.
template <int Threads>
struct threshold_storage {
  int histogram[2][256];  ///< a pass's, and the next pass's (zeroed while the pass's is scanned)
  int warp_totals[Threads / 32];
  std::uint32_t digit;
  int remaining;
};

/// Where a budget runs out along the order of n keys (higher first), each item weighing
/// weight_of(i): the key T such that the items above T weigh at most `budget` and those at or
/// above T more. Found 8 bits at a time from the top: per pass a shared-memory histogram of the
/// weights of the items matching the digits so far, then the digit by a prefix sum over the bins
/// from the top (thread t < 256 holds bin 255 - t: eight warps' shuffle scans and their totals).
/// Returns T; `remaining` is the budget left for the items at T (less than their weight). Needs a
/// total weight above the budget. Whole CTA (256 threads or a multiple); three barriers a pass.
template <int Threads, class KeyAt, class WeightOf>
__device__ __forceinline__ std::uint32_t budget_threshold(int n, int budget, const KeyAt& key_at, const WeightOf& weight_of,
                                                          threshold_storage<Threads>& s, int& remaining) {
  static_assert(Threads % 256 == 0, "a thread per radix bin, and more threads over the items");
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  std::uint32_t prefix = 0, mask = 0;
  remaining = budget;
  if (tid < 256) s.histogram[0][tid] = 0;
  __syncthreads();
  for (int pass = 0, shift = 24; shift >= 0; ++pass, shift -= 8) {
    int* histogram = s.histogram[pass & 1];
    for (int i = tid; i < n; i += Threads) {
      const std::uint32_t key = key_at(i);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255u], weight_of(i));
    }
    __syncthreads();  // the pass's histogram is complete
    int weight = 0, at_or_above = 0;
    if (tid < 256) {  // whole warps
      weight = histogram[255 - tid];
      at_or_above = warp_inclusive_sum(weight);
      if (lane == 31) s.warp_totals[warp] = at_or_above;
      s.histogram[(pass + 1) & 1][tid] = 0;  // read last in the pass before, before its last barrier
    }
    __syncthreads();  // the warps' totals
    if (tid < 256) {
      for (int w = 0; w < warp; ++w) at_or_above += s.warp_totals[w];
      if (at_or_above > remaining && at_or_above - weight <= remaining) {
        s.digit = static_cast<std::uint32_t>(255 - tid);
        s.remaining = remaining - (at_or_above - weight);
      }
    }
    __syncthreads();  // the digit (rewritten next pass only after every thread has passed its second barrier)
    prefix |= s.digit << shift;
    remaining = s.remaining;
    mask |= 255u << shift;
  }
  return prefix;
}

}  // namespace detail_select

/// Threads per CTA of the selection kernels: four per radix bin, one CTA per (sequence, KV
/// head) walking its spans 1024 at a time.
inline constexpr int select_threads = 1024;

/// Dynamic shared memory of the selection kernel for sequences of up to `max_pages` pages: their
/// keys, while they and the kernel's `static_bytes` of static shared memory fit the 48 KB every
/// architecture allows without opting in (about 10,800 pages: 690K tokens at pages of 64). Longer
/// sequences re-read their scores from L2 at each pass.
inline int select_shared_bytes(int max_pages, int static_bytes) noexcept {
  return max_pages * 4 + static_bytes <= 48 * 1024 ? max_pages * 4 : 0;
}

/// Pages each lane of `select_pages_kernel` holds the ids of from before the threshold passes on
/// (the ids of a warp's first 8 x 32 pages): a chosen page's id is then in a register when it is
/// written, not a round trip away. Pages past them load their ids when they are written.
inline constexpr int select_prefetched_pages = 8;

/// The top budget_pages[b] pages of each (sequence b, KV head) among its span_counts[b] candidates
/// (a span a page), in sequence order (with live masks, each with its live rows as its row mask).
/// It lets the split kernel, its programmatic dependent, be scheduled at once (the split kernel
/// waits for it before it reads a table); launched itself as the scoring kernel's dependent, it
/// loads its first pages' ids before it waits for the scores. The threshold key by
/// `budget_threshold`; then warp w
/// takes the run of 32 ceil(n / Threads) consecutive pages from w times that, 32 at a time: it
/// counts its chosen pages, and those at the threshold key, by ballots, a scan of the warps'
/// counts (one barrier) places each run, and a second sweep writes the run's chosen pages. Cost
/// per page: its score, read once (kept in shared memory when `keys_in_shared`, else re-read at
/// each pass), up to four histogram increments, two ballots a sweep, and its id.
/// Grid: (batch, num_kv_heads); dynamic shared memory: select_shared_bytes(header[3], ...) (0: keys
/// recomputed from the scores in global memory at each pass).
template <int Threads>
__global__ void __launch_bounds__(Threads) select_pages_kernel(const select_params p, int keys_in_shared) {
  static_assert(Threads % 256 == 0 && Threads <= 1024, "a thread per radix bin, and more threads over the pages");
  constexpr int warps = Threads / 32;
  __shared__ detail_select::threshold_storage<Threads> storage;
  __shared__ int run_ties[warps];  // per warp: its run's pages at the threshold key
  extern __shared__ std::uint32_t shared_keys[];
  detail::allow_dependent_grids();  // the split kernel may be scheduled meanwhile; it reads the tables after this grid
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // The candidates: the first span_counts[b] pages (those before the format's recent window,
  // whose pages are read from their exact rows and whose scores the step does not write).
  const int n = min(p.sealed_pages[b], p.span_counts[b]);
  const int k = min(p.budget_pages[b], n);
  std::int32_t* length = p.live_masks != nullptr ? p.table_lengths + static_cast<std::size_t>(b) * p.num_kv_heads + head : nullptr;
  if (k <= 0) {
    if (length != nullptr && tid == 0) *length = 0;
    return;
  }
  const float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride;
  const std::int32_t* table = p.block_tables + static_cast<std::size_t>(b) * p.step_header[3];
  std::int32_t* out = p.selected + static_cast<std::size_t>(b) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2];
  const int per_lane = (n + Threads - 1) / Threads;  // pages a lane takes in the sweeps
  const int begin = warp * 32 * per_lane + lane;      // this lane's first page; then every 32nd
  std::int32_t page_ids[select_prefetched_pages];
#pragma unroll
  for (int j = 0; j < select_prefetched_pages; ++j) {
    const int i = begin + 32 * j;
    page_ids[j] = j < per_lane && i < n ? table[i] : 0;
  }
  detail::wait_for_prior_grid();  // the scores (a launch as the scoring's programmatic dependent)
  if (keys_in_shared) {
#pragma unroll 8
    for (int i = tid; i < n; i += Threads) shared_keys[i] = detail_select::order_key(scores[i]);  // loads in flight together
    __syncthreads();
  }
  const auto key_at = [&](int i) { return keys_in_shared ? shared_keys[i] : detail_select::order_key(scores[i]); };

  // The key where a budget of k pages runs out, and how many pages with that key the selection
  // takes (the first ones in sequence order; fewer than there are).
  std::uint32_t threshold = 0;
  int ties_to_take = 0;
  if (k < n) threshold = detail_select::budget_threshold(n, k, key_at, [](int) { return 1; }, storage, ties_to_take);
  const bool all = k >= n, ties = !all && ties_to_take > 0;
  // Page begin + 32 j: whether it is above the threshold, or at it (only when some ties are taken).
  const auto above_at = [&](int i) { return i < n && (all || key_at(i) > threshold); };
  const auto tie_at = [&](int i) { return ties && i < n && key_at(i) == threshold; };
  int run_above = 0, run_tied = 0;  // the run's pages above the threshold, and at it
  for (int j = 0; j < per_lane; ++j) {
    const int i = begin + 32 * j;
    run_above += __popc(__ballot_sync(0xffffffffu, above_at(i)));
    if (ties) run_tied += __popc(__ballot_sync(0xffffffffu, tie_at(i)));
  }
  if (lane == 0) {
    storage.warp_totals[warp] = run_above;
    run_ties[warp] = run_tied;
  }
  __syncthreads();
  // Before this warp's run, in sequence order: pages above the threshold, and at it.
  const auto runs_before = [&](const int* per_warp, int& all_runs) {
    const int upto = detail_select::warp_inclusive_sum(lane < warps ? per_warp[lane] : 0);
    all_runs = __shfl_sync(0xffffffffu, upto, 31);
    return warp == 0 ? 0 : __shfl_sync(0xffffffffu, upto, warp - 1);
  };
  int above_total = 0, ties_total = 0;
  int above_before = runs_before(storage.warp_totals, above_total);  // then: before page begin + 32 j
  int ties_before = ties ? runs_before(run_ties, ties_total) : 0;
  const unsigned lanes_before = (1u << lane) - 1u;
  const auto write = [&](int i, std::int32_t id) {
    const bool above = above_at(i), tie = tie_at(i);
    const unsigned above_bits = __ballot_sync(0xffffffffu, above), tie_bits = ties ? __ballot_sync(0xffffffffu, tie) : 0u;
    const int tie_rank = ties_before + __popc(tie_bits & lanes_before);
    if (above || (tie && tie_rank < ties_to_take)) {
      const int at = above_before + __popc(above_bits & lanes_before) + min(tie_rank, ties_to_take);
      out[at] = id;
      if (p.live_masks != nullptr) {  // every row of a chosen page that is still live
        const std::size_t entry = static_cast<std::size_t>(out - p.selected) + at;
        const std::uint32_t* live = p.live_masks + (static_cast<std::size_t>(b) * p.step_header[3] + i) * p.mask_words;
        for (int w = 0; w < p.mask_words; ++w) p.token_masks[entry * p.mask_words + w] = live[w];
      }
    }
    above_before += __popc(above_bits);
    ties_before += __popc(tie_bits);
  };
#pragma unroll
  for (int j = 0; j < select_prefetched_pages; ++j)
    if (j < per_lane) write(begin + 32 * j, page_ids[j]);
  for (int j = select_prefetched_pages; j < per_lane; ++j) {
    const int i = begin + 32 * j;
    write(i, i < n ? table[i] : 0);
  }
  if (length != nullptr && tid == 0) *length = above_total + min(ties_total, ties_to_take);
}

namespace detail_select {
/// Sets the row-mask bits of tokens [from, to) of a sequence whose page p's mask is
/// marks[p * words .. (p + 1) * words): one atomicOr per word touched.
__device__ __forceinline__ void mark_rows(std::uint32_t* marks, int words, int page_size, int from, int to) {
  for (int t = from; t < to;) {
    const int page = t / page_size, row = t % page_size;
    const int word_end = min((row / 32 + 1) * 32, page_size);
    const int n = min(to - t, word_end - row);
    const std::uint32_t bits = (n == 32 ? ~0u : ((1u << n) - 1u)) << (row % 32);
    atomicOr(&marks[page * words + row / 32], bits);
    t += n;
  }
}
}  // namespace detail_select

/// Dynamic shared memory of `select_spans_kernel` to cache the keys and token counts of `spans`
/// spans (6 bytes each), and to hold the row marks of `pages` pages of `mask_words` words.
__host__ __device__ inline int span_select_shared_bytes(int spans) noexcept { return (spans * 6 + 15) / 16 * 16; }
__host__ __device__ inline int span_marks_shared_bytes(int pages, int mask_words) noexcept { return pages * mask_words * 4; }

/// The token-granular selection of each (sequence b, KV head): sub-page `select::quest` blocks or
/// `select::sentence_chunks` chunks. It takes the longest prefix of the spans' score order (higher
/// first, ties to the lower index) whose token counts fit budget_tokens[b] (the host's
/// `detail::budget_prefix`), by a radix select whose histograms count tokens rather than spans
/// (4 passes of 8 bits; the spans at the threshold key then go in index order by a block scan).
/// It marks the rows of the chosen spans and every sealed row from always_from[b] on, per page,
/// then writes the pages with a marked row, in sequence order, with their row masks: the split
/// kernels' table (`table_lengths` entries). Each span's key and token count are read from
/// global memory once, into shared memory, when `cached` (dynamic shared memory:
/// span_select_shared_bytes(spans)); else re-read at each pass. The marks are shared memory
/// after those when `shared_marks` (span_marks_shared_bytes(pages, mask_words) more), else
/// `p.marks`. Like `select_pages_kernel`, it lets the split kernel be scheduled at once.
/// Grid: (batch, num_kv_heads).
template <int Threads>
__global__ void __launch_bounds__(Threads) select_spans_kernel(const select_params p, int cached, int shared_marks) {
  using scan = cub::BlockScan<int, Threads>;
  __shared__ detail_select::threshold_storage<Threads> storage;
  __shared__ typename scan::TempStorage scan_storage;
  __shared__ int shared_total;
  detail::allow_dependent_grids();  // the split kernel may be scheduled meanwhile; it reads the tables after this grid
  const int b = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  const int n = p.span_counts[b], sealed = p.sealed_pages[b], words = p.mask_words;
  const int sealed_tokens = sealed * p.page_size;
  const int budget = max(p.budget_tokens[b], 0);
  const float* scores = p.scores + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.score_stride;
  const auto range = [&](int i) {
    if (p.span_tokens > 0) return make_int2(i * p.span_tokens, (i + 1) * p.span_tokens);
    const int entry = p.span_tables[static_cast<std::size_t>(b) * p.span_table_stride + i / p.spans_per_entry];
    return p.span_ranges[static_cast<std::size_t>(entry) * p.spans_per_entry + i % p.spans_per_entry];
  };
  // [n] keys, then [n] 16-bit token counts when cached; then the marks when shared.
  extern __shared__ __align__(16) std::uint32_t span_keys[];
  auto* span_tokens = reinterpret_cast<std::uint16_t*>(span_keys + (cached ? n : 0));
  std::uint32_t* marks = shared_marks ? span_keys + (cached ? span_select_shared_bytes(n) / 4 : 0)
                                      : p.marks + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * p.step_header[3] * words;
  for (int i = tid; i < sealed * words; i += Threads) marks[i] = 0u;
  if (tid == 0) shared_total = 0;
  int mine = 0;
  if (cached) {
#pragma unroll 16
    for (int i = tid; i < n; i += Threads) {  // independent loads: many in flight per thread
      const int2 r = range(i);
      span_keys[i] = detail_select::order_key(scores[i]);
      span_tokens[i] = static_cast<std::uint16_t>(r.y - r.x);
      mine += r.y - r.x;
    }
  } else {
    for (int i = tid; i < n; i += Threads) {
      const int2 r = range(i);
      mine += r.y - r.x;
    }
  }
  __syncthreads();  // marks are zero before anything is marked; the total starts at 0; keys cached
  atomicAdd(&shared_total, mine);
  __syncthreads();
  const bool take_all = shared_total <= budget;
  const auto key_at = [&](int i) { return cached ? span_keys[i] : detail_select::order_key(scores[i]); };
  const auto tokens_of = [&](int i) {
    if (cached) return static_cast<int>(span_tokens[i]);
    const int2 r = range(i);
    return r.y - r.x;
  };

  // The threshold key: the spans above it fit the budget, and adding all those at it would not.
  std::uint32_t threshold = 0;
  int remaining = budget;
  if (!take_all) threshold = detail_select::budget_threshold(n, budget, key_at, tokens_of, storage, remaining);
  // Mark the chosen spans: those above the threshold, and the longest run of those at it (in
  // index order) that fits what is left of the budget.
  int ties_before = 0;
  for (int base = 0; base < n; base += Threads) {
    const int i = base + tid;
    const std::uint32_t key = i < n ? key_at(i) : 0u;
    const int tokens = i < n ? tokens_of(i) : 0;
    const bool is_tie = !take_all && i < n && key == threshold;
    int tie_tokens_before = 0, tie_tokens = 0;
    scan(scan_storage).ExclusiveSum(is_tie ? tokens : 0, tie_tokens_before, tie_tokens);
    const bool chosen = i < n && (take_all || key > threshold ||
                                  (is_tie && ties_before + tie_tokens_before + tokens <= remaining));
    if (chosen) {
      const int2 r = range(i);
      detail_select::mark_rows(marks, words, p.page_size, r.x, min(r.y, sealed_tokens));
    }
    ties_before += tie_tokens;
    __syncthreads();  // the scan storage is reused
  }
  // The always-read rows, 32 tokens per thread and turn.
  const int always_from = max(p.always_from[b], 0);
  for (int t = always_from / 32 * 32 + tid * 32; t < sealed_tokens; t += Threads * 32)
    detail_select::mark_rows(marks, words, p.page_size, max(t, always_from), min(t + 32, sealed_tokens));
  __syncthreads();  // every mark is in

  // The pages with a marked row, in sequence order, with their masks.
  const std::size_t out_row = static_cast<std::size_t>(b) * p.step_header[1] + static_cast<std::size_t>(head) * p.step_header[2];
  int written = 0;
  for (int base = 0; base < sealed; base += Threads) {
    const int i = base + tid;
    std::uint32_t any = 0;
    if (i < sealed)
      for (int w = 0; w < words; ++w) {
        if (p.live_masks != nullptr)  // evicted rows are never read
          marks[i * words + w] &= p.live_masks[(static_cast<std::size_t>(b) * p.step_header[3] + i) * words + w];
        any |= marks[i * words + w];
      }
    int position = 0, count = 0;
    scan(scan_storage).ExclusiveSum(any != 0 ? 1 : 0, position, count);
    if (any != 0) {
      const std::size_t entry = out_row + written + position;
      p.selected[entry] = p.block_tables[static_cast<std::size_t>(b) * p.step_header[3] + i];
      for (int w = 0; w < words; ++w) p.token_masks[entry * words + w] = marks[i * words + w];
    }
    written += count;
    __syncthreads();
  }
  if (tid == 0) p.table_lengths[static_cast<std::size_t>(b) * p.num_kv_heads + head] = written;
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
  std::byte* bounds;                  ///< [max_pages][num_kv_heads][blocks per page][summary rows]
  std::int64_t bounds_page_bytes;
  int block_tokens;                   ///< tokens per block: the page size, or a multiple of 8 dividing it
};

/// The summary of the keys of each block of each new page, per KV head: with `Mean` the mean row
/// (`select::mean_keys`: an fp32 sum in token order divided by the count, the host's
/// `store_mean_key` to the bit), else the channel-wise min and max rows (`select::quest`, the
/// host's `store_key_bounds`). Grid: (n, num_kv_heads, blocks per page), one thread per channel.
template <class T, int HeadDim, bool Mean = false>
__global__ void __launch_bounds__(HeadDim) page_bounds_kernel(const bounds_params p) {
  const int i = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), c = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.z), blocks = static_cast<int>(gridDim.z);
  const T* rows = reinterpret_cast<const T*>(p.rows + static_cast<std::size_t>(p.row_slots[i]) * p.rows_slot_bytes +
                                             static_cast<std::size_t>(head) * p.rows_head_bytes) +
                  static_cast<std::size_t>(block) * p.block_tokens * HeadDim;
  if constexpr (Mean) {
    float sum = 0.0f;
    for (int t = 0; t < p.block_tokens; ++t) sum = __fadd_rn(sum, to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]));
    T* out = reinterpret_cast<T*>(p.bounds + static_cast<std::size_t>(p.new_pages[i]) * p.bounds_page_bytes) +
             (static_cast<std::size_t>(head) * blocks + block) * HeadDim;
    out[c] = T(__fdiv_rn(sum, static_cast<float>(p.block_tokens)));
    return;
  }
  float lo = to_float(rows[c]), hi = lo;
  for (int t = 1; t < p.block_tokens; ++t) {
    const float x = to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]);
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
  }
  T* out = reinterpret_cast<T*>(p.bounds + static_cast<std::size_t>(p.new_pages[i]) * p.bounds_page_bytes) +
           (static_cast<std::size_t>(head) * blocks + block) * 2 * HeadDim;
  out[c] = T(lo);  // exact: lo and hi are stored values
  out[HeadDim + c] = T(hi);
}

}  // namespace kvmosaic::cuda::kernel
