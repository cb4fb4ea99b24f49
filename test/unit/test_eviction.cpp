// SPDX-License-Identifier: Apache-2.0
// Eviction through the public API (host backend): the eviction notes' block-granular reclaim
// numbers on the pool gauge, positions and lengths after eviction, attention over the live tokens
// against the fp64 oracle, and the rejections.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using evicting_cache = cache<format::dense, select::all, compact::repack>;

cache_config oracle_config() {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 1;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 1000;
  c.max_sequences = 2;
  return c;
}

/// A sequence of `tokens` synthetic tokens in `kv`.
sequence_id add(evicting_cache& kv, const cache_config& c, int tokens, synthetic::kv_data& data) {
  data = synthetic::generate_kv(test::generator_for(c, 11), 0, tokens);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  return seq;
}

std::vector<std::int64_t> every_but(std::int64_t n, std::int64_t stride) {
  std::vector<std::int64_t> out;
  for (std::int64_t t = 0; t < n; ++t)
    if (t % stride != 0) out.push_back(t);
  return out;
}

span<const std::int64_t> view(const std::vector<std::int64_t>& v) { return {v.data(), static_cast<std::int64_t>(v.size())}; }

}  // namespace

TEST_CASE("eviction frees whole pages only: 90% scattered frees 0 of 1,000, an aligned page frees 1, one survivor "
          "per page frees 0",
          "[eviction]") {
  const cache_config c = oracle_config();
  synthetic::kv_data data;
  {
    evicting_cache kv(c);
    const sequence_id seq = add(kv, c, 16000, data);
    REQUIRE(kv.pool().used_pages() == 1000);
    kv.evict(seq, view(every_but(16000, 10)));  // 1,600 survivors, one in every 10
    CHECK(kv.pool().used_pages() == 1000);
    CHECK(kv.length(seq) == 16000);
    CHECK(kv.stored_tokens(seq) == 16000);
  }
  {
    evicting_cache kv(c);
    const sequence_id seq = add(kv, c, 16000, data);
    std::vector<std::int64_t> page2;
    for (std::int64_t t = 32; t < 48; ++t) page2.push_back(t);
    kv.evict(seq, view(page2));
    CHECK(kv.pool().used_pages() == 999);
    CHECK(kv.pages(seq).size() == 999);
    CHECK(kv.stored_tokens(seq) == 16000 - 16);
    CHECK(kv.length(seq) == 16000);  // new tokens keep their positions
    const std::vector<std::int64_t> positions = kv.positions(seq);
    CHECK(positions.size() == 15984);
    CHECK(positions[31] == 31);
    CHECK(positions[32] == 48);
  }
  {
    evicting_cache kv(c);
    const sequence_id seq = add(kv, c, 16000, data);
    kv.evict(seq, view(every_but(16000, 16)));  // 93.75% evicted, one survivor per page
    CHECK(kv.pool().used_pages() == 1000);
  }
}

TEST_CASE("after eviction, attention reads exactly the live tokens (fp64 oracle), and appends keep their positions",
          "[eviction]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 64;
  c.max_sequences = 2;
  const int tokens = 200;  // 12 pages and a tail of 8
  synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 5), 0, tokens + 1);
  synthetic::kv_data first = data;
  first.num_tokens = tokens;
  first.k.resize(static_cast<std::size_t>(tokens) * c.num_kv_heads * c.head_dim);
  first.v.resize(first.k.size());
  evicting_cache kv(c);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(first), test::v_view(first));
  std::mt19937_64 rng(9);
  std::vector<std::int64_t> dead;
  for (std::int64_t t = 0; t < 192; ++t)
    if (std::bernoulli_distribution(0.6)(rng)) dead.push_back(t);
  for (std::int64_t t = 64; t < 80; ++t)  // and one whole page
    if (std::find(dead.begin(), dead.end(), t) == dead.end()) dead.push_back(t);
  kv.evict(seq, view(dead));
  CHECK(kv.pages(seq).size() == 11);  // page 4 went back to the pool

  // The next token lands at position 200, after the tail, whatever was evicted.
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const std::vector<float> k_next(data.k.begin() + tokens * row, data.k.end()), v_next(data.v.begin() + tokens * row, data.v.end());
  const sequence_id one[] = {seq};
  kv.append(span<const sequence_id>(one, 1), tensor_view<const float, 3>(k_next.data(), 1, c.num_kv_heads, c.head_dim),
            tensor_view<const float, 3>(v_next.data(), 1, c.num_kv_heads, c.head_dim));
  CHECK(kv.length(seq) == 201);
  CHECK(kv.positions(seq).back() == 200);

  // Attention over the live tokens only, against fp64 exact attention on them.
  std::vector<std::int64_t> survivors;
  for (std::int64_t t = 0; t <= tokens; ++t)
    if (std::find(dead.begin(), dead.end(), t) == dead.end()) survivors.push_back(t);
  const synthetic::kv_data live = test::tokens_of(test::rounded(data, c.storage), survivors);
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(hq) * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<float> out(q.size());
  kv.attend(span<const sequence_id>(one, 1), tensor_view<float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<double> exact = test::exact(q, live, scale);
  const test::error_bound bound = test::attention_error_bound(q, live, c.group_size, scale, c.storage, c.page_size, true);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  }
}

