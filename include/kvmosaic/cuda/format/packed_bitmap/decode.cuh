// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The split kernels of `format::packed_bitmap` (MosaicKV's PackedAttention, section 5.3). Per
/// segment of the pages a split reads, the CTA rotates the group's queries once into the
/// segment's K basis, scores the records in the rotated space (no K tile in global memory),
/// accumulates p.v in the rotated V space and rotates the segment's merged output back once, into
/// the split's state in head_dim space. The engine's plan keeps a `select::all` split within one
/// segment (one rotation each way per split); a selection's pages may span several. Two kernels:
/// on sm_90, `decode_partial_packed_mma_kernel` streams the pages by bulk copies and each warp
/// gathers its MMA fragments straight from the records (`packed_key_rows`, `packed_value_rows`);
/// elsewhere (sm_75+),
/// `decode_partial_packed_kernel` scores on CUDA cores from records staged by `cp.async`. The
/// partials merge with `merge_splits_kernel`.

#include <cstddef>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kvmosaic/cuda/collective/page_attend.cuh"
#include "kvmosaic/cuda/collective/warp_attend_mma.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/rows.cuh"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// packed_bitmap's fields of its split kernels' params.
struct packed_decode_params {
  const std::byte* segments;   ///< [max_sequences][segments_per_sequence][num_kv_heads] entries (`packed_entry`)
  std::int32_t* page_segments; ///< [max_pages] the segment (of its sequence) each page was sealed in
  std::int64_t entry_bytes;
  int segments_per_sequence;
  int segment_pages;           ///< pages per segment
  int kept;                    ///< channels of the rotated space
  int words;                   ///< bitmap words per record of a page slot (its stride)
  int retained;                ///< 16-bit values per record of a page slot (its stride)
  std::int64_t bitmap_bytes;   ///< the bitmaps of a page (page_size x words x 4): values follow
  int stages;                  ///< sm_90 kernel: slots in flight per CTA (0: the portable kernel)
  int slot_pages;              ///< sm_90 kernel: pages a slot holds (`packed_slot_pages`)
  /// The step's unscaled queries in each segment's K basis, when a selection stage computed them
  /// for its block keys (`packed_block_queries_kernel`: [batch][num_kv_heads][segments_per_sequence]
  /// [kept][step_query_heads], the same bits the sm_90 kernel's own rotation gives), else null.
  const float* step_queries;
  int step_query_heads;
};

/// Pages one slot of the sm_90 packed kernel holds: 64 / page_size for pages of 16 and 32 tokens,
/// so that each of its 4 warps folds 16 rows of a slot whatever the page size (a selection of
/// whole small pages reads only the blocks it chose, every warp busy); else 1.
constexpr int packed_slot_pages(int page_size) { return page_size == 16 || page_size == 32 ? 64 / page_size : 1; }

/// The most pages a split of the sm_90 kernel with slots of several small pages reads: it lists
/// their ids and segments in shared memory (8 bytes a page), and the split plan cuts no longer
/// split for it (`device_format::max_pages_per_split`).
inline constexpr int packed_listed_pages = 512;

/// One segment of one KV head on the device: B_k ([head_dim][kept] fp32, rotates a query in),
/// B_v transposed ([kept][head_dim] fp32, rotates an output back), then r and g of K and of V.
/// `entry_bytes` = 2 x head_dim x kept x 4 + 16.
struct packed_entry {
  const float* k_basis;
  const float* v_basis_t;
  int retained[2];
  int group[2];

  __host__ __device__ static std::int64_t bytes(int head_dim, int kept) {
    return 2 * static_cast<std::int64_t>(head_dim) * kept * 4 + 16;
  }
  __device__ static packed_entry at(const packed_decode_params& f, int head_dim, int num_kv_heads, int slot, int segment,
                                    int head) {
    const std::byte* base = f.segments + ((static_cast<std::int64_t>(slot) * f.segments_per_sequence + segment) * num_kv_heads + head) *
                                             f.entry_bytes;
    const std::int64_t basis = static_cast<std::int64_t>(head_dim) * f.kept;
    const auto* strategy = reinterpret_cast<const std::int32_t*>(base + 2 * basis * 4);
    return packed_entry{reinterpret_cast<const float*>(base), reinterpret_cast<const float*>(base) + basis,
                        {strategy[0], strategy[2]}, {strategy[1], strategy[3]}};
  }
};

/// Shared memory of the packed kernel: the rotated queries ([kept][Group] fp32), a tile's
/// probabilities ([64][Group]), a segment's merged rotated output ([Group][HeadDim]), the split's
/// state in head_dim space (o [Group][HeadDim], then m, l, the segment's m, l and two warps'
/// partial sums of p, [Group] each), and a tile's K and V records (the bitmaps as stored, at most
/// head_dim / 32 words a token; the values at a padded stride, `padded_values`), whose space the
/// warps' reduction and the tail's reuse.
template <int HeadDim, int Group, int Rows>
struct packed_decode_layout {
  static constexpr int tile_tokens = 64;
  static constexpr int warps = 4;
  static constexpr int query_offset = 0;
  static constexpr int p_offset = query_offset + HeadDim * Group * 4;
  static constexpr int output_offset = p_offset + tile_tokens * Group * 4;
  static constexpr int split_offset = output_offset + Group * HeadDim * 4;
  static constexpr int records_offset = (split_offset + Group * (HeadDim + 6) * 4 + 15) / 16 * 16;
  static constexpr int reduction_bytes = static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>)) >
                                                 warps * Group * HeadDim * 4
                                             ? static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>))
                                             : warps * Group * HeadDim * 4;
  /// One stage: a tile's K records, then its V records, each the bitmaps (`words` a token) and
  /// the values at a stride of `padded_values(retained)`.
  __host__ __device__ static constexpr int stage_bytes(int words, int retained) {
    return 2 * tile_tokens * (words * 4 + ((retained + 1) / 2 * 2 + 2) * 2);
  }
  /// The dynamic shared memory of a launch for a slot of `words` and `retained`.
  __host__ __device__ static constexpr int bytes(int words, int retained) {
    return records_offset + (2 * stage_bytes(words, retained) > reduction_bytes ? 2 * stage_bytes(words, retained) : reduction_bytes);
  }
};

