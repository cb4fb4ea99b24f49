// SPDX-License-Identifier: Apache-2.0
// Exact tokens every format keeps (docs/architecture.md, "Exact tokens"): `sink_tokens` and
// `recent_tokens` on format::dense, format::bitmap_tiles and format::quant2, with select::all,
// select::quest and select::sentence_chunks, on the host backend, against the fp64 oracle over
// the rows the cache attends (the sink and window rows exact, the rest as the format stores them).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../support/feed.hpp"
#include "../support/exact_rows.hpp"
#include "../support/oracle.hpp"
#include "../support/quant_bound.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;
using test::as_attended;

namespace {

using ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

cache_config small_config() {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 64;
  c.max_pages = 64;
  c.max_sequences = 4;
  return c;
}

std::vector<select::boundary> synthetic_boundaries() {
  std::vector<select::boundary> b;
  for (const auto& t : synthetic::boundary_tokens) b.push_back(select::boundary{t.id, t.weight});
  return b;
}

template <class Cache>
std::vector<float> attend_one(Cache& cache, sequence_id s, const std::vector<float>& q) {
  const cache_config& c = cache.config();
  const int heads = c.num_kv_heads * c.group_size;
  std::vector<float> out(static_cast<std::size_t>(heads) * c.head_dim);
  cache.attend(span<const sequence_id>(&s, 1), tensor_view<const float, 3>(q.data(), 1, heads, c.head_dim),
               tensor_view<float, 3>(out.data(), 1, heads, c.head_dim));
  return out;
}

/// Prefill `first` tokens, then append the rest one by one (the seal paths of both).
template <class Cache>
void feed(Cache& cache, sequence_id s, const synthetic::kv_data& kv, int first, const std::vector<std::int32_t>* ids = nullptr) {
  const cache_config& c = cache.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto k = [&](int from, int n) { return tensor_view<const float, 3>(kv.k.data() + from * row, n, c.num_kv_heads, c.head_dim); };
  const auto v = [&](int from, int n) { return tensor_view<const float, 3>(kv.v.data() + from * row, n, c.num_kv_heads, c.head_dim); };
  if constexpr (selector_traits<typename Cache::selector_type>::needs_token_ids) {
    cache.prefill(s, k(0, first), v(0, first), span<const std::int32_t>(ids->data(), first));
    for (int t = first; t < kv.num_tokens; ++t)
      cache.append(span<const sequence_id>(&s, 1), k(t, 1), v(t, 1), span<const std::int32_t>(ids->data() + t, 1));
  } else {
    (void)ids;
    cache.prefill(s, k(0, first), v(0, first));
    for (int t = first; t < kv.num_tokens; ++t) cache.append(span<const sequence_id>(&s, 1), k(t, 1), v(t, 1));
  }
}


/// The tokens of `kv` in `read` (ascending, disjoint ranges).
synthetic::kv_data subset(const synthetic::kv_data& kv, const ranges& read) {
  std::vector<std::int64_t> tokens;
  for (const auto& [from, to] : read)
    for (std::int64_t t = from; t < to; ++t) tokens.push_back(t);
  return test::tokens_of(kv, tokens);
}

/// |out - exact(data)| within the fp32 arithmetic bound of the host backend (data as stored).
void check_against(const std::vector<float>& out, const std::vector<float>& q, const synthetic::kv_data& data,
                   const cache_config& c, double scale) {
  const auto exact = test::exact(q, data, scale);
  const auto bound = test::attention_error_bound(q, data, c.group_size, scale, c.storage, c.page_size, true, 0.0, 0.0,
                                                 std::ceil(data.num_tokens / static_cast<double>(c.page_size)) + 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  }
}

template <class F>
F with_exact(F f, int sinks, int recent) {
  f.sink_tokens = sinks;
  f.recent_tokens = recent;
  return f;
}

format::bitmap_tiles half_pruned() {
  format::bitmap_tiles f;
  f.s_k = 0.5f;
  f.s_v = 0.5f;
  return f;
}
format::quant2 nearest_quant2() {
  format::quant2 f;
  f.mode = format::rounding::nearest;
  return f;
}

/// The attention of `cache` (S, W from its format) against the oracle over what it attends.
template <class Cache>
void check_format_against_oracle(Cache& cache, sequence_id s, const std::vector<float>& q, const synthetic::kv_data& stored,
                                 double scale) {
  const auto out = attend_one(cache, s, q);
  const synthetic::kv_data attended = as_attended(cache, s, stored);
  if constexpr (std::is_same<typename Cache::format_type, format::quant2>::value) {
    const synthetic::kv_data decoded = test::quant_decoded(cache, s, stored);
    REQUIRE(decoded.k == attended.k);
    const test::quant_bounds bounds = test::quant_attention_bounds(cache, s, q, decoded, scale);
    const auto exact = test::exact(q, decoded, scale);
    for (std::size_t i = 0; i < out.size(); ++i) {
      INFO("element " << i);
      REQUIRE(std::abs(out[i] - exact[i]) <= bounds.vs_exact[i]);
    }
  } else {
    check_against(out, q, attended, cache.config(), scale);
  }
}

template <class F>
void every_window(const F& base) {
  const cache_config c = small_config();
  const synthetic::kv_config syn = test::generator_for(c, 5);
  const int n = 340;  // 5 pages and 20 tail rows; appends cross the seal at 320
  const auto kv = synthetic::generate_kv(syn, 1, n);
  const auto q = synthetic::generate_query(syn, 1, n);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const double scale = 1.0 / 8.0;
  for (const auto& [sinks, recent] : std::vector<std::pair<int, int>>{{0, 0}, {4, 0}, {0, 32}, {4, 80}, {16, 200}, {1, 1024}}) {
    INFO(format_traits<F>::describe(with_exact(base, sinks, recent)));
    cache<F> kv_cache(c, with_exact(base, sinks, recent));
    const sequence_id s = kv_cache.add_sequence();
    feed(kv_cache, s, kv, 300);
    check_format_against_oracle(kv_cache, s, q, stored, scale);
    // The same tokens in one prefill: the same rows, the same output.
    cache<F> whole(c, with_exact(base, sinks, recent));
    const sequence_id w = whole.add_sequence();
    feed(whole, w, kv, n);
    CHECK(attend_one(whole, w, q) == attend_one(kv_cache, s, q));
    // Accounting: 5 pages, 20 tail rows and min(S + W, 320) exact rows of 2 x 2 x 64 x 2 bytes.
    const memory_stats m = kv_cache.sequence_memory(s);
    CHECK(m.stored_bytes == 5 * static_cast<std::int64_t>(kv_cache.engine().page_slot_bytes()) +
                                (20 + std::min(sinks + recent, 320)) * 512);
    CHECK(kv_cache.memory().stored_bytes == m.stored_bytes);
    // A fork attends the same; the child's appends leave the parent alone.
    const sequence_id child = kv_cache.fork_sequence(s);
    CHECK(attend_one(kv_cache, child, q) == attend_one(kv_cache, s, q));
    const auto before = attend_one(kv_cache, s, q);
    const auto more = synthetic::generate_kv(syn, 7, 64);
    kv_cache.append(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(more.k.data(), 1, 2, 64),
                    tensor_view<const float, 3>(more.v.data(), 1, 2, 64));
    for (int t = 1; t < 64; ++t)
      kv_cache.append(span<const sequence_id>(&child, 1), tensor_view<const float, 3>(more.k.data() + t * 128, 1, 2, 64),
                      tensor_view<const float, 3>(more.v.data() + t * 128, 1, 2, 64));
    CHECK(attend_one(kv_cache, s, q) == before);
    synthetic::kv_data grown = stored;
    const synthetic::kv_data more_stored = test::rounded(more, c.storage);
    grown.k.insert(grown.k.end(), more_stored.k.begin(), more_stored.k.end());
    grown.v.insert(grown.v.end(), more_stored.v.begin(), more_stored.v.end());
    grown.num_tokens += 64;
    check_format_against_oracle(kv_cache, child, q, grown, scale);
  }
  // Before the first seal the exact rows are tail rows: nothing counted twice.
  cache<F> short_cache(c, with_exact(base, 4, 80));
  const sequence_id s = short_cache.add_sequence();
  feed(short_cache, s, kv, 10);
  (void)s;
}

}  // namespace

