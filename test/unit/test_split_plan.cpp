// SPDX-License-Identifier: Apache-2.0
// The split-KV plan: coverage (every page of every sequence exactly once, the tail once, in the
// last split), balance, and the wave choice.

#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "kvmosaic/core/split_plan.hpp"

using namespace kvmosaic;

namespace {
void check_covers(const split_plan& plan, const std::vector<std::int32_t>& pages, const std::vector<std::int32_t>& tails) {
  REQUIRE(plan.partial_offset.size() == pages.size() + 1);
  for (std::size_t b = 0; b < pages.size(); ++b) {
    std::int32_t next = 0;
    int tails_seen = 0;
    for (std::int32_t i = plan.partial_offset[b]; i < plan.partial_offset[b + 1]; ++i) {
      const split_work& w = plan.work[static_cast<std::size_t>(i)];
      REQUIRE(w.batch_index == static_cast<std::int32_t>(b));
      REQUIRE(w.page_begin == next);  // contiguous, in order, no gap or overlap
      REQUIRE(w.page_end >= w.page_begin);
      REQUIRE(w.page_end - w.page_begin <= plan.pages_per_split);
      next = w.page_end;
      tails_seen += w.with_tail;
      if (w.with_tail) REQUIRE(i + 1 == plan.partial_offset[b + 1]);  // the last split reads the tail
    }
    REQUIRE(next == pages[b]);
    REQUIRE(tails_seen == (tails[b] > 0 ? 1 : 0));
    REQUIRE(plan.partial_offset[b + 1] > plan.partial_offset[b]);
  }
}
}  // namespace

TEST_CASE("one long sequence is cut into one balanced wave of splits", "[split_plan]") {
  const std::vector<std::int32_t> pages{2048}, tails{5};
  const split_plan plan = make_split_plan(pages, tails, 49);
  check_covers(plan, pages, tails);
  CHECK(plan.num_splits() <= 49);
  CHECK(plan.num_splits() >= 45);
  CHECK(plan.pages_per_split == 42);  // ceil(2048 / 49)
}

TEST_CASE("ragged batches, empty page lists and tail-only sequences are covered exactly once", "[split_plan]") {
  const std::vector<std::int32_t> pages{0, 1, 7, 300, 0, 64}, tails{3, 0, 9, 0, 1, 63};
  for (std::int32_t target : {1, 2, 5, 49, 400}) {
    CAPTURE(target);
    check_covers(make_split_plan(pages, tails, target), pages, tails);
    check_covers(make_split_plan(pages, tails, target, 16), pages, tails);
  }
}

TEST_CASE("a batch near the slot count takes two waves of short splits over one of long ones", "[split_plan]") {
  const std::vector<std::int32_t> pages(32, 2048), tails(32, 0);
  const split_plan plan = make_split_plan(pages, tails, 49);
  check_covers(plan, pages, tails);
  // one wave: 32 splits of 2048 pages (cost 2048); two waves: 96 splits of 683 (cost 1366)
  CHECK(plan.num_splits() > 49);
  CHECK(plan.pages_per_split < 2048);
}

TEST_CASE("max_pages_per_split caps the split size even beyond one wave", "[split_plan]") {
  const std::vector<std::int32_t> pages{10000}, tails{0};
  const split_plan plan = make_split_plan(pages, tails, 2, 1000);
  check_covers(plan, pages, tails);
  CHECK(plan.pages_per_split <= 1000);
  CHECK(plan.num_splits() == 10);
}

TEST_CASE("max_pages_per_split and segments together: no split over the cap or across a segment",
          "[split_plan]") {
  // packed_bitmap's pages of 16 under select::all at batch 8, 128K: segments of 4096 pages, the
  // sm_90 kernel listing at most 512 pages a split, 66 slots per KV head and a split cost of 46.
  // Uncapped, one wave of 1024-page splits (64 of them); capped, two waves of 512-page splits
  // (2 x (512 + 46) against 4 x (256 + 46) for four).
  const std::vector<std::int32_t> pages(8, 8192), tails(8, 0);
  CHECK(make_split_plan(pages, tails, 66, 1 << 30, 1, 4096, 46).pages_per_split == 1024);
  const split_plan plan = make_split_plan(pages, tails, 66, 512, 1, 4096, 46);
  check_covers(plan, pages, tails);
  CHECK(plan.pages_per_split == 512);
  CHECK(plan.num_splits() == 8 * 16);
  for (const split_work& w : plan.work) {
    CHECK(w.page_end - w.page_begin <= 512);
    if (w.page_end > w.page_begin) CHECK(w.page_begin / 4096 == (w.page_end - 1) / 4096);
  }
}

