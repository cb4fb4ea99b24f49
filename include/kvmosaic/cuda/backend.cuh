// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The CUDA backend: page and tail arenas in device memory, and the driver of every cache
/// operation. `kvmosaic::cache<Format, Selector, Compactor, kvmosaic::backend::cuda_for<...>>`
/// uses it; the format's kernels come from its device part (cuda/format/device_format.cuh).
///
/// Pointers the cache passes to this backend (prefill/append rows, q, out, lse) are device
/// pointers; operations are asynchronous on the engine's stream (`set_stream`), and the caller
/// synchronizes before reading results. A decode step is two pieces: `plan` (host: the split plan
/// and block tables, written to page-locked staging) and `run` (one copy to the device, the
/// optional query gather, the split kernel and the merge, with a launch shape that depends only
/// on the batch size), so `run` can be captured in a CUDA graph and replayed after each new
/// `plan`.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/split_plan.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/cuda/detail/dependent_launch.cuh"
#include "kvmosaic/cuda/detail/pull_from_host.cuh"
#include "kvmosaic/cuda/device_buffer.cuh"
#include "kvmosaic/cuda/error.cuh"
#include "kvmosaic/cuda/format/device_format.cuh"
#include "kvmosaic/cuda/kernel/compact.cuh"
#include "kvmosaic/cuda/kernel/decode.cuh"
#include "kvmosaic/cuda/kernel/extend.cuh"
#include "kvmosaic/cuda/kernel/queries.cuh"
#include "kvmosaic/cuda/kernel/select_pages.cuh"
#include "kvmosaic/cuda/kernel/token_scores.cuh"
#include "kvmosaic/cuda/kernel/window_votes.cuh"
#include "kvmosaic/cuda/select/all.cuh"
#include "kvmosaic/cuda/select/selection_stage.cuh"
#include "kvmosaic/cuda/shapes.cuh"
#include "kvmosaic/cuda/tuning.cuh"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/memory/compaction_plan.hpp"
#include "kvmosaic/select/all.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/token_scores.hpp"

namespace kvmosaic {
namespace cuda {

namespace detail {

/// Grid x for a grid-stride loop over `count` items.
inline unsigned grid_for(std::int64_t count, int threads) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((count + threads - 1) / threads, 1, 65535));
}

}  // namespace detail

/// The CUDA engine of one cache type: the driver of every format (`device_format<Format>`,
/// cuda/format/device_format.cuh, provides the format's kernels and decisions) for the kernel
/// shapes `Shapes` (`detail::shape_list`; empty: every supported shape), and of every selector
/// (`selection_stage<Selector, Shapes>`, cuda/select/selection_stage.cuh: its device storage and
/// its kernels, compiled only for a selector that reads less).
///
/// Pages of a format without an encoder are written in place by the row kernels. Other formats'
/// pages are encoded on the device: the row kernels write the completed pages' dense rows to a
/// scratch arena (at most `encode_chunk_pages` pages at a time), and the format's encode pass
/// compresses them into their pages.
template <class Format, class Selector = select::all, class Shapes = detail::shape_list<>>
class engine {
  using device = device_format<Format>;
  using traits = format_traits<Format>;
  static constexpr bool encodes_pages = device::encodes_pages;
  /// What the pages of one segment and KV head share (formats with segments; else empty).
  using segment_t = typename kvmosaic::detail::segment_type<Format>::type;

 public:
  /// The selector's device part.
  using selection_type = selection_stage<Selector, Shapes>;
  /// A step can compute token scores (`plan`'s score_settings) where the format's split kernels
  /// write their rows' logits (`writes_token_logits`: format::dense, bitmap_tiles, quant), and
  /// the engine's selector reads them (token scores: select::tova, select::h2o; window votes:
  /// select::snapkv). Only such an engine takes the kernels that write them; the others keep
  /// kernels without the stores.
  static constexpr bool records_token_scores =
      writes_token_logits<Format>::value && (kvmosaic::detail::token_scores_of<Selector>::value != score_use::none ||
                                             kvmosaic::detail::reads_window_votes<Selector>::value);
  /// `window_votes` runs on the device where the engine records token scores and its format's
  /// logits are exact (`writes_exact_logits`: dense, bitmap_tiles); elsewhere the cache scores
  /// the keys it reads back.
  static constexpr bool computes_window_votes = records_token_scores && writes_exact_logits<Format>::value;

 private:
  static constexpr bool selects = selection_type::selects;
  /// The selector keeps mean keys and the format has block keys (`has_block_keys_v`): the stage
  /// keeps the format's block keys, which the format writes at each seal and scores from the
  /// step's queries in each segment (`encode_block_keys`, `block_key_queries`).
  static constexpr bool block_keys =
      has_block_keys_v<Format> && kvmosaic::detail::block_summary_of<Selector>::value == block_summary::mean;
  static selection_type make_selection(const kvmosaic::detail::engine_shape& shape, const Format& format, const Selector& selector) {
    if constexpr (block_keys) return selection_type(shape, selector, traits::block_key_bytes(format, shape.page()));
    else return selection_type(shape, selector);
  }

  /// Where a step's outputs go: `data` in the merge kernel's output type at `strides`, and the
  /// optional log-sum-exps.
  struct output_view {
    void* data = nullptr;
    dtype type = dtype::f32;
    std::int64_t strides[3] = {0, 0, 0};
    float* lse = nullptr;
    std::int64_t lse_strides[2] = {0, 0};
  };
  /// A step's queries as `run` was given them: any io dtype, any strides.
  struct query_view {
    const void* data;
    dtype type;
    std::int64_t extents[3];
    std::int64_t strides[3];
    bool contiguous;
  };