TEST_CASE("eviction rejects what it cannot do, and changes nothing then", "[eviction]") {
  cache_config c = oracle_config();
  c.max_pages = 8;
  synthetic::kv_data data;
  evicting_cache kv(c);
  const sequence_id seq = add(kv, c, 40, data);  // 2 pages and a tail of 8 (positions 32-39)
  const std::vector<std::int64_t> before = kv.positions(seq);
  const auto bad = [&](std::vector<std::int64_t> p, const char* says) {
    CHECK_THROWS_WITH(kv.evict(seq, view(p)), Catch::Contains(says));
    CHECK(kv.positions(seq) == before);
    CHECK(kv.pool().used_pages() == 2);
  };
  bad({40}, "0 to length(seq) - 1");
  bad({-1}, "0 to length(seq) - 1");
  bad({3, 35}, "the tail's open rows are not evictable");
  bad({3, 3}, "distinct positions");
  kv.evict(seq, view(std::vector<std::int64_t>{3}));
  CHECK_THROWS_WITH(kv.evict(seq, view(std::vector<std::int64_t>{3})), Catch::Contains("evicted before"));
  kv.remove_sequence(seq);
  CHECK_THROWS_WITH(kv.evict(seq, view(std::vector<std::int64_t>{4})), Catch::Contains("not removed"));
}

namespace {

/// Attention of one fixed query over `seq`.
template <class Cache>
std::vector<float> attend_one(Cache& kv, sequence_id seq) {
  const cache_config& c = kv.config();
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(hq) * d), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  const sequence_id one[] = {seq};
  kv.attend(span<const sequence_id>(one, 1), tensor_view<float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d));
  return out;
}

}  // namespace

TEST_CASE("repack through the cache: 90% scattered eviction of 16,000 tokens in pages of 16 gives 900 pages back",
          "[eviction][compaction]") {
  const cache_config c = oracle_config();
  synthetic::kv_data data;
  evicting_cache kv(c);
  const sequence_id seq = add(kv, c, 16000, data);
  kv.evict(seq, view(every_but(16000, 10)));
  const std::vector<float> before = attend_one(kv, seq);
  const compaction_report r = kv.compact(seq);
  CHECK(r.pages_freed == 900);
  CHECK(r.slot_copies == 1599);  // every survivor but the first moves
  CHECK(r.tokens_evicted == 14400);
  CHECK(r.pages_reencoded == 0);  // dense moves rows as they are
  CHECK(kv.pool().used_pages() == 100);
  CHECK(kv.stored_tokens(seq) == 1600);
  CHECK(kv.length(seq) == 16000);
  const std::vector<std::int64_t> positions = kv.positions(seq);
  REQUIRE(positions.size() == 1600);
  for (std::size_t i = 0; i < positions.size(); ++i) REQUIRE(positions[i] == static_cast<std::int64_t>(i) * 10);
  // The same survivors, now in 100 pages instead of 1,000: the same attention up to fp32
  // summation order (the bound of fp32 arithmetic over the survivors, for each output).
  std::vector<std::int64_t> survivors;
  for (std::int64_t t = 0; t < 16000; t += 10) survivors.push_back(t);
  const synthetic::kv_data kept = test::tokens_of(test::rounded(data, c.storage), survivors);
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  const test::error_bound bound = test::attention_error_bound(q, kept, c.group_size, 1.0 / 8.0, c.storage, 1000, true);
  const std::vector<float> after = attend_one(kv, seq);
  for (std::size_t i = 0; i < after.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(after[i] - before[i]) <= 2 * bound.per_element[i]);
  }
  CHECK(kv.compact(seq).slot_copies == 0);  // a second pass has nothing to do
}

