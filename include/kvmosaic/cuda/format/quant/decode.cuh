// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Decode split kernel for `format::quant<Bits, ValueAxis>` pages (HACK, Eq. 4): attention on the
/// 2- or 4-bit codes with int8 tensor cores (`quant_warp_attend`); the cache is never dequantized. The dense tail is
/// folded in fp32 by the same collective. Partial states merge with the dense path's
/// `merge_splits_kernel`.

#include <cstddef>
#include <cstdint>

#include "kvmosaic/cuda/format/quant/attend.cuh"
#include "kvmosaic/cuda/detail/bulk_copy.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"

namespace kvmosaic::cuda::kernel {

/// The quantized formats' fields of their split kernel's params.
struct quant_decode_params {
  int stages;  ///< sm_90: compressed page pairs in flight per warp
};

/// Dynamic shared memory of the quantized formats' kernel: per-warp barriers, the group's scaled queries, one
/// `temp_storage` per warp, then `stages` compressed page pairs (K and V) per warp. The CTA's
/// final reduction reuses the stage area. The same for either storage type (the collective's
/// scratch holds no stored value; `attend` is the f16 instantiation, the bf16 one is checked
/// equal in the kernel).
template <int HeadDim, int Partition, class Format>
struct quant_decode_layout {
  static constexpr int warps = 4;
  static constexpr int max_stages = 4;
  using attend = quant_warp_attend<HeadDim, Partition, half, Format>;
  static constexpr int max_group = attend::max_group;
  static constexpr int barrier_offset = 0;
  static constexpr int query_offset = 128;
  static constexpr int temp_offset = query_offset + (max_group * HeadDim * 4 + 127) / 128 * 128;
  static constexpr int stage_offset =
      temp_offset + (warps * static_cast<int>(sizeof(typename attend::temp_storage)) + 127) / 128 * 128;
  using reduction_storage = decode_temp_storage<max_group, HeadDim, warps>;
  static constexpr int reduction_bytes = static_cast<int>(sizeof(reduction_storage));
  /// Total bytes for `stages` page pairs of `stage_bytes` per warp.
  static constexpr int bytes(int stage_bytes, int stages) {
    const int stage_area = warps * stages * stage_bytes;
    return stage_offset + (stage_area > reduction_bytes ? stage_area : reduction_bytes);
  }
};

/// The quantized formats' split kernel. Each of the 4 warps takes every 4th page of the split and streams it
/// through its own ring of `p.format.stages` shared-memory slots: with `BulkCopy` (sm_90), lane 0 issues
/// one bulk copy per page and cache on the slot's mbarrier, `stages` pages ahead; without (the
/// portable path, sm_75+), the warp copies each page with 16-byte loads before folding it. Warps
/// never wait for each other until the tail and the CTA reduction.
/// The GQA group size is `p.group_size` (1-8), a run-time value: one instantiation per (element
/// type, head_dim, Pi, format (code width and V axis), copy path, `RowMasks`: whether a token-granular selection's row masks are
/// read; without, the code has no mask test: benchmark/README.md, "Decisions the code cites";
/// `Logits`: whether a step with token scores writes its rows' logits, `decode_params::token_logits`;
/// without, the code has no store: a runtime test alone slowed steps without scores,
/// benchmark/README.md).
/// Grid: (splits capacity, num_kv_heads).
template <class T, int HeadDim, int Partition, class Format, bool BulkCopy, bool RowMasks = false, bool Logits = false>
__global__ void __launch_bounds__(128) decode_partial_quant_kernel(const __grid_constant__ split_params<quant_decode_params> p) {
  using layout = quant_decode_layout<HeadDim, Partition, Format>;
  using attend = quant_warp_attend<HeadDim, Partition, T, Format>;
  static_assert(sizeof(typename attend::temp_storage) == sizeof(typename layout::attend::temp_storage) &&
                    attend::max_group == layout::max_group,
                "decode_partial_quant_kernel: the shared-memory layout must not depend on the storage type");
  constexpr int warps = layout::warps, threads = warps * 32;
  extern __shared__ __align__(128) std::byte quant_shared[];
  const int work_index = static_cast<int>(blockIdx.x);
  split_work w;
  if (!detail_decode::start_split(p, work_index, w)) return;
  const int head = static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int stages = BulkCopy ? p.format.stages : 1;
  const auto k_bytes = static_cast<int>(p.k_page_bytes), v_bytes = static_cast<int>(p.v_page_bytes);
  const int stage_bytes = k_bytes + v_bytes;

  auto* full = reinterpret_cast<std::uint64_t*>(quant_shared + layout::barrier_offset) + warp * layout::max_stages;
  auto* q = reinterpret_cast<float*>(quant_shared + layout::query_offset);
  auto& temp = reinterpret_cast<typename attend::temp_storage*>(quant_shared + layout::temp_offset)[warp];
  std::byte* ring = quant_shared + layout::stage_offset + warp * stages * stage_bytes;

  const int group = p.group_size, num_q_heads = p.num_kv_heads * group;
  const float* q_group = p.q + (static_cast<std::size_t>(w.batch_index) * num_q_heads + head * group) * HeadDim;
  for (int i = tid; i < group * HeadDim; i += threads) q[i] = __fmul_rn(q_group[i], p.softmax_scale);
  if constexpr (BulkCopy) {
    if (lane == 0)
      for (int b = 0; b < stages; ++b) detail::barrier_init(&full[b], 1);
  }
  attend state;
  state.start(group, temp);
  __syncthreads();  // q and the barriers are ready

  const detail_decode::split_pages range =
      RowMasks ? detail_decode::pages_of_split(p, w, head) : detail_decode::split_pages{w.page_begin, w.page_end};
  const std::int32_t* table = detail_decode::page_table(p, w.batch_index, head) + range.begin;
  const int num_pages = range.end - range.begin;
  // A step with token scores: every row's logits, at the split's place in the read order.
  float* const split_logits = Logits ? detail_decode::split_logits(p, w, head, range, group) : nullptr;
  const int my_pages = num_pages > warp ? (num_pages - warp + warps - 1) / warps : 0;
  const quant_page_geometry geometry = quant_page_geometry::of(p.page_size, HeadDim, Partition, Format::bits);
  const auto page_of = [&](int k) {
    return p.pages + static_cast<std::size_t>(table[warp + k * warps]) * p.page_slot_bytes;
  };
  const auto issue = [&](int k) {  // lane 0: this warp's k-th page into slot k % stages
    const int slot = k % stages;
    const std::byte* page = page_of(k);
    detail::barrier_arrive_expect(&full[slot], static_cast<std::uint32_t>(stage_bytes));
    std::byte* destination = ring + slot * stage_bytes;
    detail::bulk_copy_to_shared(destination, page + head * p.k_page_bytes, static_cast<std::uint32_t>(k_bytes), &full[slot]);
    detail::bulk_copy_to_shared(destination + k_bytes, page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes,
                                static_cast<std::uint32_t>(v_bytes), &full[slot]);
  };
  if constexpr (BulkCopy) {
    if (lane == 0)
      for (int k = 0; k < min(stages, my_pages); ++k) issue(k);
  }
  for (int k = 0; k < my_pages; ++k) {
    const int slot = k % stages;
    std::byte* k_page = ring + slot * stage_bytes;
    if constexpr (BulkCopy) {
      detail::barrier_wait(&full[slot], static_cast<std::uint32_t>((k / stages) & 1));
    } else {
      const std::byte* page = page_of(k);
      const std::byte* sources[2] = {page + head * p.k_page_bytes,
                                     page + p.num_kv_heads * p.k_page_bytes + head * p.v_page_bytes};
      const int sizes[2] = {k_bytes, v_bytes};
      std::byte* destination = k_page;
      for (int part = 0; part < 2; ++part) {
        for (int at = lane * 16; at < sizes[part]; at += 32 * 16)
          *reinterpret_cast<uint4*>(destination + at) = *reinterpret_cast<const uint4*>(sources[part] + at);
        destination += sizes[part];
      }
      __syncwarp();
    }
    // The sequence's first page (warp 0's first page of the split that starts the sequence, when
    // it is the sequence's page 0: a selection may skip it) masks its sink tokens: they are
    // attended below, as the dense rows the tail slot keeps.
    const int masked = k == 0 && warp == 0 && range.begin == 0 && p.sink_rows > 0 &&
                               table[0] == p.sequence_tables[static_cast<std::size_t>(w.batch_index) * p.step_header[3]]
                           ? p.sink_rows
                           : 0;
    const std::uint32_t* rows_read =
        RowMasks ? detail_decode::page_rows_read(p, w.batch_index, head, range.begin + warp + k * warps) : nullptr;
    if (!Logits || split_logits == nullptr) {  // a step without scores
      for (int j = 0; j < geometry.per_channel; ++j)
        if (!RowMasks || attend::reads_partition(rows_read, j, j == 0 ? masked : 0))
          state.fold_partition(k_page, k_page + k_bytes, geometry, j, q, temp, j == 0 ? masked : 0, rows_read);
    } else {  // every row's logits, -inf for a partition not folded
      float* const page_logits = split_logits + static_cast<std::size_t>(warp + k * warps) * p.page_size * group;
      for (int j = 0; j < geometry.per_channel; ++j) {
        if (attend::reads_partition(RowMasks ? rows_read : nullptr, j, j == 0 ? masked : 0))
          state.fold_partition(k_page, k_page + k_bytes, geometry, j, q, temp, j == 0 ? masked : 0, rows_read, page_logits);
        else
          state.write_masked_logits(page_logits, j);
      }
    }
    __syncwarp();  // every lane is done with the slot
    if constexpr (BulkCopy) {
      if (lane == 0 && k + stages < my_pages) issue(k + stages);
    }
  }
  if (w.with_tail) {  // the exact rows (sinks, recent window) and the tail rows, one dense run
    const detail_decode::dense_run run = detail_decode::dense_rows_of(p, w.batch_index);
    const std::byte* tail_slot = p.tails + static_cast<std::size_t>(p.tail_slots[w.batch_index]) * p.tail_slot_bytes;
    const auto* k_rows = reinterpret_cast<const T*>(tail_slot + head * p.tail_head_bytes) + static_cast<std::size_t>(run.first) * HeadDim;
    const auto* v_rows =
        reinterpret_cast<const T*>(tail_slot + (p.num_kv_heads + head) * p.tail_head_bytes) + static_cast<std::size_t>(run.first) * HeadDim;
    const int rows = run.rows;
    for (int first = warp * 16; first < rows; first += warps * 16) {
      const std::size_t skip = static_cast<std::size_t>(first) * HeadDim;
      float* const run_logits =
          Logits && split_logits != nullptr ? split_logits + (static_cast<std::size_t>(num_pages) * p.page_size + first) * group : nullptr;
      state.fold_dense_rows(k_rows + skip, v_rows + skip, min(16, rows - first), q, run_logits);
    }
  }
  __syncthreads();  // every warp is done with the stage area
  auto& reduction = *reinterpret_cast<typename layout::reduction_storage*>(quant_shared + layout::stage_offset);
  state.for_each_output([&](int g, int c, float o) { reduction.o[warp][g][c] = o; },
                        [&](int g, float m, float l) {
                          reduction.m[warp][g] = m;
                          reduction.l[warp][g] = l;
                        });
  detail_decode::merge_and_write_partial<HeadDim, layout::max_group, threads, warps>(p, work_index, head, reduction,
                                                                                   group);
}

}  // namespace kvmosaic::cuda::kernel