 public:
  /// The arenas for `shape`, the format's kernel path for this device, and the selector's device
  /// storage (`selection_type`).
  engine(const kvmosaic::detail::engine_shape& shape, const Format& format, const Selector& selector = {})
      : shape_(validated(shape, format)),
        format_(format),
        geometry_(shape, format),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        selection_(make_selection(shape, format, selector)) {
    KVMOSAIC_CUDA_CHECK(cudaGetDevice(&device_));
    const int device = device_;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device));
    int major = 0;
    KVMOSAIC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    use_bulk_copy_ = major >= 9;
    supports_dependent_launch_ = dependent_launch_ = major >= 9;
    // Rows a TMA box reads past a tail's last token must hold finite values (they meet p = 0).
    KVMOSAIC_CUDA_CHECK(cudaMemset(pages_.data(), 0, pages_.size()));
    KVMOSAIC_CUDA_CHECK(cudaMemset(tails_.data(), 0, tails_.size()));
    KVMOSAIC_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    if constexpr (has_segments_v<Format>) {
      const int per = traits::segment_pages(format_, shape_.page());
      segments_per_sequence_ = (shape.max_pages + per - 1) / per;
      segment_arena_ = device_buffer(static_cast<std::size_t>(shape.max_sequences) * segments_per_sequence_ * shape.num_kv_heads *
                                     device::segment_entry_bytes(format_, shape_.page()));
    }
    configure_format();
    prepare_decode_kernel();
  }
  ~engine() {
    if (staged_ != nullptr) cudaEventDestroy(staged_);
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  const kvmosaic::detail::arena_geometry& geometry() const noexcept { return geometry_; }
  /// Bytes of one pool slot: one page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return geometry_.page_slot_bytes(); }
  /// Bytes a page costs besides its slot: what the selector keeps per page (0 for none).
  std::size_t page_bounds_bytes() const noexcept { return selection_.page_bytes(); }
  /// The selector's device part: its storage, and what the last step chose (for tests and
  /// reports); a selector's host hooks drive it through the non-const one.
  const selection_type& selection() const noexcept { return selection_; }
  selection_type& selection() noexcept { return selection_; }
  const std::byte* pages_data() const noexcept { return pages_.as<const std::byte>(); }
  const std::byte* tails_data() const noexcept { return tails_.as<const std::byte>(); }

  /// The stream every operation of this engine is enqueued on (default: the legacy stream 0).
  void set_stream(cudaStream_t stream) noexcept { stream_ = stream; }
  cudaStream_t stream() const noexcept { return stream_; }

  /// Prefill (a chunk of) one sequence, which has `sealed_pages` pages and `tail_rows` tail rows,
  /// from device rows [n][heads][head_dim].
  template <class T>
  void extend(std::int32_t slot, int tail_rows, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              const page_id* new_pages, std::int64_t sealed_pages) {
    check_device_rows("cache::prefill", k, v);
    // Rows after a sealed page land on the old tail rows, and a seal rewrites the exact rows.
    if ((tail_rows > 0 && tail_rows + k.extent(0) > shape_.page_size) ||
        (geometry_.exact_rows > 0 && tail_rows + k.extent(0) >= shape_.page_size))
      save_tail(slot);
    // Encoded formats: chunks of at most encode_chunk_pages completed pages (the scratch arena);
    // formats without an encoder write every row in one pass. A chunk always holds at least one row: the tail
    // holds fewer than page_size rows, and a chunk of an encoded format is whole pages.
    const std::int64_t rows = k.extent(0);
    for (std::int64_t first = 0; first < rows;) {
      const std::int64_t room = encodes_pages ? std::int64_t{encode_chunk_pages} * shape_.page_size - tail_rows : rows - first;
      const auto count = static_cast<std::int32_t>(std::min(room, rows - first));
      const kernel::extend_item item{first, count, slot, tail_rows, 0};
      const std::int32_t pages = (tail_rows + count) / shape_.page_size;
      if constexpr (has_segments_v<Format>) plan_segments_in(slot, tail_rows, k, v, first, pages, sealed_pages);
      std::vector<kernel::exact_item> sealed(static_cast<std::size_t>(pages));
      for (std::int32_t i = 0; i < pages; ++i) sealed[static_cast<std::size_t>(i)] = sealed_page(slot, sealed_pages + i, sealed_pages + pages);
      run_extend(std::vector<kernel::extend_item>{item}, new_pages, pages, k.data(), v.data(), strides_of(k, v), dtype_traits<T>::id,
                 count, sealed);
      new_pages += pages;
      sealed_pages += pages;
      tail_rows = (tail_rows + count) % shape_.page_size;
      first += count;
    }
  }

  /// One decode token per sequence: row b of k, v (device, [batch][heads][head_dim]) to items[b].
  template <class T>
  void append(const std::vector<kvmosaic::detail::append_item>& items, tensor_view<const T, 3> k,
              tensor_view<const T, 3> v) {
    check_device_rows("cache::append", k, v);
    std::vector<kernel::extend_item> work;
    std::vector<page_id> new_pages;
    std::vector<kernel::exact_item> sealed;
    for (std::size_t b = 0; b < items.size(); ++b) {
      work.push_back(kernel::extend_item{static_cast<std::int64_t>(b), 1, items[b].slot, items[b].tail_rows,
                                         static_cast<std::int32_t>(new_pages.size())});
      if (items[b].new_page >= 0) {
        if constexpr (has_segments_v<Format>)
          plan_segments_in(items[b].slot, items[b].tail_rows, kvmosaic::detail::row_of(k, static_cast<std::int64_t>(b)),
                           kvmosaic::detail::row_of(v, static_cast<std::int64_t>(b)), 0, 1, items[b].sealed_pages);
        new_pages.push_back(items[b].new_page);
        sealed.push_back(sealed_page(items[b].slot, items[b].sealed_pages, items[b].sealed_pages + 1));
      }
    }
    run_extend(work, new_pages.data(), static_cast<std::int32_t>(new_pages.size()), k.data(), v.data(), strides_of(k, v),
               dtype_traits<T>::id, 1, sealed);
  }

  /// Undoes the writes since the last `commit` that a caller can see: the tail rows an `extend`
  /// overwrote (copied back on the stream), and the selector's updates not yet committed. Rows past
  /// a tail's committed length and fresh pages are never read. After
  /// a sticky CUDA error (a fault in a kernel) the device state is lost with the context.
  void rollback() noexcept {
    if (saved_slot_ >= 0) {
      const std::size_t bytes = geometry_.tail_slot_bytes();
      try {
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tails_.as<std::byte>() + saved_slot_ * bytes, saved_tail_.data(), bytes,
                                            cudaMemcpyDeviceToDevice, stream_));
      } catch (...) {  // the context is gone; the caller's exception says why
      }
    }
    saved_slot_ = -1;
    selection_.rollback();
  }
  /// Makes the writes since the last `commit` final (host bookkeeping only; cannot throw).
  void commit() noexcept {
    saved_slot_ = -1;
    selection_.commit();
  }

  /// Copies the page slots `pages[0 .. n)` (`page_slot_bytes()` each, in that order) into host
  /// memory at `out`, after the work already on the engine's stream: the bytes `cache::read`
  /// decodes on the host. Runs of consecutive page ids go in one copy; returns when the copies
  /// are done (synchronizes the stream, so not inside a graph capture).
  void copy_pages_out(const page_id* pages, std::size_t n, std::byte* out) const {
    const std::size_t bytes = page_slot_bytes();
    for (std::size_t i = 0; i < n;) {
      std::size_t run = 1;
      while (i + run < n && pages[i + run] == pages[i] + static_cast<page_id>(run)) ++run;
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out + i * bytes, pages_.as<const std::byte>() + static_cast<std::size_t>(pages[i]) * bytes,
                                          run * bytes, cudaMemcpyDeviceToHost, stream_));
      i += run;
    }
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  /// Copies the tail slot of `slot` (`geometry().tail_slot_bytes()`) into host memory at `out`,
  /// after the work already on the stream; synchronizes the stream, as `copy_pages_out`.
  void copy_tail_out(std::int32_t slot, std::byte* out) const {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out, tails_.as<const std::byte>() + static_cast<std::size_t>(slot) * bytes, bytes,
                                        cudaMemcpyDeviceToHost, stream_));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void copy_tail(std::int32_t from, std::int32_t to, int /*rows*/) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tails_.as<std::byte>() + to * bytes, tails_.as<std::byte>() + from * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    if constexpr (has_segments_v<Format>) {  // a fork reads its shared pages in the same segments
      segments_[static_cast<std::size_t>(to)] = segments_[static_cast<std::size_t>(from)];
      const std::size_t slot_bytes = segment_arena_.size() / static_cast<std::size_t>(shape_.max_sequences);
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(segment_arena_.as<std::byte>() + to * slot_bytes, segment_arena_.as<std::byte>() + from * slot_bytes,
                                          slot_bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    if constexpr (has_key_weights_v<Format>) {
      has_key_weights_[static_cast<std::size_t>(to)] = has_key_weights_[static_cast<std::size_t>(from)];
      if (has_key_weights_[static_cast<std::size_t>(from)]) {
        const std::size_t row = shape_.row_elements() * sizeof(float);
        KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(key_weights_.as<std::byte>() + to * row, key_weights_.as<std::byte>() + from * row,
                                            row, cudaMemcpyDeviceToDevice, stream_));
      }
    }
  }

  /// Formats with segments: the segment of KV head `head` that page `index` of the sequence in
  /// `slot` is stored in (the host copy of what the kernels read), the bytes the segments of a
  /// sequence of `pages` pages keep, and the host decode of a page copied out of the device.
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>  // not in an explicit instantiation
  const segment_t& segment(std::int32_t slot, std::int64_t index, int head) const {
    const std::int64_t s = index / traits::segment_pages(format_, shape_.page());
    return segments_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(s * shape_.num_kv_heads + head)];
  }
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>
  std::size_t segment_bytes(std::int64_t pages) const {
    const std::int64_t per = traits::segment_pages(format_, shape_.page());
    return static_cast<std::size_t>((pages + per - 1) / per) * shape_.num_kv_heads * traits::segment_bytes(format_, shape_.page());
  }
  template <class F = Format, std::enable_if_t<has_segments_v<F>, int> = 0>
  void decode_page(std::int32_t slot, std::int64_t index, int head, bool is_v, const std::byte* page, int n, float* rows) const {
    const segment_t& seg = segment(slot, index, head);
    if (is_v) traits::decode_v(format_, shape_.page(), seg, page, n, rows);
    else traits::decode_k(format_, shape_.page(), seg, page, n, rows);
  }

  /// A compaction pass over the sealed pages `pages` of the sequence in `slot` (`plan`, from
  /// memory/compaction_plan.hpp), on the device with no page bytes through the host:
  /// `stage_moves` then `launch_moves`. Every page the plan writes gets its rows gathered into
  /// scratch slots (from its sources' unpacked rows, or from format::dense's pages as they are)
  /// before any is written back; the selector's per-page metadata of those pages is rewritten
  /// from the same rows (`selection_stage::seal`); encoded formats encode them again with the
  /// format's re-encoding mode (`detail::reencoding`: its format, and the sequence's K weights
  /// where it uses them), other formats copy them back. `first_page_sinks`: the sequence's first
  /// page keeps sink rows, hidden again as at seal. The same bytes as the host backend's
  /// `move_slots` (the GPU tests compare them).
  /// Cost: per page written, an unpack of each page it reads from, a gather and an encode.
  void move_slots(std::int32_t slot, const block_table& pages, const kvmosaic::detail::compaction_plan& plan,
                  bool first_page_sinks) {
    if (plan.moves.empty()) return;
    stage_moves(slot, pages, plan, first_page_sinks);
    launch_moves();
  }

  /// The host half of `move_slots`: the pass in chunks of at most `encode_chunk_pages` written
  /// pages (one chunk when a later chunk would read a page an earlier one wrote), each chunk's
  /// page ids and row map written to page-locked staging. Waits only for the previous copy out of
  /// the staging. Cost: O(rows of the pages written) on the host.
  void stage_moves(std::int32_t slot, const block_table& pages, const kvmosaic::detail::compaction_plan& plan,
                   bool first_page_sinks);

  /// Pages the last staged compaction pass writes and unpacks (summed over its chunks): what its
  /// device work reads and writes, for reports and benchmarks.
  struct staged_move_pages {
    std::int64_t written = 0, unpacked = 0;
  };
  staged_move_pages staged_moves() const noexcept {
    staged_move_pages pages;
    for (const move_chunk& c : move_chunks_) {
      pages.written += c.pages_written;
      pages.unpacked += c.pages_unpacked;
    }
    return pages;
  }

  /// The device half of `move_slots`, enqueued on the engine's stream: one copy of the staged
  /// metadata, then per chunk the unpack, the gather, the selector's seal and the encode (or the
  /// copy back). Capturable in a CUDA graph; a replay redoes the staged pass.
  void launch_moves();

  /// Output-aware K pruning for the pages of `slot` sealed from now on: weights [num_kv_heads]
  /// [head_dim] in host memory (copied before this returns), or null for plain magnitudes.
  template <class F = Format>  // a template: only formats with K weights instantiate it
  void set_key_weights(std::int32_t slot, const float* weights) {
    static_assert(has_key_weights_v<F>, "this format has no K weights");
    has_key_weights_[static_cast<std::size_t>(slot)] = weights != nullptr;
    if (weights == nullptr) return;
    const std::size_t row = shape_.row_elements() * sizeof(float);
    if (key_weights_.size() == 0) key_weights_ = device_buffer(static_cast<std::size_t>(shape_.max_sequences) * row);
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // encodes in flight may read the old row
    KVMOSAIC_CUDA_CHECK(cudaMemcpy(key_weights_.as<std::byte>() + slot * row, weights, row, cudaMemcpyHostToDevice));
  }

  /// The host half of a decode step (`cache::plan`): the split plan, and with a selection request
  /// what the device selects from, written to page-locked staging. Waits only for the previous
  /// step's copy out of that staging.
  /// With `scores.use` other than none (`records_token_scores`), the step also computes each read
  /// token's score (select/token_scores.hpp) on the device: the split kernels write their rows'
  /// logits, a score kernel after the merge normalizes and combines them and files them by logical
  /// position in the selector stage's score buffers (`selection().score_table()`: a sealed row's
  /// position from the stage's mirror of the cache's position map, a tail row's from the
  /// sequence's `tail_position`). Nothing comes back to the host. Cost: per token and KV head,
  /// 4 x group bytes written and read back, 4 written (8 moved when cumulative); device memory
  /// 4 x group bytes per row of the batch's capacity.
  void plan(const std::vector<kvmosaic::detail::sequence_ref>& batch, float softmax_scale,
            const kvmosaic::detail::selection_request* request = nullptr, const score_settings& scores = {}) {
    kvmosaic::detail::require(scores.use == score_use::none || records_token_scores, "cuda::engine::plan", "token scores",
                              "requested", "an engine that records them: format::dense, bitmap_tiles or quant under a "
                              "selector that reads token scores or window votes (format::packed_bitmap's kernels write "
                              "no logits yet; backend::host: every format)");
    plan_step(batch, request);
    softmax_scale_ = softmax_scale;
    planned_scores_ = scores;
    if (scores.use != score_use::none) reserve_token_scores();
  }

  /// The device half (`cache::run`), enqueued on the engine's stream and capturable in a CUDA
  /// graph: q (device, [batch][num_q_heads][head_dim], float, half or bfloat16, any strides) is
  /// read in place when it is contiguous float, else gathered to float first (one small kernel);
  /// out gets the outputs in its own type and strides, lse (optional, [batch][num_q_heads] float)
  /// each head's log-sum-exp.
  template <class Q, class O>
  void run(tensor_view<const Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse) {
    require_device_memory("cache::run", "q", q.data());
    require_device_memory("cache::run", "out", out.data());
    if (lse.extent(0) > 0) require_device_memory("cache::run", "lse", lse.data());
    const float* queries =
        q.data() == nullptr
            ? nullptr
            : gathered_queries(query_view{q.data(), dtype_traits<Q>::id, {q.extent(0), q.extent(1), q.extent(2)},
                                          {q.stride(0), q.stride(1), q.stride(2)}, q.is_contiguous()});
    output_view o{out.data(), dtype_traits<O>::id, {out.stride(0), out.stride(1), out.stride(2)}, lse.extent(0) > 0 ? lse.data() : nullptr,
                  {lse.stride(0), lse.stride(1)}};
    launch_step(queries, o, softmax_scale_);
  }

  /// The votes of an observation window over one sequence (`cache::window_votes`, which states
  /// the math): `queries` (host memory, [window][num_q_heads][head_dim] float, unscaled) are the
  /// queries of positions window_start .. window_start + window; `row_positions[r]` is the logical
  /// position of row r of the sequence's read order (-1: none, an evicted row or a page copy of an
  /// exact row). Returns [num_kv_heads][rows] fp32 in host memory: each row's probabilities under
  /// each window query's causal softmax, combined over the group, summed over the window; 0 for
  /// rows at or after window_start. Runs decode steps of up to `window_batch` copies of the
  /// sequence whose split kernels write their rows' logits, then `kernel::window_lse_kernel` and
  /// `kernel::window_votes_kernel` over them; waits for the result. Invalidates the last plan.
  /// Cost: ceil(window / window_batch) steps reading the sequence once per query (the queries of a
  /// step share no reads), plus 4 x group bytes written and read twice per row, KV head and query;
  /// device memory 4 x group x window_batch bytes per row and KV head (the step's logits).
  std::vector<float> window_votes(const kvmosaic::detail::sequence_ref& sequence, const float* queries, int window,
                                  const std::vector<std::int64_t>& row_positions, std::int64_t window_start,
                                  float softmax_scale, group_combine combine);
  /// Window queries per decode step of `window_votes`.
  static constexpr int window_batch = 8;

  /// Fixes the step metadata layout for batches up to `batch` sequences of up to
  /// `max_pages_per_sequence` pages. Steps within it reuse the same buffers and launch shape, which
  /// is what a captured CUDA graph needs; a larger step grows the layout (re-capture after that).
  void reserve_step(std::int32_t batch, std::int32_t max_pages_per_sequence, std::int32_t splits = 0,
                    bool live_masks = false) {
    const layout_capacity new_capacity{std::max(capacity_.batch, batch),
                                       std::max(capacity_.table_stride, max_pages_per_sequence),
                                       std::max({capacity_.work, splits, work_capacity(batch)}), capacity_.live_masks || live_masks};
    selection_.reserve(new_capacity.batch, new_capacity.table_stride, new_capacity.live_masks);
    if (new_capacity.batch == capacity_.batch && new_capacity.table_stride == capacity_.table_stride &&
        new_capacity.work == capacity_.work && new_capacity.live_masks == capacity_.live_masks &&
        layout_.bytes - layout_.selection >= selection_.staged_bytes())
      return;
    capacity_ = new_capacity;
    const std::int32_t work = capacity_.work;
    layout_.header = 0;
    layout_.work = align(4 * sizeof(std::int32_t));
    layout_.partial_offset = layout_.work + align(static_cast<std::size_t>(work) * sizeof(split_work));
    layout_.slots = layout_.partial_offset + align((capacity_.batch + 1) * sizeof(std::int32_t));
    layout_.tail_rows = layout_.slots + align(capacity_.batch * sizeof(std::int32_t));
    layout_.sealed = layout_.tail_rows + align(capacity_.batch * sizeof(std::int32_t));
    layout_.read_pages = layout_.sealed + align(capacity_.batch * sizeof(std::int32_t));
    layout_.tail_positions = layout_.read_pages + align(capacity_.batch * sizeof(std::int32_t));
    layout_.tables = layout_.tail_positions + align(capacity_.batch * sizeof(std::int64_t));
    layout_.live_masks = layout_.tables + align(static_cast<std::size_t>(capacity_.batch) * capacity_.table_stride * sizeof(std::int32_t));
    layout_.selection = layout_.live_masks + (capacity_.live_masks ? align(static_cast<std::size_t>(capacity_.batch) * capacity_.table_stride *
                                                                           live_mask_words() * sizeof(std::uint32_t))
                                                                     : 0);
    layout_.bytes = layout_.selection + align(selection_.staged_bytes());
    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));
    staging_ = pinned_buffer(layout_.bytes);
    step_metadata_ = device_buffer(layout_.bytes);
    const std::size_t partial_floats = static_cast<std::size_t>(work) * shape_.num_kv_heads * shape_.group_size * (shape_.head_dim + 1);
    partials_ = device_buffer(partial_floats * sizeof(float));
    queries_ = device_buffer(static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * shape_.group_size *
                             shape_.head_dim * sizeof(float));
    if constexpr (block_keys)
      block_key_queries_ = device_buffer(static_cast<std::size_t>(capacity_.batch) * shape_.num_kv_heads * segments_per_sequence_ *
                                         kernel::score_heads(shape_.group_size) * traits::basis_dim(format_, shape_.page()) *
                                         sizeof(float));
  }

  /// Block keys: the step's queries in each (sequence, KV head, segment)'s rotated space, by the
  /// format, and where the stage scores its keys from.
  void prepare_block_keys(const kernel::decode_params& p) {
    if constexpr (block_keys) {  // discarded for other engines, which an explicit instantiation compiles too
      const device_context c = context();
      block_key_query_context queries{&c, p.q, p.tail_slots, p.sealed_pages, batch_, block_key_queries_.as<float>(),
                                      kernel::score_heads(shape_.group_size), layout_segments()};
      queries.after_pull = dependent_launch_;  // the pass follows the metadata pull as its programmatic dependent
      device::template block_key_queries<Shapes>(format_state_, format_, queries);
      if (pulled_ < layout_.bytes) {  // the tables and the rest, beside the rotation (stage_step)
        detail::pull_from_host(staging_, step_metadata_.data(), layout_.bytes - pulled_, stream_, pulled_, true);
        pulled_ = layout_.bytes;
        staging_read();
      }
      block_key_source source;
      source.q_key = block_key_queries_.as<const float>();
      source.kept = traits::basis_dim(format_, shape_.page());
      source.retained = traits::block_key_values(format_, shape_.page());
      source.segment_pages = traits::segment_pages(format_, shape_.page());
      source.segments_per_sequence = segments_per_sequence_;
      source.after_queries = dependent_launch_;
      selection_.use_block_keys(source);
    }
  }
  /// Block keys: the format writes those of `n` sealed pages (dense rows in slots `row_slots` of
  /// `rows`, pages `page_ids` in segments `segment_entries`) into the stage's arena.
  void seal_block_keys(const std::byte* rows, std::int64_t rows_slot_bytes, std::int64_t rows_head_bytes, const std::int32_t* row_slots,
                       const std::int32_t* page_ids, const std::int32_t* segment_entries, std::int32_t n) {
    if constexpr (block_keys) {
      const device_context c = context();
      const kvmosaic::detail::bounds_geometry& g = selection_.geometry();
      device::template encode_block_keys<Shapes>(
          format_state_, format_,
          block_key_seal_context{&c, rows, rows_slot_bytes, rows_head_bytes, row_slots, page_ids, segment_entries, n,
                                 selection_.block_key_arena(), static_cast<std::int64_t>(g.page_bytes), static_cast<int>(g.block_bytes),
                                 g.block_tokens, g.blocks_per_page});
    }
  }

  /// Host part of a step: the split plan from the lengths and the block tables, written to
  /// page-locked staging. Waits for the previous step's copy out of that staging, not for kernels.
  /// With a selection request, the selector's stage says which pages each sequence's splits cover
  /// (`selection_stage::plan`) and stages what the device selects from.
  void plan_step(const std::vector<kvmosaic::detail::sequence_ref>& batch,
                 const kvmosaic::detail::selection_request* request = nullptr) {
    const auto n = static_cast<std::int32_t>(batch.size());
    std::vector<std::int32_t> full_pages(batch.size()), tail_rows(batch.size()), slots(batch.size()), read_pages(batch.size());
    std::vector<step_sequence> sequences(batch.size());
    std::vector<std::int32_t> dense_rows(batch.size());  // the exact rows and the tail rows: one run
    std::int32_t longest = 1;
    // The step reads live-row masks where a sequence has evicted tokens or sealed rows attended
    // from their exact copies: window rows, and sinks unless the format's kernel skips them itself.
    bool masked = false;
    step_rows_ = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t exact = geometry_.exact_rows_held(static_cast<std::int64_t>(batch[b].pages->size()) * shape_.page_size);
      step_rows_ = std::max(step_rows_, batch[b].length + exact);
      const bool masks_exact_rows = exact > 0 && (geometry_.window_rows > 0 || !device::masks_sink_rows);
      masked = masked || batch[b].live != nullptr || masks_exact_rows;
      full_pages[b] = static_cast<std::int32_t>(batch[b].pages->size());
      tail_rows[b] = static_cast<std::int32_t>(batch[b].length - static_cast<std::int64_t>(full_pages[b]) * shape_.page_size);
      slots[b] = batch[b].slot;
      sequences[b] = step_sequence{slots[b], full_pages[b]};
      dense_rows[b] = tail_rows[b] + static_cast<std::int32_t>(exact);
      longest = std::max(longest, full_pages[b]);
    }
    selection_.plan(request, sequences, read_pages);
    const decode_tuning tuning = decode_tuning_for(shape_.head_dim, shape_.group_size);
    const split_plan plan =
        make_split_plan(read_pages, dense_rows, target_splits(), use_bulk_copy_ ? max_pages_per_split(tuning) : 1 << 30,
                        split_page_multiple, plan_segment_pages(), split_cost_pages());
    reserve_step(n, longest, plan.num_splits(), masked);
    step_masked_ = masked;
    batch_ = n;
    step_splits_ = plan.num_splits();

    KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));  // the previous copy has left the staging
    std::byte* host = staging_.as<std::byte>();
    const std::int32_t stride = capacity_.table_stride;
    const bool selected = selection_.planned();
    const std::int32_t header[4] = {plan.num_splits(), selected ? shape_.num_kv_heads * stride : stride, selected ? stride : 0,
                                    stride};
    std::memcpy(host + layout_.header, header, sizeof header);
    std::memcpy(host + layout_.sealed, full_pages.data(), full_pages.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.read_pages, read_pages.data(), read_pages.size() * sizeof(std::int32_t));
    selection_.stage(host + layout_.selection);
    std::memcpy(host + layout_.work, plan.work.data(), plan.work.size() * sizeof(split_work));
    std::memcpy(host + layout_.partial_offset, plan.partial_offset.data(), plan.partial_offset.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.slots, slots.data(), slots.size() * sizeof(std::int32_t));
    std::memcpy(host + layout_.tail_rows, tail_rows.data(), tail_rows.size() * sizeof(std::int32_t));
    auto* tail_positions = reinterpret_cast<std::int64_t*>(host + layout_.tail_positions);
    for (std::size_t b = 0; b < batch.size(); ++b)
      tail_positions[b] = batch[b].tail_position >= 0 ? batch[b].tail_position
                                                      : static_cast<std::int64_t>(full_pages[b]) * shape_.page_size;
    auto* tables = reinterpret_cast<std::int32_t*>(host + layout_.tables);
    for (std::size_t b = 0; b < batch.size(); ++b)
      std::copy(batch[b].pages->begin(), batch[b].pages->end(), tables + b * capacity_.table_stride);
    if (masked) {  // per (sequence, table entry): its live rows (every row for a sequence with none evicted),
                   // less the rows attended from their exact copies (sinks, recent window)
      auto* masks = reinterpret_cast<std::uint32_t*>(host + layout_.live_masks);
      const int words = live_mask_words(), words64 = (shape_.page_size + 63) / 64;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const std::int64_t sealed = static_cast<std::int64_t>(full_pages[b]) * shape_.page_size;
        const bool exact = geometry_.exact_rows > 0 && sealed > 0;
        std::uint32_t* row = masks + b * static_cast<std::size_t>(capacity_.table_stride) * words;
        if (!exact && shape_.page_size % 64 == 0) {  // the map's 64-bit words are the masks' 32-bit pairs
          const std::size_t bytes = static_cast<std::size_t>(full_pages[b]) * static_cast<std::size_t>(words) * sizeof(std::uint32_t);
          if (batch[b].live != nullptr) std::memcpy(row, batch[b].live, bytes);  // little-endian: low word first
          else std::memset(row, 0xff, bytes);
          continue;
        }
        for (std::int32_t i = 0; i < full_pages[b]; ++i)
          for (int w = 0; w < words; ++w) {
            const int rows = std::min(32, shape_.page_size - 32 * w);
            const std::int64_t first = static_cast<std::int64_t>(i) * shape_.page_size + 32 * w;
            std::uint32_t word = rows >= 32 ? ~0u : (1u << rows) - 1;
            if (batch[b].live != nullptr)
              word = static_cast<std::uint32_t>(batch[b].live[static_cast<std::size_t>(i) * words64 + w / 2] >> (32 * (w % 2)));
            if (exact && geometry_.any_exact_position(first, first + rows, sealed))
              for (int r = 0; r < rows; ++r)
                if (geometry_.exact_position(first + r, sealed)) word &= ~(1u << r);
            row[static_cast<std::size_t>(i) * words + w] = word;
          }
      }
    }
  }

  /// The selection part of a planned selected step alone (the metadata copy, scoring and top-k),
  /// capturable like `launch_step`: for timing selection apart from attention.
  void launch_selection_only(const float* q);

 private:
  /// Room for the logits of a step of the reserved layout: rows of the read order per (sequence,
  /// KV head), and the merge's log-sum-exps when the caller wants none.
  void reserve_token_scores() {
    const std::int64_t rows = static_cast<std::int64_t>(capacity_.table_stride) * shape_.page_size +
                              static_cast<std::int64_t>(geometry_.exact_rows) + shape_.page_size;
    if (rows <= logit_slots_ && capacity_.batch <= score_batch_) return;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffers may still be in use
    logit_slots_ = std::max(rows, logit_slots_);
    score_batch_ = std::max(capacity_.batch, score_batch_);
    const std::size_t slots = static_cast<std::size_t>(score_batch_) * shape_.num_kv_heads * static_cast<std::size_t>(logit_slots_);
    token_logits_ = device_buffer(slots * shape_.group_size * sizeof(float));
    score_lse_ = device_buffer(static_cast<std::size_t>(score_batch_) * shape_.num_kv_heads * shape_.group_size * sizeof(float));
  }

  /// Device part of a step (capturable in a CUDA graph): copy the staged metadata, run the split
  /// kernel over a grid of `work_capacity(batch)` x num_kv_heads CTAs, then the merge kernel. On
  /// sm_90 the split and merge kernels are programmatic dependents of the kernel before each
  /// (cuda/detail/dependent_launch.cuh): each is scheduled while its predecessor finishes.
  void launch_step(const float* q, const output_view& out, float softmax_scale);

  /// The step's queries as contiguous float: `q` itself, or a copy gathered into `queries_`
  /// (sized by reserve_step for the largest batch).
  const float* gathered_queries(const query_view& q);

  /// Marks the step's staging as read once the stream's last copy out of it has run (outside a
  /// graph: in a graph the caller orders replays and plan_step, and synchronizes before reading
  /// results).
  void staging_read() {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    KVMOSAIC_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
    if (capturing == cudaStreamCaptureStatusNone) KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
  }

  /// Copies the staged metadata to the device and returns the step's kernel parameters.
  kernel::decode_params stage_step(const float* q, const output_view& out, float softmax_scale) {
    // A selected step that rotates its queries for block keys (sm_90) and has at least
    // `pull_beside_bytes()` past the per-sequence arrays first pulls those arrays, which is all the
    // rotation reads, and `prepare_block_keys` pulls the rest beside the rotation; any other step
    // pulls everything here.
    bool rest_beside = false;
    if constexpr (block_keys)
      rest_beside = dependent_launch_ && selection_.planned() && layout_.bytes - layout_.tables >= pull_beside_bytes_;
    pulled_ = rest_beside ? layout_.tables : layout_.bytes;
    detail::pull_from_host(staging_, step_metadata_.data(), pulled_, stream_);
    if (pulled_ == layout_.bytes) staging_read();
    const std::byte* device = step_metadata_.as<const std::byte>();
    kernel::decode_params p{};
    p.pages = pages_.as<const std::byte>();
    p.tails = tails_.as<const std::byte>();
    p.page_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
    p.k_page_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
    p.v_page_bytes = static_cast<std::int64_t>(geometry_.v_page_bytes);
    p.tail_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
    p.tail_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
    p.num_kv_heads = shape_.num_kv_heads;
    p.page_size = shape_.page_size;
    p.step_header = reinterpret_cast<const std::int32_t*>(device + layout_.header);
    p.sequence_tables = reinterpret_cast<const std::int32_t*>(device + layout_.tables);
    p.sealed_pages = reinterpret_cast<const std::int32_t*>(device + layout_.sealed);
    p.block_tables = p.sequence_tables;
    p.planned_pages = reinterpret_cast<const std::int32_t*>(device + layout_.read_pages);
    // Evicted tokens: live-row masks per (sequence, entry). A selected step's stage ANDs them into
    // the row masks it writes; otherwise the split kernels read them, every head alike.
    const auto* live = step_masked_ ? reinterpret_cast<const std::uint32_t*>(device + layout_.live_masks) : nullptr;
    selection_.use_live_masks(selection_.planned() ? live : nullptr);
    selection_.bind(p);  // a selected step: the stage's page tables (and row masks)
    if (live != nullptr && !selection_.planned()) {
      p.token_masks = live;
      p.mask_words = live_mask_words();
    }
    p.tail_slots = reinterpret_cast<const std::int32_t*>(device + layout_.slots);
    p.tail_rows = reinterpret_cast<const std::int32_t*>(device + layout_.tail_rows);
    p.work = reinterpret_cast<const split_work*>(device + layout_.work);
    p.partial_offset = reinterpret_cast<const std::int32_t*>(device + layout_.partial_offset);
    p.q = q;
    p.softmax_scale = softmax_scale;
    const std::int32_t work = capacity_.work;
    p.partial_o = partials_.as<float>();
    p.partial_lse = partials_.as<float>() + static_cast<std::size_t>(work) * shape_.num_kv_heads * shape_.group_size * shape_.head_dim;
    p.out = out.data;
    std::copy(out.strides, out.strides + 3, p.out_strides);
    p.lse = out.lse;
    std::copy(out.lse_strides, out.lse_strides + 2, p.lse_strides);
    p.group_size = shape_.group_size;
    p.sink_rows = static_cast<int>(geometry_.sink_rows);
    p.exact_rows = static_cast<int>(geometry_.exact_rows);
    if (planned_scores_.use != score_use::none) {
      p.token_logits = token_logits_.as<float>();
      p.logit_slots = logit_slots_;
      if (p.lse == nullptr) {  // the score kernel reads each head's log-sum-exp from the merge
        p.lse = score_lse_.as<float>();
        p.lse_strides[0] = static_cast<std::int64_t>(shape_.num_kv_heads) * shape_.group_size;
        p.lse_strides[1] = 1;
      }
    }
    return p;
  }

 public:
  /// Calls f(kernel, threads, dynamic shared bytes) with the split kernel this engine launches:
  /// the bulk-copy pipeline on sm_90 and later, the portable register-streaming kernel elsewhere.
  template <class F>
  void with_decode_kernel(F&& f) const {
    device::template with_decode_kernel<Shapes, records_token_scores>(format_state_, format_, context(),
                                                                      selection_.row_masks() || step_masked_, f);
  }

  /// The most pages one split may hold (the page ids a format's sm_90 kernel keeps in shared
  /// memory, or no limit).
  int max_pages_per_split(const decode_tuning& t) const { return device::max_pages_per_split(format_state_, t); }

  /// Formats whose sm_90 kernel streams compressed pages through shared-memory stages: sets the
  /// stages (1 to 4; what a stage holds is the format's) and re-reads the occupancy. For tuning
  /// experiments; the format picks a value by itself.
  void set_compressed_stages(int stages) {
    kvmosaic::detail::require(format_state_.stages > 0, "cuda::engine::set_compressed_stages", "this engine's kernel",
                              "without run-time stages", "a format's sm_90 kernel with compressed stages");
    kvmosaic::detail::require(stages >= 1 && stages <= 4, "cuda::engine::set_compressed_stages", "stages", stages,
                              "1 to 4");
    format_state_.stages = stages;
    prepare_decode_kernel();
  }
  /// The stages of the format's kernel (0: none at run time).
  int compressed_stages() const noexcept { return format_state_.stages; }

  /// A split's fixed work in pages' worth, as the split plan weighs it (`make_split_plan`): the
  /// format's estimate for its kernel, unless set here. For tuning experiments.
  std::int32_t split_cost_pages() const {
    return split_cost_override_ >= 0 ? split_cost_override_ : split_cost<Format>::pages(format_, shape_.page());
  }
  /// Splits of the last planned step (per KV head).
  std::int32_t last_step_splits() const noexcept { return step_splits_; }
  /// Sets the split cost the plan uses from the next step (>= 0), or back to the format's (-1).
  void set_split_cost_pages(std::int32_t pages) {
    kvmosaic::detail::require(pages >= -1, "cuda::engine::set_split_cost_pages", "pages", pages,
                              ">= 0, or -1 for the format's estimate");
    split_cost_override_ = pages;
  }

  /// Splits per KV head the plan aims for: exactly one wave of resident CTAs (occupancy of the
  /// kernel this engine launches, times the SMs), so every split runs at once; or the count set by
  /// `set_target_splits`.
  std::int32_t target_splits() const {
    return target_splits_override_ > 0 ? target_splits_override_ : std::max(1, num_sms_ * ctas_per_sm_ / shape_.num_kv_heads);
  }
  /// Sets the splits per KV head the plan aims for from the next step (>= 1), or back to one wave
  /// of the device (0). For tests and tuning: fewer splits make longer ones, which is how a test
  /// reaches a kernel's per-split limits (`max_pages_per_split`) without a long context.
  void set_target_splits(std::int32_t splits) {
    kvmosaic::detail::require(splits >= 0, "cuda::engine::set_target_splits", "splits", splits,
                              ">= 1, or 0 for one wave of the device");
    target_splits_override_ = splits;
  }
  /// The least metadata past the per-sequence arrays (the tables, the selection's inputs) that a
  /// selected step over block keys pulls beside its query rotation rather than before it (sm_90):
  /// the second pull costs about a launch, which the overlap repays from about this size on
  /// (benchmark/README.md, "The tables pulled beside the query rotation"). Set for tests and
  /// tuning (0: every such step), from the next step.
  std::size_t pull_beside_bytes() const noexcept { return pull_beside_bytes_; }
  void set_pull_beside_bytes(std::size_t bytes) noexcept { pull_beside_bytes_ = bytes; }

  /// The format's device decisions (kernel path, stages, scratch sizes), to tune or to test; its
  /// members are the format's device part's to document (cuda/format/<name>/device.cuh).
  typename device::state& format_state() noexcept { return format_state_; }
  /// Decode with the portable kernel (the sm_75+ path) even on sm_90: for tests and comparisons.
  /// Takes effect from the next step.
  void use_portable_kernel() {
    use_bulk_copy_ = false;
    configure_format();
  }

  /// Programmatic dependent launch of the split and merge kernels (on by default where the device
  /// supports it, sm_90 and later; elsewhere this does nothing). For comparisons: off, each kernel
  /// of a step starts after the one before it has drained. Takes effect from the next launch.
  void use_dependent_launch(bool enable) noexcept { dependent_launch_ = enable && supports_dependent_launch_; }
  bool uses_dependent_launch() const noexcept { return dependent_launch_; }

  /// True when decode runs an sm_90 pipeline (bulk copies or TMA), whose q is rounded to two
  /// 16-bit halves on tensor cores.
  bool uses_bulk_copy() const noexcept { return use_bulk_copy_; }
  /// True when the format's split kernel multiplies p.v on tensor cores, p split into two 16-bit
  /// halves (its device part says).
  bool splits_p_on_tensor_cores() const { return device::splits_p_on_tensor_cores(format_state_, context()); }
  /// Grid size of the split kernel for a batch: an upper bound on the splits of any plan for it
  /// (at most target + batch: each sequence rounds its split count up by less than one), so a
  /// captured graph stays valid. Plans capped by max_pages_per_split (longer than a wave) may need
  /// more; the grid then grows with them (re-capture).
  std::int32_t work_capacity(std::int32_t batch) const { return target_splits() + batch; }

 private:
  static std::size_t align(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
  /// Split sizes in multiples of the workers a format's split kernel deals its pages to.
  static constexpr std::int32_t split_page_multiple = device::split_page_multiple;
  /// Completed pages per encode pass (encoded formats): bounds the scratch arena for a prefill.
  static constexpr std::int32_t encode_chunk_pages = 64;

  /// The format's device part decides its kernel path for this device (and may turn the sm_90
  /// pipelines off); then the kernel's occupancy sizes the split plan.
  void configure_format();
  device_context context() const {
    return device_context{&shape_,  &geometry_, pages_.as<std::byte>(), tails_.as<std::byte>(), device_, use_bulk_copy_,
                          stream_,  segment_arena_.as<const std::byte>(), segments_per_sequence_,
                          !selector_traits<Selector>::reads_all_pages};
  }
  /// Pages per segment for the split plan (its splits stay within one), 0 for formats without.
  std::int32_t plan_segment_pages() const {
    if constexpr (has_segments_v<Format>) return traits::segment_pages(format_, shape_.page());
    else return 0;
  }
  /// Formats with segments: the segments a sequence of the reserved step layout can span (its
  /// table stride in pages), 1 to segments_per_sequence_; 0 for formats without.
  std::int32_t layout_segments() const {
    const std::int32_t per = plan_segment_pages();
    return per > 0 ? std::max(1, std::min(segments_per_sequence_, (capacity_.table_stride + per - 1) / per)) : 0;
  }
  /// Formats with segments: the segment arena's entry (slot x segments_per_sequence + segment) of
  /// the segment that page `index` of the block table of the sequence in `slot` is stored in; -1
  /// for formats without.
  std::int32_t segment_entry(std::int32_t slot, std::int64_t index) const {
    const std::int32_t per = plan_segment_pages();
    return per > 0 ? slot * segments_per_sequence_ + static_cast<std::int32_t>(index / per) : -1;
  }

  /// Formats with segments: before pages [sealed_pages, sealed_pages + pages) of the sequence in
  /// `slot` are sealed from its tail (`tail_rows` rows) and rows [first, ...) of the call's
  /// device rows `k`, `v`, plans each of them that starts a segment from the rows the host engine
  /// would see (`detail::plan_segments`: the tail as it will be at that seal, and the call's rows
  /// after it), keeps the host copy and writes the device entries. A format that plans from sums
  /// (`has_segment_sums_v`) has the device compute them (`device_format::segment_sums`) and plans
  /// on the host from them alone; where its plan reads rows, from other sums the device computes
  /// in the planned bases (`has_segment_search_sums_v`, `device_format::segment_search_sums`),
  /// else from the rows copied back. Cost per segment: the sums on the device and their copy to
  /// the host, or a copy of the segment's rows; the format's plan; a copy of the entries back
  /// (synchronizes the stream).
  template <class T>
  void plan_segments_in(std::int32_t slot, int tail_rows, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v,
                        std::int64_t first, std::int32_t pages, std::int64_t sealed_pages) {
    const page_shape shape = shape_.page();
    const int per = traits::segment_pages(format_, shape), p = shape_.page_size;
    for (std::int32_t i = 0; i < pages; ++i) {
      const std::int64_t index = sealed_pages + i;
      if (index % per != 0) continue;
      const std::int64_t page_first = first + static_cast<std::int64_t>(i) * p - tail_rows;  // call row of the page's row 0
      const std::int64_t next = page_first + p;
      const std::int64_t ahead = std::min<std::int64_t>(k.extent(0) - next, static_cast<std::int64_t>(per - 1) * p);
      std::vector<segment_t> planned;
      std::vector<double> sums;  // formats with sums: [num_kv_heads][segment_sum_count], from the device
      if constexpr (has_segment_sums_v<Format>) {
        const kvmosaic::detail::segment_fit_rows fit = kvmosaic::detail::segment_fit_rows::of(geometry_, p, index, ahead);
        const int skip = fit.skip;
        const std::int64_t n = fit.count;
        const int from_tail = static_cast<int>(std::max<std::int64_t>(0, -page_first));  // the page's rows still in the tail
        const std::size_t count = traits::segment_sum_count(format_, shape);
        sums.resize(static_cast<std::size_t>(shape_.num_kv_heads) * count);
        const device_context c = context();
        const segment_sums_context rows{&c, tails_.as<const std::byte>() + slot * geometry_.tail_slot_bytes(), k.data(), v.data(),
                                        dtype_traits<T>::id, skip, std::max(0, from_tail - skip), p - skip, page_first + skip, n,
                                        sums.data()};
        device::template segment_sums<Shapes>(format_state_, format_, rows);
        // A plan that reads rows takes them from the device's sums of them where the format says
        // how (has_segment_search_sums_v), else from the rows copied back (below).
        if (!traits::plan_reads_rows(format_) || has_segment_search_sums_v<Format>) {
          planned.resize(static_cast<std::size_t>(shape_.num_kv_heads));
          kvmosaic::detail::for_each_item(
              shape_.num_kv_heads, [] { return 0; }, [&](std::int64_t h, int&) {
                planned[static_cast<std::size_t>(h)] =
                    traits::template plan_segment_from_sums<float>(format_, shape, sums.data() + h * count, n, nullptr, nullptr);
              });
          if constexpr (has_segment_search_sums_v<Format>)
            if (traits::plan_reads_rows(format_)) {
              const std::size_t per_head = static_cast<std::size_t>((n + traits::segment_search_chunk_rows - 1) / traits::segment_search_chunk_rows) *
                                           traits::segment_search_sum_count(format_, shape);
              std::vector<double> search(static_cast<std::size_t>(shape_.num_kv_heads) * per_head);
              device::template segment_search_sums<Shapes>(format_state_, format_, rows, planned.data(), search.data());
              for (int h = 0; h < shape_.num_kv_heads; ++h)
                traits::search_segment_from_sums(format_, shape, planned[static_cast<std::size_t>(h)], n, search.data() + h * per_head);
            }
        }
      }
      if (planned.empty()) planned = plan_from_rows(slot, k, v, page_first, next, ahead, index, sums);
      store_segments(slot, index, planned);
    }
  }
  /// `plan_segments_in` for one segment from its rows, copied to the host (with the device's
  /// sums, when given).
  template <class T>
  std::vector<segment_t> plan_from_rows(std::int32_t slot, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v,
                                        std::int64_t page_first, std::int64_t next, std::int64_t ahead, std::int64_t index,
                                        const std::vector<double>& sums) {
    const int p = shape_.page_size;
    const std::int64_t row_elements = static_cast<std::int64_t>(shape_.num_kv_heads) * shape_.head_dim;
    const std::int64_t base = std::max<std::int64_t>(0, page_first), count = next + ahead - base;
    std::vector<T> k_rows(static_cast<std::size_t>(count * row_elements)), v_rows(k_rows.size());
    std::vector<std::byte> tail(geometry_.tail_slot_bytes());
    const std::size_t row_bytes = static_cast<std::size_t>(row_elements) * sizeof(T);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(k_rows.data(), k.data() + base * row_elements, count * row_bytes, cudaMemcpyDeviceToHost, stream_));
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(v_rows.data(), v.data() + base * row_elements, count * row_bytes, cudaMemcpyDeviceToHost, stream_));
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(tail.data(), tails_.as<const std::byte>() + slot * tail.size(), tail.size(),
                                        cudaMemcpyDeviceToHost, stream_));
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const tensor_view<const T, 3> k_view(k_rows.data(), count, shape_.num_kv_heads, shape_.head_dim);
    const tensor_view<const T, 3> v_view(v_rows.data(), count, shape_.num_kv_heads, shape_.head_dim);
    // The tail as it is at the seal: the call's rows of the page after the tail's own.
    std::vector<float> row(static_cast<std::size_t>(shape_.head_dim));
    for (std::int64_t r = std::max<std::int64_t>(0, -page_first); r < p; ++r)
      for (int h = 0; h < shape_.num_kv_heads; ++h)
        for (const bool is_v : {false, true}) {
          for (int c = 0; c < shape_.head_dim; ++c) row[static_cast<std::size_t>(c)] = to_float((is_v ? v_view : k_view)(page_first + r - base, h, c));
          kvmosaic::detail::store_dense_rows(shape_.storage, row.data(), row.size(),
                                             tail.data() + geometry_.tail_offset(is_v, h) + geometry_.tail_row_offset() +
                                                 static_cast<std::size_t>(r) * geometry_.row_bytes);
        }
    return kvmosaic::detail::plan_segments(format_, shape_, geometry_, tail.data(), index, k_view, v_view, next - base,
                                           sums.empty() ? nullptr : sums.data());
  }
  /// Keeps the host copy of a sequence's newly planned segment (one per KV head) starting at page
  /// `index`, and writes its device entries (synchronizes the stream).
  void store_segments([[maybe_unused]] std::int32_t slot, [[maybe_unused]] std::int64_t index,
                      [[maybe_unused]] std::vector<segment_t>& planned) {
    if constexpr (has_segments_v<Format>) {  // a member of every engine: explicit instantiations compile it
      const page_shape shape = shape_.page();
      const int per = traits::segment_pages(format_, shape);
      const std::size_t entry_bytes = device::segment_entry_bytes(format_, shape);
      std::vector<std::byte> entries(planned.size() * entry_bytes);
      for (std::size_t h = 0; h < planned.size(); ++h) device::store_segment(format_, shape, planned[h], entries.data() + h * entry_bytes);
      const std::size_t at = static_cast<std::size_t>(segment_entry(slot, index)) * shape_.num_kv_heads * entry_bytes;
      KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(segment_arena_.as<std::byte>() + at, entries.data(), entries.size(), cudaMemcpyHostToDevice, stream_));
      KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::vector<segment_t>& list = segments_[static_cast<std::size_t>(slot)];
      list.resize(static_cast<std::size_t>(index / per) * shape_.num_kv_heads);
      list.insert(list.end(), std::make_move_iterator(planned.begin()), std::make_move_iterator(planned.end()));
    }
  }
  static const kvmosaic::detail::engine_shape& validated(const kvmosaic::detail::engine_shape& shape, const Format& format) {
    kvmosaic::detail::require(Shapes::contains(shape.storage, shape.head_dim, shape.group_size), "cache_config",
                              "storage/head_dim/group_size",
                              std::string(to_string(shape.storage)) + "/" + std::to_string(shape.head_dim) + "/" +
                                  std::to_string(shape.group_size),
                              ("a shape of the cache's CUDA backend: " + Shapes::describe()).c_str());
    device::validate(format, shape);
    return shape;
  }

  /// Raises the chosen split kernel's dynamic shared-memory limit and reads its occupancy, which
  /// sizes the split plan.
  void prepare_decode_kernel();

  /// Rows are read through their strides (a cache of `select::per_kv_head` writes one head of the
  /// caller's rows to each lane); each row's head_dim elements must be contiguous, and a format
  /// with segments (it copies whole rows back to plan them) takes contiguous arrays only.
  template <class T>
  void check_device_rows(const char* where, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v) const {
    const auto fits = [](const tensor_view<const T, 3>& x) {
      if constexpr (has_segments_v<Format>) return x.is_contiguous();
      return (x.extent(2) <= 1 || x.stride(2) == 1) && x.stride(0) >= 0 && x.stride(1) >= 0;
    };
    kvmosaic::detail::require(fits(k) && fits(v), where, "k, v layout", "strided",
                              has_segments_v<Format> ? "contiguous device arrays [rows][num_kv_heads][head_dim] for this format"
                                                     : "device arrays [rows][num_kv_heads][head_dim] whose head_dim elements are "
                                                       "contiguous (stride(2) == 1), other strides >= 0");
    require_device_memory(where, "k", k.data());
    require_device_memory(where, "v", v.data());
  }
  template <class T>
  static kernel::row_strides strides_of(const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v) noexcept {
    return kernel::row_strides{k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  }
  /// Rejects a pointer the device cannot read: host memory that is not mapped (page-locked
  /// host memory and managed memory are accepted). One driver query, no synchronization.
  static void require_device_memory(const char* where, const char* name, const void* pointer) {
    cudaPointerAttributes attributes{};
    const cudaError_t result = cudaPointerGetAttributes(&attributes, pointer);
    if (result != cudaSuccess) cudaGetLastError();  // not a pointer CUDA knows: clear, then reject
    const bool readable = result == cudaSuccess && (attributes.type == cudaMemoryTypeDevice ||
                                                    attributes.type == cudaMemoryTypeManaged ||
                                                    (attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr));
    kvmosaic::detail::require(readable, where, name, "host memory",
                              "device memory (cudaMalloc, cudaMallocManaged or mapped page-locked host memory) on "
                              "the CUDA backend");
  }

  /// Writes rows and completes pages; `sealed[i]`: new page i's tail slot, first position and the
  /// sequence's window start once the write is done (its exact rows are copied to the tail slot).
  void run_extend(const std::vector<kernel::extend_item>& items, const page_id* new_pages, std::int32_t num_new_pages,
                  const void* k, const void* v, kernel::row_strides strides, dtype rows_type, std::int64_t max_rows,
                  const std::vector<kernel::exact_item>& sealed);
  /// What the exact-row copy needs of page `index` of the sequence in `slot` that has `pages_after`
  /// pages once the write is done.
  kernel::exact_item sealed_page(std::int32_t slot, std::int64_t index, std::int64_t pages_after) const noexcept {
    const std::int64_t p = shape_.page_size;
    return kernel::exact_item{index * p, pages_after * p - static_cast<std::int64_t>(geometry_.window_rows), slot, 0};
  }

  /// Grows the scratch arena of dense page rows that encoded formats compress from.
  void reserve_scratch(std::int32_t pages) {
    if (pages <= scratch_pages_) return;
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old arena may still be read
    scratch_pages_ = std::max(pages, encode_chunk_pages);
    scratch_ = device_buffer(static_cast<std::size_t>(scratch_pages_) * geometry_.tail_slot_bytes());
  }

  /// Keeps the tail slot `slot` on the device for `rollback` (a stream-ordered copy).
  void save_tail(std::int32_t slot) {
    const std::size_t bytes = geometry_.tail_slot_bytes();
    if (saved_tail_.size() < bytes) saved_tail_ = device_buffer(bytes);
    KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(saved_tail_.data(), tails_.as<const std::byte>() + slot * bytes, bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    saved_slot_ = slot;
  }
  /// One chunk of a staged compaction pass: byte offsets in its metadata of the written pages'
  /// ids, their scratch ordinals and K weight rows, the pages to unpack, the row map, and for formats
  /// with segments the segment entries of the pages unpacked and written.
  struct move_chunk {
    std::size_t written = 0, ordinals = 0, weight_rows = 0, unpacked = 0, sources_of = 0;
    std::size_t unpacked_segments = 0, written_segments = 0;  ///< formats with segments: each page's segment entry
    std::int32_t pages_written = 0, pages_unpacked = 0;
  };
  struct layout_capacity {
    std::int32_t batch = 0, table_stride = 0, work = 0;
    bool live_masks = false;  ///< room for live-row masks (once a step had evicted tokens)
  };
  /// 32-bit row-mask words per page.
  int live_mask_words() const noexcept { return (shape_.page_size + 31) / 32; }
  /// Byte offsets of the step metadata: [header][work][partial_offset][slots][tail_rows][sealed pages]
  /// [pages to read][tail positions][tables][live masks][the selection stage's inputs].
  struct step_layout {
    std::size_t header = 0, work = 0, partial_offset = 0, slots = 0, tail_rows = 0, sealed = 0, read_pages = 0,
                tail_positions = 0, tables = 0, live_masks = 0, selection = 0, bytes = 0;
  };
  kvmosaic::detail::engine_shape shape_;
  Format format_;
  kvmosaic::detail::arena_geometry geometry_;
  device_buffer pages_;
  device_buffer tails_;
  selection_type selection_;     ///< the selector's device part
  device_buffer block_key_queries_;  ///< block keys: the step's queries per (sequence, KV head, segment)
  int device_ = 0;
  int num_sms_ = 1;
  int ctas_per_sm_ = 1;
  std::int32_t split_cost_override_ = -1;  ///< `set_split_cost_pages`; -1: the format's
  std::int32_t target_splits_override_ = 0;  ///< `set_target_splits`; 0: one wave of the device
  bool use_bulk_copy_ = false;
  bool supports_dependent_launch_ = false;  ///< sm_90 and later
  bool dependent_launch_ = false;           ///< split and merge kernels overlap their predecessor's end
  cudaStream_t stream_ = nullptr;
  cudaEvent_t staged_ = nullptr;  ///< the last copy out of page-locked staging
  std::size_t pulled_ = 0;        ///< bytes of the step's metadata pulled so far (stage_step, prepare_block_keys)
  std::size_t pull_beside_bytes_ = 64 * 1024;  ///< see pull_beside_bytes()
  layout_capacity capacity_;
  step_layout layout_;
  std::int32_t batch_ = 0;
  std::int32_t step_splits_ = 0;
  bool step_masked_ = false;  ///< the planned step reads live-row masks (a sequence has evicted tokens)
  pinned_buffer staging_, extend_staging_;
  device_buffer step_metadata_, extend_metadata_, partials_;
  device_buffer queries_;         ///< a step's queries gathered to contiguous float (when they are not)
  float softmax_scale_ = 1.0f;    ///< of the planned step
  score_settings planned_scores_;  ///< of the planned step
  bool logits_only_ = false;       ///< the step writes logits for `window_votes`, no token scores
  std::int64_t step_rows_ = 0;     ///< the planned step's most rows of one sequence's read order
  std::int64_t logit_slots_ = 0;   ///< rows per (sequence, KV head) of the token-score buffers
  std::int32_t score_batch_ = 0;   ///< sequences they hold
  device_buffer token_logits_;     ///< [batch][KV head][logit_slots_][group] (steps with token scores)
  device_buffer score_lse_;        ///< [batch][num_q_heads]: the merge's log-sum-exps when the caller wants none
  device_buffer scratch_;        ///< dense rows of pages to encode (encoded formats)
  device_buffer key_weights_;    ///< [max_sequences][num_kv_heads][head_dim] output-aware K weights
  std::vector<bool> has_key_weights_ = std::vector<bool>(static_cast<std::size_t>(shape_.max_sequences), false);
  std::int32_t scratch_pages_ = 0;
  pinned_buffer move_staging_;     ///< a compaction pass's metadata (`stage_moves`)
  device_buffer move_metadata_;
  std::size_t move_bytes_ = 0;
  std::vector<move_chunk> move_chunks_;
  device_buffer unpacked_;         ///< dense rows of the pages a compaction chunk reads (encoded formats)
  std::int32_t unpacked_pages_ = 0;
  device_buffer saved_tail_;      ///< one tail slot kept for `rollback`
  std::int32_t saved_slot_ = -1;  ///< its slot, -1: nothing to restore
  typename device::state format_state_{};  ///< the format's device decisions (kernel path, stages)
  /// Formats with segments: per tail slot the host copies of its sequence's segments,
  /// [segment * num_kv_heads + head], and the device arena of their entries.
  std::vector<std::vector<segment_t>> segments_ = std::vector<std::vector<segment_t>>(static_cast<std::size_t>(shape_.max_sequences));
  device_buffer segment_arena_;
  int segments_per_sequence_ = 0;
  Format reencoding_ = kvmosaic::detail::reencoding<Format>::format(format_);  ///< what a compaction encodes with
};

// The members that launch kernels, out of line: an explicit instantiation declaration of the
// engine (cuda/instantiate.cuh) then keeps them, and every kernel they launch, out of a
// translation unit.

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_selection_only(const float* q) {
  kvmosaic::detail::require(selects && selection_.planned(), "cuda::engine::launch_selection_only", "the planned step",
                            "not selected", "a step planned with a selection request (a read-less selector)");
  const kernel::decode_params p = stage_step(q, output_view{}, 1.0f);
  if constexpr (block_keys) prepare_block_keys(p);
  selection_.launch(p, step_metadata_.as<const std::byte>() + layout_.selection, q, stream_);
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_step(const float* q, const output_view& out, float softmax_scale) {
  kernel::split_params<typename device::params> p{};
  static_cast<kernel::decode_params&>(p) = stage_step(q, out, softmax_scale);
  p.format = device::params_for(format_state_, format_, context());
  if constexpr (selects)
    if (selection_.planned()) {
      if constexpr (block_keys) {
        prepare_block_keys(p);
        device::use_block_key_queries(p.format, block_key_queries_.as<const float>(), kernel::score_heads(shape_.group_size));
      }
      selection_.launch(p, step_metadata_.as<const std::byte>() + layout_.selection, q, stream_);
    }
  const int num_q_heads = shape_.num_kv_heads * shape_.group_size;
  const dim3 grid(static_cast<unsigned>(std::max(work_capacity(batch_), step_splits_)), static_cast<unsigned>(shape_.num_kv_heads));
  with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
    detail::launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), detail::opted_in_shared(kernel, shared_bytes),
                          stream_, dependent_launch_, p);
  });
  const kernel::decode_params& common = p;
  detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto, auto dim, auto) {
    constexpr int head_dim = decltype(dim)::value;
    detail::dispatch_io_type(out.type, [&](auto element) {
      detail::launch_kernel(kernel::merge_splits_kernel<head_dim, decltype(element)>, dim3(static_cast<unsigned>(batch_ * num_q_heads)),
                            dim3(merge_threads(head_dim)), 0, stream_, dependent_launch_, common, num_q_heads);
    });
  });
  // A selector that reads token scores keeps them in its stage (`score_table`); window votes
  // (select::snapkv) read the logits themselves.
  if constexpr (records_token_scores && kvmosaic::detail::token_scores_of<Selector>::value != score_use::none) {
    if (planned_scores_.use == score_use::none || logits_only_) return;
    // About 8 rows per thread: enough CTAs to fill the device at one sequence, few partial-state
    // merges per CTA.
    constexpr std::int64_t rows_per_cta = 8 * kernel::token_score_threads;
    const dim3 grid_scores(static_cast<unsigned>(std::max<std::int64_t>(1, (step_rows_ + rows_per_cta - 1) / rows_per_cta)),
                           static_cast<unsigned>(shape_.num_kv_heads), static_cast<unsigned>(batch_));
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, shape_.group_size, [&](auto, auto, auto group) {
      detail::launch_kernel(kernel::token_scores_kernel<decltype(group)::value>, grid_scores,
                            dim3(static_cast<unsigned>(kernel::token_score_threads)), 0, stream_, dependent_launch_, common,
                            selection_.score_table(),
                            reinterpret_cast<const std::int64_t*>(step_metadata_.as<const std::byte>() + layout_.tail_positions),
                            planned_scores_.combine == group_combine::max, planned_scores_.use == score_use::cumulative);
    });
  }
}

