// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device encode of `format::packed_bitmap` pages (MosaicKV section 5.1) in their segment's
/// basis, the host encoder's records: y = x B (fp32, a fused multiply-add chain over the input
/// channels in order), the r / g groups of largest energy sum y_c^2 (NaN first, then energy, then
/// the lower group), a bitmap of one bit per group and the kept values rounded to the storage
/// dtype. The host multiplies with
/// Eigen's blocked product, whose summation order differs: a y may differ in its last fp32 bits,
/// so a value may round to the neighbouring 16-bit number and a group whose energy ties the
/// r-th within that difference may be swapped (the GPU test bounds both).

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/format/packed_bitmap/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// A pass over `n` pages of format::packed_bitmap, each in its segment: the dense rows of the
/// pass (slot i = [K: heads][V: heads] x rows_head_bytes, the first page_size rows 16-bit), the
/// page arena, page i's id and its segment (`segment_entries[i]`, an index of the engine's segment
/// arena: slot x segments_per_sequence + segment). The encoder reads the rows and writes the
/// pages (`packed_encode_params`); a compaction's unpack the reverse (`packed_unpack_params`).
template <class Rows, class Pages>
struct packed_pass_params {
  Rows* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  Pages* pages;
  std::int64_t page_slot_bytes;
  std::int64_t page_bytes;  ///< one K (= one V) page
  const std::int32_t* page_ids;
  const std::int32_t* segment_entries;
  int num_kv_heads;
  int page_size;
  packed_decode_params format;
};
using packed_encode_params = packed_pass_params<const std::byte, std::byte>;

constexpr int packed_encode_threads = 128;
/// Tokens whose rotated rows a CTA holds at once.
constexpr int packed_encode_tokens = 16;

