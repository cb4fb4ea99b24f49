// SPDX-License-Identifier: Apache-2.0
// memory: page pool (free list, reference counts, gauge, exhaustion) and block tables.

#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "kvmosaic/kvmosaic.hpp"

using namespace kvmosaic;

TEST_CASE("page pool hands out distinct pages and the gauge counts them", "[memory]") {
  page_pool pool(8);
  CHECK(pool.capacity() == 8);
  CHECK(pool.free_pages() == 8);
  auto a = pool.allocate(3);
  auto b = pool.allocate(5);
  CHECK(pool.free_pages() == 0);
  std::vector<page_id> all(a);
  all.insert(all.end(), b.begin(), b.end());
  std::sort(all.begin(), all.end());
  CHECK(all == std::vector<page_id>{0, 1, 2, 3, 4, 5, 6, 7});
  for (page_id p : all) CHECK(pool.ref_count(p) == 1);
  pool.release(a[1]);
  CHECK(pool.free_pages() == 1);
  CHECK(pool.allocate(1).front() == a[1]);  // the freed slot is reused
}

TEST_CASE("page pool exhaustion throws a capacity_error and changes nothing", "[memory]") {
  page_pool pool(4);
  auto a = pool.allocate(3);
  try {
    pool.allocate(2);
    FAIL("no throw");
  } catch (const capacity_error& e) {
    CHECK(e.parameter() == "page_pool");
    CHECK_THAT(e.what(), Catch::Contains("2 page(s) needed, 1 free of 4"));
  }
  CHECK(pool.free_pages() == 1);
  for (page_id p : a) CHECK(pool.ref_count(p) == 1);
  CHECK(pool.allocate(0).empty());
}

TEST_CASE("reference counts keep a shared page until its last holder releases it", "[memory]") {
  page_pool pool(2);
  const page_id p = pool.allocate(1).front();
  pool.retain(p);
  CHECK(pool.ref_count(p) == 2);
  pool.release(p);
  CHECK(pool.free_pages() == 1);
  pool.release(p);
  CHECK(pool.free_pages() == 2);
  CHECK(pool.ref_count(p) == 0);
  CHECK_THROWS_AS(pool.release(p), invalid_argument);  // double free is an error, not corruption
  CHECK_THROWS_AS(pool.retain(5), invalid_argument);
  CHECK_THROWS_AS(page_pool(0), invalid_argument);
}

TEST_CASE("block tables pack into a padded int32 matrix", "[memory]") {
  block_table a{4, 7}, b{}, c{1, 2, 3};
  std::vector<std::int32_t> packed;
  const auto stride = pack_block_tables({&a, &b, &c}, packed);
  CHECK(stride == 3);
  CHECK(packed == std::vector<std::int32_t>{4, 7, -1, -1, -1, -1, 1, 2, 3});
}
