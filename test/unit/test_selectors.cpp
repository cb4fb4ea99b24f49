// SPDX-License-Identifier: Apache-2.0
// Read-less selectors on the host backend: select::quest and select::sentence_chunks. The split
// against hand-worked cases of SentKVCompress's Algorithm 2; selections against a brute-force
// selection computed here in fp64 from the stored keys; attention against fp64 exact attention
// over exactly the tokens the step read; budgets of 0, of the context and beyond; reuse; bad input.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

using ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

synthetic::kv_config synthetic_for(const cache_config& c, std::uint64_t seed = 3) {
  return test::generator_for(c, seed);
}

cache_config small_config(int page_size = 64) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = page_size;
  c.max_pages = 256;
  c.max_sequences = 4;
  return c;
}

std::vector<select::boundary> synthetic_boundaries() {
  std::vector<select::boundary> b;
  for (const auto& t : synthetic::boundary_tokens) b.push_back(select::boundary{t.id, t.weight});
  return b;
}

/// The tokens of `kv` inside `read` (ascending ranges), as their own kv_data.
synthetic::kv_data subset(const synthetic::kv_data& kv, const ranges& read) {
  synthetic::kv_data r;
  r.num_kv_heads = kv.num_kv_heads;
  r.head_dim = kv.head_dim;
  const std::size_t row = static_cast<std::size_t>(kv.num_kv_heads) * kv.head_dim;
  for (const auto& [from, to] : read)
    for (std::int64_t t = from; t < to; ++t) {
      r.k.insert(r.k.end(), kv.k.begin() + static_cast<std::ptrdiff_t>(t * row), kv.k.begin() + static_cast<std::ptrdiff_t>((t + 1) * row));
      r.v.insert(r.v.end(), kv.v.begin() + static_cast<std::ptrdiff_t>(t * row), kv.v.begin() + static_cast<std::ptrdiff_t>((t + 1) * row));
      ++r.num_tokens;
    }
  return r;
}

/// One KV head's slice of kv_data (num_kv_heads = 1).
synthetic::kv_data head_of(const synthetic::kv_data& kv, int head) {
  synthetic::kv_data r;
  r.num_kv_heads = 1;
  r.head_dim = kv.head_dim;
  r.num_tokens = kv.num_tokens;
  for (int t = 0; t < kv.num_tokens; ++t) {
    r.k.insert(r.k.end(), kv.k_row(t, head), kv.k_row(t, head) + kv.head_dim);
    r.v.insert(r.v.end(), kv.v_row(t, head), kv.v_row(t, head) + kv.head_dim);
  }
  return r;
}

ranges merged(ranges r) {
  std::sort(r.begin(), r.end());
  ranges out;
  for (const auto& x : r) {
    if (!out.empty() && x.first <= out.back().second)
      out.back().second = std::max(out.back().second, x.second);
    else
      out.push_back(x);
  }
  return out;
}

template <class Cache>
std::vector<float> attend_one(Cache& c, sequence_id seq, const std::vector<float>& q) {
  const int hq = c.config().num_q_heads(), d = c.config().head_dim;
  std::vector<float> out(q.size());
  c.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, hq, d),
           tensor_view<float, 3>(out.data(), 1, hq, d));
  return out;
}

/// Checks the output of KV head `head` (its group of query heads) against fp64 exact attention
/// over the tokens `read` of the stored (rounded) values, with the fp32 bound.
void check_head_against_exact(const std::vector<float>& got, const std::vector<float>& q, const synthetic::kv_data& stored,
                              const ranges& read, const cache_config& c, int head) {
  const synthetic::kv_data kv = subset(head_of(stored, head), read);
  REQUIRE(kv.num_tokens > 0);
  const int d = c.head_dim, g = c.group_size;
  const std::vector<float> qh(q.begin() + static_cast<std::ptrdiff_t>(head) * g * d,
                              q.begin() + static_cast<std::ptrdiff_t>(head + 1) * g * d);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto exact = test::exact(qh, kv, scale);
  const auto bound = test::attention_error_bound(qh, kv, g, scale, c.storage, c.page_size, true);
  for (std::size_t i = 0; i < exact.size(); ++i)
    REQUIRE(std::abs(got[static_cast<std::size_t>(head) * g * d + i] - exact[i]) <= bound.per_element[i]);
}

