// SPDX-License-Identifier: Apache-2.0
// select::snapkv: the votes by hand (the softmax of one query, the causal mask inside the window,
// the group combined, the max pooling across a gap), the snapshot's evictions against a brute-force
// W x N fp64 evaluation over the stored values, budgets of 0, the context and beyond, a second
// snapshot over a compacted sequence, memory given back, attention over the survivors against the
// fp64 oracle, and the rejections.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <type_traits>
#include <vector>

#include "../support/feed.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

/// Keys and queries of the hand-computed cases: head_dim 1, [row][head][1] and [w][query head][1].
struct hand {
  std::vector<double> k, q;
  int heads = 1, q_heads = 1;
  double key(std::int64_t i, int h, int) const { return k[static_cast<std::size_t>(i) * heads + h]; }
  double query(int w, int j, int) const { return q[static_cast<std::size_t>(w) * q_heads + j]; }
};

std::vector<double> hand_scores(const hand& x, const std::vector<std::int64_t>& positions, std::int64_t window_start,
                                int window, int group, int pool, group_combine combine = group_combine::sum) {
  const auto key = [&](std::int64_t i, int h, int c) { return x.key(i, h, c); };
  const auto query = [&](int w, int j, int c) { return x.query(w, j, c); };
  return detail::snapkv_scores(key, positions, query, window_start, window, x.heads, group, 1, pool, combine);
}

}  // namespace

TEST_CASE("snapkv votes by hand: one query's softmax, max pooling, an evicted position", "[snapkv]") {
  // Keys 0, ln 2, 0, 0, ln 4 | 0 (window of one, at position 5), query 1: exp = 1, 2, 1, 1, 4, 1, sum 10.
  hand x;
  x.k = {0, std::log(2.0), 0, 0, std::log(4.0), 0};
  x.q = {1};
  const std::vector<std::int64_t> all = {0, 1, 2, 3, 4, 5};
  const std::vector<double> plain = hand_scores(x, all, 5, 1, 1, 1);
  const double expect_plain[] = {0.1, 0.2, 0.1, 0.1, 0.4};
  REQUIRE(plain.size() == 5);
  for (int t = 0; t < 5; ++t) CHECK(plain[t] == Approx(expect_plain[t]).epsilon(1e-14));
  // Kernel 3: each position takes the largest vote within one position, the window's excluded.
  const std::vector<double> pooled = hand_scores(x, all, 5, 1, 1, 3);
  const double expect_pooled[] = {0.2, 0.2, 0.2, 0.4, 0.4};
  for (int t = 0; t < 5; ++t) CHECK(pooled[t] == Approx(expect_pooled[t]).epsilon(1e-14));
  // Position 2 evicted (its slot holds -1): out of the softmax (sum 9) and of the pooling.
  const std::vector<std::int64_t> gap = {0, 1, -1, 3, 4, 5};
  const std::vector<double> holed = hand_scores(x, gap, 5, 1, 1, 3);
  CHECK(holed[0] == Approx(2.0 / 9).epsilon(1e-14));
  CHECK(holed[1] == Approx(2.0 / 9).epsilon(1e-14));
  CHECK(std::isinf(holed[2]));
  CHECK(holed[2] < 0);
  CHECK(holed[3] == Approx(4.0 / 9).epsilon(1e-14));
  CHECK(holed[4] == Approx(4.0 / 9).epsilon(1e-14));
}

TEST_CASE("snapkv votes by hand: the causal window, the group summed or maxed, the heads summed", "[snapkv]") {
  SECTION("query w sees positions up to its own") {
    // Prefix 0..3, window 4, 5; key ln 4 at position 5, which only the second query sees:
    // query 0: 5 tokens of exp 1, p = 1/5; query 1: exp 1,1,1,1,1,4, p = 1/9. Vote 14/45.
    hand x;
    x.k = {0, 0, 0, 0, 0, std::log(4.0)};
    x.q = {1, 1};
    const std::vector<double> s = hand_scores(x, {0, 1, 2, 3, 4, 5}, 4, 2, 1, 1);
    for (int t = 0; t < 4; ++t) CHECK(s[t] == Approx(14.0 / 45).epsilon(1e-14));
  }
  SECTION("two query heads of one KV head, and two KV heads") {
    // Keys 0 | ln 2; query heads 1 and 2: p(0) = 1/3 and 1/5; sum 8/15, max 1/3.
    hand x;
    x.k = {0, std::log(2.0)};
    x.q = {1, 2};
    x.q_heads = 2;
    CHECK(hand_scores(x, {0, 1}, 1, 1, 2, 1, group_combine::sum)[0] == Approx(8.0 / 15).epsilon(1e-14));
    CHECK(hand_scores(x, {0, 1}, 1, 1, 2, 1, group_combine::max)[0] == Approx(1.0 / 3).epsilon(1e-14));
    // The same keys under two KV heads of one query head each: the heads' votes add, 1/3 + 1/5.
    hand y;
    y.k = {0, 0, std::log(2.0), std::log(2.0)};
    y.heads = 2;
    y.q = {1, 2};
    y.q_heads = 2;
    CHECK(hand_scores(y, {0, 1}, 1, 1, 1, 1)[0] == Approx(8.0 / 15).epsilon(1e-14));
  }
}

