// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device unpack of `format::packed_bitmap` pages, the inverse of `encode_packed_pages_kernel`
/// for a compaction: each record's retained values back at their rotated channels (zeros
/// elsewhere), rotated back to head_dim space in the segment the page was sealed in (x = y B^T,
/// fp32, the kept channels summed in order) and rounded to the storage dtype: the host's
/// `format_traits<packed_bitmap>::decode_k/v`, whose Eigen product sums in another order (a row
/// may differ in its last fp32 bits, and so round to the neighbouring 16-bit number). A
/// compaction then moves the rows and encodes the pages it writes in their own segments.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/format/packed_bitmap/encode.cuh"

namespace kvmosaic::cuda::kernel {

/// Pages `page_ids[i]` unpacked, each in its segment, to the rows (`packed_pass_params`).
using packed_unpack_params = packed_pass_params<std::byte, const std::byte>;

constexpr int packed_unpack_threads = 128;
/// Tokens whose rotated rows a CTA holds at once.
constexpr int packed_unpack_tokens = 16;

/// Grid (pages, num_kv_heads, 2: K then V); static shared memory: the rotated rows of 16 tokens
/// at kept <= head_dim (8 KB at head_dim 128). Per 16 tokens: the values scattered to their
/// channels (a thread per token and group: the popcount of the bits before it), then a thread
/// per (token, channel) sums y_j B_cj over the kept channels. Cost per page and head, K or V:
/// page_size x head_dim x kept FMAs, one read of the records and of the basis (from L2 after
/// the first page), one write of the rows.
template <class T, int HeadDim>
__global__ void __launch_bounds__(packed_unpack_threads) unpack_packed_pages_kernel(const packed_unpack_params u) {
  constexpr int tokens = packed_unpack_tokens;
  __shared__ float y[tokens][HeadDim];
  const int page_index = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int which = static_cast<int>(blockIdx.z);  // 0: K, 1: V
  const int tid = static_cast<int>(threadIdx.x);
  const packed_decode_params& f = u.format;
  const int kept = f.kept;
  const std::int64_t head_at = static_cast<std::int64_t>(which == 0 ? 0 : u.num_kv_heads) + head;
  const std::byte* page = u.pages + static_cast<std::int64_t>(u.page_ids[page_index]) * u.page_slot_bytes + head_at * u.page_bytes;
  auto* rows = reinterpret_cast<T*>(u.rows + page_index * u.rows_slot_bytes + head_at * u.rows_head_bytes);
  const std::byte* entry = f.segments + (static_cast<std::int64_t>(u.segment_entries[page_index]) * u.num_kv_heads + head) * f.entry_bytes;
  const std::int64_t basis_floats = static_cast<std::int64_t>(HeadDim) * kept;
  const auto* k_basis = reinterpret_cast<const float*>(entry);    // [HeadDim][kept]
  const auto* v_basis_t = k_basis + basis_floats;                 // [kept][HeadDim]
  const auto* strategy = reinterpret_cast<const std::int32_t*>(entry + 2 * basis_floats * 4);
  const int group = strategy[which * 2 + 1];
  const int groups = kept / group, words = (groups + 31) / 32;
  const auto* bits = reinterpret_cast<const std::uint32_t*>(page);
  const auto* values = reinterpret_cast<const std::uint16_t*>(page + f.bitmap_bytes);

  for (int first = 0; first < u.page_size; first += tokens) {
    const int n = min(tokens, u.page_size - first);
    // y[t][j * g + i]: the record's value (set bits before group j) x g + i, or zero.
    for (int index = tid; index < n * groups; index += packed_unpack_threads) {
      const int t = index / groups, j = index % groups;
      const std::uint32_t* record = bits + static_cast<std::size_t>(first + t) * f.words;
      const std::uint32_t word = record[j / 32];
      const bool set = ((word >> (j % 32)) & 1u) != 0;
      int before = __popc(word & ((1u << (j % 32)) - 1u));
      for (int w = 0; w < j / 32 && w < words; ++w) before += __popc(record[w]);
      const std::uint16_t* at = values + static_cast<std::size_t>(first + t) * f.retained + before * group;
      for (int i = 0; i < group; ++i) y[t][j * group + i] = set ? to_float(T::from_bits(at[i])) : 0.0f;
    }
    __syncthreads();
    for (int index = tid; index < n * HeadDim; index += packed_unpack_threads) {
      const int t = index / HeadDim, c = index % HeadDim;
      float x = 0.0f;
      for (int j = 0; j < kept; ++j) x = fmaf(y[t][j], which == 0 ? k_basis[c * kept + j] : v_basis_t[j * HeadDim + c], x);
      rows[static_cast<std::size_t>(first + t) * HeadDim + c] = T(x);
    }
    __syncthreads();
  }
}

}  // namespace kvmosaic::cuda::kernel
