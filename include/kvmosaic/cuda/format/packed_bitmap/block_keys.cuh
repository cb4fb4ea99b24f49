// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap`'s block keys on the device (MosaicKV's per-block keys, "channel-
/// compressed together with the original K vectors", section 5.2): the kernels that write them
/// when pages are sealed and rotate a step's queries into each segment's K basis, each in the
/// host's order (`format_traits<packed_bitmap>::encode_block_key`, `block_key_query`) to the bit.
///
/// The engine runs them through `device_format<packed_bitmap>`'s block-key hooks; the scoring
/// kernel is the generic `score_block_keys_kernel` (kernel/select_pages.cuh).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// Where the block keys of newly sealed pages come from and go.
struct packed_block_key_params {
  const std::byte* rows;                 ///< dense rows of the new pages (storage dtype)
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;          ///< K rows of KV head h start h * rows_head_bytes into a slot
  const std::int32_t* row_slots;         ///< [n] the slot of `rows` holding new page i
  const std::int32_t* new_pages;         ///< [n] page ids
  const std::int32_t* segment_entries;   ///< [n] the segment arena entry of page i (slot x segments_per_sequence + segment)
  std::byte* keys;                       ///< [max_pages][num_kv_heads][blocks per page][key_bytes]
  std::int64_t keys_page_bytes;
  int key_bytes;                         ///< one block key (`block_key_bytes`)
  int block_tokens;
  int num_kv_heads;
  packed_decode_params format;
};

inline constexpr int packed_block_key_threads = 128;

/// The block key of each block of each new page, per KV head: the fp32 mean of the block's rows
/// (a sum in token order divided by the count), y = mean B_k (thread j sums channel j over the
/// head_dim channels in order by fused multiply-adds), the r / g groups of largest energy (an
/// fp32 sum of squares in group order; NaN first, then energy, then the lower group), then each
/// kept channel's 8-bit index and 16-bit value in channel order, zeros past the strategy's r.
/// Grid: (n, num_kv_heads, blocks per page).
template <class T, int HeadDim>
__global__ void __launch_bounds__(packed_block_key_threads) encode_packed_block_keys_kernel(const packed_block_key_params p) {
  static_assert(HeadDim <= 256, "8-bit channel indices");
  __shared__ float mean[HeadDim];
  __shared__ float y[HeadDim];
  __shared__ float energy[HeadDim];
  __shared__ std::uint8_t keep[HeadDim];
  const int i = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), block = static_cast<int>(blockIdx.z);
  const int blocks = static_cast<int>(gridDim.z), tid = static_cast<int>(threadIdx.x);
  const packed_decode_params& f = p.format;
  const int kept = f.kept;
  const T* rows = reinterpret_cast<const T*>(p.rows + static_cast<std::size_t>(p.row_slots[i]) * p.rows_slot_bytes +
                                             static_cast<std::size_t>(head) * p.rows_head_bytes) +
                  static_cast<std::size_t>(block) * p.block_tokens * HeadDim;
  const std::byte* entry = f.segments + (static_cast<std::int64_t>(p.segment_entries[i]) * p.num_kv_heads + head) * f.entry_bytes;
  const auto* k_basis = reinterpret_cast<const float*>(entry);
  const auto* strategy = reinterpret_cast<const std::int32_t*>(entry + 2 * static_cast<std::int64_t>(HeadDim) * kept * 4);
  const int retained = strategy[0], group = strategy[1];
  const int groups = kept / group, keep_groups = retained / group;
  std::byte* key = p.keys + static_cast<std::size_t>(p.new_pages[i]) * p.keys_page_bytes +
                   (static_cast<std::size_t>(head) * blocks + block) * p.key_bytes;

  for (int c = tid; c < HeadDim; c += packed_block_key_threads) {
    float sum = 0.0f;
    for (int t = 0; t < p.block_tokens; ++t) sum = __fadd_rn(sum, to_float(rows[static_cast<std::size_t>(t) * HeadDim + c]));
    mean[c] = __fdiv_rn(sum, static_cast<float>(p.block_tokens));
  }
  for (int b = tid; b < p.key_bytes / 4; b += packed_block_key_threads) reinterpret_cast<std::uint32_t*>(key)[b] = 0u;
  __syncthreads();
  for (int j = tid; j < kept; j += packed_block_key_threads) {
    float acc = 0.0f;
    for (int c = 0; c < HeadDim; ++c) acc = __fmaf_rn(mean[c], k_basis[c * kept + j], acc);  // the host's fused_rotate
    y[j] = acc;
  }
  __syncthreads();
  for (int j = tid; j < groups; j += packed_block_key_threads) {
    float sum = 0.0f;
    for (int g = 0; g < group; ++g) sum = __fadd_rn(sum, __fmul_rn(y[j * group + g], y[j * group + g]));
    energy[j] = sum;
  }
  __syncthreads();
  for (int j = tid; j < groups; j += packed_block_key_threads) {
    const float mine = energy[j];
    int before = 0;
    for (int o = 0; o < groups; ++o) {
      const float other = energy[o];
      const bool ranks_before = isnan(other) != isnan(mine) ? isnan(other) : (other > mine || (!(other < mine) && o < j));
      before += o != j && ranks_before ? 1 : 0;
    }
    keep[j] = before < keep_groups ? 1 : 0;
  }
  __syncthreads();
  auto* channels = reinterpret_cast<std::uint8_t*>(key);
  auto* values = reinterpret_cast<std::uint16_t*>(key + block_key_layout{f.retained}.values_offset());
  for (int j = tid; j < groups; j += packed_block_key_threads) {
    if (keep[j] == 0) continue;
    int at = 0;
    for (int o = 0; o < j; ++o) at += keep[o];
    for (int g = 0; g < group; ++g) {
      channels[at * group + g] = static_cast<std::uint8_t>(j * group + g);
      values[at * group + g] = T(y[j * group + g]).bits;
    }
  }
}