/// Quest's bound of tokens [first, end) of KV head `head` in fp64 from the stored keys, the query
/// heads of the group combined by max.
double fp64_group_score(const synthetic::kv_data& stored, const std::vector<float>& q, int head, int group,
                        std::int64_t first, std::int64_t end) {
  const int d = stored.head_dim;
  double best = -INFINITY;
  for (int g = 0; g < group; ++g) {
    const float* qg = q.data() + static_cast<std::size_t>(head * group + g) * d;
    double score = 0;
    for (int c = 0; c < d; ++c) {
      double lo = INFINITY, hi = -INFINITY;
      for (std::int64_t t = first; t < end; ++t) {
        lo = std::min(lo, static_cast<double>(stored.k_at(static_cast<int>(t), head, c)));
        hi = std::max(hi, static_cast<double>(stored.k_at(static_cast<int>(t), head, c)));
      }
      score += std::max(qg[c] * lo, qg[c] * hi);
    }
    best = std::max(best, score);
  }
  return best;
}

/// The top floor(budget / block) of the blocks of [0, sealed) by `score(first, end)` (fp64):
/// their ranges, and the gap between the last chosen and the first rejected score (relative).
template <class Score>
std::pair<ranges, double> brute_force_blocks(std::int64_t sealed, int block, std::int64_t budget, Score&& score) {
  std::vector<std::pair<double, std::int64_t>> scored;  // (-score, block)
  for (std::int64_t first = 0; first < sealed; first += block) scored.emplace_back(-score(first, first + block), first / block);
  std::sort(scored.begin(), scored.end());
  const auto k = static_cast<std::size_t>(std::min<std::int64_t>(budget / block, static_cast<std::int64_t>(scored.size())));
  ranges chosen;
  for (std::size_t i = 0; i < k; ++i) chosen.emplace_back(scored[i].second * block, (scored[i].second + 1) * block);
  double gap = INFINITY;
  if (k > 0 && k < scored.size())
    gap = (scored[k].first - scored[k - 1].first) / std::max(1.0, std::abs(scored[k - 1].first));
  return {merged(chosen), gap};
}

/// Brute-force Quest selection in fp64 from the stored keys: per block the channel min and max,
/// the group's bound scores combined by max.
std::pair<ranges, double> brute_force_quest(const synthetic::kv_data& stored, const std::vector<float>& q, int head,
                                            int group, std::int64_t sealed, int block, std::int64_t budget) {
  return brute_force_blocks(sealed, block, budget, [&](std::int64_t first, std::int64_t end) {
    return fp64_group_score(stored, q, head, group, first, end);
  });
}

/// MosaicKV's stage 2 in fp64 from the stored keys: per block the mean key, the group's scores
/// q . mean combined by max.
std::pair<ranges, double> brute_force_mean_keys(const synthetic::kv_data& stored, const std::vector<float>& q, int head,
                                                int group, std::int64_t sealed, int block, std::int64_t budget) {
  const int d = stored.head_dim;
  return brute_force_blocks(sealed, block, budget, [&](std::int64_t first, std::int64_t end) {
    double best = -INFINITY;
    for (int g = 0; g < group; ++g) {
      const float* qg = q.data() + static_cast<std::size_t>(head * group + g) * d;
      double score = 0;
      for (int c = 0; c < d; ++c) {
        double mean = 0;
        for (std::int64_t t = first; t < end; ++t) mean += stored.k_at(static_cast<int>(t), head, c);
        score += qg[c] * (mean / static_cast<double>(end - first));
      }
      best = std::max(best, score);
    }
    return best;
  });
}

}  // namespace

