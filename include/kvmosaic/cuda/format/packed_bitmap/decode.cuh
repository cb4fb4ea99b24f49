// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The split kernel of `format::packed_bitmap` (MosaicKV's PackedAttention, section 5.3). Per
/// segment of the pages a split reads, the CTA rotates the group's queries once into the
/// segment's K basis, scores every record on its set bits (no K tile), accumulates p.v in the
/// rotated V space from V records expanded 64 tokens at a time into a dense shared tile, and
/// rotates the segment's merged output back once, into the split's state in head_dim space. The
/// engine's plan keeps a `select::all` split within one segment (one rotation each way per split);
/// a selection's pages may span several. The dense tail is a split of its own, read as the dense
/// portable kernel reads it. Portable (sm_75+) CUDA cores; the partials merge with
/// `merge_splits_kernel`.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/collective/page_attend.cuh"
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
};

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

/// Shared memory of the packed kernel: the rotated queries ([kept][Group] fp32), the logits of a
/// 64-token tile ([Group][64]), a segment's merged rotated output ([Group][HeadDim]), the split's
/// state in head_dim space (o [Group][HeadDim], then m and l [Group]), and one dense V tile,
/// which the CTA reduction of each segment reuses.
template <int HeadDim, int Group, int Rows>
struct packed_decode_layout {
  static constexpr int tile_tokens = 64;
  static constexpr int query_offset = 0;
  static constexpr int logits_offset = query_offset + HeadDim * Group * 4;
  static constexpr int output_offset = logits_offset + Group * tile_tokens * 4;
  static constexpr int split_offset = output_offset + Group * HeadDim * 4;
  static constexpr int tile_offset = (split_offset + Group * (HeadDim + 4) * 4 + 15) / 16 * 16;
  static constexpr int tile_bytes = tile_tokens * HeadDim * 2;
  static constexpr int reduction_bytes = static_cast<int>(sizeof(decode_temp_storage<Group, HeadDim, Rows>));
  static constexpr int bytes = tile_offset + (tile_bytes > reduction_bytes ? tile_bytes : reduction_bytes);
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

/// The group's logits of token t: q' . y^ over the record's set bits, q' the rotated, pre-scaled
/// queries in shared memory ([kept][Group]). Cost: r x Group FMAs and one pass over the bitmap.
template <class T, int Group>
__device__ __forceinline__ void score_record(const record& r, int group, int kept, const float* q_rotated,
                                             float (&logit)[Group]) {
#pragma unroll
  for (int g = 0; g < Group; ++g) logit[g] = 0.0f;
  const int words = (kept / group + 31) / 32;
  int at = 0;
  for (int w = 0; w < words; ++w)
    for (std::uint32_t word = r.bits[w]; word != 0; word &= word - 1) {
      const int j = w * 32 + __ffs(static_cast<int>(word)) - 1;
      for (int i = 0; i < group; ++i, ++at) {
        const float value = to_float(T::from_bits(__ldg(r.values + at)));
        const float* q = q_rotated + (j * group + i) * Group;
#pragma unroll
        for (int g = 0; g < Group; ++g) logit[g] = fmaf(q[g], value, logit[g]);
      }
    }
}

/// Writes the 8 channels [8 k, 8 k + 8) of record r, zeros where nothing is kept, as 16 bytes at
/// `out` (shared): the set groups among them and their values, found by the popcount of the bits
/// before them. g divides 8, so no group straddles two chunks.
__device__ __forceinline__ void expand_chunk(const record& r, int group, int kept, int k, std::byte* out) {
  std::uint16_t chunk[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (8 * k < kept) {
    const int first = 8 * k / group;  // the chunk's first group
    int at = 0;
    for (int w = 0; w < first / 32; ++w) at += __popc(r.bits[w]);
    const std::uint32_t word = r.bits[first / 32];
    at += __popc(word & ((1u << (first % 32)) - 1u));  // first % 32 <= 24: no full shift
    at *= group;
    const int groups = 8 / group;
    for (int jj = 0; jj < groups; ++jj) {
      const int j = first + jj;
      if (j * group >= kept) break;
      if (((r.bits[j / 32] >> (j % 32)) & 1u) == 0) continue;
      for (int i = 0; i < group; ++i) chunk[jj * group + i] = __ldg(r.values + at++);
    }
  }
  uint4 packed;
  packed.x = chunk[0] | (static_cast<std::uint32_t>(chunk[1]) << 16);
  packed.y = chunk[2] | (static_cast<std::uint32_t>(chunk[3]) << 16);
  packed.z = chunk[4] | (static_cast<std::uint32_t>(chunk[5]) << 16);
  packed.w = chunk[6] | (static_cast<std::uint32_t>(chunk[7]) << 16);
  *reinterpret_cast<uint4*>(out) = packed;
}

}  // namespace detail_packed

/// The packed_bitmap split kernel (sm_75+). Grid: (splits capacity, num_kv_heads); `Threads`
/// threads as the dense portable kernel (its collective folds the p.v of every tile).
/// Per segment of the split's pages: q' = scale x q B_k (Group x head_dim x kept FMAs); per
/// 64-token tile one thread per token scores its K record into shared logits, the CTA expands the
/// V records into a dense [64][head_dim] tile (channels past kept are zero) and
/// `page_attend<dense>::fold_scored` accumulates; at the segment's end (`leave_segment`) the rows'
/// states merge in shared memory and o = o' B_v^T (Group x head_dim x kept FMAs) merges into the
/// split's state. A split without pages reads the exact rows and the tail, dense, as
/// `decode_partial_kernel`.
template <class T, int HeadDim, int Group, int Threads, int Unroll>
__global__ void __launch_bounds__(Threads) decode_partial_packed_kernel(const split_params<packed_decode_params> p) {
  using collective = page_attend<format::dense, T, HeadDim, Group, Threads, Unroll>;
  constexpr int rows = collective::rows;
  constexpr int vec = detail::vector_elements;
  using layout = packed_decode_layout<HeadDim, Group, rows>;
  constexpr int tile = layout::tile_tokens;
  extern __shared__ __align__(16) std::byte packed_shared[];
  float* q_rotated = reinterpret_cast<float*>(packed_shared + layout::query_offset);
  float* logits = reinterpret_cast<float*>(packed_shared + layout::logits_offset);
  float* o_rotated = reinterpret_cast<float*>(packed_shared + layout::output_offset);
  float* split_o = reinterpret_cast<float*>(packed_shared + layout::split_offset);  // [Group][HeadDim]
  float* split_m = split_o + Group * HeadDim;
  float* split_l = split_m + Group;
  float* segment_m = split_l + Group;  // the segment's merged (m, l), [Group] each
  float* segment_l = segment_m + Group;
  std::byte* v_tile = packed_shared + layout::tile_offset;
  auto& temp = *reinterpret_cast<decode_temp_storage<Group, HeadDim, rows>*>(v_tile);

  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x);
  thread_state<Group> s;
  detail_decode::start_state<HeadDim, Group, collective::lanes_per_row>(p, w, head, s);
  const detail_decode::split_pages range = detail_decode::pages_of_split(p, w, head);

