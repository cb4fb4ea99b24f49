// SPDX-License-Identifier: Apache-2.0
// select::per_kv_head<S> (per_kv_head_cache.hpp): each KV head evicts by its own scores within its
// own budget (against a brute-force ranking of that head's scores), attention reads exactly each
// head's live tokens (fp64 oracle), the pool gives back memory per head (the gauge), a head equals
// a one-head cache fed that head's data, and the rejections. Also the per-sequence budget of a
// plain keep-less cache (`cache::set_budget(seq, budget)`), which the lanes are built on.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using test::append_token;
using test::attend_one;
using test::prefill_tokens;
using test::step_query;

cache_config small_config(int max_pages = 64) { return test::two_head_config(max_pages); }

std::vector<std::int64_t> live_of(const std::vector<std::int64_t>& positions) {
  std::vector<std::int64_t> live;
  for (const std::int64_t p : positions)
    if (p >= 0) live.push_back(p);
  std::sort(live.begin(), live.end());
  return live;
}

/// The `count` lowest of `candidates` by one head's scores (`scores[position]`), ties to the
/// earlier position: the brute force each head's choice is checked against.
std::vector<std::int64_t> brute_lowest(const std::vector<float>& scores, const std::vector<std::int64_t>& candidates,
                                       std::int64_t count) {
  std::vector<std::pair<float, std::int64_t>> all;
  for (const std::int64_t p : candidates) all.emplace_back(scores[static_cast<std::size_t>(p)], p);
  std::sort(all.begin(), all.end());
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < std::min<std::int64_t>(count, static_cast<std::int64_t>(all.size())); ++i)
    out.push_back(all[static_cast<std::size_t>(i)].second);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::int64_t> difference(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b) {
  std::vector<std::int64_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

/// Head `head` of `data` as one-head data.
synthetic::kv_data one_head(const synthetic::kv_data& data, int head) {
  synthetic::kv_data out = data;
  out.num_kv_heads = 1;
  out.k.clear();
  out.v.clear();
  const std::size_t d = static_cast<std::size_t>(data.head_dim), heads = static_cast<std::size_t>(data.num_kv_heads);
  for (std::size_t t = 0; t < static_cast<std::size_t>(data.num_tokens); ++t) {
    const std::size_t at = (t * heads + static_cast<std::size_t>(head)) * d;
    out.k.insert(out.k.end(), data.k.begin() + static_cast<std::ptrdiff_t>(at), data.k.begin() + static_cast<std::ptrdiff_t>(at + d));
    out.v.insert(out.v.end(), data.v.begin() + static_cast<std::ptrdiff_t>(at), data.v.begin() + static_cast<std::ptrdiff_t>(at + d));
  }
  return out;
}

/// Checks head `head`'s query heads of `out` against fp64 attention over that head's `live` tokens.
void check_head_output(const cache_config& c, const std::vector<float>& q, const std::vector<float>& out,
                       const synthetic::kv_data& data, int head, const std::vector<std::int64_t>& live) {
  const std::size_t d = static_cast<std::size_t>(c.head_dim), g = static_cast<std::size_t>(c.group_size);
  const std::vector<float> q_head(q.begin() + static_cast<std::ptrdiff_t>(head * g * d),
                                  q.begin() + static_cast<std::ptrdiff_t>((head + 1) * g * d));
  const synthetic::kv_data kept = test::tokens_of(test::rounded(one_head(data, head), c.storage), live);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const std::vector<double> exact = test::exact(q_head, kept, scale);
  const test::error_bound bound =
      test::attention_error_bound(q_head, kept, c.group_size, scale, c.storage, c.page_size, true, 0.0, 0.0, 8);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("head " << head << ", element " << i);
    REQUIRE(std::abs(out[static_cast<std::size_t>(head) * g * d + i] - exact[i]) <= bound.per_element[i]);
  }
}

using h2o_cache = cache<format::dense, select::per_kv_head<select::h2o>, compact::repack>;

}  // namespace