namespace detail_packed {

/// Token t's record of a K or V page: its bitmap words and its 16-bit values.
struct record {
  const std::uint32_t* bits;
  const std::uint16_t* values;
};
__device__ __forceinline__ record record_of(const packed_decode_params& f, const std::byte* page, int t) {
  return record{reinterpret_cast<const std::uint32_t*>(page) + static_cast<std::size_t>(t) * f.words,
                reinterpret_cast<const std::uint16_t*>(page + f.bitmap_bytes) + static_cast<std::size_t>(t) * f.retained};
}

/// Starts copying `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared
/// memory, the CTA's threads striding over 16-byte words (`detail::async_copy`: in flight until
/// `detail::async_copy_wait`).
template <int Threads>
__device__ __forceinline__ void copy_to_shared(const std::byte* from, std::byte* to, int bytes) {
  for (int i = static_cast<int>(threadIdx.x); i < bytes / 16; i += Threads)
    detail::async_copy<16>(to + static_cast<std::size_t>(i) * 16, from + static_cast<std::size_t>(i) * 16);
}

/// Starts copying the values of `n` records (`retained` 16-bit values each, contiguous in global
/// memory) to shared memory with a record stride of `padded_values(retained)` values: whole
/// 32-bit words and one more, so the threads that read one record each, at about the same
/// offset, hit different banks.
__host__ __device__ constexpr int padded_values(int retained) { return (retained + 1) / 2 * 2 + 2; }
template <int Threads>
__device__ __forceinline__ void copy_values_padded(const std::byte* from, std::uint16_t* to, int n, int retained) {
  const int stride = padded_values(retained);
  if (retained % 2 == 0) {
    const int words = retained / 2;
    for (int i = static_cast<int>(threadIdx.x); i < n * words; i += Threads)
      detail::async_copy<4>(reinterpret_cast<std::uint32_t*>(to) + i / words * (stride / 2) + i % words,
                            reinterpret_cast<const std::uint32_t*>(from) + i);
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < n * retained; i += Threads)
      to[i / retained * stride + i % retained] = __ldg(reinterpret_cast<const std::uint16_t*>(from) + i);
  }
}

/// The group's logits of one token: q' . y^ over its record's set bits (groups of `G` channels),
/// q' the rotated, pre-scaled queries in shared memory ([kept][Group]). Cost: r x Group FMAs and
/// one pass over the bitmap.
template <class T, int Group, int G>
__device__ __forceinline__ void score_record(const std::uint32_t* bits, const std::uint16_t* values, int words,
                                             const float* q_rotated, float (&logit)[Group]) {
#pragma unroll
  for (int g = 0; g < Group; ++g) logit[g] = 0.0f;
  int at = 0;
  for (int w = 0; w < words; ++w)
    for (std::uint32_t word = bits[w]; word != 0; word &= word - 1) {
      const int j = w * 32 + __ffs(static_cast<int>(word)) - 1;
#pragma unroll
      for (int i = 0; i < G; ++i, ++at) {
        const float value = to_float(T::from_bits(values[at]));
        const float* q = q_rotated + (j * G + i) * Group;
#pragma unroll
        for (int g = 0; g < Group; ++g) logit[g] = fmaf(q[g], value, logit[g]);
      }
    }
}

/// One token's p.v into a lane's accumulators: lane l owns the rotated channels c = 32 k + l; in
/// groups of `G` channels, channel c is bit (c / G) mod 32 of bitmap word k / G (G divides 32),
/// and its value's index is G x (the set bits before its group) + c mod G. Channels from `kept`
/// on are not stored. Cost per lane: head_dim / 32 bit tests and popcounts, Group FMAs per set one.
template <class T, int HeadDim, int Group, int G>
__device__ __forceinline__ void accumulate_record(const std::uint32_t* bits, const std::uint16_t* values, int words, int kept,
                                                  int lane, const float (&p)[Group], float (&acc)[HeadDim / 32][Group]) {
  constexpr int lane_channels = HeadDim / 32;
  constexpr int word_count = (lane_channels + G - 1) / G;  // the words the lane's channels lie in
  std::uint32_t word[word_count];
  int below[word_count];
  int count = 0;
#pragma unroll
  for (int x = 0; x < word_count; ++x) {
    word[x] = x < words ? bits[x] : 0u;
    below[x] = count;
    count += __popc(word[x]);
  }
#pragma unroll
  for (int k = 0; k < lane_channels; ++k) {
    const int c = k * 32 + lane, b = (c / G) & 31;
    const std::uint32_t wk = word[k / G];
    if (c < kept && ((wk >> b) & 1u) != 0) {
      const int at = (below[k / G] + __popc(wk & ((1u << b) - 1u))) * G + c % G;
      const float value = to_float(T::from_bits(values[at]));
#pragma unroll
      for (int g = 0; g < Group; ++g) acc[k][g] = fmaf(p[g], value, acc[k][g]);
    }
  }
}

/// f(std::integral_constant<int, shift>) for a group size of 2^shift channels (shift 0, 1, 2).
template <class F>
__device__ __forceinline__ decltype(auto) with_shift(int shift, F&& f) {
  if (shift == 0) return f(std::integral_constant<int, 0>{});
  if (shift == 1) return f(std::integral_constant<int, 1>{});
  return f(std::integral_constant<int, 2>{});
}

/// Calls f(std::integral_constant<int, g>) for a group size g of 1, 2 or 4.
template <class F>
__device__ __forceinline__ void with_group(int group, F&& f) {
  if (group == 1) f(std::integral_constant<int, 1>{});
  else if (group == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 4>{});
}

/// A packed split's state in head_dim space in shared memory (o [Group][HeadDim], then m, l) and
/// the (m, l) of the segment being merged into it ([Group] each, after l): `Group x (HeadDim + 4)`
/// floats from `o` on. Every thread of the CTA calls its members.
template <int HeadDim, int Group, int Threads>
struct split_state {
  float* o;
  __device__ __forceinline__ float* m() const { return o + Group * HeadDim; }
  __device__ __forceinline__ float* l() const { return m() + Group; }
  __device__ __forceinline__ float* segment_m() const { return l() + Group; }
  __device__ __forceinline__ float* segment_l() const { return segment_m() + Group; }

  /// The empty state. A barrier must follow before it is read.
  __device__ __forceinline__ void start() const {
    for (int index = static_cast<int>(threadIdx.x); index < Group * HeadDim; index += Threads) o[index] = 0.0f;
    if (threadIdx.x < Group) {
      m()[threadIdx.x] = -HUGE_VALF;
      l()[threadIdx.x] = 0.0f;
    }
  }

