// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A format's device part: `device_format<Format>`, specialized on the format tag in the format's
/// own folder (`cuda/format/<name>/device.cuh`), found by the CUDA engine the way CUTLASS finds a
/// collective. The engine (`cuda/backend.cuh`) drives splits, staging, plan/run and the merge for
/// every format and never names one; a specialization provides:
///
/// ```cpp
/// template <> struct device_format<format::X> {
///   static constexpr bool encodes_pages;          // false: rows are copied into pages as they are
///   static constexpr bool masks_sink_rows;        // the split kernel skips the sink rows of a
///                                                 // sequence's first page itself (p.sink_rows), so
///                                                 // sinks alone need no per-page row masks
///   static constexpr std::int32_t split_page_multiple;  // split sizes are multiples of it
///   static std::int32_t split_cost_pages(const format::X&, const page_shape&);  // optional, default
///                                                 // 0: a split's fixed work in pages' worth, which
///                                                 // the split plan weighs (make_split_plan)
///   static constexpr bool writes_token_logits;    // optional, default false: its split kernels
///                                                 // write each row's logits when a step records
///                                                 // token scores (kernel::decode_params::token_logits)
///   static constexpr bool writes_exact_logits;    // optional, default false: and those logits are
///                                                 // q . k of the decoded keys up to fp32 rounding
///                                                 // (not an approximation such as HACK's 8-bit q')
///   struct params;                                // the format's fields of the split kernels' params
///   struct state;                                 // per-engine decisions (kernel path, stages), with
///                                                 // `int stages` (0 when the format has none)
///   static void validate(const format::X&, const engine_shape&);         // what the kernels cannot do
///   template <class Shapes>
///   static void configure(state&, const format::X&, device_context&);  // at construction; may
///                                                 // turn bulk_copy off (then the portable path)
///   template <class Shapes, bool Logits, class F>                        // the split kernel of a step:
///   static void with_decode_kernel(const state&, const format::X&, const device_context&, bool row_masks,
///                                  F&& f);                               // f(kernel, threads, shared bytes);
///                                                 // Logits: of an engine whose steps may record token
///                                                 // scores (formats that write logits only)
///   static params params_for(const state&, const format::X&, const device_context&);
///   static int max_pages_per_split(const state&, const decode_tuning&);  // page ids a split keeps
///   static bool splits_p_on_tensor_cores(const state&, const device_context&);
///   template <class Shapes>                                              // encoded formats only:
///   static void encode_pages(const state&, const format::X&, const encode_context&);
///   template <class Shapes>                                              // encoded formats only: the
///   static void unpack_pages(const state&, const format::X&, const unpack_context&);  // inverse
///   // formats with segments (format_traits::has_segments) only: a segment of one KV head in the
///   // engine's segment arena (device_context::segments), as the kernels read it
///   static std::size_t segment_entry_bytes(const format::X&, const page_shape&);
///   static void store_segment(const format::X&, const page_shape&, const segment&, std::byte* out);
///   // formats whose segments are planned from sums (has_segment_sums_v): the sums of a segment's
///   // rows for every KV head, computed on the device in the order format_traits::segment_sums
///   // defines (to the bit), copied to the host
///   template <class Shapes>
///   static void segment_sums(state&, const format::X&, const segment_sums_context&);
///   // formats whose plan reads rows from sums of them (has_segment_search_sums_v): those sums
///   // over the same rows in the bases of each KV head's segment planned from the sums above,
///   // in the order format_traits::search_segment_from_sums reads (to the bit), copied to the host
///   template <class Shapes>
///   static void segment_search_sums(state&, const format::X&, const segment_sums_context&,
///                                   const segment* planned, double* sums);
///   // formats with block keys (format_traits::has_block_keys) only: what a selector that keeps
///   // mean keys stores and scores instead of dense rows (the generic score_block_keys_kernel)
///   template <class Shapes>
///   static void encode_block_keys(const state&, const format::X&, const block_key_seal_context&);
///   template <class Shapes>
///   static void block_key_queries(const state&, const format::X&, const block_key_query_context&);
///   // the queries block_key_queries wrote, for the step's split kernel to read if it wants them
///   static void use_block_key_queries(params&, const float* q_key, int query_heads);
/// };
/// ```
///
/// Split kernels take `kernel::split_params<params>` (the shared `decode_params` plus the
/// format's own); the engine fills the shared part and launches what `with_decode_kernel` hands
/// it. docs/architecture.md ("Adding a format") lists the files a new format writes.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/host/backend.hpp"

