// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host backend: page and tail storage in host memory and the CPU implementation of every cache
/// operation (extend, append, attend), built on the format's host reference primitives and Eigen.
/// It is the test oracle's sibling (same arithmetic as the kernels: fp32 logits and accumulators,
/// online softmax merged page by page) and the backend the demo runs on without a GPU.
///
/// Layouts (all row-major, bytes):
///   page slot  = [K: num_kv_heads x k_page_bytes][V: num_kv_heads x v_page_bytes]
///   tail slot  = [K: num_kv_heads x tail head][V: same], storage dtype (format::dense), a tail head
///                = [recent window ring: W rows][sinks: S rows][tail: page_size rows] (W, S: the
///                format's `window_rows` and `sink_rows`, usually 0). Ring entry j (the sealed
///                position S + j modulo W) is row W - 1 - j, so a sequence's exact rows, however
///                many it holds yet, and its tail rows are one contiguous run ending at the tail.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/softmax_state.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/format/dense.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/memory/block_table.hpp"
#include "kvmosaic/memory/compaction_plan.hpp"
#include "kvmosaic/select/all.hpp"
#include "kvmosaic/select/selection_request.hpp"
#include "kvmosaic/select/selector_traits.hpp"
#include "kvmosaic/select/span_score.hpp"

namespace kvmosaic {
namespace backend {
/// Runs everything on the CPU, with pages in host memory.
struct host {
  using policy_category = backend_tag;
  static constexpr const char* name = "host";
};
}  // namespace backend

namespace detail {

/// The geometry every backend engine is built from (a subset of cache_config, already validated).
struct engine_shape {
  int num_kv_heads;
  int group_size;
  int head_dim;
  int page_size;
  dtype storage;
  std::int32_t max_pages;
  std::int32_t max_sequences;

  page_shape page() const { return page_shape{page_size, head_dim, storage}; }
  std::size_t row_elements() const { return static_cast<std::size_t>(num_kv_heads) * head_dim; }
};

/// Byte geometry of one format's page and tail arenas (the layouts in this file's comment): the
/// one place every engine computes slot sizes and offsets.
struct arena_geometry {
  template <class Format>
  arena_geometry(const engine_shape& shape, const Format& format)
      : num_kv_heads(shape.num_kv_heads),
        k_page_bytes(format_traits<Format>::k_page_bytes(format, shape.page())),
        v_page_bytes(format_traits<Format>::v_page_bytes(format, shape.page())),
        sink_rows(kvmosaic::sink_rows(format)),
        window_rows(kvmosaic::window_rows(format)),
        exact_rows(sink_rows + window_rows),
        row_bytes(static_cast<std::size_t>(shape.head_dim) * size_of(shape.storage)),
        tail_head_bytes((static_cast<std::size_t>(shape.page_size) + exact_rows) * row_bytes) {}

  std::size_t num_kv_heads;
  std::size_t k_page_bytes;     ///< one page of K of one head, by the format's accounting
  std::size_t v_page_bytes;     ///< one page of V of one head
  std::size_t sink_rows;        ///< S: exact sink rows a tail head keeps (format's `sink_rows`)
  std::size_t window_rows;      ///< W: exact recent-window rows a tail head keeps (`window_rows`)
  std::size_t exact_rows;       ///< S + W
  std::size_t row_bytes;        ///< one dense row of one head
  std::size_t tail_head_bytes;  ///< the window ring, the sinks, then page_size tail rows, of one head (K or V)

