// SPDX-License-Identifier: Apache-2.0
// Compaction plans (memory/compaction_plan.hpp) against the numpy oracle of the eviction and
// compaction notes (its six checks, with its numbers), hand-worked cases with shared pages, and
// seeded random eviction masks checked against a brute-force replay of each plan.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kvmosaic/core/error.hpp"
#include "kvmosaic/memory/compaction_plan.hpp"

using namespace kvmosaic;
using detail::compaction_plan;

namespace {

/// Slots 0 .. n holding positions 0 .. n, with the listed slots dead.
std::vector<std::int64_t> slots_with_dead(std::int64_t n, const std::vector<std::int64_t>& dead) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = i;
  for (const std::int64_t d : dead) p[static_cast<std::size_t>(d)] = -1;
  return p;
}

/// Positions of the survivors, in slot order.
std::vector<std::int64_t> survivors(const std::vector<std::int64_t>& positions) {
  std::vector<std::int64_t> s;
  for (const std::int64_t p : positions)
    if (p >= 0) s.push_back(p);
  return s;
}

/// Executes a plan on the slots as a device would: every source read, then every destination
/// written; then the pages the plan frees dropped. Returns the slots kept.
std::vector<std::int64_t> replay(const std::vector<std::int64_t>& positions, const compaction_plan& plan, int page) {
  std::vector<std::int64_t> read;
  for (const auto& m : plan.moves) read.push_back(positions[static_cast<std::size_t>(m.from)]);
  std::vector<std::int64_t> out = positions;
  for (const auto& m : plan.moves) out[static_cast<std::size_t>(m.from)] = -1;  // a moved token leaves its slot
  for (std::size_t i = 0; i < plan.moves.size(); ++i) out[static_cast<std::size_t>(plan.moves[i].to)] = read[i];
  out.resize(static_cast<std::size_t>(plan.pages_kept) * static_cast<std::size_t>(page));
  return out;
}

}  // namespace

TEST_CASE("compaction oracle 1-3: scattered 90% eviction frees nothing until a repack frees 900 of 1,000 pages",
          "[compaction]") {
  std::vector<std::int64_t> positions(16000, -1);
  for (std::int64_t t = 0; t < 16000; t += 10) positions[static_cast<std::size_t>(t)] = t;
  REQUIRE(survivors(positions).size() == 1600);
  CHECK(detail::empty_pages(positions, 16).empty());  // 1. every page keeps a survivor

  const compaction_plan plan = detail::plan_repack(positions, 16);
  CHECK(plan.pages_freed == 900);  // 2. ceil(1600 / 16) = 100 pages kept
  CHECK(plan.pages_kept == 100);
  CHECK(plan.tokens_evicted == 14400);
  // 3. Logical order is kept exactly: the kept slots list the survivors in their original order.
  CHECK(plan.positions == survivors(positions));
  CHECK(replay(positions, plan, 16) == plan.positions);
}

TEST_CASE("compaction oracle 4-5: eviction alone frees exactly an aligned dead page, and nothing when one token per "
          "page survives",
          "[compaction]") {
  std::vector<std::int64_t> aligned = slots_with_dead(16000, {});
  for (std::int64_t t = 32; t < 48; ++t) aligned[static_cast<std::size_t>(t)] = -1;  // page 2 exactly
  CHECK(detail::empty_pages(aligned, 16) == std::vector<std::int32_t>{2});

  std::vector<std::int64_t> worst(16000, -1);
  for (std::int64_t t = 0; t < 16000; t += 16) worst[static_cast<std::size_t>(t)] = t;  // one survivor per page
  REQUIRE(survivors(worst).size() == 1000);                                             // 93.75% evicted
  CHECK(detail::empty_pages(worst, 16).empty());
  CHECK(detail::plan_repack(worst, 16).pages_freed == 1000 - 63);  // 1000 survivors fit 63 pages
}