namespace {

cache_config snap_config(int page_size = 16) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = page_size;
  c.max_pages = 64;
  c.max_sequences = 2;
  return c;
}

std::vector<float> window_queries(const cache_config& c, int window, std::uint64_t seed) {
  std::vector<float> q(static_cast<std::size_t>(window) * c.num_q_heads() * c.head_dim);
  std::uint64_t state = seed;
  for (float& x : q) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x = 2.0f * (static_cast<float>(state >> 40) / 16777216.0f - 0.5f);
  }
  return q;
}

template <class Cache>
std::vector<std::int64_t> live_positions(const Cache& kv, sequence_id seq) {
  std::vector<std::int64_t> live;
  for (const std::int64_t p : kv.positions(seq))
    if (p >= 0) live.push_back(p);
  std::sort(live.begin(), live.end());
  return live;
}

/// The tokens a snapshot must evict, by brute force: the W x N matrix of fp64 logits over the
/// values read back, each row's causal softmax, the votes summed over the window and combined over
/// the group, max-pooled per head, summed over the heads, then the lowest candidates (after the
/// sinks, before the window and the open tail), ties to the earlier position.
template <class Cache>
std::set<std::int64_t> brute_force_evictions(const Cache& kv, sequence_id seq, const std::vector<float>& q) {
  const cache_config& c = kv.config();
  const select::snapkv& s = kv.selector();
  const int heads = c.num_kv_heads, groups = c.group_size, d = c.head_dim, window = s.window;
  const std::int64_t stored = kv.stored_tokens(seq), length = kv.length(seq), start = length - window;
  std::vector<float> k(static_cast<std::size_t>(stored) * heads * d), v(k.size());
  kv.read(seq, tensor_view<float, 3>(k.data(), stored, heads, d), tensor_view<float, 3>(v.data(), stored, heads, d));
  const std::vector<std::int64_t> slots = kv.positions(seq);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // vote[h][position], -inf where no live token is.
  std::vector<std::vector<double>> vote(static_cast<std::size_t>(heads), std::vector<double>(static_cast<std::size_t>(start), -INFINITY));
  for (int h = 0; h < heads; ++h) {
    for (const std::int64_t p : slots)
      if (p >= 0 && p < start) vote[h][static_cast<std::size_t>(p)] = 0;
    for (int w = 0; w < window; ++w) {
      std::vector<std::vector<double>> p_of(static_cast<std::size_t>(groups));  // [g][slot]
      for (int g = 0; g < groups; ++g) {
        const float* qj = q.data() + (static_cast<std::size_t>(w) * c.num_q_heads() + static_cast<std::size_t>(h * groups + g)) * d;
        std::vector<double> logit(slots.size(), -INFINITY);
        double m = -INFINITY, l = 0;
        for (std::size_t i = 0; i < slots.size(); ++i) {
          if (slots[i] < 0 || slots[i] > start + w) continue;
          double dot = 0;
          for (int ch = 0; ch < d; ++ch)
            dot += static_cast<double>(qj[ch]) * scale * k[(i * heads + static_cast<std::size_t>(h)) * d + static_cast<std::size_t>(ch)];
          logit[i] = dot;
          m = std::max(m, dot);
        }
        for (std::size_t i = 0; i < slots.size(); ++i)
          if (logit[i] > -INFINITY) l += std::exp(logit[i] - m);
        p_of[g].assign(slots.size(), 0.0);
        for (std::size_t i = 0; i < slots.size(); ++i)
          if (logit[i] > -INFINITY) p_of[g][i] = std::exp(logit[i] - m) / l;
      }
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] < 0 || slots[i] >= start) continue;
        double combined = s.combine == group_combine::sum ? 0.0 : -INFINITY;
        for (int g = 0; g < groups; ++g)
          combined = s.combine == group_combine::sum ? combined + p_of[g][i] : std::max(combined, p_of[g][i]);
        vote[h][static_cast<std::size_t>(slots[i])] += combined;
      }
    }
  }
  const std::int64_t reach = s.pool_kernel / 2;
  const std::int64_t open_from = length - stored % c.page_size, before = std::min(start, open_from);
  const std::int64_t first = sink_rows(kv.format());
  std::vector<std::pair<double, std::int64_t>> ranked;
  std::int64_t live = 0;
  for (const std::int64_t p : slots) {
    if (p < 0) continue;
    ++live;
    if (p < first || p >= before) continue;
    double total = 0;
    for (int h = 0; h < heads; ++h) {
      double pooled = -INFINITY;
      for (std::int64_t u = std::max<std::int64_t>(0, p - reach); u <= std::min(start - 1, p + reach); ++u)
        pooled = std::max(pooled, vote[h][static_cast<std::size_t>(u)]);
      total += pooled;
    }
    ranked.emplace_back(total, p);
  }
  std::sort(ranked.begin(), ranked.end());
  const std::int64_t keep = s.budget.resolve(length);
  const std::int64_t evict = std::min<std::int64_t>(std::max<std::int64_t>(live - keep, 0), static_cast<std::int64_t>(ranked.size()));
  std::set<std::int64_t> out;
  for (std::int64_t i = 0; i < evict; ++i) out.insert(ranked[static_cast<std::size_t>(i)].second);
  return out;
}