TEST_CASE("sentence_split follows Algorithm 2 on hand-worked streams", "[selectors][sentence_chunks]") {
  select::sentence_chunks s;  // L = 14, Delta = 8
  s.boundaries = {{1, 1.0f}, {2, 0.5f}, {3, 0.6f}};
  const auto split = [&](const std::vector<std::int32_t>& ids) {
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    for (const auto& c : select::sentence_split(ids.data(), static_cast<std::int64_t>(ids.size()), s)) out.emplace_back(c.begin, c.end);
    return out;
  };
  SECTION("a strong boundary beats a closer weak one; no boundary: ideal end; the stream's end") {
    // current 0: ideal 14, window [6, 22], candidates 10 (S = 1: 0.7 + 0.3 (1 - 4/8) = 0.85) and
    // 15 (S = 0.5: 0.35 + 0.3 (1 - 1/8) = 0.6125) -> 10. current 10: ideal 24, window [16, 32]:
    // 30 (0.7 + 0.3 (1 - 6/8) = 0.775) -> 30. current 30: ideal min(44, 40) = 40, window [32, 40],
    // no boundary before token 40 -> 40.
    std::vector<std::int32_t> ids(40, 100);
    ids[10] = 1;
    ids[15] = 2;
    ids[30] = 1;
    CHECK(split(ids) == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 10}, {10, 30}, {30, 40}});
  }
  SECTION("weight against distance, and the end of the window") {
    // current 0: 14 (S = 0.6: 0.42 + 0.3 = 0.72) loses to 20 (S = 1: 0.7 + 0.3 (1 - 6/8) = 0.775).
    // current 20: ideal 30 = n, window [22, 30], no token 30 -> 30.
    std::vector<std::int32_t> ids(30, 100);
    ids[14] = 3;
    ids[20] = 1;
    CHECK(split(ids) == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 20}, {20, 30}});
  }
  SECTION("equal scores: the first candidate; no boundary at all: chunks of L") {
    std::vector<std::int32_t> ids(50, 100);
    ids[12] = 1;  // both 2 from the ideal end 14
    ids[16] = 1;
    const auto chunks = split(ids);
    REQUIRE(chunks.size() >= 2);
    CHECK(chunks[0] == std::make_pair<std::int64_t, std::int64_t>(0, 12));
    std::vector<std::int32_t> plain(45, 100);
    CHECK(split(plain) == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 14}, {14, 28}, {28, 42}, {42, 45}});
  }
  SECTION("a window that starts past the current token: the split moves at least one token") {
    select::sentence_chunks tiny = s;
    tiny.target_length = 2;
    tiny.window = 8;  // window_start = max(2 - 8, current + 1)
    std::vector<std::int32_t> ids(6, 100);
    ids[1] = 1;
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    for (const auto& c : select::sentence_split(ids.data(), 6, tiny)) out.emplace_back(c.begin, c.end);
    CHECK(out.front() == std::make_pair<std::int64_t, std::int64_t>(0, 1));
    for (const auto& c : out) CHECK(c.second > c.first);
  }
}

TEST_CASE("the cache cuts the same chunks as Algorithm 2, in one prefill or token by token", "[selectors][sentence_chunks]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_for(c);
  const int n = 700;
  const auto tokens = synthetic::generate_tokens(syn, 0, n);
  const auto kv = synthetic::generate_kv(syn, 0, n);
  select::sentence_chunks s;
  s.boundaries = synthetic_boundaries();
  const auto expected = select::sentence_split(tokens.ids.data(), n, s);

  cache<format::dense, select::sentence_chunks> whole(c, {}, s), pieces(c, {}, s);
  const sequence_id a = whole.add_sequence(), b = pieces.add_sequence();
  whole.prefill(a, test::k_view(kv), test::v_view(kv), span<const std::int32_t>(tokens.ids.data(), n));
  const int first = 300;
  pieces.prefill(b, tensor_view<const float, 3>(kv.k.data(), first, c.num_kv_heads, c.head_dim),
                 tensor_view<const float, 3>(kv.v.data(), first, c.num_kv_heads, c.head_dim),
                 span<const std::int32_t>(tokens.ids.data(), first));
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  for (int t = first; t < n; ++t)
    pieces.append(span<const sequence_id>(&b, 1), tensor_view<const float, 3>(kv.k.data() + t * row, 1, c.num_kv_heads, c.head_dim),
                  tensor_view<const float, 3>(kv.v.data() + t * row, 1, c.num_kv_heads, c.head_dim),
                  span<const std::int32_t>(tokens.ids.data() + t, 1));
  const auto got = whole.chunks(a);
  REQUIRE(got.size() == pieces.chunks(b).size());
  REQUIRE(got.size() + 2 >= expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].begin == expected[i].begin);
    CHECK(got[i].end == expected[i].end);
    CHECK(pieces.chunks(b)[i].end == got[i].end);
  }
  // Final chunks stop where the window could still see a future token.
  CHECK(n - got.back().end <= s.target_length + s.window);
  CHECK(n - got.back().end >= 0);
  // Chunk bounds are counted: 2 rows of head_dim 16-bit values per chunk and KV head.
  const memory_stats m = whole.memory();
  const std::int64_t pages = n / c.page_size;
  const std::int64_t expected_bytes = pages * 2 * c.num_kv_heads * c.page_size * c.head_dim * 2 +
                                      (n - pages * c.page_size) * 2 * c.num_kv_heads * c.head_dim * 2 +
                                      static_cast<std::int64_t>(got.size()) * c.num_kv_heads * 2 * c.head_dim * 2;
  CHECK(m.stored_bytes == expected_bytes);
}

