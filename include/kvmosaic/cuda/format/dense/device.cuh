// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// format::dense on the device (cuda/format/device_format.cuh says what a device part provides):
/// rows are copied into pages as they are (no encode pass); decode runs the sm_90 TMA +
/// tensor-core kernel where the page size divides or is a multiple of its 64-token stage, the
/// sm_90 bulk-copy pipeline for other page sizes, and the portable SIMT kernel before sm_90.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/dense/decode.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/dense.hpp"

namespace kvmosaic::cuda {

template <>
struct device_format<format::dense> {
  static constexpr bool encodes_pages = false;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  static constexpr std::int32_t split_page_multiple = 1;
  static constexpr bool writes_token_logits = true;  ///< every dense split kernel (select::tova, select::h2o)
  static constexpr bool writes_exact_logits = true;  ///< fp32 q . k (sm_90: q in two 16-bit halves)
  using params = kernel::dense_decode_params;

  struct state {
    bool tma = false;  ///< the sm_90 TMA kernel (else bulk copies on sm_90, or the portable kernel)
    int stages = 0;    ///< no run-time stages: the TMA stages are tuning (decode_tuning::tma_stages)
    params maps{};
  };

  static void validate(const format::dense&, const kvmosaic::detail::engine_shape&) {}

  /// The TMA kernel needs page sizes that divide or are multiples of its 64-token box, and row
  /// indices of both arenas below 2^31.
  template <class Shapes>
  static void configure(state& s, const format::dense&, device_context& e) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const std::int64_t tail_head_rows = static_cast<std::int64_t>(e.geometry->tail_head_bytes / e.geometry->row_bytes);
    const std::int64_t arena_rows = std::max<std::int64_t>(static_cast<std::int64_t>(shape.max_pages) * shape.page_size,
                                                           static_cast<std::int64_t>(shape.max_sequences) * tail_head_rows) *
                                    2 * shape.num_kv_heads;
    s.tma = e.bulk_copy && (shape.page_size % 64 == 0 || 64 % shape.page_size == 0) && arena_rows < (std::int64_t{1} << 31);
    if (s.tma) {
      s.maps.page_rows = row_map(e, e.pages, static_cast<std::uint64_t>(shape.max_pages) * 2 * shape.num_kv_heads * shape.page_size);
      s.maps.tail_rows = row_map(e, e.tails, static_cast<std::uint64_t>(shape.max_sequences) * 2 * shape.num_kv_heads * tail_head_rows);
    }
  }

  template <class Shapes, bool /*Logits: its kernels branch on the step at run time*/ = false, class F>
  static void with_decode_kernel(const state& s, const format::dense&, const device_context& e, bool /*row_masks*/, F&& f) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
      if (s.tma) {
        constexpr int stage_tokens = 64, stages = t.tma_stages;
        using layout = kernel::tma_decode_layout<T, head_dim, stage_tokens, stages, t.max_pages_per_split>;
        f(kernel::decode_partial_tma_kernel<T, head_dim, group_size, stage_tokens, stages, t.max_pages_per_split>, 128,
          layout::bytes);
      } else if (e.bulk_copy) {
        using layout = kernel::bulk_decode_layout<T, head_dim, group_size, t.stage_tokens, t.stages, t.max_pages_per_split>;
        f(kernel::decode_partial_bulk_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll, t.stage_tokens,
                                             t.stages, t.max_pages_per_split>,
          t.threads, layout::bytes);
      } else {
        f(kernel::decode_partial_kernel<format::dense, T, head_dim, group_size, t.threads, t.unroll>, t.threads, 0);
      }
    });
  }

  static params params_for(const state& s, const format::dense&, const device_context&) { return s.maps; }

  /// The sm_90 kernels keep a split's page ids in shared memory.
  static int max_pages_per_split(const state&, const decode_tuning& t) { return t.max_pages_per_split; }

  /// The TMA kernel multiplies p.v on tensor cores, p split into two 16-bit halves.
  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.tma; }

 private:
  /// A 2D tensor map over `rows` rows of head_dim 16-bit values at `base`, boxes of 64 channels x
  /// min(page_size, 64) rows, 128-byte swizzle (the layout the TMA kernel reads with ldmatrix).
  static CUtensorMap row_map(const device_context& e, void* base, std::uint64_t rows) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    cudaDriverEntryPointQueryResult status{};
    KVMOSAIC_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                                         12000, cudaEnableDefault, &status));
    kvmosaic::detail::require(status == cudaDriverEntryPointSuccess && encode != nullptr, "cuda::engine",
                              "cuTensorMapEncodeTiled", "missing", "a driver with TMA (CUDA 12+)");
    CUtensorMap map{};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(shape.head_dim), rows};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(shape.head_dim) * 2};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(std::min(shape.page_size, 64))};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result =
        encode(&map, shape.storage == dtype::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
               base, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    kvmosaic::detail::require(result == CUDA_SUCCESS, "cuda::engine", "cuTensorMapEncodeTiled result",
                              static_cast<int>(result), "CUDA_SUCCESS");
    return map;
  }
};

}  // namespace kvmosaic::cuda