template <class Cache>
void prefill(Cache& kv, sequence_id seq, const synthetic::kv_data& data, std::int64_t first, std::int64_t n) {
  const cache_config& c = kv.config();
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data() + first * row, n, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data() + first * row, n, c.num_kv_heads, c.head_dim));
}

/// Prefill `length` tokens, snapshot with `s`, and check the evictions against the brute force
/// and the attention afterwards against the fp64 oracle over the survivors.
template <class Format, class Compactor>
void check_snapshot(const Format& format, const select::snapkv& s, std::int64_t length, std::uint64_t seed,
                    int page_size = 16) {
  const cache_config c = snap_config(page_size);
  cache<Format, select::snapkv, Compactor> kv(c, format, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, seed), 0, static_cast<int>(length));
  const sequence_id seq = kv.add_sequence();
  prefill(kv, seq, data, 0, length);
  const std::vector<float> q = window_queries(c, s.window, seed + 1);
  const std::set<std::int64_t> expected = brute_force_evictions(kv, seq, q);
  const std::int64_t pages_before = kv.memory().pages_used;
  const std::int64_t evicted = kv.snapshot(seq, tensor_view<const float, 3>(q.data(), s.window, c.num_q_heads(), c.head_dim));
  CHECK(evicted == static_cast<std::int64_t>(expected.size()));
  std::vector<std::int64_t> survivors_expected;
  for (std::int64_t p = 0; p < length; ++p)
    if (!expected.count(p)) survivors_expected.push_back(p);
  CHECK(live_positions(kv, seq) == survivors_expected);
  CHECK(kv.length(seq) == length);
  // A compacted sequence holds whole pages of survivors, the tail apart.
  const std::int64_t tail = length % c.page_size;
  const std::int64_t pages_needed = (static_cast<std::int64_t>(survivors_expected.size()) - tail + c.page_size - 1) / c.page_size;
  CHECK(kv.memory().pages_used == pages_needed);
  CHECK(kv.memory().pages_used <= pages_before);
  // The window and the tail always survive.
  for (std::int64_t p = std::min<std::int64_t>(length - s.window, length - tail); p < length; ++p) CHECK(expected.count(p) == 0);
  // Attention over what is left equals the fp64 oracle over the values read back (format::quant2
  // attends with 8-bit queries and probabilities, HACK's Eq. 4: its error is tested with the format).
  if (std::is_same_v<Format, format::quant2>) return;
  const std::vector<float> query = window_queries(c, 1, seed + 7);
  std::vector<float> out(query.size());
  const sequence_id one[] = {seq};
  kv.attend(span<const sequence_id>(one, 1), tensor_view<const float, 3>(query.data(), 1, c.num_q_heads(), c.head_dim),
            tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim));
  const std::int64_t stored = kv.stored_tokens(seq);
  std::vector<float> k(static_cast<std::size_t>(stored) * c.num_kv_heads * c.head_dim), v(k.size());
  kv.read(seq, tensor_view<float, 3>(k.data(), stored, c.num_kv_heads, c.head_dim),
          tensor_view<float, 3>(v.data(), stored, c.num_kv_heads, c.head_dim));
  const std::vector<std::int64_t> slots = kv.positions(seq);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  for (int j = 0; j < c.num_q_heads(); ++j) {
    const int h = j / c.group_size;
    std::vector<double> logit;
    std::vector<std::size_t> rows;
    double m = -INFINITY;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] < 0) continue;
      double dot = 0;
      for (int ch = 0; ch < c.head_dim; ++ch)
        dot += static_cast<double>(query[static_cast<std::size_t>(j) * c.head_dim + ch]) *
               k[(i * c.num_kv_heads + static_cast<std::size_t>(h)) * c.head_dim + static_cast<std::size_t>(ch)];
      logit.push_back(scale * dot);
      rows.push_back(i);
      m = std::max(m, scale * dot);
    }
    for (int ch = 0; ch < c.head_dim; ++ch) {
      double num = 0, den = 0;
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const double p = std::exp(logit[r] - m);
        den += p;
        num += p * v[(rows[r] * c.num_kv_heads + static_cast<std::size_t>(h)) * c.head_dim + static_cast<std::size_t>(ch)];
      }
      CHECK(out[static_cast<std::size_t>(j) * c.head_dim + ch] == Approx(num / den).margin(2e-5));
    }
  }
}