TEST_CASE("quest selects the blocks a brute-force fp64 selection picks, and attends exactly those", "[selectors][quest]") {
  for (const int block : {16, 64}) {
    for (const double ratio : {1.0 / 16, 1.0 / 8, 1.0 / 4}) {
      CAPTURE(block, ratio);
      const cache_config c = small_config();
      const synthetic::kv_config syn = synthetic_for(c, 5);
      const int n = 1000;
      const auto kv = synthetic::generate_kv(syn, 1, n);
      select::quest s;
      s.block_tokens = block;
      s.budget.ratio = ratio;
      s.combine = group_combine::max;  // what brute_force_quest computes
      cache<format::dense, select::quest> q_cache(c, {}, s);
      const sequence_id seq = q_cache.add_sequence();
      q_cache.prefill(seq, test::k_view(kv), test::v_view(kv));
      const auto q = synthetic::generate_query(syn, 1, n);
      const auto out = attend_one(q_cache, seq, q);
      const synthetic::kv_data stored = test::rounded(kv, c.storage);
      const std::int64_t sealed = n / c.page_size * c.page_size;
      const std::int64_t budget = static_cast<std::int64_t>(std::floor(ratio * n));
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const auto [expected, gap] = brute_force_quest(stored, q, h, c.group_size, sealed, block, budget);
        REQUIRE(gap > 1e-4);  // the cut is not a near-tie, so fp32 and fp64 orders agree
        CHECK(q_cache.selected_ranges(seq, h) == expected);
        ranges read = expected;
        read.emplace_back(sealed, n);  // the tail
        check_head_against_exact(out, q, stored, merged(read), c, h);
      }
      const selection_stats stats = q_cache.selection(seq);
      CHECK(stats.tokens_selected == Approx(static_cast<double>(budget / block * block)));
      CHECK(stats.tokens_read == Approx(static_cast<double>(budget / block * block + n - sealed)));
      CHECK(std::isnan(stats.reuse));
    }
  }
}

TEST_CASE("budgets of 0, of the whole context and beyond", "[selectors]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_for(c, 9);
  const int n = 617;
  const auto kv = synthetic::generate_kv(syn, 2, n);
  const auto tokens = synthetic::generate_tokens(syn, 2, n);
  const auto q = synthetic::generate_query(syn, 2, n);
  const span<const std::int32_t> ids(tokens.ids.data(), n);
  cache<format::dense> all(c);
  const sequence_id a = all.add_sequence();
  all.prefill(a, test::k_view(kv), test::v_view(kv));
  const auto exact_all = attend_one(all, a, q);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const std::int64_t sealed = n / c.page_size * c.page_size;

  for (const std::int64_t budget : {std::int64_t{n}, std::int64_t{5 * n}}) {
    select::quest sq;
    sq.budget.tokens = budget;
    cache<format::dense, select::quest> qc(c, {}, sq);
    const sequence_id s = qc.add_sequence();
    qc.prefill(s, test::k_view(kv), test::v_view(kv));
    CHECK(attend_one(qc, s, q) == exact_all);  // every block: the same folds as select::all
    select::sentence_chunks sc;
    sc.boundaries = synthetic_boundaries();
    sc.budget.tokens = budget;
    cache<format::dense, select::sentence_chunks> cc(c, {}, sc);
    const sequence_id t = cc.add_sequence();
    cc.prefill(t, test::k_view(kv), test::v_view(kv), ids);
    CHECK(attend_one(cc, t, q) == exact_all);
    CHECK(cc.selection(t).tokens_read == Approx(n));
  }
  SECTION("budget 0: only the tail (and the open chunk)") {
    select::quest sq;
    sq.budget.tokens = 0;
    cache<format::dense, select::quest> qc(c, {}, sq);
    const sequence_id s = qc.add_sequence();
    qc.prefill(s, test::k_view(kv), test::v_view(kv));
    const auto out = attend_one(qc, s, q);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      CHECK(qc.selected_ranges(s, h).empty());
      check_head_against_exact(out, q, stored, {{sealed, n}}, c, h);
    }
    CHECK(qc.selection(s).pages_read == 0);
    select::sentence_chunks sc;
    sc.boundaries = synthetic_boundaries();
    sc.budget.ratio = 0;
    cache<format::dense, select::sentence_chunks> cc(c, {}, sc);
    const sequence_id t = cc.add_sequence();
    cc.prefill(t, test::k_view(kv), test::v_view(kv), ids);
    const auto chunk_out = attend_one(cc, t, q);
    const std::int64_t open = cc.chunks(t).back().end;
    for (int h = 0; h < c.num_kv_heads; ++h) check_head_against_exact(chunk_out, q, stored, {{std::min(open, sealed), n}}, c, h);
  }
  SECTION("budget 0 with an empty tail: the best block, so that the step attends to something") {
    select::quest sq;
    sq.budget.tokens = 0;
    sq.block_tokens = 16;
    sq.combine = group_combine::max;
    cache<format::dense, select::quest> qc(c, {}, sq);
    const sequence_id s = qc.add_sequence();
    qc.prefill(s, tensor_view<const float, 3>(kv.k.data(), 128, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(kv.v.data(), 128, c.num_kv_heads, c.head_dim));
    const auto out = attend_one(qc, s, q);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const auto& chosen = qc.selected_ranges(s, h);
      REQUIRE(chosen.size() == 1);
      CHECK(chosen[0].second - chosen[0].first == 16);
      const auto [expected, gap] = brute_force_quest(stored, q, h, c.group_size, 128, 16, 16);
      REQUIRE(gap > 1e-4);
      CHECK(chosen == expected);
      check_head_against_exact(out, q, stored, chosen, c, h);
    }
  }
  SECTION("a sequence still in its tail reads its tail") {
    select::quest sq;
    cache<format::dense, select::quest> qc(c, {}, sq);
    const sequence_id s = qc.add_sequence();
    qc.prefill(s, tensor_view<const float, 3>(kv.k.data(), 20, c.num_kv_heads, c.head_dim),
               tensor_view<const float, 3>(kv.v.data(), 20, c.num_kv_heads, c.head_dim));
    const auto out = attend_one(qc, s, q);
    for (int h = 0; h < c.num_kv_heads; ++h) check_head_against_exact(out, q, stored, {{0, 20}}, c, h);
  }
}