TEST_CASE("a split's fixed cost keeps one wave of long splits where short ones win only by less", "[split_plan]") {
  // Batch 8 at 128K, 66 slots per KV head. Waves x (longest split + cost): without a cost, four
  // waves of 63 pages (252) beat one of 256; at 2 pages a split, one wave (258) beats two (2 x
  // 130 = 260), three (3 x 88 = 264) and four (4 x 65 = 260).
  const std::vector<std::int32_t> pages(8, 2048), tails(8, 0);
  CHECK(make_split_plan(pages, tails, 66, 1 << 30, 1, 0, 0).pages_per_split == 63);
  const split_plan plan = make_split_plan(pages, tails, 66, 1 << 30, 1, 0, 2);
  check_covers(plan, pages, tails);
  CHECK(plan.pages_per_split == 256);
  CHECK(plan.num_splits() == 64);
  // A cost that is small against the splits changes nothing: 2 sequences of 2048 pages fill one
  // wave of 66 with splits of 63 pages either way.
  const std::vector<std::int32_t> two(2, 2048), two_tails(2, 0);
  CHECK(make_split_plan(two, two_tails, 66, 1 << 30, 1, 0, 10).pages_per_split ==
        make_split_plan(two, two_tails, 66).pages_per_split);
}

TEST_CASE("bad plan arguments are rejected", "[split_plan]") {
  CHECK_THROWS_WITH(make_split_plan({1}, {0}, 4, 1 << 30, 1, 0, -1), Catch::Contains("split_cost_pages = -1"));
  CHECK_THROWS_WITH(make_split_plan({1}, {0, 1}, 4), Catch::Contains("tail_rows.size()"));
  CHECK_THROWS_WITH(make_split_plan({0}, {0}, 4), Catch::Contains("at least one token per sequence"));
  CHECK_THROWS_WITH(make_split_plan({1}, {0}, 0), Catch::Contains("target_splits = 0"));
}

TEST_CASE("page_multiple keeps split boundaries on multiples, so every worker of a split gets as many pages",
          "[split_plan]") {
  // Batch 8 at 128K with pages of 64 and 66 slots per KV head: without a multiple, 4 waves of
  // 60- and 61-page splits (15 or 16 pages for each of 4 warps); with 4, equal splits of a
  // multiple of 4 pages (here one wave of 256: a tie with four waves of 64).
  const std::vector<std::int32_t> pages(8, 2048), tails(8, 0);
  CHECK(make_split_plan(pages, tails, 66).pages_per_split == 63);
  const split_plan plan = make_split_plan(pages, tails, 66, 1 << 30, 4);
  check_covers(plan, pages, tails);
  CHECK(plan.pages_per_split % 4 == 0);
  for (const split_work& w : plan.work) CHECK(w.page_end - w.page_begin == plan.pages_per_split);
  // Ragged lengths: boundaries on multiples of the unit but at a sequence's end.
  const std::vector<std::int32_t> ragged{0, 1, 7, 300, 2001, 64}, ragged_tails{3, 0, 9, 0, 1, 63};
  for (std::int32_t target : {1, 5, 49, 400}) {
    for (std::int32_t multiple : {2, 4, 8}) {
      CAPTURE(target, multiple);
      const split_plan p = make_split_plan(ragged, ragged_tails, target, 1 << 30, multiple);
      check_covers(p, ragged, ragged_tails);
      CHECK(p.pages_per_split % multiple == 0);
      for (const split_work& w : p.work) CHECK((w.page_begin % multiple == 0));
    }
  }
  CHECK_THROWS_WITH(make_split_plan(pages, tails, 66, 16, 32), Catch::Contains("page_multiple = 32"));
}

TEST_CASE("segment_pages: no split crosses a segment boundary and the tail is a split of its own", "[split_plan]") {
  // Formats with segments (format::packed_bitmap): a split works in one segment's basis.
  const std::vector<std::int32_t> pages{2048, 1000, 0, 64, 7}, tails{5, 0, 3, 1, 0};
  for (const std::int32_t per : {1, 64, 100, 1024, 4096})
    for (const std::int32_t target : {1, 49, 132}) {
      CAPTURE(per, target);
      const split_plan plan = make_split_plan(pages, tails, target, 1 << 30, 1, per);
      check_covers(plan, pages, tails);
      for (std::size_t b = 0; b < pages.size(); ++b)
        for (std::int32_t i = plan.partial_offset[b]; i < plan.partial_offset[b + 1]; ++i) {
          const split_work& w = plan.work[static_cast<std::size_t>(i)];
          if (w.page_end > w.page_begin) REQUIRE(w.page_begin / per == (w.page_end - 1) / per);  // one segment
          if (w.with_tail && pages[b] > 0) REQUIRE(w.page_begin == w.page_end);                // the tail alone
        }
      // Without segments the tail rides in the last split of pages: one split fewer per such sequence.
      const split_plan plain = make_split_plan(pages, tails, target);
      check_covers(plain, pages, tails);
    }
  // A segment boundary cuts a split the plan would otherwise make whole.
  const split_plan one = make_split_plan({8}, {0}, 1, 1 << 30, 1, 4);
  REQUIRE(one.num_splits() == 2);
  CHECK(one.work[0].page_end == 4);
  CHECK(one.work[1].page_begin == 4);
  REQUIRE_THROWS_WITH(make_split_plan({8}, {0}, 1, 1 << 30, 1, -1), Catch::Contains("segment_pages"));
}