namespace kvmosaic::cuda {

/// What a format's device part may read of its engine: shapes, arenas and the device.
struct device_context {
  const kvmosaic::detail::engine_shape* shape;
  const kvmosaic::detail::arena_geometry* geometry;
  std::byte* pages;            ///< page arena (device)
  std::byte* tails;            ///< tail arena (device)
  int device;                  ///< CUDA device ordinal
  bool bulk_copy;              ///< sm_90 bulk-copy pipelines in use (false: the portable sm_75+ path)
  cudaStream_t stream;
  /// Formats with segments: the segment arena, [max_sequences][segments_per_sequence]
  /// [num_kv_heads] entries of `segment_entry_bytes` (null for other formats).
  const std::byte* segments;
  int segments_per_sequence;
  /// The engine's selector may read a subset of the pages (any but `select::all`): a split then
  /// holds few, scattered pages, and a format may keep more of them in flight.
  bool selects_pages;
};

/// What an encode pass is given: `n` completed pages whose dense rows are in scratch slots
/// 0 .. n (tail-slot layout), to be written to `page_ids` (device array).
struct encode_context {
  const device_context* engine;
  const std::byte* rows;              ///< scratch slots of dense rows (device)
  const std::int32_t* page_ids;       ///< [n] destination pages (device)
  const std::int32_t* weight_rows;    ///< [n] key-weight row per page or -1 (formats with key weights)
  const float* key_weights;           ///< [max_sequences][num_kv_heads][head_dim] (device), or null
  const std::int32_t* sink_slots;     ///< [n] tail slot keeping a first page's sink rows, or -1
  std::int32_t n;
  const std::int32_t* segment_entries;  ///< [n] formats with segments: the page's segment in the
                                        ///< arena (slot x segments_per_sequence + segment); else null
};

/// What an unpack pass is given: `n` pages `page_ids` (device array) whose dense rows, in the
/// storage dtype, are to be written to scratch slots 0 .. n of `rows` (tail-slot layout: the first
/// page_size rows of each head's K, then of its V). The rows are what the host's
/// `format_traits::decode_k/v` give, rounded to the storage dtype; a compaction moves them and
/// encodes the pages it writes again.
struct unpack_context {
  const device_context* engine;
  std::byte* rows;                    ///< scratch slots (device)
  const std::int32_t* page_ids;       ///< [n] pages to unpack (device)
  std::int32_t n;
  const std::int32_t* segment_entries;  ///< [n] formats with segments: the page's segment in the
                                        ///< arena (slot x segments_per_sequence + segment); else null
};

/// What a format's block-key seal is given (formats with `format_traits::has_block_keys`, when
/// the selector keeps mean keys): `n` sealed pages whose dense rows are in slots `row_slots[i]`
/// of `rows` (tail-slot layout), written to `page_ids` in segment `segment_entries[i]` (slot x
/// segments_per_sequence + segment); their block keys go to `keys` ([max_pages][num_kv_heads]
/// [blocks_per_page][key_bytes], the selection stage's arena).
struct block_key_seal_context {
  const device_context* engine;
  const std::byte* rows;
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::int32_t* row_slots;
  const std::int32_t* page_ids;
  const std::int32_t* segment_entries;
  std::int32_t n;
  std::byte* keys;
  std::int64_t keys_page_bytes;
  int key_bytes;
  int block_tokens;
  int blocks_per_page;
};

/// What a format's block-key query pass is given: the step's queries ([batch][num_q_heads]
/// [head_dim], unscaled), each sequence's slot and sealed pages, and where the queries in each
/// (sequence, KV head, segment)'s rotated space go ([batch][num_kv_heads][segments_per_sequence]
/// [basis_dim][query_heads]: a channel's heads side by side, zeros past the group).
struct block_key_query_context {
  const device_context* engine;
  const float* q;
  const std::int32_t* tail_slots;
  const std::int32_t* sealed_pages;
  std::int32_t batch;
  float* q_key;
  int query_heads;  ///< the group padded to the scoring kernel's heads (`kernel::score_heads`)
  int segments;     ///< segments a sequence of the step's reserved layout can span (<= segments_per_sequence):
                    ///< the pass's launch shape, fixed by the layout as a captured graph needs
  /// Launch the pass as a programmatic dependent of the stream's last kernel (the metadata pull;
  /// sm_90): it waits for that kernel before it reads the slots, and lets the scoring kernel be
  /// scheduled only then.
  bool after_pull = false;
};

/// What a format's segment sums are given (formats with `has_segment_sums_v`): the rows of a
/// segment about to be planned, for every KV head, as the host engine plans from them. Segment
/// row i < tail_rows is row first_row + i of the sequence's tail page (its page rows in the tail
/// slot `tail`); a later row i is row call_offset + i of the call's rows `k`, `v` ([rows]
/// [num_kv_heads][head_dim], contiguous, of `rows_type`), rounded to the storage dtype for
/// i < page_rows (the rest of the page being sealed, as the tail will store it).
struct segment_sums_context {
  const device_context* engine;
  const std::byte* tail;
  const void* k;
  const void* v;
  dtype rows_type;
  int first_row;
  int tail_rows;
  int page_rows;
  std::int64_t call_offset;
  std::int64_t n;        ///< rows of the segment
  double* sums;          ///< [num_kv_heads][segment_sum_count] (host memory), written
};

namespace detail {

/// `bytes` of dynamic shared memory for a launch of `kernel`, opted in (past the default 48 KB)
/// right here, next to the launch. A kernel template that several translation units instantiate
/// may have one handle per unit, and which unit's copy of an inline engine function the linker
/// keeps is not ours to choose: an opt-in made in another function can land on another unit's
/// copy of the kernel (the GPU test binary, whose units all instantiate the engines, launched
/// with "invalid argument" that way). `static_bytes`: the kernel's own shared memory, which counts
/// towards the 48 KB. Cost: one cudaFuncSetAttribute per launch that needs it.
template <class Kernel>
int opted_in_shared(Kernel kernel, int bytes, int static_bytes = 0) {
  if (bytes + static_bytes > 48 * 1024)
    KVMOSAIC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return bytes;
}

/// Registers per thread of `kernel` (a handle as a device format's `with_decode_kernel` passes it),
/// what a kernel's occupancy is sized by (`stages_for`). Cost: one attribute query.
template <class Kernel>
int registers_of(Kernel kernel) {
  cudaFuncAttributes attributes{};
  KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.numRegs;
}

/// Static shared memory of `kernel` in bytes: what its dynamic shared memory must leave room for
/// under a CTA's limit. Cost: one attribute query.
template <class Kernel>
int static_shared_of(Kernel kernel) {
  cudaFuncAttributes attributes{};
  KVMOSAIC_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return static_cast<int>(attributes.sharedSizeBytes);
}

/// Stages of a kernel that streams compressed page pairs through shared memory (4 warps per
/// CTA): occupancy first, as many CTAs per SM as its `registers` per thread allow (at most
/// `most_ctas`) with at least `wanted_stages` stages each (or, where not even one CTA has room
/// for them, at least one), then as many stages as fit next to them (at most `max_stages`);
/// `shared_bytes(stages)` is the CTA's dynamic shared memory. 0 when not even one stage fits.
/// Cost: four device attribute queries.
template <class SharedBytes>
int stages_for(int device, int registers, int most_ctas, int max_stages, SharedBytes&& shared_bytes, int wanted_stages = 1) {
  int per_sm = 0, per_block = 0, reserved = 0, sm_registers = 0;
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
  KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&sm_registers, cudaDevAttrMaxRegistersPerMultiprocessor, device));
  // Registers are allocated per warp in units of 256; the kernels run 4 warps.
  const int per_cta_registers = 4 * ((registers * 32 + 255) / 256 * 256);
  const int most = std::min(most_ctas, sm_registers / std::max(per_cta_registers, 1));
  // The stages at the most CTAs per SM that have room for `least` each (0: none has).
  const auto at_most_ctas_with = [&](int least) {
    for (int ctas = most; ctas >= 1; --ctas) {
      const int budget = std::min(per_sm / ctas - reserved, per_block);
      int stages = 0;
      while (stages < max_stages && shared_bytes(stages + 1) <= budget) ++stages;
      if (stages >= least) return stages;
    }
    return 0;
  };
  const int chosen = at_most_ctas_with(std::min(std::max(wanted_stages, 1), max_stages));
  return chosen > 0 ? chosen : at_most_ctas_with(1);
}

}  // namespace detail