TEST_CASE("sentence_chunks fills the budget with whole chunks in score order and reports reuse", "[selectors][sentence_chunks]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_for(c, 11);
  const int n = 2000;
  const auto kv = synthetic::generate_kv(syn, 4, n + 8);
  const auto tokens = synthetic::generate_tokens(syn, 4, n + 8);
  select::sentence_chunks s;
  s.boundaries = synthetic_boundaries();
  s.budget.ratio = 1.0 / 8;
  s.combine = group_combine::max;  // what the brute force below computes
  cache<format::dense, select::sentence_chunks> cc(c, {}, s);
  const sequence_id seq = cc.add_sequence();
  cc.prefill(seq, tensor_view<const float, 3>(kv.k.data(), n, c.num_kv_heads, c.head_dim),
             tensor_view<const float, 3>(kv.v.data(), n, c.num_kv_heads, c.head_dim), span<const std::int32_t>(tokens.ids.data(), n));
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const auto chunks = cc.chunks(seq);
  const auto q = synthetic::generate_query(syn, 4, n);
  const auto out = attend_one(cc, seq, q);
  const std::int64_t budget = n / 8, sealed = n / c.page_size * c.page_size;
  for (int h = 0; h < c.num_kv_heads; ++h) {
    // Brute force: fp64 scores per chunk, the longest prefix of the score order within the budget.
    std::vector<std::pair<double, std::size_t>> scored;
    for (std::size_t i = 0; i < chunks.size(); ++i)
      scored.emplace_back(-fp64_group_score(stored, q, h, c.group_size, chunks[i].begin, chunks[i].end), i);
    std::sort(scored.begin(), scored.end());
    ranges expected;
    std::int64_t used = 0;
    std::size_t taken = 0;
    for (; taken < scored.size(); ++taken) {
      const auto& ch = chunks[scored[taken].second];
      if (used + (ch.end - ch.begin) > budget) break;
      used += ch.end - ch.begin;
      expected.emplace_back(ch.begin, ch.end);
    }
    REQUIRE(taken < scored.size());
    REQUIRE((scored[taken].first - scored[taken - 1].first) / std::abs(scored[taken - 1].first) > 1e-4);
    CHECK(cc.selected_ranges(seq, h) == merged(expected));
    CHECK(used <= budget);
    ranges read = expected;
    read.emplace_back(std::min(chunks.back().end, sealed), n);
    check_head_against_exact(out, q, stored, merged(read), c, h);
  }
  // The next steps: one more token each; reuse is the share of the previous selection read again.
  const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
  for (int t = n; t < n + 8; ++t) {
    cc.append(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(kv.k.data() + t * row, 1, c.num_kv_heads, c.head_dim),
              tensor_view<const float, 3>(kv.v.data() + t * row, 1, c.num_kv_heads, c.head_dim),
              span<const std::int32_t>(tokens.ids.data() + t, 1));
    std::vector<ranges> previous;
    for (int h = 0; h < c.num_kv_heads; ++h) previous.push_back(cc.selected_ranges(seq, h));
    attend_one(cc, seq, synthetic::generate_query(syn, 4, t + 1));
    // Expected reuse, token by token: of the previous selection's tokens (all KV heads), those
    // read again (selected now, or from the open chunk / the tail on).
    const std::int64_t always_from = std::min<std::int64_t>(cc.chunks(seq).back().end, (t + 1) / c.page_size * c.page_size);
    double kept = 0, total = 0;
    for (int h = 0; h < c.num_kv_heads; ++h) {
      std::vector<char> read(static_cast<std::size_t>(t + 1), 0);
      for (const auto& [from, to] : cc.selected_ranges(seq, h))
        for (std::int64_t x = from; x < to; ++x) read[static_cast<std::size_t>(x)] = 1;
      for (const auto& [from, to] : previous[static_cast<std::size_t>(h)])
        for (std::int64_t x = from; x < to; ++x) {
          total += 1;
          kept += read[static_cast<std::size_t>(x)] || x >= always_from;
        }
    }
    CHECK(cc.selection(seq).reuse == Approx(kept / total).epsilon(1e-12));
  }
  CHECK(cc.selection(seq).reuse > 0.5);  // neighbouring steps share most of their sentences
}