  /// Merges a segment's output into the state: o_seg = rotated B_v^T (`rotated`: [Group][HeadDim]
  /// in shared memory, its first `kept` channels; `basis` B_v transposed, [kept][HeadDim], or null
  /// for an output already in head_dim space) with the segment's (m, l). A thread takes output
  /// channels c for every head, so each basis element is loaded once (coalesced along c) and used
  /// Group times. Cost: Group x head_dim x kept FMAs, head_dim x kept loads, one barrier; a
  /// barrier must follow before the state is read.
  __device__ __forceinline__ void merge_segment(const float* rotated, const float* basis, int kept) const {
    for (int c = static_cast<int>(threadIdx.x); c < HeadDim; c += Threads) {
      float out[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) out[g] = basis == nullptr ? rotated[g * HeadDim + c] : 0.0f;
      if (basis != nullptr) {
#pragma unroll 32
        for (int j = 0; j < kept; ++j) {
          const float b = __ldg(basis + j * HeadDim + c);
#pragma unroll
          for (int g = 0; g < Group; ++g) out[g] = fmaf(rotated[g * HeadDim + j], b, out[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < Group; ++g) {
        softmax_state<float> split{m()[g], l()[g]};
        const merge_weights<float> mw = split.merge(softmax_state<float>{segment_m()[g], segment_l()[g]});
        o[g * HeadDim + c] = o[g * HeadDim + c] * mw.self + out[g] * mw.other;
      }
    }
    __syncthreads();  // every thread has read m and l
    if (threadIdx.x < Group) {
      softmax_state<float> split{m()[threadIdx.x], l()[threadIdx.x]};
      split.merge(softmax_state<float>{segment_m()[threadIdx.x], segment_l()[threadIdx.x]});
      m()[threadIdx.x] = split.m;
      l()[threadIdx.x] = split.l;
    }
  }

  /// The split's partial: o / l and its log-sum-exp (an empty split, every row masked, writes the
  /// empty state, which merges as nothing). After a barrier.
  __device__ __forceinline__ void write(const decode_params& p, int work_index, int head) const {
    const int num_q_heads = p.num_kv_heads * Group;
    const std::size_t partial_base = static_cast<std::size_t>(work_index) * num_q_heads + head * Group;
    for (int index = static_cast<int>(threadIdx.x); index < Group * HeadDim; index += Threads) {
      const int g = index / HeadDim;
      const softmax_state<float> split{m()[g], l()[g]};
      p.partial_o[(partial_base + g) * HeadDim + index % HeadDim] = split.l > 0.0f ? o[index] / split.l : 0.0f;
      if (index % HeadDim == 0) p.partial_lse[partial_base + g] = split.log_sum_exp();
    }
  }
};

}  // namespace detail_packed

/// The packed_bitmap split kernel (sm_75+). Grid: (splits capacity, num_kv_heads); 128 threads.
/// Per segment of the split's pages: q' = scale x q B_k (Group x head_dim x kept FMAs). Per
/// 64-token tile the CTA stages the K and V records in shared memory as stored (coalesced), one
/// thread per token scores its K record on its set bits, the tile's softmax step is taken once
/// for the CTA, and each warp accumulates p.v for a quarter of the tokens straight from the V
/// records: lane l owns the rotated channels l, l + 32, ..., finds its bit in the token's bitmap
/// and its value by the popcount of the bits below it (no dense tile: r x Group FMAs a token). At
/// the segment's end (`leave_segment`) the warps' accumulators add up in shared memory and o =
/// o' B_v^T (Group x head_dim x kept FMAs) merges into the split's state in head_dim space. A
/// split without pages reads the exact rows and the tail, dense, as `decode_partial_kernel`.
template <class T, int HeadDim, int Group, int Threads, int Unroll, bool Logits = false>
__global__ void __launch_bounds__(Threads) decode_partial_packed_kernel(const split_params<packed_decode_params> p) {
  static_assert(Threads == 128, "the packed kernel runs 4 warps");
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  constexpr int rows = collective::rows;
  using layout = packed_decode_layout<HeadDim, Group, rows>;
  constexpr int tile = layout::tile_tokens, warps = layout::warps;
  constexpr int lane_channels = HeadDim / 32;  // rotated channels a lane owns: kept <= head_dim
  extern __shared__ __align__(16) std::byte packed_shared[];
  float* q_rotated = reinterpret_cast<float*>(packed_shared + layout::query_offset);
  float* tile_p = reinterpret_cast<float*>(packed_shared + layout::p_offset);  // [tile][Group]
  float* o_rotated = reinterpret_cast<float*>(packed_shared + layout::output_offset);
  const detail_packed::split_state<HeadDim, Group, Threads> split{reinterpret_cast<float*>(packed_shared + layout::split_offset)};
  float* segment_m = split.segment_m();  // the segment's running (m, l), [Group] each
  float* segment_l = split.segment_l();
  float* rescale = segment_l + Group;  // the tile's partial sums of p, [2][Group]
  std::byte* records = packed_shared + layout::records_offset;  // two stages of a tile's K and V records
  float* warp_o = reinterpret_cast<float*>(records);  // [warps][Group][HeadDim], after a segment's tiles

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  // `Logits`: a step with token scores; each row's scaled logit (-inf where masked) at
  // split_logits[(row of the split's read order) x Group + head of the group].
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;

  if (range.begin == range.end) {  // the exact rows and the tail rows, dense, in head_dim space
    thread_state<Group> s;
    detail_decode::start_state<HeadDim, Group, collective::lanes_per_row>(p, w, head, s);
    if (w.with_tail) {
      const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
      const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                              static_cast<std::size_t>(run.first) * HeadDim * 2;
      collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s, nullptr,
                       split_logits);
    }
    detail_decode::write_partial<HeadDim, Group, Threads, collective::lanes_per_row>(
        p, work_index, head, s, *reinterpret_cast<decode_temp_storage<Group, HeadDim, rows>*>(records));
    return;
  }

  const packed_decode_params& f = p.format;
  const int kept = f.kept, slot_index = p.tail_slots[w.batch_index];
  const int stride = detail_packed::padded_values(f.retained);
  const int stage_bytes = layout::stage_bytes(f.words, f.retained);
  const int num_q_heads = p.num_kv_heads * Group;
  const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group) * HeadDim;
  split.start();
  float acc[lane_channels][Group];  // this warp's p.v for the lane's channels, relative to segment_m
#pragma unroll
  for (int k = 0; k < lane_channels; ++k)
#pragma unroll
    for (int g = 0; g < Group; ++g) acc[k][g] = 0.0f;

