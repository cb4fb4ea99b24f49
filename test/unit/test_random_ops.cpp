// SPDX-License-Identifier: Apache-2.0
// Seeded random differential test: random operation sequences (add_sequence, prefill and chunked
// prefill of sizes 1, P-1, P, P+1, 2P+3 and random ones, batched append, attend, fork_sequence,
// remove_sequence, set_budget, and invalid calls) on host caches of every format and selector,
// with small random configurations and pools small enough to run out. What is checked after every
// operation, and against which references, is in fuzz/cache_ops_harness.hpp.
//
// Iterations scale with the environment variable KVMOSAIC_RANDOM_OPS_SCALE (default 1; the
// sanitizer build in CI runs 0.1). A failure prints the seed, the configuration and the
// operations that led to it.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz/cache_ops_harness.hpp"
#include "kvmosaic/kvmosaic.hpp"

using namespace kvmosaic;

namespace {

template <class F, class S>
struct combo {
  using format_type = F;
  using selector_type = S;
};

double iteration_scale() {
  const char* s = std::getenv("KVMOSAIC_RANDOM_OPS_SCALE");
  if (s == nullptr || *s == '\0') return 1.0;
  const double x = std::strtod(s, nullptr);
  return x > 0 ? x : 1.0;
}

using rng = std::mt19937_64;

int pick(rng& r, int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(r); }
template <class T>
T pick_of(rng& r, std::initializer_list<T> values) {
  return *(values.begin() + pick(r, 0, static_cast<int>(values.size()) - 1));
}

format::dense make_format(rng&, format::dense*) { return {}; }
format::bitmap_tiles make_format(rng& r, format::bitmap_tiles*) {
  format::bitmap_tiles f;
  f.s_k = pick_of(r, {0.0f, 0.5f, 0.7f});
  f.s_v = pick_of(r, {0.0f, 0.5f, 0.7f});
  f.k_layout = pick(r, 0, 1) ? format::bitmap_k_layout::along_channels : format::bitmap_k_layout::along_tokens;
  return f;
}
template <int Bits, format::value_axis V>
format::quant<Bits, V> make_format(rng& r, format::quant<Bits, V>*) {
  format::quant<Bits, V> f;
  f.partition = 32;
  f.mode = pick(r, 0, 1) ? format::rounding::stochastic : format::rounding::nearest;
  f.seed = static_cast<std::uint64_t>(pick(r, 0, 1000));
  f.k_axis = pick(r, 0, 1) ? format::key_axis::tokens : format::key_axis::head_dim;
  f.sink_tokens = pick_of(r, {0, 0, 4});
  return f;
}
int page_size_for(rng& r, format::dense*) { return pick_of(r, {16, 32}); }
int page_size_for(rng&, format::bitmap_tiles*) { return 64; }  // a multiple of the 64-element tile
template <int Bits, format::value_axis V>
int page_size_for(rng& r, format::quant<Bits, V>*) { return pick_of(r, {32, 64}); }  // a multiple of the partition

select::token_budget random_budget(rng& r) {
  select::token_budget b;
  if (pick(r, 0, 2) == 0)
    b.tokens = pick_of<std::int64_t>(r, {0, 8, 16, 40, 100000});
  else
    b.ratio = pick_of(r, {0.0, 1.0 / 16, 1.0 / 4, 0.5, 1.0});
  return b;
}
select::all make_selector(rng&, int, select::all*) { return {}; }
select::quest make_selector(rng& r, int page, select::quest*) {
  select::quest s;
  s.budget = random_budget(r);
  s.block_tokens = pick_of(r, {0, 8, 16});
  if (s.block_tokens > page) s.block_tokens = 0;
  s.combine = pick(r, 0, 1) ? group_combine::max : group_combine::sum;
  return s;
}
select::sentence_chunks make_selector(rng& r, int, select::sentence_chunks*) {
  select::sentence_chunks s;
  s.budget = random_budget(r);
  s.target_length = pick(r, 2, 12);
  s.window = pick(r, 1, 5);
  s.combine = pick(r, 0, 1) ? group_combine::max : group_combine::sum;
  s.boundaries = {{1, 1.0f}, {2, 0.5f}, {3, 0.25f}};
  return s;
}

/// n token rows of one sequence's style: K and V around a per-call offset, ids from a small
/// vocabulary where 1-3 are boundaries.
test::ops::rows random_rows(rng& r, std::int64_t n, std::size_t row) {
  test::ops::rows out;
  out.n = n;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float k_scale = pick_of(r, {0.25f, 1.0f, 3.0f}), offset = normal(r);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::size_t x = 0; x < row; ++x) {
      out.k.push_back(offset + k_scale * normal(r));
      out.v.push_back(normal(r));
    }
  for (std::int64_t t = 0; t < n; ++t) out.ids.push_back(pick(r, 0, 3) == 0 ? pick(r, 1, 3) : pick(r, 4, 40));
  return out;
}