/// Grid (pages, num_kv_heads, 2: K then V). Per 16 tokens the CTA stages the basis a few input
/// channels at a time in shared memory (32, 16 at head_dim 256; B_v read from its transposed
/// copy along channels), with those channels of the tokens' rows, and a thread per rotated
/// channel (two at head_dim 256) runs the 16 tokens' chains over them. Static shared memory: the
/// staged basis rows (reused for the group energies), the staged row values, the rotated rows and
/// the kept flags of 16 tokens (about 28 KB at head_dim 128, 37 KB at 256).
template <class T, int HeadDim>
__global__ void __launch_bounds__(packed_encode_threads) encode_packed_pages_kernel(const packed_encode_params e) {
  constexpr int max_kept = HeadDim;
  constexpr int tokens = packed_encode_tokens;
  constexpr int stage_rows = HeadDim >= 256 ? 16 : 32;                        // input channels staged at a time
  constexpr int columns = (max_kept + packed_encode_threads - 1) / packed_encode_threads;  // rotated channels a thread
  constexpr int stride = max_kept + 1;                                        // staged basis row (odd: no bank conflicts)
  static_assert(tokens * max_kept <= stage_rows * stride, "the group energies fit the staged basis");
  __shared__ float basis_rows[stage_rows * stride];  // [stage_rows][stride], then energy [tokens][max_kept]
  __shared__ float x[tokens][stage_rows];
  __shared__ float y[tokens][max_kept];
  __shared__ std::uint8_t keep[tokens][max_kept];
  float (*energy)[max_kept] = reinterpret_cast<float (*)[max_kept]>(basis_rows);
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int which = static_cast<int>(blockIdx.z);  // 0: K, 1: V
  const int tid = static_cast<int>(threadIdx.x);
  const packed_decode_params& f = e.format;
  const int kept = f.kept;
  const std::int64_t head_at = (static_cast<std::int64_t>(which == 0 ? 0 : e.num_kv_heads) + head) * e.rows_head_bytes;
  const auto* rows = reinterpret_cast<const T*>(e.rows + page_index * e.rows_slot_bytes + head_at);
  std::byte* page = e.pages + static_cast<std::int64_t>(e.page_ids[page_index]) * e.page_slot_bytes +
                    (static_cast<std::int64_t>(which == 0 ? 0 : e.num_kv_heads) + head) * e.page_bytes;
  const std::byte* entry = f.segments + (static_cast<std::int64_t>(e.segment_entries[page_index]) * e.num_kv_heads + head) * f.entry_bytes;
  const std::int64_t basis_floats = static_cast<std::int64_t>(HeadDim) * kept;
  const auto* k_basis = reinterpret_cast<const float*>(entry);
  const auto* v_basis_t = k_basis + basis_floats;
  const auto* strategy = reinterpret_cast<const std::int32_t*>(entry + 2 * basis_floats * 4);
  const int retained = strategy[which * 2], group = strategy[which * 2 + 1];
  if (head == 0 && which == 0 && tid == 0) f.page_segments[e.page_ids[page_index]] = e.segment_entries[page_index] % f.segments_per_sequence;
  const int groups = kept / group, keep_groups = retained / group;

  // The page is zeroed first: a record shorter than the slot leaves the rest zero, as the host's.
  for (std::int64_t i = tid; i < e.page_bytes / 16; i += packed_encode_threads)
    reinterpret_cast<uint4*>(page)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  for (int first = 0; first < e.page_size; first += tokens) {
    const int n = min(tokens, e.page_size - first);
    // y[t][j] = sum_c x[t][c] B[c][j], in channel order: one chain per (token, rotated channel).
    float acc[columns][tokens] = {};
    for (int c0 = 0; c0 < HeadDim; c0 += stage_rows) {
      __syncthreads();  // the previous stage (or the energies of the tokens before) is read
      if (which == 0) {
        for (int index = tid; index < stage_rows * kept; index += packed_encode_threads) {
          const int c = index / kept, j = index % kept;  // along B_k's rows
          basis_rows[c * stride + j] = k_basis[static_cast<std::size_t>(c0 + c) * kept + j];
        }
      } else {
        for (int index = tid; index < stage_rows * kept; index += packed_encode_threads) {
          const int c = index % stage_rows, j = index / stage_rows;  // along B_v^T's rows
          basis_rows[c * stride + j] = v_basis_t[static_cast<std::size_t>(j) * HeadDim + c0 + c];
        }
      }
      for (int index = tid; index < tokens * stage_rows; index += packed_encode_threads) {
        const int t = index / stage_rows, c = index % stage_rows;
        x[t][c] = t < n ? to_float(rows[static_cast<std::size_t>(first + t) * HeadDim + c0 + c]) : 0.0f;
      }
      __syncthreads();
#pragma unroll 4
      for (int c = 0; c < stage_rows; ++c) {
        float b[columns];
#pragma unroll
        for (int k = 0; k < columns; ++k) {
          const int j = tid + k * packed_encode_threads;
          b[k] = j < kept ? basis_rows[c * stride + j] : 0.0f;
        }
#pragma unroll
        for (int t = 0; t < tokens; ++t) {
          const float xt = x[t][c];
#pragma unroll
          for (int k = 0; k < columns; ++k) acc[k][t] = fmaf(xt, b[k], acc[k][t]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < columns; ++k) {
      const int j = tid + k * packed_encode_threads;
      if (j < kept)
#pragma unroll
        for (int t = 0; t < tokens; ++t) y[t][j] = acc[k][t];
    }
    __syncthreads();  // y is written, the staged basis is free for the energies
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      float sum = 0.0f;
      for (int i = 0; i < group; ++i) sum = __fadd_rn(sum, __fmul_rn(y[t][j * group + i], y[t][j * group + i]));
      energy[t][j] = sum;
    }
    __syncthreads();
    // A group is kept when fewer than keep_groups groups rank before it.
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      const float mine = energy[t][j];
      int before = 0;
      for (int o = 0; o < groups; ++o) {
        const float other = energy[t][o];
        const bool ranks_before = isnan(other) != isnan(mine) ? isnan(other) : (other > mine || (!(other < mine) && o < j));
        before += o != j && ranks_before ? 1 : 0;
      }
      keep[t][j] = before < keep_groups ? 1 : 0;
    }
    __syncthreads();
    const int words = (groups + 31) / 32;
    for (int index = tid; index < n * words; index += packed_encode_threads) {
      const int t = index / words, wd = index % words;
      std::uint32_t bits = 0;
      for (int b = 0; b < 32 && wd * 32 + b < groups; ++b) bits |= static_cast<std::uint32_t>(keep[t][wd * 32 + b]) << b;
      reinterpret_cast<std::uint32_t*>(page)[static_cast<std::size_t>(first + t) * f.words + wd] = bits;
    }
    for (int index = tid; index < n * groups; index += packed_encode_threads) {
      const int t = index / groups, j = index % groups;
      if (keep[t][j] == 0) continue;
      int at = 0;
      for (int o = 0; o < j; ++o) at += keep[t][o];
      auto* values = reinterpret_cast<std::uint16_t*>(page + f.bitmap_bytes) + static_cast<std::size_t>(first + t) * f.retained;
      for (int i = 0; i < group; ++i) values[at * group + i] = T(y[t][j * group + i]).bits;
    }
    __syncthreads();
  }
}

}  // namespace kvmosaic::cuda::kernel