TEST_CASE("per_kv_head<h2o>: each head keeps its recent window and its own heaviest hitters within its own budget",
          "[per_kv_head][scores][eviction][h2o]") {
  const cache_config c = small_config(12);  // 400 tokens of 2 heads need 50 head pages: 24 exist
  select::per_kv_head<select::h2o> s;
  s.selector.compact_every = 16;
  s.budgets.resize(2);
  s.budgets[0].tokens = 32;  // 16 recent, 16 heavy hitters
  s.budgets[1].tokens = 96;  // 48 recent, 48 heavy hitters
  h2o_cache kv(c, {}, s);
  CHECK(kv.describe() == "dense/per_kv_head(h2o(1/16, recent 0.5, sum, compact every 16), budgets 32 tokens; 96 tokens)/repack");
  const int total = 400;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 11), 0, total);
  const sequence_id seq = kv.add_sequence();
  prefill_tokens(kv, seq, data, 40);
  for (int t = 40; t < total; ++t) {
    const std::vector<float> q = step_query(c, t);
    const std::vector<float> out = attend_one(kv, seq, q);
    std::vector<std::vector<float>> scores(2);
    std::vector<std::vector<std::int64_t>> before(2);
    for (int h = 0; h < 2; ++h) {
      before[static_cast<std::size_t>(h)] = live_of(kv.positions(seq, h));
      check_head_output(c, q, out, data, h, before[static_cast<std::size_t>(h)]);
      scores[static_cast<std::size_t>(h)] = kv.token_scores(seq, h);
      REQUIRE(scores[static_cast<std::size_t>(h)].size() == static_cast<std::size_t>(t));  // one head: [position]
    }
    append_token(kv, seq, data, t);
    const std::int64_t n = t + 1;
    CAPTURE(t);
    for (int h = 0; h < 2; ++h) {
      const std::int64_t budget = s.budgets[static_cast<std::size_t>(h)].tokens, recent = budget / 2;
      const std::vector<std::int64_t> live = live_of(kv.positions(seq, h));
      for (std::int64_t p = std::max<std::int64_t>(0, n - recent); p < n; ++p) REQUIRE(std::binary_search(live.begin(), live.end(), p));
      const std::int64_t open_from = n - (kv.stored_tokens(seq, h) - static_cast<std::int64_t>(kv.lanes().pages(kv.lanes(seq)[static_cast<std::size_t>(h)]).size()) * c.page_size);
      std::vector<std::int64_t> candidates;
      for (const std::int64_t p : before[static_cast<std::size_t>(h)])
        if (p < std::min<std::int64_t>({open_from, n - recent, t})) candidates.push_back(p);
      const std::int64_t stored = static_cast<std::int64_t>(before[static_cast<std::size_t>(h)].size()) + 1;
      INFO("head " << h);
      REQUIRE(difference(before[static_cast<std::size_t>(h)], live) ==
              brute_lowest(scores[static_cast<std::size_t>(h)], candidates, stored - budget));
      if (t >= 120) REQUIRE(static_cast<std::int64_t>(live.size()) == budget);
    }
  }
  // The heads kept different tokens, and each holds only the pages of its own budget.
  CHECK(live_of(kv.positions(seq, 0)) != live_of(kv.positions(seq, 1)));
  const memory_stats m = kv.memory();
  CHECK(m.pages_used <= (32 + 16 + 15) / 16 + (96 + 16 + 15) / 16 + 2);
  CHECK(m.pages_used == static_cast<std::int32_t>(kv.lanes().pages(kv.lanes(seq)[0]).size() + kv.lanes().pages(kv.lanes(seq)[1]).size()));
}

TEST_CASE("per_kv_head frees memory by head: with budgets that differ, the pool holds fewer pages than one shared decision",
          "[per_kv_head][memory]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::tova> s;
  s.selector.compact_every = 8;
  s.budgets = {select::token_budget{0, 32}, select::token_budget{0, 256}};
  cache<format::dense, select::per_kv_head<select::tova>, compact::repack> heads(c, {}, s);
  select::tova shared_budget = s.selector;
  shared_budget.budget.tokens = 256;  // one decision for both heads: the larger head's budget
  cache<format::dense, select::tova, compact::repack> shared(c, {}, shared_budget);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 13), 0, 600);
  const sequence_id a = heads.add_sequence(), b = shared.add_sequence();
  prefill_tokens(heads, a, data, 64);
  prefill_tokens(shared, b, data, 64);
  for (int t = 64; t < 600; ++t) {
    const std::vector<float> q = step_query(c, t);
    attend_one(heads, a, q);
    attend_one(shared, b, q);
    append_token(heads, a, data, t);
    append_token(shared, b, data, t);
  }
  heads.compact(a);
  shared.compact(b);
  const memory_stats mh = heads.sequence_memory(a), ms = shared.sequence_memory(b);
  INFO("head pages " << mh.pages_used << " (" << mh.stored_bytes << " bytes), all-heads pages " << ms.pages_used << " ("
                     << ms.stored_bytes << " bytes)");
  CHECK(heads.stored_tokens(a, 0) < 32 + 16);  // its budget, plus at most the tail
  CHECK(heads.stored_tokens(a, 1) < 256 + 16);
  CHECK(heads.pool().used_pages() == (heads.stored_tokens(a, 0) / 16) + (heads.stored_tokens(a, 1) / 16));
  // A head page is half an all-heads page here (2 heads): the shared decision holds the larger
  // budget's pages for both heads; per head, (32 + 256) / (2 x 256) of them.
  CHECK(shared.pool().used_pages() >= 256 / 16);
  CHECK(heads.pool().used_pages() <= (32 + 256) / 16 + 2);
  CHECK(static_cast<double>(mh.stored_bytes) < 0.6 * static_cast<double>(ms.stored_bytes));
  CHECK(mh.tokens == (heads.stored_tokens(a, 0) + heads.stored_tokens(a, 1)) / 2);
}

