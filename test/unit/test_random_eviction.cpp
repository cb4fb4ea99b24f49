// SPDX-License-Identifier: Apache-2.0
// Seeded random operation sequences with eviction and compaction: add_sequence, prefill and
// chunked prefill, batched append, evict (random subsets of the live sealed tokens, whole pages,
// single tokens, empty lists, and lists holding one token that cannot be evicted: in the open
// tail, out of range, evicted before, listed twice, a sink), compact (one sequence or all),
// attend, fork_sequence, remove_sequence and invalid calls, on host caches with compact::repack
// and compact::hole_fill over format::dense, format::quant2 (nearest rounding; with and without
// sink tokens) and format::bitmap_tiles, with small random configurations and pools small enough
// to run out. What is checked after every operation (the shadow model's block tables, reference
// counts, position maps and compaction passes; the pool against the live block tables; shared
// pages and untouched sequences bitwise; outputs against fp64 exact attention over the live
// tokens) is in fuzz/cache_ops_harness.hpp.
//
// quant2 pages a compaction writes are quantized again (docs/eviction.md: at most max_reencodes
// times per page, 0 to 255 here; the error this adds is measured, not bounded), so quant2 outputs are checked against exact attention over what each
// live slot decodes to, within the bound of the 8-bit q and p steps (support/quant_bound.hpp):
// that the right tokens are read, in the right pages, with the format's own error only. What a
// pass does to the values is checked on its own: after each pass every live token's decoded rows
// are within half a quantization step (of the rows the pass wrote to that page) of what they
// decoded to before it, and bitwise equal where no move wrote the page.
//
// Iterations scale with KVMOSAIC_RANDOM_OPS_SCALE (default 1), as test_random_ops.cpp. A failure
// prints the seed, the configuration and the operations that led to it.

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

/// Which format, and for quant2 whether it keeps sink tokens.
enum class variant { plain, sinks };

format::dense make_format(rng&, variant, format::dense*) { return {}; }
format::bitmap_tiles make_format(rng& r, variant, format::bitmap_tiles*) {
  format::bitmap_tiles f;
  f.s_k = pick_of(r, {0.0f, 0.5f, 0.7f});
  f.s_v = pick_of(r, {0.0f, 0.5f, 0.7f});
  f.k_layout = pick(r, 0, 1) ? format::bitmap_k_layout::along_channels : format::bitmap_k_layout::along_tokens;
  return f;
}
format::quant2 make_format(rng& r, variant v, format::quant2*) {
  format::quant2 f;
  f.partition = 32;
  f.mode = format::rounding::nearest;
  f.seed = static_cast<std::uint64_t>(pick(r, 0, 1000));
  f.k_axis = pick(r, 0, 1) ? format::key_axis::tokens : format::key_axis::head_dim;
  f.sink_tokens = v == variant::sinks ? 4 : 0;
  f.max_reencodes = pick_of(r, {0, 1, 1, 2, 255});  // 0: nothing re-encoded; 255: no limit in practice
  return f;
}
int page_size_for(rng& r, format::dense*) { return pick_of(r, {16, 32}); }
int page_size_for(rng&, format::bitmap_tiles*) { return 64; }
int page_size_for(rng& r, format::quant2*) { return pick_of(r, {32, 64}); }

/// n token rows: K around a per-call offset, V standard normal, ids (unused by select::all).
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
  for (std::int64_t t = 0; t < n; ++t) out.ids.push_back(pick(r, 4, 40));
  return out;
}