TEST_CASE("exact tokens: every format with sinks and a recent window attends them exactly", "[exact_tokens]") {
  SECTION("dense") { every_window(format::dense{}); }
  SECTION("bitmap_tiles") { every_window(half_pruned()); }
  SECTION("quant2") { every_window(nearest_quant2()); }
}

TEST_CASE("exact tokens: dense with sinks and a window is plain dense attention", "[exact_tokens]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = test::generator_for(c, 8);
  const int n = 333;
  const auto kv = synthetic::generate_kv(syn, 2, n);
  const auto q = synthetic::generate_query(syn, 2, n);
  cache<format::dense> plain(c), exact(c, with_exact(format::dense{}, 4, 96));
  const sequence_id a = plain.add_sequence(), b = exact.add_sequence();
  feed(plain, a, kv, n);
  feed(exact, b, kv, n);
  check_against(attend_one(exact, b, q), q, test::rounded(kv, c.storage), c, 1.0 / 8.0);
  const auto x = attend_one(plain, a, q), y = attend_one(exact, b, q);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(std::abs(x[i] - y[i]) <= 1e-5 * (1 + std::abs(x[i])));
}

TEST_CASE("exact tokens: a window covering the sequence makes compressed formats exact", "[exact_tokens]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = test::generator_for(c, 11);
  const int n = 300;
  const auto kv = synthetic::generate_kv(syn, 3, n);
  const auto q = synthetic::generate_query(syn, 3, n);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  cache<format::bitmap_tiles> bitmap(c, with_exact(half_pruned(), 0, 1024));
  cache<format::quant2> quant(c, with_exact(format::quant2{}, 2, 300));
  const sequence_id a = bitmap.add_sequence(), b = quant.add_sequence();
  feed(bitmap, a, kv, 100);
  feed(quant, b, kv, 299);
  check_against(attend_one(bitmap, a, q), q, stored, c, 1.0 / 8.0);
  check_against(attend_one(quant, b, q), q, stored, c, 1.0 / 8.0);
}