TEST_CASE("quest over compressed formats reads only selected pages; sinks and tail always", "[selectors][quest]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_for(c, 13);
  const int n = 900;
  const auto kv = synthetic::generate_kv(syn, 6, n);
  const auto q = synthetic::generate_query(syn, 6, n);
  select::quest s;
  s.budget.tokens = 0;
  format::quant2 f;
  f.sink_tokens = 4;
  cache<format::quant2, select::quest> qc(c, f, s);
  const sequence_id seq = qc.add_sequence();
  qc.prefill(seq, test::k_view(kv), test::v_view(kv));
  const auto out = attend_one(qc, seq, q);
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const std::int64_t sealed = n / c.page_size * c.page_size;
  for (int h = 0; h < c.num_kv_heads; ++h) check_head_against_exact(out, q, stored, {{0, 4}, {sealed, n}}, c, h);
  CHECK(qc.selection(seq).tokens_read == Approx(4 + n - sealed));

  // With every block selected, quest over bitmap_tiles is select::all over bitmap_tiles, bitwise.
  format::bitmap_tiles bt;
  bt.s_k = bt.s_v = 0.5;
  select::quest everything;
  everything.budget.ratio = 1.0;
  cache<format::bitmap_tiles, select::quest> sel(c, bt, everything);
  cache<format::bitmap_tiles> plain(c, bt);
  const sequence_id a = sel.add_sequence(), b = plain.add_sequence();
  sel.prefill(a, test::k_view(kv), test::v_view(kv));
  plain.prefill(b, test::k_view(kv), test::v_view(kv));
  CHECK(attend_one(sel, a, q) == attend_one(plain, b, q));
  // The bounds cost 2 rows of head_dim per block and KV head on top of each page.
  const int blocks_per_page = c.page_size / everything.block_for(c.page_size);
  CHECK(sel.memory().stored_bytes - plain.memory().stored_bytes ==
        static_cast<std::int64_t>(sel.memory().pages_used) * blocks_per_page * c.num_kv_heads * 2 * c.head_dim * 2);
}

TEST_CASE("mean_keys selects the blocks a brute-force fp64 mean-key selection picks, and attends exactly those",
          "[selectors][mean_keys]") {
  for (const int block : {8, 16, 64}) {
    for (const double ratio : {1.0 / 16, 1.0 / 8, 1.0 / 4}) {
      CAPTURE(block, ratio);
      const cache_config c = small_config();
      const synthetic::kv_config syn = synthetic_for(c, 21);
      const int n = 1000;
      const auto kv = synthetic::generate_kv(syn, 3, n);
      select::mean_keys s;
      s.block_tokens = block;
      s.budget.ratio = ratio;
      cache<format::dense, select::mean_keys> m_cache(c, {}, s);
      const sequence_id seq = m_cache.add_sequence();
      m_cache.prefill(seq, test::k_view(kv), test::v_view(kv));
      const auto q = synthetic::generate_query(syn, 3, n);
      const auto out = attend_one(m_cache, seq, q);
      const synthetic::kv_data stored = test::rounded(kv, c.storage);
      const std::int64_t sealed = n / c.page_size * c.page_size;
      const std::int64_t budget = static_cast<std::int64_t>(std::floor(ratio * n));
      int compared = 0;
      for (int h = 0; h < c.num_kv_heads; ++h) {
        const auto [expected, gap] = brute_force_mean_keys(stored, q, h, c.group_size, sealed, block, budget);
        // The mean row is rounded to bf16 before scoring: skip a head whose cut is that close.
        if (gap < 1e-2) continue;
        ++compared;
        CHECK(m_cache.selected_ranges(seq, h) == expected);
        ranges read = expected;
        read.emplace_back(sealed, n);  // the tail
        check_head_against_exact(out, q, stored, merged(read), c, h);
      }
      CHECK(compared >= c.num_kv_heads / 2);
      CHECK(m_cache.selection(seq).tokens_selected == Approx(static_cast<double>(budget / block * block)));
    }
  }
}