TEST_CASE("per_kv_head: a head is a one-head cache fed that head's data", "[per_kv_head][views]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::h2o> s;
  s.selector.compact_every = 4;
  s.budgets = {select::token_budget{0, 40}, select::token_budget{0, 72}};
  h2o_cache kv(c, {}, s);
  cache_config one = c;
  one.num_kv_heads = 1;
  std::vector<cache<format::dense, select::h2o, compact::repack>> alone;
  for (int h = 0; h < 2; ++h) {
    select::h2o sh = s.selector;
    sh.budget = s.budgets[static_cast<std::size_t>(h)];
    alone.emplace_back(one, format::dense{}, sh);
  }
  const int total = 200;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 17), 0, total);
  const synthetic::kv_data heads[2] = {one_head(data, 0), one_head(data, 1)};
  const sequence_id seq = kv.add_sequence();
  sequence_id lone[2];
  prefill_tokens(kv, seq, data, 50);
  for (int h = 0; h < 2; ++h) {
    lone[h] = alone[static_cast<std::size_t>(h)].add_sequence();
    prefill_tokens(alone[static_cast<std::size_t>(h)], lone[h], heads[h], 50);
  }
  const std::size_t d = static_cast<std::size_t>(c.head_dim);
  for (int t = 50; t < total; ++t) {
    const std::vector<float> q = step_query(c, t);
    const std::vector<float> out = attend_one(kv, seq, q);
    for (int h = 0; h < 2; ++h) {
      const std::vector<float> qh(q.begin() + static_cast<std::ptrdiff_t>(h * 2 * d),
                                  q.begin() + static_cast<std::ptrdiff_t>((h + 1) * 2 * d));
      const std::vector<float> oh = attend_one(alone[static_cast<std::size_t>(h)], lone[h], qh);
      INFO("t " << t << ", head " << h);
      REQUIRE(std::equal(oh.begin(), oh.end(), out.begin() + static_cast<std::ptrdiff_t>(h * 2 * d)));
    }
    append_token(kv, seq, data, t);
    for (int h = 0; h < 2; ++h) {
      append_token(alone[static_cast<std::size_t>(h)], lone[h], heads[h], t);
      REQUIRE(kv.positions(seq, h) == alone[static_cast<std::size_t>(h)].positions(lone[h]));
      REQUIRE(kv.token_scores(seq, h) == alone[static_cast<std::size_t>(h)].token_scores(lone[h]));
    }
  }
}