TEST_CASE("hole filling through the cache: the newest round's survivors drop into the history's holes", "[eviction][compaction]") {
  cache_config c = oracle_config();
  c.max_pages = 8;
  using filling_cache = cache<format::dense, select::all, compact::hole_fill>;
  synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 4), 0, 96);
  filling_cache kv(c);
  const sequence_id seq = kv.add_sequence();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 80, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data(), 80, c.num_kv_heads, c.head_dim));
  CHECK(kv.compact(seq).slot_copies == 0);  // the history: 5 pages; the next round starts after them
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data() + 80 * row, 16, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data() + 80 * row, 16, c.num_kv_heads, c.head_dim));
  std::vector<std::int64_t> dead = {2, 36, 52};  // three holes in the history
  for (std::int64_t t = 80; t < 96; ++t)
    if (t != 80 && t != 86 && t != 95) dead.push_back(t);  // the round keeps 80, 86 and 95
  kv.evict(seq, view(dead));
  const compaction_report r = kv.compact(seq);
  CHECK(r.slot_copies == 3);
  CHECK(r.pages_freed == 1);
  CHECK(kv.pool().used_pages() == 5);
  const std::vector<std::int64_t> positions = kv.positions(seq);
  CHECK(positions[2] == 80);
  CHECK(positions[36] == 86);
  CHECK(positions[52] == 95);
  std::vector<std::int64_t> sorted = positions;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> expected;
  for (std::int64_t t = 0; t < 96; ++t)
    if (std::find(dead.begin(), dead.end(), t) == dead.end()) expected.push_back(t);
  CHECK(sorted == expected);  // the same survivor set, in another physical order
}

TEST_CASE("compacted attention equals attention over a fresh cache of the same survivors (fp32 order aside)",
          "[eviction][compaction]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 64;
  c.max_sequences = 2;
  const int tokens = 300;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 8), 0, tokens);
  std::mt19937_64 rng(3);
  std::vector<std::int64_t> dead;
  for (std::int64_t t = 0; t < 288; ++t)
    if (std::bernoulli_distribution(0.5)(rng)) dead.push_back(t);
  std::vector<std::int64_t> survivors;
  for (std::int64_t t = 0; t < tokens; ++t)
    if (std::find(dead.begin(), dead.end(), t) == dead.end()) survivors.push_back(t);
  const synthetic::kv_data kept = test::tokens_of(data, survivors);
  for (const bool fill : {false, true}) {
    CAPTURE(fill);
    std::vector<float> compacted;
    if (fill) {
      cache<format::dense, select::all, compact::hole_fill> kv(c);
      const sequence_id seq = kv.add_sequence();
      kv.prefill(seq, test::k_view(data), test::v_view(data));
      kv.evict(seq, view(dead));
      kv.compact(seq);
      compacted = attend_one(kv, seq);
    } else {
      evicting_cache kv(c);
      const sequence_id seq = kv.add_sequence();
      kv.prefill(seq, test::k_view(data), test::v_view(data));
      kv.evict(seq, view(dead));
      kv.compact(seq);
      compacted = attend_one(kv, seq);
    }
    cache<format::dense> fresh(c);
    const sequence_id f = fresh.add_sequence();
    fresh.prefill(f, test::k_view(kept), test::v_view(kept));
    const std::vector<float> reference = attend_one(fresh, f);
    std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
    const test::error_bound bound = test::attention_error_bound(q, test::rounded(kept, c.storage), c.group_size,
                                                                1.0 / std::sqrt(64.0), c.storage, c.page_size, true);
    for (std::size_t i = 0; i < reference.size(); ++i) {
      INFO("element " << i);
      REQUIRE(std::abs(compacted[i] - reference[i]) <= 2 * bound.per_element[i]);
    }
  }
}

