// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// format::packed_bitmap (MosaicKV) on the device (cuda/format/device_format.cuh says what a
/// device part provides; a format with segments adds `segment_entry_bytes` and `store_segment`).
/// The segments are planned on the host from the rows the host backend would fit them to (the
/// same `format_traits::plan_segment`, so the same bases), copied into the engine's segment arena,
/// and read by the encode kernel (`encode_packed_pages_kernel`) and the split kernel
/// (`decode_partial_packed_mma_kernel`, PackedAttention on tensor cores with bulk copies, sm_90;
/// `decode_partial_packed_kernel` on CUDA cores elsewhere, sm_75+); a compaction unpacks the pages
/// it reads in their segments (`unpack_packed_pages_kernel`) and encodes the pages it writes in
/// theirs.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/block_keys.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/decode.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/encode.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/search_sums.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/segment_sums.cuh"
#include "kvmosaic/cuda/format/packed_bitmap/unpack.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/packed_bitmap.hpp"

namespace kvmosaic::cuda {

template <>
struct device_format<format::packed_bitmap> {
  static constexpr bool encodes_pages = true;
  static constexpr bool masks_sink_rows = false;  ///< sinks are masked by the step's row masks
  /// Both split kernels write their rows' logits in a step with token scores (their `Logits`
  /// instantiations): q' . y in the segment's rotated space, which is q . k of the decoded key up
  /// to fp32 rounding (B_k's columns are orthonormal) and the sm_90 kernel's hi + lo split of q'.
  static constexpr bool writes_token_logits = true;
  static constexpr bool writes_exact_logits = true;
  static constexpr std::int32_t split_page_multiple = 1;
  /// A split's fixed work in pages' worth for the split plan (`make_split_plan`): the sm_90
  /// kernel rotates the queries into a segment's K basis when a split enters it and its output
  /// back through the V basis when it leaves, reading both bases (2 x head_dim x kept fp32), so a
  /// split costs about the pages of as many bytes more.
  static std::int32_t split_cost_pages(const format::packed_bitmap& f, const page_shape& shape) {
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape);
    const std::size_t bases = 2 * static_cast<std::size_t>(g.head_dim) * g.kept * sizeof(float);
    const std::size_t page_pair = 2 * g.page_bytes();
    return static_cast<std::int32_t>((bases + page_pair - 1) / page_pair);
  }
  using params = kernel::packed_decode_params;
  using traits = format_traits<format::packed_bitmap>;

  struct state {
    int stages = 0;               ///< sm_90 kernel: page pairs in flight per CTA (0: the portable kernel)
    bool listed = false;          ///< sm_90 kernel with slots of several small pages: it lists each split's pages
    device_buffer page_segments;  ///< [max_pages] int32: the segment each page was sealed in (the encoder writes it)
    device_buffer sum_scratch;    ///< the tiles' sums of a pass of `segment_sums`
    device_buffer sum_totals;     ///< [num_kv_heads][segment_sum_count] doubles
    device_buffer search_bases;   ///< `segment_search_sums`: [num_kv_heads][2][head_dim][kept] fp32
    device_buffer search_sums;    ///< `segment_search_sums`: [num_kv_heads][chunks][segment_search_sum_count] doubles
    /// The most scratch a pass of `segment_sums` fills with its tiles' sums (at least one tile's):
    /// a segment of more tiles takes more passes (2.1 MB a tile at head_dim 128, 8 KV heads).
    std::size_t sum_pass_bytes = std::size_t{64} << 20;
  };

  static void validate(const format::packed_bitmap&, const kvmosaic::detail::engine_shape&) {}

