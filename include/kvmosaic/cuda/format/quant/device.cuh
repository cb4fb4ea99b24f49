// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// format::quant<Bits, ValueAxis> (HACK; quant2, quant4) on the device
/// (cuda/format/device_format.cuh says what a device part provides): completed pages are quantized
/// by `encode_quant_pages_kernel` (bytes equal to the host encoder's); decode computes on the codes
/// with int8 tensor cores (`decode_partial_quant_kernel`), each of 4 warps streaming its own pages
/// through shared-memory stages with bulk copies on sm_90, one stage with plain loads before. K is
/// read partitioned per channel (`key_axis::tokens`); the per-token K layout runs on the host
/// backend. V runs either way (the axis is a template parameter of the format and the kernel).

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/format/quant/decode.cuh"
#include "kvmosaic/cuda/format/quant/encode.cuh"
#include "kvmosaic/cuda/format/quant/unpack.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/quant.hpp"

namespace kvmosaic::cuda {

template <int Bits, format::value_axis ValueAxis>
struct device_format<format::quant<Bits, ValueAxis>> {
  using format_type = format::quant<Bits, ValueAxis>;
  static constexpr bool encodes_pages = true;
  /// The split kernel masks the sinks of a sequence's first page (`decode_partial_quant_kernel`'s
  /// `masked`): a step whose only exact rows are sinks runs the kernel without row masks.
  static constexpr bool masks_sink_rows = true;
  /// Split sizes in multiples of the kernel's 4 warps, which deal a split's pages among them (so
  /// none idles at the end of a split: 3% at batch 8, 128K).
  static constexpr std::int32_t split_page_multiple = 4;
  /// Both paths write each row's logits for a step with token scores (select::tova, select::h2o),
  /// in the kernels `with_decode_kernel<Shapes, true>` hands out (an engine whose selector reads
  /// scores takes those, every other engine the kernels without the stores):
  /// HACK's, from the 8-bit q' and the codes, as the softmax takes them: not the exact q . k of
  /// the dequantized keys, so `cache::window_votes` scores those on the host.
  static constexpr bool writes_token_logits = true;
  using params = kernel::quant_decode_params;

  struct state {
    int stages = 1;  ///< compressed page pairs in flight per warp (sm_90; 1 on the portable path)
  };

  static void validate(const format_type& f, const kvmosaic::detail::engine_shape& shape) {
    kvmosaic::detail::require(f.k_axis == format::key_axis::tokens, "cuda::engine", k_axis_name(),
                              "key_axis::head_dim",
                              "key_axis::tokens (the CUDA kernels read K partitioned per channel; the per-token "
                              "layout runs on the host backend)");
    dispatch_partition(shape.head_dim, f.partition, [](auto, auto) {});  // rejects Pi > head_dim
  }