  /// One pool slot: a page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return num_kv_heads * (k_page_bytes + v_page_bytes); }
  /// One tail slot: the exact rows and page_size tail rows of K and of V for every KV head.
  std::size_t tail_slot_bytes() const noexcept { return 2 * num_kv_heads * tail_head_bytes; }
  /// Offset of tail row 0 inside a tail head (after the exact rows).
  std::size_t tail_row_offset() const noexcept { return exact_rows * row_bytes; }
  /// Exact rows a sequence with `sealed` sealed tokens holds (just before its tail rows):
  /// min(S + W, sealed), 0 before its first page is sealed.
  std::int64_t exact_rows_held(std::int64_t sealed) const noexcept {
    return sealed > 0 ? std::min(static_cast<std::int64_t>(exact_rows), sealed) : 0;
  }
  /// The row of a tail head (from its start) that keeps the exact copy of sealed position `t`
  /// (a sink, or a window position >= S).
  std::size_t exact_row_of(std::int64_t t) const noexcept {
    if (t < static_cast<std::int64_t>(sink_rows)) return window_rows + static_cast<std::size_t>(t);
    return window_rows - 1 - static_cast<std::size_t>((t - static_cast<std::int64_t>(sink_rows)) % static_cast<std::int64_t>(window_rows));
  }
  /// The logical positions of the `exact_rows_held(sealed)` rows the attend path folds before the
  /// tail rows (the run that ends where the tail's rows begin), in run order.
  void exact_run_positions(std::int64_t sealed, std::int64_t* out) const noexcept {
    const std::int64_t held = exact_rows_held(sealed), region = static_cast<std::int64_t>(exact_rows);
    const auto place = [&](std::int64_t t) {
      const std::int64_t run_row = static_cast<std::int64_t>(exact_row_of(t)) - (region - held);
      if (run_row >= 0 && run_row < held) out[run_row] = t;
    };
    const auto sinks = static_cast<std::int64_t>(sink_rows), window = static_cast<std::int64_t>(window_rows);
    for (std::int64_t t = 0; t < std::min(sinks, sealed); ++t) place(t);
    for (std::int64_t t = std::max(sinks, sealed - window); t < sealed; ++t) place(t);
  }
  /// Whether sealed position `t` of a sequence with `sealed` sealed tokens is attended from its
  /// exact copy (its page copy is masked): a sink, or one of the last W sealed tokens.
  bool exact_position(std::int64_t t, std::int64_t sealed) const noexcept {
    return t < static_cast<std::int64_t>(sink_rows) || t >= sealed - static_cast<std::int64_t>(window_rows);
  }
  /// Whether any sealed position in [from, to) is attended from its exact copy: only the first
  /// pages (sinks) and the last ones (the window) have rows to mask, so a step's row masks cost
  /// O(pages), not O(tokens).
  bool any_exact_position(std::int64_t from, std::int64_t to, std::int64_t sealed) const noexcept {
    return from < to && (from < static_cast<std::int64_t>(sink_rows) || to > sealed - static_cast<std::int64_t>(window_rows));
  }
  /// Offsets inside a page slot and a tail slot.
  std::size_t k_page_offset(int head) const noexcept { return head * k_page_bytes; }
  std::size_t v_page_offset(int head) const noexcept { return num_kv_heads * k_page_bytes + head * v_page_bytes; }
  std::size_t tail_offset(bool is_v, int head) const noexcept {
    return (static_cast<std::size_t>(is_v) * num_kv_heads + head) * tail_head_bytes;
  }
};

/// What the attend path needs to know about one sequence of a batch.
struct sequence_ref {
  const block_table* pages;   ///< full (encoded) pages, in order
  std::int64_t length;        ///< tokens stored: pages->size() * page_size + tail rows
  std::int32_t slot;          ///< tail slot
  const std::uint64_t* live = nullptr;  ///< per page, the live rows (`slot_positions::live`); null: every row
  /// A step that records token scores (`score_settings`): where they go, [position][num_kv_heads];
  /// null: none recorded for this sequence.
  float* scores = nullptr;
  const std::int64_t* positions = nullptr;  ///< per sealed slot, its logical position; null: the slot's index
  std::int64_t tail_position = -1;          ///< the tail's first logical position; -1: pages->size() * page_size
};

/// One sequence of a decode batch's append: its tail slot, the rows its tail holds, the page
/// its tail is sealed into when this token fills it (-1 otherwise), and the pages it has.
struct append_item {
  std::int32_t slot;
  std::int32_t tail_rows;
  page_id new_page;
  std::int64_t sealed_pages;
};

/// Block summaries kept per block of every page for a read-less selector (`block_summary`):
/// `select::quest`'s key bounds (the channel-wise min row then max row of each block's keys) or
/// `select::mean_keys`'s mean key row, per KV head, in the storage dtype; or, for a mean key
/// over a format with block keys (`has_block_keys_v`), the format's block key of
/// `block_key_bytes` bytes.
struct bounds_geometry {
  bounds_geometry(const engine_shape& shape, int block, block_summary kind = block_summary::bounds,
                  std::size_t block_key_bytes = 0)
      : block_tokens(block),
        blocks_per_page(block > 0 ? shape.page_size / block : 0),
        summary(kind),
        rows_per_block(summary_rows(kind)),
        row_bytes(static_cast<std::size_t>(shape.head_dim) * size_of(shape.storage)),
        block_bytes(block_key_bytes > 0 ? block_key_bytes : rows_per_block * row_bytes),
        format_keys(block_key_bytes > 0),
        head_bytes(static_cast<std::size_t>(blocks_per_page) * block_bytes),
        page_bytes(static_cast<std::size_t>(shape.num_kv_heads) * head_bytes) {}
  int block_tokens;        ///< 0: no summaries kept
  int blocks_per_page;
  block_summary summary;
  int rows_per_block;      ///< 2 (lo row, hi row) or 1 (mean row)
  std::size_t row_bytes;   ///< one row of head_dim values
  std::size_t block_bytes; ///< one block's summary of one KV head
  bool format_keys;        ///< the blocks keep the format's block keys, not dense rows
  std::size_t head_bytes;  ///< the summaries of one page of one KV head: [blocks][block_bytes]
  std::size_t page_bytes;  ///< the summaries of one page (every KV head): what a page costs on top
  std::size_t offset(page_id page, int head, int block) const noexcept {
    return static_cast<std::size_t>(page) * page_bytes + head * head_bytes + static_cast<std::size_t>(block) * block_bytes;
  }
};

/// The fp32 mean of `n` rows (head_dim floats each): per channel a sum in token order divided by
/// n, the order of the CUDA summary kernels.
inline void mean_key(const float* rows, int n, int head_dim, float* mean) {
  for (int c = 0; c < head_dim; ++c) {
    float sum = 0.0f;
    for (int t = 0; t < n; ++t) sum = sum + rows[static_cast<std::size_t>(t) * head_dim + c];
    mean[c] = sum / static_cast<float>(n);
  }
}

/// Writes the channel-wise min and max of `n` rows (head_dim floats each, already exact in the
/// storage dtype) as two stored rows at `out`.
inline void store_key_bounds(dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  std::vector<float> bounds(2 * static_cast<std::size_t>(head_dim));
  for (int c = 0; c < head_dim; ++c) {
    float lo = rows[c], hi = rows[c];
    for (int t = 1; t < n; ++t) {
      const float x = rows[static_cast<std::size_t>(t) * head_dim + c];
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    bounds[static_cast<std::size_t>(c)] = lo;
    bounds[static_cast<std::size_t>(head_dim + c)] = hi;
  }
  store_dense_rows(storage, bounds.data(), bounds.size(), out);
}

/// Writes the mean of `n` rows (head_dim floats each, exact in the storage dtype) as one stored
/// row at `out`: per channel an fp32 sum in token order, divided by n, rounded to the storage
/// dtype (the CUDA summary kernel computes it in the same order: the same bits).
inline void store_mean_key(dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  std::vector<float> mean(static_cast<std::size_t>(head_dim));
  mean_key(rows, n, head_dim, mean.data());
  store_dense_rows(storage, mean.data(), mean.size(), out);
}

/// Writes the summary `kind` of `n` rows at `out`.
inline void store_block_summary(block_summary kind, dtype storage, const float* rows, int n, int head_dim, std::byte* out) {
  if (kind == block_summary::mean) store_mean_key(storage, rows, n, head_dim, out);
  else store_key_bounds(storage, rows, n, head_dim, out);
}

/// What one step read for one (sequence, KV head): the selected spans' token ranges (merged,
/// ascending), the tokens attended (selected, open chunk, tail, sinks) and the pages read.
struct head_selection {
  std::vector<std::pair<std::int64_t, std::int64_t>> selected;
  std::int64_t tokens_selected = 0;
  std::int64_t tokens_read = 0;
  std::int32_t pages_read = 0;
};

/// Row b of a [batch][heads][head_dim] view, as a one-row view.
template <class T>
tensor_view<const T, 3> row_of(const tensor_view<const T, 3>& x, std::int64_t b) {
  return tensor_view<const T, 3>::strided(&x(b, 0, 0), {1, x.extent(1), x.extent(2)},
                                          {x.stride(0), x.stride(1), x.stride(2)});
}

/// Owns bytes with 64-byte alignment and leaves them uninitialized (pages are written before read).
class host_buffer {
 public:
  explicit host_buffer(std::size_t bytes) : bytes_(bytes), data_(allocate(bytes)) {}
  std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return bytes_; }

 private:
  struct free_aligned {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }
  };
  static std::byte* allocate(std::size_t bytes) {
    try {
      return static_cast<std::byte*>(::operator new[](bytes == 0 ? 64 : bytes, std::align_val_t{64}));
    } catch (const std::bad_alloc&) {
      throw capacity_error("cache_config", "kvmosaic: host backend: cannot allocate " + std::to_string(bytes) +
                                               " bytes of page or tail storage; allowed: a cache_config whose "
                                               "max_pages and max_sequences fit in host memory");
    }
  }
  std::size_t bytes_;
  std::unique_ptr<std::byte[], free_aligned> data_;
};

/// Calls body(i, scratch) for every i in [0, n). Compiled with OpenMP (`_OPENMP`: the consumer
/// builds with -fopenmp) and for n > 1, on OpenMP's threads (`OMP_NUM_THREADS`; dynamic schedule,
/// one item at a time), each thread with its own scratch, made by make_scratch() when it takes
/// its first item; otherwise in order on the calling thread, with one scratch. When items throw,
/// the exception of the lowest one is rethrown, as the serial loop would throw it (on threads,
/// after the others have run). The host backend's one way of spreading independent work.
template <class MakeScratch, class Body>
void for_each_item(std::int64_t n, const MakeScratch& make_scratch, const Body& body) {
  using scratch_type = decltype(make_scratch());
#if defined(_OPENMP)
  if (n > 1) {
    std::exception_ptr error;
    std::int64_t error_item = n;
#pragma omp parallel
    {
      std::optional<scratch_type> scratch;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t i = 0; i < n; ++i) {
        try {
          if (!scratch) scratch.emplace(make_scratch());
          body(i, *scratch);
        } catch (...) {
#pragma omp critical(kvmosaic_host_item_error)
          if (i < error_item) {
            error_item = i;
            error = std::current_exception();
          }
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  if (n <= 0) return;
  scratch_type scratch = make_scratch();
  for (std::int64_t i = 0; i < n; ++i) body(i, scratch);
}

/// The rows a segment whose first page is page `index` is fit to: that page's rows from `skip`
/// (its sinks are left out of a first segment), then `ahead` more; `count` in all.
struct segment_fit_rows {
  int skip;
  std::int64_t count;
  static segment_fit_rows of(const arena_geometry& geometry, int page_size, std::int64_t index, std::int64_t ahead) {
    const int skip = index == 0 ? static_cast<int>(geometry.sink_rows) : 0;
    return segment_fit_rows{skip, page_size - skip + ahead};
  }
};

/// The segments (one per KV head) of a sequence's segment whose first page is page `index` (a
/// multiple of `segment_pages`), about to be sealed from the full tail slot `tail` (host bytes):
/// each fitted (`format_traits::plan_segment`) to the rows an engine has of the segment, the
/// page's rows (the sinks left out of a first segment) and rows [next, next + segment_tokens -
/// page_size) of the call's `k`, `v` as far as they go (a prefill gives the whole segment; an
/// append, its first page). One function for both backends, so both fit the same bases to the
/// same rows. The KV heads are planned by `for_each_item` (on OpenMP's threads where built with
/// OpenMP), each as on one thread: the same segments, bit for bit, for any thread count. `sums`
/// (formats with `has_segment_sums_v`; [num_kv_heads][segment_sum_count]): the rows' sums as a
/// device computed them, in the order `format_traits::segment_sums` defines, which each head's
/// plan then takes with its rows (`plan_segment_from_sums`; a plan that reads no rows needs only
/// the sums, and no call of this function). Cost: the format's plan per KV head; per thread, two
/// [segment_tokens][head_dim] fp32 buffers.
template <class Format, class T>
std::vector<typename segment_type<Format>::type> plan_segments(const Format& format, const engine_shape& engine,
                                                               const arena_geometry& geometry, const std::byte* tail,
                                                               std::int64_t index, const tensor_view<const T, 3>& k,
                                                               const tensor_view<const T, 3>& v, std::int64_t next,
                                                               const double* sums = nullptr) {
  using traits = format_traits<Format>;
  using segment = typename segment_type<Format>::type;
  const page_shape shape = engine.page();
  const int per = traits::segment_pages(format, shape);
  const int p = engine.page_size, d = engine.head_dim, heads = engine.num_kv_heads;
  const std::int64_t ahead = std::min<std::int64_t>(k.extent(0) - next, static_cast<std::int64_t>(per - 1) * p);
  const segment_fit_rows fit = segment_fit_rows::of(geometry, p, index, ahead);
  const int skip = fit.skip;
  const std::int64_t n = fit.count;
  struct rows_scratch {
    std::vector<float> k_rows, v_rows, page;  // [n][d], [n][d], [p][d]
  };
  static_cast<void>(sums);  // formats without sums
  // Head h's K and V rows into the scratch, then its plan.
  const auto plan_head = [&](std::int64_t h, rows_scratch& s) {
    s.k_rows.resize(static_cast<std::size_t>(n) * d);
    s.v_rows.resize(s.k_rows.size());
    s.page.resize(static_cast<std::size_t>(p) * d);
    for (const bool is_v : {false, true}) {
      std::vector<float>& rows = is_v ? s.v_rows : s.k_rows;
      load_dense_rows(shape.storage, tail + geometry.tail_offset(is_v, static_cast<int>(h)) + geometry.tail_row_offset(),
                      static_cast<std::size_t>(p) * d, s.page.data());
      std::copy(s.page.begin() + static_cast<std::ptrdiff_t>(skip) * d, s.page.end(), rows.begin());
      const tensor_view<const T, 3>& src = is_v ? v : k;
      for (std::int64_t t = 0; t < ahead; ++t)
        for (int c = 0; c < d; ++c) rows[static_cast<std::size_t>((p - skip + t) * d + c)] = to_float(src(next + t, h, c));
    }
    if constexpr (has_segment_sums_v<Format>) {
      if (sums != nullptr)
        return traits::plan_segment_from_sums(format, shape, sums + h * traits::segment_sum_count(format, shape), n, s.k_rows.data(),
                                              s.v_rows.data());
    }
    return traits::plan_segment(format, shape, s.k_rows.data(), s.v_rows.data(), n);
  };
  std::vector<segment> planned(static_cast<std::size_t>(heads));
  const auto make_scratch = [] { return rows_scratch(); };
  for_each_item(heads, make_scratch, [&](std::int64_t h, rows_scratch& s) { planned[static_cast<std::size_t>(h)] = plan_head(h, s); });
  return planned;
}

}  // namespace detail

namespace host {

/// The host engine of one format: storage plus the CPU data path. The cache drives it with
/// validated arguments and does all bookkeeping (pool, block tables, lengths) itself.
template <class Format>
class engine {
  using traits = format_traits<Format>;
  using dense_traits = format_traits<format::dense>;

 public:
  /// What the pages of one segment and KV head share (formats with segments; else empty).
  using segment_t = typename detail::segment_type<Format>::type;
  /// Every format's attend path writes the scores of the tokens it reads (`plan`'s score_settings).
  static constexpr bool records_token_scores = true;
  /// No device: `cache::window_votes` scores the keys it reads back, in fp64.
  static constexpr bool computes_window_votes = false;

  /// Keeps the key bounds of every block of `selector_traits<Selector>::bounds_block_tokens`
  /// tokens of each sealed page (none when 0). Selectors with other per-sequence data keep it in
  /// their host state and pass it with each step (`select::sentence_chunks`: `chunk_list`).
  template <class Selector = select::all>
  engine(const detail::engine_shape& shape, const Format& format, const Selector& selector = {})
      : shape_(shape),
        format_(format),
        geometry_(shape, format),
        bounds_geometry_(shape, selector_traits<Selector>::bounds_block_tokens(selector, shape.page_size),
                         detail::block_summary_of<Selector>::value, block_key_bytes_for<Selector>(format, shape)),
        pages_(static_cast<std::size_t>(shape.max_pages) * geometry_.page_slot_bytes()),
        tails_(static_cast<std::size_t>(shape.max_sequences) * geometry_.tail_slot_bytes()),
        bounds_(static_cast<std::size_t>(shape.max_pages) * bounds_geometry_.page_bytes) {}

  const detail::arena_geometry& geometry() const noexcept { return geometry_; }
  const detail::bounds_geometry& bounds_geometry() const noexcept { return bounds_geometry_; }
  /// Whether the page blocks keep the format's block keys (`has_block_keys_v`: a mean key over
  /// such a format) rather than dense summary rows.
  bool format_block_keys() const noexcept { return bounds_geometry_.format_keys; }
  /// Bytes of one pool slot: one page of K and of V for every KV head.
  std::size_t page_slot_bytes() const noexcept { return geometry_.page_slot_bytes(); }
  /// Bytes a page costs besides its slot: the key bounds a selector keeps (0 for none).
  std::size_t page_bounds_bytes() const noexcept { return bounds_geometry_.page_bytes; }
  /// The key bounds of block `block` of `page`, KV head `head`: lo row then hi row.
  const std::byte* page_bounds(page_id page, int head, int block) const {
    return bounds_.data() + bounds_geometry_.offset(page, head, block);
  }
  /// What the last selected step read, per (batch entry, KV head): [b * num_kv_heads + h].
  const std::vector<detail::head_selection>& last_selection() const noexcept { return last_selection_; }

  /// Appends `rows` ([n][num_kv_heads][head_dim]) to the tail of `slot`, which holds `tail_rows`
  /// rows after `sealed_pages` pages. Each time the tail fills, it is encoded into the next page
  /// of `new_pages`. Until the next `commit`, `rollback` restores the tail rows this overwrote
  /// (the rows after a sealed page land where the old tail rows were).
  template <class T>
  void extend(std::int32_t slot, int tail_rows, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              const page_id* new_pages, std::int64_t sealed_pages) {
    const std::size_t row_bytes = static_cast<std::size_t>(shape_.head_dim) * size_of(shape_.storage);
    std::vector<float> row(static_cast<std::size_t>(shape_.head_dim));
    // Rows after a sealed page land on the old tail rows, and a seal rewrites the exact rows.
    if ((tail_rows > 0 && tail_rows + k.extent(0) > shape_.page_size) ||
        (geometry_.exact_rows > 0 && tail_rows + k.extent(0) >= shape_.page_size))
      save_tail(slot, tail_rows);
    const auto store = [&](tensor_view<const T, 3> src, bool is_v, std::int64_t t, int h) {
      for (int c = 0; c < shape_.head_dim; ++c) row[static_cast<std::size_t>(c)] = to_float(src(t, h, c));
      detail::store_dense_rows(shape_.storage, row.data(), row.size(), tail_head(slot, is_v, h) + tail_rows * row_bytes);
    };
    for (std::int64_t t = 0; t < k.extent(0); ++t) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        store(k, false, t, h);
        store(v, true, t, h);
      }
      if (++tail_rows == shape_.page_size) {
        if constexpr (has_segments_v<Format>) plan_segment_at(slot, sealed_pages, k, v, t + 1);
        seal_tail(slot, *new_pages++, sealed_pages++);
        tail_rows = 0;
      }
    }
  }

  /// Appends row b of `k`, `v` ([batch][num_kv_heads][head_dim]) to sequence items[b].
  template <class T>
  void append(const std::vector<detail::append_item>& items, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    for (std::size_t b = 0; b < items.size(); ++b) {
      const auto row = static_cast<std::int64_t>(b);
      extend(items[b].slot, items[b].tail_rows, detail::row_of(k, row), detail::row_of(v, row), &items[b].new_page,
             items[b].sealed_pages);
    }
  }

  /// Undoes the writes since the last `commit` that a caller can see: the tail rows an `extend`
  /// overwrote and the exact rows its seals rewrote, of every slot it saved (latest first). (Rows
  /// written past a tail's committed length, and fresh pages, are never read.)
  void rollback() noexcept {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      const std::size_t bytes = (geometry_.exact_rows + static_cast<std::size_t>(it->rows)) * geometry_.row_bytes;
      std::size_t at = it->at;
      for (int h = 0; h < shape_.num_kv_heads; ++h)
        for (const bool is_v : {false, true}) {
          std::memcpy(tail_slot(it->slot) + geometry_.tail_offset(is_v, h), saved_tail_.data() + at, bytes);
          at += bytes;
        }
    }
    saved_.clear();
    saved_tail_.clear();
  }
  /// Makes the writes since the last `commit` final.
  void commit() noexcept {
    saved_.clear();
    saved_tail_.clear();
  }

  /// Copies the page slots `pages[0 .. n)` (`page_slot_bytes()` each, in that order) into host
  /// memory at `out`: the bytes `cache::read` decodes. Cost: n slot copies.
  void copy_pages_out(const page_id* pages, std::size_t n, std::byte* out) const {
    for (std::size_t i = 0; i < n; ++i)
      std::memcpy(out + i * page_slot_bytes(), pages_.data() + static_cast<std::size_t>(pages[i]) * page_slot_bytes(),
                  page_slot_bytes());
  }
  /// Copies the tail slot of `slot` (`geometry().tail_slot_bytes()`: its tail rows, then its sink
  /// rows, per KV head, K then V) into host memory at `out`. Cost: one slot copy.
  void copy_tail_out(std::int32_t slot, std::byte* out) const {
    std::memcpy(out, tail_slot(slot), geometry_.tail_slot_bytes());
  }

  /// Copies the first `rows` tail rows of one slot to another (fork); the K weights go along.
  void copy_tail(std::int32_t from, std::int32_t to, int rows) {
    (void)rows;  // whole slot: simpler, and the bytes past `rows` are never read
    std::memcpy(tail_slot(to), tail_slot(from), geometry_.tail_slot_bytes());
    if constexpr (has_key_weights_v<Format>) {
      key_weights_[static_cast<std::size_t>(to)] = key_weights_[static_cast<std::size_t>(from)];
    }
    if constexpr (has_segments_v<Format>) segments_[static_cast<std::size_t>(to)] = segments_[static_cast<std::size_t>(from)];
  }

  /// The segment of KV head `head` that page `index` of the sequence in `slot` is stored in
  /// (formats with segments).
  const segment_t& segment(std::int32_t slot, std::int64_t index, int head) const {
    const std::int64_t s = index / traits::segment_pages(format_, shape_.page());
    return segments_[static_cast<std::size_t>(slot)][static_cast<std::size_t>(s * shape_.num_kv_heads + head)];
  }
  /// Bytes the segments of a sequence of `pages` sealed pages keep (0 for formats without).
  std::size_t segment_bytes(std::int64_t pages) const {
    if constexpr (has_segments_v<Format>) {
      const std::int64_t per = traits::segment_pages(format_, shape_.page());
      return static_cast<std::size_t>((pages + per - 1) / per) * shape_.num_kv_heads * traits::segment_bytes(format_, shape_.page());
    } else {
      (void)pages;
      return 0;
    }
  }
  /// Decodes the first n rows of page `index` of the sequence in `slot` (stored at `page`), KV
  /// head `head`, K or V: the format's host decode, in the page's segment where it has them.
  void decode_page(std::int32_t slot, std::int64_t index, int head, bool is_v, const std::byte* page, int n, float* rows) const {
    const page_shape shape = shape_.page();
    if constexpr (has_segments_v<Format>) {
      const segment_t& seg = segment(slot, index, head);
      if (is_v) traits::decode_v(format_, shape, seg, page, n, rows);
      else traits::decode_k(format_, shape, seg, page, n, rows);
    } else {
      (void)slot, (void)index, (void)head;
      if (is_v) traits::decode_v(format_, shape, page, n, rows);
      else traits::decode_k(format_, shape, page, n, rows);
    }
  }

  /// Output-aware K pruning for the pages of `slot` sealed from now on: weights [num_kv_heads]
  /// [head_dim] (host memory), or null for plain magnitudes.
  void set_key_weights(std::int32_t slot, const float* weights) {
    static_assert(has_key_weights_v<Format>, "this format has no K weights");
    std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
    if (weights == nullptr)
      w.clear();
    else
      w.assign(weights, weights + shape_.row_elements());
  }

  /// A compaction pass over the sealed pages `pages` of the sequence in `slot` (`plan`, from
  /// memory/compaction_plan.hpp): every page a move reads or writes is decoded to dense rows, each
  /// moved row is taken from the decoded sources (so every source is read before any destination
  /// is written), and the pages written are encoded again from the moved rows rounded to the
  /// storage dtype, with the format's re-encoding mode (`detail::reencoding`: its format, and the
  /// sequence's K weights where it uses them), their key bounds rewritten. `first_page_sinks`: the
  /// sequence's first page keeps sink rows (they are hidden again, as at seal, before the bounds
  /// and the encode). Cost: one decode of each page touched and one encode of each page written,
  /// O(page_size x head_dim) each, per KV head.
  void move_slots(std::int32_t slot, const block_table& pages, const detail::compaction_plan& plan, bool first_page_sinks) {
    if (plan.moves.empty()) return;
    const page_shape shape = shape_.page();
    const int p = shape_.page_size, d = shape_.head_dim, heads = shape_.num_kv_heads;
    const std::size_t page_rows = static_cast<std::size_t>(p) * d;  // floats of one page, one head, K or V
    std::vector<std::int32_t> touched = plan.pages_written;
    for (const detail::slot_move& m : plan.moves) touched.push_back(static_cast<std::int32_t>(m.from / p));
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    const auto index_of = [&](std::int32_t page) {
      return static_cast<std::size_t>(std::lower_bound(touched.begin(), touched.end(), page) - touched.begin());
    };
    // [touched page][head][K, V][rows]: decoded once, read-only; the written pages' rows are copies.
    std::vector<float> decoded(touched.size() * heads * 2 * page_rows);
    const auto rows_of = [&](std::vector<float>& buffer, std::size_t i, int h, int is_v) {
      return buffer.data() + ((i * heads + h) * 2 + is_v) * page_rows;
    };
    for (std::size_t i = 0; i < touched.size(); ++i)
      for (int h = 0; h < heads; ++h) {
        const page_id page = pages[static_cast<std::size_t>(touched[i])];
        decode_page(slot, touched[i], h, false, k_page(page, h), p, rows_of(decoded, i, h, 0));
        decode_page(slot, touched[i], h, true, v_page(page, h), p, rows_of(decoded, i, h, 1));
      }
    // Pages are encoded from storage-dtype rows, at seal and here alike (the CUDA backend's
    // scratch rows are 16-bit): a decoded value between two of them is rounded to the nearest.
    for (float& x : decoded) x = detail::storage_value(detail::storage_bits(x, shape_.storage), shape_.storage);
    const Format reencoding = detail::reencoding<Format>::format(format_);
    std::vector<float> written = decoded;
    for (const detail::slot_move& m : plan.moves) {
      const std::size_t from = index_of(static_cast<std::int32_t>(m.from / p)), to = index_of(static_cast<std::int32_t>(m.to / p));
      for (int h = 0; h < heads; ++h)
        for (int is_v = 0; is_v < 2; ++is_v)
          std::copy_n(rows_of(decoded, from, h, is_v) + (m.from % p) * d, d, rows_of(written, to, h, is_v) + (m.to % p) * d);
    }
    std::vector<float> rows(page_rows);
    for (const std::int32_t index : plan.pages_written) {
      const std::size_t i = index_of(index);
      const page_id page = pages[static_cast<std::size_t>(index)];
      std::byte* base = pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes();
      const int sinks = detail::hides_sink_rows_v<Format> && first_page_sinks && index == 0 ? static_cast<int>(geometry_.sink_rows) : 0;
      for (int h = 0; h < heads; ++h) {
        for (int is_v = 0; is_v < 2; ++is_v) {
          std::copy_n(rows_of(written, i, h, is_v), page_rows, rows.begin());
          for (int t = 0; t < sinks; ++t)  // hidden as at seal: the first row after them
            std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(sinks) * d, d, rows.begin() + static_cast<std::ptrdiff_t>(t) * d);
          if (is_v == 0)
            for (int block = 0; block < bounds_geometry_.blocks_per_page; ++block)
              store_block(slot, index, page, h, block, rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * d);
          if constexpr (has_segments_v<Format>) {
            const segment_t& seg = segment(slot, index, h);
            if (is_v == 1) traits::encode_v(reencoding, shape, seg, rows.data(), base + geometry_.v_page_offset(h));
            else traits::encode_k(reencoding, shape, seg, rows.data(), base + geometry_.k_page_offset(h));
          } else if (is_v == 1) {
            traits::encode_v(reencoding, shape, rows.data(), base + geometry_.v_page_offset(h));
          } else if constexpr (has_key_weights_v<Format>) {
            const std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
            const bool weighted = detail::reencoding<Format>::key_weights && !w.empty();
            traits::encode_k(reencoding, shape, rows.data(), weighted ? w.data() + h * d : nullptr, base + geometry_.k_page_offset(h));
          } else {
            traits::encode_k(reencoding, shape, rows.data(), base + geometry_.k_page_offset(h));
          }
        }
      }
    }
  }