template <class Format, class Selector, class Shapes>
std::vector<float> engine<Format, Selector, Shapes>::window_votes(const kvmosaic::detail::sequence_ref& sequence,
                                                                  const float* queries, int window,
                                                                  const std::vector<std::int64_t>& row_positions,
                                                                  std::int64_t window_start, float softmax_scale,
                                                                  group_combine combine) {
  const char* where = "cuda::engine::window_votes";
  kvmosaic::detail::require(computes_window_votes, where, "the engine", "without exact logits",
                            "an engine of format::dense or bitmap_tiles under a selector that reads window votes");
  kvmosaic::detail::require(window >= 1, where, "window", window, ">= 1");
  const auto rows = static_cast<std::int64_t>(row_positions.size());
  const int heads = shape_.num_kv_heads, group = shape_.group_size;
  const std::size_t query_floats = static_cast<std::size_t>(heads) * group * shape_.head_dim;
  const int per_step = std::min(window, window_batch);
  device_buffer device_queries(static_cast<std::size_t>(window) * query_floats * sizeof(float));
  device_buffer outputs(static_cast<std::size_t>(per_step) * query_floats * sizeof(float));
  device_buffer positions(static_cast<std::size_t>(rows) * sizeof(std::int64_t));
  device_buffer lse(static_cast<std::size_t>(per_step) * heads * group * sizeof(float));
  device_buffer votes(static_cast<std::size_t>(heads) * static_cast<std::size_t>(rows) * sizeof(float));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(device_queries.data(), queries, device_queries.size(), cudaMemcpyHostToDevice, stream_));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(positions.data(), row_positions.data(), positions.size(), cudaMemcpyHostToDevice, stream_));
  KVMOSAIC_CUDA_CHECK(cudaMemsetAsync(votes.data(), 0, votes.size(), stream_));
  struct logits_only_scope {  // the flag is the engine's state: cleared on every way out
    bool& flag;
    explicit logits_only_scope(bool& f) : flag(f) { flag = true; }
    ~logits_only_scope() { flag = false; }
  } scope(logits_only_);
  output_view out{outputs.data(), dtype::f32,
                  {static_cast<std::int64_t>(query_floats), static_cast<std::int64_t>(shape_.head_dim), 1}, nullptr, {0, 0}};
  for (int first = 0; first < window; first += per_step) {
    const int n = std::min(per_step, window - first);
    plan(std::vector<kvmosaic::detail::sequence_ref>(static_cast<std::size_t>(n), sequence), softmax_scale, nullptr,
         score_settings{score_use::last_step, combine});
    launch_step(device_queries.as<const float>() + static_cast<std::size_t>(first) * query_floats, out, softmax_scale_);
    const kernel::window_vote_params p{token_logits_.as<const float>(), logit_slots_, positions.as<const std::int64_t>(),
                                       rows, window_start, first, n, heads, lse.as<float>(), votes.as<float>(),
                                       combine == group_combine::max};
    detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, group, [&](auto, auto, auto g) {
      constexpr int Group = decltype(g)::value;
      kernel::window_lse_kernel<Group><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(heads)),
                                         kernel::window_vote_threads, 0, stream_>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
      const auto blocks = static_cast<unsigned>((rows + kernel::window_vote_threads - 1) / kernel::window_vote_threads);
      kernel::window_votes_kernel<Group><<<dim3(std::max(blocks, 1u), static_cast<unsigned>(heads)),
                                           kernel::window_vote_threads, 0, stream_>>>(p);
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
  }
  std::vector<float> out_votes(static_cast<std::size_t>(heads) * static_cast<std::size_t>(rows));
  KVMOSAIC_CUDA_CHECK(cudaMemcpyAsync(out_votes.data(), votes.data(), votes.size(), cudaMemcpyDeviceToHost, stream_));
  KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // also: the buffers above outlive their kernels
  return out_votes;
}

