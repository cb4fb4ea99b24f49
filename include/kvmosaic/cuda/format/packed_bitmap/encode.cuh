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

namespace detail_packed {

/// Input channels of the basis staged at a time by `rotate_tokens`.
template <int HeadDim>
inline constexpr int rotate_stage_rows = HeadDim >= 256 ? 16 : 32;

/// y[t][j] = sum_c x(t, c) B[c][j] for the first n <= Tokens tokens and the kept rotated channels
/// j: each a chain of fused multiply-adds from zero over c in order (the host's `fused_rotate`),
/// a thread per rotated channel (two at head_dim 256) running the tokens' chains in registers.
/// Per `rotate_stage_rows` input channels the CTA stages those rows of B (`basis(c, j)`, read
/// along B's rows where `along_rows`, else along its columns: whichever is coalesced) into
/// `staged` ([stage rows][HeadDim + 1]: no bank conflicts) and those channels of the tokens
/// (`x(t, c)`, zeros past n) into `xs`. Ends after a barrier, y written and `staged` free.
template <int HeadDim, int Tokens, int Threads, class Basis, class X>
__device__ __forceinline__ void rotate_tokens(int kept, int n, Basis&& basis, bool along_rows, X&& x, float* staged,
                                              float (*xs)[rotate_stage_rows<HeadDim>], float (*y)[HeadDim]) {
  constexpr int stage_rows = rotate_stage_rows<HeadDim>;
  constexpr int columns = (HeadDim + Threads - 1) / Threads;  // rotated channels a thread
  constexpr int stride = HeadDim + 1;
  const int tid = static_cast<int>(threadIdx.x);
  float acc[columns][Tokens] = {};
  for (int c0 = 0; c0 < HeadDim; c0 += stage_rows) {
    __syncthreads();  // the previous stage (or what the caller kept in `staged`) is read
    for (int index = tid; index < stage_rows * kept; index += Threads) {
      const int c = along_rows ? index / kept : index % stage_rows, j = along_rows ? index % kept : index / stage_rows;
      staged[c * stride + j] = basis(c0 + c, j);
    }
    for (int index = tid; index < Tokens * stage_rows; index += Threads) {
      const int t = index / stage_rows, c = index % stage_rows;
      xs[t][c] = t < n ? x(t, c0 + c) : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < stage_rows; ++c) {
      float b[columns];
#pragma unroll
      for (int k = 0; k < columns; ++k) {
        const int j = tid + k * Threads;
        b[k] = j < kept ? staged[c * stride + j] : 0.0f;
      }
#pragma unroll
      for (int t = 0; t < Tokens; ++t) {
        const float xt = xs[t][c];
#pragma unroll
        for (int k = 0; k < columns; ++k) acc[k][t] = fmaf(xt, b[k], acc[k][t]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < columns; ++k) {
    const int j = tid + k * Threads;
    if (j < kept)
#pragma unroll
      for (int t = 0; t < Tokens; ++t) y[t][j] = acc[k][t];
  }
  __syncthreads();  // y is written, `staged` is free
}

/// For tokens t < n of y and their groups j < `groups` of g adjacent channels: energy[t][j] = the
/// group's squares added in order from zero, each rounded to fp32 (the host's
/// `packed_group_energies`), then ranked(t, j, before) with the number of groups that rank before
/// it (`packed_group_order`: NaN first, then higher energy, then the lower group), a thread per
/// (token, group) each time. Barriers after each; `energy` may alias the staged basis.
template <int HeadDim, int Threads, class Ranked>
__device__ __forceinline__ void rank_groups(int n, int groups, int g, const float (*y)[HeadDim], float (*energy)[HeadDim], Ranked&& ranked) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int index = tid; index < n * groups; index += Threads) {
    const int t = index / groups, j = index % groups;
    float sum = 0.0f;
    for (int i = 0; i < g; ++i) sum = __fadd_rn(sum, __fmul_rn(y[t][j * g + i], y[t][j * g + i]));
    energy[t][j] = sum;
  }
  __syncthreads();
  for (int index = tid; index < n * groups; index += Threads) {
    const int t = index / groups, j = index % groups;
    const float mine = energy[t][j];
    int before = 0;
    for (int o = 0; o < groups; ++o) {
      const float other = energy[t][o];
      const bool ranks_before = isnan(other) != isnan(mine) ? isnan(other) : (other > mine || (!(other < mine) && o < j));
      before += o != j && ranks_before ? 1 : 0;
    }
    ranked(t, j, before);
  }
  __syncthreads();
}

}  // namespace detail_packed

/// Grid (pages, num_kv_heads, 2: K then V). Per 16 tokens the CTA rotates the rows
/// (`detail_packed::rotate_tokens`; B_v read from its transposed copy along channels), ranks
/// each token's groups by energy and writes its record. Static shared memory: the staged basis
/// rows (reused for the group energies), the staged row values, the rotated rows and the kept
/// flags of 16 tokens (about 28 KB at head_dim 128, 37 KB at 256).
template <class T, int HeadDim>
__global__ void __launch_bounds__(packed_encode_threads) encode_packed_pages_kernel(const packed_encode_params e) {
  constexpr int max_kept = HeadDim;
  constexpr int tokens = packed_encode_tokens;
  constexpr int stage_rows = detail_packed::rotate_stage_rows<HeadDim>;
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
    const auto basis = [&](int c, int j) {
      return which == 0 ? k_basis[static_cast<std::size_t>(c) * kept + j] : v_basis_t[static_cast<std::size_t>(j) * HeadDim + c];
    };
    const auto row_value = [&](int t, int c) { return to_float(rows[static_cast<std::size_t>(first + t) * HeadDim + c]); };
    detail_packed::rotate_tokens<HeadDim, tokens, packed_encode_threads>(kept, n, basis, which == 0, row_value, basis_rows, x, y);
    // A group is kept when fewer than keep_groups groups rank before it.
    detail_packed::rank_groups<HeadDim, packed_encode_threads>(n, groups, group, y, energy,
                                                               [&](int t, int j, int before) { keep[t][j] = before < keep_groups ? 1 : 0; });
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
