// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `cache<Format, select::per_kv_head<S>, Compactor, Backend>`: a cache whose KV heads keep
/// different tokens, with different budgets, and free their memory on their own. Each (sequence,
/// KV head) is a *lane*: a one-head sequence of an inner `cache<Format, S, Compactor, Backend>`
/// with `num_kv_heads = 1`, so a pool page is one head's `[K page][V page]` of P tokens and each
/// lane has its own block table, tail, scores, evictions and compactions. All lanes share the one
/// pool. A decode step runs the inner cache's kernels, unchanged, over batch x num_kv_heads lanes:
/// a [batch][num_q_heads][head_dim] query is the same memory as [batch x num_kv_heads][group]
/// [head_dim] (docs/architecture.md, "Per-KV-head eviction").
///
/// Cost against a cache of S: the same bytes per token; per step, num_kv_heads times as many
/// sequences to plan and stage (their block-table entries are as many in total: one per head page
/// instead of one per all-heads page); per write, one eviction decision per lane, ranked together
/// on backend::cuda. Memory: pool pages are head pages (`memory_stats::pages_used` and
/// `pages_free` count them), num_kv_heads x `cache_config::max_pages` of them.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/cache.hpp"
#include "kvmosaic/select/per_kv_head.hpp"

namespace kvmosaic {

namespace detail {

/// Whether dims 0 and 1 of `view` collapse into one: one row, or stride(0) == extent(1) x
/// stride(1) (a contiguous tensor's).
template <class T, int Rank>
bool first_dims_collapse(const tensor_view<T, Rank>& view) noexcept {
  return view.extent(0) <= 1 || view.stride(0) == view.extent(1) * view.stride(1);
}

/// `view`, [batch][heads x per][...] with dims 0 and 1 collapsible, as [batch x heads][per][...]:
/// lane b x heads + h is head h's `per` entries of row b. Collapsible: one row, or
/// stride(0) == heads x per x stride(1) (a contiguous tensor's). Throws `invalid_argument` naming
/// `name` otherwise.
template <class T, int Rank>
tensor_view<T, Rank> rows_by_head(const tensor_view<T, Rank>& view, int heads, const char* where, const char* name) {
  static_assert(Rank == 2 || Rank == 3, "kvmosaic::detail::rows_by_head: rank 2 or 3");
  const std::int64_t per = view.extent(1) / heads;
  detail::require(first_dims_collapse(view), where, name,
                  "strides whose first two dimensions do not collapse",
                  "stride(0) == extent(1) x stride(1), as a contiguous tensor's (a per_kv_head cache reads each KV "
                  "head's rows as a row of its own)");
  std::int64_t extents[Rank], strides[Rank];
  extents[0] = view.extent(0) * heads;
  strides[0] = per * view.stride(1);
  extents[1] = per;
  strides[1] = view.stride(1);
  if constexpr (Rank == 3) {
    extents[2] = view.extent(2);
    strides[2] = view.stride(2);
  }
  return tensor_view<T, Rank>::strided(view.data(), extents, strides);
}

/// Head `head` of `view`, [rows][heads][head_dim], as [rows][1][head_dim] (a strided view).
template <class T>
tensor_view<T, 3> one_head(const tensor_view<T, 3>& view, int head) {
  const std::int64_t extents[3] = {view.extent(0), 1, view.extent(2)};
  const std::int64_t strides[3] = {view.stride(0), view.stride(1), view.stride(2)};
  return tensor_view<T, 3>::strided(view.data() + static_cast<std::ptrdiff_t>(head) * view.stride(1), extents, strides);
}

}  // namespace detail

/// A cache of `select::per_kv_head<S>` (see the file comment). Its calls are the primary cache's,
/// with a KV head named where the heads' tokens differ (`evict`, `positions`, `stored_tokens`,
/// `read`, `token_scores`, `set_budget`); the rest take and return what the primary's do.
template <class FormatArg, class S, class CompactorArg, class BackendArg>
class cache<FormatArg, select::per_kv_head<S>, CompactorArg, BackendArg> {
  using traits = selector_traits<select::per_kv_head<S>>;