  /// The host half of a decode step (`cache::plan`): keeps the batch, the scale and the
  /// selection request for `run` (the batch's block tables are read when `run` runs).
  /// With `scores.use` other than none, `run` also writes each read token's score
  /// (select/token_scores.hpp) to the sequences' `scores`.
  void plan(const std::vector<detail::sequence_ref>& batch, float softmax_scale, const detail::selection_request* request = nullptr,
            const score_settings& scores = {}) {
    planned_batch_ = batch;
    planned_scale_ = softmax_scale;
    planned_request_ = request != nullptr ? *request : detail::selection_request{};
    planned_selects_ = request != nullptr;
    planned_scores_ = scores;
  }

  /// The planned step (`cache::run`): out[b][j] = softmax(scale * q[b][j] . K_b) V_b over every
  /// stored token of sequence b, or, with a selection request, over the tokens the selection
  /// reads (docs/selectors.md); lse[b][j] (optional, extent 0: not written) its log-sum-exp.
  /// q, out: [batch][num_kv_heads * group_size][head_dim], float, half or bfloat16, any strides.
  ///
  /// Each (sequence, KV head) is computed alone, from its own pages, into its own outputs, with
  /// the same operations in the same order whichever thread runs it: the outputs are the same
  /// bits for any thread count. The pairs are spread by `detail::for_each_item`: over OpenMP's
  /// threads where the consumer builds with OpenMP, else on the calling thread. Cost: per pair,
  /// one score and one accumulate per page read plus the tail and sinks; working memory per
  /// thread, no allocation per page or token.
  template <class Q, class O>
  void run(tensor_view<const Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse) {
    const std::int64_t heads = shape_.num_kv_heads;
    const std::int64_t items = static_cast<std::int64_t>(planned_batch_.size()) * heads;
    if (planned_selects_) last_selection_.assign(static_cast<std::size_t>(items), {});
    prepare_visible_rows();
    struct worker {
      attend_scratch s;
      std::vector<std::uint64_t> keep;
    };
    kvmosaic::detail::for_each_item(
        items, [&] { return worker{attend_scratch(shape_.group_size, shape_.head_dim, scratch_rows()), {}}; },
        [&](std::int64_t i, worker& w) {
          attend_head(q, out, lse, static_cast<std::size_t>(i / heads), static_cast<int>(i % heads), w.s, w.keep);
        });
  }