TEST_CASE("mean_keys keeps one mean row per block; a whole-context budget is select::all; bad parameters named",
          "[selectors][mean_keys]") {
  const cache_config c = small_config();
  const synthetic::kv_config syn = synthetic_for(c, 23);
  const int n = 700;
  const auto kv = synthetic::generate_kv(syn, 4, n);
  const auto q = synthetic::generate_query(syn, 4, n);
  select::mean_keys everything;
  everything.budget.ratio = 1.0;
  everything.block_tokens = 16;
  format::quant2 f;
  f.sink_tokens = 4;
  cache<format::quant2, select::mean_keys> sel(c, f, everything);
  cache<format::quant2> plain(c, f);
  const sequence_id a = sel.add_sequence(), b = plain.add_sequence();
  sel.prefill(a, test::k_view(kv), test::v_view(kv));
  plain.prefill(b, test::k_view(kv), test::v_view(kv));
  CHECK(attend_one(sel, a, q) == attend_one(plain, b, q));
  // One row of head_dim per block and KV head on top of each page (quest keeps two).
  CHECK(sel.memory().stored_bytes - plain.memory().stored_bytes ==
        static_cast<std::int64_t>(sel.memory().pages_used) * (c.page_size / 16) * c.num_kv_heads * c.head_dim * 2);
  // The stored row is the fp32 mean of the block's stored keys, rounded to bf16.
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const page_id page = sel.pages(a)[1];
  const std::byte* row = sel.engine().page_bounds(page, 1, 2);  // KV head 1, tokens 64 + 32 .. 64 + 47
  for (int ch = 0; ch < c.head_dim; ++ch) {
    float sum = 0.0f;
    for (int t = 96; t < 112; ++t) sum = sum + stored.k_at(t, 1, ch);
    std::uint16_t bits;
    std::memcpy(&bits, row + 2 * ch, 2);
    CHECK(detail::bfloat16_bits_to_float(bits) == to_float(bfloat16(sum / 16.0f)));
  }
  CHECK(selector_traits<select::mean_keys>::describe(everything) == "mean_keys(1/1, block 16, max)");
  select::mean_keys bad_block;
  bad_block.block_tokens = 12;
  CHECK_THROWS_WITH((cache<format::dense, select::mean_keys>(c, {}, bad_block)),
                    Catch::Contains("select::mean_keys") && Catch::Contains("block_tokens"));
  select::mean_keys bad_ratio;
  bad_ratio.budget.ratio = -0.5;
  CHECK_THROWS_WITH((cache<format::dense, select::mean_keys>(c, {}, bad_ratio)), Catch::Contains("budget.ratio"));
  // Over packed_bitmap (host): the selection comes from the exact keys, the reads from the pages.
  format::packed_bitmap pb;
  pb.sink_tokens = 4;
  select::mean_keys eighth;
  eighth.budget.ratio = 1.0 / 8;
  cache<format::packed_bitmap, select::mean_keys> packed(c, pb, eighth);
  const sequence_id p = packed.add_sequence();
  packed.prefill(p, test::k_view(kv), test::v_view(kv));
  const auto got = attend_one(packed, p, q);
  for (const float x : got) CHECK(std::isfinite(x));
  CHECK(packed.selection(p).tokens_selected == Approx(static_cast<double>(n / 8 / 16 * 16)));
}

TEST_CASE("selectors reject bad parameters naming them", "[selectors]") {
  const cache_config c = small_config();
  select::quest bad_block;
  bad_block.block_tokens = 12;
  CHECK_THROWS_WITH((cache<format::dense, select::quest>(c, {}, bad_block)), Catch::Contains("block_tokens"));
  bad_block.block_tokens = 128;  // larger than the page
  CHECK_THROWS_WITH((cache<format::dense, select::quest>(c, {}, bad_block)), Catch::Contains("block_tokens"));
  select::quest bad_ratio;
  bad_ratio.budget.ratio = 1.5;
  CHECK_THROWS_WITH((cache<format::dense, select::quest>(c, {}, bad_ratio)), Catch::Contains("budget.ratio"));
  select::sentence_chunks bad_window;
  bad_window.window = 0;
  CHECK_THROWS_WITH((cache<format::dense, select::sentence_chunks>(c, {}, bad_window)), Catch::Contains("window"));
  select::sentence_chunks bad_weight;
  bad_weight.boundaries = {{1, 1.5f}};
  CHECK_THROWS_WITH((cache<format::dense, select::sentence_chunks>(c, {}, bad_weight)), Catch::Contains("weight"));
  cache<format::dense, select::sentence_chunks> cc(c);
  const sequence_id seq = cc.add_sequence();
  std::vector<float> rows(static_cast<std::size_t>(3) * c.num_kv_heads * c.head_dim, 0.5f);
  std::vector<std::int32_t> ids(2, 1);
  const tensor_view<const float, 3> k(rows.data(), 3, c.num_kv_heads, c.head_dim);
  CHECK_THROWS_WITH(cc.prefill(seq, k, k, span<const std::int32_t>(ids.data(), 2)), Catch::Contains("token_ids.size()"));
  CHECK(cc.length(seq) == 0);
}