TEST_CASE("compaction leaves a fork's shared pages alone: the parent reads what it read before", "[eviction][compaction]") {
  cache_config c = oracle_config();
  c.max_pages = 16;
  synthetic::kv_data data;
  evicting_cache kv(c);
  const sequence_id parent = add(kv, c, 100, data);  // 6 pages and a tail of 4
  const std::vector<float> parent_before = attend_one(kv, parent);
  const sequence_id child = kv.fork_sequence(parent);
  std::vector<std::int64_t> dead;
  for (std::int64_t t = 1; t < 96; t += 2) dead.push_back(t);
  kv.evict(child, view(dead));
  const compaction_report r = kv.compact(child);
  CHECK(r.slot_copies == 0);  // every page is shared: nothing may move
  CHECK(r.pages_freed == 0);
  CHECK(attend_one(kv, parent) == parent_before);
  kv.remove_sequence(parent);  // now the child holds its pages alone
  const compaction_report second = kv.compact(child);
  CHECK(second.pages_freed == 3);  // 48 survivors in 3 pages
  CHECK(kv.pool().used_pages() == 3);
}

TEST_CASE("select::streaming keeps the sinks and the window, evicts the rest as it is sealed, and compacts on cadence",
          "[eviction][streaming]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 12;  // far below the 240 tokens written: only eviction and compaction make room
  c.max_sequences = 1;
  select::streaming s;
  s.sink_tokens = 4;
  s.budget.tokens = 64;  // 4 sinks and a window of 60
  s.compact_every = 32;
  cache<format::dense, select::streaming, compact::repack> kv(c, {}, s);
  const int total = 240;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 21), 0, total);
  const sequence_id seq = kv.add_sequence();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 40, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data(), 40, c.num_kv_heads, c.head_dim));
  const sequence_id one[] = {seq};
  for (int t = 40; t < total; ++t) {
    kv.append(span<const sequence_id>(one, 1), tensor_view<const float, 3>(data.k.data() + t * row, 1, c.num_kv_heads, c.head_dim),
              tensor_view<const float, 3>(data.v.data() + t * row, 1, c.num_kv_heads, c.head_dim));
    // The live positions: the sinks, and the last 60 (the tail always lies inside the window).
    std::vector<std::int64_t> live;
    for (const std::int64_t p : kv.positions(seq))
      if (p >= 0) live.push_back(p);
    std::sort(live.begin(), live.end());
    const std::int64_t n = t + 1;
    std::vector<std::int64_t> expected = {0, 1, 2, 3};
    for (std::int64_t p = std::max<std::int64_t>(4, n - 60); p < n; ++p) expected.push_back(p);
    // Sealed tokens leave once they fall out of the window; tail tokens never do.
    REQUIRE(live.size() >= expected.size());
    for (const std::int64_t p : expected) REQUIRE(std::binary_search(live.begin(), live.end(), p));
    for (const std::int64_t p : live)
      if (!std::binary_search(expected.begin(), expected.end(), p)) REQUIRE(p >= n - 60 - c.page_size);
    REQUIRE(kv.pool().used_pages() <= 7);  // bounded by the budget, not by the 240 tokens
  }
  CHECK(kv.length(seq) == total);

  // Attention reads exactly the live tokens (fp64 oracle over them).
  std::vector<std::int64_t> live;
  for (const std::int64_t p : kv.positions(seq))
    if (p >= 0) live.push_back(p);
  std::sort(live.begin(), live.end());
  const synthetic::kv_data kept = test::tokens_of(test::rounded(data, c.storage), live);
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  const std::vector<float> out = attend_one(kv, seq);
  const double scale = 1.0 / std::sqrt(64.0);
  const std::vector<double> exact = test::exact(q, kept, scale);
  const test::error_bound bound = test::attention_error_bound(q, kept, c.group_size, scale, c.storage, c.page_size, true);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  }
}