  // Enters a segment: q' = scale x q B_k, [kept][Group], a thread per rotated channel j for every
  // head (each element of B_k loaded once, coalesced along j), and an empty state.
  const auto enter_segment = [&](const packed_entry& segment) {
    for (int j = tid; j < kept; j += Threads) {
      float dot[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) dot[g] = 0.0f;
#pragma unroll 16
      for (int c = 0; c < HeadDim; ++c) {
        const float b = __ldg(segment.k_basis + c * kept + j);
#pragma unroll
        for (int g = 0; g < Group; ++g) dot[g] = fmaf(__ldg(q + g * HeadDim + c), b, dot[g]);
      }
#pragma unroll
      for (int g = 0; g < Group; ++g) q_rotated[j * Group + g] = dot[g] * p.softmax_scale;
    }
    if (tid < Group) {
      segment_m[tid] = -HUGE_VALF;
      segment_l[tid] = 0.0f;
    }
    __syncthreads();
  };
  // The warps' accumulators to shared memory (the records' space: every thread calls it after
  // the last tile's barrier), and zero. Not in a lambda: `acc` stays in registers.
#define KVMOSAIC_PACKED_STORE_ACCUMULATORS()                                                   \
  do {                                                                                          \
    _Pragma("unroll") for (int k = 0; k < lane_channels; ++k) {                                \
      _Pragma("unroll") for (int g = 0; g < Group; ++g) {                                      \
        warp_o[(warp * Group + g) * HeadDim + k * 32 + lane] = acc[k][g];                      \
        acc[k][g] = 0.0f;                                                                       \
      }                                                                                         \
    }                                                                                           \
  } while (false)
  // Leaves a segment: the warps' accumulators (in warp_o) added up (rotated V space), rotated
  // back once and merged into the split's state.
  const auto leave_segment = [&](const packed_entry& segment) {
    __syncthreads();
    for (int index = tid; index < Group * kept; index += Threads) {
      const int g = index / kept, c = index % kept;
      float o = 0.0f;
#pragma unroll
      for (int v = 0; v < warps; ++v) o += warp_o[(v * Group + g) * HeadDim + c];
      o_rotated[g * HeadDim + c] = o;
    }
    __syncthreads();
    split.merge_segment(o_rotated, segment.v_basis_t, kept);
    __syncthreads();
  };

  // The split's pages segment by segment, in increasing order: a selection's page list may
  // interleave segments, and each entry and exit costs a rotation.
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  for (int current = -1;;) {
    int next = INT_MAX;
    for (int i = range.begin; i < range.end; ++i) {
      const int page_segment = f.page_segments[table[i]];
      if (page_segment > current && page_segment < next) next = page_segment;
    }
    if (next == INT_MAX) break;
    current = next;
    const packed_entry segment = packed_entry::at(f, HeadDim, p.num_kv_heads, slot_index, current, head);
    enter_segment(segment);
    const int k_words = (kept / segment.group[0] + 31) / 32, v_words = (kept / segment.group[1] + 31) / 32;
    // The segment's tiles (entry i, first row), the next one's records in flight while a tile is
    // folded: two stages of K and V records.
    const auto next_entry = [&](int i) {
      while (i < range.end && f.page_segments[table[i]] != current) ++i;
      return i;
    };
    const auto stage_tile = [&](int i, int first, int stage) {
      const std::byte* slot = p.pages + static_cast<std::size_t>(table[i]) * p.page_slot_bytes;
      const std::byte* k_page = slot + head * p.k_page_bytes;
      const std::byte* v_page = slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes;
      const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
      std::byte* k_stage = records + stage * stage_bytes;
      std::byte* v_stage = k_stage + stage_bytes / 2;
      const int n = min(tile, p.page_size - first);
      // The bitmaps as stored, the values at a padded stride (`copy_values_padded`), 16 rows at a
      // time, skipping the blocks of 16 rows a selection's row masks leave out entirely (their
      // logits are -inf and their p 0 below).
      for (int block = 0; block < n; block += 16) {
        if (detail_decode::sixteen_rows_read(rows_read, first + block) == 0) continue;
        const std::size_t row = static_cast<std::size_t>(first + block);
        for (int which = 0; which < 2; ++which) {
          const std::byte* page = which == 0 ? k_page : v_page;
          std::byte* to = which == 0 ? k_stage : v_stage;
          detail_packed::copy_to_shared<Threads>(page + row * f.words * 4, to + block * f.words * 4, 16 * f.words * 4);
          detail_packed::copy_values_padded<Threads>(page + f.bitmap_bytes + row * f.retained * 2,
                                                     reinterpret_cast<std::uint16_t*>(to + tile * f.words * 4) + block * stride, 16,
                                                     f.retained);
        }
      }
      detail::async_copy_commit();
    };
    int i = next_entry(range.begin), first = 0, stage = 0;
    if (i < range.end) stage_tile(i, 0, 0);
    while (i < range.end) {
      int next_i = i, next_first = first + tile;
      if (next_first >= p.page_size) {
        next_i = next_entry(i + 1);
        next_first = 0;
      }
      if (next_i < range.end) {
        stage_tile(next_i, next_first, stage ^ 1);
        detail::async_copy_wait<1>();  // this tile's copies are done, the next tile's in flight
      } else {
        detail::async_copy_wait<0>();
      }
      __syncthreads();
      const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
      const int n = min(tile, p.page_size - first);
      const std::byte* k_records = records + stage * stage_bytes;
      const std::byte* v_records = k_records + stage_bytes / 2;
      const auto* k_values = reinterpret_cast<const std::uint16_t*>(k_records + tile * f.words * 4);
      const auto* v_values = reinterpret_cast<const std::uint16_t*>(v_records + tile * f.words * 4);
      // Logits, one thread per token (tile <= 64: warps 0 and 1).
      float logit[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) logit[g] = -HUGE_VALF;
      if (tid < n) {
        const int row = first + tid;
        if (rows_read == nullptr || ((rows_read[row >> 5] >> (row & 31)) & 1u) != 0)
          detail_packed::with_group(segment.group[0], [&](auto g) {
            detail_packed::score_record<T, Group, decltype(g)::value>(reinterpret_cast<const std::uint32_t*>(k_records) + tid * f.words,
                                                                      k_values + tid * stride, k_words, q_rotated, logit);
          });
        if (Logits && split_logits != nullptr) {
          float* at = split_logits + (static_cast<std::size_t>(i - range.begin) * p.page_size + row) * Group;
#pragma unroll
          for (int g = 0; g < Group; ++g) at[g] = logit[g];
        }
      }
      // The tile's softmax step, once for the CTA: the max and the sum of p by warp shuffles.
      if (warp < 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          float m = logit[g];
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
          if (lane == 0) tile_p[warp * Group + g] = m;  // tile_p is free until the p are written
        }
      }
      __syncthreads();
      float m_new[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) m_new[g] = fmaxf(segment_m[g], fmaxf(tile_p[g], tile_p[Group + g]));
      __syncthreads();  // every thread has read the maxima
      if (warp < 2) {
#pragma unroll
        for (int g = 0; g < Group; ++g) {
          const float pt = logit[g] == -HUGE_VALF ? 0.0f : __expf(logit[g] - m_new[g]);
          if (tid < n) tile_p[tid * Group + g] = pt;
          float sum = pt;
#pragma unroll
          for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
          if (lane == 0) rescale[warp * Group + g] = sum;  // [2][Group] partial sums, after rescale's [Group]
        }
      }
      float factor[Group];
#pragma unroll
      for (int g = 0; g < Group; ++g) factor[g] = segment_m[g] == -HUGE_VALF ? 0.0f : __expf(segment_m[g] - m_new[g]);
      __syncthreads();
      if (tid < Group) {
        segment_l[tid] = segment_l[tid] * factor[tid] + rescale[tid] + rescale[Group + tid];
        segment_m[tid] = m_new[tid];
      }
      // p.v: warp `warp` takes tokens warp, warp + 4, ...; lane owns channels lane + 32 k.
#pragma unroll
      for (int g = 0; g < Group; ++g)
#pragma unroll
        for (int k = 0; k < lane_channels; ++k) acc[k][g] *= factor[g];
      detail_packed::with_group(segment.group[1], [&](auto g) {
        for (int t = warp; t < n; t += warps) {
          const int row = first + t;
          if (rows_read != nullptr && ((rows_read[row >> 5] >> (row & 31)) & 1u) == 0) continue;  // p = 0
          float pt[Group];
#pragma unroll
          for (int x = 0; x < Group; ++x) pt[x] = tile_p[t * Group + x];
          detail_packed::accumulate_record<T, HeadDim, Group, decltype(g)::value>(
              reinterpret_cast<const std::uint32_t*>(v_records) + t * f.words, v_values + t * stride, v_words, kept, lane, pt, acc);
        }
      });
      __syncthreads();  // this stage and tile_p are free for the tile after next
      i = next_i;
      first = next_first;
      stage ^= 1;
    }
    KVMOSAIC_PACKED_STORE_ACCUMULATORS();
    leave_segment(segment);
  }
