// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The composition: `kvmosaic::cache<Format, Selector, Compactor, Backend>`.
///
/// A cache holds the K and V of many sequences for one attention layer: per sequence, a block
/// table of compressed pages of `page_size` tokens (stored by `Format`, in a fixed-size page pool)
/// plus one dense tail of fewer than `page_size` tokens in the storage dtype. When the tail fills
/// it is encoded into a new page. A decode step attends one query token per sequence over the
/// pages `Selector` picks plus the tail; `Compactor` turns evicted tokens into freed pages.
///
/// The cache is the host object of the layering: it owns memory, validates every argument, and
/// keeps the bookkeeping (pool, block tables, lengths, reference counts) on the host for every
/// backend. The backend's engine owns the bytes and the data path (CPU code, or CUDA kernels).
/// Every operation is all or nothing: it checks its arguments and makes its allocations before it
/// changes anything, the engine undoes a write that fails (`rollback`), and the bookkeeping is
/// committed with operations that cannot throw; a call that throws, for bad input, an exhausted
/// pool, an allocation failure or a CUDA error short of a lost context, leaves the cache as it
/// was (docs/architecture.md, "Every call is all or nothing").
///
/// What a new part must provide: see format/format_traits.hpp, select/selector_traits.hpp and
/// compact/compactor_traits.hpp; docs/architecture.md walks through adding one.

#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/compact/compactor_traits.hpp"
#include "kvmosaic/compact/none.hpp"
#include "kvmosaic/core/config.hpp"
#include "kvmosaic/core/dtype.hpp"
#include "kvmosaic/core/error.hpp"
#include "kvmosaic/core/policy.hpp"
#include "kvmosaic/core/view.hpp"
#include "kvmosaic/format/format_traits.hpp"
#include "kvmosaic/host/backend.hpp"
#include "kvmosaic/memory/block_table.hpp"
#include "kvmosaic/memory/page_pool.hpp"
#include "kvmosaic/select/all.hpp"
#include "kvmosaic/select/per_kv_head.hpp"
#include "kvmosaic/select/selection_request.hpp"
#include "kvmosaic/select/selector_traits.hpp"

namespace kvmosaic {

/// Run-time shape and capacity of a cache. Checked by the cache constructor (`validate`).
struct cache_config {
  int num_kv_heads = 8;      ///< KV heads of the layer, >= 1
  int group_size = 4;        ///< query heads per KV head (GQA): 1 to 8
  int head_dim = 128;        ///< 64, 128 or 256
  int page_size = limits::default_page_size;  ///< tokens per page: a multiple of 16, 16 to 1024
  dtype storage = dtype::bf16;                ///< dtype of uncompressed values: f16 or bf16
  std::int32_t max_pages = 1024;              ///< page pool capacity (pages of all KV heads, K and V)
  std::int32_t max_sequences = 64;            ///< concurrent sequences (one dense tail each)

  int num_q_heads() const noexcept { return num_kv_heads * group_size; }

  /// Throws `invalid_argument` naming the first field outside its allowed values.
  void validate() const {
    const char* where = "cache_config";
    detail::require(num_kv_heads >= 1, where, "num_kv_heads", num_kv_heads, ">= 1");
    detail::require(limits::is_supported_group_size(group_size), where, "group_size", group_size,
                    limits::supported_group_sizes);
    detail::require(limits::is_supported_head_dim(head_dim), where, "head_dim", head_dim,
                    limits::supported_head_dims);
    detail::require(limits::is_supported_page_size(page_size), where, "page_size", page_size,
                    limits::supported_page_sizes);
    detail::require(storage == dtype::f16 || storage == dtype::bf16, where, "storage", to_string(storage),
                    "f16 or bf16");
    detail::require(num_kv_heads <= limits::max_kv_heads, where, "num_kv_heads", num_kv_heads,
                    "at most limits::max_kv_heads (1024)");
    detail::require(max_pages >= 1 && max_pages <= limits::max_pool_pages, where, "max_pages", max_pages,
                    "1 to limits::max_pool_pages (2^24)");
    detail::require(max_sequences >= 1 && max_sequences <= limits::max_sequences, where, "max_sequences",
                    max_sequences, "1 to limits::max_sequences (2^20)");
  }
};

/// A compile-time shape: a config whose head_dim, group size and page size are checked by the
/// compiler. Kernels specialized on a shape use the same predicates.
template <int HeadDim, int GroupSize, int PageSize = limits::default_page_size>
struct static_shape {
  static_assert(limits::is_supported_head_dim(HeadDim), "kvmosaic: head_dim must be 64, 128 or 256");
  static_assert(limits::is_supported_group_size(GroupSize), "kvmosaic: group_size must be 1 to 8");
  static_assert(limits::is_supported_page_size(PageSize),
                "kvmosaic: page_size must be a multiple of 16 from 16 to 1024");
  static constexpr int head_dim = HeadDim;
  static constexpr int group_size = GroupSize;
  static constexpr int page_size = PageSize;

  /// A run-time config with this shape.
  static cache_config config(int num_kv_heads, dtype storage = dtype::bf16) {
    cache_config c;
    c.num_kv_heads = num_kv_heads;
    c.group_size = GroupSize;
    c.head_dim = HeadDim;
    c.page_size = PageSize;
    c.storage = storage;
    return c;
  }
};

/// Handle of a sequence in a cache (returned by `add_sequence`). Opaque: it names a sequence slot
/// and the generation of that slot, so a handle kept after `remove_sequence` is rejected with
/// `invalid_argument` instead of addressing the sequence that reuses the slot. A slot's generation
/// wraps after 2^31 / max_sequences removals (2^25 at the default 64 slots); `cache::slot` maps a
/// live handle to its slot, 0 to max_sequences - 1, the index the backends use.
using sequence_id = std::int32_t;

/// Options of one decode step.
struct attend_params {
  /// Multiplies q . k before the softmax. 0 means the default 1 / sqrt(head_dim).
  float softmax_scale = 0.0f;
};

/// Memory in use, in bytes, with every stored byte of the format counted.
struct memory_stats {
  std::int64_t tokens = 0;          ///< tokens stored
  std::int64_t stored_bytes = 0;    ///< pages (whole pages, by the format's accounting) + tail rows
                                    ///< + the exact sink and recent-window rows the tail slot holds
  std::int64_t dense_bytes = 0;     ///< the same tokens as 16-bit K and V rows
  std::int32_t pages_used = 0;      ///< pool pages held
  std::int32_t pages_free = 0;      ///< the free-page gauge