TEST_CASE("per_kv_head: a batch whose k, v do not collapse is written head by head, as one that does",
          "[per_kv_head][views]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::tova> s;
  s.selector.compact_every = 3;
  s.budgets = {select::token_budget{0, 24}, select::token_budget{0, 40}};
  using tova_cache = cache<format::dense, select::per_kv_head<select::tova>, compact::repack>;
  tova_cache contiguous(c, {}, s), head_major(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 19), 0, 160);
  const std::size_t d = static_cast<std::size_t>(c.head_dim);
  sequence_id a[2], b[2];
  for (int i = 0; i < 2; ++i) {
    a[i] = contiguous.add_sequence();
    b[i] = head_major.add_sequence();
    prefill_tokens(contiguous, a[i], data, 30);
    prefill_tokens(head_major, b[i], data, 30);
  }
  for (int t = 30; t < 160; ++t) {
    // Sequence i appends token t - 10 i of the data ([batch][head][d] in k, [head][batch][d] in kh).
    std::vector<float> q(2 * 4 * d), k(2 * 2 * d), v(k.size()), kh(k.size()), vh(k.size());
    for (std::size_t i = 0; i < 2; ++i) {
      const std::vector<float> qi = step_query(c, t + 7 * static_cast<int>(i));
      std::copy(qi.begin(), qi.end(), q.begin() + static_cast<std::ptrdiff_t>(i * 4 * d));
      const std::size_t token = static_cast<std::size_t>(t) - 10 * i;
      for (std::size_t h = 0; h < 2; ++h)
        for (std::size_t x = 0; x < d; ++x) {
          const std::size_t from = (token * 2 + h) * d + x;
          k[(i * 2 + h) * d + x] = kh[(h * 2 + i) * d + x] = data.k[from];
          v[(i * 2 + h) * d + x] = vh[(h * 2 + i) * d + x] = data.v[from];
        }
    }
    std::vector<float> out_a(q.size()), out_b(q.size());
    contiguous.attend(span<const sequence_id>(a, 2), tensor_view<const float, 3>(q.data(), 2, 4, c.head_dim),
                      tensor_view<float, 3>(out_a.data(), 2, 4, c.head_dim));
    head_major.attend(span<const sequence_id>(b, 2), tensor_view<const float, 3>(q.data(), 2, 4, c.head_dim),
                      tensor_view<float, 3>(out_b.data(), 2, 4, c.head_dim));
    REQUIRE(out_a == out_b);
    contiguous.append(span<const sequence_id>(a, 2), tensor_view<const float, 3>(k.data(), 2, 2, c.head_dim),
                      tensor_view<const float, 3>(v.data(), 2, 2, c.head_dim));
    const std::int64_t extents[3] = {2, 2, c.head_dim}, strides[3] = {c.head_dim, 2 * c.head_dim, 1};
    head_major.append(span<const sequence_id>(b, 2), tensor_view<const float, 3>::strided(kh.data(), extents, strides),
                      tensor_view<const float, 3>::strided(vh.data(), extents, strides));
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) REQUIRE(contiguous.positions(a[i], h) == head_major.positions(b[i], h));
  }
  CHECK(contiguous.stored_tokens(a[0], 0) < contiguous.stored_tokens(a[0], 1));
}

TEST_CASE("per_kv_head<snapkv>: each head's snapshot keeps its budget by its own pooled votes", "[per_kv_head][snapkv]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::snapkv> s;
  s.selector.window = 8;
  s.budgets = {select::token_budget{0, 40}, select::token_budget{0, 100}};
  cache<format::dense, select::per_kv_head<select::snapkv>, compact::repack> kv(c, {}, s);
  cache_config one = c;
  one.num_kv_heads = 1;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 23), 0, 300);
  const sequence_id seq = kv.add_sequence();
  prefill_tokens(kv, seq, data, 300);
  std::vector<float> window(static_cast<std::size_t>(8 * c.num_q_heads() * c.head_dim));
  for (std::size_t i = 0; i < window.size(); ++i) window[i] = std::sin(0.37f * static_cast<float>(i));
  const std::int64_t evicted = kv.snapshot(seq, tensor_view<const float, 3>(window.data(), 8, c.num_q_heads(), c.head_dim));
  const std::size_t gd = static_cast<std::size_t>(c.group_size * c.head_dim);
  std::int64_t expected_evicted = 0;
  for (int h = 0; h < 2; ++h) {
    select::snapkv sh = s.selector;
    sh.budget = s.budgets[static_cast<std::size_t>(h)];
    cache<format::dense, select::snapkv, compact::repack> alone(one, {}, sh);
    const sequence_id lone = alone.add_sequence();
    prefill_tokens(alone, lone, one_head(data, h), 300);
    std::vector<float> wh;  // head h's query heads of each window query
    for (std::size_t w = 0; w < 8; ++w) {
      const auto from = window.begin() + static_cast<std::ptrdiff_t>((w * 2 + static_cast<std::size_t>(h)) * gd);
      wh.insert(wh.end(), from, from + static_cast<std::ptrdiff_t>(gd));
    }
    expected_evicted += alone.snapshot(lone, tensor_view<const float, 3>(wh.data(), 8, c.group_size, c.head_dim));
    INFO("head " << h);
    CHECK(kv.positions(seq, h) == alone.positions(lone));
    CHECK(static_cast<std::int64_t>(live_of(kv.positions(seq, h)).size()) == s.budgets[static_cast<std::size_t>(h)].tokens);
  }
  CHECK(evicted == expected_evicted);
  CHECK(evicted == (300 - 40) + (300 - 100));
}

