// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `format::packed_bitmap`'s strategy search on the device (MosaicKV section 5.5): the sums a
/// segment's search chooses its strategies from, in the host's order to the bit
/// (`detail::packed_search_chunk_rows` defines it), so that the host only compares the
/// candidates' losses (`format_traits::search_segment_from_sums`) and no row crosses the bus.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/format/packed_bitmap/encode.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/segment_sums.cuh"
#include "kvmosaic/format/packed_bitmap.hpp"

namespace kvmosaic::cuda::kernel {

/// The search's sums of a segment's rows (`rows`, `packed_sum_rows`) in its bases (`bases`:
/// [num_kv_heads][2: K, V][head_dim][kept], fp32, as the host plan holds them) for the
/// `candidates` strategies (r, g) of `detail::packed_candidates`, in its order: `sums` holds
/// [num_kv_heads][chunks][2][detail::packed_search_sum_count] doubles.
struct packed_search_params {
  packed_sum_rows rows;
  const float* bases;
  double* sums;
  int kept;
  int candidates;
  int retained[::kvmosaic::detail::packed_max_candidates];
  int group[::kvmosaic::detail::packed_max_candidates];
};

inline constexpr int packed_search_threads = 128;

/// One chunk of `detail::packed_search_chunk_rows` rows of one KV head's K or V (grid: (chunks,
/// num_kv_heads, 2)). Per 16 rows the CTA rotates them (`detail_packed::rotate_tokens`: the
/// host's `fused_rotate`), then per group size of the candidates a thread per (row, group) adds
/// the group's squares in order (each rounded to fp32, as the host) and ranks it
/// (`detail_packed::rank_groups`, as the encoder does), and a thread per (row, candidate) adds the
/// energies of the groups the candidate keeps in group order from zero (fp64); a thread per row
/// sums its squared norm in channel order. A thread per sum then adds the 16 rows in order to
/// the chunk's. A row with a NaN energy makes its group size's sums NaN. Cost per row:
/// head_dim x kept fused multiply-adds, (kept / g)^2 comparisons per group size; static shared
/// memory about 30 KB at head_dim 128, 43 KB at 256.
template <int HeadDim>
__global__ void __launch_bounds__(packed_search_threads) packed_search_sums_kernel(const packed_search_params p) {
  constexpr int tokens = packed_encode_tokens, threads = packed_search_threads;
  constexpr int stage_rows = detail_packed::rotate_stage_rows<HeadDim>;
  constexpr int stride = HeadDim + 1;
  constexpr int sum_count = ::kvmosaic::detail::packed_search_sum_count;
  static_assert(tokens * HeadDim <= stage_rows * stride, "the group energies fit the staged basis");
  __shared__ float staged[stage_rows * stride];  // the basis rows, then energy [tokens][HeadDim]
  __shared__ float x[tokens][stage_rows];
  __shared__ float y[tokens][HeadDim];
  __shared__ std::int16_t rank[tokens][HeadDim];
  __shared__ double row_sums[tokens][sum_count];
  float (*energy)[HeadDim] = reinterpret_cast<float (*)[HeadDim]>(staged);
  const int chunk = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), which = static_cast<int>(blockIdx.z);
  const int tid = static_cast<int>(threadIdx.x), kept = p.kept;
  const std::int64_t first_row = static_cast<std::int64_t>(chunk) * ::kvmosaic::detail::packed_search_chunk_rows;
  const int rows = static_cast<int>(min(static_cast<std::int64_t>(::kvmosaic::detail::packed_search_chunk_rows), p.rows.n - first_row));
  const float* basis = p.bases + (static_cast<std::size_t>(head) * 2 + which) * HeadDim * kept;
  double chunk_sum = 0;  // thread i < 1 + candidates: sum i of the chunk (0: the squared norms)
  for (int first = 0; first < rows; first += tokens) {
    const int n = min(tokens, rows - first);
    const auto element = [&](int t, int c) { return detail_packed::segment_element(p.rows, HeadDim, which, head, first_row + first + t, c); };
    const auto basis_at = [&](int c, int j) { return basis[static_cast<std::size_t>(c) * kept + j]; };
    detail_packed::rotate_tokens<HeadDim, tokens, threads>(kept, n, basis_at, true, element, staged, x, y);
    if (tid < n) {  // the row's squared norm, in channel order (each square exact in fp64)
      double norm = 0;
      for (int c = 0; c < HeadDim; ++c) {
        const double v = element(tid, c);
        norm = __dadd_rn(norm, __dmul_rn(v, v));
      }
      row_sums[tid][0] = norm;
    }
    for (int g = 4; g >= 1; g /= 2) {
      bool tried = false;
      for (int i = 0; i < p.candidates; ++i) tried = tried || p.group[i] == g;
      if (!tried) continue;  // the same for the whole CTA
      const int groups = kept / g;
      __syncthreads();  // the previous group size's ranks and energies are read
      detail_packed::rank_groups<HeadDim, threads>(n, groups, g, y, energy,
                                                   [&](int t, int j, int before) { rank[t][j] = static_cast<std::int16_t>(before); });
      for (int index = tid; index < n * p.candidates; index += threads) {
        const int t = index / p.candidates, i = index % p.candidates;
        if (p.group[i] != g) continue;
        const int keep = p.retained[i] / g;
        double sum = 0;
        bool nan = false;
        for (int j = 0; j < groups; ++j) {
          nan = nan || isnan(energy[t][j]);
          if (rank[t][j] < keep) sum = __dadd_rn(sum, static_cast<double>(energy[t][j]));
        }
        row_sums[t][1 + i] = nan ? __longlong_as_double(0x7ff8000000000000ll) : sum;
      }
    }
    __syncthreads();  // the rows' sums are written
    if (tid < 1 + p.candidates)
      for (int t = 0; t < n; ++t) chunk_sum = __dadd_rn(chunk_sum, row_sums[t][tid]);
  }
  if (tid < sum_count) {
    double* out = p.sums + ((static_cast<std::size_t>(head) * gridDim.x + chunk) * 2 + which) * sum_count;
    out[tid] = tid < 1 + p.candidates ? chunk_sum : 0.0;
  }
}

}  // namespace kvmosaic::cuda::kernel
