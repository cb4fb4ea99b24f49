// SPDX-License-Identifier: Apache-2.0
// Token scores from the attend path (host backend) and the selectors that evict by them,
// select::tova and select::h2o: the scores against the fp64 softmax over the stored values, the
// evictions against a brute-force ranking of the same scores, the recent window, memory given
// back, and the rejections.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using test::append_token;
using test::attend_one;
using test::step_query;

cache_config small_config(int max_pages = 64) { return test::two_head_config(max_pages); }

template <class Cache>
std::vector<std::int64_t> live_positions(const Cache& kv, sequence_id seq) {
  std::vector<std::int64_t> live;
  for (const std::int64_t p : kv.positions(seq))
    if (p >= 0) live.push_back(p);
  std::sort(live.begin(), live.end());
  return live;
}

/// The fp64 scores one step over `kv`'s stored values should write ([position][kv head]), and a
/// bound on their difference from the fp32 attend path's. Per query head j, p_j = exp(s_j - m_j)
/// / l_j over the live tokens, s = scale q . k on the values read back (the stored form, exactly:
/// dense and bitmap_tiles score on them); combined over the group. The bound: each logit is a D-term
/// fp32 dot product (error delta_t <= gamma_{D+2} scale sum |q k|); exp(s - m) then moves by a factor
/// within e^{2 delta + u |s - m|}, l by the same and its sum of n terms and the merges of the blocks
/// by gamma_{n + blocks}, so p by a factor within e^{4 delta + 2 u range} (1 + gamma_{n + blocks + 8}).
struct expected_scores {
  std::vector<double> score, bound;
};
template <class Cache>
expected_scores oracle_scores(const Cache& kv, sequence_id seq, const std::vector<float>& q, group_combine combine) {
  const cache_config& c = kv.config();
  const int heads = c.num_kv_heads, groups = c.group_size, d = c.head_dim;
  const std::int64_t stored = kv.stored_tokens(seq), length = kv.length(seq);
  std::vector<float> k(static_cast<std::size_t>(stored) * heads * d), v(k.size());
  kv.read(seq, tensor_view<float, 3>(k.data(), stored, heads, d), tensor_view<float, 3>(v.data(), stored, heads, d));
  const std::vector<std::int64_t> slots = kv.positions(seq);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  expected_scores e;
  e.score.assign(static_cast<std::size_t>(length) * heads, 0.0);
  e.bound.assign(e.score.size(), 0.0);
  std::int64_t live = 0;
  for (const std::int64_t p : slots) live += p >= 0;
  const double blocks = std::ceil(static_cast<double>(stored) / c.page_size) + 2;
  for (int h = 0; h < heads; ++h)
    for (int g = 0; g < groups; ++g) {
      const float* qj = q.data() + static_cast<std::size_t>(h * groups + g) * d;
      std::vector<double> logit(slots.size(), 0.0);
      double delta = 0;
      for (std::size_t i = 0; i < slots.size(); ++i) {
        if (slots[i] < 0) continue;
        double dot = 0, magnitude = 0;
        for (int c2 = 0; c2 < d; ++c2) {
          const double kc = k[(i * heads + static_cast<std::size_t>(h)) * d + static_cast<std::size_t>(c2)];
          dot += static_cast<double>(qj[c2]) * kc;
          magnitude += std::abs(static_cast<double>(qj[c2]) * kc);
        }
        logit[i] = scale * dot;
        delta = std::max(delta, test::gamma(d + 2) * scale * magnitude);
      }
      test::add_probabilities(logit, slots, heads, h, delta, static_cast<double>(live) + blocks + 8, combine, e.score, e.bound);
    }
  return e;
}