TEST_CASE("per_kv_head: budgets of 0, the whole context and beyond; forks; set_budget per head", "[per_kv_head][budgets]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::tova> s;
  s.selector.compact_every = 1;
  s.budgets = {select::token_budget{0, 0}, select::token_budget{0, 1 << 20}};
  cache<format::dense, select::per_kv_head<select::tova>, compact::repack> kv(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 29), 0, 140);
  const sequence_id seq = kv.add_sequence();
  prefill_tokens(kv, seq, data, 100);
  attend_one(kv, seq, step_query(c, 1));
  append_token(kv, seq, data, 100);  // 101 tokens: head 0 keeps only its tail, head 1 everything
  CHECK(live_of(kv.positions(seq, 0)).size() == 101u % 16u);
  CHECK(live_of(kv.positions(seq, 1)).size() == 101u);
  CHECK(kv.budget(seq, 1).tokens == (1 << 20));
  // A fork shares the pages of both heads; its budgets are its own from then on.
  const sequence_id child = kv.fork_sequence(seq);
  kv.set_budget(child, 1, select::token_budget{0, 64});
  CHECK(kv.budget(seq, 1).tokens == (1 << 20));
  attend_one(kv, child, step_query(c, 2));
  append_token(kv, child, data, 101);
  CHECK(live_of(kv.positions(child, 1)).size() == 64u);
  CHECK(live_of(kv.positions(seq, 1)).size() == 101u);
  // Head 1's budget set to the whole context by ratio: it evicts nothing more.
  kv.set_budget(seq, 1, select::token_budget{1.0, -1});
  attend_one(kv, seq, step_query(c, 3));
  append_token(kv, seq, data, 101);
  CHECK(live_of(kv.positions(seq, 1)).size() == 102u);
  CHECK(kv.length(seq) == 102);
  kv.remove_sequence(child);
  kv.remove_sequence(seq);
  CHECK(kv.pool().used_pages() == 0);
}

TEST_CASE("per_kv_head rejects bad input, naming it", "[per_kv_head][errors]") {
  const cache_config c = small_config(4);
  select::per_kv_head<select::tova> s;
  s.budgets.resize(3);
  using tova_cache = cache<format::dense, select::per_kv_head<select::tova>, compact::repack>;
  CHECK_THROWS_WITH(tova_cache(c, {}, s), Catch::Contains("budgets.size()") && Catch::Contains("num_kv_heads"));
  s.budgets = {select::token_budget{2.0, -1}, select::token_budget{}};
  CHECK_THROWS_WITH(tova_cache(c, {}, s), Catch::Contains("budget.ratio"));
  s.budgets.clear();
  s.selector.compact_every = 0;
  CHECK_THROWS_WITH(tova_cache(c, {}, s), Catch::Contains("compact_every"));
  s.selector.compact_every = 8;
  cache_config huge = c;
  huge.max_pages = limits::max_pool_pages;
  CHECK_THROWS_WITH(tova_cache(huge, {}, s), Catch::Contains("max_pages") && Catch::Contains("num_kv_heads"));

  tova_cache kv(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 31), 0, 200);
  const sequence_id seq = kv.add_sequence();
  CHECK_THROWS_WITH(kv.positions(seq, 2), Catch::Contains("head"));
  CHECK_THROWS_WITH(kv.set_budget(seq, -1, select::token_budget{}), Catch::Contains("head"));
  CHECK_THROWS_WITH(kv.set_budget(seq, 0, select::token_budget{-1.0, -1}), Catch::Contains("budget.ratio"));
  CHECK_THROWS_WITH(kv.positions(seq + 1, 0), Catch::Contains("seq"));
  // 8 head pages: a prefill of 80 tokens needs 10; nothing is stored in any head.
  CHECK_THROWS_AS(prefill_tokens(kv, seq, data, 80), capacity_error);
  CHECK(kv.stored_tokens(seq, 0) == 0);
  CHECK(kv.stored_tokens(seq, 1) == 0);
  CHECK(kv.pool().used_pages() == 0);
  CHECK_THROWS_WITH(kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 10, 1, c.head_dim),
                               tensor_view<const float, 3>(data.v.data(), 10, 1, c.head_dim)),
                    Catch::Contains("num_kv_heads"));
  prefill_tokens(kv, seq, data, 20);
  const sequence_id second = kv.add_sequence();
  prefill_tokens(kv, second, data, 20);
  // A query whose first two dimensions do not collapse: [query head][batch][d] in memory.
  std::vector<float> q(static_cast<std::size_t>(2 * c.num_q_heads() * c.head_dim)), out(q.size());
  const std::int64_t extents[3] = {2, c.num_q_heads(), c.head_dim};
  const std::int64_t strides[3] = {c.head_dim, 2 * c.head_dim, 1};
  const sequence_id both[] = {seq, second};
  CHECK_THROWS_WITH(kv.attend(span<const sequence_id>(both, 2), tensor_view<const float, 3>::strided(q.data(), extents, strides),
                              tensor_view<float, 3>(out.data(), 2, c.num_q_heads(), c.head_dim)),
                    Catch::Contains("q") && Catch::Contains("stride(0) == extent(1) x stride(1)"));
  CHECK_THROWS_AS(kv.add_sequence(), capacity_error);
  kv.remove_sequence(seq);
  CHECK_THROWS_WITH(kv.length(seq), Catch::Contains("seq"));
}