namespace {

/// With selector S over format F (S = 4, W = 80): budget 0 reads the sinks, the window and the
/// tail (and, for sentence chunks, the open chunk); a budget of the whole context reads what
/// select::all reads; a selection never picks a span inside the window.
template <class F, class Sel>
void selector_reads_exact_tokens(const F& base, Sel selector) {
  const cache_config c = small_config();
  const synthetic::kv_config syn = test::generator_for(c, 13);
  const int n = 340;
  const auto kv = synthetic::generate_kv(syn, 4, n);
  const auto tokens = synthetic::generate_tokens(syn, 4, n);
  const auto q = synthetic::generate_query(syn, 4, n);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const F f = with_exact(base, 4, 80);
  const std::int64_t sealed = 320, window_from = sealed - 80;
  constexpr bool chunks = selector_traits<Sel>::needs_token_ids;
  if constexpr (chunks) selector.boundaries = synthetic_boundaries();

  cache<F> all(c, f);
  const sequence_id a = all.add_sequence();
  feed(all, a, kv, 300);
  const auto everything = attend_one(all, a, q);

  selector.budget.tokens = 10 * n;
  cache<F, Sel> whole(c, f, selector);
  const sequence_id w = whole.add_sequence();
  feed(whole, w, kv, 300, &tokens.ids);
  CHECK(attend_one(whole, w, q) == everything);

  selector.budget.tokens = 0;
  cache<F, Sel> none(c, f, selector);
  const sequence_id z = none.add_sequence();
  feed(none, z, kv, 300, &tokens.ids);
  const auto out = attend_one(none, z, q);
  std::int64_t open = window_from;
  if constexpr (chunks) open = std::min(open, none.chunks(z).back().end);
  const synthetic::kv_data read = subset(stored, {{0, 4}, {open, n}});
  check_against(out, q, read, c, 1.0 / 8.0);
  if constexpr (!chunks) {
    CHECK(none.selection(z).tokens_read == Approx(4 + 80 + 20));
    CHECK(none.selection(z).pages_read == 0);
  }

  // A budget of a quarter: the picked spans all start before the window.
  selector.budget.tokens = n / 4;
  cache<F, Sel> some(c, f, selector);
  const sequence_id y = some.add_sequence();
  feed(some, y, kv, 300, &tokens.ids);
  (void)attend_one(some, y, q);
  for (int h = 0; h < c.num_kv_heads; ++h)
    for (const auto& [from, to] : some.selected_ranges(y, h)) {
      INFO("head " << h << ": [" << from << ", " << to << ")");
      CHECK(from < window_from);
    }
}

}  // namespace

TEST_CASE("exact tokens: read-less selectors always read the sinks and the window, on no budget", "[exact_tokens][selectors]") {
  select::quest quest;
  quest.block_tokens = 16;
  select::sentence_chunks chunks;
  SECTION("dense") {
    selector_reads_exact_tokens(format::dense{}, quest);
    selector_reads_exact_tokens(format::dense{}, chunks);
  }
  SECTION("bitmap_tiles") {
    selector_reads_exact_tokens(half_pruned(), quest);
    selector_reads_exact_tokens(half_pruned(), chunks);
  }
  SECTION("quant2") {
    selector_reads_exact_tokens(nearest_quant2(), quest);
    selector_reads_exact_tokens(nearest_quant2(), chunks);
  }
}