TEST_CASE("select::quest over evicted tokens reads the chosen rows that are live; compaction rewrites the bounds it moves",
          "[eviction][compaction][select]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 64;
  c.max_sequences = 2;
  const int tokens = 300;  // 18 pages and a tail of 12
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 9), 0, tokens);
  const synthetic::kv_data stored = test::rounded(data, c.storage);
  std::mt19937_64 rng(4);
  std::vector<std::int64_t> dead;
  for (std::int64_t t = 0; t < 288; ++t)
    if (std::bernoulli_distribution(0.5)(rng)) dead.push_back(t);
  while ((288 - dead.size()) % 16 != 0) dead.pop_back();  // survivors fill whole pages once compacted
  select::quest quest;
  quest.budget.ratio = 0.25;
  const double scale = 1.0 / std::sqrt(64.0);
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));

  // Each KV head's output against fp64 attention over the tokens it must read: the live tokens of
  // the slots its selection chose (`positions` maps slots to tokens), and the tail.
  using quest_cache = cache<format::dense, select::quest, compact::repack>;
  const auto check_reads_live_selection = [&](quest_cache& kv, sequence_id seq) {
    const std::vector<float> out = attend_one(kv, seq);
    const std::vector<std::int64_t> positions = kv.positions(seq);
    const std::int64_t sealed = kv.stored_tokens(seq) - tokens % c.page_size;
    for (int h = 0; h < c.num_kv_heads; ++h) {
      std::vector<std::int64_t> read;
      for (const auto& [first, last] : kv.selected_ranges(seq, h))
        for (std::int64_t slot = first; slot < last && slot < sealed; ++slot)
          if (positions[static_cast<std::size_t>(slot)] >= 0) read.push_back(positions[static_cast<std::size_t>(slot)]);
      for (std::int64_t t = tokens - tokens % c.page_size; t < tokens; ++t) read.push_back(t);
      std::sort(read.begin(), read.end());
      REQUIRE(std::adjacent_find(read.begin(), read.end()) == read.end());
      for (const std::int64_t t : read) REQUIRE(!std::binary_search(dead.begin(), dead.end(), t));
      CHECK(read.size() < 200);  // a selection, not everything
      const synthetic::kv_data subset = test::tokens_of(stored, read);
      const std::vector<double> exact = test::exact(q, subset, scale);
      const test::error_bound bound = test::attention_error_bound(q, subset, c.group_size, scale, c.storage, c.page_size, true);
      for (int i = h * c.group_size * c.head_dim; i < (h + 1) * c.group_size * c.head_dim; ++i) {
        INFO("head " << h << ", element " << i);
        REQUIRE(std::abs(out[static_cast<std::size_t>(i)] - exact[static_cast<std::size_t>(i)]) <= bound.per_element[static_cast<std::size_t>(i)]);
      }
    }
    return out;
  };
  quest_cache kv(c, {}, quest);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  kv.evict(seq, view(dead));
  check_reads_live_selection(kv, seq);
  const compaction_report r = kv.compact(seq);
  CHECK(r.pages_freed > 0);
  const std::vector<float> compacted = check_reads_live_selection(kv, seq);

  // The bounds the pass rewrote are those of the rows now in each page: a fresh cache of the
  // survivors (in the same slots, as repack keeps their order; its tail starts elsewhere) selects
  // the same ranges and reads the same tokens, up to fp32 summation order.
  std::vector<std::int64_t> survivors;
  for (std::int64_t t = 0; t < tokens; ++t)
    if (!std::binary_search(dead.begin(), dead.end(), t)) survivors.push_back(t);
  const synthetic::kv_data kept = test::tokens_of(data, survivors);
  cache<format::dense, select::quest> fresh(c, {}, quest);
  const sequence_id f = fresh.add_sequence();
  fresh.prefill(f, test::k_view(kept), test::v_view(kept));
  const std::vector<float> reference = attend_one(fresh, f);
  for (int h = 0; h < c.num_kv_heads; ++h) CHECK(kv.selected_ranges(seq, h) == fresh.selected_ranges(f, h));
  const test::error_bound bound = test::attention_error_bound(q, test::rounded(kept, c.storage), c.group_size, scale, c.storage,
                                                              c.page_size, true);
  for (std::size_t i = 0; i < reference.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(compacted[i] - reference[i]) <= 2 * bound.per_element[i]);
  }
}