template <class Combo>
void run_episode(std::uint64_t seed, int operations) {
  using F = typename Combo::format_type;
  using S = typename Combo::selector_type;
  using Cache = cache<F, S>;
  rng r(seed);
  cache_config c;
  c.num_kv_heads = pick(r, 1, 2);
  c.group_size = pick_of(r, {1, 2, 4});
  c.head_dim = 64;
  c.page_size = page_size_for(r, static_cast<F*>(nullptr));
  c.storage = pick(r, 0, 1) ? dtype::bf16 : dtype::f16;
  c.max_pages = pick(r, 2, 24);
  c.max_sequences = pick(r, 1, 5);
  const F f = make_format(r, static_cast<F*>(nullptr));
  const S s = make_selector(r, c.page_size, static_cast<S*>(nullptr));
  test::ops::harness<Cache> h(c, f, s);
  std::ostringstream desc;
  desc << "seed " << seed << ": " << h.cache().describe() << ", kv heads " << c.num_kv_heads << ", group " << c.group_size
       << ", page " << c.page_size << ", " << to_string(c.storage) << ", max_pages " << c.max_pages << ", max_sequences "
       << c.max_sequences;
  INFO(desc.str());
  const int P = c.page_size;
  const std::size_t row = h.row();
  const auto live = [&] { return h.model().live().size(); };
  const auto some_live = [&](std::size_t at_most) {
    std::vector<std::size_t> all(live());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), r);
    all.resize(std::min(all.size(), std::max<std::size_t>(1, static_cast<std::size_t>(pick(r, 1, static_cast<int>(at_most))))));
    return all;
  };
  try {
    for (int op = 0; op < operations; ++op) {
      const int kind = pick(r, 0, 99);
      if (live() == 0 || kind < 10) {
        h.add_sequence();
      } else if (kind < 34) {  // prefill: a chunk of a chunked prefill when the sequence is not empty
        const std::size_t i = static_cast<std::size_t>(pick(r, 0, static_cast<int>(live()) - 1));
        const std::int64_t n = pick_of<std::int64_t>(r, {1, P - 1, P, P + 1, 2 * P + 3, pick(r, 1, 3 * P)});
        h.prefill(i, random_rows(r, n, row));
        // Often the next chunk of the same sequence right away.
        while (pick(r, 0, 2) == 0 && i < live())
          h.prefill(i, random_rows(r, pick_of<std::int64_t>(r, {1, P - 1, P, P + 1, 2 * P + 3, pick(r, 1, 3 * P)}), row));
      } else if (kind < 56) {
        const auto which = some_live(live());
        h.append(which, random_rows(r, static_cast<std::int64_t>(which.size()), row));
      } else if (kind < 76) {
        std::vector<std::size_t> which;
        for (const std::size_t i : some_live(live()))
          if (h.model().live()[i].length() > 0 || pick(r, 0, 9) == 0) which.push_back(i);  // sometimes an empty one
        if (which.empty()) continue;
        std::vector<float> q(which.size() * static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
        std::normal_distribution<float> normal(0.0f, pick_of(r, {0.5f, 1.0f, 2.0f}));
        for (float& x : q) x = normal(r);
        h.attend(which, q);
      } else if (kind < 84) {
        h.fork(static_cast<std::size_t>(pick(r, 0, static_cast<int>(live()) - 1)));
      } else if (kind < 91) {
        h.remove(static_cast<std::size_t>(pick(r, 0, static_cast<int>(live()) - 1)));
      } else if (kind < 94) {
        select::token_budget b = random_budget(r);
        if (pick(r, 0, 5) == 0) b.ratio = pick_of(r, {-0.5, 1.5});  // invalid
        h.set_budget(b);
      } else {
        const std::size_t i = static_cast<std::size_t>(pick(r, 0, static_cast<int>(live()) - 1));
        switch (pick(r, 0, 2)) {
          case 0: h.append_duplicate(i, random_rows(r, 2, row)); break;
          case 1: h.prefill_empty(i); break;
          default:
            if (!h.model().removed().empty())
              h.use_stale_id(static_cast<std::size_t>(pick(r, 0, static_cast<int>(h.model().removed().size()) - 1)),
                             random_rows(r, pick(r, 1, P + 1), row));
        }
      }
    }
  } catch (const test::ops::failure& e) {
    FAIL(e.what());
  }
  SUCCEED();
}