  /// The sm_90 kernel's stages (slots of `kernel::packed_slot_pages` page pairs). Under
  /// `select::all`, as bitmap_tiles chooses them: as many CTAs per SM as its registers allow with
  /// at least one slot each, then up to two slots. Under a selector with slots of one page (pages
  /// of 64 tokens or more), three slots first, then as many CTAs as fit: a selection's splits hold
  /// few, scattered pages whose copies the kernel waits for, which a third slot in flight hides,
  /// while `select::all` loses more to the fewer CTAs per SM than it would gain (benchmark/README.md,
  /// "format::packed_bitmap's split kernel: per-page and per-segment latency"). Slots of several
  /// smaller pages (pages of 16 or 32 tokens) take two under a selector too: there the third slot
  /// was slower in every selected step measured (benchmark/README.md, "Span scoring by fused
  /// multiply-adds, page top-k by ballots"). Without bulk copies, or where not one slot fits:
  /// the portable kernel (stages = 0).
  template <class Shapes>
  static void configure(state& s, const format::packed_bitmap& f, device_context& e) {
    if (s.page_segments.size() == 0) s.page_segments = device_buffer(static_cast<std::size_t>(e.shape->max_pages) * sizeof(std::int32_t));
    s.stages = 0;
    s.listed = false;
    if (!e.bulk_copy) return;
    s.stages = 1;  // what with_decode_kernel picks the kernel by while its registers are read
    const int slot = slot_bytes(e);
    int registers = 0, slots_offset = 0;
    with_decode_kernel<Shapes>(s, f, e, false, [&](auto kernel, int, int shared_bytes) {
      registers = detail::registers_of(kernel);
      slots_offset = shared_bytes - slot;  // one stage
    });
    const auto shared_bytes = [&](int stages) { return slots_offset + stages * slot; };
    const bool one_page_slots = kernel::packed_slot_pages(e.shape->page_size) == 1;
    s.stages = e.selects_pages && one_page_slots ? detail::stages_for(e.device, registers, 16, 3, shared_bytes, 3)
                                                 : detail::stages_for(e.device, registers, 16, 2, shared_bytes);
    if (s.stages == 0) e.bulk_copy = false;
    s.listed = s.stages > 0 && !one_page_slots;
  }