  if (range.begin == range.end) {  // the exact rows and the tail rows, dense, in head_dim space
    if (w.with_tail) {
      const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
      const std::byte* slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes +
                              static_cast<std::size_t>(run.first) * HeadDim * 2;
      collective::fold(slot + head * p.tail_head_bytes, slot + (p.num_kv_heads + head) * p.tail_head_bytes, run.rows, s);
    }
    detail_decode::write_partial<HeadDim, Group, Threads, collective::lanes_per_row>(p, work_index, head, s, temp);
    return;
  }

  const packed_decode_params& f = p.format;
  const int kept = f.kept, slot_index = p.tail_slots[w.batch_index];
  const int num_q_heads = p.num_kv_heads * Group;
  const float* q = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * Group) * HeadDim;
  for (int index = tid; index < Group * HeadDim; index += Threads) split_o[index] = 0.0f;
  if (tid < Group) {
    split_m[tid] = -HUGE_VALF;
    split_l[tid] = 0.0f;
  }

  // Enters a segment: q' = scale x q B_k, [kept][Group] (B_k's rows are read along j: coalesced),
  // and an empty state for its rows.
  const auto enter_segment = [&](const packed_entry& segment) {
    for (int index = tid; index < kept * Group; index += Threads) {
      const int g = index / kept, j = index % kept;
      float acc = 0.0f;
      for (int c = 0; c < HeadDim; ++c) acc = fmaf(q[g * HeadDim + c], segment.k_basis[c * kept + j], acc);
      q_rotated[j * Group + g] = acc * p.softmax_scale;
    }
#pragma unroll
    for (int g = 0; g < Group; ++g) {
      s.m[g] = -HUGE_VALF;
      s.l[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < vec; ++i) s.o[g][i] = 0.0f;
    }
    __syncthreads();
  };
  // Leaves a segment: the rows' states merged (rotated V space), rotated back once and merged
  // into the split's state. Every thread calls it after the last tile's barrier.
  const auto leave_segment = [&](const packed_entry& segment) {
    const int lane = tid % collective::lanes_per_row, row = tid / collective::lanes_per_row;
#pragma unroll
    for (int g = 0; g < Group; ++g) {
#pragma unroll
      for (int i = 0; i < vec; ++i) temp.o[row][g][lane * vec + i] = s.o[g][i];
      if (lane == 0) {
        temp.m[row][g] = s.m[g];
        temp.l[row][g] = s.l[g];
      }
    }
    __syncthreads();
    for (int index = tid; index < Group * kept; index += Threads) {
      const int g = index / kept, c = index % kept;
      softmax_state<float> total;
      float o = 0.0f;
      for (int r = 0; r < rows; ++r) {
        softmax_state<float> part;
        part.m = temp.m[r][g];
        part.l = temp.l[r][g];
        const merge_weights<float> mw = total.merge(part);
        o = o * mw.self + temp.o[r][g][c] * mw.other;
      }
      o_rotated[g * HeadDim + c] = o;  // relative to the segment's m
      if (c == 0) {
        segment_m[g] = total.m;
        segment_l[g] = total.l;
      }
    }
    __syncthreads();
    for (int index = tid; index < Group * HeadDim; index += Threads) {
      const int g = index / HeadDim, c = index % HeadDim;
      float o = 0.0f;
      for (int j = 0; j < kept; ++j) o = fmaf(o_rotated[g * HeadDim + j], segment.v_basis_t[j * HeadDim + c], o);
      softmax_state<float> split{split_m[g], split_l[g]};
      const merge_weights<float> mw = split.merge(softmax_state<float>{segment_m[g], segment_l[g]});
      split_o[index] = split_o[index] * mw.self + o * mw.other;
    }
    __syncthreads();
    if (tid < Group) {
      softmax_state<float> split{split_m[tid], split_l[tid]};
      split.merge(softmax_state<float>{segment_m[tid], segment_l[tid]});
      split_m[tid] = split.m;
      split_l[tid] = split.l;
    }
    __syncthreads();
  };

  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head);
  int current = -1;
  packed_entry segment{};
  for (int i = range.begin; i < range.end; ++i) {
    const std::int32_t page = table[i];
    const int page_segment = f.page_segments[page];
    if (page_segment != current) {
      if (current >= 0) leave_segment(segment);
      current = page_segment;
      segment = packed_entry::at(f, HeadDim, p.num_kv_heads, slot_index, current, head);
      enter_segment(segment);
    }
    const std::byte* slot = p.pages + static_cast<std::size_t>(page) * p.page_slot_bytes;
    const std::byte* k_page = slot + head * p.k_page_bytes;
    const std::byte* v_page = slot + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes;
    const std::uint32_t* rows_read = detail_decode::page_rows_read(p, w.batch_index, head, i);
    for (int first = 0; first < p.page_size; first += tile) {
      const int n = min(tile, p.page_size - first);
      for (int t = tid; t < n; t += Threads) {
        const int row = first + t;
        float logit[Group];
        detail_packed::score_record<T, Group>(detail_packed::record_of(f, k_page, row), segment.group[0], kept, q_rotated, logit);
        const bool read = rows_read == nullptr || ((rows_read[row >> 5] >> (row & 31)) & 1u) != 0;
#pragma unroll
        for (int g = 0; g < Group; ++g) logits[g * tile + t] = read ? logit[g] : -HUGE_VALF;
      }
      constexpr int chunks = HeadDim / 8;
      for (int index = tid; index < n * chunks; index += Threads) {
        const int t = index / chunks, k = index % chunks;
        detail_packed::expand_chunk(detail_packed::record_of(f, v_page, first + t), segment.group[1], kept, k,
                                    v_tile + (t * HeadDim + k * 8) * 2);
      }
      __syncthreads();
      collective::template fold_scored<from_shared>(logits, tile, v_tile, n, s);
      __syncthreads();
    }
  }
  leave_segment(segment);

  // The split's partial: o / l and its log-sum-exp (an empty split, every row masked, writes the
  // empty state, which merges as nothing).
  const std::size_t partial_base = static_cast<std::size_t>(work_index) * num_q_heads + head * Group;
  for (int index = tid; index < Group * HeadDim; index += Threads) {
    const int g = index / HeadDim;
    const softmax_state<float> split{split_m[g], split_l[g]};
    p.partial_o[(partial_base + g) * HeadDim + index % HeadDim] = split.l > 0.0f ? split_o[index] / split.l : 0.0f;
    if (index % HeadDim == 0) p.partial_lse[partial_base + g] = split.log_sum_exp();
  }
}

}  // namespace kvmosaic::cuda::kernel