TEST_CASE("a keep-less cache keeps a budget per sequence: cache::set_budget(seq, budget)", "[budgets][eviction]") {
  const cache_config c = small_config(64);
  select::tova s;
  s.budget.tokens = 48;
  s.compact_every = 4;
  cache<format::dense, select::tova, compact::repack> kv(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 37), 0, 200);
  const sequence_id a = kv.add_sequence(), b = kv.add_sequence();
  kv.set_budget(b, select::token_budget{0, 80});
  CHECK(kv.budget(a).tokens == 48);
  CHECK(kv.budget(b).tokens == 80);
  prefill_tokens(kv, a, data, 100);
  prefill_tokens(kv, b, data, 100);
  for (int t = 100; t < 140; ++t) {
    attend_one(kv, a, step_query(c, t));
    attend_one(kv, b, step_query(c, t));
    append_token(kv, a, data, t);
    append_token(kv, b, data, t);
  }
  CHECK(live_of(kv.positions(a)).size() == 48u);
  CHECK(live_of(kv.positions(b)).size() == 80u);
  kv.remove_sequence(a);
  const sequence_id fork = kv.fork_sequence(b);
  CHECK(kv.budget(fork).tokens == 80);
  CHECK_THROWS_WITH(kv.set_budget(b, select::token_budget{1.5, -1}), Catch::Contains("budget.ratio"));
  CHECK_THROWS_WITH(kv.budget(a), Catch::Contains("seq"));
}

TEST_CASE("per_kv_head behind layer_cache: the same attention; read and window votes rejected, naming the selector",
          "[per_kv_head][model_cache]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::snapkv> s;
  s.selector.window = 4;
  s.budgets = {select::token_budget{0, 24}, select::token_budget{0, 48}};
  using snap_cache = cache<format::dense, select::per_kv_head<select::snapkv>, compact::repack>;
  const std::unique_ptr<layer_cache> layer = make_layer<snap_cache>(c, format::dense{}, s);
  snap_cache typed(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 43), 0, 100);
  const sequence_id seq = layer->add_sequence(), twin = typed.add_sequence();
  layer->prefill(seq, tensor_ref<3>::of(test::k_view(data)), tensor_ref<3>::of(test::v_view(data)), {});
  prefill_tokens(typed, twin, data, 100);
  std::vector<float> window(static_cast<std::size_t>(4 * c.num_q_heads() * c.head_dim));
  for (std::size_t i = 0; i < window.size(); ++i) window[i] = std::cos(0.21f * static_cast<float>(i));
  const tensor_view<const float, 3> queries(window.data(), 4, c.num_q_heads(), c.head_dim);
  CHECK(layer->snapshot(seq, tensor_ref<3>::of(queries)) == typed.snapshot(twin, queries));
  CHECK(layer->stored_tokens(seq) == (typed.stored_tokens(twin, 0) + typed.stored_tokens(twin, 1)) / 2);
  const std::vector<float> q = step_query(c, 5);
  std::vector<float> out(q.size());
  const sequence_id one[] = {seq};
  layer->attend(span<const sequence_id>(one, 1), tensor_ref<3>::of(tensor_view<const float, 3>(q.data(), 1, c.num_q_heads(), c.head_dim)),
                tensor_ref<3>::of(tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim)));
  CHECK(out == attend_one(typed, twin, q));
  std::vector<float> k(100 * 2 * 64), v(k.size());
  CHECK_THROWS_WITH(layer->read(seq, tensor_ref<3>::of(tensor_view<float, 3>(k.data(), 100, 2, 64)),
                                tensor_ref<3>::of(tensor_view<float, 3>(v.data(), 100, 2, 64))),
                    Catch::Contains("per_kv_head"));
  CHECK_THROWS_WITH(layer->window_votes(seq, tensor_ref<3>::of(queries)), Catch::Contains("per_kv_head"));
}