template <class Format, class Selector, class Shapes>
const float* engine<Format, Selector, Shapes>::gathered_queries(const query_view& q) {
  if (q.type == dtype::f32 && q.contiguous) return static_cast<const float*>(q.data);
  detail::dispatch_io_type(q.type, [&](auto element) {
    using Q = decltype(element);
    const kernel::query_source<Q> source{static_cast<const Q*>(q.data), {q.strides[0], q.strides[1], q.strides[2]},
                                         static_cast<int>(q.extents[0]), static_cast<int>(q.extents[1]),
                                         static_cast<int>(q.extents[2])};
    constexpr int threads = 256;
    kernel::gather_queries_kernel<Q><<<detail::grid_for(q.extents[0] * q.extents[1] * q.extents[2], threads), threads, 0, stream_>>>(
        source, queries_.as<float>());
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  });
  return queries_.as<const float>();
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::stage_moves(std::int32_t slot, const block_table& pages,
                                                   const kvmosaic::detail::compaction_plan& plan, bool first_page_sinks) {
  const int p = shape_.page_size;
  const bool segmented = plan_segment_pages() > 0;  // formats with segments: each page's segment is staged too
  const std::vector<std::int32_t>& written = plan.pages_written;  // block-table indices, ascending
  const auto n = static_cast<std::int32_t>(written.size());
  const auto index_of = [&](std::int64_t page) {
    return static_cast<std::size_t>(std::lower_bound(written.begin(), written.end(), static_cast<std::int32_t>(page)) - written.begin());
  };
  // Row r of written page i takes the token in sealed slot source[i * p + r] (block-table slots).
  std::vector<std::int64_t> source(static_cast<std::size_t>(n) * p);
  for (std::int32_t i = 0; i < n; ++i)
    for (int r = 0; r < p; ++r) source[static_cast<std::size_t>(i) * p + r] = static_cast<std::int64_t>(written[i]) * p + r;
  for (const kvmosaic::detail::slot_move& m : plan.moves) source[index_of(m.to / p) * p + m.to % p] = m.from;
  const int sinks = kvmosaic::detail::hides_sink_rows_v<Format> && first_page_sinks && n > 0 && written[0] == 0
                        ? static_cast<int>(geometry_.sink_rows)
                        : 0;
  for (int t = 0; t < sinks; ++t) source[static_cast<std::size_t>(t)] = source[static_cast<std::size_t>(sinks)];  // hidden as at seal

  // Chunks of written pages; the pages a chunk reads (distinct source pages, first-use order).
  const auto pages_read = [&](std::int32_t first, std::int32_t last) {
    std::vector<std::int32_t> read;
    for (std::size_t at = static_cast<std::size_t>(first) * p; at < static_cast<std::size_t>(last) * p; ++at) {
      const auto page = static_cast<std::int32_t>(source[at] / p);
      if (std::find(read.begin(), read.end(), page) == read.end()) read.push_back(page);
    }
    return read;
  };
  std::vector<std::pair<std::int32_t, std::int32_t>> ranges;
  bool ordered = true;  // no chunk reads a page an earlier chunk wrote
  for (std::int32_t first = 0; first < n; first += encode_chunk_pages) {
    const std::int32_t last = std::min(n, first + encode_chunk_pages);
    for (const std::int32_t page : pages_read(first, last))
      ordered = ordered && !std::binary_search(written.begin(), written.begin() + first, page);
    ranges.emplace_back(first, last);
  }
  if (!ordered) ranges.assign(1, {0, n});

  if constexpr (!encodes_pages)  // read in place and written back as scratch rows are laid out
    kvmosaic::detail::require(geometry_.k_page_bytes == geometry_.v_page_bytes && geometry_.k_page_bytes == p * geometry_.row_bytes,
                              "cuda::engine::move_slots", "the format's page layout", "not dense rows",
                              "dense rows [page_size][head_dim] per head (a format without an encoder)");
  const std::int64_t max_sources = static_cast<std::int64_t>(shape_.max_pages) * p;
  kvmosaic::detail::require(max_sources <= std::numeric_limits<std::int32_t>::max(), "cache::compact", "max_pages * page_size",
                            max_sources, "below 2^31 on backend::cuda (the row map is 32-bit)");
  std::vector<std::vector<std::int32_t>> reads;
  std::size_t bytes = 0;
  std::int32_t most_written = 0, most_read = 0;
  move_chunks_.clear();
  for (const auto& [first, last] : ranges) {
    move_chunk c;
    c.pages_written = last - first;
    reads.push_back(encodes_pages ? pages_read(first, last) : std::vector<std::int32_t>{});
    c.pages_unpacked = static_cast<std::int32_t>(reads.back().size());
    const std::size_t ids = align(static_cast<std::size_t>(c.pages_written) * sizeof(std::int32_t));
    c.written = bytes;
    c.ordinals = c.written + ids;
    c.weight_rows = c.ordinals + ids;
    c.unpacked = c.weight_rows + ids;
    c.sources_of = c.unpacked + align(static_cast<std::size_t>(c.pages_unpacked) * sizeof(std::int32_t));
    c.unpacked_segments = c.sources_of + align(static_cast<std::size_t>(c.pages_written) * p * sizeof(std::int32_t));
    c.written_segments = c.unpacked_segments + (segmented ? align(static_cast<std::size_t>(c.pages_unpacked) * sizeof(std::int32_t)) : 0);
    bytes = c.written_segments + (segmented ? ids : 0);
    most_written = std::max(most_written, c.pages_written);
    most_read = std::max(most_read, c.pages_unpacked);
    move_chunks_.push_back(c);
  }
  reserve_scratch(most_written);
  if (most_read > unpacked_pages_) {
    KVMOSAIC_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old arena may still be read
    unpacked_pages_ = std::max(most_read, encode_chunk_pages);
    unpacked_ = device_buffer(static_cast<std::size_t>(unpacked_pages_) * geometry_.tail_slot_bytes());
  }
  KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));  // the previous copy has left the staging
  move_staging_.reserve(bytes);
  move_metadata_.reserve(bytes);
  move_bytes_ = bytes;
  std::byte* host = move_staging_.as<std::byte>();
  bool weighted = false;
  if constexpr (has_key_weights_v<Format>)
    weighted = kvmosaic::detail::reencoding<Format>::key_weights && has_key_weights_[static_cast<std::size_t>(slot)];
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const move_chunk& c = move_chunks_[k];
    const std::int32_t first = ranges[k].first;
    const std::vector<std::int32_t>& read = reads[k];
    auto* ids = reinterpret_cast<std::int32_t*>(host + c.written);
    auto* ordinals = reinterpret_cast<std::int32_t*>(host + c.ordinals);
    auto* weight_rows = reinterpret_cast<std::int32_t*>(host + c.weight_rows);
    auto* unpacked = reinterpret_cast<std::int32_t*>(host + c.unpacked);
    auto* sources_of = reinterpret_cast<std::int32_t*>(host + c.sources_of);
    for (std::int32_t i = 0; i < c.pages_written; ++i) {
      ids[i] = pages[static_cast<std::size_t>(written[static_cast<std::size_t>(first + i)])];
      ordinals[i] = i;
      weight_rows[i] = weighted ? slot : -1;
    }
    for (std::size_t i = 0; i < read.size(); ++i) unpacked[i] = pages[static_cast<std::size_t>(read[i])];
    if (segmented) {  // the segments of the pages read and of the pages written
      auto* unpacked_segments = reinterpret_cast<std::int32_t*>(host + c.unpacked_segments);
      auto* written_segments = reinterpret_cast<std::int32_t*>(host + c.written_segments);
      for (std::size_t i = 0; i < read.size(); ++i) unpacked_segments[i] = segment_entry(slot, read[i]);
      for (std::int32_t i = 0; i < c.pages_written; ++i) written_segments[i] = segment_entry(slot, written[static_cast<std::size_t>(first + i)]);
    }
    for (std::size_t at = 0; at < static_cast<std::size_t>(c.pages_written) * p; ++at) {
      const std::int64_t from = source[static_cast<std::size_t>(first) * p + at];
      const auto page = static_cast<std::int32_t>(from / p);
      // Encoded formats read unpacked slot (index in `read`), others the page itself.
      const std::int64_t source_slot = encodes_pages ? static_cast<std::int64_t>(std::find(read.begin(), read.end(), page) - read.begin())
                                                     : static_cast<std::int64_t>(pages[static_cast<std::size_t>(page)]);
      sources_of[at] = static_cast<std::int32_t>(source_slot * p + from % p);
    }
  }
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::launch_moves() {
  detail::pull_from_host(move_staging_, move_metadata_.data(), move_bytes_, stream_);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  KVMOSAIC_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
  if (capturing == cudaStreamCaptureStatusNone) KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
  const std::byte* metadata = move_metadata_.as<const std::byte>();
  const device_context c = context();
  const auto i32 = [&](std::size_t at) { return reinterpret_cast<const std::int32_t*>(metadata + at); };
  const auto copy_rows = [&](const kernel::copy_rows_params& params) {
    const std::int64_t vectors = static_cast<std::int64_t>(params.n) * shape_.page_size * 2 * shape_.num_kv_heads *
                                 (shape_.head_dim / detail::vector_elements);
    kernel::copy_rows_kernel<><<<detail::grid_for(vectors, kernel::copy_rows_threads), kernel::copy_rows_threads, 0, stream_>>>(params);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
  };
  const auto tail_slot = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
  const auto tail_head = static_cast<std::int64_t>(geometry_.tail_head_bytes);
  [[maybe_unused]] const bool segmented = plan_segment_pages() > 0;
  for (const move_chunk& chunk : move_chunks_) {
    kernel::copy_rows_params gather{};
    if constexpr (encodes_pages) {
      device::template unpack_pages<Shapes>(format_state_, format_,
                                            unpack_context{&c, unpacked_.as<std::byte>(), i32(chunk.unpacked), chunk.pages_unpacked,
                                                           segmented ? i32(chunk.unpacked_segments) : nullptr});
      gather = {unpacked_.as<const std::byte>(), tail_slot, tail_head, nullptr, 0, 0, nullptr, nullptr, 0, 0, 0, 0};
    } else {  // the pages are dense rows: read in place
      gather = {pages_.as<const std::byte>(), static_cast<std::int64_t>(geometry_.page_slot_bytes()),
                static_cast<std::int64_t>(geometry_.k_page_bytes), nullptr, 0, 0, nullptr, nullptr, 0, 0, 0, 0};
    }
    gather.rows = scratch_.as<std::byte>();
    gather.rows_slot_bytes = tail_slot;
    gather.rows_head_bytes = tail_head;
    gather.sources_of = i32(chunk.sources_of);
    gather.n = chunk.pages_written;
    gather.num_kv_heads = shape_.num_kv_heads;
    gather.head_dim = shape_.head_dim;
    gather.page_size = shape_.page_size;
    copy_rows(gather);
    selection_.seal(sealed_pages{scratch_.as<const std::byte>(), tail_slot, tail_head, i32(chunk.ordinals), i32(chunk.written),
                                 chunk.pages_written},
                    stream_);
    if constexpr (encodes_pages) {
      const encode_context e{&c, scratch_.as<const std::byte>(), i32(chunk.written), i32(chunk.weight_rows),
                             key_weights_.size() > 0 ? key_weights_.as<const float>() : nullptr, nullptr, chunk.pages_written,
                             segmented ? i32(chunk.written_segments) : nullptr};
      device::template encode_pages<Shapes>(format_state_, reencoding_, e);
      if constexpr (block_keys)
        seal_block_keys(scratch_.as<const std::byte>(), tail_slot, tail_head, i32(chunk.ordinals), i32(chunk.written),
                        i32(chunk.written_segments), chunk.pages_written);
    } else {
      kernel::copy_rows_params back = gather;
      back.sources = scratch_.as<const std::byte>();
      back.source_slot_bytes = tail_slot;
      back.source_head_bytes = tail_head;
      back.rows = pages_.as<std::byte>();
      back.rows_slot_bytes = static_cast<std::int64_t>(geometry_.page_slot_bytes());
      back.rows_head_bytes = static_cast<std::int64_t>(geometry_.k_page_bytes);
      back.sources_of = nullptr;
      back.slot_ids = i32(chunk.written);
      copy_rows(back);
    }
  }
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::configure_format() {
  device_context c = context();
  device::template configure<Shapes>(format_state_, format_, c);
  use_bulk_copy_ = c.bulk_copy;
  prepare_decode_kernel();
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::prepare_decode_kernel() {
  with_decode_kernel([&](auto kernel, int threads, int shared_bytes) {
    if (shared_bytes > 48 * 1024)
      KVMOSAIC_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
    KVMOSAIC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm_, kernel, threads, shared_bytes));
    ctas_per_sm_ = std::max(ctas_per_sm_, 1);
  });
}