/// The device part of `Format`. Only specializations exist.
template <class Format>
struct device_format {
  static_assert(sizeof(Format) == 0,
                "kvmosaic: this format has no CUDA device part: include its cuda/format/<name>/device.cuh "
                "(kvmosaic.cuh includes every built-in one), or specialize kvmosaic::cuda::device_format<Format> "
                "(docs/architecture.md, 'Adding a format')");
};

/// Whether `Format`'s split kernels write each row's logits for a step that records token
/// scores (`device_format<Format>::writes_token_logits`; false where it does not say).
template <class Format, class = void>
struct writes_token_logits : std::false_type {};
template <class Format>
struct writes_token_logits<Format, std::void_t<decltype(device_format<Format>::writes_token_logits)>>
    : std::bool_constant<device_format<Format>::writes_token_logits> {};

/// A split's fixed work in pages' worth for the split plan (`device_format<Format>::
/// split_cost_pages`; 0 where it does not say).
template <class Format, class = void>
struct split_cost {
  static std::int32_t pages(const Format&, const page_shape&) { return 0; }
};
template <class Format>
struct split_cost<Format, std::void_t<decltype(device_format<Format>::split_cost_pages(std::declval<const Format&>(),
                                                                                       std::declval<const page_shape&>()))>> {
  static std::int32_t pages(const Format& f, const page_shape& shape) { return device_format<Format>::split_cost_pages(f, shape); }
};

/// Whether `Format`'s logits (`writes_token_logits`) are q . k of its decoded keys up to fp32
/// rounding (`device_format<Format>::writes_exact_logits`; false where it does not say): what
/// `cache::window_votes` needs to compute on the device what the host computes from `read`.
template <class Format, class = void>
struct writes_exact_logits : std::false_type {};
template <class Format>
struct writes_exact_logits<Format, std::void_t<decltype(device_format<Format>::writes_exact_logits)>>
    : std::bool_constant<writes_token_logits<Format>::value && device_format<Format>::writes_exact_logits> {};

}  // namespace kvmosaic::cuda