/// The positions an eviction of sequence `s` names: live sealed tokens past the sinks (a random
/// share of them, one whole page, a few, none), or such a list with one position that cannot be
/// evicted.
std::vector<std::int64_t> eviction_list(rng& r, const test::ops::shadow_model::sequence& s, int page_size, int sinks) {
  std::vector<std::int64_t> candidates;
  for (std::int64_t p = sinks; p < s.sealed; ++p)
    if (!s.evicted[static_cast<std::size_t>(p)]) candidates.push_back(p);
  std::shuffle(candidates.begin(), candidates.end(), r);
  std::vector<std::int64_t> out;
  const int mode = pick(r, 0, 9);
  if (mode <= 3) {  // a random share
    const double share = pick_of(r, {0.1, 0.25, 0.5, 0.75, 0.9});
    for (const std::int64_t p : candidates)
      if (std::bernoulli_distribution(share)(r)) out.push_back(p);
  } else if (mode <= 5) {  // every live token of one page (the page goes back to the pool)
    const std::size_t pages = s.slots.size() / static_cast<std::size_t>(page_size);
    if (pages > 0) {
      const std::size_t pg = static_cast<std::size_t>(pick(r, 0, static_cast<int>(pages) - 1));
      for (int t = 0; t < page_size; ++t) {
        const std::int64_t p = s.slots[pg * static_cast<std::size_t>(page_size) + static_cast<std::size_t>(t)];
        if (p >= sinks) out.push_back(p);
      }
    }
  } else if (mode == 6) {  // a few
    out.assign(candidates.begin(), candidates.begin() + std::min<std::ptrdiff_t>(pick(r, 1, 3), static_cast<std::ptrdiff_t>(candidates.size())));
  } else if (mode == 7) {
    // none: a valid call that changes nothing
  } else {  // one bad position among good ones: all or nothing
    out.assign(candidates.begin(), candidates.begin() + std::min<std::ptrdiff_t>(pick(r, 0, 4), static_cast<std::ptrdiff_t>(candidates.size())));
    std::vector<std::int64_t> bad = {s.length(), s.length() + 3, -1};
    if (s.sealed < s.length()) bad.push_back(pick(r, static_cast<int>(s.sealed), static_cast<int>(s.length()) - 1));  // open tail
    for (std::int64_t p = 0; p < s.length(); ++p)
      if (s.evicted[static_cast<std::size_t>(p)]) {
        bad.push_back(p);  // evicted before
        break;
      }
    if (!out.empty()) bad.push_back(out.front());  // listed twice
    if (sinks > 0 && s.sealed > 0) bad.push_back(pick(r, 0, sinks - 1));  // a sink
    out.push_back(bad[static_cast<std::size_t>(pick(r, 0, static_cast<int>(bad.size()) - 1))]);
  }
  std::shuffle(out.begin(), out.end(), r);
  return out;
}