TEST_CASE("per_kv_head<streaming>: each head keeps its sinks and its own window", "[per_kv_head][streaming]") {
  const cache_config c = small_config(64);
  select::per_kv_head<select::streaming> s;
  s.selector.compact_every = 8;
  s.budgets = {select::token_budget{0, 20}, select::token_budget{0, 68}};
  cache<format::dense, select::per_kv_head<select::streaming>, compact::repack> kv(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 47), 0, 300);
  const sequence_id seq = kv.add_sequence();
  prefill_tokens(kv, seq, data, 100);
  for (int t = 100; t < 300; ++t) append_token(kv, seq, data, t);
  for (int h = 0; h < 2; ++h) {
    const std::int64_t budget = s.budgets[static_cast<std::size_t>(h)].tokens;
    const std::vector<std::int64_t> live = live_of(kv.positions(seq, h));
    INFO("head " << h);
    // The sinks, then the most recent tokens: at most the budget, plus the open tail's rows.
    for (int p = 0; p < s.selector.sink_tokens; ++p) CHECK(std::binary_search(live.begin(), live.end(), p));
    CHECK(static_cast<std::int64_t>(live.size()) <= budget + c.page_size);
    CHECK(live.back() == 299);
    for (std::size_t i = static_cast<std::size_t>(s.selector.sink_tokens) + 1; i < live.size(); ++i) CHECK(live[i] == live[i - 1] + 1);
  }
  CHECK(kv.stored_tokens(seq, 0) < kv.stored_tokens(seq, 1));
}