TEST_CASE("quant2's max_reencodes: no page is re-encoded by more passes than it allows", "[eviction][compaction][quant2]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 32;
  c.max_pages = 32;
  c.max_sequences = 1;
  const int tokens = 20 * 32;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 12), 0, tokens);
  std::vector<std::int64_t> first_round, second_round;  // every 3rd token, then every 5th of the rest
  for (std::int64_t t = 0; t < tokens; ++t) (t % 3 == 1 ? first_round : second_round).push_back(t);
  std::vector<std::int64_t> second;
  for (std::size_t i = 0; i < second_round.size(); i += 5) second.push_back(second_round[i]);
  for (const int limit : {0, 1, 2}) {
    CAPTURE(limit);
    format::quant2 f;
    f.partition = 32;
    f.mode = format::rounding::nearest;
    f.sink_tokens = 0;  // the pattern below evicts from the first token on
    f.max_reencodes = limit;
    cache<format::quant2, select::all, compact::repack> kv(c, f);
    const sequence_id seq = kv.add_sequence();
    kv.prefill(seq, test::k_view(data), test::v_view(data));
    kv.evict(seq, view(first_round));
    const compaction_report one = kv.compact(seq);
    if (limit == 0) {  // nothing may be re-encoded: nothing moves, whole pages only
      CHECK(one.slot_copies == 0);
      CHECK(one.pages_reencoded == 0);
      CHECK(kv.pool().used_pages() == 20);
    } else {
      CHECK(one.pages_reencoded > 0);
      CHECK(kv.pool().used_pages() == 14);  // 427 survivors in pages of 32
    }
    kv.evict(seq, view(second));
    const compaction_report two = kv.compact(seq);
    if (limit <= 1) {  // every page the first pass wrote is frozen (and, at 0, every page)
      CHECK(two.slot_copies == 0);
      CHECK(two.pages_reencoded == 0);
    } else {
      CHECK(two.pages_reencoded > 0);
      CHECK(two.pages_freed > 0);
    }
    CHECK(kv.length(seq) == tokens);
  }
  format::quant2 bad;
  bad.partition = 32;
  bad.max_reencodes = 256;
  CHECK_THROWS_WITH((cache<format::quant2, select::all, compact::repack>(c, bad)), Catch::Contains("max_reencodes"));
}

TEST_CASE("compaction never writes a page shared with a fork, even when a page held alone comes before it", "[eviction][compaction]") {
  // The parent evicts its whole first page, which drops its reference: the child then holds that
  // page alone, ahead of pages it still shares with the parent. A compaction of the child that
  // took only the leading shared pages as frozen moved survivors into the shared pages (the
  // parent's output changed). Found by the random eviction sequences (test_random_eviction.cpp).
  cache_config c = oracle_config();
  c.max_pages = 16;
  const auto run = [&](auto kv, std::int64_t copies_once_alone) {
    synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 11), 0, 52);
    const sequence_id parent = kv.add_sequence();
    kv.prefill(parent, test::k_view(data), test::v_view(data));  // 3 pages and a tail of 4
    const sequence_id child = kv.fork_sequence(parent);
    std::vector<std::int64_t> first_page;
    for (std::int64_t t = 0; t < 16; ++t) first_page.push_back(t);
    kv.evict(parent, view(first_page));
    CHECK(kv.pool().ref_count(kv.pages(child)[0]) == 1);
    const std::vector<float> parent_before = attend_one(kv, parent);
    kv.evict(child, view(std::vector<std::int64_t>{3}));
    const compaction_report r = kv.compact(child);
    CHECK(r.pages_freed == 0);
    CHECK(attend_one(kv, parent) == parent_before);
    CHECK(kv.pool().used_pages() == 3);
    kv.remove_sequence(parent);  // the child holds every page alone now
    CHECK(kv.compact(child).slot_copies == copies_once_alone);
  };
  SECTION("repack") { run(evicting_cache(c), 44); }  // the 44 survivors after the hole slide forward
  // The three pages are hole filling's history now: its hole waits for the next round's survivors.
  SECTION("hole_fill") { run(cache<format::dense, select::all, compact::hole_fill>(c), 0); }
}