  /// `Logits`: the instantiations that write their rows' logits (an engine whose selector reads
  /// token scores takes them; every other engine runs kernels with no store in them).
  template <class Shapes, bool Logits = false, class F>
  static void with_decode_kernel(const state& s, const format::packed_bitmap& f, const device_context& e, bool /*row_masks*/,
                                 F&& call) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape.page());
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, shape.group_size, [&](auto element, auto dim, auto group) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      constexpr int group_size = decltype(group)::value;
      if (s.stages > 0) {
        const int bytes = kernel::packed_mma_layout<head_dim, group_size>::bytes(slot_bytes(e), s.stages);
        if (kernel::packed_slot_pages(shape.page_size) > 1)
          call(kernel::decode_partial_packed_mma_kernel<T, head_dim, group_size, Logits, true>, 128, bytes);
        else
          call(kernel::decode_partial_packed_mma_kernel<T, head_dim, group_size, Logits, false>, 128, bytes);
      } else {
        constexpr decode_tuning t = decode_tuning_for(head_dim, group_size);
        using collective = page_attend<format::dense, T, head_dim, group_size, t.threads, t.unroll>;
        call(kernel::decode_partial_packed_kernel<T, head_dim, group_size, t.threads, t.unroll, Logits>, t.threads,
             kernel::packed_decode_layout<head_dim, group_size, collective::rows>::bytes(g.words, g.retained));
      }
    });
  }

  static params params_for(const state& s, const format::packed_bitmap& f, const device_context& e) {
    const page_shape shape = e.shape->page();
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, shape);
    return params{e.segments,
                  s.page_segments.as<std::int32_t>(),
                  kernel::packed_entry::bytes(g.head_dim, g.kept),
                  e.segments_per_sequence,
                  traits::segment_pages(f, shape),
                  g.kept,
                  g.words,
                  g.retained,
                  static_cast<std::int64_t>(g.bitmap_bytes()),
                  s.stages,
                  kernel::packed_slot_pages(shape.page_size),
                  nullptr,
                  0};
  }

  /// The step's queries in every segment's K basis, as `block_key_queries` wrote them for the
  /// selection stage: the sm_90 split kernel then reads a segment's rotated queries instead of
  /// rotating them itself (the same bits; one read of kept x group floats against one of B_k and
  /// group x head_dim x kept FMAs per split and segment). The portable kernel rotates its own.
  static void use_block_key_queries(params& p, const float* q_key, int query_heads) {
    p.step_queries = q_key;
    p.step_query_heads = query_heads;
  }

  /// The sm_90 kernel with slots of several small pages lists a split's pages in shared memory
  /// (`kernel::packed_listed_pages`); otherwise no bound.
  static int max_pages_per_split(const state& s, const decode_tuning&) { return s.listed ? kernel::packed_listed_pages : 1 << 30; }

  static bool splits_p_on_tensor_cores(const state& s, const device_context&) { return s.stages > 0; }

  /// Bytes of one segment of one KV head in the engine's segment arena (`kernel::packed_entry`).
  static std::size_t segment_entry_bytes(const format::packed_bitmap& f, const page_shape& shape) {
    return static_cast<std::size_t>(kernel::packed_entry::bytes(shape.head_dim, traits::basis_dim(f, shape)));
  }
  /// Writes `s` as the device reads it (`kernel::packed_entry`): B_k as it is, B_v transposed,
  /// then r and g of K and of V.
  static void store_segment(const format::packed_bitmap&, const page_shape& shape, const traits::segment& s, std::byte* out) {
    const int d = shape.head_dim, kept = s.kept;
    auto* floats = reinterpret_cast<float*>(out);
    std::memcpy(floats, s.basis[0].data(), static_cast<std::size_t>(d) * kept * sizeof(float));
    float* v_t = floats + static_cast<std::size_t>(d) * kept;
    for (int c = 0; c < d; ++c)
      for (int j = 0; j < kept; ++j) v_t[static_cast<std::size_t>(j) * d + c] = s.basis[1][static_cast<std::size_t>(c) * kept + j];
    const std::int32_t strategy[4] = {s.strategy[0].retained, s.strategy[0].group, s.strategy[1].retained, s.strategy[1].group};
    std::memcpy(v_t + static_cast<std::size_t>(d) * kept, strategy, sizeof strategy);
  }

  /// Where the rows of the segment `c` describes are, as the sums' kernels read them.
  static kernel::packed_sum_rows rows_of(const segment_sums_context& c) {
    const device_context& e = *c.engine;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    return kernel::packed_sum_rows{c.tail + g.tail_row_offset(),
                                   static_cast<std::int64_t>(g.tail_head_bytes),
                                   static_cast<std::int64_t>(g.row_bytes),
                                   e.shape->storage,
                                   static_cast<const std::byte*>(c.k),
                                   static_cast<const std::byte*>(c.v),
                                   c.rows_type,
                                   c.first_row,
                                   c.tail_rows,
                                   c.page_rows,
                                   c.call_offset,
                                   c.n,
                                   e.shape->num_kv_heads};
  }

  /// The sums of a segment's rows (`format_traits::segment_sums`, to the bit) for every KV head,
  /// into `c.sums` (host; synchronizes the stream). Passes of up to `state::sum_pass_bytes` of
  /// tiles' sums (device scratch the engine keeps, with the totals): per pass a CTA per (tile, K or V of a head, 64 x 64 block of the covariance's lower
  /// triangle), a CTA per (tile, head) for K's per-channel sums, then one thread per (head, sum)
  /// adds the pass's tiles to the totals in tile order. Cost: 2 n head_dim^2 fp64 multiply-adds
  /// per KV head (about a third of them above the diagonal in the diagonal blocks, computed and
  /// not kept), four reads of K and two of V per 64-channel block row.
  template <class Shapes>
  static void segment_sums(state& s, const format::packed_bitmap& f, const segment_sums_context& c) {
    const device_context& e = *c.engine;
    const int heads = e.shape->num_kv_heads, d = e.shape->head_dim;
    const std::size_t count = traits::segment_sum_count(f, e.shape->page());
    const std::size_t totals_bytes = static_cast<std::size_t>(heads) * count * sizeof(double);
    const int tiles = static_cast<int>((c.n + traits::segment_sum_tile_rows - 1) / traits::segment_sum_tile_rows);
    if (tiles == 0) {
      std::memset(c.sums, 0, totals_bytes);
      return;
    }
    const int per_pass = static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(tiles, s.sum_pass_bytes / totals_bytes)));
    if (s.sum_scratch.size() < per_pass * totals_bytes) s.sum_scratch = device_buffer(per_pass * totals_bytes);
    if (s.sum_totals.size() < totals_bytes) s.sum_totals = device_buffer(totals_bytes);
    kernel::packed_sum_params p{};
    p.rows = rows_of(c);
    p.scratch = s.sum_scratch.as<double>();
    p.totals = s.sum_totals.as<double>();
    const int blocks = d / kernel::packed_covariance_block;
    detail::dispatch_shape(Shapes{}, e.shape->storage, d, 0, [&](auto, auto dim, auto) {
      constexpr int head_dim = decltype(dim)::value;
      for (int first = 0; first < tiles; first += per_pass) {
        p.first_tile = first;
        p.tiles = std::min(per_pass, tiles - first);
        p.first_pass = first == 0;
        const dim3 covariance_grid(static_cast<unsigned>(p.tiles), static_cast<unsigned>(2 * heads),
                                   static_cast<unsigned>(blocks * (blocks + 1) / 2));
        kernel::packed_tile_covariance_kernel<head_dim><<<covariance_grid, kernel::packed_covariance_threads, 0, e.stream>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
        kernel::packed_tile_key_sums_kernel<head_dim>
            <<<dim3(static_cast<unsigned>(p.tiles), static_cast<unsigned>(heads)), head_dim, 0, e.stream>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
        const std::size_t sums = static_cast<std::size_t>(heads) * count;
        kernel::packed_add_tile_sums_kernel<head_dim><<<static_cast<unsigned>((sums + 255) / 256), 256, 0, e.stream>>>(p);
        KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      }
    });
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(c.sums, p.totals, totals_bytes, cudaMemcpyDeviceToHost, e.stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(e.stream));
  }

  /// The strategy search's sums of a segment's rows (`format_traits::search_segment_from_sums`
  /// reads them; the host's order, to the bit) in the bases of `planned` (each KV head's segment
  /// planned from the sums), into `sums` ([num_kv_heads][chunks][segment_search_sum_count], host;
  /// synchronizes the stream). A CTA per (chunk of rows, KV head, K or V): the rows rotated as the
  /// host's `fused_rotate` does, each candidate's kept energies summed per row, then per chunk
  /// (`kernel::packed_search_sums_kernel`). Cost: the bases' copy to the device (2 x head_dim x
  /// kept fp32 per head), one read of the rows and head_dim x kept multiply-adds per row, and
  /// the sums' copy back (160 bytes per chunk of 64 rows and head).
  template <class Shapes>
  static void segment_search_sums(state& s, const format::packed_bitmap& f, const segment_sums_context& c, const traits::segment* planned,
                                  double* sums) {
    const device_context& e = *c.engine;
    const int heads = e.shape->num_kv_heads, d = e.shape->head_dim;
    const kvmosaic::detail::packed_geometry g = kvmosaic::detail::packed_geometry::of(f, e.shape->page());
    const std::int64_t chunks = (c.n + traits::segment_search_chunk_rows - 1) / traits::segment_search_chunk_rows;
    if (chunks == 0) return;
    const std::size_t count = traits::segment_search_sum_count(f, e.shape->page());
    const std::size_t basis_floats = static_cast<std::size_t>(d) * g.kept;
    std::vector<float> bases(static_cast<std::size_t>(heads) * 2 * basis_floats);
    for (int h = 0; h < heads; ++h)
      for (int which = 0; which < 2; ++which)
        std::copy(planned[h].basis[which].begin(), planned[h].basis[which].end(), bases.begin() + (static_cast<std::size_t>(h) * 2 + which) * basis_floats);
    const std::size_t sums_bytes = static_cast<std::size_t>(heads) * chunks * count * sizeof(double);
    if (s.search_bases.size() < bases.size() * sizeof(float)) s.search_bases = device_buffer(bases.size() * sizeof(float));
    if (s.search_sums.size() < sums_bytes) s.search_sums = device_buffer(sums_bytes);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(s.search_bases.data(), bases.data(), bases.size() * sizeof(float), cudaMemcpyHostToDevice, e.stream));
    kernel::packed_search_params p{};
    p.rows = rows_of(c);
    p.bases = s.search_bases.as<const float>();
    p.sums = s.search_sums.as<double>();
    p.kept = g.kept;
    const std::vector<kvmosaic::detail::packed_strategy> candidates = kvmosaic::detail::packed_candidates(g);
    p.candidates = static_cast<int>(candidates.size());
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      p.retained[i] = candidates[i].retained;
      p.group[i] = candidates[i].group;
    }
    detail::dispatch_shape(Shapes{}, e.shape->storage, d, 0, [&](auto, auto dim, auto) {
      kernel::packed_search_sums_kernel<decltype(dim)::value>
          <<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(heads), 2), kernel::packed_search_threads, 0, e.stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(sums, p.sums, sums_bytes, cudaMemcpyDeviceToHost, e.stream));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(e.stream));
  }

  /// The block keys of `c.n` sealed pages (`format_traits::encode_block_key` to the bit): one CTA
  /// per (page, KV head, block).
  template <class Shapes>
  static void encode_block_keys(const state& s, const format::packed_bitmap& f, const block_key_seal_context& c) {
    if (c.n == 0) return;
    kernel::packed_block_key_params p{};
    p.rows = c.rows;
    p.rows_slot_bytes = c.rows_slot_bytes;
    p.rows_head_bytes = c.rows_head_bytes;
    p.row_slots = c.row_slots;
    p.new_pages = c.page_ids;
    p.segment_entries = c.segment_entries;
    p.keys = c.keys;
    p.keys_page_bytes = c.keys_page_bytes;
    p.key_bytes = c.key_bytes;
    p.block_tokens = c.block_tokens;
    p.num_kv_heads = c.engine->shape->num_kv_heads;
    p.format = params_for(s, f, *c.engine);
    const dim3 grid(static_cast<unsigned>(c.n), static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(c.blocks_per_page));
    detail::dispatch_shape(Shapes{}, c.engine->shape->storage, c.engine->shape->head_dim, 0, [&](auto element, auto dim, auto) {
      kernel::encode_packed_block_keys_kernel<decltype(element), decltype(dim)::value>
          <<<grid, kernel::packed_block_key_threads, 0, c.engine->stream>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }

  /// The step's queries in every (sequence, KV head, segment)'s K basis
  /// (`format_traits::block_key_query` to the bit): a thread per channel, all heads of the group.
  template <class Shapes>
  static void block_key_queries(const state& s, const format::packed_bitmap& f, const block_key_query_context& c) {
    if (c.batch == 0) return;
    kernel::packed_block_query_params p{};
    p.q = c.q;
    p.slots = c.tail_slots;
    p.sealed_pages = c.sealed_pages;
    p.q_key = c.q_key;
    p.num_kv_heads = c.engine->shape->num_kv_heads;
    p.group_size = c.engine->shape->group_size;
    p.query_heads = c.query_heads;
    p.format = params_for(s, f, *c.engine);
    const int parts = (p.format.kept + kernel::packed_block_query_columns - 1) / kernel::packed_block_query_columns;
    const dim3 grid(static_cast<unsigned>(c.segments * parts), static_cast<unsigned>(p.num_kv_heads),
                    static_cast<unsigned>(c.batch));
    detail::dispatch_shape(Shapes{}, c.engine->shape->storage, c.engine->shape->head_dim, 0, [&](auto, auto dim, auto) {
      detail::launch_kernel(kernel::packed_block_queries_kernel<decltype(dim)::value>, grid, dim3(kernel::packed_block_query_threads), 0,
                            c.engine->stream, c.after_pull, p);
    });
  }

  /// Packs `n` completed pages (K and V of every KV head) in their segments: one CTA per (page,
  /// head, K or V).
  template <class Shapes>
  static void encode_pages(const state& s, const format::packed_bitmap& f, const encode_context& c) {
    kernel::packed_encode_params p{};
    p.rows = c.rows;
    run_pass<Shapes>(s, f, *c.engine, p, c.page_ids, c.segment_entries, c.n, [&](auto element, auto dim, dim3 grid) {
      kernel::encode_packed_pages_kernel<decltype(element), decltype(dim)::value><<<grid, kernel::packed_encode_threads, 0, c.engine->stream>>>(p);
    });
  }

  /// Unpacks `c.n` pages (K and V of every KV head), each in its segment (`c.segment_entries`),
  /// to dense rows for a compaction: one CTA per (page, head, K or V).
  template <class Shapes>
  static void unpack_pages(const state& s, const format::packed_bitmap& f, const unpack_context& c) {
    kernel::packed_unpack_params p{};
    p.rows = c.rows;
    run_pass<Shapes>(s, f, *c.engine, p, c.page_ids, c.segment_entries, c.n, [&](auto element, auto dim, dim3 grid) {
      kernel::unpack_packed_pages_kernel<decltype(element), decltype(dim)::value><<<grid, kernel::packed_unpack_threads, 0, c.engine->stream>>>(p);
    });
  }

 private:
  /// Bytes of one slot of the sm_90 kernel: `packed_slot_pages` page pairs (K and V of a head).
  static int slot_bytes(const device_context& e) {
    return kernel::packed_slot_pages(e.shape->page_size) * static_cast<int>(e.geometry->k_page_bytes + e.geometry->v_page_bytes);
  }

  /// Completes `p` (all but its rows) for a pass over `n` pages and calls `launch(element, dim,
  /// grid)` for the engine's storage dtype and head_dim: grid (pages, num_kv_heads, 2: K then V).
  template <class Shapes, class Params, class Launch>
  static void run_pass(const state& s, const format::packed_bitmap& f, const device_context& e, Params& p, const std::int32_t* page_ids,
                       const std::int32_t* segment_entries, std::int32_t n, Launch&& launch) {
    const kvmosaic::detail::engine_shape& shape = *e.shape;
    const kvmosaic::detail::arena_geometry& g = *e.geometry;
    p.rows_slot_bytes = static_cast<std::int64_t>(g.tail_slot_bytes());
    p.rows_head_bytes = static_cast<std::int64_t>(g.tail_head_bytes);
    p.pages = e.pages;
    p.page_slot_bytes = static_cast<std::int64_t>(g.page_slot_bytes());
    p.page_bytes = static_cast<std::int64_t>(g.k_page_bytes);
    p.page_ids = page_ids;
    p.segment_entries = segment_entries;
    p.num_kv_heads = shape.num_kv_heads;
    p.page_size = shape.page_size;
    p.format = params_for(s, f, e);
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(shape.num_kv_heads), 2);
    detail::dispatch_shape(Shapes{}, shape.storage, shape.head_dim, 0, [&](auto element, auto dim, auto) {
      launch(element, dim, grid);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
};

}  // namespace kvmosaic::cuda