 public:
  /// The inner cache: one one-head sequence per (sequence, KV head).
  using lane_cache = cache<FormatArg, S, CompactorArg, BackendArg>;
  using format_type = typename lane_cache::format_type;
  using selector_type = select::per_kv_head<S>;
  using compactor_type = typename lane_cache::compactor_type;
  using backend_type = typename lane_cache::backend_type;
  using engine_type = typename lane_cache::engine_type;

  /// `config` as for any cache (its `max_pages` counts all-heads pages: the pool holds
  /// num_kv_heads head pages for each). Throws `invalid_argument` naming the field at fault.
  explicit cache(const cache_config& config, const format_type& format = {}, const selector_type& selector = {},
                 const compactor_type& compactor = {})
      : config_(checked(config, selector)),
        selector_(selector),
        lanes_(lane_config(config_), format, selector.selector, compactor),
        heads_of_(static_cast<std::size_t>(lane_config(config_).max_sequences)) {}

  const cache_config& config() const noexcept { return config_; }
  const format_type& format() const noexcept { return lanes_.format(); }
  const selector_type& selector() const noexcept { return selector_; }
  const compactor_type& compactor() const noexcept { return lanes_.compactor(); }
  const page_pool& pool() const noexcept { return lanes_.pool(); }
  /// The engine of every lane (on backend::cuda, its stream orders every step).
  const engine_type& engine() const noexcept { return lanes_.engine(); }
  engine_type& engine() noexcept { return lanes_.engine(); }
  /// The inner cache of one-head lanes (its sequences: `lanes(seq)`).
  const lane_cache& lanes() const noexcept { return lanes_; }
  lane_cache& lanes() noexcept { return lanes_; }
  /// The lanes of `seq`, one per KV head in head order: handles of `lanes()`.
  const std::vector<sequence_id>& lanes(sequence_id seq) const { return lanes_of(seq, "cache::lanes"); }

  /// "format/selector/compactor" with parameters, for reports.
  std::string describe() const {
    return format_traits<format_type>::describe(format()) + "/" + traits::describe(selector_) + "/" +
           compactor_traits<compactor_type>::describe(compactor());
  }

  /// Starts an empty sequence: one lane per KV head, each with its head's budget. Throws
  /// `capacity_error` when max_sequences are live; all or nothing.
  sequence_id add_sequence() {
    check_slots("cache::add_sequence");
    std::vector<sequence_id> lanes;
    lanes.reserve(static_cast<std::size_t>(config_.num_kv_heads));
    try {
      for (int h = 0; h < config_.num_kv_heads; ++h) {
        lanes.push_back(lanes_.add_sequence());
        lanes_.set_budget(lanes.back(), selector_.budget_of(h));
      }
    } catch (...) {
      for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
      throw;
    }
    return adopt(std::move(lanes));
  }
  /// Ends a sequence: every lane's pages go back to the pool (shared ones when their last holder ends).
  void remove_sequence(sequence_id seq) {
    std::vector<sequence_id>& entry = heads_of_[index_of(lanes_of(seq, "cache::remove_sequence"))];
    const std::vector<sequence_id> lanes = std::move(entry);
    entry.clear();
    for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
    --live_;
  }
  /// A new sequence sharing each lane's full pages (`cache::fork_sequence`, per lane); all or nothing.
  sequence_id fork_sequence(sequence_id seq) {
    const std::vector<sequence_id> parent = lanes_of(seq, "cache::fork_sequence");
    check_slots("cache::fork_sequence");
    std::vector<sequence_id> lanes;
    lanes.reserve(parent.size());
    try {
      for (const sequence_id lane : parent) lanes.push_back(lanes_.fork_sequence(lane));
    } catch (...) {
      for (const sequence_id lane : lanes) lanes_.remove_sequence(lane);
      throw;
    }
    return adopt(std::move(lanes));
  }

