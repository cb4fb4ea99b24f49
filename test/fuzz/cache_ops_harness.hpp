// SPDX-License-Identifier: Apache-2.0
#pragma once
// A host-backend cache driven by operation sequences next to a shadow model, shared by the seeded
// random differential tests (test/unit/test_random_ops.cpp, test/unit/test_random_eviction.cpp)
// and the libFuzzer target (test/fuzz/fuzz_cache_ops.cpp).
//
// The shadow model keeps, per live sequence, the tokens it was given (K and V float rows, token
// ids) and its full pages as reference-counted model pages (a fork shares its parent's full
// pages until the last holder is removed). Before every operation the model decides whether the
// operation is valid; a valid one must succeed, an invalid one must throw the expected
// kvmosaic::error (capacity_error where a fixed resource is short) and leave the cache as it was
// (gauge, lengths and outputs of a probe step bitwise equal). After every operation the cache
// must match the model: free-page gauge, pages per sequence, reference count of every page,
// lengths, token counts. Every attend output is checked:
//   - bitwise against a second cache built by one-shot prefill of the same tokens (same format,
//     selector and budget): same outputs, same per-sequence memory, same selections;
//   - against fp64 exact attention over what the format stores (dense: the rows rounded to the
//     storage dtype; bitmap_tiles: those rows pruned by the independent reference of
//     support/prune.hpp; quant2 with select::all: its pages decoded, with the bound of
//     support/quant_bound.hpp) over the tokens the step read (every token for select::all; the
//     selected ranges plus the tail, open chunk and sink rows for read-less selectors), within
//     the derived bound of support/oracle.hpp;
//   - finite (every input is finite).
//
// Caches whose compactor frees memory (compact::repack, compact::hole_fill) also take `evict` and
// `compact`. The model then keeps each sequence's sealed slots (the logical position in each, -1
// once evicted), drops a page every slot of which is dead at eviction (releasing its reference),
// and plans each compaction pass itself (written here from the rules in memory/compaction_plan.hpp
// and docs/eviction.md, not from the library's plan): frozen pages up to the last one another
// sequence holds and, for quant2, up to the last one re-encoded `max_reencodes` times (a count
// per block-table entry, as a fork inherits it), repack sliding the survivors after them forward
// in slot order, hole filling dropping the newest round's survivors into the older holes. After every operation
// `positions(seq)` must equal the model's slots then tail positions, `stored_tokens` its slot
// count, the pool's used pages the distinct pages of the live block tables. A pass must report the
// model's pages freed, copies, tokens evicted and pages re-encoded; no page held by two sequences
// may change (decoded bitwise), every sequence the operation must not change (all but the one
// evicted from or compacted; those whose pass moves nothing) reads the same bits on a probe step,
// and every live token's rows follow it (`check_moved_rows`: a page no move writes decodes as
// before; a written page holds the rows moved there, bitwise for dense and bitmap_tiles, within
// half a quantization step of its input for quant2, which re-encodes it).
// Attend outputs are checked against fp64 exact attention over the live tokens (dense: stored
// rows; bitmap_tiles: sealed tokens pruned by support/prune.hpp; quant2: each live slot's decoded
// row, with the quant2 bound over the live tokens of support/quant_bound.hpp), and bitwise
// against the one-shot-prefilled cache while no token of the batch was ever evicted.
//
// A mismatch throws `ops::failure` (a std::logic_error, never a kvmosaic::error) whose message
// names the operation; `log()` lists every operation so far, to reproduce it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"
#include "support/oracle.hpp"
#include "support/prune.hpp"
#include "support/quant_bound.hpp"