template <class Combo>
void run_all(std::uint64_t base_seed, int base_episodes) {
  const int episodes = std::max(1, static_cast<int>(base_episodes * iteration_scale() + 0.5));
  for (int e = 0; e < episodes; ++e) run_episode<Combo>(base_seed + static_cast<std::uint64_t>(e), 80);
}

}  // namespace

TEST_CASE("random operations: dense / all against the fp64 oracle and one-shot prefill", "[random]") {
  run_all<combo<format::dense, select::all>>(0x6b766d0100000000ull, 120);
}
TEST_CASE("random operations: dense / quest", "[random]") {
  run_all<combo<format::dense, select::quest>>(0x6b766d0200000000ull, 120);
}
TEST_CASE("random operations: dense / sentence_chunks", "[random]") {
  run_all<combo<format::dense, select::sentence_chunks>>(0x6b766d0300000000ull, 120);
}
TEST_CASE("random operations: bitmap_tiles / all", "[random]") {
  run_all<combo<format::bitmap_tiles, select::all>>(0x6b766d0400000000ull, 80);
}
TEST_CASE("random operations: bitmap_tiles / quest", "[random]") {
  run_all<combo<format::bitmap_tiles, select::quest>>(0x6b766d0500000000ull, 80);
}
TEST_CASE("random operations: bitmap_tiles / sentence_chunks", "[random]") {
  run_all<combo<format::bitmap_tiles, select::sentence_chunks>>(0x6b766d0600000000ull, 80);
}
TEST_CASE("random operations: quant2 / all", "[random]") {
  run_all<combo<format::quant2, select::all>>(0x6b766d0700000000ull, 80);
}
TEST_CASE("random operations: quant2 / quest", "[random]") {
  run_all<combo<format::quant2, select::quest>>(0x6b766d0800000000ull, 80);
}
TEST_CASE("random operations: quant2 / sentence_chunks", "[random]") {
  run_all<combo<format::quant2, select::sentence_chunks>>(0x6b766d0900000000ull, 80);
}
TEST_CASE("random operations: quant4 / all", "[random]") {
  run_all<combo<format::quant4, select::all>>(0x6b766d0a00000000ull, 40);
}
TEST_CASE("random operations: quant4 with V per token / all", "[random]") {
  run_all<combo<format::quant<4, format::value_axis::head_dim>, select::all>>(0x6b766d0b00000000ull, 40);
}