/// The step's queries in each segment's K basis for scoring block keys: q'[b][head][segment]
/// [channel][g] = (q_g B_k)[channel], each summed over head_dim in order by fused multiply-adds
/// (the host's `block_key_query`), with the heads of a channel side by side and padded to
/// `query_heads` (zeros) so that a scoring thread loads a channel's heads by vector loads.
/// A CTA takes `packed_block_query_columns` channels of one (sequence, KV head, segment): it
/// copies their basis columns into shared memory by `cp.async` (16 bytes a copy where a basis
/// row is a multiple of 4 channels), up to 128 rows a round, all in flight at once, and a thread
/// per (channel, head) runs that head's chain (heads h and h + 4 for groups over 4). So a
/// sequence's rotation waits on two global round trips (its slot, then its basis) and a chain of
/// head_dim dependent multiply-adds, with every channel and head of the step in flight at once.
/// Launched as the metadata pull's programmatic dependent (on sm_90), it loads the queries, waits
/// for the pull (the per-sequence part: the engine pulls the tables beside this kernel), then lets
/// the next kernel be scheduled. Grid: (segments x ceil(kept /
/// packed_block_query_columns), num_kv_heads, batch), `segments` those a sequence of the step's
/// layout can span (`block_key_query_context::segments`);
/// sequences with fewer segments leave the rest unwritten. Cost: group x head_dim x kept fused
/// multiply-adds and one read of B_k per (sequence, KV head, segment); 32 KB of static shared
/// memory for the staged rows, and the group's queries (8 KB at most).
struct packed_block_query_params {
  const float* q;                         ///< [batch][num_kv_heads x group][head_dim], unscaled
  const std::int32_t* slots;              ///< [batch] each sequence's slot (its segment arena row)
  const std::int32_t* sealed_pages;       ///< [batch] pages each sequence has: ceil(/ segment_pages) segments
  float* q_key;                           ///< [batch][num_kv_heads][segments_per_sequence][kept][query_heads]
  int num_kv_heads;
  int group_size;
  int query_heads;                        ///< the group padded to the scoring kernel's heads (4 or 8)
  packed_decode_params format;
};

inline constexpr int packed_block_query_columns = 64;  ///< channels a CTA rotates into
inline constexpr int packed_block_query_threads = 4 * packed_block_query_columns;  ///< a thread per (channel, head mod 4)