  /// stored_bytes / dense_bytes (DESIGN: all stored bytes over dense 16-bit bytes, same tokens).
  double compression_ratio() const noexcept {
    return dense_bytes > 0 ? static_cast<double>(stored_bytes) / static_cast<double>(dense_bytes) : 1.0;
  }
  double bytes_per_token() const noexcept {
    return tokens > 0 ? static_cast<double>(stored_bytes) / static_cast<double>(tokens) : 0.0;
  }
};

/// What the last decode step of a read-less selector read for one sequence: token and page counts
/// averaged over its KV heads (each KV head selects on its own); reuse over all of them.
struct selection_stats {
  double tokens_selected = 0;  ///< tokens of the selected spans (within the budget)
  double tokens_read = 0;      ///< tokens attended: selected, those the selector always reads,
                               ///< sink rows and tail
  double pages_read = 0;       ///< pages holding at least one attended token (the tail not counted)
  /// Of the previous step's selected tokens (every KV head's), the fraction this step read again
  /// (SentKVCompress's reuse); NaN before a sequence's second selected step.
  double reuse = std::numeric_limits<double>::quiet_NaN();
};

/// A paged, compressed KV cache for one attention layer. See the file comment.
///
/// \tparam Format    how a page is stored (`format::dense`, ...)
/// \tparam Selector  which tokens a query reads (`select::all`, ...)
/// \tparam Compactor how evicted tokens free pages (`compact::none`, ...)
/// \tparam Backend   where pages live and attention runs (`backend::host`, `backend::cuda`)
///
/// The selector takes part through its traits' hooks only (select/selector_traits.hpp): a state
/// per sequence that the cache stages, reserves and commits with each call, the engine's share of
/// its work, its bytes, its part of a step's selection request, and public members it adds
/// (`selector_traits<Selector>::cache_members`, a base of this class).
template <class FormatArg, class SelectorArg = select::all, class CompactorArg = compact::none,
          class BackendArg = backend::host>
class cache
    : public detail::selector_cache_members<SelectorArg, cache<FormatArg, SelectorArg, CompactorArg, BackendArg>>::type {
  static_assert(is_format_v<FormatArg>,
                "kvmosaic::cache: the first template argument (Format) must be a storage format, "
                "e.g. kvmosaic::format::dense");
  static_assert(is_selector_v<SelectorArg>,
                "kvmosaic::cache: the second template argument (Selector) must be a selector, "
                "e.g. kvmosaic::select::all");
  static_assert(is_compactor_v<CompactorArg>,
                "kvmosaic::cache: the third template argument (Compactor) must be a compactor, "
                "e.g. kvmosaic::compact::none");
  static_assert(is_backend_v<BackendArg>,
                "kvmosaic::cache: the fourth template argument (Backend) must be kvmosaic::backend::host "
                "or kvmosaic::backend::cuda");
  static_assert(!detail::is_per_kv_head<SelectorArg>::value,
                "kvmosaic::cache: a cache of select::per_kv_head<S> is declared in kvmosaic/per_kv_head_cache.hpp "
                "(kvmosaic/kvmosaic.hpp includes it)");

  // A policy in the wrong position fails its sentence above; the rest of the class then compiles
  // against a default of that kind, so that sentence is the only error a user reads.
  using Format = std::conditional_t<is_format_v<FormatArg>, FormatArg, format::dense>;
  using Selector = std::conditional_t<is_selector_v<SelectorArg> && !detail::is_per_kv_head<SelectorArg>::value, SelectorArg,
                                      select::all>;
  using Compactor = std::conditional_t<is_compactor_v<CompactorArg>, CompactorArg, compact::none>;
  using Backend = std::conditional_t<is_backend_v<BackendArg>, BackendArg, backend::host>;

  static_assert(!(selector_traits<Selector>::evicts && !compactor_traits<Compactor>::frees_memory),
                "kvmosaic::cache: a selector that evicts tokens needs a compactor that frees memory "
                "(e.g. compact::repack), not compact::none");
  static_assert(!(compactor_traits<Compactor>::frees_memory && detail::keeps_token_ranges<Selector>::value),
                "kvmosaic::cache: this selector's spans are runs of slots (select::sentence_chunks), which a "
                "compaction would move: use it with compact::none");

 public:
  using format_type = Format;
  using selector_type = Selector;
  using compactor_type = Compactor;
  using backend_type = Backend;
  using engine_type = typename detail::engine_for<Backend, Format, Selector>::type;
  static_assert(detail::token_scores_of<Selector>::value == score_use::none || engine_type::records_token_scores,
                "kvmosaic::cache: this selector reads each step's token scores (select::tova, select::h2o), which "
                "this backend's kernels do not write for this format: on backend::cuda use format::dense, "
                "format::bitmap_tiles, format::quant (quant2, quant4) or format::packed_bitmap, or use backend::host");

  explicit cache(const cache_config& config, const Format& format = {}, const Selector& selector = {},
                 const Compactor& compactor = {})
      : config_(validated(config, format, selector)),
        format_(format),
        selector_(selector),
        compactor_(compactor),
        pool_(config.max_pages),
        engine_(engine_shape(config), format, selector),
        sequences_(sequence_slots(config)) {}

  const cache_config& config() const noexcept { return config_; }
  const Format& format() const noexcept { return format_; }
  const Selector& selector() const noexcept { return selector_; }
  const Compactor& compactor() const noexcept { return compactor_; }
  const page_pool& pool() const noexcept { return pool_; }
  const engine_type& engine() const noexcept { return engine_; }
  /// The backend engine (e.g. to set the CUDA stream or capture a decode step in a graph).
  engine_type& engine() noexcept { return engine_; }

  /// "format/selector/compactor" with parameters, for reports.
  std::string describe() const {
    return format_traits<Format>::describe(format_) + "/" + selector_traits<Selector>::describe(selector_) + "/" +
           compactor_traits<Compactor>::describe(compactor_);
  }

  /// Starts an empty sequence. Throws `capacity_error` when max_sequences are live.
  sequence_id add_sequence() {
    const std::int32_t slot = free_slot("cache::add_sequence");
    sequence_state fresh;  // may throw (allocation): nothing changed yet
    if constexpr (has_key_weights_v<Format>) engine_.set_key_weights(slot, nullptr);  // magnitudes
    return activate(slot, std::move(fresh));
  }

  /// Ends a sequence and releases its pages (shared pages stay until their last holder ends). Its
  /// handle, and every copy of it, is invalid from now on.
  void remove_sequence(sequence_id seq) {
    sequence_state& s = live(seq, "cache::remove_sequence");
    const std::int32_t slot = slot_of(seq);
    for (const page_id page : s.pages) pool_.release(page);
    selector_traits<Selector>::template release<rows_on_device>(engine_, slot);
    if constexpr (has_key_weights_v<Format>) engine_.set_key_weights(slot, nullptr);
    const std::uint32_t generation = s.generation + 1 < generations_ ? s.generation + 1 : 0;
    s = sequence_state{};
    s.generation = generation;
  }

  /// A new sequence that shares every full page of `seq` (reference counted, no copy) and holds a
  /// copy of its tail: a common prefix stored once. All or nothing: on failure no slot is taken.
  sequence_id fork_sequence(sequence_id seq) {
    const sequence_state& parent = live(seq, "cache::fork_sequence");
    const std::int32_t from = slot_of(seq);
    const std::int32_t slot = free_slot("cache::fork_sequence");
    sequence_state child;  // copies (may throw): nothing changed yet
    child.pages = parent.pages;
    child.stored = parent.stored;
    child.seen = parent.seen;
    child.slots = parent.slots;
    child.selector_state = parent.selector_state;
    child.budget = parent.budget;
    child.own_budget = parent.own_budget;
    // The child's slot is not live until the end: a failed copy leaves nothing visible.
    write_then_commit({}, [&] {
      engine_.copy_tail(from, slot, tail_rows(parent));
      selector_traits<Selector>::template fork<rows_on_device>(engine_, from, slot);
    });
    for (const page_id page : child.pages) pool_.retain(page);
    return activate(slot, std::move(child));
  }

  /// The slot (0 to max_sequences - 1) of a live sequence: the index a backend's per-sequence
  /// storage (tail, a selector's engine state, `detail::sequence_ref::slot`) uses.
  std::int32_t slot(sequence_id seq) const {
    live(seq, "cache::slot");
    return slot_of(seq);
  }

  /// Output-aware K pruning (MUSTAFAR section 2.1), for formats with `has_key_weights_v`: K pages
  /// of `seq` sealed from now on keep, per token, the elements of largest |k_c| * weights(h, c)
  /// instead of largest |k_c|. `weights` is [num_kv_heads][head_dim] in host memory, e.g.
  /// `output_aware_key_weights` of the latest window of queries; an empty view (extent 0) goes
  /// back to magnitudes. Pages already sealed keep their pruning; forks inherit the weights.
  void set_key_weights(sequence_id seq, tensor_view<const float, 2> weights) {
    static_assert(has_key_weights_v<Format>,
                  "kvmosaic::cache::set_key_weights: this format does not prune K with channel weights "
                  "(format::bitmap_tiles does)");
    live(seq, "cache::set_key_weights");
    if (weights.extent(0) == 0) {
      engine_.set_key_weights(slot_of(seq), nullptr);
      return;
    }
    detail::require(weights.extent(0) == config_.num_kv_heads && weights.extent(1) == config_.head_dim,
                    "cache::set_key_weights", "weights shape", std::to_string(weights.extent(0)) + "x" +
                    std::to_string(weights.extent(1)), "num_kv_heads x head_dim");
    check_view("cache::set_key_weights", "weights", weights);
    std::vector<float> dense(static_cast<std::size_t>(weights.extent(0) * weights.extent(1)));
    for (std::int64_t h = 0; h < weights.extent(0); ++h)
      for (std::int64_t c = 0; c < weights.extent(1); ++c) {
        const float w = weights(h, c);
        detail::require(std::isfinite(w) && w >= 0.0f, "cache::set_key_weights", "weights", w,
                        "finite and >= 0 (sums of |q|)");
        dense[static_cast<std::size_t>(h * weights.extent(1) + c)] = w;
      }
    engine_.set_key_weights(slot_of(seq), dense.data());
  }

  /// Appends the tokens of `k` and `v` ([tokens][num_kv_heads][head_dim], float, half or bfloat16,
  /// any strides; on backend::cuda device memory whose head_dim elements are contiguous, and
  /// contiguous arrays for a format with segments; values are rounded to the storage dtype,
  /// finite values beyond its range saturated to its largest finite value, infinities and NaN
  /// kept) to one sequence: a prefill, or a piece of one
  /// of any size (pieces store exactly what one prefill of the same tokens stores). Full pages are
  /// encoded by the format; the rest stays in the dense tail. All or nothing: when the pool lacks
  /// the pages, it throws `capacity_error` and nothing is stored. NaN input gives unspecified
  /// outputs for the heads that read it, never undefined behaviour.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    static_assert(!selector_traits<Selector>::needs_token_ids,
                  "kvmosaic::cache::prefill: this selector cuts the stream at boundary tokens: pass the token "
                  "ids, prefill(seq, k, v, token_ids)");
    prefill_rows(seq, k, v, span<const std::int32_t>{});
  }
  /// `prefill` with the tokens' ids (`token_ids.size() == k.extent(0)`, host memory), which
  /// selectors with `selector_traits::needs_token_ids` read; other selectors ignore them.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == k.extent(0), "cache::prefill", "token_ids.size()", token_ids.size(),
                    "k.extent(0) (one id per token)");
    check_view("cache::prefill", "token_ids", token_ids);
    prefill_rows(seq, k, v, token_ids);
  }

 private:
  // All or nothing: everything that can fail (checks, allocations, the selector's staged update)
  // happens before the backend writes; the backend's write is undone if it fails (the
  // tail rows it may have overwritten are restored, its fresh pages go back to the pool); the
  // bookkeeping is then committed with operations that cannot throw.
  template <class T>
  void prefill_rows(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    sequence_state& s = live(seq, "cache::prefill");
    const std::int32_t slot = slot_of(seq);
    check_rows("cache::prefill", k, v);
    detail::require(k.extent(0) >= 1, "cache::prefill", "k.extent(0) (tokens)", k.extent(0), ">= 1");
    const int tail = tail_rows(s);
    const std::int64_t rows = k.extent(0), page = config_.page_size;
    // Pages the rows complete, without overflow for any row count (a count the pool cannot hold
    // is a capacity_error below).
    const std::int64_t completed = rows / page + (tail + rows % page) / page;
    const std::vector<page_id> fresh = pool_.allocate(completed);
    using traits = selector_traits<Selector>;
    typename traits::update staged;
    write_then_commit(fresh, [&] {
      staged = traits::template stage<rows_on_device>(selector_, selector_shape_of(), s.selector_state, k, token_ids, 0, rows);
      traits::reserve(s.selector_state, staged);
      s.pages.reserve(s.pages.size() + fresh.size());
      if constexpr (evicts_tokens) s.slots.reserve(s.pages.size() + fresh.size(), config_.page_size);
      engine_.extend(slot, tail, k, v, fresh.data(), static_cast<std::int64_t>(s.pages.size()));
      traits::template write<rows_on_device>(engine_, slot, staged, k, 0, rows);
    });
    s.pages.insert(s.pages.end(), fresh.begin(), fresh.end());  // within the reserved capacity
    if constexpr (evicts_tokens) s.slots.seal(fresh.size(), s.seen - tail, config_.page_size);  // reserved
    s.stored += rows;
    s.seen += rows;
    traits::commit(s.selector_state, staged);
    after_write(span<const sequence_id>(&seq, 1), rows);
  }

 public:

  /// Appends one token to each sequence of a decode batch: `k`, `v` are [batch][num_kv_heads]
  /// [head_dim], row b for `seqs[b]`. Sequences must be distinct. All or nothing, as prefill.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    static_assert(!selector_traits<Selector>::needs_token_ids,
                  "kvmosaic::cache::append: this selector cuts the stream at boundary tokens: pass the token "
                  "ids, append(seqs, k, v, token_ids)");
    append_rows(seqs, k, v, span<const std::int32_t>{});
  }
  /// `append` with each new token's id (`token_ids.size() == seqs.size()`); see `prefill`.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == seqs.size(), "cache::append", "token_ids.size()", token_ids.size(),
                    "seqs.size() (one id per sequence)");
    check_view("cache::append", "token_ids", token_ids);
    append_rows(seqs, k, v, token_ids);
  }

 private:
  template <class T>
  void append_rows(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
                   span<const std::int32_t> token_ids) {
    check_view("cache::append", "seqs", seqs);
    check_rows("cache::append", k, v);
    detail::require(k.extent(0) == seqs.size(), "cache::append", "k.extent(0) (batch)", k.extent(0),
                    "seqs.size()");
    std::int64_t pages_needed = 0;
    std::vector<bool> seen(sequences_.size(), false);
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const sequence_state& s = live(seqs(b), "cache::append");
      const auto slot = static_cast<std::size_t>(slot_of(seqs(b)));
      detail::require(!seen[slot], "cache::append", "seqs", seqs(b),
                      "distinct sequence ids (one token per sequence per call)");
      seen[slot] = true;
      pages_needed += tail_rows(s) + 1 == config_.page_size;
    }
    // Staging (may throw; nothing changed yet): the selector's updates, room for the new pages.
    using traits = selector_traits<Selector>;
    std::vector<typename traits::update> staged(static_cast<std::size_t>(seqs.size()));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = state_of(seqs(b));
      staged[static_cast<std::size_t>(b)] =
          traits::template stage<rows_on_device>(selector_, selector_shape_of(), s.selector_state, k, token_ids, b, 1);
      traits::reserve(s.selector_state, staged[static_cast<std::size_t>(b)]);
      if (tail_rows(s) + 1 == config_.page_size) {
        s.pages.reserve(s.pages.size() + 1);
        if constexpr (evicts_tokens) s.slots.reserve(s.pages.size() + 1, config_.page_size);
      }
    }
    std::vector<detail::append_item> items;
    items.reserve(static_cast<std::size_t>(seqs.size()));
    const std::vector<page_id> fresh = pool_.allocate(pages_needed);
    auto next = fresh.begin();
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const sequence_state& s = state_of(seqs(b));
      const int tail = tail_rows(s);
      items.push_back(detail::append_item{slot_of(seqs(b)), tail, tail + 1 == config_.page_size ? *next++ : -1,
                                          static_cast<std::int64_t>(s.pages.size())});
    }
    write_then_commit(fresh, [&] {
      engine_.append(items, k, v);
      for (std::int64_t b = 0; b < seqs.size(); ++b)
        traits::template write<rows_on_device>(engine_, slot_of(seqs(b)), staged[static_cast<std::size_t>(b)], k, b, 1);
    });
    for (std::int64_t b = 0; b < seqs.size(); ++b) {  // cannot throw: capacities reserved above
      sequence_state& s = state_of(seqs(b));
      if (items[static_cast<std::size_t>(b)].new_page >= 0) {
        s.pages.push_back(items[static_cast<std::size_t>(b)].new_page);
        if constexpr (evicts_tokens) s.slots.seal(1, s.seen - (config_.page_size - 1), config_.page_size);
      }
      ++s.stored;
      ++s.seen;
      traits::commit(s.selector_state, staged[static_cast<std::size_t>(b)]);
    }
    after_write(seqs, 1);
  }

 public:

  /// One decode step: `plan(seqs, params)`, then `run(q, out)`. out[b] = attention of query q[b]
  /// ([num_q_heads][head_dim]) over the tokens of `seqs[b]` that the selector picks (all of them
  /// for `select::all`); query head j reads KV head j / group_size. q and out: float, half or
  /// bfloat16, any strides (host memory on backend::host, device memory on backend::cuda).
  template <class Q, class O>
  void attend(span<const sequence_id> seqs, tensor_view<Q, 3> q, tensor_view<O, 3> out, const attend_params& params = {}) {
    plan(seqs, params);
    run(q, out);
  }

  /// The host half of a decode step (FlashInfer's plan, CUTLASS's initialize): checks `seqs`,
  /// makes the split plan and the selector's request, and stages them; `run` executes the latest
  /// plan. Cost: O(batch + pages of the batch) on the host; on backend::cuda it writes page-locked
  /// staging and waits only for the previous step's copy out of it, never for kernels. A plan
  /// stays valid until the next call that changes the cache (append, prefill, fork, remove).
  void plan(span<const sequence_id> seqs, const attend_params& params = {}) {
    const char* where = "cache::plan";
    detail::require(params.softmax_scale >= 0.0f && std::isfinite(params.softmax_scale), where,
                    "params.softmax_scale", params.softmax_scale, "a finite value >= 0 (0: 1/sqrt(head_dim))");
    check_view(where, "seqs", seqs);
    std::vector<detail::sequence_ref> batch;
    batch.reserve(static_cast<std::size_t>(seqs.size()));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = live(seqs(b), where);
      detail::require(s.stored >= 1, where, "seqs (an empty sequence)", seqs(b),
                      "sequences holding at least one token");
      const std::uint64_t* live_rows = nullptr;
      if constexpr (evicts_tokens) live_rows = s.slots.dead > 0 ? s.slots.live.data() : nullptr;
      batch.push_back(detail::sequence_ref{&s.pages, s.stored, slot_of(seqs(b)), live_rows});
      if constexpr (records_scores) {  // the step writes each read token's score, by logical position
        if constexpr (rows_on_device) upload_positions(s, slot_of(seqs(b)));
        detail::sequence_ref& ref = batch.back();
        ref.scores = selector_traits<Selector>::scores(state_of(seqs(b)).selector_state).values.data();
        ref.positions = s.slots.position.data();
        ref.tail_position = s.seen - tail_rows(s);
      }
    }

    planned_.assign(seqs.data(), seqs.data() + seqs.size());
    const float scale = params.softmax_scale > 0.0f ? params.softmax_scale
                                                    : 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    if constexpr (records_scores) {  // backend::host: scores by the attend path itself
      engine_.plan(batch, scale, nullptr,
                   score_settings{detail::token_scores_of<Selector>::value, selector_traits<Selector>::score_combine(selector_)});
    } else if constexpr (selector_traits<Selector>::reads_all_pages) {
      engine_.plan(batch, scale);
    } else {
      const selector_shape shape = selector_shape_of();
      detail::selection_request request = selector_traits<Selector>::start_request(selector_, shape);
      for (std::int64_t b = 0; b < seqs.size(); ++b) {
        const sequence_state& s = state_of(seqs(b));
        selector_traits<Selector>::request(selector_, shape, s.selector_state, s.stored, tail_rows(s), request);
        // The recent window is read from its exact rows: its spans are no candidates.
        const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
        request.candidates_before.push_back(window_rows(format_) > 0 ? sealed - window_rows(format_)
                                                                     : std::numeric_limits<std::int64_t>::max());
      }
      engine_.plan(batch, scale, &request);
    }
  }

  /// The device half of the planned step (backend::cuda: enqueued on `engine().stream()`, no
  /// allocation and no synchronization, so a CUDA graph can capture it and replay it after each
  /// new `plan` of a batch no larger). q, out: [batch][num_q_heads][head_dim] in float, half or
  /// bfloat16 with any strides (contiguous float q is read in place; other queries are gathered
  /// to float first, one small kernel); `lse` (optional, [batch][num_q_heads] float) receives
  /// each head's log-sum-exp of its scaled logits (natural log), so an engine can merge this
  /// attention with attention over other tokens computed elsewhere (cascade, chunked prefill).
  /// A selector that reads token scores (select::tova, select::h2o): the step also writes them
  /// (on backend::cuda into the selector's device buffers, without waiting for the step).
  template <class Q, class O>
  void run(tensor_view<Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse = {}) {
    static_assert(detail::is_io_type<std::remove_const_t<Q>>::value && detail::is_io_type<O>::value,
                  "kvmosaic::cache::run: q and out hold float, kvmosaic::half or kvmosaic::bfloat16");
    const char* where = "cache::run";
    const auto batch = static_cast<std::int64_t>(planned_.size());
    detail::require(q.extent(0) == batch, where, "q.extent(0) (batch)", q.extent(0), "the batch of the last plan");
    detail::require(q.extent(1) == config_.num_q_heads(), where, "q.extent(1) (query heads)", q.extent(1),
                    "num_kv_heads * group_size");
    detail::require(q.extent(2) == config_.head_dim, where, "q.extent(2) (head_dim)", q.extent(2),
                    "cache_config::head_dim");
    detail::require(out.extent(0) == q.extent(0) && out.extent(1) == q.extent(1) && out.extent(2) == q.extent(2),
                    where, "out.extents", "mismatch", "the extents of q");
    detail::require(lse.extent(0) == 0 || (lse.extent(0) == batch && lse.extent(1) == q.extent(1)), where,
                    "lse.extents", "mismatch", "empty, or [batch][num_q_heads]");
    check_view(where, "q", q);
    check_view(where, "out", out);
    check_view(where, "lse", lse);
    detail::require(!detail::views_overlap(q, out), where, "out", "overlapping q",
                    "an array that shares no element with q (attention reads every query of a group "
                    "before it writes an output)");
    detail::require(lse.extent(0) == 0 || (!detail::views_overlap(lse, q) && !detail::views_overlap(lse, out)), where,
                    "lse", "overlapping q or out", "an array that shares no element with q or out");
    using query_type = std::remove_const_t<Q>;
    engine_.run(tensor_view<const query_type, 3>(q), out, lse);
    if constexpr (records_scores) {
      for (const sequence_id seq : planned_) {
        sequence_state& s = state_of(seq);
        selector_traits<Selector>::scores(s.selector_state).scored_tokens = s.seen;
      }
    }
    if constexpr (!selector_traits<Selector>::reads_all_pages) {
      // The host engine reports what it read; the CUDA engine keeps its selection on the device
      // (engine().selection().selected_pages), so a step never waits for it.
      record_selection(span<const sequence_id>(planned_.data(), batch));
    }
  }

  /// Sizes the buffers of decode steps for batches of up to `batch` sequences of up to
  /// `max_tokens` tokens each, so that `plan` and `run` within those bounds never reallocate:
  /// what a CUDA graph captured from `run` needs (a larger step reallocates, and the graph must be
  /// captured again). backend::host has nothing to size.
  void reserve_step(std::int32_t batch, std::int64_t max_tokens) {
    detail::require(batch >= 1 && batch <= config_.max_sequences, "cache::reserve_step", "batch", batch,
                    "1 to cache_config::max_sequences");
    detail::require(max_tokens >= 1, "cache::reserve_step", "max_tokens", max_tokens, ">= 1");
    if constexpr (!std::is_same<Backend, backend::host>::value) {
      const std::int64_t pages = std::min<std::int64_t>(max_tokens / config_.page_size + 1, config_.max_pages);
      engine_.reserve_step(batch, static_cast<std::int32_t>(pages));
    }
  }

  /// Changes a read-less selector's token budget from the next step on (engines vary it with load).
  void set_budget(const select::token_budget& budget) {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::set_budget: select::all has no budget");
    budget.validate("cache::set_budget");
    selector_.budget = budget;
  }

  /// A keep-less selector's budget for `seq` alone from its next write (or snapshot) on, in place
  /// of the selector's: engines give requests different budgets, and `select::per_kv_head` gives
  /// each KV head its own. Tokens already evicted stay evicted; a smaller budget evicts at the next
  /// write. Forks inherit it. Throws `invalid_argument` naming `budget.ratio` outside [0, 1], or
  /// for a dead handle. Cost: O(1).
  void set_budget(sequence_id seq, const select::token_budget& budget) {
    static_assert(selector_traits<Selector>::evicts && detail::has_token_budget<Selector>::value,
                  "kvmosaic::cache::set_budget(seq, budget): only a keep-less selector with a token budget (select::h2o, "
                  "tova, snapkv, streaming) keeps one per sequence; a read-less one takes set_budget(budget)");
    sequence_state& s = live(seq, "cache::set_budget");
    budget.validate("cache::set_budget");
    s.budget = budget;
    s.own_budget = true;
  }
  /// The budget a keep-less selector applies to `seq`: its own (`set_budget(seq, budget)`), else
  /// the selector's.
  select::token_budget budget(sequence_id seq) const {
    static_assert(selector_traits<Selector>::evicts && detail::has_token_budget<Selector>::value,
                  "kvmosaic::cache::budget(seq): only a keep-less selector with a token budget keeps one per sequence");
    const sequence_state& s = live(seq, "cache::budget");
    return s.own_budget ? s.budget : selector_.budget;
  }

  /// What the last step read for `seq` (read-less selectors; the sequence must have been in it).
  selection_stats selection(sequence_id seq) const {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::selection: select::all reads every token");
    static_assert(std::is_same<Backend, backend::host>::value,
                  "kvmosaic::cache::selection: on backend::cuda, read engine().selection().selected_pages(b, head)");
    return live(seq, "cache::selection").last_selection;
  }
  /// The token ranges the last step selected for `seq`, KV head `head` (merged, ascending).
  const std::vector<std::pair<std::int64_t, std::int64_t>>& selected_ranges(sequence_id seq, int head) const {
    static_assert(!selector_traits<Selector>::reads_all_pages, "kvmosaic::cache::selected_ranges: select::all reads every token");
    static_assert(std::is_same<Backend, backend::host>::value,
                  "kvmosaic::cache::selected_ranges: on backend::cuda, read engine().selection().selected_pages(b, head)");
    const sequence_state& s = live(seq, "cache::selected_ranges");
    detail::require(head >= 0 && head < config_.num_kv_heads, "cache::selected_ranges", "head", head, "0 to num_kv_heads - 1");
    detail::require(!s.selected.empty(), "cache::selected_ranges", "seq", seq, "a sequence of a selected decode step");
    return s.selected[static_cast<std::size_t>(head)];
  }
  /// The selector's state of a live sequence (`selector_traits<Selector>::sequence_state`; empty
  /// for selectors that keep none). The selector's `cache_members` read it.
  const typename selector_traits<Selector>::sequence_state& selector_state(sequence_id seq) const {
    return live(seq, "cache::selector_state").selector_state;
  }

  /// Tokens stored for a sequence.
  /// Evicts the tokens at logical `positions` (host memory) of `seq`: attention skips them from
  /// this call on, and every page left with no live token goes back to the pool at once (block-
  /// granular reclaim; a compaction pass frees the rest). Positions of the other tokens, and
  /// `length(seq)`, do not change. All or nothing: a position outside [0, length), in the open tail
  /// (its rows are not evictable), already evicted or listed twice is an `invalid_argument` and
  /// nothing changes. Cost: O(slots log slots) on the host (the position lookup); no device work
  /// (on backend::cuda each later step stages the sequence's live-row masks with its metadata).
  template <class C = Compactor>
  void evict(sequence_id seq, span<const std::int64_t> positions) {
    static_assert(compactor_traits<C>::frees_memory,
                  "kvmosaic::cache::evict: this cache's compactor frees no memory; use compact::repack or "
                  "compact::hole_fill");
    evict_positions(seq, positions, false);
  }

 private:
  /// `evict`; with `skip_evicted`, positions already evicted are passed over instead of rejected
  /// (a keep-less selector's own evictions after the caller's).
  void evict_positions(sequence_id seq, span<const std::int64_t> positions, bool skip_evicted) {
    const char* where = "cache::evict";
    sequence_state& s = live(seq, where);
    check_view(where, "positions", positions);
    const int page = config_.page_size;
    const std::int64_t open_from = s.seen - tail_rows(s);  // the tail's first position
    std::vector<std::pair<std::int64_t, std::int64_t>> by_position;  // (position, slot) of live sealed slots
    by_position.reserve(s.slots.position.size() - static_cast<std::size_t>(s.slots.dead));
    for (std::size_t slot = 0; slot < s.slots.position.size(); ++slot)
      if (s.slots.position[slot] >= 0) by_position.emplace_back(s.slots.position[slot], static_cast<std::int64_t>(slot));
    std::sort(by_position.begin(), by_position.end());
    std::vector<std::int64_t> slots;
    slots.reserve(static_cast<std::size_t>(positions.size()));
    for (std::int64_t i = 0; i < positions.size(); ++i) {
      const std::int64_t p = positions(i);
      detail::require(p >= 0 && p < s.seen, where, "positions", p, "0 to length(seq) - 1");
      detail::require(p < open_from, where, "positions", p,
                      ("a sealed token: below " + std::to_string(open_from) + " (the tail's open rows are not evictable)").c_str());
      detail::require(p >= sink_rows(format_), where, "positions", p,
                      "a token after the format's sink tokens (they are kept 16-bit and always read)");
      const auto it = std::lower_bound(by_position.begin(), by_position.end(), std::make_pair(p, std::int64_t{-1}));
      const bool found = it != by_position.end() && it->first == p;
      if (skip_evicted && !found) continue;
      detail::require(found, where, "positions", p, "a live token (this one was evicted before)");
      slots.push_back(it->second);
    }
    std::vector<std::int64_t> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    detail::require(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), where, "positions", "a repeated position",
                    "distinct positions");
    // Nothing below allocates past this point but the empty-page list: compute it on a copy first.
    detail::slot_positions next = s.slots;
    for (const std::int64_t slot : slots) next.evict(slot, page);
    const std::vector<std::int32_t> empty = detail::empty_pages(next.position, page);
    block_table pages;
    pages.reserve(s.pages.size() - empty.size());
    for (std::size_t i = 0, e = 0; i < s.pages.size(); ++i) {
      if (e < empty.size() && empty[e] == static_cast<std::int32_t>(i)) {
        ++e;
        continue;
      }
      pages.push_back(s.pages[i]);
    }
    next.drop_pages(empty, page);
    // Commit (cannot throw): the freed pages go back to the pool.
    for (const std::int32_t i : empty) pool_.release(s.pages[static_cast<std::size_t>(i)]);
    s.pages.swap(pages);
    s.slots = std::move(next);
    s.stored -= static_cast<std::int64_t>(empty.size()) * page;
    if (!sorted.empty()) s.device_positions = std::min(s.device_positions, sorted.front());
    if (!empty.empty()) s.device_positions = std::min(s.device_positions, static_cast<std::int64_t>(empty.front()) * page);
  }

  /// Evicts sealed `slots` of `seq` (ascending, distinct, live, past the sinks: a device ranking's
  /// choice, which the device mirror already marks). Cost: O(slots given) on the host, plus
  /// O(sealed slots) when a page empties (the position map drops it, as `evict` does).
  void evict_slots(sequence_id seq, const std::vector<std::int64_t>& slots) {
    sequence_state& s = state_of(seq);
    const int page = config_.page_size;
    const int words = detail::slot_positions::words(page);
    // Pages left with no live row, found before anything changes: a page empties when every live
    // row it has is among `slots` (ascending, so a page's slots are adjacent).
    std::vector<std::int32_t> empty;
    for (std::size_t i = 0; i < slots.size();) {
      const std::int64_t p = slots[i] / page;
      std::size_t j = i;
      while (j < slots.size() && slots[j] / page == p) ++j;
      int live = 0;
      for (int w = 0; w < words; ++w) live += static_cast<int>(std::bitset<64>(s.slots.live[static_cast<std::size_t>(p * words + w)]).count());
      if (live == static_cast<int>(j - i)) empty.push_back(static_cast<std::int32_t>(p));
      i = j;
    }
    if (!empty.empty()) {  // rare: the general path (it copies the map before changing it)
      // The mirror already marks these slots: re-uploaded from the first of them if that path throws.
      s.device_positions = std::min(s.device_positions, slots.front());
      std::vector<std::int64_t> positions;
      positions.reserve(slots.size());
      for (const std::int64_t slot : slots) positions.push_back(s.slots.position[static_cast<std::size_t>(slot)]);
      evict_positions(seq, span<const std::int64_t>(positions.data(), static_cast<std::int64_t>(positions.size())), false);
      return;
    }
    for (const std::int64_t slot : slots) s.slots.evict(slot, page);  // cannot throw
  }

  /// After a write of `written` tokens to each of `seqs` (committed): a keep-less selector's
  /// evictions, then its compaction cadence. Runs after the write's commit: a failure here (an
  /// allocation) leaves the written tokens stored and the evictions to the next write. A selector
  /// that reads token scores on backend::cuda ranks the whole batch's evictions in one pass on the
  /// device (`selection().lowest_scored`), where the scores are; the others rank on the host.
  void after_write(span<const sequence_id> seqs, std::int64_t written) {
    if constexpr (selector_traits<Selector>::evicts) {
      if constexpr (records_scores && rows_on_device) {
        using stage = typename engine_type::selection_type;
        std::vector<typename stage::ranking> rankings;
        std::vector<sequence_id> ranked;
        for (std::int64_t b = 0; b < seqs.size(); ++b) {
          sequence_state& s = state_of(seqs(b));
          const score_eviction quota = selector_traits<Selector>::eviction_quota(selector_of(s), s.selector_state, s.seen,
                                                                                 s.seen - tail_rows(s), s.stored - s.slots.dead);
          if (quota.count <= 0) continue;
          upload_positions(s, slot_of(seqs(b)));
          rankings.push_back({slot_of(seqs(b)), static_cast<std::int64_t>(s.slots.position.size()), sink_rows(format_),
                              quota.before, quota.count});
          ranked.push_back(seqs(b));
        }
        const std::vector<std::vector<std::int64_t>> chosen =
            rankings.empty() ? std::vector<std::vector<std::int64_t>>{} : engine_.selection().lowest_scored(rankings, engine_.stream());
        for (std::int64_t b = 0, i = 0; b < seqs.size(); ++b) {  // each sequence evicts, then compacts, in batch order
          if (i < static_cast<std::int64_t>(ranked.size()) && ranked[static_cast<std::size_t>(i)] == seqs(b))
            evict_slots(seqs(b), chosen[static_cast<std::size_t>(i++)]);
          if (selector_traits<Selector>::compaction_due(selector_, state_of(seqs(b)).selector_state, written)) compact(seqs(b));
        }
      } else {
        for (std::int64_t b = 0; b < seqs.size(); ++b) {
          sequence_state& s = state_of(seqs(b));
          const eviction_view view{s.stored - s.slots.dead, s.slots.position.data(),
                                   static_cast<std::int64_t>(s.slots.position.size()), sink_rows(format_)};
          const std::vector<std::int64_t> dead =
              selector_traits<Selector>::evictions(selector_of(s), s.selector_state, s.seen, s.seen - tail_rows(s), view);
          if (!dead.empty())
            evict_positions(seqs(b), span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())), true);
          if (selector_traits<Selector>::compaction_due(selector_, s.selector_state, written)) compact(seqs(b));
        }
      }
    }
  }

 public:

  /// A compaction pass over `seq` with the cache's compactor (`compact::repack`,
  /// `compact::hole_fill`): survivors move (memory/compaction_plan.hpp), the pages the pass empties
  /// go back to the pool at once, and the position map follows. Pages shared with another sequence
  /// (reference count above one), and every page before the last of them, are neither moved nor
  /// freed; nor, for a format that re-encodes what it moves, is any page up to the last one it has
  /// re-encoded as often as it allows (format::quant2's `max_reencodes`). Returns what the pass
  /// did. Cost: the plan, O(slots) on the host, and the engine's moves: a decode of every page a
  /// move touches and an encode of every page it writes (formats that encode pages compress the
  /// moved rows again: see the format's docs for what that does to its error).
  template <class C = Compactor>
  compaction_report compact(sequence_id seq) {
    static_assert(compactor_traits<C>::frees_memory, "kvmosaic::cache::compact: compact::none frees nothing");
    sequence_state& s = live(seq, "cache::compact");
    const int page = config_.page_size;
    // Frozen: every page up to the last one another sequence holds too (a fork's shared pages lead
    // the block table, but an eviction that drops a page can leave a page held alone before them),
    // and, for formats that re-encode what they move, up to the last one re-encoded as often as the
    // format allows.
    std::int32_t frozen = 0;
    for (std::size_t i = 0; i < s.pages.size(); ++i)
      if (pool_.ref_count(s.pages[i]) > 1) frozen = static_cast<std::int32_t>(i) + 1;
    constexpr bool reencodes = detail::reencodes_moved_rows_v<Format>;
    if constexpr (reencodes) {
      const int limit = detail::reencoding<Format>::limit(format_);
      for (std::size_t i = s.slots.reencoded.size(); i-- > 0;)
        if (s.slots.reencoded[i] >= limit) {
          frozen = std::max(frozen, static_cast<std::int32_t>(i) + 1);
          break;
        }
    }
    const std::int64_t round_start = std::max<std::int64_t>(s.slots.round_start, static_cast<std::int64_t>(frozen) * page);
    const detail::compaction_plan plan = compactor_traits<C>::plan(compactor_, s.slots.position, page, round_start, frozen);
    detail::slot_positions next;  // the map afterwards (allocates: before anything changes)
    next.reserve(static_cast<std::size_t>(plan.pages_kept), page);
    next.seal(static_cast<std::size_t>(plan.pages_kept), 0, page);
    for (std::size_t slot = 0; slot < plan.positions.size(); ++slot) {
      next.position[slot] = plan.positions[slot];
      if (plan.positions[slot] < 0) next.evict(static_cast<std::int64_t>(slot), page);
    }
    next.round_start = static_cast<std::int64_t>(plan.pages_kept) * page;
    std::copy_n(s.slots.reencoded.begin(), plan.pages_kept, next.reencoded.begin());  // the kept pages stay where they are
    if (reencodes)
      for (const std::int32_t i : plan.pages_written) {
        std::uint8_t& count = next.reencoded[static_cast<std::size_t>(i)];
        count = static_cast<std::uint8_t>(std::min(count + 1, 255));
      }
    engine_.move_slots(slot_of(seq), s.pages, plan, !s.pages.empty() && frozen == 0 && sink_rows(format_) > 0);
    for (const detail::slot_move& m : plan.moves) s.device_positions = std::min({s.device_positions, m.from, m.to});
    s.device_positions = std::min(s.device_positions, static_cast<std::int64_t>(plan.positions.size()));
    // Commit (cannot throw): emptied pages go back to the pool.
    for (std::size_t i = static_cast<std::size_t>(plan.pages_kept); i < s.pages.size(); ++i) pool_.release(s.pages[i]);
    s.pages.resize(static_cast<std::size_t>(plan.pages_kept));
    s.stored -= static_cast<std::int64_t>(plan.pages_freed) * page;
    s.slots = std::move(next);
    return plan.report(detail::reencodes_moved_rows_v<Format>);
  }
  /// `compact(seq)` for every live sequence; the reports summed.
  template <class C = Compactor>
  compaction_report compact() {
    compaction_report total;
    for (std::size_t i = 0; i < sequences_.size(); ++i)
      if (sequences_[i].live)
        total += compact<C>(static_cast<sequence_id>(static_cast<std::int64_t>(sequences_[i].generation) * config_.max_sequences +
                                                     static_cast<std::int64_t>(i)));
    return total;
  }

  /// The logical position of each sealed slot of `seq` (block-table order, -1 for an evicted
  /// token), then its tail rows' positions: what position-dependent code (RoPE, prefix hashing)
  /// reads once a compaction has moved tokens.
  template <class C = Compactor>
  std::vector<std::int64_t> positions(sequence_id seq) const {
    static_assert(compactor_traits<C>::frees_memory,
                  "kvmosaic::cache::positions: without a compactor that frees memory, slot i holds position i");
    const sequence_state& s = live(seq, "cache::positions");
    std::vector<std::int64_t> out = s.slots.position;
    for (std::int64_t p = s.seen - tail_rows(s); p < s.seen; ++p) out.push_back(p);
    return out;
  }

  /// Tokens the sequence has been given: the position of its next token. Eviction and compaction
  /// do not change it.
  std::int64_t length(sequence_id seq) const { return live(seq, "cache::length").seen; }
  /// Tokens the sequence holds in its slots (its sealed pages' rows, dead ones included until a
  /// compaction reclaims them, and its tail rows); `length` when nothing was evicted.
  std::int64_t stored_tokens(sequence_id seq) const { return live(seq, "cache::stored_tokens").stored; }

  /// Reads back the K and V a sequence holds, decoded, for inspection and tests: `k`, `v` are
  /// [stored_tokens(seq)][num_kv_heads][head_dim] in host memory, float, half or bfloat16 with any
  /// strides (on every backend). Row i is slot i of the sequence (its sealed pages' rows in
  /// block-table order, then its tail rows) as attention reads it: the format's host decode of
  /// each page (`format_traits::decode_k/v`: format::dense the stored rows, format::bitmap_tiles
  /// the pruned rows with zeros where pruned, format::quant2 the dequantized codes, min + scale *
  /// code), the exact rows (sink tokens and the recent window, `sink_tokens` / `recent_tokens`)
  /// from their 16-bit copies, the tail rows as stored. Evicted slots hold whatever their page
  /// decodes to (`positions(seq)` maps slots to positions). Values are converted to T (exact unless T is narrower than the storage dtype or
  /// the decode). On backend::cuda the page and tail bytes are copied to the host after the work
  /// on the engine's stream (which this synchronizes: not inside a graph capture) and decoded
  /// there with the same host decode, so both backends read the same values from the same bytes.
  /// Cost: one copy and one decode of each page of the sequence (in chunks of 64 pages), plus its
  /// tail slot; O(stored_tokens x num_kv_heads x head_dim). Throws `invalid_argument` for a
  /// dead handle or views of the wrong extents; writes nothing then.
  template <class T>
  void read(sequence_id seq, tensor_view<T, 3> k, tensor_view<T, 3> v) const {
    static_assert(detail::is_io_type<T>::value,
                  "kvmosaic::cache::read: k and v hold float, kvmosaic::half or kvmosaic::bfloat16 (not const)");
    const char* where = "cache::read";
    const sequence_state& s = live(seq, where);
    detail::require(k.extent(0) == s.stored, where, "k.extent(0) (tokens)", k.extent(0), "stored_tokens(seq)");
    detail::require(k.extent(1) == config_.num_kv_heads, where, "k.extent(1) (kv heads)", k.extent(1),
                    "cache_config::num_kv_heads");
    detail::require(k.extent(2) == config_.head_dim, where, "k.extent(2) (head_dim)", k.extent(2), "cache_config::head_dim");
    detail::require(v.extent(0) == k.extent(0) && v.extent(1) == k.extent(1) && v.extent(2) == k.extent(2), where,
                    "v.extents", "mismatch", "the extents of k");
    check_view(where, "k", k);
    check_view(where, "v", v);
    detail::require(!detail::views_overlap(k, v), where, "v", "overlapping k", "an array that shares no element with k");
    if (s.stored == 0) return;
    using dense_traits = format_traits<format::dense>;
    const detail::arena_geometry& g = engine_.geometry();
    const page_shape shape{config_.page_size, config_.head_dim, config_.storage};
    const int p = config_.page_size, d = config_.head_dim;
    std::vector<float> rows(static_cast<std::size_t>(p) * d);
    // Rows [from, to) of `rows` into out[first + t][h].
    const auto put = [&](const tensor_view<T, 3>& out, std::int64_t first, int h, int from, int to) {
      for (int t = from; t < to; ++t)
        for (int c = 0; c < d; ++c) out(first + t, h, c) = T(rows[static_cast<std::size_t>(t) * d + c]);
    };
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * p;
    const std::int64_t exact = g.exact_rows_held(sealed);  // sinks and window: read from their copies
    const std::size_t chunk = std::min<std::size_t>(64, s.pages.size());
    if (chunk > 0) {
      detail::host_buffer bytes(chunk * engine_.page_slot_bytes());
      for (std::size_t first = 0; first < s.pages.size(); first += chunk) {
        const std::size_t n = std::min(chunk, s.pages.size() - first);
        engine_.copy_pages_out(s.pages.data() + first, n, bytes.data());
        for (std::size_t i = 0; i < n; ++i) {
          const std::byte* slot = bytes.data() + i * engine_.page_slot_bytes();
          const auto row0 = static_cast<std::int64_t>(first + i) * p;
          for (int h = 0; h < config_.num_kv_heads; ++h)
            for (const bool is_v : {false, true}) {
              if constexpr (has_segments_v<Format>) {  // in the page's segment: the engine keeps them
                engine_.decode_page(slot_of(seq), static_cast<std::int64_t>(first + i), h, is_v,
                                    slot + (is_v ? g.v_page_offset(h) : g.k_page_offset(h)), p, rows.data());
              } else if (is_v) {
                format_traits<Format>::decode_v(format_, shape, slot + g.v_page_offset(h), p, rows.data());
              } else {
                format_traits<Format>::decode_k(format_, shape, slot + g.k_page_offset(h), p, rows.data());
              }
              for (int t = 0; t < p; ++t)
                if (exact == 0 || !g.exact_position(row0 + t, sealed)) put(is_v ? v : k, row0, h, t, t + 1);
            }
        }
      }
    }
    const int tail = tail_rows(s);
    if (tail == 0 && exact == 0) return;
    detail::host_buffer tail_bytes(g.tail_slot_bytes());
    engine_.copy_tail_out(slot_of(seq), tail_bytes.data());
    for (int h = 0; h < config_.num_kv_heads; ++h)
      for (const bool is_v : {false, true}) {
        const std::byte* head = tail_bytes.data() + g.tail_offset(is_v, h);
        const tensor_view<T, 3>& out = is_v ? v : k;
        for (std::int64_t t = 0; t < sealed && exact > 0; ++t) {
          if (!g.exact_position(t, sealed)) continue;
          dense_traits::decode_k(format::dense{}, shape, head + g.exact_row_of(t) * g.row_bytes, 1, rows.data());
          put(out, t, h, 0, 1);
        }
        if (tail > 0) {
          dense_traits::decode_k(format::dense{}, shape, head + g.tail_row_offset(), tail, rows.data());
          put(out, sealed, h, 0, tail);
        }
      }
  }
  /// The attention the last W = `queries.extent(0)` positions of `seq` pay each earlier token: an
  /// observation window's votes (SnapKV; `select::snapkv`'s snapshot ranks by them, and any
  /// window-based policy may). For each position t < length(seq) - W that holds a live token and
  /// each KV head h,
  ///
  ///     vote(t, h) = sum over w < W of combine over the group's query heads j of softmax_w,j(t)
  ///
  /// where window query w (position length - W + w) attends causally to every live token the
  /// sequence stores up to its own position, as attention reads them. `queries`:
  /// [W][num_q_heads][head_dim] in host memory (float, half or bfloat16); softmax_scale 0 means
  /// 1 / sqrt(head_dim). Returns [length - W][num_kv_heads] by position, -inf where no live token
  /// is.
  ///
  /// On backend::cuda over a format whose split kernels write exact logits, in a cache whose
  /// selector reads window votes (format::dense or bitmap_tiles with select::snapkv:
  /// `engine_type::computes_window_votes`), the votes are computed on the device, in fp32: decode
  /// steps of up to 8 copies of the sequence write each row's logits, a kernel takes each query's
  /// causal log-sum-exp and another sums the probabilities (`cuda::engine::window_votes`); 4 bytes
  /// per row and KV head come back. This invalidates the last plan and may grow the step buffers
  /// (re-capture a graph of `run` after it). Elsewhere the keys are read back (`read`) and scored
  /// on the host in fp64, one pass over them per window query and query head (no W x N matrix).
  /// Throws `invalid_argument`, before anything changes, for a dead handle, W < 1 or longer than
  /// the sequence, or queries of the wrong extents.
  template <class Q>
  std::vector<double> window_votes(sequence_id seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f,
                                   group_combine combine = group_combine::sum) {
    static_assert(detail::is_io_type<std::remove_const_t<Q>>::value,
                  "kvmosaic::cache::window_votes: queries hold float, kvmosaic::half or kvmosaic::bfloat16");
    const char* where = "cache::window_votes";
    const sequence_state& s = live(seq, where);
    const std::int64_t window = queries.extent(0);
    detail::require(window >= 1 && window <= s.seen, where, "queries.extent(0) (window)", window,
                    "1 to length(seq): the window's tokens must be stored");
    detail::require(queries.extent(1) == config_.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                    "num_kv_heads x group_size");
    detail::require(queries.extent(2) == config_.head_dim, where, "queries.extent(2) (head_dim)", queries.extent(2),
                    "cache_config::head_dim");
    detail::require(softmax_scale >= 0.0f && std::isfinite(softmax_scale), where, "softmax_scale", softmax_scale,
                    "a finite value >= 0 (0: 1/sqrt(head_dim))");
    check_view(where, "queries", queries);
    const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
    const std::int64_t window_start = s.seen - window;
    const int heads = config_.num_kv_heads, group = config_.group_size, d = config_.head_dim;
    if constexpr (engine_type::computes_window_votes) {
      std::vector<float> q(static_cast<std::size_t>(window) * heads * group * d);
      for (std::int64_t w = 0; w < window; ++w)
        for (int j = 0; j < heads * group; ++j)
          for (int c = 0; c < d; ++c) q[(static_cast<std::size_t>(w) * heads * group + j) * d + c] = to_float(queries(w, j, c));
      const std::vector<std::int64_t> rows = read_order_positions(s);
      const std::uint64_t* live_rows = nullptr;
      if constexpr (evicts_tokens) live_rows = s.slots.dead > 0 ? s.slots.live.data() : nullptr;
      const std::vector<float> votes = engine_.window_votes(detail::sequence_ref{&s.pages, s.stored, slot_of(seq), live_rows},
                                                            q.data(), static_cast<int>(window), rows, window_start, scale,
                                                            combine);
      std::vector<double> out(static_cast<std::size_t>(window_start) * heads, -std::numeric_limits<double>::infinity());
      for (std::size_t r = 0; r < rows.size(); ++r) {
        if (rows[r] < 0 || rows[r] >= window_start) continue;
        for (int h = 0; h < heads; ++h)
          out[static_cast<std::size_t>(rows[r]) * heads + h] = votes[static_cast<std::size_t>(h) * rows.size() + r];
      }
      return out;
    } else {
      std::vector<std::int64_t> positions(static_cast<std::size_t>(s.stored));
      if constexpr (evicts_tokens) {
        positions = this->positions(seq);
      } else {
        for (std::int64_t i = 0; i < s.stored; ++i) positions[static_cast<std::size_t>(i)] = i;
      }
      std::vector<float> k(static_cast<std::size_t>(s.stored) * heads * d), v(k.size());
      read(seq, tensor_view<float, 3>(k.data(), s.stored, heads, d), tensor_view<float, 3>(v.data(), s.stored, heads, d));
      const auto key = [&](std::int64_t i, int h, int c) { return k[(static_cast<std::size_t>(i) * heads + h) * d + c]; };
      const auto query = [&](int w, int j, int c) { return static_cast<double>(to_float(queries(w, j, c))) * scale; };
      return detail::window_votes(key, positions, query, window_start, static_cast<int>(window), heads, group, d, combine);
    }
  }

  /// A selector that reads token scores (select::tova, select::h2o): the scores of `seq`,
  /// [position][num_kv_heads] for every position it has held (select/token_scores.hpp; evicted
  /// positions keep their last value). On backend::cuda they are copied from the device (this
  /// waits for the engine's stream). Cost: 4 bytes per position and KV head.
  std::vector<float> token_scores(sequence_id seq) const {
    static_assert(records_scores, "kvmosaic::cache::token_scores: this cache's selector reads no token scores "
                                  "(select::tova and select::h2o do)");
    const sequence_state& s = live(seq, "cache::token_scores");
    const detail::token_score_buffer& buffer = selector_traits<Selector>::scores(s.selector_state);
    if constexpr (rows_on_device) return engine_.selection().scores(slot_of(seq), buffer.tokens(), engine_.stream());
    else return buffer.values;
  }

  /// The page ids of a sequence's full pages, in order.
  const block_table& pages(sequence_id seq) const { return live(seq, "cache::pages").pages; }

  /// Memory of one sequence as if it were alone (its pages counted in full, shared or not).
  memory_stats sequence_memory(sequence_id seq) const {
    const sequence_state& s = live(seq, "cache::sequence_memory");
    memory_stats m = pool_gauge();
    m.tokens = s.stored;
    m.stored_bytes = static_cast<std::int64_t>(s.pages.size()) * page_bytes() +
                     (tail_rows(s) + exact_rows_of(s)) * tail_row_bytes() + selector_bytes(s) + segment_bytes(s);
    m.dense_bytes = s.stored * tail_row_bytes();
    return m;
  }

  /// Memory of the whole cache: every pool page in use once, plus every live tail.
  memory_stats memory() const {
    memory_stats m = pool_gauge();
    m.stored_bytes = static_cast<std::int64_t>(m.pages_used) * page_bytes();
    for (const sequence_state& s : sequences_) {
      if (!s.live) continue;
      m.tokens += s.stored;
      m.stored_bytes += (tail_rows(s) + exact_rows_of(s)) * tail_row_bytes() + selector_bytes(s) + segment_bytes(s);
      m.dense_bytes += s.stored * tail_row_bytes();
    }
    return m;
  }

 private:
  struct sequence_state {
    bool live = false;
    std::uint32_t generation = 0;  ///< of the slot: bumped by each removal (stale handles)
    std::int64_t stored = 0;  ///< slots in use: the sealed pages' rows and the tail rows
    std::int64_t seen = 0;    ///< tokens given: the next token's position
    block_table pages;
    detail::slot_positions slots;  ///< caches whose compactor frees memory: per sealed slot, its position
    typename selector_traits<Selector>::sequence_state selector_state;  ///< the selector's, per sequence
    selection_stats last_selection;
    /// The previous selected step's ranges per KV head (for reuse).
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> selected;
    /// Sealed slots whose positions the device mirror holds as `slots.position` does (backend::cuda
    /// with a selector that reads token scores: its stage's `upload_positions`).
    std::int64_t device_positions = 0;
    select::token_budget budget;  ///< a keep-less selector's budget for this sequence, when `own_budget`
    bool own_budget = false;
  };

  /// The selector as it applies to `s`: a copy of the cache's, with the sequence's own budget when
  /// it has one. Cost: one copy of the selector (a few scalars) per write and sequence.
  Selector selector_of(const sequence_state& s) const {
    Selector copy = selector_;
    if constexpr (detail::has_token_budget<Selector>::value)
      if (s.own_budget) copy.budget = s.budget;
    return copy;
  }

  /// Bytes of one pool page, with the key bounds a selector keeps per page.
  std::int64_t page_bytes() const {
    return static_cast<std::int64_t>(engine_.page_slot_bytes() + engine_.page_bounds_bytes());
  }
  /// Bytes the selector keeps for a sequence (e.g. key bounds of its spans).
  std::int64_t selector_bytes(const sequence_state& s) const {
    return selector_traits<Selector>::extra_bytes(selector_shape_of(), s.selector_state);
  }
  /// Bytes the format keeps per sequence besides pages and tail: the segments' bases of a format
  /// with segments (format::packed_bitmap), else 0.
  std::int64_t segment_bytes(const sequence_state& s) const {
    if constexpr (has_segments_v<Format>) return static_cast<std::int64_t>(engine_.segment_bytes(static_cast<std::int64_t>(s.pages.size())));
    else return 0;
  }
  /// What the selector's hooks know of this cache.
  selector_shape selector_shape_of() const noexcept {
    return selector_shape{config_.num_kv_heads, config_.head_dim, config_.page_size, config_.storage};
  }
  /// The backend keeps K and V rows in device memory (backend::cuda): the selector's hooks then
  /// leave work on the keys to the engine.
  static constexpr bool rows_on_device = !std::is_same<Backend, backend::host>::value;
  /// The compactor frees memory: the cache keeps each sequence's position map and can evict.
  static constexpr bool evicts_tokens = compactor_traits<Compactor>::frees_memory;
  /// The selector reads the attend path's token scores (select::tova, select::h2o).
  static constexpr bool records_scores = detail::token_scores_of<Selector>::value != score_use::none;

  /// Brings the device mirror of `s`'s position map up to date (backend::cuda, a selector that
  /// reads token scores): the slots from the first one changed since the last upload. Cost: 8
  /// bytes per slot copied; a decode step copies only what sealing and evictions changed.
  void upload_positions(sequence_state& s, std::int32_t slot) {
    const auto slots = static_cast<std::int64_t>(s.slots.position.size());
    if (s.device_positions < slots)
      engine_.selection().upload_positions(slot, s.slots.position.data(), s.device_positions, slots, engine_.stream());
    s.device_positions = slots;
  }

  /// The logical position of each row of a sequence's read order on backend::cuda (its sealed
  /// pages' rows in block-table order, then its exact rows' run, then its tail rows): -1 for an
  /// evicted row and for a page row attended from its exact copy (sinks, recent window).
  /// Cost: O(rows).
  std::vector<std::int64_t> read_order_positions(const sequence_state& s) const {
    const auto& geometry = engine_.geometry();
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
    const std::int64_t exact = geometry.exact_rows_held(sealed);
    std::vector<std::int64_t> out(static_cast<std::size_t>(sealed + exact + tail_rows(s)));
    for (std::int64_t r = 0; r < sealed; ++r) {
      std::int64_t position = r;
      if constexpr (evicts_tokens) position = s.slots.position[static_cast<std::size_t>(r)];
      out[static_cast<std::size_t>(r)] = exact > 0 && geometry.exact_position(r, sealed) ? -1 : position;
    }
    geometry.exact_run_positions(sealed, out.data() + sealed);
    const std::int64_t tail_from = s.seen - tail_rows(s);
    for (std::int64_t t = 0; t < tail_rows(s); ++t) out[static_cast<std::size_t>(sealed + exact + t)] = tail_from + t;
    return out;
  }

  /// Tokens of [from, to) inside the union of `ranges` (which may overlap: each token counts once).
  static std::int64_t overlap(std::int64_t from, std::int64_t to, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) {
    std::vector<std::pair<std::int64_t, std::int64_t>> hits;
    for (const auto& [a, z] : ranges)
      if (std::max(a, from) < std::min(z, to)) hits.emplace_back(std::max(a, from), std::min(z, to));
    std::sort(hits.begin(), hits.end());
    std::int64_t total = 0, reach = from;
    for (const auto& [a, z] : hits) {
      const std::int64_t start = std::max(a, reach);
      if (z > start) total += z - start;
      reach = std::max(reach, z);
    }
    return total;
  }

  /// After a selected step: each sequence's stats, and its reuse of the previous step's selection.
  void record_selection(span<const sequence_id> seqs) {
    if constexpr (std::is_same<Backend, backend::host>::value) record_host_selection(seqs);
  }
  void record_host_selection(span<const sequence_id> seqs) {
    const auto& heads = engine_.last_selection();
    const int num_heads = config_.num_kv_heads;
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      sequence_state& s = state_of(seqs(b));
      selection_stats stats;
      double reused = 0, previous = 0;
      // Always read: the sink rows, and everything from the selector's always-read region (or the
      // tail) on.
      const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
      const std::int64_t always_from = selector_traits<Selector>::always_from(s.selector_state, sealed);
      const std::int64_t sinks = s.pages.empty() ? 0 : static_cast<std::int64_t>(sink_rows(format_));
      const std::int64_t window_from = sealed - window_rows(format_);
      std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> current(static_cast<std::size_t>(num_heads));
      for (int h = 0; h < num_heads; ++h) {
        const detail::head_selection& e = heads[static_cast<std::size_t>(b * num_heads + h)];
        stats.tokens_selected += static_cast<double>(e.tokens_selected) / num_heads;
        stats.tokens_read += static_cast<double>(e.tokens_read) / num_heads;
        stats.pages_read += static_cast<double>(e.pages_read) / num_heads;
        current[static_cast<std::size_t>(h)] = e.selected;
        if (s.selected.empty()) continue;
        std::vector<std::pair<std::int64_t, std::int64_t>> read = e.selected;
        if (sinks > 0) read.emplace_back(0, sinks);
        read.emplace_back(std::min(always_from, window_from), std::numeric_limits<std::int64_t>::max());
        for (const auto& [from, to] : s.selected[static_cast<std::size_t>(h)]) {
          previous += static_cast<double>(to - from);
          reused += static_cast<double>(overlap(from, to, read));
        }
      }
      if (!s.selected.empty()) stats.reuse = previous > 0 ? reused / previous : 1.0;
      s.last_selection = stats;
      s.selected = std::move(current);
    }
  }

  static cache_config validated(const cache_config& config, const Format& format, const Selector& selector) {
    config.validate();
    format_traits<Format>::validate(format, page_shape{config.page_size, config.head_dim, config.storage});
    // The recent window's ring is indexed by position, which a compaction's moves break.
    detail::require(!compactor_traits<Compactor>::frees_memory || window_rows(format) == 0,
                    (std::string(format_traits<Format>::name) + " with compact::" + compactor_traits<Compactor>::name).c_str(),
                    "recent_tokens", window_rows(format), "0 with a compactor that frees memory (evicted caches keep no exact window)");
    selector_traits<Selector>::validate(selector, config.page_size);
    return config;
  }
  static std::vector<sequence_state> sequence_slots(const cache_config& c) {
    try {
      return std::vector<sequence_state>(static_cast<std::size_t>(c.max_sequences));
    } catch (const std::bad_alloc&) {
      throw capacity_error("max_sequences", "kvmosaic: cache: cannot allocate the state of " +
                                                std::to_string(c.max_sequences) +
                                                " sequences; allowed: a max_sequences that fits in host memory");
    }
  }
  static detail::engine_shape engine_shape(const cache_config& c) {
    return detail::engine_shape{c.num_kv_heads, c.group_size, c.head_dim, c.page_size,
                                c.storage,      c.max_pages,  c.max_sequences};
  }

  // A handle is slot + max_sequences * generation (sequence_id's comment).
  std::int32_t slot_of(sequence_id seq) const noexcept { return seq % config_.max_sequences; }
  sequence_state& state_of(sequence_id seq) noexcept { return sequences_[static_cast<std::size_t>(slot_of(seq))]; }
  const sequence_state& state_of(sequence_id seq) const noexcept {
    return sequences_[static_cast<std::size_t>(slot_of(seq))];
  }

  const sequence_state& live(sequence_id seq, const char* where) const {
    detail::require(seq >= 0, where, "seq", seq, "an id returned by add_sequence or fork_sequence and not removed");
    const sequence_state& s = state_of(seq);
    detail::require(s.live && static_cast<std::uint32_t>(seq / config_.max_sequences) == s.generation, where, "seq", seq,
                    "an id returned by add_sequence or fork_sequence and not removed (this one was removed, "
                    "or never handed out)");
    return s;
  }
  sequence_state& live(sequence_id seq, const char* where) {
    return const_cast<sequence_state&>(static_cast<const cache&>(*this).live(seq, where));
  }

  /// A slot with no live sequence, or `capacity_error`.
  std::int32_t free_slot(const char* where) const {
    for (std::size_t i = 0; i < sequences_.size(); ++i)
      if (!sequences_[i].live) return static_cast<std::int32_t>(i);
    throw capacity_error("max_sequences", std::string("kvmosaic: ") + where + ": all " +
                                              std::to_string(config_.max_sequences) +
                                              " sequence slots are in use; allowed: at most "
                                              "cache_config::max_sequences live sequences");
  }
  /// Makes `state` the live sequence of `slot` (cannot throw) and returns its handle.
  sequence_id activate(std::int32_t slot, sequence_state&& state) noexcept {
    sequence_state& s = sequences_[static_cast<std::size_t>(slot)];
    state.generation = s.generation;
    state.live = true;
    s = std::move(state);
    return static_cast<sequence_id>(static_cast<std::int64_t>(s.generation) * config_.max_sequences + slot);
  }

  /// Rejects a view whose extents are negative, or that has elements but no data.
  template <class T, int Rank>
  static void check_view(const char* where, const char* name, const tensor_view<T, Rank>& view) {
    bool empty = false;
    for (int d = 0; d < Rank; ++d) {
      detail::require(view.extent(d) >= 0, where, name, "an extent < 0", "extents >= 0");
      empty = empty || view.extent(d) == 0;
    }
    detail::require(empty || view.data() != nullptr, where, name, "null", "a non-null pointer to its elements");
  }

  int tail_rows(const sequence_state& s) const {
    return static_cast<int>(s.stored - static_cast<std::int64_t>(s.pages.size()) * config_.page_size);
  }
  /// Exact rows the format keeps besides the pages: the sinks and the recent window's ring, as far
  /// as the sealed tokens fill them (min(S + W, sealed tokens); none before the first seal).
  std::int64_t exact_rows_of(const sequence_state& s) const {
    const std::int64_t sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
    return s.pages.empty() ? 0 : std::min<std::int64_t>(exact_rows(format_), sealed);
  }
  /// Bytes of one token's K and V across all KV heads at 16 bits: the dense reference.
  std::int64_t tail_row_bytes() const {
    return 2 * static_cast<std::int64_t>(config_.num_kv_heads) * config_.head_dim * 2;
  }

  template <class T>
  void check_rows(const char* where, const tensor_view<const T, 3>& k, const tensor_view<const T, 3>& v) const {
    detail::require(k.extent(1) == config_.num_kv_heads, where, "k.extent(1) (kv heads)", k.extent(1),
                    "cache_config::num_kv_heads");
    detail::require(k.extent(2) == config_.head_dim, where, "k.extent(2) (head_dim)", k.extent(2),
                    "cache_config::head_dim");
    detail::require(v.extent(0) == k.extent(0) && v.extent(1) == k.extent(1) && v.extent(2) == k.extent(2), where,
                    "v.extents", "mismatch", "the extents of k");
    check_view(where, "k", k);
    check_view(where, "v", v);
  }

  /// Runs a backend write into freshly allocated pages. If it fails (an allocation or a CUDA
  /// error), the engine undoes what it wrote (`rollback`: the tail rows it overwrote, its pending
  /// selector updates), the pages go back to the pool and the bookkeeping is left untouched;
  /// otherwise the engine commits (`commit`, which cannot throw).
  template <class Write>
  void write_then_commit(const std::vector<page_id>& fresh, Write&& write) {
    try {
      write();
    } catch (...) {
      engine_.rollback();
      for (const page_id page : fresh) pool_.release(page);
      throw;
    }
    engine_.commit();
  }

  memory_stats pool_gauge() const {
    memory_stats m;
    m.pages_used = pool_.used_pages();
    m.pages_free = pool_.free_pages();
    return m;
  }

  cache_config config_;
  std::vector<sequence_id> planned_;  ///< the sequences of the last plan
  /// Generations a slot's handles run through before they wrap (sequence_id's comment).
  std::uint32_t generations_ = static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max() / config_.max_sequences);
  Format format_;
  Selector selector_;
  Compactor compactor_;
  page_pool pool_;
  engine_type engine_;
  std::vector<sequence_state> sequences_;
};

}  // namespace kvmosaic