#undef KVMOSAIC_PACKED_STORE_ACCUMULATORS

  split.write(p, work_index, head);
}


/// Dynamic shared memory of the sm_90 packed kernel: barriers, the query tiles, a segment's
/// rotated queries or merged rotated output ([Group][HeadDim] fp32), the split's state in
/// head_dim space (o, then m, l and the segment's m, l), the warps' states at a segment's end
/// (`decode_temp_storage`: not the slots, which hold the next segment's pages in flight), then
/// `stages` slots of `slot_pages` page pairs each (K and V records of one head, as stored). One
/// formula for the kernel and for the host's choice of stages.
template <int HeadDim, int Group>
struct packed_mma_layout {
  static constexpr int max_stages = 4;
  /// mbarriers, a slot's pages have landed: `max_stages` (slots of one page), or `max_stages` x 4,
  /// one per warp and slot (slots of small pages: each warp's 16 rows land on their own)
  static constexpr int full_offset = 0;
  static constexpr int empty_offset = 128;   ///< `max_stages` mbarriers: the 4 warps are done with a slot of one page
  static constexpr int segment_offset = 160; ///< `max_stages` ints: the segment of a slot's page
  static constexpr int list_offset = 256;    ///< a split of small pages: its page ids, then their segments (`packed_listed_pages` ints each)
  static constexpr int query_offset = list_offset + 2 * packed_listed_pages * 4;
  static constexpr int query_bytes = 2 * 8 * (HeadDim * 2 + 16);
  static constexpr int rotated_offset = query_offset + query_bytes;
  static constexpr int split_offset = rotated_offset + Group * HeadDim * 4;
  static constexpr int temp_offset = (split_offset + Group * (HeadDim + 4) * 4 + 15) / 16 * 16;
  static constexpr int temp_bytes = 4 * Group * HeadDim * 4 + 2 * 4 * Group * 4;
  static constexpr int slots_offset = (temp_offset + temp_bytes + 127) / 128 * 128;
  static_assert(sizeof(decode_temp_storage<Group, HeadDim, 4>) == temp_bytes, "the warps' states: 4 rows");
  __host__ __device__ static constexpr int bytes(int slot_bytes, int stages) { return slots_offset + stages * slot_bytes; }
};

/// CTAs per SM the sm_90 packed kernel's registers are bounded for (`__launch_bounds__`), at
/// head_dim 128 with groups of 4 or fewer: four, whose 128 registers hold its page loop without
/// spills (five CTAs' 96 do not), for slots of one page and of several small pages alike
/// (benchmark/README.md, "The pages-of-64 split kernel bounded for four CTAs an SM").
constexpr int packed_mma_min_ctas(int head_dim, int group) { return head_dim == 128 && group <= 4 ? 4 : 0; }

