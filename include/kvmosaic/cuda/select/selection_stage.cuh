// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A selector's device part: `selection_stage<Selector, Shapes>`, specialized on the selector tag
/// in `cuda/select/<name>.cuh`, found by the CUDA engine as it finds a format's device part
/// (`device_format`). The engine (`cuda/backend.cuh`) never names a selector: it hands each stage
/// the pages a write seals, asks it per step which pages each sequence's splits cover, gives it a
/// region of the step's staged metadata, and launches it between the metadata copy and the split
/// kernel. A specialization provides:
///
/// ```cpp
/// template <class Shapes> class selection_stage<select::X, Shapes> {
///  public:
///   static constexpr bool selects;          // false: every step reads every page (no kernels)
///   selection_stage(const engine_shape&, const select::X&);   // device storage, sized once
///   std::size_t page_bytes() const;         // device bytes the stage keeps per page (memory_stats)
///   void seal(const sealed_pages&, cudaStream_t);             // pages a write completed
///   void commit() noexcept;                 // makes the stage's writes since the last commit final
///   void rollback() noexcept;               // forgets them (the engine's rollback)
///   void plan(const detail::selection_request*, const std::vector<step_sequence>&,
///             std::vector<std::int32_t>& read_pages);         // host, per step (see below)
///   std::size_t staged_bytes() const;       // bytes of the planned step's inputs to stage
///   void stage(std::byte* host) const;      // writes them (the engine copies them with the step's)
///   void reserve(std::int32_t batch, std::int32_t table_stride, bool live_masks);  // outputs for
///                                           // such steps (live_masks: some may have evicted tokens)
///   bool planned() const;                   // the planned step selects
///   bool row_masks() const;                 // ... and writes row masks (blocks smaller than a page,
///                                           // or evicted tokens)
///   void use_live_masks(const std::uint32_t*) noexcept;  // the step's live rows per (sequence,
///                                           // block-table entry), or null: ANDed into its masks
///   void bind(kernel::decode_params&) const;                  // the contract (below)
///   void launch(const kernel::decode_params&, const std::byte* staged, const float* q, cudaStream_t);
/// };
/// ```
///
/// The contract every format's split kernel reads (`kernel::decode_params`): for a selected step,
/// per (sequence, KV head) a page table (`block_tables`, rows `step_header[1]` apart, heads
/// `step_header[2]` apart) and, when `row_masks()`, per listed page a row mask (`token_masks`,
/// `mask_words` words) and the entries written (`table_lengths`). A step with evicted tokens
/// gets the live rows of every (sequence, block-table entry) first (`use_live_masks`); a stage
/// that selects writes row masks then, each ANDed with its page's live rows. `plan` fills `read_pages[b]`,
/// the pages sequence b's splits cover (`planned_pages`): every sealed page, or fewer when the
/// selection is known to read fewer whole pages. A selector that reads token scores
/// (`selector_traits::token_scores`) keeps them in its stage: the engine's score kernel writes
/// them through `score_table()` (per sequence slot, its scores and slot positions:
/// `cuda::scored_selection_stage`, cuda/select/scored_eviction.cuh, is the one implementation).
/// docs/architecture.md ("Adding a selector") lists the files a new selector writes.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/select/selection_request.hpp"

namespace kvmosaic::cuda {

/// Pages a write completed, whose dense rows a stage may read (before a format encodes them):
/// page `page_ids[i]`'s rows are in slot `row_slots[i]` of `rows` (every KV head's K rows at
/// `head * rows_head_bytes`, token-major, head_dim values each).
struct sealed_pages {
  const std::byte* rows;              ///< device
  std::int64_t rows_slot_bytes;
  std::int64_t rows_head_bytes;
  const std::int32_t* row_slots;      ///< [n] (device)
  const std::int32_t* page_ids;       ///< [n] (device)
  std::int32_t n;
};

/// Where a step's block keys are scored from, for a stage whose spans keep a format's block keys
/// (`format_traits::has_block_keys`, under a selector that keeps mean keys): the step's queries in
/// each segment's rotated space, which the engine has the format compute before the launch.
struct block_key_source {
  const float* q_key = nullptr;     ///< [batch][num_kv_heads][segments_per_sequence][kept][score_heads(group)] (device)
  int kept = 0;                     ///< channels of the rotated space
  int retained = 0;                 ///< (channel, value) pairs a block key holds
  int segment_pages = 1;
  int segments_per_sequence = 1;
  /// The stream's last kernel completes only after the one that wrote q_key (it is that kernel,
  /// or the rest of the metadata pull, which waits for it), has let the step's metadata be read
  /// and the device has programmatic dependent launch (sm_90): the scoring may be launched as its
  /// dependent (`detail::launch_kernel`), to stage its keys while that kernel runs; it waits for
  /// it before it reads q_key.
  bool after_queries = false;
};

/// One sequence of a step as a stage sees it.
struct step_sequence {
  std::int32_t slot;          ///< tail slot
  std::int32_t sealed_pages;  ///< pages in its block table
};

/// The device part of `Selector` for an engine compiling `Shapes`. Only specializations exist.
template <class Selector, class Shapes>
class selection_stage {
  static_assert(sizeof(Selector) == 0,
                "kvmosaic: this selector has no CUDA selection stage: include its cuda/select/<name>.cuh "
                "(kvmosaic.cuh includes every built-in one), or specialize kvmosaic::cuda::selection_stage<Selector, "
                "Shapes> (docs/architecture.md, 'Adding a selector')");
};

}  // namespace kvmosaic::cuda