TEST_CASE("exact tokens: bad values are rejected by name", "[exact_tokens]") {
  const cache_config c = small_config();
  const auto message = [&](auto format) {
    try {
      cache<decltype(format)> bad(c, format);
      return std::string("accepted");
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
  };
  for (const int sinks : {-1, 17}) {
    CHECK(message(with_exact(format::dense{}, sinks, 0)) ==
          "kvmosaic: format::dense: sink_tokens = " + std::to_string(sinks) + "; allowed: 0 to 16");
    CHECK(message(with_exact(half_pruned(), sinks, 0)) ==
          "kvmosaic: format::bitmap_tiles: sink_tokens = " + std::to_string(sinks) + "; allowed: 0 to 16");
  }
  for (const int recent : {-1, 1025}) {
    CHECK(message(with_exact(format::dense{}, 0, recent)) ==
          "kvmosaic: format::dense: recent_tokens = " + std::to_string(recent) + "; allowed: 0 to 1024");
    CHECK(message(with_exact(half_pruned(), 0, recent)) ==
          "kvmosaic: format::bitmap_tiles: recent_tokens = " + std::to_string(recent) + "; allowed: 0 to 1024");
    CHECK(message(with_exact(format::quant2{}, 0, recent)) ==
          "kvmosaic: format::quant2: recent_tokens = " + std::to_string(recent) + "; allowed: 0 to 1024");
  }
  CHECK(message(with_exact(format::dense{}, 16, 1024)) == "accepted");
  // A window with a compactor that frees memory: rejected at construction.
  try {
    cache<format::quant2, select::all, compact::repack> bad(c, with_exact(format::quant2{}, 4, 32));
    FAIL("accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()) ==
          "kvmosaic: quant2 with compact::repack: recent_tokens = 32; allowed: 0 with a compactor that frees memory "
          "(evicted caches keep no exact window)");
  }
  cache<format::dense, select::all, compact::hole_fill> sinks_only(c, with_exact(format::dense{}, 4, 0));
  CHECK(sinks_only.memory().pages_free == c.max_pages);
}

TEST_CASE("exact tokens: sinks of dense and bitmap_tiles survive eviction and compaction", "[exact_tokens][eviction]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = test::generator_for(c, 17);
  const int n = 300;
  const auto kv = synthetic::generate_kv(syn, 5, n);
  const auto q = synthetic::generate_query(syn, 5, n);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const auto run = [&](auto format) {
    cache<decltype(format), select::all, compact::repack> kv_cache(c, with_exact(format, 4, 0));
    const sequence_id s = kv_cache.add_sequence();
    feed(kv_cache, s, kv, n);
    std::vector<std::int64_t> evicted;
    for (std::int64_t t = 10; t < 150; ++t) evicted.push_back(t);
    kv_cache.evict(s, span<const std::int64_t>(evicted.data(), static_cast<std::int64_t>(evicted.size())));
    kv_cache.compact(s);
    std::vector<std::int64_t> live;
    for (std::int64_t t = 0; t < n; ++t)
      if (t < 10 || t >= 150) live.push_back(t);
    const auto out = attend_one(kv_cache, s, q);
    if constexpr (std::is_same<decltype(format), format::dense>::value) {
      check_against(out, q, test::tokens_of(stored, live), c, 1.0 / 8.0);
    } else {  // the sinks exact; everything else as the pages hold it (moved pages re-pruned)
      CHECK(std::all_of(out.begin(), out.end(), [](float x) { return std::isfinite(x); }));
    }
  };
  run(format::dense{});
  run(half_pruned());
}

TEST_CASE("a range holds an exact position exactly when one of its positions is one", "[exact_tokens]") {
  // The device's row masks look only at the pages that any_exact_position admits.
  for (const int sinks : {0, 1, 4, 16})
    for (const int window : {0, 1, 64, 130}) {
      format::dense f;
      f.sink_tokens = sinks;
      f.recent_tokens = window;
      const detail::arena_geometry g(detail::engine_shape{1, 1, 64, 64, dtype::bf16, 8, 1}, f);
      for (const std::int64_t sealed : {0, 64, 192, 1024})
        for (std::int64_t from = 0; from <= sealed; from += 16)
          for (const std::int64_t rows : {0, 1, 16, 32, 64}) {
            const std::int64_t to = std::min(from + rows, sealed);
            bool any = false;
            for (std::int64_t t = from; t < to; ++t) any = any || g.exact_position(t, sealed);
            CAPTURE(sinks, window, sealed, from, to);
            CHECK(g.any_exact_position(from, to, sealed) == any);
          }
    }
}
