// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The collective of every read-less selection stage that scores *spans* (runs of tokens with the
/// min and max of their keys, select/span_score.hpp) and picks some within a token budget:
/// `span_selection<Shapes>` owns the step's outputs (scores, the chosen page tables, row masks),
/// stages the per-sequence inputs (span counts, token budgets, the always-read region, and a span
/// table when the spans are not the pages) and launches the scoring and top-k kernels
/// (kernel/select_pages.cuh). A stage (`cuda/select/quest.cuh`, `cuda/select/sentence_chunks.cuh`)
/// derives from it, says where its spans' bounds live (`use_source`, once its storage exists) and
/// plans each step (`start`, `add`); the rest of the stage's interface (staging, outputs, launch,
/// read-back) is this class's, the same for both.
///
/// Cost per step: one scoring pass over every span's bounds (2 x head_dim 16-bit values per span
/// and KV head) and a radix top-k per (sequence, KV head); host: O(batch) staging, plus the span
/// tables when the stage has its own.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"
#include "kvmosaic/cuda/kernel/select_pages.cuh"
#include "kvmosaic/cuda/select/selection_stage.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/select/selection_request.hpp"

namespace kvmosaic::cuda {

/// Where a stage's spans and their key bounds live on the device.
struct span_source {
  const std::byte* bounds;          ///< [entries][num_kv_heads][spans_per_entry][summary_rows rows], storage dtype
  std::int64_t entry_bytes;         ///< one entry's bounds, every KV head
  int spans_per_entry;
  int span_tokens;                  ///< > 0: span i is tokens [i * span_tokens, (i + 1) * span_tokens) (entries: pages)
  const int2* ranges;               ///< span_tokens == 0: {begin, end} per span slot (entry * spans_per_entry + k)
  int longest_span;                 ///< tokens of the longest span
  bool own_tables;                  ///< entries from the stage's span tables (else the sequences' block tables)
  int summary_rows = 2;             ///< rows per span: 2 (lo, hi: key bounds) or 1 (a mean key, scored as lo = hi)
  int key_bytes = 0;                ///< > 0: each span keeps a format's block key of this many bytes instead of rows
};

template <class Shapes>
class span_selection {
 public:
  static constexpr bool selects = true;