TEST_CASE("compaction oracle 6: the 6 x 4 toy, repack 18 copies and hole filling 3, one page freed by each",
          "[compaction]") {
  // History T0-T19, new round T20-T23; T2, T9, T13, T21 evicted.
  const std::vector<std::int64_t> toy = slots_with_dead(24, {2, 9, 13, 21});

  const compaction_plan repack = detail::plan_repack(toy, 4);
  CHECK(repack.pages_freed == 1);
  CHECK(repack.moves.size() == 18);
  CHECK(repack.report(false).slot_copies == 18);
  CHECK(repack.positions == survivors(toy));

  const compaction_plan fill = detail::plan_hole_fill(toy, 4, 20);
  CHECK(fill.pages_freed == 1);
  CHECK(fill.moves.size() == 3);
  CHECK(fill.positions[2] == 20);  // T20 lands in T2's slot
  CHECK(fill.positions[9] == 22);
  CHECK(fill.positions[13] == 23);
  CHECK_FALSE(std::is_sorted(fill.positions.begin(), fill.positions.end()));  // physical order scrambled
  std::vector<std::int64_t> sorted = fill.positions;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == survivors(toy));  // the same survivor set
  CHECK(replay(toy, fill, 4) == fill.positions);
  // Pages written: the three holes' pages (0, 2, 3); quant2 re-encodes exactly those.
  CHECK(fill.pages_written == std::vector<std::int32_t>{0, 2, 3});
  CHECK(fill.report(true).pages_reencoded == 3);
  CHECK(fill.report(false).pages_reencoded == 0);
}

TEST_CASE("compaction with shared pages: nothing moves into or out of them, their holes stay", "[compaction]") {
  const std::vector<std::int64_t> toy = slots_with_dead(24, {2, 9, 13, 21});
  // Pages 0 and 1 are shared with a fork: survivors from slot 8 on close up behind them (10, 11
  // and 12 move by one, 14 to 20 by two, 22 and 23 by three).
  const compaction_plan repack = detail::plan_repack(toy, 4, 2);
  CHECK(repack.moves.size() == 12);
  for (const auto& m : repack.moves) {
    CHECK(m.from >= 8);
    CHECK(m.to >= 8);
  }
  CHECK(repack.positions[2] == -1);  // the shared page keeps its hole
  CHECK(repack.pages_kept == 6);     // 8 + 13 slots: no page empties
  CHECK(repack.pages_freed == 0);
  CHECK(replay(toy, repack, 4) == repack.positions);

  // Hole filling skips the shared page's hole: T20, T22, T23 go to the holes of 9 and 13, then behind.
  const compaction_plan fill = detail::plan_hole_fill(toy, 4, 20, 1);
  CHECK(fill.positions[2] == -1);
  CHECK(fill.positions[9] == 20);
  CHECK(fill.positions[13] == 22);
  CHECK(fill.positions[20] == 23);
  CHECK(fill.pages_freed == 0);  // 21 slots still need 6 pages
  CHECK(replay(toy, fill, 4) == fill.positions);
  CHECK(detail::empty_pages(slots_with_dead(8, {0, 1, 2, 3}), 4, 1).empty());  // a frozen page is never freed here
}

TEST_CASE("hole filling: a round with more survivors than holes slides the rest behind the history", "[compaction]") {
  const std::vector<std::int64_t> toy = slots_with_dead(24, {2, 9, 13, 21});
  const compaction_plan fill = detail::plan_hole_fill(toy, 4, 16);
  // Survivors 16-20, 22, 23: three fill the holes, four close up at slots 16-19.
  CHECK(fill.moves.size() == 7);
  CHECK(fill.positions[2] == 16);
  CHECK(fill.positions[9] == 17);
  CHECK(fill.positions[13] == 18);
  CHECK(std::vector<std::int64_t>(fill.positions.begin() + 16, fill.positions.begin() + 20) ==
        std::vector<std::int64_t>{19, 20, 22, 23});
  CHECK(fill.pages_freed == 1);
  CHECK(replay(toy, fill, 4) == fill.positions);
}

