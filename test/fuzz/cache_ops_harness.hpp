// SPDX-License-Identifier: Apache-2.0
#pragma once
// A host-backend cache driven by operation sequences next to a shadow model, shared by the seeded
// random differential test (test/unit/test_random_ops.cpp) and the libFuzzer target
// (test/fuzz/fuzz_cache_ops.cpp).
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
//     support/quant2_bound.hpp) over the tokens the step read (every token for select::all; the
//     selected ranges plus the tail, open chunk and sink rows for read-less selectors), within
//     the derived bound of support/oracle.hpp;
//   - finite (every input is finite).
// A mismatch throws `ops::failure` (a std::logic_error, never a kvmosaic::error) whose message
// names the operation; `log()` lists every operation so far, to reproduce it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"
#include "support/oracle.hpp"
#include "support/prune.hpp"
#include "support/quant2_bound.hpp"

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
    sequence_id id;
    std::vector<float> k, v;         ///< [token][heads][head_dim], as given
    std::vector<std::int32_t> ids;   ///< one per token
    std::vector<std::int64_t> pages; ///< model pages of the full pages, in order
    std::int64_t length() const { return static_cast<std::int64_t>(ids.size()); }
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
  std::int64_t tail(const sequence& s) const { return s.length() - static_cast<std::int64_t>(s.pages.size()) * page_size_; }
  /// Pages a write of n tokens to `s` seals.
  std::int64_t pages_for(const sequence& s, std::int64_t n) const { return (tail(s) + n) / page_size_; }

  void add(sequence_id id) { live_.push_back(sequence{id, {}, {}, {}, {}}); }
  void grow(std::size_t i, const rows& r, std::int64_t first, std::int64_t n) {
    sequence& s = live_[i];
    s.k.insert(s.k.end(), r.k.begin() + static_cast<std::ptrdiff_t>(first * static_cast<std::int64_t>(row_)),
               r.k.begin() + static_cast<std::ptrdiff_t>((first + n) * static_cast<std::int64_t>(row_)));
    s.v.insert(s.v.end(), r.v.begin() + static_cast<std::ptrdiff_t>(first * static_cast<std::int64_t>(row_)),
               r.v.begin() + static_cast<std::ptrdiff_t>((first + n) * static_cast<std::int64_t>(row_)));
    s.ids.insert(s.ids.end(), r.ids.begin() + first, r.ids.begin() + first + n);
    while (static_cast<std::int64_t>(s.pages.size()) < s.length() / page_size_) {
      refs_[next_page_] = 1;
      s.pages.push_back(next_page_++);
    }
  }
  void fork(std::size_t parent, sequence_id child) {
    sequence c = live_[parent];
    c.id = child;
    for (const std::int64_t p : c.pages) ++refs_[p];
    live_.push_back(std::move(c));
  }
  void remove(std::size_t i) {
    for (const std::int64_t p : live_[i].pages)
      if (--refs_[p] == 0) refs_.erase(p);
    removed_.push_back(live_[i].id);
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }

 private:
  int page_size_;
  std::int32_t pool_, max_sequences_;
  std::size_t row_;
  std::vector<sequence> live_;
  std::vector<sequence_id> removed_;
  std::map<std::int64_t, std::int32_t> refs_;
  std::int64_t next_page_ = 0;
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
    bool has_empty = false;
    for (const std::size_t i : which) {
      const auto& s = model_.live()[i];
      ids.push_back(s.id);
      has_empty = has_empty || s.length() == 0;
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
    if (options_.one_shot_reference) check_one_shot(which, q, out);
    if (options_.oracle)
      for (std::size_t b = 0; b < which.size(); ++b)
        check_oracle(model_.live()[which[b]], std::vector<float>(q.begin() + static_cast<std::ptrdiff_t>(b * per),
                                                                 q.begin() + static_cast<std::ptrdiff_t>((b + 1) * per)),
                     out.data() + b * per);
    check_state();
  }

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
      tokens += s.length();
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
    std::vector<float> probe;
  };
  snapshot take_snapshot() {
    snapshot s;
    s.memory = cache_.memory();
    std::vector<sequence_id> ids;
    for (const auto& seq : model_.live()) {
      s.lengths.push_back(cache_.length(seq.id));
      if (seq.length() > 0) ids.push_back(seq.id);
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
    } else if constexpr (std::is_same<format_type, format::quant2>::value) {
      held = quant2_decoded(cache_, s.id, stored);
      sinks = s.pages.empty() ? 0 : cache_.format().sink_tokens;
      if constexpr (reads_all) {
        const auto exact_out = exact(q, held, scale);
        const auto bounds = quant2_attention_bounds(cache_, s.id, q, held, scale);
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