  /// `row_masks_possible`: whether any step may pick spans smaller than a page (sizes the
  /// row-mask outputs).
  span_selection(const kvmosaic::detail::engine_shape& shape, bool row_masks_possible)
      : shape_(shape), row_masks_possible_(row_masks_possible) {
    int device = 0, opt_in = 0;
    KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device));
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    spans_static_shared_ = detail::static_shared_of(kernel::select_spans_kernel<kernel::select_threads>);
    pages_static_shared_ = detail::static_shared_of(kernel::select_pages_kernel<kernel::select_threads>);
    max_dynamic_shared_ = opt_in - spans_static_shared_;
    max_shared_ = opt_in;
  }

  /// Row-mask words per page: ceil(page_size / 32).
  int mask_words() const noexcept { return (shape_.page_size + 31) / 32; }
  bool planned() const noexcept { return planned_; }
  /// Whether the planned step's split kernels read row masks: spans smaller than a page, or
  /// evicted tokens.
  bool row_masks() const noexcept { return planned_ && (row_masks_ || live_masks_ != nullptr); }
  /// The step's live-row masks (device, [batch][table stride][mask_words()]; null: no token of the
  /// batch is evicted), ANDed into every row mask the step writes. Set by the engine before each
  /// launch.
  void use_live_masks(const std::uint32_t* masks) noexcept { live_masks_ = masks; }
  /// Scores per (sequence, KV head): one per span of the longest sequence the layout holds.
  std::int32_t score_stride() const noexcept {
    return source_.own_tables ? std::max(span_table_stride_, 1) * source_.spans_per_entry
                              : table_stride_ * std::max(source_.spans_per_entry, 1);
  }

  /// Staged inputs: [span counts][token budgets][always-read starts][span tables], each
  /// `batch capacity` rows (fixed between growths, so a captured step stays valid).
  std::size_t staged_bytes() const noexcept {
    return 3 * align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t)) +
           align(static_cast<std::size_t>(batch_capacity_) * span_table_stride_ * sizeof(std::int32_t));
  }
  void stage(std::byte* host) const {
    if (!planned_) return;
    const std::size_t row = align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t));
    std::memcpy(host, span_counts_.data(), span_counts_.size() * sizeof(std::int32_t));
    std::memcpy(host + row, budget_tokens_.data(), budget_tokens_.size() * sizeof(std::int32_t));
    std::memcpy(host + 2 * row, always_from_.data(), always_from_.size() * sizeof(std::int32_t));
    std::memcpy(host + 3 * row, span_tables_.data(), span_tables_.size() * sizeof(std::int32_t));
  }

  /// Outputs for steps of up to `batch` sequences of up to `table_stride` pages, and scores for
  /// their spans.
  void reserve(std::int32_t batch, std::int32_t table_stride, bool live_masks = false) {
    live_masks_possible_ = live_masks_possible_ || live_masks;
    batch_capacity_ = std::max(batch_capacity_, batch);
    table_stride_ = std::max(table_stride_, table_stride);
    const std::size_t rows = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * table_stride_;
    const std::size_t score_bytes = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * score_stride() * sizeof(float);
    if (scores_.size() < score_bytes) scores_ = device_buffer(score_bytes);
    if (selected_.size() < rows * sizeof(std::int32_t)) selected_ = device_buffer(rows * sizeof(std::int32_t));
    if (row_masks_possible_ || live_masks_possible_) {  // and each chosen page's row mask
      const std::size_t words = rows * static_cast<std::size_t>(mask_words()) * sizeof(std::uint32_t);
      if (marks_.size() < words) {
        marks_ = device_buffer(words);
        token_masks_ = device_buffer(words);
      }
      const std::size_t lengths = static_cast<std::size_t>(batch_capacity_) * shape_.num_kv_heads * sizeof(std::int32_t);
      if (table_lengths_.size() < lengths) table_lengths_ = device_buffer(lengths);
    }
  }
  /// The outputs the split kernels read in place of the sequences' block tables.
  void bind(kernel::decode_params& p) const noexcept {
    if (!planned_) return;
    p.block_tables = selected_.as<const std::int32_t>();
    if (row_masks()) {
      p.token_masks = token_masks_.as<const std::uint32_t>();
      p.mask_words = mask_words();
      p.table_lengths = table_lengths_.as<const std::int32_t>();
    }
  }

  /// Where the step's block keys are scored from (stages whose spans keep them; set before each
  /// launch).
  void use_block_keys(const block_key_source& source) noexcept { key_queries_ = source; }

  /// Scores every span, then chooses each KV head's pages (and, with row masks, their rows).
  /// `p`: the step's parameters (its metadata on the device), `staged`: this step's staged inputs
  /// on the device.
  void launch(const kernel::decode_params& p, const std::byte* staged, const float* q, cudaStream_t stream) {
    if (!planned_) return;
    const std::size_t row = align(static_cast<std::size_t>(batch_capacity_) * sizeof(std::int32_t));
    scores_overlapped_ = false;
    kernel::select_params s{};
    s.bounds = source_.bounds;
    s.bounds_entry_bytes = source_.entry_bytes;
    s.spans_per_entry = source_.spans_per_entry;
    s.summary_rows = source_.summary_rows;
    s.span_tables = source_.own_tables ? reinterpret_cast<const std::int32_t*>(staged + 3 * row) : p.sequence_tables;
    s.span_table_stride = source_.own_tables ? span_table_stride_ : table_stride_;
    s.span_tokens = source_.span_tokens;
    s.span_ranges = source_.ranges;
    s.span_counts = reinterpret_cast<const std::int32_t*>(staged);
    s.score_stride = score_stride();
    s.step_header = p.step_header;
    s.block_tables = p.sequence_tables;
    s.sealed_pages = p.sealed_pages;
    s.budget_pages = p.planned_pages;
    s.q = q;
    s.num_kv_heads = shape_.num_kv_heads;
    s.group_size = shape_.group_size;
    s.combine_sum = combine_sum_ ? 1 : 0;
    s.scores = scores_.as<float>();
    s.selected = selected_.as<std::int32_t>();
    // Instances by summary rows and heads per reduction (groups of up to 4, or of 5 to 8).
    const int heads = kernel::score_heads(shape_.group_size);
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto dim, auto) {
      using T = decltype(element);
      constexpr int head_dim = decltype(dim)::value;
      if (source_.key_bytes > 0) {  // block keys: a thread per span
        s.key_bytes = source_.key_bytes;
        s.key_retained = key_queries_.retained;
        s.key_kept = key_queries_.kept;
        s.entry_of_span = kvmosaic::detail::fast_divisor(source_.spans_per_entry);
        s.segment_of_span = kvmosaic::detail::fast_divisor(source_.spans_per_entry * key_queries_.segment_pages);
        s.key_of_chunk = kvmosaic::detail::fast_divisor(s.key_bytes / 16);
        s.segments_per_sequence = key_queries_.segments_per_sequence;
        s.q_key = key_queries_.q_key;
        const auto score = heads == 4 ? kernel::score_block_keys_kernel<T, head_dim, 4> : kernel::score_block_keys_kernel<T, head_dim, 8>;
        const kernel::block_key_launch launch = block_key_plan(score, heads);
        s.key_query_copies = launch.copies;
        s.key_stride = launch.key_stride;
        const dim3 grid(static_cast<unsigned>(shape_.num_kv_heads),
                        static_cast<unsigned>(std::max((s.score_stride + launch.threads - 1) / launch.threads, 1)),
                        static_cast<unsigned>(planned_batch_));
        const int shared = detail::opted_in_shared(score, launch.shared_bytes, score_static_shared_);
        // Overlapping the query kernel pays only while the whole grid fits on the device at once:
        // CTAs scheduled early would otherwise hold the slots its later waves need
        // (benchmark/README.md, "The selection's kernels fused, overlapped, clustered"; launched as
        // its dependent at every grid, with the early start only where it fits, it gained nothing:
        // "The selection's boundaries at every batch").
        if (key_queries_.after_queries && score_wave_ == 0) {
          int device = 0, sms = 0, per_sm = 0;
          KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device));
          KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
          KVMOSAIC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, score, launch.threads, static_cast<std::size_t>(shared)));
          score_wave_ = std::max(per_sm * sms, 1);
        }
        const bool overlap = key_queries_.after_queries &&
                             static_cast<long long>(grid.x) * grid.y * grid.z <= static_cast<long long>(score_wave_);
        s.q_key_ready = overlap ? 0 : 1;
        scores_overlapped_ = overlap;  // the whole grid resident: the page top-k may overlap it too
        detail::launch_kernel(score, grid, dim3(static_cast<unsigned>(launch.threads)), static_cast<std::size_t>(shared), stream,
                              overlap, s);
        return;
      }
      using kernel::score_pages_kernel;
      const auto score = s.summary_rows == 1
                             ? (heads == 4 ? score_pages_kernel<T, head_dim, 1, 4> : score_pages_kernel<T, head_dim, 1, 8>)
                             : (heads == 4 ? score_pages_kernel<T, head_dim, 2, 4> : score_pages_kernel<T, head_dim, 2, 8>);
      const int spans_per_cta = kernel::score_warps * kernel::score_spans_per_warp(head_dim, s.summary_rows, heads);
      const dim3 score_grid(static_cast<unsigned>(shape_.num_kv_heads),
                            static_cast<unsigned>(std::max((s.score_stride + spans_per_cta - 1) / spans_per_cta, 1)),
                            static_cast<unsigned>(planned_batch_));
      score<<<score_grid, kernel::score_warps * 32, 0, stream>>>(s);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    const dim3 select_grid(static_cast<unsigned>(planned_batch_), static_cast<unsigned>(shape_.num_kv_heads));
    s.live_masks = live_masks_;
    s.mask_words = mask_words();
    s.token_masks = token_masks_.as<std::uint32_t>();
    s.table_lengths = table_lengths_.as<std::int32_t>();
    if (row_masks_) {
      s.budget_tokens = reinterpret_cast<const std::int32_t*>(staged + row);
      s.always_from = reinterpret_cast<const std::int32_t*>(staged + 2 * row);
      s.page_size = shape_.page_size;
      s.marks = marks_.as<std::uint32_t>();
      // Keys and token counts in shared memory when they fit beside its static shared memory,
      // then the row marks when they fit too.
      int keys = kernel::span_select_shared_bytes(s.score_stride);
      if (keys > max_dynamic_shared_ || source_.longest_span > 65535) keys = 0;
      const int marks = kernel::span_marks_shared_bytes(table_stride_, mask_words());
      const bool shared_marks = keys + marks <= max_dynamic_shared_;
      const int bytes = keys + (shared_marks ? marks : 0);
      const auto select = kernel::select_spans_kernel<kernel::select_threads>;
      select<<<select_grid, kernel::select_threads, detail::opted_in_shared(select, bytes, spans_static_shared_), stream>>>(
          s, keys > 0 ? 1 : 0, shared_marks ? 1 : 0);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      return;
    }
    const int keys_bytes = kernel::select_shared_bytes(table_stride_, pages_static_shared_);
    detail::launch_kernel(kernel::select_pages_kernel<kernel::select_threads>, select_grid, dim3(kernel::select_threads),
                          static_cast<std::size_t>(keys_bytes), stream, scores_overlapped_, s, keys_bytes > 0 ? 1 : 0);
  }

  /// The page ids the last step chose for (batch entry b, KV head h), in sequence order (copied
  /// from the device after synchronizing the device: the stream of the step may be gone). For
  /// tests and reports.
  std::vector<std::int32_t> selected_pages(std::int32_t b, int head) const {
    kvmosaic::detail::require(planned_ && b >= 0 && b < planned_batch_, "cuda::engine::selection().selected_pages", "b",
                              b, "a batch entry of the last step, which must have been a selected one");
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    std::int32_t count = selected_counts_[static_cast<std::size_t>(b)];
    if (row_masks())
      KVMOSAIC_CUDA_CHECK(cudaMemcpy(&count, table_lengths_.as<const std::int32_t>() + b * shape_.num_kv_heads + head,
                                     sizeof count, cudaMemcpyDeviceToHost));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(count));
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(ids.data(),
                                   selected_.as<const std::int32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * table_stride_,
                                   ids.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    return ids;
  }
  /// The row masks of `selected_pages(b, head)` after a step with row masks: per page,
  /// mask_words() words, bit r of word w for row 32 w + r (synchronizes).
  std::vector<std::uint32_t> selected_rows(std::int32_t b, int head) const {
    const std::size_t pages = selected_pages(b, head).size(), words = static_cast<std::size_t>(mask_words());
    kvmosaic::detail::require(row_masks(), "cuda::engine::selection().selected_rows", "the last step", "page-granular",
                              "a step with row masks (sub-page spans, or evicted tokens)");
    std::vector<std::uint32_t> masks(pages * words);
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(masks.data(),
                                   token_masks_.as<const std::uint32_t>() +
                                       (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * table_stride_ * words,
                                   masks.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
    return masks;
  }
  /// The scores of the last selected step for (b, head), one per span (`spans` of them;
  /// synchronizes).
  std::vector<float> span_scores(std::int32_t b, int head, std::int32_t spans) const {
    std::vector<float> scores(static_cast<std::size_t>(spans));
    KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(scores.data(),
                                   scores_.as<const float>() + (static_cast<std::size_t>(b) * shape_.num_kv_heads + head) * score_stride(),
                                   scores.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return scores;
  }

 protected:
  /// Where the spans and their bounds live (fixed for the stage's life).
  void use_source(const span_source& source) noexcept { source_ = source; }

  /// Starts the host half of a step of `batch` sequences: `row_masks` when spans are smaller than
  /// a page; `table_entries`: the span-table entries the longest sequence lists when the spans
  /// are the stage's own (0 for the block tables' spans; scores are sized from either).
  void start(const kvmosaic::detail::selection_request& request, std::size_t batch, bool row_masks,
             std::int32_t table_entries) {
    planned_ = true;
    row_masks_ = row_masks;
    combine_sum_ = request.combine == group_combine::sum;
    planned_batch_ = static_cast<std::int32_t>(batch);
    span_table_stride_ = std::max(span_table_stride_, table_entries);
    batch_capacity_ = std::max(batch_capacity_, planned_batch_);
    span_counts_.assign(batch, 0);
    budget_tokens_.assign(batch, 0);
    always_from_.assign(batch, 0);
    span_tables_.assign(batch * static_cast<std::size_t>(span_table_stride_), 0);
    selected_counts_.assign(batch, 0);
  }
  /// A step that reads every page (no request).
  void start_unselected() noexcept { planned_ = false; }
  /// Sequence b of the started step: `spans` to score, the budget and always-read region from
  /// the request, `read_pages` pages its splits cover, and its span table (own tables only).
  /// Spans starting at or after the request's `candidates_before` (the format's recent window,
  /// read from its exact rows) are left out: the candidates are the first spans, in token order.
  void add(std::size_t b, std::int32_t spans, const kvmosaic::detail::selection_request& request, std::int32_t read_pages,
           const std::vector<std::int32_t>* table = nullptr) {
    if (b < request.candidates_before.size()) {
      const std::int64_t before = request.candidates_before[b];
      if (source_.span_tokens > 0) {
        // Spans starting before `before`: ceil(before / span_tokens), without overflow (no window: max).
        const std::int64_t fits = before <= 0 ? 0 : (before - 1) / source_.span_tokens + 1;
        spans = static_cast<std::int32_t>(std::min<std::int64_t>(spans, fits));
      } else if (b < request.chunks.size() && request.chunks[b].starts != nullptr) {
        std::int32_t fits = 0;
        while (fits < spans && fits < request.chunks[b].count && request.chunks[b].starts[fits] < before) ++fits;
        spans = fits;
      }
    }
    span_counts_[b] = spans;
    budget_tokens_[b] = static_cast<std::int32_t>(std::clamp<std::int64_t>(request.budget[b], 0, std::numeric_limits<std::int32_t>::max()));
    always_from_[b] = static_cast<std::int32_t>(std::min<std::int64_t>(request.always_from[b], std::numeric_limits<std::int32_t>::max()));
    selected_counts_[b] = read_pages;
    if (table != nullptr)
      std::copy(table->begin(), table->end(), span_tables_.begin() + static_cast<std::ptrdiff_t>(b * span_table_stride_));
  }

 private:
  static std::size_t align(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

  /// The launch of the block-key scoring kernel `score` for groups scored `heads` (4 or 8) at a
  /// time: the dynamic shared memory left beside its own (asked once).
  template <class Kernel>
  kernel::block_key_launch block_key_plan(Kernel score, int heads) {
    if (score_static_shared_ < 0) score_static_shared_ = detail::static_shared_of(score);
    return kernel::plan_block_key_scoring(key_queries_.kept, heads, source_.key_bytes, max_shared_ - score_static_shared_);
  }

  kvmosaic::detail::engine_shape shape_;
  span_source source_{};
  block_key_source key_queries_{};
  int max_dynamic_shared_ = 48 * 1024;  ///< the most dynamic shared memory select_spans_kernel may opt in to
  int max_shared_ = 48 * 1024;          ///< the most shared memory a CTA may opt in to
  int spans_static_shared_ = 0, pages_static_shared_ = 0;  ///< the top-k kernels' static shared memory
  int score_static_shared_ = -1;  ///< the block-key scoring kernel's static shared memory (-1: not asked yet)
  int score_wave_ = 0;  ///< CTAs of the block-key scoring kernel the device holds at once (0: not asked yet)
  bool scores_overlapped_ = false;  ///< the step's scoring was launched as a programmatic dependent (its grid resident at once)
  bool row_masks_possible_ = false;
  bool live_masks_possible_ = false;  ///< a step has had evicted tokens: row-mask outputs kept
  const std::uint32_t* live_masks_ = nullptr;  ///< the planned step's (device), or null
  std::int32_t batch_capacity_ = 0, table_stride_ = 0, span_table_stride_ = 0;
  // The planned step.
  bool planned_ = false, row_masks_ = false, combine_sum_ = false;
  std::int32_t planned_batch_ = 0;
  std::vector<std::int32_t> span_counts_, budget_tokens_, always_from_, span_tables_, selected_counts_;
  // Outputs.
  device_buffer scores_;         ///< [batch][num_kv_heads][score stride] span scores
  device_buffer selected_;       ///< [batch][num_kv_heads][table stride] the pages each KV head reads
  device_buffer marks_;          ///< row-mask scratch: [batch][num_kv_heads][table stride][mask words]
  device_buffer token_masks_;    ///< the row masks of selected_ (same shape)
  device_buffer table_lengths_;  ///< [batch][num_kv_heads] entries of selected_ a row-mask step wrote
};

}  // namespace kvmosaic::cuda