select::snapkv snap(std::int64_t tokens, int window = 32, int pool = 7, group_combine combine = group_combine::sum) {
  select::snapkv s;
  s.budget.tokens = tokens;
  s.window = window;
  s.pool_kernel = pool;
  s.combine = combine;
  return s;
}

}  // namespace

TEST_CASE("snapkv snapshot evicts what a brute-force W x N evaluation evicts, and frees the pages", "[snapkv]") {
  SECTION("dense, repack, budgets 100 and 48") {
    check_snapshot<format::dense, compact::repack>({}, snap(100), 300, 11);
    check_snapshot<format::dense, compact::repack>({}, snap(48, 16, 7, group_combine::max), 250, 12);
  }
  SECTION("dense, hole_fill, pool 1 (no pooling) and pool 15") {
    check_snapshot<format::dense, compact::hole_fill>({}, snap(120, 32, 1), 301, 13);
    check_snapshot<format::dense, compact::hole_fill>({}, snap(120, 8, 15), 301, 14);
  }
  SECTION("bitmap_tiles with sink tokens: scored on the pruned values, the sinks kept") {
    format::bitmap_tiles f;
    f.sink_tokens = 4;
    check_snapshot<format::bitmap_tiles, compact::repack>(f, snap(90), 460, 15, 64);
  }
  SECTION("quant2: scored on the dequantized keys") {
    check_snapshot<format::quant2, compact::repack>({}, snap(100), 470, 16, 64);
  }
  SECTION("budget 0: only the window and the tail stay") {
    check_snapshot<format::dense, compact::repack>({}, snap(0), 200, 17);
  }
  SECTION("budget of the whole context, and beyond: nothing evicted") {
    check_snapshot<format::dense, compact::repack>({}, snap(300), 300, 18);
    check_snapshot<format::dense, compact::repack>({}, snap(1000), 300, 19);
  }
  SECTION("a window as long as the prompt: nothing to evict") {
    check_snapshot<format::dense, compact::repack>({}, snap(10, 40), 40, 20);
  }
}