  const std::byte* k_page(page_id page, int head) const {
    return pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes() + geometry_.k_page_offset(head);
  }
  const std::byte* v_page(page_id page, int head) const {
    return pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes() + geometry_.v_page_offset(head);
  }

 private:
  /// Per-call working memory of attend, sized once per call rather than per page.
  struct attend_scratch {
    attend_scratch(int groups, int head_dim, int page_size)
        : q_group(static_cast<std::size_t>(groups) * head_dim),
          logits(static_cast<std::size_t>(groups) * page_size),
          o(q_group.size()),
          o_block(q_group.size()),
          state(static_cast<std::size_t>(groups)),
          block(state.size()),
          q_basis(q_group.size()),
          o_segment(q_group.size()),
          segment_state(state.size()) {}
    std::vector<float> q_group, logits, o, o_block;
    std::vector<softmax_state<float>> state, block;
    // Formats with segments: the queries, output and state of the segment being folded, in its
    // space (at most head_dim channels).
    std::vector<float> q_basis, o_segment;
    std::vector<softmax_state<float>> segment_state;
    // A step that records token scores: the positions of the block being folded, and per read
    // token its position and its G scaled logits ([token][G]).
    bool record = false;
    std::vector<std::int64_t> block_positions, read_positions;
    std::vector<float> read_logits;
  };