template <class Format, class Selector, class Shapes>
void engine<Format, Selector, Shapes>::run_extend(const std::vector<kernel::extend_item>& items, const page_id* new_pages,
                                               std::int32_t num_new_pages, const void* k, const void* v,
                                               kernel::row_strides strides, dtype rows_type, std::int64_t max_rows,
                                               const std::vector<kernel::exact_item>& sealed) {
  // Staging: [items][new page ids], and for encoded formats [scratch ordinals 0 .. n) [the K
  // weight row of each new page, -1 for none] [sink slots: a sequence's first page's slot, else
  // -1]; then, for formats with exact rows, [exact items].
  const std::size_t items_bytes = align(items.size() * sizeof(kernel::extend_item));
  const std::size_t pages_bytes = align(static_cast<std::size_t>(num_new_pages) * sizeof(page_id));
  const bool exact = geometry_.exact_rows > 0 && num_new_pages > 0;
  const std::size_t exact_at = items_bytes + (encodes_pages ? 5 : 1) * pages_bytes;
  const std::size_t bytes = exact_at + (exact ? align(static_cast<std::size_t>(num_new_pages) * sizeof(kernel::exact_item)) : 0);
  KVMOSAIC_CUDA_CHECK(cudaEventSynchronize(staged_));
  extend_staging_.reserve(bytes);
  extend_metadata_.reserve(bytes);
  std::byte* staging = extend_staging_.as<std::byte>();
  std::memcpy(staging, items.data(), items.size() * sizeof(kernel::extend_item));
  if (num_new_pages > 0) std::memcpy(staging + items_bytes, new_pages, num_new_pages * sizeof(page_id));
  if (encodes_pages) {
    auto* ordinals = reinterpret_cast<std::int32_t*>(staging + items_bytes + pages_bytes);
    for (std::int32_t i = 0; i < num_new_pages; ++i) ordinals[i] = i;
    auto* weight_rows = reinterpret_cast<std::int32_t*>(staging + items_bytes + 2 * pages_bytes);
    for (const kernel::extend_item& item : items) {
      const std::int32_t pages = (item.tail_rows + item.count) / shape_.page_size;
      bool weighted = false;
      if constexpr (has_key_weights_v<Format>) weighted = has_key_weights_[static_cast<std::size_t>(item.slot)];
      for (std::int32_t i = 0; i < pages; ++i) weight_rows[item.first_new_page + i] = weighted ? item.slot : -1;
    }
    auto* sink_slots = reinterpret_cast<std::int32_t*>(staging + items_bytes + 3 * pages_bytes);
    for (std::int32_t i = 0; i < num_new_pages; ++i)
      sink_slots[i] = sealed[static_cast<std::size_t>(i)].first == 0 && geometry_.sink_rows > 0 ? sealed[static_cast<std::size_t>(i)].slot : -1;
    auto* segment_entries = reinterpret_cast<std::int32_t*>(staging + items_bytes + 4 * pages_bytes);
    for (std::int32_t i = 0; i < num_new_pages; ++i) {
      const kernel::exact_item& page = sealed[static_cast<std::size_t>(i)];
      segment_entries[i] = segment_entry(page.slot, page.first / shape_.page_size);
    }
    reserve_scratch(num_new_pages);
  }
  if (exact) std::memcpy(staging + exact_at, sealed.data(), sealed.size() * sizeof(kernel::exact_item));
  detail::pull_from_host(extend_staging_, extend_metadata_.data(), bytes, stream_);
  KVMOSAIC_CUDA_CHECK(cudaEventRecord(staged_, stream_));
  const std::byte* metadata = extend_metadata_.as<const std::byte>();
  const auto* page_ids = reinterpret_cast<const std::int32_t*>(metadata + items_bytes);
  kernel::extend_params p{};
  // Completed pages: dense rows straight into their pages, or into scratch slots to encode.
  p.pages = encodes_pages ? scratch_.as<std::byte>() : pages_.as<std::byte>();
  p.page_slot_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_slot_bytes() : geometry_.page_slot_bytes());
  p.new_pages = encodes_pages ? page_ids + pages_bytes / sizeof(std::int32_t) : page_ids;
  p.tails = tails_.as<std::byte>();
  p.page_head_bytes = static_cast<std::int64_t>(encodes_pages ? geometry_.tail_head_bytes : geometry_.k_page_bytes);
  p.tail_slot_bytes = static_cast<std::int64_t>(geometry_.tail_slot_bytes());
  p.tail_head_bytes = static_cast<std::int64_t>(geometry_.tail_head_bytes);
  p.tail_row_offset = static_cast<std::int64_t>(geometry_.tail_row_offset());
  p.num_kv_heads = shape_.num_kv_heads;
  p.head_dim = shape_.head_dim;
  p.strides = strides;
  p.page_size = shape_.page_size;
  p.items = reinterpret_cast<const kernel::extend_item*>(metadata);
  const std::int64_t vectors_per_row = 2LL * shape_.num_kv_heads * (shape_.head_dim / 8);
  const dim3 tail_grid(detail::grid_for(vectors_per_row * shape_.page_size, extend_threads), static_cast<unsigned>(items.size()));
  const dim3 row_grid(detail::grid_for(vectors_per_row * max_rows, extend_threads), static_cast<unsigned>(items.size()));
  const auto scatter = [&](auto element) {
    using S = decltype(element);
    kernel::move_tail_rows_kernel<S><<<tail_grid, extend_threads, 0, stream_>>>(p);
    KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    detail::dispatch_io_type(rows_type, [&](auto input) {
      using T = decltype(input);
      kernel::scatter_rows_kernel<S, T><<<row_grid, extend_threads, 0, stream_>>>(p, static_cast<const T*>(k), static_cast<const T*>(v));
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    });
    if (exact) {  // the sinks and the recent window, from the completed pages' dense rows
      const dim3 exact_grid(detail::grid_for(vectors_per_row * shape_.page_size, extend_threads), static_cast<unsigned>(num_new_pages));
      kernel::keep_exact_rows_kernel<S><<<exact_grid, extend_threads, 0, stream_>>>(
          p, reinterpret_cast<const kernel::exact_item*>(metadata + exact_at), static_cast<int>(geometry_.sink_rows),
          static_cast<int>(geometry_.window_rows));
      KVMOSAIC_CUDA_CHECK(cudaGetLastError());
    }
  };
  detail::dispatch_shape(Shapes{}, shape_.storage, shape_.head_dim, 0, [&](auto element, auto, auto) { scatter(element); });
  // The selector sees the new pages' dense rows: in their page slots, or in scratch slots 0 .. n.
  selection_.seal(sealed_pages{encodes_pages ? scratch_.as<const std::byte>() : pages_.as<const std::byte>(),
                               static_cast<std::int64_t>(encodes_pages ? geometry_.tail_slot_bytes() : geometry_.page_slot_bytes()),
                               static_cast<std::int64_t>(encodes_pages ? geometry_.tail_head_bytes : geometry_.k_page_bytes),
                               encodes_pages ? page_ids + pages_bytes / sizeof(std::int32_t) : page_ids, page_ids, num_new_pages},
                  stream_);
  if constexpr (encodes_pages) {
    if (num_new_pages > 0) {
      const device_context c = context();
      const encode_context e{&c,
                             scratch_.as<const std::byte>(),
                             page_ids,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 2 * pages_bytes),
                             key_weights_.size() > 0 ? key_weights_.as<const float>() : nullptr,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 3 * pages_bytes),
                             num_new_pages,
                             reinterpret_cast<const std::int32_t*>(metadata + items_bytes + 4 * pages_bytes)};
      device::template encode_pages<Shapes>(format_state_, format_, e);
      if constexpr (block_keys)
        seal_block_keys(scratch_.as<const std::byte>(), static_cast<std::int64_t>(geometry_.tail_slot_bytes()),
                        static_cast<std::int64_t>(geometry_.tail_head_bytes), page_ids + pages_bytes / sizeof(std::int32_t), page_ids,
                        e.segment_entries, num_new_pages);
    }
  }
}
}  // namespace cuda

namespace detail {
template <class Format, class Selector, class... Shapes>
struct engine_for<backend::cuda_for<Shapes...>, Format, Selector> {
  using type = cuda::engine<Format, Selector, cuda::detail::shape_list<Shapes...>>;
};
}  // namespace detail

}  // namespace kvmosaic