TEST_CASE("snapkv: a second snapshot scores what the first left, after appends, positions kept", "[snapkv]") {
  const cache_config c = snap_config();
  cache<format::dense, select::snapkv, compact::hole_fill> kv(c, {}, snap(80, 16));
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 21), 0, static_cast<int>(400));
  const sequence_id seq = kv.add_sequence();
  prefill(kv, seq, data, 0, 220);
  const std::vector<float> q1 = window_queries(c, 16, 22);
  kv.snapshot(seq, tensor_view<const float, 3>(q1.data(), 16, c.num_q_heads(), c.head_dim));
  REQUIRE(live_positions(kv, seq).size() == 80);
  prefill(kv, seq, data, 220, 150);  // appends: nothing evicted until the next snapshot
  CHECK(live_positions(kv, seq).size() == 230);
  const std::vector<float> q2 = window_queries(c, 16, 23);
  const std::set<std::int64_t> expected = brute_force_evictions(kv, seq, q2);
  std::vector<std::int64_t> survivors;
  for (const std::int64_t p : live_positions(kv, seq))
    if (!expected.count(p)) survivors.push_back(p);
  CHECK(kv.snapshot(seq, tensor_view<const float, 3>(q2.data(), 16, c.num_q_heads(), c.head_dim)) ==
        static_cast<std::int64_t>(expected.size()));
  CHECK(live_positions(kv, seq) == survivors);
  CHECK(survivors.size() == 80);
}

TEST_CASE("snapkv rejects a window longer than the sequence, queries of the wrong shape, bad parameters", "[snapkv]") {
  const cache_config c = snap_config();
  cache<format::dense, select::snapkv, compact::repack> kv(c, {}, snap(50, 32));
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 1), 0, static_cast<int>(100));
  const sequence_id seq = kv.add_sequence();
  prefill(kv, seq, data, 0, 20);
  const std::vector<float> q = window_queries(c, 33, 1);
  const auto call = [&](std::int64_t w, std::int64_t heads, std::int64_t d) {
    return kv.snapshot(seq, tensor_view<const float, 3>(q.data(), w, heads, d));
  };
  CHECK_THROWS_WITH(call(32, c.num_q_heads(), c.head_dim), Catch::Contains("select::snapkv::window") && Catch::Contains("at most length(seq)"));
  prefill(kv, seq, data, 20, 80);
  CHECK_THROWS_WITH(call(31, c.num_q_heads(), c.head_dim), Catch::Contains("queries.extent(0) (window)"));
  CHECK_THROWS_WITH(call(32, c.num_kv_heads, c.head_dim), Catch::Contains("queries.extent(1) (query heads)"));
  CHECK_THROWS_WITH(call(32, c.num_q_heads(), 32), Catch::Contains("queries.extent(2) (head_dim)"));
  CHECK(live_positions(kv, seq).size() == 100);  // nothing changed
  // cache::window_votes, which the snapshot ranks by, rejects the same shapes and its own arguments.
  const auto votes = [&](std::int64_t w, std::int64_t heads, std::int64_t d, float scale = 0.0f) {
    return kv.window_votes(seq, tensor_view<const float, 3>(q.data(), w, heads, d), scale);
  };
  CHECK_THROWS_WITH(votes(0, c.num_q_heads(), c.head_dim), Catch::Contains("queries.extent(0) (window)") && Catch::Contains("1 to length(seq)"));
  CHECK_THROWS_WITH(votes(32, c.num_kv_heads, c.head_dim), Catch::Contains("queries.extent(1) (query heads)"));
  CHECK_THROWS_WITH(votes(32, c.num_q_heads(), 32), Catch::Contains("queries.extent(2) (head_dim)"));
  CHECK_THROWS_WITH(votes(32, c.num_q_heads(), c.head_dim, -1.0f), Catch::Contains("softmax_scale"));
  CHECK(votes(32, c.num_q_heads(), c.head_dim).size() == static_cast<std::size_t>(68 * c.num_kv_heads));
  CHECK(call(32, c.num_q_heads(), c.head_dim) == 50);
  CHECK_THROWS_WITH((cache<format::dense, select::snapkv, compact::repack>(c, {}, snap(50, 0))),
                    Catch::Contains("window") && Catch::Contains(">= 1"));
  CHECK_THROWS_WITH((cache<format::dense, select::snapkv, compact::repack>(c, {}, snap(50, 32, 6))),
                    Catch::Contains("pool_kernel") && Catch::Contains("odd"));
  CHECK_THROWS_WITH((cache<format::dense, select::snapkv, compact::repack>(c, {}, snap(50, 32, 0))), Catch::Contains("pool_kernel"));
  select::snapkv negative;
  negative.budget.ratio = -0.5;
  CHECK_THROWS_WITH((cache<format::dense, select::snapkv, compact::repack>(c, {}, negative)), Catch::Contains("ratio"));
}