  /// Up to 4 CTAs per SM (as tuned) and up to 4 stages per warp.
  template <class Shapes>
  static void configure(state& s, const format_type& f, device_context& e) {
    s.stages = 1;
    if (!e.bulk_copy) return;
    int registers = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int) {
      cudaFuncAttributes attributes{};
      KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
      registers = attributes.numRegs;
    });
    const int pair = 4 * static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);  // a page pair per warp
    int stage_offset = 0;
    dispatch_partition(e.shape->head_dim, f.partition, [&](auto dim, auto partition) {
      stage_offset = kernel::quant_decode_layout<decltype(dim)::value, decltype(partition)::value, format_type>::stage_offset;
    });
    const int stages = detail::stages_for(e.device, registers, 4, 4, [&](int n) { return stage_offset + 1024 + n * pair; });
    if (stages == 0) {
      e.bulk_copy = false;  // not even one page pair per warp fits: plain loads
      return;
    }
    s.stages = stages;
  }

  /// The group size is a run-time value of this kernel: instantiations per (type, head_dim, Pi).
  template <class Shapes, bool Logits = false, class F>
  static void with_decode_kernel(const state& s, const format_type& f, const device_context& e, bool row_masks, F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const int stage_bytes = static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      dispatch_partition_of<head_dim>(f.partition, [&](auto partition) {
        constexpr int pi = decltype(partition)::value;
        using layout = kernel::quant_decode_layout<head_dim, pi, format_type>;
        // Row masks and logits: their own instantiations (an engine takes the logit-writing ones
        // only, where its selector reads token scores).
        if (e.bulk_copy && row_masks)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, true, true, Logits>, 128,
               layout::bytes(stage_bytes, s.stages));
        else if (e.bulk_copy)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, true, false, Logits>, 128,
               layout::bytes(stage_bytes, s.stages));
        else if (row_masks)
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, false, true, Logits>, 128,
               layout::bytes(stage_bytes, 1));
        else
          call(kernel::decode_partial_quant_kernel<T, head_dim, pi, format_type, false, false, Logits>, 128,
               layout::bytes(stage_bytes, 1));
      });
    });
  }

  static params params_for(const state& s, const format_type&, const device_context&) { return params{s.stages}; }

  /// Page ids are read from the block table: no limit.
  static int max_pages_per_split(const state&, const decode_tuning&) { return 1 << 30; }

  /// p is quantized to 8 bits (Eq. 4), not split into 16-bit halves.
  static bool splits_p_on_tensor_cores(const state&, const device_context&) { return false; }

  /// Quantizes `n` completed pages (K and V of every KV head): one CTA per (page, head, K or V);
  /// a sequence's first page is quantized with its sinks hidden (`detail::hides_sink_rows`).
  template <class Shapes>
  static void encode_pages(const state&, const format_type& f, const encode_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    kernel::quant_encode_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.sink_rows = static_cast<int>(g.sink_rows);
    p.sink_slots = c.sink_slots;
    p.new_pages = c.page_ids;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.partition = f.partition;
    p.stochastic = f.mode == format::rounding::stochastic;
    p.seed = f.seed;
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    const int code_bytes = shape.page_size * shape.head_dim;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      const auto encode = kernel::encode_quant_pages_kernel<S, head_dim, format_type>;
      encode<<<grid, kernel::quant_encode_threads, detail::opted_in_shared(encode, code_bytes), e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Unpacks `n` pages to dense rows (a compaction's sources): one CTA per (page, head, K or V).
  template <class Shapes>
  static void unpack_pages(const state&, const format_type& f, const unpack_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const kernel::quant_unpack_params p{c.rows,
                                         static_cast<std::int64_t>(g.tail_slot_bytes()),
                                         static_cast<std::int64_t>(g.tail_head_bytes),
                                         e.pages,
                                         static_cast<std::int64_t>(g.page_slot_bytes()),
                                         static_cast<std::int64_t>(g.k_page_bytes),
                                         c.page_ids,
                                         shape.num_kv_heads,
                                         shape.page_size,
                                         f.partition,
                                         shape.storage};
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto, auto dim, auto) {
      kernel::unpack_quant_pages_kernel<decltype(dim)::value, format_type><<<grid, kernel::quant_unpack_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

 private:
  /// "format::quant2::k_axis" and the like, for messages.
  static const char* k_axis_name() {
    static const std::string name = std::string(kvmosaic::detail::quant_where<Bits, ValueAxis>()) + "::k_axis";
    return name.c_str();
  }
  static const char* partition_name() {
    static const std::string name = std::string(kvmosaic::detail::quant_where<Bits, ValueAxis>()) + "::partition";
    return name.c_str();
  }
  /// Calls f(partition constant) for Pi at most HeadDim.
  template <int HeadDim, class F>
  static void dispatch_partition_of(int partition, F&& f) {
    switch (partition) {
      case 32: return f(std::integral_constant<int, 32>{});
      case 64: return f(std::integral_constant<int, 64>{});
      case 128:
        if constexpr (HeadDim >= 128) return f(std::integral_constant<int, 128>{});
        break;
    }
    kvmosaic::detail::require(false, "cuda::engine", partition_name(), partition, "32, 64 or 128, at most head_dim");
  }
  /// Calls f(head_dim constant, partition constant) for a quantized shape (Pi at most head_dim).
  template <class F>
  static void dispatch_partition(int head_dim, int partition, F&& f) {
    const auto by_partition = [&](auto dim) {
      switch (partition) {
        case 32: return f(dim, std::integral_constant<int, 32>{});
        case 64: return f(dim, std::integral_constant<int, 64>{});
        case 128:
          if constexpr (decltype(dim)::value >= 128) return f(dim, std::integral_constant<int, 128>{});
          break;
      }
      kvmosaic::detail::require(false, "cuda::engine", partition_name(), partition,
                                "32, 64 or 128, at most head_dim");
    };
    switch (head_dim) {
      case 64: return by_partition(std::integral_constant<int, 64>{});
      case 128: return by_partition(std::integral_constant<int, 128>{});
      case 256: return by_partition(std::integral_constant<int, 256>{});
    }
    kvmosaic::detail::require(false, "cuda::engine", "head_dim", head_dim, limits::supported_head_dims);
  }
};

}  // namespace kvmosaic::cuda