TEST_CASE("token budgets describe and resolve every value safely", "[selectors]") {
  const cache_config c = small_config();
  select::quest s;
  CHECK(selector_traits<select::quest>::describe(s) == "quest(1/16, block 16, max)");
  s.budget.ratio = 0.0;  // valid: reads only the tail (and sinks)
  CHECK(selector_traits<select::quest>::describe(s) == "quest(ratio 0, block 16, max)");
  CHECK_NOTHROW(cache<format::dense, select::quest>(c, {}, s));
  s.budget.ratio = 0.3;  // not 1/3
  CHECK(selector_traits<select::quest>::describe(s) == "quest(ratio 0.3, block 16, max)");
  s.budget.ratio = 1.0 / 3.0;
  CHECK(selector_traits<select::quest>::describe(s) == "quest(1/3, block 16, max)");
  s.budget.ratio = 1e-300;  // 1 / ratio beyond int
  CHECK(selector_traits<select::quest>::describe(s) == "quest(ratio 1e-300, block 16, max)");
  s.budget.ratio = 4.9406564584124654e-324;  // 1 / ratio overflows
  CHECK(selector_traits<select::quest>::describe(s) == "quest(ratio 4.94066e-324, block 16, max)");
  s.budget.tokens = 0;
  CHECK(selector_traits<select::quest>::describe(s) == "quest(0 tokens, block 16, max)");
  select::sentence_chunks chunks;
  chunks.budget.ratio = 0.0;
  CHECK(selector_traits<select::sentence_chunks>::describe(chunks) == "sentence_chunks(ratio 0, L 14, delta 8, max)");
  // resolve: floor(ratio x length) in [0, length], also where ratio x length rounds to 2^63.
  select::token_budget b;
  b.ratio = 1.0;
  CHECK(b.resolve(INT64_MAX) == INT64_MAX);
  b.ratio = 0.5;
  CHECK(b.resolve(INT64_MAX) == (std::int64_t{1} << 62));
  CHECK(b.resolve(7) == 3);
  b.ratio = 0.0;
  CHECK(b.resolve(INT64_MAX) == 0);
  b.ratio = NAN;
  CHECK(b.resolve(100) == 0);
  CHECK_THROWS_WITH((cache<format::dense, select::quest>(c, {}, select::quest{b})),
                    "kvmosaic: select::quest: budget.ratio = nan; allowed: 0 to 1");
}

TEST_CASE("sentence_chunks rejects chunk lengths beyond 4096, naming them", "[selectors][sentence_chunks]") {
  const cache_config c = small_config();
  const auto message = [&](int target_length, int window) {
    select::sentence_chunks s;
    s.target_length = target_length;
    s.window = window;
    try {
      cache<format::dense, select::sentence_chunks> cc(c, {}, s);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(message(INT_MAX, 8) ==
        "kvmosaic: select::sentence_chunks: target_length = 2147483647; allowed: 1 to 4096 (sentence_chunks::max_length)");
  CHECK(message(14, INT_MAX) ==
        "kvmosaic: select::sentence_chunks: window = 2147483647; allowed: 1 to 4096 (sentence_chunks::max_length)");
  CHECK(message(4097, 8) ==
        "kvmosaic: select::sentence_chunks: target_length = 4097; allowed: 1 to 4096 (sentence_chunks::max_length)");
  CHECK(message(0, 8) ==
        "kvmosaic: select::sentence_chunks: target_length = 0; allowed: 1 to 4096 (sentence_chunks::max_length)");
  CHECK(message(14, -1) == "kvmosaic: select::sentence_chunks: window = -1; allowed: 1 to 4096 (sentence_chunks::max_length)");
  CHECK(message(4096, 4096) == "accepted");
  // At the largest lengths the split still follows Algorithm 2: no boundary, chunks of L tokens.
  select::sentence_chunks s;
  s.target_length = 4096;
  s.window = 4096;
  const std::vector<std::int32_t> ids(10000, 1);
  const std::vector<select::chunk> got = select::sentence_split(ids.data(), 10000, s);
  REQUIRE(got.size() == 3);
  CHECK(got[0].end == 4096);
  CHECK(got[1].end == 8192);
  CHECK(got[2].end == 10000);
}