TEST_CASE("compaction plans reject what is not a sequence's slots", "[compaction]") {
  const std::vector<std::int64_t> toy = slots_with_dead(24, {2});
  CHECK_THROWS_AS(detail::plan_repack(toy, 0), invalid_argument);
  CHECK_THROWS_WITH(detail::plan_repack(slots_with_dead(10, {}), 4), Catch::Contains("positions.size()"));
  CHECK_THROWS_WITH(detail::plan_repack(toy, 4, 7), Catch::Contains("frozen_pages"));
  CHECK_THROWS_WITH(detail::plan_hole_fill(toy, 4, 25), Catch::Contains("round_start"));
  CHECK_THROWS_WITH(detail::plan_hole_fill(toy, 4, 3, 1), Catch::Contains("round_start"));
}

TEST_CASE("compaction plans on seeded random evictions: a replay of each plan keeps exactly the survivors",
          "[compaction]") {
  std::mt19937_64 rng(20261125);
  for (int trial = 0; trial < 400; ++trial) {
    const int page = 1 << std::uniform_int_distribution<int>(0, 5)(rng);
    const int pages = std::uniform_int_distribution<int>(1, 12)(rng);
    const double dead_fraction = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    std::vector<std::int64_t> positions(static_cast<std::size_t>(page) * pages);
    for (std::size_t s = 0; s < positions.size(); ++s)
      positions[s] = std::bernoulli_distribution(dead_fraction)(rng) ? -1 : static_cast<std::int64_t>(s) * 3 + 7;
    const auto frozen = std::uniform_int_distribution<std::int32_t>(0, pages)(rng);
    const std::int64_t first = static_cast<std::int64_t>(frozen) * page;
    const std::int64_t round_start =
        std::uniform_int_distribution<std::int64_t>(first, static_cast<std::int64_t>(positions.size()))(rng);
    CAPTURE(trial, page, pages, frozen, round_start);
    std::vector<std::int64_t> expected = survivors(positions);
    std::sort(expected.begin(), expected.end());
    const auto dead = static_cast<std::int64_t>(positions.size() - survivors(positions).size());
    for (const bool fill : {false, true}) {
      CAPTURE(fill);
      const compaction_plan plan =
          fill ? detail::plan_hole_fill(positions, page, round_start, frozen) : detail::plan_repack(positions, page, frozen);
      const std::vector<std::int64_t> kept = replay(positions, plan, page);
      REQUIRE(kept == plan.positions);
      std::vector<std::int64_t> got = survivors(kept);
      std::sort(got.begin(), got.end());
      REQUIRE(got == expected);  // nothing lost, nothing duplicated
      REQUIRE(plan.tokens_evicted == dead);
      REQUIRE(plan.pages_kept + plan.pages_freed == pages);
      REQUIRE(plan.pages_kept >= frozen);
      // The last kept page holds a survivor (or is frozen): every page that could go went.
      if (plan.pages_kept > frozen) {
        const auto last = plan.positions.begin() + static_cast<std::ptrdiff_t>(plan.pages_kept - 1) * page;
        REQUIRE(std::any_of(last, last + page, [](std::int64_t p) { return p >= 0; }));
      }
      for (const auto& m : plan.moves) {
        REQUIRE(m.from >= first);  // shared pages neither give nor take
        REQUIRE(m.to >= first);
        REQUIRE(positions[static_cast<std::size_t>(m.from)] >= 0);
      }
      // Frozen slots are exactly as before.
      REQUIRE(std::equal(positions.begin(), positions.begin() + std::min<std::int64_t>(first, static_cast<std::int64_t>(plan.positions.size())),
                         plan.positions.begin()));
      if (!fill) {  // repack: the slots after the shared pages hold the survivors in logical order, no holes
        const std::vector<std::int64_t> tail(plan.positions.begin() + std::min<std::int64_t>(first, static_cast<std::int64_t>(plan.positions.size())),
                                             plan.positions.end());
        std::vector<std::int64_t> live = survivors(tail);
        REQUIRE(std::is_sorted(live.begin(), live.end()));
        const auto used = static_cast<std::int64_t>(live.size());
        REQUIRE(std::all_of(tail.begin(), tail.begin() + used, [](std::int64_t p) { return p >= 0; }));
      }
    }
  }
}