  /// `cache::prefill`: `k`, `v` [tokens][num_kv_heads][head_dim]; head h goes to lane h. All or
  /// nothing: the pages every head needs are counted first (`capacity_error` when the pool lacks
  /// them), and the first head checks the input for all.
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    const char* where = "cache::prefill";
    const std::vector<sequence_id>& lanes = lanes_of(seq, where);
    check_heads(where, "k", k.extent(1));
    check_heads(where, "v", v.extent(1));
    check_room(where, lanes, k.extent(0));
    for (int h = 0; h < config_.num_kv_heads; ++h)
      lanes_.prefill(lanes[static_cast<std::size_t>(h)], detail::one_head(k, h), detail::one_head(v, h));
  }
  /// `prefill` with the tokens' ids (`cache::prefill`'s overload: one per token; S reads none).
  template <class T>
  void prefill(sequence_id seq, tensor_view<const T, 3> k, tensor_view<const T, 3> v, span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == k.extent(0), "cache::prefill", "token_ids.size()", token_ids.size(),
                    "k.extent(0) (one id per token)");
    prefill(seq, k, v);
  }

  /// `cache::append`: one token per sequence, `k`, `v` [batch][num_kv_heads][head_dim]; all or
  /// nothing, as prefill. Every lane of the batch is written by one call of the inner cache (its
  /// evictions ranked together), or, when k's or v's first two dimensions do not collapse, one call
  /// per head.
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v) {
    const char* where = "cache::append";
    check_heads(where, "k", k.extent(1));
    check_heads(where, "v", v.extent(1));
    const std::vector<sequence_id> lanes = batch_lanes(seqs, where);
    check_room(where, lanes, 1);  // the fallback below writes head by head
    if (detail::first_dims_collapse(k) && detail::first_dims_collapse(v)) {
      lanes_.append(span<const sequence_id>(lanes.data(), static_cast<std::int64_t>(lanes.size())),
                    detail::rows_by_head(k, config_.num_kv_heads, where, "k"),
                    detail::rows_by_head(v, config_.num_kv_heads, where, "v"));
      return;
    }
    std::vector<sequence_id> of_head(static_cast<std::size_t>(seqs.size()));
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      for (std::size_t b = 0; b < of_head.size(); ++b) of_head[b] = lanes[b * config_.num_kv_heads + h];
      lanes_.append(span<const sequence_id>(of_head.data(), static_cast<std::int64_t>(of_head.size())), detail::one_head(k, h),
                    detail::one_head(v, h));
    }
  }

  /// `append` with each new token's id (`cache::append`'s overload: one per sequence; S reads none).
  template <class T>
  void append(span<const sequence_id> seqs, tensor_view<const T, 3> k, tensor_view<const T, 3> v,
              span<const std::int32_t> token_ids) {
    detail::require(token_ids.size() == seqs.size(), "cache::append", "token_ids.size()", token_ids.size(),
                    "seqs.size() (one id per sequence)");
    append(seqs, k, v);
  }

  /// `cache::plan` for `seqs`: plans their batch x num_kv_heads lanes.
  void plan(span<const sequence_id> seqs, const attend_params& params = {}) {
    std::vector<sequence_id> lanes = batch_lanes(seqs, "cache::plan");
    lanes_.plan(span<const sequence_id>(lanes.data(), static_cast<std::int64_t>(lanes.size())), params);
    planned_ = std::move(lanes);  // after the plan: a failed one leaves the last plan as it was
  }
  /// `cache::run`: q, out [batch][num_q_heads][head_dim], lse [batch][num_q_heads] (optional), whose
  /// first two dimensions collapse (a contiguous tensor's do), read as the lanes' [batch x
  /// num_kv_heads][group][...]. Throws `invalid_argument` naming the view that does not.
  template <class Q, class O>
  void run(tensor_view<Q, 3> q, tensor_view<O, 3> out, tensor_view<float, 2> lse = {}) {
    const char* where = "cache::run";
    const std::int64_t batch = static_cast<std::int64_t>(planned_.size()) / config_.num_kv_heads;
    detail::require(q.extent(0) == batch, where, "q.extent(0) (batch)", q.extent(0), "the batch of the last plan");
    detail::require(q.extent(1) == config_.num_q_heads(), where, "q.extent(1) (query heads)", q.extent(1),
                    "num_kv_heads * group_size");
    detail::require(out.extent(0) == q.extent(0) && out.extent(1) == q.extent(1) && out.extent(2) == q.extent(2), where,
                    "out.extents", "mismatch", "the extents of q");
    detail::require(lse.extent(0) == 0 || (lse.extent(0) == batch && lse.extent(1) == q.extent(1)), where, "lse.extents",
                    "mismatch", "empty, or [batch][num_q_heads]");
    const int heads = config_.num_kv_heads;
    const tensor_view<float, 2> lane_lse =
        lse.extent(0) == 0 ? tensor_view<float, 2>{} : detail::rows_by_head(lse, heads, where, "lse");
    lanes_.run(detail::rows_by_head(q, heads, where, "q"), detail::rows_by_head(out, heads, where, "out"), lane_lse);
  }
  /// `plan` then `run`.
  template <class Q, class O>
  void attend(span<const sequence_id> seqs, tensor_view<Q, 3> q, tensor_view<O, 3> out, const attend_params& params = {}) {
    plan(seqs, params);
    run(q, out);
  }
  /// `cache::reserve_step` for batches of up to `batch` sequences (batch x num_kv_heads lanes).
  void reserve_step(std::int32_t batch, std::int64_t max_tokens) {
    detail::require(batch >= 1 && batch <= config_.max_sequences, "cache::reserve_step", "batch", batch,
                    "1 to cache_config::max_sequences");
    lanes_.reserve_step(batch * config_.num_kv_heads, max_tokens);
  }

  /// Head `head`'s budget for `seq` from its next write on (Ada-KV-style reallocation between
  /// heads); `cache::set_budget(seq, budget)` of that lane.
  void set_budget(sequence_id seq, int head, const select::token_budget& budget) {
    lanes_.set_budget(lane(seq, head, "cache::set_budget"), budget);
  }
  /// Head `head`'s budget for `seq`.
  select::token_budget budget(sequence_id seq, int head) const { return lanes_.budget(lane(seq, head, "cache::budget")); }

  /// `cache::evict` of head `head` of `seq`: its tokens at `positions` leave that head only.
  void evict(sequence_id seq, int head, span<const std::int64_t> positions) {
    lanes_.evict(lane(seq, head, "cache::evict"), positions);
  }
  /// `cache::compact` of every lane of `seq`; the reports summed.
  compaction_report compact(sequence_id seq) {
    compaction_report total;
    for (const sequence_id lane : lanes_of(seq, "cache::compact")) total += lanes_.compact(lane);
    return total;
  }
  /// `compact(seq)` of every live sequence.
  compaction_report compact() { return lanes_.compact(); }

  /// `cache::positions` of head `head`: the logical position of each of its slots (-1 evicted).
  std::vector<std::int64_t> positions(sequence_id seq, int head) const {
    return lanes_.positions(lane(seq, head, "cache::positions"));
  }
  /// Tokens `seq` has been given (every head has been given the same).
  std::int64_t length(sequence_id seq) const { return lanes_.length(lanes_of(seq, "cache::length").front()); }
  /// Slots head `head` of `seq` holds (`cache::stored_tokens`).
  std::int64_t stored_tokens(sequence_id seq, int head) const {
    return lanes_.stored_tokens(lane(seq, head, "cache::stored_tokens"));
  }
  /// `cache::read` of head `head`: k, v [stored_tokens(seq, head)][1][head_dim].
  template <class T>
  void read(sequence_id seq, int head, tensor_view<T, 3> k, tensor_view<T, 3> v) const {
    lanes_.read(lane(seq, head, "cache::read"), k, v);
  }
  /// `cache::token_scores` of head `head`: [position] for every position it has held.
  std::vector<float> token_scores(sequence_id seq, int head) const {
    return lanes_.token_scores(lane(seq, head, "cache::token_scores"));
  }
  /// select::snapkv: a snapshot of every head, each voted by its own query heads' window queries
  /// ([window][num_q_heads][head_dim], as the primary's `snapshot`). Without `adaptive`, each head
  /// keeps its own budget (`cache::snapshot` of its lane); with it, Ada-KV's allocation
  /// (`select::per_kv_head::adaptive`): the heads evict as many tokens in all as their budgets
  /// ask, chosen together by pooled vote. Returns the tokens evicted, summed over the heads.
  /// Throws `invalid_argument`, before anything changes, for queries of the wrong extents or a
  /// window longer than the sequence.
  template <class Q, class Lanes = lane_cache>
  auto snapshot(sequence_id seq, tensor_view<const Q, 3> queries, float softmax_scale = 0.0f)
      -> decltype(std::declval<Lanes&>().snapshot(seq, queries, softmax_scale)) {
    const char* where = "cache::snapshot";
    const std::vector<sequence_id> lanes = lanes_of(seq, where);
    detail::require(queries.extent(1) == config_.num_q_heads(), where, "queries.extent(1) (query heads)", queries.extent(1),
                    "num_kv_heads x group_size");
    if (selector_.adaptive) return adaptive_snapshot(lanes, queries, softmax_scale);
    std::int64_t evicted = 0;
    for (int h = 0; h < config_.num_kv_heads; ++h)
      evicted += lanes_.snapshot(lanes[static_cast<std::size_t>(h)], query_heads_of(queries, h), softmax_scale);
    return evicted;
  }

  /// Memory of one sequence as if it were alone: its lanes' summed (pages are head pages).
  memory_stats sequence_memory(sequence_id seq) const {
    memory_stats total;
    for (const sequence_id lane : lanes_of(seq, "cache::sequence_memory")) {
      const memory_stats m = lanes_.sequence_memory(lane);
      total.tokens += m.tokens;
      total.stored_bytes += m.stored_bytes;
      total.dense_bytes += m.dense_bytes;
      total.pages_used = m.pages_used;
      total.pages_free = m.pages_free;
    }
    total.tokens /= config_.num_kv_heads;  // a token is one row of each head: its heads' mean
    return total;
  }
  /// Memory of the whole cache (`cache::memory` of the lanes; pages are head pages). `tokens` is
  /// the mean over the heads of the tokens each stores.
  memory_stats memory() const {
    memory_stats m = lanes_.memory();
    m.tokens /= config_.num_kv_heads;
    return m;
  }

 private:
  /// Head `head`'s query heads of `queries` ([window][num_q_heads][head_dim]): [window][group]
  /// [head_dim], a strided view.
  template <class Q>
  tensor_view<const Q, 3> query_heads_of(const tensor_view<const Q, 3>& queries, int head) const {
    const std::int64_t extents[3] = {queries.extent(0), config_.group_size, queries.extent(2)};
    const std::int64_t strides[3] = {queries.stride(0), queries.stride(1), queries.stride(2)};
    return tensor_view<const Q, 3>::strided(
        queries.data() + static_cast<std::ptrdiff_t>(head) * config_.group_size * queries.stride(1), extents, strides);
  }

  /// Ada-KV's allocation over SnapKV's pooled votes (`select::per_kv_head::adaptive`). Each head h
  /// scores its candidates (live tokens after the sinks, before the window and its open tail) by
  /// its pooled votes and would evict e_h = live_h - budget_h of them; the top
  /// floor(safeguard x (candidates_h - e_h)) of each head are kept whatever the others score (the
  /// safeguard), and of all the heads' other candidates the sum of the e_h lowest, ranked
  /// together (score, then position, then head; NaN highest), are evicted; then each head
  /// compacts. Cost: each head's window votes (as its snapshot), then O(N log N) on the host for
  /// N candidates in all.
  template <class Q>
  std::int64_t adaptive_snapshot(const std::vector<sequence_id>& lanes, const tensor_view<const Q, 3>& queries,
                                 float softmax_scale) {
    const char* where = "cache::snapshot";
    const select::snapkv& s = selector_.selector;
    const std::int64_t length = lanes_.length(lanes.front());
    detail::require(queries.extent(0) == s.window, where, "queries.extent(0) (window)", queries.extent(0),
                    "select::snapkv::window");
    detail::require(s.window <= length, where, "select::snapkv::window", s.window,
                    "at most length(seq): the window's tokens must be stored");
    const std::int64_t window_start = length - s.window;
    struct candidate {
      double score;
      std::int64_t position;
      int head;
      bool operator<(const candidate& o) const noexcept {
        if (score != o.score) return score < o.score;
        return position != o.position ? position < o.position : head < o.head;
      }
    };
    std::vector<candidate> pool;  // every head's candidates but its safeguarded ones
    std::int64_t to_evict = 0;
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      const sequence_id lane = lanes[static_cast<std::size_t>(h)];
      const std::vector<double> votes = lanes_.window_votes(lane, query_heads_of(queries, h), softmax_scale, s.combine);
      const std::vector<double> score = detail::snapkv_pool(votes, window_start, 1, s.pool_kernel);
      const std::int64_t open_from = length - lanes_.stored_tokens(lane) % config_.page_size;
      const detail::snapshot_candidates c =
          detail::candidates_of(lanes_.positions(lane), sink_rows(format()), std::min(window_start, open_from));
      const auto n = static_cast<std::int64_t>(c.positions.size());
      const std::int64_t evict = std::min(n, std::max<std::int64_t>(0, c.live - lanes_.budget(lane).resolve(length)));
      const auto safe = static_cast<std::int64_t>(std::floor(selector_.safeguard * static_cast<double>(n - evict)));
      std::vector<candidate> mine;
      mine.reserve(c.positions.size());
      for (const std::int64_t p : c.positions) {
        const double x = score[static_cast<std::size_t>(p)];
        mine.push_back({std::isnan(x) ? std::numeric_limits<double>::infinity() : x, p, h});
      }
      std::sort(mine.begin(), mine.end());
      pool.insert(pool.end(), mine.begin(), mine.end() - safe);  // the top `safe` stay
      to_evict += evict;
    }
    to_evict = std::min<std::int64_t>(to_evict, static_cast<std::int64_t>(pool.size()));
    std::partial_sort(pool.begin(), pool.begin() + to_evict, pool.end());
    std::vector<std::vector<std::int64_t>> dead(lanes.size());
    for (std::int64_t i = 0; i < to_evict; ++i)
      dead[static_cast<std::size_t>(pool[static_cast<std::size_t>(i)].head)].push_back(pool[static_cast<std::size_t>(i)].position);
    for (std::size_t h = 0; h < lanes.size(); ++h) {
      if (dead[h].empty()) continue;
      lanes_.evict(lanes[h], span<const std::int64_t>(dead[h].data(), static_cast<std::int64_t>(dead[h].size())));
      lanes_.compact(lanes[h]);
    }
    return to_evict;
  }

  static const cache_config& checked(const cache_config& config, const selector_type& selector) {
    config.validate();
    traits::validate(selector, config.num_kv_heads, config.page_size);
    const std::int64_t pages = static_cast<std::int64_t>(config.max_pages) * config.num_kv_heads;
    const std::int64_t sequences = static_cast<std::int64_t>(config.max_sequences) * config.num_kv_heads;
    detail::require(pages <= limits::max_pool_pages, "cache_config", "max_pages", config.max_pages,
                    "at most limits::max_pool_pages / num_kv_heads (a per_kv_head cache's pool holds head pages)");
    detail::require(sequences <= limits::max_sequences, "cache_config", "max_sequences", config.max_sequences,
                    "at most limits::max_sequences / num_kv_heads (a per_kv_head cache has a lane per head)");
    return config;
  }
  static cache_config lane_config(const cache_config& config) {
    cache_config lane = config;
    lane.num_kv_heads = 1;
    lane.max_pages = config.max_pages * config.num_kv_heads;
    lane.max_sequences = config.max_sequences * config.num_kv_heads;
    return lane;
  }

  std::size_t index_of(const std::vector<sequence_id>& lanes) const { return static_cast<std::size_t>(lanes_.slot(lanes.front())); }
  sequence_id adopt(std::vector<sequence_id>&& lanes) noexcept {
    const sequence_id seq = lanes.front();
    heads_of_[index_of(lanes)] = std::move(lanes);
    ++live_;
    return seq;
  }
  /// The lanes of a live sequence (its handle is its head-0 lane's), or `invalid_argument`.
  const std::vector<sequence_id>& lanes_of(sequence_id seq, const char* where) const {
    const auto slots = static_cast<std::int64_t>(heads_of_.size());
    const std::vector<sequence_id>* lanes = seq >= 0 ? &heads_of_[static_cast<std::size_t>(seq % slots)] : nullptr;
    detail::require(lanes != nullptr && !lanes->empty() && lanes->front() == seq, where, "seq", seq,
                    "an id returned by add_sequence or fork_sequence and not removed");
    return *lanes;
  }
  sequence_id lane(sequence_id seq, int head, const char* where) const {
    const std::vector<sequence_id>& lanes = lanes_of(seq, where);
    detail::require(head >= 0 && head < config_.num_kv_heads, where, "head", head, "0 to num_kv_heads - 1");
    return lanes[static_cast<std::size_t>(head)];
  }
  /// The lanes of a batch, sequence-major: lane b x num_kv_heads + h is head h of seqs[b].
  std::vector<sequence_id> batch_lanes(span<const sequence_id> seqs, const char* where) const {
    std::vector<sequence_id> lanes;
    lanes.reserve(static_cast<std::size_t>(seqs.size()) * static_cast<std::size_t>(config_.num_kv_heads));
    for (std::int64_t b = 0; b < seqs.size(); ++b) {
      const std::vector<sequence_id>& of = lanes_of(seqs(b), where);
      lanes.insert(lanes.end(), of.begin(), of.end());
    }
    return lanes;
  }
  /// `capacity_error` when max_sequences are live.
  void check_slots(const char* where) const {
    if (live_ < config_.max_sequences) return;
    throw capacity_error("max_sequences", std::string("kvmosaic: ") + where + ": all " + std::to_string(config_.max_sequences) +
                                              " sequence slots are in use; allowed: at most cache_config::max_sequences "
                                              "live sequences");
  }
  /// `capacity_error`, before anything changes, when writing `rows` more tokens to every lane of
  /// `lanes` seals more head pages than the pool has free: lane by lane, (tail rows + rows) / P.
  void check_room(const char* where, const std::vector<sequence_id>& lanes, std::int64_t rows) const {
    const std::int64_t page = config_.page_size;
    std::int64_t needed = 0;
    for (const sequence_id l : lanes) {
      const std::int64_t tail = lanes_.stored_tokens(l) - static_cast<std::int64_t>(lanes_.pages(l).size()) * page;
      needed += (tail + std::max<std::int64_t>(rows, 0)) / page;
    }
    if (needed <= pool().free_pages()) return;
    throw capacity_error("max_pages", std::string("kvmosaic: ") + where + ": the write seals " + std::to_string(needed) +
                                          " head pages and the pool has " + std::to_string(pool().free_pages()) +
                                          " free; allowed: writes within cache_config::max_pages x num_kv_heads head pages");
  }
  void check_heads(const char* where, const char* name, std::int64_t heads) const {
    detail::require(heads == config_.num_kv_heads, where, name, heads, "num_kv_heads in dimension 1");
  }

  cache_config config_;
  selector_type selector_;
  lane_cache lanes_;
  /// By the inner slot of each sequence's head-0 lane: its lanes in head order (empty elsewhere).
  std::vector<std::vector<sequence_id>> heads_of_;
  std::vector<sequence_id> planned_;  ///< the lanes of the last plan
  std::int32_t live_ = 0;             ///< live sequences
};

}  // namespace kvmosaic