TEST_CASE("per_kv_head<snapkv> adaptive (Ada-KV): the heads' evictions chosen together by pooled vote, a safeguard each",
          "[per_kv_head][snapkv][adaptive]") {
  const cache_config c = small_config(64);
  const double safeguard = GENERATE(0.0, 0.2, 1.0);
  CAPTURE(safeguard);
  select::per_kv_head<select::snapkv> s;
  s.selector.window = 8;
  s.budgets = {select::token_budget{0, 60}, select::token_budget{0, 100}};
  s.adaptive = true;
  s.safeguard = safeguard;
  cache<format::dense, select::per_kv_head<select::snapkv>, compact::repack> kv(c, {}, s);
  CHECK(kv.describe() == "dense/per_kv_head(snapkv(1/16, window 8, pool 7, sum), adaptive, safeguard " +
                             detail::to_text(safeguard) + ", budgets 60 tokens; 100 tokens)/repack");
  const int n = 300;
  synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 53), 0, n);
  const sequence_id seq = kv.add_sequence();
  prefill_tokens(kv, seq, data, n);
  std::vector<float> window(static_cast<std::size_t>(8 * c.num_q_heads() * c.head_dim));
  for (std::size_t i = 0; i < window.size(); ++i) window[i] = 2.0f * std::sin(0.29f * static_cast<float>(i));
  const tensor_view<const float, 3> queries(window.data(), 8, c.num_q_heads(), c.head_dim);

  // The brute force, on each head's pooled votes from a one-head cache of that head's data:
  // protect each head's top floor(safeguard x kept) by setting them to +infinity, then evict the
  // lowest (sum of the heads' excess) of all heads' candidates together.
  cache_config one = c;
  one.num_kv_heads = 1;
  const std::size_t gd = static_cast<std::size_t>(c.group_size * c.head_dim);
  struct entry {
    double score;
    std::int64_t position;
    int head;
  };
  std::vector<entry> all;
  std::int64_t excess = 0;
  std::vector<std::int64_t> safe(2);
  for (int h = 0; h < 2; ++h) {
    select::snapkv sh = s.selector;
    sh.budget = s.budgets[static_cast<std::size_t>(h)];
    cache<format::dense, select::snapkv, compact::repack> alone(one, {}, sh);
    const sequence_id lone = alone.add_sequence();
    prefill_tokens(alone, lone, one_head(data, h), n);
    std::vector<float> wh;
    for (std::size_t w = 0; w < 8; ++w) {
      const auto from = window.begin() + static_cast<std::ptrdiff_t>((w * 2 + static_cast<std::size_t>(h)) * gd);
      wh.insert(wh.end(), from, from + static_cast<std::ptrdiff_t>(gd));
    }
    const std::vector<double> pooled = detail::snapkv_pool(
        alone.window_votes(lone, tensor_view<const float, 3>(wh.data(), 8, c.group_size, c.head_dim)), n - 8, 1, 7);
    // Candidates: after no sinks, before the window (n - 8 = 292) and the open tail (288).
    std::vector<entry> mine;
    for (std::int64_t p = 0; p < 288; ++p) mine.push_back({pooled[static_cast<std::size_t>(p)], p, h});
    const std::int64_t evict = n - s.budgets[static_cast<std::size_t>(h)].tokens;
    safe[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(std::floor(safeguard * static_cast<double>(288 - evict)));
    std::sort(mine.begin(), mine.end(), [](const entry& a, const entry& b) {
      return a.score != b.score ? a.score > b.score : a.position > b.position;  // highest first
    });
    for (std::int64_t i = 0; i < safe[static_cast<std::size_t>(h)]; ++i) mine[static_cast<std::size_t>(i)].score = INFINITY;
    all.insert(all.end(), mine.begin(), mine.end());
    excess += evict;
  }
  std::sort(all.begin(), all.end(), [](const entry& a, const entry& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.position != b.position ? a.position < b.position : a.head < b.head;
  });
  std::vector<std::vector<std::int64_t>> expected_dead(2);
  for (std::int64_t i = 0; i < excess; ++i)
    expected_dead[static_cast<std::size_t>(all[static_cast<std::size_t>(i)].head)].push_back(all[static_cast<std::size_t>(i)].position);

  CHECK(kv.snapshot(seq, queries) == excess);
  std::int64_t live_total = 0;
  std::vector<std::int64_t> every(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) every[static_cast<std::size_t>(p)] = p;
  for (int h = 0; h < 2; ++h) {
    INFO("head " << h);
    std::vector<std::int64_t> dead = expected_dead[static_cast<std::size_t>(h)];
    std::sort(dead.begin(), dead.end());
    const std::vector<std::int64_t> live = live_of(kv.positions(seq, h));
    CHECK(difference(every, live) == dead);
    // Each head keeps its safeguard's share of what its own budget would keep, and the window.
    CHECK(static_cast<std::int64_t>(live.size()) >= safe[static_cast<std::size_t>(h)] + (n - 288));
    live_total += static_cast<std::int64_t>(live.size());
  }
  CHECK(live_total == 60 + 100);  // the budgets in all, spread by the votes
  if (safeguard < 1.0)  // on this data the votes move 10 tokens of budget from head 1 to head 0
    CHECK(live_of(kv.positions(seq, 0)).size() == 70u);
  if (safeguard == 1.0) {  // every kept token safeguarded: each head keeps exactly its own budget
    CHECK(live_of(kv.positions(seq, 0)).size() == 60u);
    CHECK(live_of(kv.positions(seq, 1)).size() == 100u);
  }
  // Attention then reads each head's survivors (fp64 oracle).
  const std::vector<float> q = step_query(c, 9);
  const std::vector<float> out = attend_one(kv, seq, q);
  for (int h = 0; h < 2; ++h) check_head_output(c, q, out, data, h, live_of(kv.positions(seq, h)));
}

TEST_CASE("per_kv_head rejects adaptive allocation for a selector that ranks at every write", "[per_kv_head][errors]") {
  select::per_kv_head<select::h2o> s;
  s.adaptive = true;
  CHECK_THROWS_WITH((cache<format::dense, select::per_kv_head<select::h2o>, compact::repack>(small_config(), {}, s)),
                    Catch::Contains("adaptive") && Catch::Contains("select::snapkv"));
  select::per_kv_head<select::snapkv> k;
  k.safeguard = 1.5;
  CHECK_THROWS_WITH((cache<format::dense, select::per_kv_head<select::snapkv>, compact::repack>(small_config(), {}, k)),
                    Catch::Contains("safeguard"));
}