/// The `count` lowest of `candidates` by the summed-over-heads score, ties to the earlier position:
/// the brute force the selectors' choice is checked against.
std::vector<std::int64_t> brute_lowest(const detail::token_score_buffer& scores, const std::vector<std::int64_t>& candidates,
                                       std::int64_t count) {
  std::vector<std::pair<double, std::int64_t>> all;
  for (const std::int64_t p : candidates) {
    double total = 0;
    for (int h = 0; h < scores.heads; ++h) total += scores.at(p, h);
    all.emplace_back(total, p);
  }
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

template <class Format>
void check_step_scores(const Format& format, int page_size) {
  cache_config c = small_config();
  c.page_size = page_size;
  const group_combine combine = GENERATE(group_combine::sum, group_combine::max);
  CAPTURE(to_string(combine));
  select::h2o s;
  s.budget.tokens = 1 << 20;  // nothing evicted: the scores alone
  s.combine = combine;
  cache<Format, select::h2o, compact::repack> kv(c, format, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 5), 0, 120);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 100, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data(), 100, c.num_kv_heads, c.head_dim));
  // Step 1 over 100 tokens (pages and a tail), then one more token and step 2: the buffer
  // holds the sum of the two steps' probabilities (H2O's accumulation).
  const std::vector<float> q1 = step_query(c, 1), q2 = step_query(c, 2);
  const expected_scores first = oracle_scores(kv, seq, q1, combine);
  attend_one(kv, seq, q1);
  const detail::token_score_buffer after_first = kv.selector_state(seq).scores;
  REQUIRE(after_first.tokens() == 100);
  REQUIRE(after_first.scored_tokens == 100);
  CHECK(kv.token_scores(seq) == after_first.values);  // the public copy, [position][KV head]
  CHECK(kv.selector_state(seq).scores.values.size() == 100u * static_cast<std::size_t>(c.num_kv_heads));
  for (std::int64_t p = 0; p < 100; ++p)
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const std::size_t at = static_cast<std::size_t>(p) * c.num_kv_heads + static_cast<std::size_t>(h);
      INFO("position " << p << ", head " << h);
      REQUIRE(std::abs(after_first.at(p, h) - first.score[at]) <= first.bound[at]);
    }
  // Every step reads every token: the probabilities of a head's query heads sum to 1 each.
  for (int h = 0; h < c.num_kv_heads; ++h) {
    double total = 0;
    for (std::int64_t p = 0; p < 100; ++p) total += after_first.at(p, h);
    if (combine == group_combine::sum) CHECK(std::abs(total - c.group_size) < 1e-4);
  }
  append_token(kv, seq, data, 100);
  const expected_scores second = oracle_scores(kv, seq, q2, combine);
  attend_one(kv, seq, q2);
  const detail::token_score_buffer& after_second = kv.selector_state(seq).scores;
  REQUIRE(after_second.tokens() == 101);
  for (std::int64_t p = 0; p < 101; ++p)
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const std::size_t at = static_cast<std::size_t>(p) * c.num_kv_heads + static_cast<std::size_t>(h);
      const double expected = (p < 100 ? first.score[at] : 0.0) + second.score[at];
      const double bound = (p < 100 ? first.bound[at] : 0.0) + second.bound[at] + 2 * 5.96e-8 * expected;
      INFO("position " << p << ", head " << h);
      REQUIRE(std::abs(after_second.at(p, h) - expected) <= bound);
    }
}

}  // namespace

TEST_CASE("token scores are each read token's probability under the step's softmax (fp64), summed over steps",
          "[scores]") {
  SECTION("dense") { check_step_scores(format::dense{}, 16); }
  SECTION("bitmap_tiles") { check_step_scores(format::bitmap_tiles{}, 64); }
}

TEST_CASE("select::tova evicts the tokens the last step attended to least, as a brute force over the same scores",
          "[scores][eviction][tova]") {
  const cache_config c = small_config();
  const std::int64_t budget = GENERATE(48, 0, 100, 1000);
  CAPTURE(budget);
  select::tova s;
  s.budget.tokens = budget;
  s.compact_every = 1000;  // no compaction here: positions stay in their slots
  cache<format::dense, select::tova, compact::repack> kv(c, {}, s);
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 7), 0, 101);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 100, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data(), 100, c.num_kv_heads, c.head_dim));
  // No step has scored the prefill: nothing is evicted however far over the budget it is.
  CHECK(live_positions(kv, seq).size() == 100);
  attend_one(kv, seq, step_query(c, 3));
  const detail::token_score_buffer scores = kv.selector_state(seq).scores;
  append_token(kv, seq, data, 100);  // 101 tokens, the tail 96..100: the candidates are 0..95
  std::vector<std::int64_t> candidates;
  for (std::int64_t p = 0; p < 96; ++p) candidates.push_back(p);
  const std::int64_t over = std::max<std::int64_t>(0, 101 - budget);
  const std::vector<std::int64_t> expected = brute_lowest(scores, candidates, over);
  std::vector<std::int64_t> all;
  for (std::int64_t p = 0; p < 101; ++p) all.push_back(p);
  const std::vector<std::int64_t> live = live_positions(kv, seq);
  CHECK(difference(all, live) == expected);
  CHECK(static_cast<std::int64_t>(live.size()) == std::max<std::int64_t>(std::min<std::int64_t>(budget, 101), 5));

  // Attention then reads exactly the live tokens (fp64 oracle over them).
  const std::vector<float> q = step_query(c, 4);
  const std::vector<float> out = attend_one(kv, seq, q);
  const synthetic::kv_data kept = test::tokens_of(test::rounded(data, c.storage), live);
  const double scale = 1.0 / std::sqrt(64.0);
  const std::vector<double> exact = test::exact(q, kept, scale);
  const test::error_bound bound = test::attention_error_bound(q, kept, c.group_size, scale, c.storage, c.page_size, true, 0.0,
                                                              0.0, 8);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  }
}