namespace kvmosaic::test::ops {

/// A cache that disagrees with the model or with a reference.
struct failure : std::logic_error {
  using std::logic_error::logic_error;
};

/// Token rows for prefill / append: k, v [n][num_kv_heads][head_dim], one id per token.
struct rows {
  std::int64_t n = 0;
  std::vector<float> k, v;
  std::vector<std::int32_t> ids;
};

using ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

namespace detail {

inline ranges merged(ranges r) {
  std::sort(r.begin(), r.end());
  ranges out;
  for (const auto& x : r) {
    if (x.first >= x.second) continue;
    if (!out.empty() && x.first <= out.back().second)
      out.back().second = std::max(out.back().second, x.second);
    else
      out.push_back(x);
  }
  return out;
}

/// KV head `head` of `kv`, tokens in `read` only.
inline synthetic::kv_data head_subset(const synthetic::kv_data& kv, int head, const ranges& read) {
  synthetic::kv_data r;
  r.num_kv_heads = 1;
  r.head_dim = kv.head_dim;
  for (const auto& [from, to] : read)
    for (std::int64_t t = from; t < to; ++t) {
      const float* k = kv.k_row(static_cast<int>(t), head);
      const float* v = kv.v_row(static_cast<int>(t), head);
      r.k.insert(r.k.end(), k, k + kv.head_dim);
      r.v.insert(r.v.end(), v, v + kv.head_dim);
      ++r.num_tokens;
    }
  return r;
}

inline bool same_bits(const float* a, const float* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace detail

/// The shadow model: tokens and reference-counted full pages of every live sequence.
class shadow_model {
 public:
  struct sequence {
    sequence_id id{};
    std::vector<float> k, v;         ///< [token][heads][head_dim], as given
    std::vector<std::int32_t> ids;   ///< one per token
    std::vector<std::int64_t> pages; ///< model pages of the full pages, in order
    std::vector<std::int64_t> slots; ///< per sealed slot (pages x page_size): its position, -1 once evicted
    std::vector<bool> evicted;       ///< per position
    std::int64_t sealed = 0;         ///< positions below this one are sealed (the rest: the tail)
    std::int64_t round_start = 0;    ///< hole filling: the slot count its previous pass left
    std::vector<int> reencoded;      ///< per page: the passes that encoded it again (quant2)
    /// The harness's memo of the references it derived from the first tokens (bitmap_tiles: the
    /// pruned stored rows): tokens never change once given.
    mutable std::vector<float> memo_k, memo_v;
    std::int64_t length() const { return static_cast<std::int64_t>(ids.size()); }
    /// Slots in use: sealed slots (dead ones included) and tail rows.
    std::int64_t stored() const { return static_cast<std::int64_t>(slots.size()) + length() - sealed; }
    bool any_evicted() const { return std::find(evicted.begin(), evicted.end(), true) != evicted.end(); }
    /// The live positions, ascending.
    std::vector<std::int64_t> live_positions() const {
      std::vector<std::int64_t> out;
      for (std::int64_t p = 0; p < length(); ++p)
        if (!evicted[static_cast<std::size_t>(p)]) out.push_back(p);
      return out;
    }
    /// positions(seq) as the cache must report it: the sealed slots, then the tail's positions.
    std::vector<std::int64_t> positions() const {
      std::vector<std::int64_t> out = slots;
      for (std::int64_t p = sealed; p < length(); ++p) out.push_back(p);
      return out;
    }
  };

  /// What a compaction pass over one sequence must do and report.
  struct pass {
    std::int32_t pages_freed = 0;
    std::int64_t slot_copies = 0;
    std::int64_t tokens_evicted = 0;
    std::int32_t pages_written = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> moves;  ///< (from slot, to slot)
    std::vector<bool> written;                                 ///< per page kept: a move writes it
  };

  shadow_model(int page_size, std::int32_t pool_pages, std::int32_t max_sequences, std::size_t row)
      : page_size_(page_size), pool_(pool_pages), max_sequences_(max_sequences), row_(row) {}

  std::vector<sequence>& live() { return live_; }
  const std::vector<sequence>& live() const { return live_; }
  const std::vector<sequence_id>& removed() const { return removed_; }
  const std::map<std::int64_t, std::int32_t>& refs() const { return refs_; }
  std::int32_t used_pages() const { return static_cast<std::int32_t>(refs_.size()); }
  std::int32_t free_pages() const { return pool_ - used_pages(); }
  bool slots_full() const { return static_cast<std::int32_t>(live_.size()) >= max_sequences_; }
  std::int64_t tail(const sequence& s) const { return s.length() - s.sealed; }
  /// Pages a write of n tokens to `s` seals.
  std::int64_t pages_for(const sequence& s, std::int64_t n) const { return (tail(s) + n) / page_size_; }

  void add(sequence_id id) {
    sequence s;
    s.id = id;
    live_.push_back(std::move(s));
  }
  void grow(std::size_t i, const rows& r, std::int64_t first, std::int64_t n) {
    sequence& s = live_[i];
    s.k.insert(s.k.end(), r.k.begin() + static_cast<std::ptrdiff_t>(first * static_cast<std::int64_t>(row_)),
               r.k.begin() + static_cast<std::ptrdiff_t>((first + n) * static_cast<std::int64_t>(row_)));
    s.v.insert(s.v.end(), r.v.begin() + static_cast<std::ptrdiff_t>(first * static_cast<std::int64_t>(row_)),
               r.v.begin() + static_cast<std::ptrdiff_t>((first + n) * static_cast<std::int64_t>(row_)));
    s.ids.insert(s.ids.end(), r.ids.begin() + first, r.ids.begin() + first + n);
    s.evicted.resize(static_cast<std::size_t>(s.length()), false);
    while (s.length() - s.sealed >= page_size_) {
      refs_[next_page_] = 1;
      s.pages.push_back(next_page_++);
      for (int t = 0; t < page_size_; ++t) s.slots.push_back(s.sealed + t);
      s.reencoded.push_back(0);
      s.sealed += page_size_;
    }
  }
  void fork(std::size_t parent, sequence_id child) {
    sequence c = live_[parent];
    c.id = child;
    for (const std::int64_t p : c.pages) ++refs_[p];
    live_.push_back(std::move(c));
  }
  void remove(std::size_t i) {
    for (const std::int64_t p : live_[i].pages) release(p);
    removed_.push_back(live_[i].id);
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  /// Whether `evict(seq, positions)` must succeed: every position below the length, sealed (not in
  /// the open tail), past the format's `sinks`, not evicted before, and none listed twice.
  bool evict_valid(std::size_t i, const std::vector<std::int64_t>& positions, int sinks) const {
    const sequence& s = live_[i];
    std::vector<std::int64_t> sorted = positions;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return false;
    for (const std::int64_t p : positions)
      if (p < 0 || p >= s.sealed || p < sinks || s.evicted[static_cast<std::size_t>(p)]) return false;
    return true;
  }
  /// A valid eviction: the slots die, and every page left with no live slot leaves the block
  /// table (its reference released).
  void evict(std::size_t i, const std::vector<std::int64_t>& positions) {
    sequence& s = live_[i];
    for (const std::int64_t p : positions) {
      s.evicted[static_cast<std::size_t>(p)] = true;
      *std::find(s.slots.begin(), s.slots.end(), p) = -1;
    }
    std::vector<std::int64_t> pages, slots;
    std::vector<int> reencoded;
    std::int64_t round_start = s.round_start;
    for (std::size_t pg = 0; pg < s.pages.size(); ++pg) {
      const auto first = s.slots.begin() + static_cast<std::ptrdiff_t>(pg * static_cast<std::size_t>(page_size_));
      if (std::all_of(first, first + page_size_, [](std::int64_t p) { return p < 0; })) {
        release(s.pages[pg]);
        if (static_cast<std::int64_t>(pg) * page_size_ < s.round_start) round_start -= page_size_;
        continue;
      }
      pages.push_back(s.pages[pg]);
      reencoded.push_back(s.reencoded[pg]);
      slots.insert(slots.end(), first, first + page_size_);
    }
    s.pages = std::move(pages);
    s.reencoded = std::move(reencoded);
    s.slots = std::move(slots);
    s.round_start = round_start;
  }

  /// Pages a compaction pass of sequence `i` may neither write nor free: up to the last page that
  /// another sequence holds too, and up to the last one re-encoded `reencode_limit` times (-1: a
  /// format that does not re-encode what it moves).
  std::int64_t frozen_pages(std::size_t i, int reencode_limit) const {
    const sequence& s = live_[i];
    std::int64_t frozen = 0;
    for (std::size_t pg = 0; pg < s.pages.size(); ++pg)
      if (refs_.at(s.pages[pg]) > 1 || (reencode_limit >= 0 && s.reencoded[pg] >= reencode_limit))
        frozen = static_cast<std::int64_t>(pg) + 1;
    return frozen;
  }
  /// A compaction pass over sequence `i` (`hole_fill`: hole filling, else repack): the survivors
  /// after the frozen pages move, trailing pages with no survivor are freed, and each page a move
  /// writes counts one more re-encode (formats with a `reencode_limit`, up to 255).
  pass compact(std::size_t i, bool hole_fill, int reencode_limit) {
    sequence& s = live_[i];
    const std::int64_t page = page_size_, first = frozen_pages(i, reencode_limit) * page;
    const auto slots = static_cast<std::int64_t>(s.slots.size());
    pass r;
    r.tokens_evicted = std::count(s.slots.begin(), s.slots.end(), std::int64_t{-1});
    // Hole filling keeps every survivor before its round (at least the frozen pages); repack only
    // the frozen pages' slots.
    const std::int64_t keep = hole_fill ? std::max(s.round_start, first) : first;
    std::vector<std::int64_t> after(s.slots.begin(), s.slots.begin() + keep);
    std::vector<std::int64_t> holes;
    if (hole_fill)
      for (std::int64_t x = first; x < keep; ++x)
        if (after[static_cast<std::size_t>(x)] < 0) holes.push_back(x);
    std::vector<bool> written(static_cast<std::size_t>(slots / page), false);
    std::size_t next_hole = 0;
    for (std::int64_t x = keep; x < slots; ++x) {
      const std::int64_t p = s.slots[static_cast<std::size_t>(x)];
      if (p < 0) continue;
      std::int64_t to;
      if (next_hole < holes.size()) {
        to = holes[next_hole++];
        after[static_cast<std::size_t>(to)] = p;
      } else {
        to = static_cast<std::int64_t>(after.size());
        after.push_back(p);
      }
      if (to != x) {
        ++r.slot_copies;
        r.moves.emplace_back(x, to);
        written[static_cast<std::size_t>(to / page)] = true;
      }
    }
    std::int64_t used = static_cast<std::int64_t>(after.size());
    while (used > first && after[static_cast<std::size_t>(used - 1)] < 0) --used;
    const std::int64_t kept = (used + page - 1) / page;
    after.resize(static_cast<std::size_t>(kept * page), -1);
    r.pages_freed = static_cast<std::int32_t>(static_cast<std::int64_t>(s.pages.size()) - kept);
    r.pages_written = static_cast<std::int32_t>(std::count(written.begin(), written.end(), true));
    written.resize(static_cast<std::size_t>(kept));
    r.written = std::move(written);
    for (std::size_t pg = static_cast<std::size_t>(kept); pg < s.pages.size(); ++pg) release(s.pages[pg]);
    s.pages.resize(static_cast<std::size_t>(kept));
    s.reencoded.resize(static_cast<std::size_t>(kept));
    if (reencode_limit >= 0)
      for (std::size_t pg = 0; pg < r.written.size(); ++pg)
        if (r.written[pg]) s.reencoded[pg] = std::min(s.reencoded[pg] + 1, 255);
    s.slots = std::move(after);
    s.round_start = kept * page;
    return r;
  }

 private:
  int page_size_;
  std::int32_t pool_, max_sequences_;
  std::size_t row_;
  std::vector<sequence> live_;
  std::vector<sequence_id> removed_;
  std::map<std::int64_t, std::int32_t> refs_;
  std::int64_t next_page_ = 0;

  void release(std::int64_t page) {
    if (--refs_[page] == 0) refs_.erase(page);
  }
};

/// What the harness checks besides the model (the fuzzer may turn the expensive ones off).
struct check_options {
  bool one_shot_reference = true;  ///< bitwise against a one-shot-prefilled cache
  bool oracle = true;              ///< fp64 exact attention within the derived bound
  /// A removed sequence's id must be rejected by every call and never be handed out again while
  /// the test runs (ids carry their slot's generation).
  bool stale_ids = true;
};

template <class Cache>
class harness {
 public:
  using format_type = typename Cache::format_type;
  using selector_type = typename Cache::selector_type;
  static constexpr bool needs_ids = selector_traits<selector_type>::needs_token_ids;
  static constexpr bool reads_all = selector_traits<selector_type>::reads_all_pages;
  using compactor_type = typename Cache::compactor_type;
  /// The compactor frees memory: the cache takes `evict` and `compact`.
  static constexpr bool evicts = compactor_traits<compactor_type>::frees_memory;
  static constexpr bool hole_fill = std::is_same<compactor_type, compact::hole_fill>::value;
  /// The passes that may re-encode a page: quant2's max_reencodes; -1 for formats whose moves
  /// keep the values (dense, bitmap_tiles), which no limit freezes.
  int reencode_limit() const {
    if constexpr (format::is_quant_v<format_type>)
      return cache_.format().max_reencodes;
    else
      return -1;
  }

  harness(const cache_config& config, const format_type& format, const selector_type& selector, check_options options = {})
      : config_(config),
        cache_(config, format, selector),
        model_(config.page_size, config.max_pages, config.max_sequences,
               static_cast<std::size_t>(config.num_kv_heads) * config.head_dim),
        options_(options) {}

  const cache_config& config() const { return config_; }
  Cache& cache() { return cache_; }
  const shadow_model& model() const { return model_; }
  std::size_t row() const { return static_cast<std::size_t>(config_.num_kv_heads) * config_.head_dim; }
  /// Every operation so far, one per line.
  std::string log() const { return log_.str(); }

  // --- Valid or invalid by the model's judgement ----------------------------------------------------

  void add_sequence() {
    begin("add_sequence");
    if (model_.slots_full()) {
      expect_rejected("add_sequence with every slot live", true, [&] { cache_.add_sequence(); });
      return;
    }
    sequence_id id{};
    expect_ok([&] { id = cache_.add_sequence(); });
    note_new_id(id);
    model_.add(id);
    log_ << " -> id " << id << "\n";
    check_state();
  }

  /// Prefills rows [0, r.n) into live sequence `i` (a chunk of a chunked prefill when it is not empty).
  void prefill(std::size_t i, const rows& r) {
    auto& s = model_.live()[i];
    begin("prefill") << " seq " << s.id << " (length " << s.length() << ", tail " << model_.tail(s) << ") n " << r.n;
    const std::int64_t need = model_.pages_for(s, r.n);
    if (need > model_.free_pages()) {
      expect_rejected("prefill beyond the free pages", true, [&] { call_prefill(s.id, r); });
      return;
    }
    expect_ok([&] { call_prefill(s.id, r); });
    model_.grow(i, r, 0, r.n);
    log_ << "\n";
    check_state();
  }

  /// One token to each of the live sequences `which` (distinct), row b of `r` to which[b].
  void append(const std::vector<std::size_t>& which, const rows& r) {
    begin("append") << " seqs";
    std::vector<sequence_id> ids;
    std::int64_t need = 0;
    for (const std::size_t i : which) {
      const auto& s = model_.live()[i];
      ids.push_back(s.id);
      need += model_.pages_for(s, 1);
      log_ << " " << s.id << "(len " << s.length() << ")";
    }
    if (need > model_.free_pages()) {
      expect_rejected("append beyond the free pages", true, [&] { call_append(ids, r); });
      return;
    }
    expect_ok([&] { call_append(ids, r); });
    for (std::size_t b = 0; b < which.size(); ++b) model_.grow(which[b], r, static_cast<std::int64_t>(b), 1);
    log_ << "\n";
    check_state();
  }

  void fork(std::size_t i) {
    const sequence_id parent = model_.live()[i].id;
    begin("fork_sequence") << " seq " << parent;
    if (model_.slots_full()) {
      expect_rejected("fork with every slot live", true, [&] { cache_.fork_sequence(parent); });
      return;
    }
    sequence_id child{};
    expect_ok([&] { child = cache_.fork_sequence(parent); });
    note_new_id(child);
    model_.fork(i, child);
    log_ << " -> id " << child << "\n";
    check_state();
  }

  void remove(std::size_t i) {
    const sequence_id id = model_.live()[i].id;
    begin("remove_sequence") << " seq " << id << "\n";
    expect_ok([&] { cache_.remove_sequence(id); });
    model_.remove(i);
    check_state();
  }

  void set_budget(const select::token_budget& budget) {
    begin("set_budget") << " ratio " << budget.ratio << " tokens " << budget.tokens;
    if constexpr (!reads_all) {
      if (!(budget.ratio >= 0.0 && budget.ratio <= 1.0)) {
        expect_rejected("set_budget with a ratio outside [0, 1]", false, [&] { cache_.set_budget(budget); });
        return;
      }
      expect_ok([&] { cache_.set_budget(budget); });
    }
    log_ << "\n";
    check_state();
  }

  /// One decode step over the live sequences `which` (distinct) with q [which.size()][q heads][d].
  /// A batch holding an empty sequence must be rejected.
  void attend(const std::vector<std::size_t>& which, const std::vector<float>& q) {
    begin("attend") << " seqs";
    std::vector<sequence_id> ids;
    bool has_empty = false, evicted = false;
    for (const std::size_t i : which) {
      const auto& s = model_.live()[i];
      ids.push_back(s.id);
      has_empty = has_empty || s.stored() == 0;
      evicted = evicted || s.any_evicted();
      log_ << " " << s.id << "(len " << s.length() << ")";
    }
    log_ << "\n";
    const std::int64_t batch = static_cast<std::int64_t>(ids.size());
    const int hq = config_.num_q_heads(), d = config_.head_dim;
    std::vector<float> out(q.size(), -1.0f);
    const auto call = [&] {
      cache_.attend(span<const sequence_id>(ids.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
                    tensor_view<float, 3>(out.data(), batch, hq, d));
    };
    if (has_empty) {
      expect_rejected("attend over an empty sequence", false, call);
      return;
    }
    expect_ok(call);
    const std::size_t per = static_cast<std::size_t>(hq) * d;
    for (std::size_t x = 0; x < out.size(); ++x)
      if (!std::isfinite(out[x]))
        fail("attend: output of batch row " + std::to_string(x / per) + " element " + std::to_string(x % per) +
             " is not finite (" + std::to_string(out[x]) + ") for finite inputs");
    // The one-shot cache holds every token: a reference while no token of the batch was evicted.
    if (options_.one_shot_reference && !evicted) check_one_shot(which, q, out);
    if (options_.oracle)
      for (std::size_t b = 0; b < which.size(); ++b)
        check_oracle(model_.live()[which[b]], std::vector<float>(q.begin() + static_cast<std::ptrdiff_t>(b * per),
                                                                 q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per)),
                     out.data() + b * per);
    check_state();
  }

  // --- Eviction and compaction (caches whose compactor frees memory) --------------------------------

  /// Evicts `positions` of live sequence `i`. The model judges the list: a valid one must succeed,
  /// any other be rejected (invalid_argument) with nothing changed. Afterwards every other
  /// sequence reads the same bits, and this one's probe output is checked against the oracle.
  void evict(std::size_t i, const std::vector<std::int64_t>& positions) {
    static_assert(evicts, "ops::harness::evict: this cache's compactor frees no memory");
    const auto& s = model_.live()[i];
    const sequence_id id = s.id;
    begin("evict") << " seq " << id << " (length " << s.length() << ", sealed " << s.sealed << ", live "
                   << s.live_positions().size() << ") positions";
    for (const std::int64_t p : positions) log_ << " " << p;
    const auto call = [&] {
      cache_.evict(id, span<const std::int64_t>(positions.data(), static_cast<std::int64_t>(positions.size())));
    };
    if (!model_.evict_valid(i, positions, sink_rows(cache_.format()))) {
      expect_rejected("evict of positions that are not distinct live sealed tokens", false, call);
      return;
    }
    log_ << "\n";
    const probe before = probe_all();
    expect_ok(call);
    model_.evict(i, positions);
    check_state();
    check_probe(before, {id}, "evict");
  }

  /// `evict` on the id of a removed sequence (`which` indexes model().removed()).
  void evict_stale(std::size_t which) {
    static_assert(evicts, "ops::harness::evict_stale: this cache's compactor frees no memory");
    if (!options_.stale_ids) return;
    const sequence_id id = model_.removed()[which];
    begin("evict stale id") << " " << id;
    const std::int64_t position = 0;
    expect_rejected("evict from a removed sequence", false,
                    [&] { cache_.evict(id, span<const std::int64_t>(&position, 1)); });
  }

  /// A compaction pass over live sequence `i`.
  void compact(std::size_t i) { compact_pass(false, i); }
  /// A compaction pass over every live sequence.
  void compact_all() { compact_pass(true, 0); }

  // --- Always invalid ----------------------------------------------------------------------------------

  /// An append naming live sequence `i` twice.
  void append_duplicate(std::size_t i, const rows& r) {
    const sequence_id id = model_.live()[i].id;
    begin("append duplicate") << " seq " << id << " twice\n";
    const std::vector<sequence_id> ids{id, id};
    expect_rejected("append with a repeated sequence", false, [&] { call_append(ids, r); });
  }

  /// A prefill of zero tokens.
  void prefill_empty(std::size_t i) {
    const sequence_id id = model_.live()[i].id;
    begin("prefill of 0 tokens") << " seq " << id << "\n";
    rows none;
    none.k.assign(row(), 0.5f);
    none.v.assign(row(), 0.5f);
    none.ids.assign(1, 0);
    expect_rejected("prefill of 0 tokens", false, [&] { call_prefill(id, none); });
  }

  /// Calls on the id of a removed sequence (`which` indexes model().removed()).
  void use_stale_id(std::size_t which, const rows& r) {
    if (!options_.stale_ids) return;
    const sequence_id id = model_.removed()[which];
    begin("stale id") << " " << id << "\n";
    expect_rejected("length of a removed sequence", false, [&] { (void)cache_.length(id); });
    expect_rejected("prefill into a removed sequence", false, [&] { call_prefill(id, r); });
    expect_rejected("fork of a removed sequence", false, [&] { (void)cache_.fork_sequence(id); });
  }

  /// The cache against the model: gauge, pages and their reference counts, lengths, tokens.
  void check_state() {
    const memory_stats m = cache_.memory();
    if (m.pages_free != model_.free_pages() || m.pages_used != model_.used_pages())
      fail("gauge: pages_free " + std::to_string(m.pages_free) + ", pages_used " + std::to_string(m.pages_used) +
           "; model: " + std::to_string(model_.free_pages()) + " free, " + std::to_string(model_.used_pages()) + " used");
    if (cache_.pool().free_pages() != model_.free_pages()) fail("pool().free_pages() differs from memory().pages_free");
    std::int64_t tokens = 0;
    std::map<std::int64_t, page_id> to_cache;  // model page -> cache page
    std::map<page_id, std::int64_t> to_model;
    for (const auto& s : model_.live()) {
      tokens += s.stored();
      const std::int64_t length = cache_.length(s.id);
      if (length != s.length())
        fail("length of seq " + std::to_string(s.id) + " is " + std::to_string(length) + "; model: " + std::to_string(s.length()));
      const auto& pages = cache_.pages(s.id);
      if (pages.size() != s.pages.size())
        fail("seq " + std::to_string(s.id) + " holds " + std::to_string(pages.size()) + " pages; model: " +
             std::to_string(s.pages.size()));
      for (std::size_t p = 0; p < pages.size(); ++p) {
        const auto a = to_cache.emplace(s.pages[p], pages[p]);
        const auto b = to_model.emplace(pages[p], s.pages[p]);
        if (a.first->second != pages[p] || b.first->second != s.pages[p])
          fail("seq " + std::to_string(s.id) + " page " + std::to_string(p) + ": the cache shares pages the model does not (or not those it does)");
        if (cache_.pool().ref_count(pages[p]) != model_.refs().at(s.pages[p]))
          fail("page " + std::to_string(pages[p]) + " has " + std::to_string(cache_.pool().ref_count(pages[p])) +
               " holders; model: " + std::to_string(model_.refs().at(s.pages[p])));
      }
    }
    if (m.tokens != tokens) fail("memory().tokens " + std::to_string(m.tokens) + "; model: " + std::to_string(tokens));
    // The pool holds exactly the pages the live block tables name, each once (not through the model).
    std::set<page_id> named;
    for (const auto& s : model_.live())
      for (const page_id page : cache_.pages(s.id)) named.insert(page);
    if (static_cast<std::int32_t>(named.size()) != cache_.pool().used_pages())
      fail("the pool has " + std::to_string(cache_.pool().used_pages()) + " pages in use; the live block tables name " +
           std::to_string(named.size()));
    if constexpr (evicts) check_positions();
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw failure("kvmosaic ops harness: " + what + "\nafter operation #" + std::to_string(ops_) + ". Operations:\n" + log_.str());
  }
  std::ostringstream& begin(const char* op) {
    log_ << "#" << ++ops_ << " " << op;
    return log_;
  }

  void note_new_id(sequence_id id) {
    for (const auto& s : model_.live())
      if (s.id == id) fail("a new sequence got the id of live sequence " + std::to_string(id));
    if (options_.stale_ids)
      for (const sequence_id old : model_.removed())
        if (old == id) fail("a new sequence got the id " + std::to_string(id) + " of a removed one: stale handles address it");
  }

  void call_prefill(sequence_id id, const rows& r) {
    const int h = config_.num_kv_heads, d = config_.head_dim;
    const tensor_view<const float, 3> k(r.k.data(), r.n, h, d), v(r.v.data(), r.n, h, d);
    if constexpr (needs_ids)
      cache_.prefill(id, k, v, span<const std::int32_t>(r.ids.data(), r.n));
    else
      cache_.prefill(id, k, v);
  }
  void call_append(const std::vector<sequence_id>& ids, const rows& r) {
    const int h = config_.num_kv_heads, d = config_.head_dim;
    const std::int64_t b = static_cast<std::int64_t>(ids.size());
    // Never taken; tells g++ (-O3, -Walloc-size-larger-than) that the batch is not negative when
    // it inlines append into this call.
    if (b < 0) fail("a batch of more than 2^63 sequences");
    const tensor_view<const float, 3> k(r.k.data(), b, h, d), v(r.v.data(), b, h, d);
    if constexpr (needs_ids)
      cache_.append(span<const sequence_id>(ids.data(), b), k, v, span<const std::int32_t>(r.ids.data(), b));
    else
      cache_.append(span<const sequence_id>(ids.data(), b), k, v);
  }

  template <class Op>
  void expect_ok(Op&& op) {
    try {
      op();
    } catch (const error& e) {
      fail(std::string("a valid operation threw: ") + e.what());
    }
  }

  /// What must not change when a call is rejected.
  struct snapshot {
    memory_stats memory;
    std::vector<std::int64_t> lengths;
    std::vector<std::vector<std::int64_t>> positions;  ///< caches that evict
    std::vector<float> probe;
  };
  snapshot take_snapshot() {
    snapshot s;
    s.memory = cache_.memory();
    std::vector<sequence_id> ids;
    for (const auto& seq : model_.live()) {
      s.lengths.push_back(cache_.length(seq.id));
      if constexpr (evicts) s.positions.push_back(cache_.positions(seq.id));
      if (seq.stored() > 0) ids.push_back(seq.id);
    }
    if (!ids.empty()) {
      const int hq = config_.num_q_heads(), d = config_.head_dim;
      const std::int64_t batch = static_cast<std::int64_t>(ids.size());
      std::vector<float> q(static_cast<std::size_t>(batch) * hq * d);
      for (std::size_t x = 0; x < q.size(); ++x) q[x] = static_cast<float>((x * 7919u) % 17u) / 8.0f - 1.0f;
      s.probe.assign(q.size(), 0.0f);
      cache_.attend(span<const sequence_id>(ids.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
                    tensor_view<float, 3>(s.probe.data(), batch, hq, d));
    }
    return s;
  }

  /// The call must throw a kvmosaic::error (capacity_error when `capacity`) and change nothing.
  template <class Op>
  void expect_rejected(const char* what, bool capacity, Op&& op) {
    log_ << " [expected rejection: " << what << "]\n";
    const snapshot before = take_snapshot();
    bool threw = false;
    try {
      op();
    } catch (const capacity_error& e) {
      threw = true;
      if (!capacity) fail(std::string(what) + ": threw capacity_error, expected invalid_argument: " + e.what());
    } catch (const error& e) {
      threw = true;
      if (capacity) fail(std::string(what) + ": expected capacity_error, got: " + e.what());
    }
    if (!threw) fail(std::string(what) + ": accepted, expected a kvmosaic::error");
    const snapshot after = take_snapshot();
    const memory_stats &a = before.memory, &b = after.memory;
    if (a.tokens != b.tokens || a.stored_bytes != b.stored_bytes || a.dense_bytes != b.dense_bytes ||
        a.pages_used != b.pages_used || a.pages_free != b.pages_free)
      fail(std::string(what) + ": the rejected call changed memory() (pages_free " + std::to_string(a.pages_free) + " -> " +
           std::to_string(b.pages_free) + ", stored_bytes " + std::to_string(a.stored_bytes) + " -> " +
           std::to_string(b.stored_bytes) + ")");
    if (before.lengths != after.lengths) fail(std::string(what) + ": the rejected call changed a length");
    if (before.positions != after.positions) fail(std::string(what) + ": the rejected call changed a position map");
    if (before.probe.size() != after.probe.size() || !detail::same_bits(before.probe.data(), after.probe.data(), before.probe.size()))
      fail(std::string(what) + ": the rejected call changed the outputs of a probe step");
    check_state();
  }

  // --- References ----------------------------------------------------------------------------------

  /// The same tokens prefilled in one call each into a fresh cache: bitwise equal outputs, per-sequence
  /// memory and selections.
  void check_one_shot(const std::vector<std::size_t>& which, const std::vector<float>& q, const std::vector<float>& out) {
    cache_config rc = config_;
    rc.max_sequences = static_cast<std::int32_t>(which.size());
    std::int64_t pages = 1;
    for (const std::size_t i : which) pages += static_cast<std::int64_t>(model_.live()[i].pages.size());
    rc.max_pages = static_cast<std::int32_t>(pages);
    Cache ref(rc, cache_.format(), cache_.selector());
    std::vector<sequence_id> ids;
    const int h = config_.num_kv_heads, d = config_.head_dim, hq = config_.num_q_heads();
    for (const std::size_t i : which) {
      const auto& s = model_.live()[i];
      const sequence_id id = ref.add_sequence();
      const tensor_view<const float, 3> k(s.k.data(), s.length(), h, d), v(s.v.data(), s.length(), h, d);
      if constexpr (needs_ids)
        ref.prefill(id, k, v, span<const std::int32_t>(s.ids.data(), s.length()));
      else
        ref.prefill(id, k, v);
      ids.push_back(id);
    }
    const std::int64_t batch = static_cast<std::int64_t>(ids.size());
    std::vector<float> expected(out.size());
    ref.attend(span<const sequence_id>(ids.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
               tensor_view<float, 3>(expected.data(), batch, hq, d));
    const std::size_t per = static_cast<std::size_t>(hq) * d;
    for (std::size_t b = 0; b < which.size(); ++b) {
      const sequence_id id = model_.live()[which[b]].id;
      for (std::size_t x = 0; x < per; ++x)
        if (!detail::same_bits(&out[b * per + x], &expected[b * per + x], 1)) {
          std::ostringstream os;
          os.precision(9);
          os << "attend: seq " << id << " output element " << x << " = " << out[b * per + x]
             << "; the one-shot-prefilled cache gives " << expected[b * per + x] << " (chunked/append vs one-shot)";
          fail(os.str());
        }
      const memory_stats a = cache_.sequence_memory(id), e = ref.sequence_memory(ids[b]);
      if (a.tokens != e.tokens || a.stored_bytes != e.stored_bytes || a.dense_bytes != e.dense_bytes)
        fail("sequence_memory of seq " + std::to_string(id) + ": stored_bytes " + std::to_string(a.stored_bytes) +
             ", one-shot " + std::to_string(e.stored_bytes));
      if constexpr (!reads_all)
        for (int head = 0; head < h; ++head)
          if (cache_.selected_ranges(id, head) != ref.selected_ranges(ids[b], head))
            fail("attend: seq " + std::to_string(id) + " head " + std::to_string(head) +
                 " selected other ranges than the one-shot-prefilled cache");
      if constexpr (needs_ids) {
        const auto a_chunks = cache_.chunks(id), e_chunks = ref.chunks(ids[b]);
        bool same = a_chunks.size() == e_chunks.size();
        for (std::size_t c = 0; same && c < a_chunks.size(); ++c)
          same = a_chunks[c].begin == e_chunks[c].begin && a_chunks[c].end == e_chunks[c].end;
        if (!same) fail("seq " + std::to_string(id) + ": other chunks than the one-shot-prefilled cache");
      }
    }
  }

  /// fp64 exact attention over what the format stores and the step read, within the derived bound.
  void check_oracle(const shadow_model::sequence& s, const std::vector<float>& q, const float* out) {
    if constexpr (evicts) {
      check_live_oracle(s, q, out);
      return;
    }
    synthetic::kv_data given;
    given.num_tokens = static_cast<int>(s.length());
    given.num_kv_heads = config_.num_kv_heads;
    given.head_dim = config_.head_dim;
    given.k = s.k;
    given.v = s.v;
    const synthetic::kv_data stored = rounded(given, config_.storage);
    const int d = config_.head_dim, g = config_.group_size, heads = config_.num_kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const std::int64_t n = s.length(), sealed = static_cast<std::int64_t>(s.pages.size()) * config_.page_size;
    synthetic::kv_data held = stored;  // what the format attends over
    std::int64_t sinks = 0;
    if constexpr (std::is_same<format_type, format::bitmap_tiles>::value) {
      held = pruned_cache(stored, config_.page_size, cache_.format().s_k, cache_.format().s_v);
    } else if constexpr (format::is_quant_v<format_type>) {
      held = quant_decoded(cache_, s.id, stored);
      sinks = s.pages.empty() ? 0 : cache_.format().sink_tokens;
      if constexpr (reads_all) {
        const auto exact_out = exact(q, held, scale);
        const auto bounds = quant_attention_bounds(cache_, s.id, q, held, scale);
        for (std::size_t x = 0; x < exact_out.size(); ++x)
          if (!(std::abs(out[x] - exact_out[x]) <= bounds.vs_exact[x]))
            fail_oracle(s, x, out[x], exact_out[x], bounds.vs_exact[x]);
      }
      return;  // read-less selectors over quant2: the one-shot reference only (no bound on a subset)
    }
    for (int head = 0; head < heads; ++head) {
      ranges read{{0, n}};
      if constexpr (!reads_all) {
        std::int64_t always_from = sealed;
        if constexpr (needs_ids) {
          const auto chunks = cache_.chunks(s.id);
          always_from = std::min(always_from, chunks.empty() ? std::int64_t{0} : chunks.back().end);
        }
        // Quest selects blocks of sealed pages; sentence_chunks final chunks (which may reach into the tail).
        const std::int64_t selectable = needs_ids ? std::max(always_from, std::min(n, final_end(s.id))) : sealed;
        read = cache_.selected_ranges(s.id, head);
        for (const auto& [from, to] : read)
          if (from < 0 || to > selectable || from >= to)
            fail("seq " + std::to_string(s.id) + " head " + std::to_string(head) + ": selected range [" +
                 std::to_string(from) + ", " + std::to_string(to) + ") outside the selectable tokens [0, " +
                 std::to_string(selectable) + ")");
        read.emplace_back(always_from, n);
        read.emplace_back(0, sinks);
        read = detail::merged(read);
      }
      const synthetic::kv_data kv = detail::head_subset(held, head, read);
      const std::vector<float> qh(q.begin() + static_cast<std::ptrdiff_t>(head) * g * d,
                                  q.begin() + static_cast<std::ptrdiff_t>(head + 1) * g * d);
      const auto exact_out = exact(qh, kv, scale);
      const auto bound = attention_error_bound(qh, kv, g, scale, config_.storage, config_.page_size, true);
      for (std::size_t x = 0; x < exact_out.size(); ++x) {
        const std::size_t at = static_cast<std::size_t>(head) * g * d + x;
        if (!(std::abs(out[at] - exact_out[x]) <= bound.per_element[x])) fail_oracle(s, at, out[at], exact_out[x], bound.per_element[x]);
      }
    }
  }
  // --- Eviction and compaction: references ----------------------------------------------------------

  /// One step over every live sequence that holds a token, with a fixed query.
  struct probe {
    std::vector<sequence_id> ids;
    std::vector<float> q, out;  ///< [ids][num_q_heads][head_dim]
  };
  probe probe_all() {
    probe p;
    for (const auto& s : model_.live())
      if (s.stored() > 0) p.ids.push_back(s.id);
    if (p.ids.empty()) return p;
    const int hq = config_.num_q_heads(), d = config_.head_dim;
    const std::int64_t batch = static_cast<std::int64_t>(p.ids.size());
    const std::size_t per = static_cast<std::size_t>(hq) * d;
    p.q.resize(static_cast<std::size_t>(batch) * per);
    for (std::size_t b = 0; b < p.ids.size(); ++b)  // each sequence's query depends on its id only
      for (std::size_t x = 0; x < per; ++x)
        p.q[b * per + x] = static_cast<float>((x * 7717u + static_cast<std::size_t>(p.ids[b]) * 131u) % 23u) / 11.0f - 1.0f;
    p.out.assign(p.q.size(), 0.0f);
    expect_ok([&] {
      cache_.attend(span<const sequence_id>(p.ids.data(), batch), tensor_view<const float, 3>(p.q.data(), batch, hq, d),
                    tensor_view<float, 3>(p.out.data(), batch, hq, d));
    });
    return p;
  }
  /// After an operation that changed the sequences `changed` only: every other sequence reads the
  /// same bits as `before`; the changed ones are checked against the oracle.
  void check_probe(const probe& before, const std::vector<sequence_id>& changed, const char* what) {
    const probe after = probe_all();
    const std::size_t per = static_cast<std::size_t>(config_.num_q_heads()) * config_.head_dim;
    for (std::size_t b = 0; b < after.ids.size(); ++b) {
      const sequence_id id = after.ids[b];
      const float* out = after.out.data() + b * per;
      for (std::size_t x = 0; x < per; ++x)
        if (!std::isfinite(out[x])) fail(std::string(what) + ": seq " + std::to_string(id) + " reads a non-finite output");
      if (std::find(changed.begin(), changed.end(), id) != changed.end()) {
        if (options_.oracle)
          for (const auto& s : model_.live())
            if (s.id == id)
              check_oracle(s, std::vector<float>(after.q.begin() + static_cast<std::ptrdiff_t>(b * per),
                                                 after.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per)),
                           out);
        continue;
      }
      const auto at = std::find(before.ids.begin(), before.ids.end(), id);
      if (at == before.ids.end()) fail(std::string(what) + ": seq " + std::to_string(id) + " holds tokens it did not hold before");
      const std::size_t was = static_cast<std::size_t>(at - before.ids.begin());
      for (std::size_t x = 0; x < per; ++x)
        if (!detail::same_bits(out + x, before.out.data() + was * per + x, 1)) {
          std::ostringstream os;
          os.precision(9);
          os << what << ": seq " << id << ", which it must not change, reads output element " << x << " = " << out[x]
             << "; before: " << before.out[was * per + x];
          fail(os.str());
        }
    }
  }

  /// The decoded K and V rows of every page that two or more sequences hold.
  std::map<page_id, std::vector<float>> shared_pages() const {
    using traits = format_traits<format_type>;
    const page_shape shape{config_.page_size, config_.head_dim, config_.storage};
    const std::size_t rows = static_cast<std::size_t>(config_.page_size) * config_.head_dim;
    std::map<page_id, std::vector<float>> out;
    for (const auto& s : model_.live())
      for (const page_id page : cache_.pages(s.id)) {
        if (cache_.pool().ref_count(page) < 2 || out.count(page) > 0) continue;
        std::vector<float>& v = out[page];
        v.resize(2 * rows * static_cast<std::size_t>(config_.num_kv_heads));
        for (int h = 0; h < config_.num_kv_heads; ++h) {
          traits::decode_k(cache_.format(), shape, cache_.engine().k_page(page, h), config_.page_size,
                           v.data() + 2 * rows * static_cast<std::size_t>(h));
          traits::decode_v(cache_.format(), shape, cache_.engine().v_page(page, h), config_.page_size,
                           v.data() + 2 * rows * static_cast<std::size_t>(h) + rows);
        }
      }
    return out;
  }

  /// `compact(seq)` (or `compact()` with `all`) against the model's pass.
  void compact_pass(bool all, std::size_t i) {
    static_assert(evicts, "ops::harness::compact: this cache's compactor frees no memory");
    sequence_id id = -1;
    if (all) {
      begin("compact all");
    } else {
      const auto& s = model_.live()[i];
      id = s.id;
      begin("compact") << " seq " << id << " (length " << s.length() << ", slots " << s.slots.size() << ", live "
                       << s.live_positions().size() << ")";
    }
    log_ << "\n";
    const probe before = probe_all();
    const std::map<page_id, std::vector<float>> shared = shared_pages();
    std::map<sequence_id, std::vector<float>> rows_before;  // every sealed slot's decoded rows
    for (std::size_t j = 0; j < model_.live().size(); ++j)
      if (all || j == i) rows_before[model_.live()[j].id] = decoded_slots(model_.live()[j].id);
    compaction_report got;
    expect_ok([&] { got = all ? cache_.compact() : cache_.compact(id); });
    shadow_model::pass expected;
    std::vector<sequence_id> moved;
    std::map<sequence_id, shadow_model::pass> passes;
    for (std::size_t j = 0; j < model_.live().size(); ++j) {
      if (!all && j != i) continue;
      const shadow_model::pass& one = passes[model_.live()[j].id] = model_.compact(j, hole_fill, reencode_limit());
      expected.pages_freed += one.pages_freed;
      expected.slot_copies += one.slot_copies;
      expected.tokens_evicted += one.tokens_evicted;
      expected.pages_written += one.pages_written;
      if (one.slot_copies > 0) moved.push_back(model_.live()[j].id);
    }
    const std::int32_t reencoded = format::is_quant_v<format_type> ? expected.pages_written : 0;
    if (got.pages_freed != expected.pages_freed || got.slot_copies != expected.slot_copies ||
        got.tokens_evicted != expected.tokens_evicted || got.pages_reencoded != reencoded)
      fail("compact reported pages_freed " + std::to_string(got.pages_freed) + ", slot_copies " +
           std::to_string(got.slot_copies) + ", tokens_evicted " + std::to_string(got.tokens_evicted) +
           ", pages_reencoded " + std::to_string(got.pages_reencoded) + "; model: " + std::to_string(expected.pages_freed) +
           ", " + std::to_string(expected.slot_copies) + ", " + std::to_string(expected.tokens_evicted) + ", " +
           std::to_string(reencoded));
    check_state();
    for (const auto& [seq, pass] : passes) check_moved_rows(seq, rows_before.at(seq), pass);
    // A shared page is frozen for each of its holders: still held by all of them, its bytes as they were.
    const std::map<page_id, std::vector<float>> now = shared_pages();
    for (const auto& [page, rows] : shared) {
      const auto it = now.find(page);
      if (it == now.end()) fail("compact released page " + std::to_string(page) + ", which two sequences held");
      if (!detail::same_bits(it->second.data(), rows.data(), rows.size()))
        fail("compact changed page " + std::to_string(page) + ", which two sequences hold");
    }
    check_probe(before, moved, all ? "compact all" : "compact");
  }

  /// Every sealed slot's decoded K and V rows of sequence `id`: [slot][head][K, V][head_dim].
  std::vector<float> decoded_slots(sequence_id id) const {
    using traits = format_traits<format_type>;
    const int page = config_.page_size, d = config_.head_dim, heads = config_.num_kv_heads;
    const page_shape shape{page, d, config_.storage};
    const auto& pages = cache_.pages(id);
    std::vector<float> out(pages.size() * static_cast<std::size_t>(page) * heads * 2 * d), rows(static_cast<std::size_t>(page) * d);
    for (std::size_t pg = 0; pg < pages.size(); ++pg)
      for (int h = 0; h < heads; ++h)
        for (int is_v = 0; is_v < 2; ++is_v) {
          if (is_v)
            traits::decode_v(cache_.format(), shape, cache_.engine().v_page(pages[pg], h), page, rows.data());
          else
            traits::decode_k(cache_.format(), shape, cache_.engine().k_page(pages[pg], h), page, rows.data());
          for (int t = 0; t < page; ++t)
            std::copy_n(rows.data() + static_cast<std::size_t>(t) * d, d,
                        out.data() + slot_row(pg * static_cast<std::size_t>(page) + static_cast<std::size_t>(t), h, is_v));
        }
    return out;
  }
  std::size_t slot_row(std::size_t slot, int head, int is_v) const {
    return ((slot * static_cast<std::size_t>(config_.num_kv_heads) + static_cast<std::size_t>(head)) * 2 + static_cast<std::size_t>(is_v)) *
           static_cast<std::size_t>(config_.head_dim);
  }

  /// After a pass over `id`: each live token's rows followed it. A page no move writes decodes as
  /// before, bit for bit. A written page is encoded from the rows the pass put there (a move's
  /// source row, or the slot's own): dense and bitmap_tiles keep their values (bitwise); quant2
  /// quantizes them again with nearest rounding, each decoded value within half a step of its
  /// input, the step at most a third of the range of the page's input rows (K and V apart), plus
  /// the 16-bit rounding of the rows, min and scale. Sink rows of the first page are masked
  /// (read dense) and not checked.
  void check_moved_rows(sequence_id id, const std::vector<float>& before, const shadow_model::pass& pass) {
    const std::vector<float> after = decoded_slots(id);
    const int page = config_.page_size, d = config_.head_dim, heads = config_.num_kv_heads;
    const auto& s = *std::find_if(model_.live().begin(), model_.live().end(), [&](const auto& x) { return x.id == id; });
    std::vector<std::int64_t> source(s.slots.size());  // the slot whose row the pass put in each slot
    for (std::size_t x = 0; x < source.size(); ++x) source[x] = static_cast<std::int64_t>(x);
    for (const auto& [from, to] : pass.moves) source[static_cast<std::size_t>(to)] = from;
    const int sinks = sink_rows(cache_.format());
    for (std::size_t pg = 0; pg < pass.written.size(); ++pg)
      for (int h = 0; h < heads; ++h)
        for (int is_v = 0; is_v < 2; ++is_v) {
          double lo = 1e300, hi = -1e300, top = 0;
          for (int t = 0; t < page; ++t) {
            const float* in = before.data() + slot_row(static_cast<std::size_t>(source[pg * static_cast<std::size_t>(page) + static_cast<std::size_t>(t)]), h, is_v);
            for (int c = 0; c < d; ++c) {
              lo = std::min(lo, static_cast<double>(in[c]));
              hi = std::max(hi, static_cast<double>(in[c]));
              top = std::max(top, std::abs(static_cast<double>(in[c])));
            }
          }
          for (int t = pg == 0 ? sinks : 0; t < page; ++t) {
            const std::size_t slot = pg * static_cast<std::size_t>(page) + static_cast<std::size_t>(t);
            if (pass.written[pg] && s.slots[slot] < 0) continue;  // a dead row of a re-encoded page: never read
            const float* got = after.data() + slot_row(slot, h, is_v);
            const float* want = before.data() + slot_row(static_cast<std::size_t>(source[slot]), h, is_v);
            const bool exact = !pass.written[pg] || !format::is_quant_v<format_type>;
            const double tolerance = exact ? 0.0 : (hi - lo) / 6 * 1.01 + std::ldexp(top, -6);
            for (int c = 0; c < d; ++c)
              if (exact ? !detail::same_bits(got + c, want + c, 1) : !(std::abs(static_cast<double>(got[c]) - want[c]) <= tolerance)) {
                std::ostringstream os;
                os.precision(9);
                os << "compact: seq " << id << " slot " << slot << " (position " << s.slots[slot] << ", from slot " << source[slot]
                   << (pass.written[pg] ? ", page written" : ", page not written") << ") head " << h << (is_v ? " V" : " K")
                   << " channel " << c << " decodes to " << got[c] << "; the row put there held " << want[c]
                   << " (tolerance " << tolerance << ")";
                fail(os.str());
              }
          }
        }
  }

  /// Each sequence's position map, slot count and sink slots against the model.
  void check_positions() {
    const int sinks = sink_rows(cache_.format());
    for (const auto& s : model_.live()) {
      const std::vector<std::int64_t> got = cache_.positions(s.id), expected = s.positions();
      if (got != expected) {
        std::ostringstream os;
        os << "positions(seq " << s.id << ") differ from the model's:\n  cache:";
        for (const std::int64_t p : got) os << " " << p;
        os << "\n  model:";
        for (const std::int64_t p : expected) os << " " << p;
        fail(os.str());
      }
      if (cache_.stored_tokens(s.id) != s.stored())
        fail("stored_tokens(seq " + std::to_string(s.id) + ") = " + std::to_string(cache_.stored_tokens(s.id)) + "; model: " +
             std::to_string(s.stored()));
      // Sink tokens stay in their slots: the first page's leading rows are masked and read dense.
      if (!s.pages.empty())
        for (int t = 0; t < sinks; ++t)
          if (s.slots[static_cast<std::size_t>(t)] != t) fail("seq " + std::to_string(s.id) + ": a sink token left its slot");
    }
  }

  /// fp64 exact attention over the live tokens of `s` as the format holds them, within the derived
  /// bound (quant2: each live slot's decoded row, with the quant2 bound over the live tokens).
  void check_live_oracle(const shadow_model::sequence& s, const std::vector<float>& q, const float* out) {
    synthetic::kv_data given;
    given.num_tokens = static_cast<int>(s.length());
    given.num_kv_heads = config_.num_kv_heads;
    given.head_dim = config_.head_dim;
    given.k = s.k;
    given.v = s.v;
    synthetic::kv_data held = rounded(given, config_.storage);
    const int d = config_.head_dim, heads = config_.num_kv_heads, page = config_.page_size;
    const std::size_t row = this->row();
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const std::vector<std::int64_t> live = s.live_positions();
    if constexpr (std::is_same<format_type, format::bitmap_tiles>::value) {
      // Sealed tokens are pruned (once, at seal: a move keeps their values); pruned rows memoized.
      for (std::size_t t = s.memo_k.size() / row; t < static_cast<std::size_t>(s.sealed); ++t)
        for (int h = 0; h < heads; ++h)
          for (const bool is_v : {false, true}) {
            const float* x = (is_v ? held.v.data() : held.k.data()) + t * row + static_cast<std::size_t>(h) * d;
            const std::vector<float> pruned =
                reference_prune(std::vector<float>(x, x + d), d, is_v ? cache_.format().s_v : cache_.format().s_k);
            std::vector<float>& memo = is_v ? s.memo_v : s.memo_k;
            memo.insert(memo.end(), pruned.begin(), pruned.end());
          }
      std::copy_n(s.memo_k.begin(), static_cast<std::size_t>(s.sealed) * row, held.k.begin());
      std::copy_n(s.memo_v.begin(), static_cast<std::size_t>(s.sealed) * row, held.v.begin());
    } else if constexpr (format::is_quant_v<format_type>) {
      using traits = format_traits<format_type>;
      const page_shape shape{page, d, config_.storage};
      const auto& pages = cache_.pages(s.id);
      const int sinks = pages.empty() ? 0 : cache_.format().sink_tokens;
      std::vector<float> rows(static_cast<std::size_t>(page) * d);
      for (std::size_t pg = 0; pg < pages.size(); ++pg)
        for (int h = 0; h < heads; ++h)
          for (const bool is_v : {false, true}) {
            if (is_v)
              traits::decode_v(cache_.format(), shape, cache_.engine().v_page(pages[pg], h), page, rows.data());
            else
              traits::decode_k(cache_.format(), shape, cache_.engine().k_page(pages[pg], h), page, rows.data());
            for (int t = pg == 0 ? sinks : 0; t < page; ++t) {
              const std::int64_t p = s.slots[pg * static_cast<std::size_t>(page) + static_cast<std::size_t>(t)];
              if (p < 0) continue;
              std::copy_n(rows.data() + static_cast<std::size_t>(t) * d, d,
                          (is_v ? held.v.data() : held.k.data()) + static_cast<std::size_t>(p) * row + static_cast<std::size_t>(h) * d);
            }
          }
      const std::vector<double> bound = quant_live_bounds(cache_, s.id, q, held, s.slots, s.sealed, scale);
      const synthetic::kv_data kv = live_rows(held, live);
      const auto exact_out = exact(q, kv, scale);
      for (std::size_t x = 0; x < exact_out.size(); ++x)
        if (!(std::abs(out[x] - exact_out[x]) <= bound[x])) fail_oracle(s, x, out[x], exact_out[x], bound[x]);
      return;
    }
    const synthetic::kv_data kv = live_rows(held, live);
    const double blocks = static_cast<double>(cache_.pages(s.id).size()) + 2;  // pages, sink rows, tail
    const auto exact_out = exact(q, kv, scale);
    const auto bound = attention_error_bound(q, kv, config_.group_size, scale, config_.storage, page, true, 0.0, 0.0, blocks);
    for (std::size_t x = 0; x < exact_out.size(); ++x)
      if (!(std::abs(out[x] - exact_out[x]) <= bound.per_element[x])) fail_oracle(s, x, out[x], exact_out[x], bound.per_element[x]);
  }
  /// The rows of `kv` at `positions`, in that order.
  static synthetic::kv_data live_rows(const synthetic::kv_data& kv, const std::vector<std::int64_t>& positions) {
    synthetic::kv_data r;
    r.num_kv_heads = kv.num_kv_heads;
    r.head_dim = kv.head_dim;
    const std::size_t row = static_cast<std::size_t>(kv.num_kv_heads) * kv.head_dim;
    for (const std::int64_t p : positions) {
      r.k.insert(r.k.end(), kv.k.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p) * row),
                 kv.k.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p + 1) * row));
      r.v.insert(r.v.end(), kv.v.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p) * row),
                 kv.v.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p + 1) * row));
      ++r.num_tokens;
    }
    return r;
  }

  /// End of the last final chunk (select::sentence_chunks), 0 when there is none.
  std::int64_t final_end(sequence_id id) const {
    if constexpr (needs_ids) {
      const auto chunks = cache_.chunks(id);
      return chunks.empty() ? 0 : chunks.back().end;
    } else {
      return 0;
    }
  }
  [[noreturn]] void fail_oracle(const shadow_model::sequence& s, std::size_t at, float got, double exact_value, double bound) const {
    std::ostringstream os;
    os.precision(9);
    os << "attend: seq " << s.id << " (length " << s.length() << ") output element " << at << " = " << got
       << "; fp64 exact attention " << exact_value << ", bound " << bound;
    fail(os.str());
  }

  cache_config config_;
  Cache cache_;
  shadow_model model_;
  check_options options_;
  std::ostringstream log_;
  std::int64_t ops_ = 0;
};

}  // namespace kvmosaic::test::ops