  /// Rows a step's block folds at most: a page, or the exact rows and the tail in one run.
  int scratch_rows() const noexcept { return shape_.page_size + static_cast<int>(geometry_.exact_rows); }

  /// Per planned sequence holding exact rows: the page rows read from the pages (live, and not
  /// one of the exact rows, which are read from their copies), [page][mask word]; empty otherwise.
  /// Cost: O(sealed tokens) per such sequence, once per step.
  void prepare_visible_rows() {
    const int p = shape_.page_size, mask_words = (p + 63) / 64;
    visible_rows_.resize(planned_batch_.size());
    for (std::size_t b = 0; b < planned_batch_.size(); ++b) {
      const detail::sequence_ref& seq = planned_batch_[b];
      const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
      std::vector<std::uint64_t>& visible = visible_rows_[b];
      visible.clear();
      if (geometry_.exact_rows_held(sealed) == 0) continue;
      visible.assign(seq.pages->size() * static_cast<std::size_t>(mask_words), 0);
      for (std::int64_t t = 0; t < sealed; ++t)
        if (!geometry_.exact_position(t, sealed))
          visible[static_cast<std::size_t>(t / p) * mask_words + static_cast<std::size_t>(t % p) / 64] |= std::uint64_t{1} << (t % p % 64);
      if (seq.live != nullptr)
        for (std::size_t w = 0; w < visible.size(); ++w) visible[w] &= seq.live[w];
    }
  }