TEST_CASE("an eviction that drops several history pages at once leaves hole filling's round where it was", "[eviction][compaction]") {
  // The position map's round start (the slot count the previous pass left) loses a page for each
  // dropped page below it. Compared with the count as it shrank, the second of two dropped history
  // pages was missed: here the round start stayed at 16 with no slot left, and the next
  // compact() threw. Found by the random eviction sequences (test_random_eviction.cpp).
  cache_config c = oracle_config();
  c.max_pages = 8;
  cache<format::dense, select::all, compact::hole_fill> kv(c);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 1), 0, 65);
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  const auto feed = [&](sequence_id seq, std::int64_t from, std::int64_t n) {
    kv.prefill(seq, tensor_view<const float, 3>(data.k.data() + from * static_cast<std::int64_t>(row), n, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(data.v.data() + from * static_cast<std::int64_t>(row), n, c.num_kv_heads, c.head_dim));
  };
  const sequence_id seq = kv.add_sequence();
  feed(seq, 0, 33);
  kv.compact(seq);  // the history: 2 pages
  feed(seq, 33, 16);  // a third page, the newest round
  SECTION("every page dropped") {
    std::vector<std::int64_t> all;
    for (std::int64_t t = 0; t < 48; ++t) all.push_back(t);
    kv.evict(seq, view(all));
    CHECK(kv.pages(seq).empty());
    CHECK_NOTHROW(kv.compact(seq));
  }
  SECTION("both history pages dropped: the round's survivors are the next pass's round") {
    std::vector<std::int64_t> dead;
    for (std::int64_t t = 0; t < 32; ++t) dead.push_back(t);
    dead.push_back(40);  // a hole in the round's page
    kv.evict(seq, view(dead));
    REQUIRE(kv.pages(seq).size() == 1);
    // With no history left, the pass slides the round's survivors after the hole forward.
    CHECK(kv.compact(seq).slot_copies == 7);
  }
}

TEST_CASE("bitmap_tiles compaction keeps every stored value even when the K weights changed since the seal",
          "[eviction][compaction][bitmap_tiles]") {
  // The pages are sealed with plain magnitudes, then the sequence's weights become 0 for half the
  // channels: pruning the moved rows with them would drop kept values (found by the random
  // eviction sequences' review). Compaction prunes by the rows' magnitudes, which keeps them all.
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 1;
  c.head_dim = 64;
  c.page_size = 64;
  c.max_pages = 4;
  c.max_sequences = 1;
  format::bitmap_tiles f;
  f.s_k = 0.5f;
  f.s_v = 0.0f;
  for (const auto layout : {format::bitmap_k_layout::along_channels, format::bitmap_k_layout::along_tokens}) {
    CAPTURE(static_cast<int>(layout));
    f.k_layout = layout;
    cache<format::bitmap_tiles, select::all, compact::repack> kv(c, f);
    const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 3), 0, 130);
    const sequence_id s = kv.add_sequence();
    kv.prefill(s, test::k_view(data), test::v_view(data));
    std::vector<float> w(64, 1.0f);
    for (int ch = 32; ch < 64; ++ch) w[static_cast<std::size_t>(ch)] = 0.0f;
    kv.set_key_weights(s, tensor_view<const float, 2>(w.data(), 1, 64));
    using traits = format_traits<format::bitmap_tiles>;
    const page_shape shape{64, 64, c.storage};
    std::vector<float> before(2 * 64 * 64), after(2 * 64 * 64);
    for (int p = 0; p < 2; ++p)
      traits::decode_k(kv.format(), shape, kv.engine().k_page(kv.pages(s)[static_cast<std::size_t>(p)], 0), 64,
                       before.data() + p * 64 * 64);
    kv.evict(s, view(std::vector<std::int64_t>{5}));
    const compaction_report r = kv.compact(s);
    REQUIRE(r.slot_copies == 122);  // tokens 6 .. 127 move up one slot
    for (int p = 0; p < 2; ++p)
      traits::decode_k(kv.format(), shape, kv.engine().k_page(kv.pages(s)[static_cast<std::size_t>(p)], 0), 64,
                       after.data() + p * 64 * 64);
    for (int slot = 0; slot < 127; ++slot) {  // the token in each slot now, against its values before
      const int was = slot < 5 ? slot : slot + 1;
      for (int ch = 0; ch < 64; ++ch) {
        INFO("slot " << slot << ", channel " << ch);
        REQUIRE(after[static_cast<std::size_t>(slot * 64 + ch)] == before[static_cast<std::size_t>(was * 64 + ch)]);
      }
    }
  }
}