template <class F, class C>
void run_episode(std::uint64_t seed, int operations, variant v) {
  using Cache = cache<F, select::all, C>;
  rng r(seed);
  cache_config c;
  c.num_kv_heads = pick(r, 1, 2);
  c.group_size = pick_of(r, {1, 2, 4});
  c.head_dim = 64;
  c.page_size = page_size_for(r, static_cast<F*>(nullptr));
  c.storage = pick(r, 0, 1) ? dtype::bf16 : dtype::f16;
  c.max_pages = pick(r, 4, 24);
  c.max_sequences = pick(r, 1, 5);
  const F f = make_format(r, v, static_cast<F*>(nullptr));
  test::ops::harness<Cache> h(c, f, select::all{});
  std::ostringstream desc;
  desc << "seed " << seed << ": " << h.cache().describe() << ", kv heads " << c.num_kv_heads << ", group " << c.group_size
       << ", page " << c.page_size << ", " << to_string(c.storage) << ", max_pages " << c.max_pages << ", max_sequences "
       << c.max_sequences;
  INFO(desc.str());
  const int P = c.page_size, sinks = sink_rows(f);
  const std::size_t row = h.row();
  const auto live = [&] { return h.model().live().size(); };
  const auto any = [&] { return static_cast<std::size_t>(pick(r, 0, static_cast<int>(live()) - 1)); };
  const auto some_live = [&] {
    std::vector<std::size_t> all(live());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), r);
    all.resize(static_cast<std::size_t>(pick(r, 1, static_cast<int>(all.size()))));
    return all;
  };
  const auto chunk = [&] { return pick_of<std::int64_t>(r, {1, P - 1, P, P + 1, 2 * P + 3, pick(r, 1, 3 * P)}); };
  try {
    for (int op = 0; op < operations; ++op) {
      const int kind = pick(r, 0, 99);
      if (live() == 0 || kind < 8) {
        h.add_sequence();
      } else if (kind < 26) {  // prefill, often chunked
        const std::size_t i = any();
        h.prefill(i, random_rows(r, chunk(), row));
        while (pick(r, 0, 2) == 0) h.prefill(i, random_rows(r, chunk(), row));
      } else if (kind < 40) {
        const auto which = some_live();
        h.append(which, random_rows(r, static_cast<std::int64_t>(which.size()), row));
      } else if (kind < 56) {
        const std::size_t i = any();
        h.evict(i, eviction_list(r, h.model().live()[i], P, sinks));
      } else if (kind < 66) {
        std::vector<std::size_t> holding_dead;  // mostly a sequence with dead slots: a pass with work
        for (std::size_t i = 0; i < live(); ++i) {
          const auto& slots = h.model().live()[i].slots;
          if (std::find(slots.begin(), slots.end(), std::int64_t{-1}) != slots.end()) holding_dead.push_back(i);
        }
        if (pick(r, 0, 3) == 0)
          h.compact_all();
        else if (!holding_dead.empty() && pick(r, 0, 3) != 0)
          h.compact(holding_dead[static_cast<std::size_t>(pick(r, 0, static_cast<int>(holding_dead.size()) - 1))]);
        else
          h.compact(any());
      } else if (kind < 78) {
        const auto which = some_live();
        std::vector<float> q(which.size() * static_cast<std::size_t>(c.num_q_heads()) * c.head_dim);
        std::normal_distribution<float> normal(0.0f, pick_of(r, {0.5f, 1.0f, 2.0f}));
        for (float& x : q) x = normal(r);
        h.attend(which, q);
      } else if (kind < 86) {
        h.fork(any());
      } else if (kind < 92) {
        h.remove(any());
      } else {
        const std::size_t i = any();
        switch (pick(r, 0, 3)) {
          case 0: h.append_duplicate(i, random_rows(r, 2, row)); break;
          case 1: h.prefill_empty(i); break;
          case 2:
            if (!h.model().removed().empty())
              h.use_stale_id(static_cast<std::size_t>(pick(r, 0, static_cast<int>(h.model().removed().size()) - 1)),
                             random_rows(r, pick(r, 1, P + 1), row));
            break;
          default:
            if (!h.model().removed().empty())
              h.evict_stale(static_cast<std::size_t>(pick(r, 0, static_cast<int>(h.model().removed().size()) - 1)));
        }
      }
    }
  } catch (const test::ops::failure& e) {
    FAIL(e.what());
  }
  SUCCEED();
}

template <class F, class C>
void run_all(std::uint64_t base_seed, int base_episodes, variant v = variant::plain) {
  const int episodes = std::max(1, static_cast<int>(base_episodes * iteration_scale() + 0.5));
  for (int e = 0; e < episodes; ++e) run_episode<F, C>(base_seed + static_cast<std::uint64_t>(e), 120, v);
}

}  // namespace

TEST_CASE("random eviction: dense / repack against the model and the fp64 oracle over the live tokens", "[random][eviction]") {
  run_all<format::dense, compact::repack>(0x6b76650100000000ull, 60);
}
TEST_CASE("random eviction: dense / hole_fill", "[random][eviction]") {
  run_all<format::dense, compact::hole_fill>(0x6b76650200000000ull, 60);
}
TEST_CASE("random eviction: quant2 (nearest) / repack", "[random][eviction]") {
  run_all<format::quant2, compact::repack>(0x6b76650300000000ull, 20);
}
TEST_CASE("random eviction: quant2 (nearest) / hole_fill", "[random][eviction]") {
  run_all<format::quant2, compact::hole_fill>(0x6b76650400000000ull, 20);
}
TEST_CASE("random eviction: quant2 (nearest) with 4 sinks / repack", "[random][eviction]") {
  run_all<format::quant2, compact::repack>(0x6b76650500000000ull, 20, variant::sinks);
}
TEST_CASE("random eviction: quant2 (nearest) with 4 sinks / hole_fill", "[random][eviction]") {
  run_all<format::quant2, compact::hole_fill>(0x6b76650600000000ull, 20, variant::sinks);
}
TEST_CASE("random eviction: bitmap_tiles / repack", "[random][eviction]") {
  run_all<format::bitmap_tiles, compact::repack>(0x6b76650700000000ull, 20);
}
TEST_CASE("random eviction: bitmap_tiles / hole_fill", "[random][eviction]") {
  run_all<format::bitmap_tiles, compact::hole_fill>(0x6b76650800000000ull, 20);
}