/// The sm_90 packed_bitmap split kernel (MosaicKV's PackedAttention on tensor cores). Thread 0
/// streams the split's K and V pages of the head into `p.format.stages` shared slots with bulk
/// copies (one per page and cache, completing on an mbarrier), a slot a page, and records each
/// slot's segment; with `SmallPages` (pages of 16 or 32 tokens) the CTA first lists the split's
/// pages (at most `packed_listed_pages`) with their segments in shared memory, a slot holds up to
/// `slot_pages` pages of one segment (`packed_slot_pages`), and each warp copies its own 16 rows
/// of each slot from that list and waits only for them. Per segment the CTA rotates the group's queries once (q' = scale x q B_k,
/// split into hi + lo halves in T as the dense path does) and each of the 4 warps folds its 16
/// tokens of every 64 of a slot straight from the records there: its lanes gather the rotated
/// channels their MMA fragments hold in the slab order (`packed_key_rows`, `packed_value_rows`:
/// rows.cuh; q' is staged in the K order and o' taken back from the V order), through
/// `score_chunks` and `accumulate_chunks` with the segment's K and V group sizes, so q'.k and p.v'
/// are MMAs over zero-filled fragments and no dense tile is written. At a segment's end the warps'
/// states merge, o = o' B_v^T once, and the result merges into the split's state; then the dense
/// tail, if the split has it, is folded in head_dim space. Grid: (splits capacity, num_kv_heads).
/// Cost per 16 tokens and warp: the MMAs of the dense kernel over the live slabs (ceil(kept / 32)
/// of head_dim / 32) plus, per lane, 2 K and 4 V rows located (their live bitmap words) and, per
/// live slab and row, one masked popcount and the lane's 8 (K) or 4 (V) channels: a predicated load
/// per channel at g = 1, per group at g = 2 and 4; per segment 2 x Group x head_dim x kept FMAs and
/// five CTA barriers.
template <class T, int HeadDim, int Group, bool Logits = false, bool SmallPages = false>
__global__ void __launch_bounds__(128, packed_mma_min_ctas(HeadDim, Group)) decode_partial_packed_mma_kernel(const __grid_constant__ split_params<packed_decode_params> p) {
  constexpr int threads = 128, warps = 4, tokens = 64;
  using layout = packed_mma_layout<HeadDim, Group>;
  using attend = warp_attend_mma<T, HeadDim, Group, tokens, operand_path::row_chunks>;
  using temp_storage = decode_temp_storage<Group, HeadDim, warps>;
  static_assert(layout::query_bytes == attend::query_bytes, "query tile sizes agree");
  static_assert(layout::query_bytes >= Group * HeadDim * 4, "the query tiles hold q transposed while a segment opens");
  extern __shared__ __align__(128) std::byte packed_mma_shared[];
  std::byte* shared = packed_mma_shared;
  auto* full = reinterpret_cast<std::uint64_t*>(shared + layout::full_offset);
  auto* empty = reinterpret_cast<std::uint64_t*>(shared + layout::empty_offset);
  auto* slot_segment = reinterpret_cast<std::int32_t*>(shared + layout::segment_offset);
  std::byte* query_tiles = shared + layout::query_offset;
  float* rotated = reinterpret_cast<float*>(shared + layout::rotated_offset);  // [Group][HeadDim]
  const detail_packed::split_state<HeadDim, Group, threads> split{reinterpret_cast<float*>(shared + layout::split_offset)};
  temp_storage& temp = *reinterpret_cast<temp_storage*>(shared + layout::temp_offset);
  std::byte* slots = shared + layout::slots_offset;

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);
  const int num_pages = range.end - range.begin;
  const packed_decode_params& f = p.format;
  const int stages = f.stages, kept = f.kept, slot_index = p.tail_slots[w.batch_index];
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int pair_bytes = k_bytes + v_bytes;
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  const int num_q_heads = p.num_kv_heads * Group;
  const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group) * HeadDim;
  // `Logits`: a step with token scores; each row's scaled logit (-inf where masked) at
  // split_logits[(row of the split's read order) x Group + head of the group].
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, Group) : nullptr;
  if (tid == 0)
    for (int b = 0; b < stages; ++b) {
      if constexpr (SmallPages) {
        for (int x = 0; x < warps; ++x) detail::barrier_init(&full[b * warps + x], 1);
      } else {
        detail::barrier_init(&full[b], 1);
        detail::barrier_init(&empty[b], warps);
      }
    }
  // `SmallPages` (pages of 16 or 32 tokens, `packed_slot_pages` > 1): a slot holds the run of up
  // to `slot_pages` pages of one segment from its first page on (`compose`: each warp finds the
  // same runs from the list), and each warp copies its own 16 rows of each slot into it and waits
  // on its own barrier, so no warp waits for another's copies or for another to leave a slot
  // (only a change of segment gathers the CTA). The split's pages (at most
  // `packed_listed_pages`) are listed first, each page's id and segment in shared memory, loaded
  // by all threads at once (two dependent rounds), so that no refill waits on a global load.
  // Otherwise thread 0 fills a slot with one page once the 4 warps have left it, its page ids and
  // segments loaded ahead in registers (the next page's segment, the id of the one after), and
  // the slot's segment is visible to the warps once they have waited on its barrier.
  const int slot_pages = SmallPages ? f.slot_pages : 1, slot_bytes = slot_pages * pair_bytes;
  // The warp's page of a slot and its first row there: page rows_first / page_size of a slot of
  // small pages, else page 0 and rows_first (+ 64 per tile of a larger page).
  const int rows_first = warp * 16;  // the warp's rows of every 64
  const int warp_page = SmallPages ? rows_first / p.page_size : 0;
  const int warp_row = rows_first - warp_page * p.page_size;
  auto* const listed_id = reinterpret_cast<std::int32_t*>(shared + layout::list_offset);
  std::int32_t* const listed_segment = listed_id + packed_listed_pages;
  std::int32_t next_id = 0, next_segment = 0, later_id = 0;  // thread 0, pages of 64 or more
  if constexpr (SmallPages) {
    for (int k = tid; k < num_pages; k += threads) {  // num_pages <= packed_listed_pages (the plan's cap)
      const std::int32_t id = table[k];
      listed_id[k] = id;
      listed_segment[k] = f.page_segments[id];
    }
  } else if (tid == 0) {
    if (num_pages > 0) {
      next_id = table[0];
      next_segment = f.page_segments[next_id];
      if (num_pages > 1) later_id = table[1];
    }
  }
  // SmallPages: the pages of the slot that starts at the split's page `first` (< num_pages), and
  // their segment; the same in every warp.
  const auto compose = [&](int first, int& segment) {
    segment = listed_segment[first];
    const bool same = lane < slot_pages && first + lane < num_pages && listed_segment[first + lane] == segment;
    return __ffs(static_cast<int>(~__ballot_sync(0xffffffffu, same))) - 1;
  };
  // Fills `slot` from page `page` on of the split (a page to issue is left) and returns the pages
  // it holds: with SmallPages, the warp's own 16 rows of it (its lane 0; its barrier completes
  // with no copy where the slot has no page for it), else (thread 0) the whole page.
  const auto refill = [&](int slot, int page) {
    if constexpr (SmallPages) {
      int segment;
      const int count = compose(page, segment);
      if (lane == 0) {
        std::uint64_t* landed = &full[slot * warps + warp];
        if (warp_page < count) {
          const std::byte* from = p.pages + static_cast<std::size_t>(listed_id[page + warp_page]) * p.page_slot_bytes;
          const std::byte* k_from = from + head * p.k_page_bytes;
          const std::byte* v_from = from + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes;
          std::byte* to = slots + slot * slot_bytes + warp_page * pair_bytes;
          if (slot_pages * 16 == tokens) {  // pages of 16: the warp's page, K and V
            detail::barrier_arrive_expect(landed, static_cast<std::uint32_t>(pair_bytes));
            detail::bulk_copy_to_shared(to, k_from, static_cast<std::uint32_t>(k_bytes), landed);
            detail::bulk_copy_to_shared(to + k_bytes, v_from, static_cast<std::uint32_t>(v_bytes), landed);
          } else {  // the warp's 16 rows of its page: their bitmaps and their values, K and V
            const int bitmaps_at = warp_row * f.words * 4, bitmaps = 16 * f.words * 4;
            const int values_at = static_cast<int>(f.bitmap_bytes) + warp_row * f.retained * 2, values = 16 * f.retained * 2;
            detail::barrier_arrive_expect(landed, static_cast<std::uint32_t>(2 * (bitmaps + values)));
            for (int which = 0; which < 2; ++which) {
              const std::byte* records = which == 0 ? k_from : v_from;
              std::byte* into = to + which * k_bytes;
              detail::bulk_copy_to_shared(into + bitmaps_at, records + bitmaps_at, static_cast<std::uint32_t>(bitmaps), landed);
              detail::bulk_copy_to_shared(into + values_at, records + values_at, static_cast<std::uint32_t>(values), landed);
            }
          }
        } else {
          detail::barrier_arrive(landed);
        }
      }
      return count;
    } else {
      const int i = page;
      slot_segment[slot] = next_segment;
      const std::byte* page = p.pages + static_cast<std::size_t>(next_id) * p.page_slot_bytes;
      detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(pair_bytes));
      std::byte* destination = slots + slot * pair_bytes;
      detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
      detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                  static_cast<std::uint32_t>(v_bytes), &full[slot]);
      if (i + 1 < num_pages) {
        next_id = later_id;
        next_segment = f.page_segments[next_id];
      }
      if (i + 2 < num_pages) later_id = table[i + 2];
      return 1;
    }
  };
  split.start();
  __syncthreads();  // the barriers are initialized, the page list written
  int issued = 0;   // SmallPages: the split's pages the warp's refills have reached
  if constexpr (SmallPages) {
    for (int slot = 0; slot < stages && issued < num_pages; ++slot) issued += refill(slot, issued);
  } else if (tid == 0) {
    for (int i = 0; i < min(stages, num_pages); ++i) refill(i, i);
  }

  attend state;
  // Ends a segment (every thread): the warps' states merge (rotated V space, or head_dim space
  // for the tail: `basis` null), o = o' B_v^T, and the result merges into the split's state.
  const auto close_segment = [&](const float* basis) {
    state.store(temp, warp);
    __syncthreads();
    for (int index = tid; index < Group * HeadDim; index += threads) {
      const int g = index / HeadDim, c = index % HeadDim;
      softmax_state<float> total;
      float o = 0.0f;
#pragma unroll
      for (int r = 0; r < warps; ++r) {
        const merge_weights<float> mw = total.merge(softmax_state<float>{temp.m[r][g], temp.l[r][g]});
        o = o * mw.self + temp.o[r][g][c] * mw.other;
      }
      // A packed segment's o' comes in the V slab order (rows.cuh); the tail's in head_dim order.
      rotated[basis == nullptr ? index : g * HeadDim + packed_value_channel<HeadDim>(c)] = o;
      if (c == 0) {
        split.segment_m()[g] = total.m;
        split.segment_l()[g] = total.l;
      }
    }
    __syncthreads();
    split.merge_segment(rotated, basis, kept);
  };
  // Starts a segment (every thread; the query tiles are free): q' = scale x q B_k in the
  // segment's rotated channels, zero past `kept` (or q itself for the tail: `basis` null), read
  // from the step's rotated queries where the selection stage wrote them.
  const auto open_segment = [&](const float* basis, int segment_index) {
    if (basis == nullptr) {
      for (int index = tid; index < Group * HeadDim; index += threads) rotated[index] = q[index];
    } else if (f.step_queries != nullptr) {
      const int heads = f.step_query_heads;
      const float* from = f.step_queries + ((static_cast<std::size_t>(w.batch_index) * p.num_kv_heads + head) * f.segments_per_sequence +
                                            segment_index) * kept * heads;
      for (int index = tid; index < Group * HeadDim; index += threads) {
        const int g = index / HeadDim, j = index % HeadDim;
        rotated[g * HeadDim + packed_key_position(j)] = j < kept ? from[j * heads + g] : 0.0f;  // the K slab order
      }
    } else {
      // q transposed ([HeadDim][Group]) into the free query tiles, then a thread per rotated
      // channel j for every head: each basis element is loaded once (coalesced along j) and
      // used Group times.
      float* q_t = reinterpret_cast<float*>(query_tiles);
      for (int index = tid; index < Group * HeadDim; index += threads) q_t[index % HeadDim * Group + index / HeadDim] = q[index];
      __syncthreads();
      for (int j = tid; j < HeadDim; j += threads) {
        float dot[Group];
#pragma unroll
        for (int g = 0; g < Group; ++g) dot[g] = 0.0f;
        if (j < kept) {
#pragma unroll 32
          for (int c = 0; c < HeadDim; ++c) {
            const float b = __ldg(basis + c * kept + j);
#pragma unroll
            for (int g = 0; g < Group; ++g) dot[g] = fmaf(q_t[c * Group + g], b, dot[g]);
          }
        }
#pragma unroll
        for (int g = 0; g < Group; ++g) rotated[g * HeadDim + packed_key_position(j)] = dot[g];  // the K slab order
      }
    }
    __syncthreads();  // rotated is whole, and q_t read, before the query tiles are written
    attend::stage_queries(rotated, p.softmax_scale, query_tiles, threads);
    __syncthreads();
    state.start();
  };

  int current = -1;
  packed_entry segment{};
  int k_shift = 0, v_shift = 0;  // log2 of the segment's K and V groups
  const int slabs = (kept + 31) / 32;
  // The split's row masks (null without them): page i's at split_rows_read + i x mask_words.
  const std::uint32_t* const split_rows_read = detail_decode::page_rows_read(p, w.batch_index, head, range.begin);
  int slot = 0;              // i mod stages
  std::uint32_t phase = 0u;  // (slots used / stages) mod 2: the parity of the slot's barriers
  const int slot_rows = SmallPages ? tokens : p.page_size;
  for (int i = 0; i < num_pages;) {  // i: the slot's first page in the split
    int page_segment = 0, count = 1;
    if constexpr (SmallPages) {
      count = compose(i, page_segment);
      detail::barrier_wait(&full[slot * warps + warp], phase);
    } else {
      detail::barrier_wait(&full[slot], phase);
      page_segment = slot_segment[slot];
    }
    if (page_segment != current) {  // every warp reaches this slot before any leaves it
      if (current >= 0) close_segment(segment.v_basis_t);
      current = page_segment;
      segment = packed_entry::at(f, HeadDim, p.num_kv_heads, slot_index, current, head);
      k_shift = segment.group[0] == 1 ? 0 : segment.group[0] == 2 ? 1 : 2;
      v_shift = segment.group[1] == 1 ? 0 : segment.group[1] == 2 ? 1 : 2;
      open_segment(segment.k_basis, current);
    }
    const int page_index = i + warp_page;  // the warp's page in the split
    const std::byte* k_page = slots + slot * slot_bytes + warp_page * pair_bytes;
    const std::byte* v_page = k_page + k_bytes;
    const auto* k_bits = reinterpret_cast<const std::uint32_t*>(k_page);
    const auto* k_values = reinterpret_cast<const std::uint16_t*>(k_page + f.bitmap_bytes);
    const auto* v_bits = reinterpret_cast<const std::uint32_t*>(v_page);
    const auto* v_values = reinterpret_cast<const std::uint16_t*>(v_page + f.bitmap_bytes);
    const std::uint32_t* rows_read =
        split_rows_read != nullptr && warp_page < count ? split_rows_read + static_cast<std::size_t>(page_index) * p.mask_words : nullptr;
    for (int first = 0; first < slot_rows; first += tokens) {
      const int row = first + warp_row;  // the warp's first row in its page
      // No rows, and no mask word, past the page's end or past the slot's pages.
      const std::uint32_t covered = warp_page < count ? attend::rows_before(row, p.page_size) : 0u;
      const std::uint32_t rows = covered != 0 ? detail_decode::sixteen_rows_read(rows_read, row) & covered : 0u;
      float* const warp_logits = Logits && split_logits != nullptr
                                     ? split_logits + (static_cast<std::size_t>(page_index) * p.page_size + row) * Group
                                     : nullptr;
      // The row sources count the warp's tokens from rows_first on.
      const int records_first = row - rows_first;
      if (rows != 0) {  // K and V sources by their group sizes: one dispatch each
        const typename attend::p_fragments probabilities = detail_packed::with_shift(k_shift, [&](auto shift) {
          const packed_key_rows<HeadDim, decltype(shift)::value> k_rows{
              {k_bits, k_values, f.words, f.retained, slabs, records_first}};
          return state.score_chunks(k_rows, query_tiles, rows_first, rows, warp_logits, covered);
        });
        detail_packed::with_shift(v_shift, [&](auto shift) {
          const packed_value_rows<HeadDim, decltype(shift)::value> v_rows{
              {v_bits, v_values, f.words, f.retained, slabs, records_first}};
          state.accumulate_chunks(v_rows, rows_first, probabilities);
        });
      } else if (warp_logits != nullptr && covered != 0) {
        attend::write_masked_logits(warp_logits, covered);
      }
    }
    // SmallPages: the warp refills its rows of the slot. Else each warp releases the slot, and
    // thread 0 refills it once all four have, while the other warps go on.
    __syncwarp();
    if constexpr (SmallPages) {
      if (issued < num_pages) issued += refill(slot, issued);
    } else {
      if (lane == 0) detail::barrier_arrive(&empty[slot]);
      if (tid == 0 && i + stages < num_pages) {
        detail::barrier_wait(&empty[slot], phase);
        refill(slot, i + stages);
      }
    }
    i += count;
    if (++slot == stages) {
      slot = 0;
      phase ^= 1u;
    }
  }
  if (current >= 0) close_segment(segment.v_basis_t);
  if (w.with_tail) {  // the exact rows and the tail rows, one dense run, in head_dim space
    __syncthreads();  // the query tiles are free
    open_segment(nullptr, 0);
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* tail = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                            static_cast<std::size_t>(run.first) * HeadDim * 2;
    const std::byte* k_tail = tail + head * p.tail_head_bytes;
    const std::byte* v_tail = tail + (p.num_kv_heads + head) * p.tail_head_bytes;
    for (int first = 0; first < run.rows; first += tokens) {
      const std::uint32_t warp_rows = attend::rows_before(first + rows_first, run.rows);
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim * 2;
      float* const warp_logits = Logits && split_logits != nullptr
                                     ? split_logits + (static_cast<std::size_t>(num_pages) * p.page_size + first + rows_first) * Group
                                     : nullptr;
      if (warp_rows != 0)
        state.fold_chunks(global_dense_rows<HeadDim>{k_tail + skip, run.rows - first},
                          global_dense_rows<HeadDim>{v_tail + skip, run.rows - first}, query_tiles, rows_first, warp_rows,
                          warp_logits, warp_rows);
    }
    close_segment(nullptr);
  }
  __syncthreads();
  split.write(p, work_index, head);
}


}  // namespace kvmosaic::cuda::kernel