template <int HeadDim>
__global__ void __launch_bounds__(packed_block_query_threads) packed_block_queries_kernel(const packed_block_query_params p) {
  static_assert(HeadDim % 32 == 0, "head_dim is a multiple of 32");
  constexpr int threads = packed_block_query_threads, width = packed_block_query_columns;
  constexpr int round_rows = HeadDim < 128 ? HeadDim : 128;  // basis rows staged a round
  __shared__ __align__(16) float q[8 * HeadDim];
  __shared__ __align__(16) float basis[round_rows * width];  // [row][channel of the CTA]
  const packed_decode_params& f = p.format;
  const int parts = (f.kept + width - 1) / width;
  const int segment = static_cast<int>(blockIdx.x) / parts, part = static_cast<int>(blockIdx.x) % parts;
  const int head = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int group = p.group_size, tid = static_cast<int>(threadIdx.x);
  // The group's queries, loaded before anything waits: the caller's input, complete before the
  // metadata pull (an ordinary launch) started.
  constexpr int held_queries = 8 * HeadDim / threads;  // groups of up to 8 heads
  const float* source = p.q + (static_cast<std::size_t>(b) * p.num_kv_heads + head) * group * HeadDim;
  float held[held_queries];
#pragma unroll
  for (int j = 0; j < held_queries; ++j) held[j] = tid + j * threads < group * HeadDim ? __ldg(source + tid + j * threads) : 0.0f;
  // A launch as the metadata pull's programmatic dependent: the slots are read after it. Only
  // then may the next kernel be scheduled (the rest of the pull, then the scoring: each reads the
  // step's metadata, the pulled part included, before it waits for the kernel before it).
  detail::wait_for_prior_grid();
  detail::allow_dependent_grids();  // the scoring may stage its keys meanwhile
  const int sealed = __ldg(p.sealed_pages + b), slot = __ldg(p.slots + b);  // one round, together
  if (segment * f.segment_pages >= sealed) return;
  const int kept = f.kept, heads = p.query_heads;
  const int first_column = part * width, columns = min(width, kept - first_column);
  const int column = tid % width, head_slot = tid / width;  // a warp's lanes share the head: query loads broadcast
  const packed_entry e = packed_entry::at(f, HeadDim, p.num_kv_heads, slot, segment, head);
  // Rows [row0, row0 + round_rows) of the CTA's columns into `basis`, one commit group.
  const auto stage_rows = [&](int row0) {
    const float* from = e.k_basis + static_cast<std::size_t>(row0) * kept + first_column;
    if (kept % 4 == 0) {  // rows 16-byte aligned (entries are): 16-byte copies
      const int chunks = columns / 4;
      for (int x = tid; x < round_rows * chunks; x += threads) {
        const int i = x / chunks, c = 4 * (x % chunks);
        detail::async_copy<16>(basis + i * width + c, from + static_cast<std::size_t>(i) * kept + c);
      }
    } else {
      for (int x = tid; x < round_rows * columns; x += threads) {
        const int i = x / columns, c = x % columns;
        detail::async_copy<4>(basis + i * width + c, from + static_cast<std::size_t>(i) * kept + c);
      }
    }
    detail::async_copy_commit();
  };
  stage_rows(0);
#pragma unroll
  for (int j = 0; j < held_queries; ++j)
    if (tid + j * threads < group * HeadDim) q[tid + j * threads] = held[j];
  float acc[2] = {};  // heads head_slot and head_slot + 4
  for (int row0 = 0; row0 < HeadDim; row0 += round_rows) {
    if (row0 > 0) {
      __syncthreads();  // every thread is done with the previous round's rows
      stage_rows(row0);
    }
    detail::async_copy_wait<0>();
    __syncthreads();  // the round's rows (and the queries) are in shared memory
    if (column < columns) {
#pragma unroll 8
      for (int i = 0; i < round_rows; i += 4) {
        const float rows[4] = {basis[i * width + column], basis[(i + 1) * width + column], basis[(i + 2) * width + column],
                               basis[(i + 3) * width + column]};
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int g = head_slot + 4 * k;
          if (g < group) {
            const float4 x = *reinterpret_cast<const float4*>(q + g * HeadDim + row0 + i);
            acc[k] = __fmaf_rn(x.x, rows[0], acc[k]);
            acc[k] = __fmaf_rn(x.y, rows[1], acc[k]);
            acc[k] = __fmaf_rn(x.z, rows[2], acc[k]);
            acc[k] = __fmaf_rn(x.w, rows[3], acc[k]);
          }
        }
      }
    }
  }
  if (column >= columns) return;
  float* out = p.q_key + (((static_cast<std::size_t>(b) * p.num_kv_heads + head) * f.segments_per_sequence + segment) * kept +
                          first_column + column) * heads;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int g = head_slot + 4 * k;
    if (g < heads) out[g] = g < group ? acc[k] : 0.0f;
  }
}

}  // namespace kvmosaic::cuda::kernel