TEST_CASE("select::h2o keeps the recent window and the heaviest hitters, frees memory, and compaction changes no decision",
          "[scores][eviction][h2o]") {
  cache_config c = small_config(12);  // 400 tokens need 25 pages: only eviction and compaction make room
  select::h2o s;
  s.budget.tokens = 64;  // 32 recent, 32 heavy hitters
  s.compact_every = 16;
  cache<format::dense, select::h2o, compact::repack> kv(c, {}, s);
  cache_config roomy = c;
  roomy.max_pages = 64;
  select::h2o never = s;
  never.compact_every = 1 << 30;
  cache<format::dense, select::h2o, compact::repack> uncompacted(roomy, {}, never);
  const int total = 400;
  const synthetic::kv_data data = synthetic::generate_kv(test::generator_for(c, 9), 0, total);
  const sequence_id seq = kv.add_sequence(), other = uncompacted.add_sequence();
  kv.prefill(seq, tensor_view<const float, 3>(data.k.data(), 40, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(data.v.data(), 40, c.num_kv_heads, c.head_dim));
  uncompacted.prefill(other, tensor_view<const float, 3>(data.k.data(), 40, c.num_kv_heads, c.head_dim),
                      tensor_view<const float, 3>(data.v.data(), 40, c.num_kv_heads, c.head_dim));
  std::int64_t most_pages = 0;
  for (int t = 40; t < total; ++t) {
    const std::vector<float> q = step_query(c, t);
    const std::vector<float> out = attend_one(kv, seq, q);
    attend_one(uncompacted, other, q);
    const detail::token_score_buffer scores = kv.selector_state(seq).scores;
    const std::vector<std::int64_t> before = live_positions(kv, seq);
    append_token(kv, seq, data, t);
    append_token(uncompacted, other, data, t);
    const std::int64_t n = t + 1;
    const std::vector<std::int64_t> live = live_positions(kv, seq);
    CAPTURE(t);
    // The recent window is live; the evicted tokens are the lowest-scored older ones.
    for (std::int64_t p = n - 32; p < n; ++p) REQUIRE(std::binary_search(live.begin(), live.end(), p));
    const std::int64_t open_from = n - (n % c.page_size);
    std::vector<std::int64_t> candidates;
    for (const std::int64_t p : before)
      if (p < std::min<std::int64_t>({open_from, n - 32, t})) candidates.push_back(p);
    const std::int64_t stored = static_cast<std::int64_t>(before.size()) + 1;
    const auto candidate_count = static_cast<std::int64_t>(candidates.size());
    REQUIRE(difference(before, live) == brute_lowest(scores, candidates, stored - 64));
    REQUIRE(static_cast<std::int64_t>(live.size()) == (stored > 64 ? std::max<std::int64_t>(64, stored - candidate_count) : stored));
    // The uncompacted cache decided the same (the compaction moves slots, not scores).
    REQUIRE(live_positions(uncompacted, other) == live);
    most_pages = std::max<std::int64_t>(most_pages, kv.pool().used_pages());
  }
  CHECK(most_pages <= 12);
  CHECK(uncompacted.pool().used_pages() > kv.pool().used_pages());
}

TEST_CASE("score selectors reject bad parameters, naming them", "[scores][errors]") {
  const cache_config c = small_config();
  select::h2o h;
  h.recent_share = 1.5;
  CHECK_THROWS_WITH((cache<format::dense, select::h2o, compact::repack>(c, {}, h)), Catch::Contains("recent_share"));
  h.recent_share = 0.5;
  h.budget.ratio = 2.0;
  CHECK_THROWS_WITH((cache<format::dense, select::h2o, compact::repack>(c, {}, h)), Catch::Contains("budget.ratio"));
  select::tova t;
  t.compact_every = 0;
  CHECK_THROWS_WITH((cache<format::dense, select::tova, compact::repack>(c, {}, t)), Catch::Contains("compact_every"));
  CHECK(selector_traits<select::tova>::describe(select::tova{}) == "tova(1/16, sum, compact every 128)");
}