  /// One (sequence, KV head) of the planned step: its selection (read-less selectors), every page
  /// it reads, the sinks and the tail folded in order, the outputs of its G query heads written.
  template <class Q, class O>
  void attend_head(const tensor_view<const Q, 3>& q, const tensor_view<O, 3>& out, const tensor_view<float, 2>& lse,
                   std::size_t b, int h, attend_scratch& s, std::vector<std::uint64_t>& keep) {
    const detail::selection_request* request = planned_selects_ ? &planned_request_ : nullptr;
    const float softmax_scale = planned_scale_;
    const int groups = shape_.group_size, d = shape_.head_dim, p = shape_.page_size;
    const int mask_words = (p + 63) / 64;
    const detail::sequence_ref& seq = planned_batch_[b];
    const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
    const int tail_rows = static_cast<int>(seq.length - sealed);
    // The exact rows (sinks, recent window) just before the tail rows; their page copies masked.
    const std::int64_t exact = geometry_.exact_rows_held(sealed);
    const std::uint64_t* rows_visible = exact > 0 ? visible_rows_[b].data() : seq.live;  // null: every row
    const auto row = static_cast<std::int64_t>(b);
    if (request != nullptr) {
      detail::head_selection& chosen = last_selection_[b * static_cast<std::size_t>(shape_.num_kv_heads) + h];
      select_tokens(*request, b, seq, q, h, keep, chosen);
      if (rows_visible != nullptr)  // evicted tokens are never read, exact ones from their copies
        for (std::size_t w = 0; w < keep.size(); ++w) keep[w] &= rows_visible[w];
      chosen.tokens_read = tail_rows + exact;
      for (std::size_t i = 0; i < seq.pages->size(); ++i) {
        int tokens = 0;
        for (int w = 0; w < mask_words; ++w) tokens += popcount64(keep[i * mask_words + w]);
        chosen.tokens_read += tokens;
        chosen.pages_read += tokens > 0;
      }
    }
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < d; ++c) s.q_group[g * d + c] = to_float(q(row, h * groups + g, c)) * softmax_scale;
    std::fill(s.o.begin(), s.o.end(), 0.0f);
    std::fill(s.state.begin(), s.state.end(), softmax_state<float>{});
    s.record = planned_scores_.use != score_use::none && seq.scores != nullptr;
    if (s.record) {
      s.read_positions.clear();
      s.read_logits.clear();
      s.block_positions.resize(static_cast<std::size_t>(scratch_rows()));
    }
    const auto page_positions = [&](std::size_t i) {  // the logical positions of page i's rows
      if (!s.record) return;
      for (int t = 0; t < p; ++t) {
        const std::size_t slot = i * static_cast<std::size_t>(p) + static_cast<std::size_t>(t);
        s.block_positions[static_cast<std::size_t>(t)] = seq.positions != nullptr ? seq.positions[slot] : static_cast<std::int64_t>(slot);
      }
    };
    const page_shape shape = shape_.page();
    const auto keep_of = [&](std::size_t i) -> const std::uint64_t* {
      return request != nullptr ? keep.data() + i * mask_words : rows_visible != nullptr ? rows_visible + i * mask_words : nullptr;
    };
    const auto skipped = [&](const std::uint64_t* page_keep) {
      return page_keep != nullptr && std::all_of(page_keep, page_keep + mask_words, [](std::uint64_t w) { return w == 0; });
    };
    if constexpr (has_segments_v<Format>) {
      // Per segment: the queries rotated in, its pages folded into a state of its own in the
      // segment's space, the output rotated back and merged (PackedAttention, once per segment).
      const std::size_t per = static_cast<std::size_t>(traits::segment_pages(format_, shape));
      const int kept = traits::basis_dim(format_, shape);
      for (std::size_t first = 0; first < seq.pages->size(); first += per) {
        const std::size_t last = std::min(seq.pages->size(), first + per);
        const segment_t& seg = segment(seq.slot, static_cast<std::int64_t>(first), h);
        traits::enter_segment(format_, shape, seg, s.q_group.data(), groups, s.q_basis.data());
        std::fill(s.o_segment.begin(), s.o_segment.end(), 0.0f);
        std::fill(s.segment_state.begin(), s.segment_state.end(), softmax_state<float>{});
        for (std::size_t i = first; i < last; ++i) {
          const page_id page = (*seq.pages)[i];
          const std::uint64_t* page_keep = keep_of(i);
          if (skipped(page_keep)) continue;
          page_positions(i);
          fold_block(
              p, kept, s, s.segment_state, s.o_segment,
              [&](float* logits) { traits::score(format_, shape, seg, k_page(page, h), p, s.q_basis.data(), groups, logits); },
              [&](const float* probabilities, float* o) {
                traits::accumulate(format_, shape, seg, v_page(page, h), p, probabilities, groups, o);
              },
              0, page_keep);
        }
        traits::leave_segment(format_, shape, seg, s.o_segment.data(), groups, s.o_block.data());
        for (int g = 0; g < groups; ++g) {
          if (!(s.segment_state[static_cast<std::size_t>(g)].l > 0)) continue;  // nothing of this head read
          float* o_g = s.o.data() + static_cast<std::size_t>(g) * d;
          merge_into(s.state[static_cast<std::size_t>(g)], o_g, s.segment_state[static_cast<std::size_t>(g)],
                     s.o_block.data() + static_cast<std::size_t>(g) * d, d);
        }
      }
    } else {
      for (std::size_t i = 0; i < seq.pages->size(); ++i) {
        const page_id page = (*seq.pages)[i];
        const std::uint64_t* page_keep = keep_of(i);
        if (skipped(page_keep)) continue;
        page_positions(i);
        fold_block<traits>(format_, shape, k_page(page, h), v_page(page, h), p, s, 0, page_keep);
      }
    }
    if (exact + tail_rows > 0) {  // one run of dense rows: the exact rows, then the tail
      if (s.record) {
        geometry_.exact_run_positions(sealed, s.block_positions.data());
        const std::int64_t tail_from = seq.tail_position >= 0 ? seq.tail_position : sealed;
        for (int r = 0; r < tail_rows; ++r) s.block_positions[static_cast<std::size_t>(exact + r)] = tail_from + r;
      }
      const std::size_t back = static_cast<std::size_t>(exact) * geometry_.row_bytes;
      fold_block<dense_traits>(format::dense{}, shape, tail_head(seq.slot, false, h) - back,
                               tail_head(seq.slot, true, h) - back, static_cast<int>(exact) + tail_rows, s);
    }
    for (int g = 0; g < groups; ++g) {
      for (int c = 0; c < d; ++c) out(row, h * groups + g, c) = O(s.o[g * d + c] / s.state[g].l);
      if (lse.extent(0) > 0) lse(row, h * groups + g) = s.state[g].log_sum_exp();
    }
    if (s.record) write_scores(seq, h, s);
  }

  /// The scores of the tokens one (sequence, KV head) read this step: per query head j of the
  /// group, p_j = exp(s_j - m_j) / l_j under the step's final (merged) softmax state, combined over
  /// the group, written to (last_step) or added to (cumulative) `seq.scores[position][h]`. Each
  /// (sequence, KV head) writes its own column: no two threads write one element.
  void write_scores(const detail::sequence_ref& seq, int h, const attend_scratch& s) const {
    const int groups = shape_.group_size, heads = shape_.num_kv_heads;
    for (std::size_t i = 0; i < s.read_positions.size(); ++i) {
      float combined = 0.0f;
      for (int g = 0; g < groups; ++g) {
        const softmax_state<float>& state = s.state[static_cast<std::size_t>(g)];
        const float logit = s.read_logits[i * static_cast<std::size_t>(groups) + static_cast<std::size_t>(g)];
        const float p = state.l > 0.0f ? std::exp(logit - state.m) / state.l : 0.0f;
        combined = planned_scores_.combine == group_combine::sum ? combined + p : std::max(combined, p);
      }
      float& slot = seq.scores[static_cast<std::size_t>(s.read_positions[i]) * static_cast<std::size_t>(heads) +
                               static_cast<std::size_t>(h)];
      slot = planned_scores_.use == score_use::cumulative ? slot + combined : combined;
    }
  }

  /// Folds one block of n tokens (a page or the tail) into the running states: logits on the
  /// stored form, a block-local softmax, p.v on the stored form, then the (m, l, o) merge. The
  /// first `masked` tokens (sinks, attended as dense rows instead) get p = 0, and so do the tokens
  /// whose bit in `keep` (a token mask, null: all) is clear. Heads are independent: a head with no
  /// token left (every logit -inf) folds nothing, and a block with no token left for any head is
  /// skipped.
  template <class Traits, class F>
  static void fold_block(const F& format, const page_shape& shape, const std::byte* k, const std::byte* v, int n,
                         attend_scratch& s, int masked = 0, const std::uint64_t* keep = nullptr) {
    const int groups = static_cast<int>(s.state.size());
    fold_block(
        n, shape.head_dim, s, s.state, s.o,
        [&](float* logits) { Traits::score(format, shape, k, n, s.q_group.data(), groups, logits); },
        [&](const float* probabilities, float* o) { Traits::accumulate(format, shape, v, n, probabilities, groups, o); }, masked,
        keep);
  }
  /// The same, with the primitives given: score(logits [G][n]) and accumulate(p [G][n],
  /// o [G][d] +=), folded into `state` and `o` ([G][d]).
  template <class Score, class Accumulate>
  static void fold_block(int n, int d, attend_scratch& s, std::vector<softmax_state<float>>& state, std::vector<float>& o,
                         Score&& score, Accumulate&& accumulate, int masked = 0, const std::uint64_t* keep = nullptr) {
    const int groups = static_cast<int>(state.size());
    constexpr float minus_infinity = -std::numeric_limits<float>::infinity();
    bool any = false;
    score(s.logits.data());
    if (s.record)  // the logits of the tokens this block reads, before the softmax overwrites them
      for (int t = masked; t < n; ++t) {
        if (keep != nullptr && ((keep[t / 64] >> (t % 64)) & 1) == 0) continue;
        s.read_positions.push_back(s.block_positions[static_cast<std::size_t>(t)]);
        for (int g = 0; g < groups; ++g) s.read_logits.push_back(s.logits[static_cast<std::size_t>(g) * n + t]);
      }
    for (int g = 0; g < groups; ++g) {
      float* row = s.logits.data() + static_cast<std::size_t>(g) * n;
      std::fill(row, row + masked, minus_infinity);
      if (keep != nullptr)
        for (int t = masked; t < n; ++t)
          if (((keep[t / 64] >> (t % 64)) & 1) == 0) row[t] = minus_infinity;
      float m = row[0];
      for (int t = 1; t < n; ++t) m = std::max(m, row[t]);
      s.block[g].m = m;
      if (m == minus_infinity) {  // nothing of this head to fold (masked, or logits below fp32)
        std::fill(row, row + n, 0.0f);
        s.block[g].l = 0.0f;
        continue;
      }
      float l = 0;
      for (int t = 0; t < n; ++t) l += (row[t] = std::exp(row[t] - m));
      s.block[g].l = l;
      any = true;
    }
    if (!any) return;  // no head has a token left: nothing to fold
    std::fill(s.o_block.begin(), s.o_block.begin() + static_cast<std::ptrdiff_t>(groups) * d, 0.0f);
    accumulate(s.logits.data(), s.o_block.data());
    for (int g = 0; g < groups; ++g) {
      float* o_g = o.data() + static_cast<std::size_t>(g) * d;
      merge_into(state[static_cast<std::size_t>(g)], o_g, s.block[static_cast<std::size_t>(g)], s.o_block.data() + static_cast<std::size_t>(g) * d, d);
    }
  }

  static int popcount64(std::uint64_t x) noexcept {
    int n = 0;
    for (; x != 0; x &= x - 1) ++n;
    return n;
  }

  /// A read-less step for one (sequence, KV head): scores the spans (the page blocks, or the
  /// sequence's chunks), picks them within the budget (`detail::budget_prefix`) and marks the page
  /// tokens the step reads in `keep` ([page][mask word]): the selected spans' tokens and every
  /// token from `always_from` on. The tail and sink rows are read besides.
  template <class Q>
  void select_tokens(const detail::selection_request& r, std::size_t b, const detail::sequence_ref& seq,
                     const tensor_view<const Q, 3>& q, int h, std::vector<std::uint64_t>& keep,
                     detail::head_selection& chosen) const {
    const int p = shape_.page_size, d = shape_.head_dim, groups = shape_.group_size;
    const std::size_t mask_words = static_cast<std::size_t>(p + 63) / 64;
    const std::int64_t sealed = static_cast<std::int64_t>(seq.pages->size()) * p;
    keep.assign(seq.pages->size() * mask_words, 0);
    std::vector<std::int64_t> begin;
    std::vector<const std::byte*> bounds;
    std::vector<std::int32_t> length;
    if (r.block_tokens > 0) {
      for (std::size_t i = 0; i < seq.pages->size(); ++i)
        for (int j = 0; j < bounds_geometry_.blocks_per_page; ++j) {
          begin.push_back(static_cast<std::int64_t>(i) * p + static_cast<std::int64_t>(j) * r.block_tokens);
          length.push_back(r.block_tokens);
          bounds.push_back(page_bounds((*seq.pages)[i], h, j));
        }
    } else {
      const detail::chunk_list& c = r.chunks[b];
      for (std::int32_t i = 0; i < c.count; ++i) {
        begin.push_back(c.starts[i]);
        length.push_back(static_cast<std::int32_t>(c.starts[i + 1] - c.starts[i]));
        bounds.push_back(reinterpret_cast<const std::byte*>(
            c.bounds + (static_cast<std::size_t>(i) * shape_.num_kv_heads + h) * 2 * static_cast<std::size_t>(d)));
      }
    }
    // Spans inside the recent window are read from its exact rows anyway: no candidates (spans
    // come in token order, so they are a suffix).
    if (b < r.candidates_before.size()) {
      std::size_t count = 0;
      while (count < begin.size() && begin[count] < r.candidates_before[b]) ++count;
      begin.resize(count);
      length.resize(count);
      bounds.resize(count);
    }
    std::vector<float> scores(begin.size()), head_scores(static_cast<std::size_t>(groups)), lo_hi(2 * static_cast<std::size_t>(d));
    std::vector<float> queries(static_cast<std::size_t>(groups) * d);  // unscaled: the order is what counts
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < d; ++c) queries[static_cast<std::size_t>(g) * d + c] = to_float(q(static_cast<std::int64_t>(b), h * groups + g, c));
    // Page blocks keep the selector's summary (a mean row is scored as lo = hi = mean), or the
    // format's block keys, scored with the queries in each page's segment; chunks keep bounds.
    if constexpr (has_block_keys_v<Format>) {
      if (r.block_tokens > 0 && bounds_geometry_.format_keys) {
        std::vector<float> q_key;
        std::int64_t key_segment = -1;
        const int per = traits::segment_pages(format_, shape_.page());
        for (std::size_t i = 0; i < begin.size(); ++i) {
          const std::int64_t index = begin[i] / p;
          if (index / per != key_segment) {  // spans come in token order: one query per segment
            const segment_t& seg = segment(seq.slot, index, h);
            key_segment = index / per;
            q_key.resize(static_cast<std::size_t>(groups) * seg.kept);
            traits::block_key_query(format_, shape_.page(), seg, queries.data(), groups, q_key.data());
          }
          const std::size_t kept = q_key.size() / static_cast<std::size_t>(groups);
          for (int g = 0; g < groups; ++g)
            head_scores[static_cast<std::size_t>(g)] = traits::score_block_key(format_, shape_.page(), q_key.data() + g * kept, bounds[i]);
          scores[i] = detail::combine_scores(head_scores.data(), groups, r.combine);
        }
      }
    }
    const int rows = r.block_tokens > 0 ? bounds_geometry_.rows_per_block : 2;
    for (std::size_t i = 0; i < begin.size() && !(r.block_tokens > 0 && bounds_geometry_.format_keys); ++i) {
      dense_traits::decode_k(format::dense{}, page_shape{rows, d, shape_.storage}, bounds[i], rows, lo_hi.data());
      for (int g = 0; g < groups; ++g)
        head_scores[static_cast<std::size_t>(g)] = detail::span_score(queries.data() + static_cast<std::size_t>(g) * d, d, [&](int c) {
          return std::make_pair(lo_hi[static_cast<std::size_t>(c)], lo_hi[static_cast<std::size_t>((rows - 1) * d + c)]);
        });
      scores[i] = detail::combine_scores(head_scores.data(), groups, r.combine);
    }
    const auto mark = [&](std::int64_t from, std::int64_t to) {
      for (std::int64_t t = std::max<std::int64_t>(from, 0); t < std::min(to, sealed); ++t)
        keep[static_cast<std::size_t>(t / p) * mask_words + static_cast<std::size_t>(t % p) / 64] |= std::uint64_t{1} << (t % p % 64);
    };
    for (const std::int32_t i : detail::budget_prefix(scores, length, r.budget[b])) {
      const std::int64_t from = begin[static_cast<std::size_t>(i)], to = from + length[static_cast<std::size_t>(i)];
      mark(from, to);
      chosen.tokens_selected += to - from;
      if (!chosen.selected.empty() && chosen.selected.back().second == from)
        chosen.selected.back().second = to;
      else
        chosen.selected.emplace_back(from, to);
    }
    mark(r.always_from[b], sealed);
  }

  std::byte* tail_slot(std::int32_t slot) const {
    return tails_.data() + static_cast<std::size_t>(slot) * geometry_.tail_slot_bytes();
  }
  /// Keeps the exact rows and the first `rows` tail rows of `slot` (every head, K and V) for
  /// `rollback`.
  /// A batch's appends may save several slots; each is restored by `rollback`.
  void save_tail(std::int32_t slot, int rows) {
    const std::size_t bytes = (geometry_.exact_rows + static_cast<std::size_t>(rows)) * geometry_.row_bytes;
    const std::size_t first = saved_tail_.size();
    saved_.reserve(saved_.size() + 1);
    saved_tail_.resize(first + 2 * static_cast<std::size_t>(shape_.num_kv_heads) * bytes);
    std::size_t at = first;
    for (int h = 0; h < shape_.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        std::memcpy(saved_tail_.data() + at, tail_slot(slot) + geometry_.tail_offset(is_v, h), bytes);
        at += bytes;
      }
    saved_.push_back(saved_rows{slot, rows, first});
  }
  /// Tail row 0 of one head of a slot (K or V); the exact rows precede it.
  std::byte* tail_head(std::int32_t slot, bool is_v, int head) const {
    return tail_slot(slot) + geometry_.tail_offset(is_v, head) + geometry_.tail_row_offset();
  }
  /// Before the first page of a segment (page `index`, a multiple of `segment_pages`) is sealed:
  /// fits the segment of every KV head (`detail::plan_segments`) to the full tail and this call's
  /// rows from `next` on; the slot's later segments are dropped (they belonged to a removed or
  /// rolled-back sequence).
  template <class T>
  void plan_segment_at(std::int32_t slot, std::int64_t index, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v,
                       std::int64_t next) {
    const int per = traits::segment_pages(format_, shape_.page());
    if (index % per != 0) return;
    std::vector<segment_t> planned = detail::plan_segments(format_, shape_, geometry_, tail_slot(slot), index, k, v, next);
    std::vector<segment_t>& list = segments_[static_cast<std::size_t>(slot)];
    list.resize(static_cast<std::size_t>(index / per) * shape_.num_kv_heads);
    list.insert(list.end(), std::make_move_iterator(planned.begin()), std::make_move_iterator(planned.end()));
  }

  /// Encodes a full tail into `page`, the sequence's page number `index`, with the format's
  /// encoder (reading the tail's exact values). The exact rows are copied first: the sinks (page
  /// 0) and the tokens among the last W sealed once this page is (the window ring); they are
  /// masked in the page. A format that hides its sinks (`detail::hides_sink_rows`) has them
  /// replaced by the first row after them in what the encoder sees.
  void seal_tail(std::int32_t slot, page_id page, std::int64_t index) {
    const page_shape shape = shape_.page();
    const int p = shape_.page_size;
    const int sinks = index == 0 ? static_cast<int>(geometry_.sink_rows) : 0;
    std::vector<float> rows(static_cast<std::size_t>(p) * shape_.head_dim);
    const auto hide_sinks = [&] {
      if constexpr (detail::hides_sink_rows_v<Format>)
        for (int t = 0; t < sinks; ++t)
          std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(sinks) * shape_.head_dim, shape_.head_dim,
                      rows.begin() + static_cast<std::ptrdiff_t>(t) * shape_.head_dim);
    };
    if (geometry_.exact_rows > 0) {
      const std::int64_t first = index * p, sealed = first + p;
      for (int r = 0; r < p; ++r) {
        const std::int64_t t = first + r;
        if (!geometry_.exact_position(t, sealed)) continue;
        for (int h = 0; h < shape_.num_kv_heads; ++h)
          for (const bool is_v : {false, true}) {
            std::byte* head = tail_slot(slot) + geometry_.tail_offset(is_v, h);
            std::memcpy(head + geometry_.exact_row_of(t) * geometry_.row_bytes, tail_head(slot, is_v, h) + r * geometry_.row_bytes,
                        geometry_.row_bytes);
          }
      }
    }
    std::byte* base = pages_.data() + static_cast<std::size_t>(page) * page_slot_bytes();
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      dense_traits::decode_k(format::dense{}, shape, tail_head(slot, false, h), shape_.page_size, rows.data());
      for (int block = 0; block < bounds_geometry_.blocks_per_page; ++block)
        store_block(slot, index, page, h, block,
                    rows.data() + static_cast<std::size_t>(block) * bounds_geometry_.block_tokens * shape_.head_dim);
      hide_sinks();
      if constexpr (has_segments_v<Format>) {
        traits::encode_k(format_, shape, segment(slot, index, h), rows.data(), base + geometry_.k_page_offset(h));
      } else if constexpr (has_key_weights_v<Format>) {
        const std::vector<float>& w = key_weights_[static_cast<std::size_t>(slot)];
        traits::encode_k(format_, shape, rows.data(), w.empty() ? nullptr : w.data() + h * shape_.head_dim,
                         base + geometry_.k_page_offset(h));
      } else {
        traits::encode_k(format_, shape, rows.data(), base + geometry_.k_page_offset(h));
      }
      dense_traits::decode_v(format::dense{}, shape, tail_head(slot, true, h), shape_.page_size, rows.data());
      hide_sinks();
      if constexpr (has_segments_v<Format>) traits::encode_v(format_, shape, segment(slot, index, h), rows.data(), base + geometry_.v_page_offset(h));
      else traits::encode_v(format_, shape, rows.data(), base + geometry_.v_page_offset(h));
    }
  }

  /// Bytes of the format's block key when `Selector` keeps mean keys and the format has block
  /// keys; 0 (dense summary rows) otherwise.
  template <class Selector>
  static std::size_t block_key_bytes_for(const Format& format, const detail::engine_shape& shape) {
    if constexpr (has_block_keys_v<Format>)
      if (detail::block_summary_of<Selector>::value == block_summary::mean) return traits::block_key_bytes(format, shape.page());
    return 0;
  }
  /// The summary of one block of `n` exact rows of head `h` of page `index` of the sequence in
  /// `slot` (page `page` of the pool): the selector's dense rows, or the format's block key of the
  /// rows' fp32 mean in the page's segment.
  void store_block(std::int32_t slot, std::int64_t index, page_id page, int h, int block, const float* rows) {
    std::byte* out = bounds_.data() + bounds_geometry_.offset(page, h, block);
    if constexpr (has_block_keys_v<Format>) {
      if (bounds_geometry_.format_keys) {
        std::vector<float> mean(static_cast<std::size_t>(shape_.head_dim));
        detail::mean_key(rows, bounds_geometry_.block_tokens, shape_.head_dim, mean.data());
        traits::encode_block_key(format_, shape_.page(), segment(slot, index, h), mean.data(), out);
        return;
      }
    }
    detail::store_block_summary(bounds_geometry_.summary, shape_.storage, rows, bounds_geometry_.block_tokens, shape_.head_dim, out);
  }

  detail::engine_shape shape_;
  Format format_;
  detail::arena_geometry geometry_;
  detail::bounds_geometry bounds_geometry_;
  detail::host_buffer pages_;
  detail::host_buffer tails_;
  detail::host_buffer bounds_;  ///< key bounds per page block (read-less selectors), else empty
  std::vector<detail::head_selection> last_selection_;
  std::vector<detail::sequence_ref> planned_batch_;  ///< the planned step (`plan`, then `run`)
  std::vector<std::vector<std::uint64_t>> visible_rows_;  ///< per planned sequence: `prepare_visible_rows`
  detail::selection_request planned_request_;
  float planned_scale_ = 1.0f;
  bool planned_selects_ = false;
  score_settings planned_scores_;
  /// Rows kept for `rollback`: per saved slot, its exact rows and `rows` tail rows at `at`.
  struct saved_rows {
    std::int32_t slot;
    int rows;
    std::size_t at;
  };
  std::vector<saved_rows> saved_;
  std::vector<std::byte> saved_tail_;
  /// Per tail slot: the segments of its sequence, [segment * num_kv_heads + head] (formats with
  /// segments; empty otherwise).
  std::vector<std::vector<segment_t>> segments_ = std::vector<std::vector<segment_t>>(static_cast<std::size_t>(shape_.max_sequences));
  /// Per tail slot: output-aware K weights [num_kv_heads][head_dim], empty for magnitudes.
  std::vector<std::vector<float>> key_weights_ = std::vector<std::vector<float>>(static_cast<std::size_t>(shape_.max_sequences));
};

}  // namespace host

namespace detail {
template <class Format, class Selector>
struct engine_for<backend::host, Format, Selector> {
  using type = host::engine<Format>;
};
}  // namespace detail
}  // namespace kvmosaic
