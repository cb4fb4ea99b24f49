// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// format::bitmap_tiles (MUSTAFAR) on the device (cuda/format/device_format.cuh says what a device
/// part provides): completed pages are pruned and packed by `encode_bitmap_pages_kernel` (bytes
/// equal to the host encoder's); decode runs the sm_90 kernel that bulk-copies compressed pages
/// into shared-memory stages and lets each warp gather its tensor-core fragments straight from
/// them (`decode_partial_bitmap_kernel`), or the portable kernel that expands a page into dense
/// tiles before sm_90 and for pages too large for one stage.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/bitmap_tiles/decode.cuh"
#include "kvmosaic/cuda/format/bitmap_tiles/encode.cuh"
#include "kvmosaic/cuda/format/bitmap_tiles/unpack.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/bitmap_tiles.hpp"

namespace kvmosaic::cuda {

template <>
struct device_format<format::bitmap_tiles> {
  static constexpr bool encodes_pages = true;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  static constexpr std::int32_t split_page_multiple = 1;
  /// Both kernels write each row's logits for a step with token scores (select::tova, select::h2o,
  /// cache::window_votes): q . k of the pruned keys in fp32 (sm_90: q in two 16-bit halves).
  static constexpr bool writes_token_logits = true;
  static constexpr bool writes_exact_logits = true;
  using params = kernel::bitmap_decode_params;
  using traits = format_traits<format::bitmap_tiles>;

  struct state {
    int stages = 0;  ///< sm_90 kernel: compressed page pairs in flight per CTA (0: the portable kernel)
  };

  static void validate(const format::bitmap_tiles&, const kvmosaic::detail::engine_shape&) {}

  /// The sm_90 kernel's stages. Occupancy comes first: as many CTAs per SM as the kernel's
  /// registers allow (it is bounded to 96 registers at head_dim 128, groups <= 4: five CTAs) with
  /// at least one stage each, then up to two stages next to them (a third or fourth was slower
  /// or equal at batch 8-32: benchmark/README.md). Pages too large for one stage: the portable
  /// kernel (stages = 0).
  template <class Shapes>
  static void configure(state& s, const format::bitmap_tiles& f, device_context& e) {
    s.stages = 0;
    if (!e.bulk_copy) return;
    s.stages = 1;  // what with_decode_kernel sizes the kernel with while the registers are read
    int kernel_registers = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int) { kernel_registers = detail::registers_of(kernel); });
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const int pair = static_cast<int>(g.k_page_bytes + g.v_page_bytes);
    const auto shared_bytes = [&](int stages) {
      return kernel::bitmap_decode_shared_bytes(e.shape->head_dim, e.shape->group_size, pair, stages, traits::k_along_tokens(f));
    };
    s.stages = detail::stages_for(e.device, kernel_registers, 16, 2, shared_bytes);
    if (s.stages == 0) e.bulk_copy = false;  // not even one page pair fits: the portable kernel
  }

  /// `Logits`: the sm_90 kernel that writes each row's logits for a step with token scores (its
  /// own instantiations: a kernel without scores has no store); the portable kernel branches at
  /// run time.
  template <class Shapes, bool Logits = false, class F>
  static void with_decode_kernel(const state& s, const format::bitmap_tiles& f, const device_context& e, bool row_masks,
                                 F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
      if (s.stages > 0) {
        const int shared_bytes = kernel::bitmap_decode_shared_bytes(
            head_dim, group_size, static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes), s.stages,
            traits::k_along_tokens(f));
        if (row_masks)  // row masks: their own instantiation
          call(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size, true, Logits>, 128, shared_bytes);
        else
          call(kernel::decode_partial_bitmap_kernel<T, head_dim, group_size, false, Logits>, 128, shared_bytes);
      } else {
        using collective = page_attend<format::dense, T, head_dim, group_size, t.threads, t.unroll>;
        call(kernel::decode_partial_bitmap_portable_kernel<T, head_dim, group_size, t.threads, t.unroll>, t.threads,
             kernel::bitmap_portable_layout<head_dim, group_size, collective::rows>::bytes);
      }
    });
  }

  static params params_for(const state& s, const format::bitmap_tiles& f, const device_context&) {
    return params{s.stages, traits::k_along_tokens(f) ? 1 : 0};
  }

  /// Page ids are read from the block table: no limit.
  static int max_pages_per_split(const state&, const decode_tuning&) { return 1 << 30; }

  /// The sm_90 kernel multiplies p.v on tensor cores, p split into two 16-bit halves.
  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.stages > 0; }

  /// Prunes and packs `n` completed pages (K and V of every KV head): one CTA per (page, head,
  /// K or V), the rows from the scratch slots, output-aware K weights where a page has a row.
  template <class Shapes>
  static void encode_pages(const state&, const format::bitmap_tiles& f, const encode_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    kernel::bitmap_encode_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.k_page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.v_page_bytes = static_cast<std::int64_t>(g.v_page_bytes);
    p.new_pages = c.page_ids;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.keep_k = kvmosaic::detail::kept_per_vector(f.s_k, shape.head_dim);
    p.keep_v = kvmosaic::detail::kept_per_vector(f.s_v, shape.head_dim);
    p.k_along_tokens = traits::k_along_tokens(f) ? 1 : 0;
    p.key_weights = c.key_weights;
    p.weight_rows = c.key_weights != nullptr ? c.weight_rows : nullptr;
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    const int mask_bytes = shape.page_size * shape.head_dim / 8;
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      using S = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      kernel::encode_bitmap_pages_kernel<S, head_dim><<<grid, kernel::encode_threads, mask_bytes, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// Unpacks `n` pages to dense rows (a compaction's sources): one CTA per (page, head, K or V).
  template <class Shapes>
  static void unpack_pages(const state&, const format::bitmap_tiles& f, const unpack_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    const kernel::bitmap_unpack_params p{c.rows,
                                         static_cast<std::int64_t>(g.tail_slot_bytes()),
                                         static_cast<std::int64_t>(g.tail_head_bytes),
                                         e.pages,
                                         static_cast<std::int64_t>(g.page_slot_bytes()),
                                         static_cast<std::int64_t>(g.k_page_bytes),
                                         static_cast<std::int64_t>(g.v_page_bytes),
                                         c.page_ids,
                                         shape.num_kv_heads,
                                         shape.page_size,
                                         traits::k_along_tokens(f) ? 1 : 0};
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto, auto dim, auto) {
      kernel::unpack_bitmap_pages_kernel<decltype(dim)::value><<<grid, kernel::bitmap_unpack_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
};

}  // namespace kvmosaic::cuda
