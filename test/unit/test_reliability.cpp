// SPDX-License-Identifier: Apache-2.0
// The cache's contracts under valid but awkward use and under failure, on the host backend:
// chunked prefills equal one-shot prefills (bytes and outputs), every public call is all or
// nothing when an allocation fails anywhere inside it (operator new is replaced below with a
// countdown that makes the n-th allocation throw), stale handles are rejected, per-sequence state
// does not outlive its sequence, heads of a GQA group are independent, and bad pointers are
// rejected with the parameter named.

#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

// --- Allocation fault injection ---------------------------------------------------------------------
// Every operator new of this program goes through here. Disarmed (-1) it is malloc; armed with n,
// the (n+1)-th allocation from then on throws std::bad_alloc, once.

namespace {
std::atomic<long> allocation_countdown{-1};
std::atomic<long> allocations_seen{0};

void* checked_allocate(std::size_t bytes, std::size_t alignment) {
  if (allocation_countdown.load(std::memory_order_relaxed) >= 0) {
    allocations_seen.fetch_add(1, std::memory_order_relaxed);
    if (allocation_countdown.fetch_sub(1, std::memory_order_relaxed) == 0) throw std::bad_alloc();
  }
  if (bytes == 0) bytes = 1;
  void* p = alignment <= alignof(std::max_align_t)
                ? std::malloc(bytes)
                : std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t bytes) { return checked_allocate(bytes, alignof(std::max_align_t)); }
void* operator new[](std::size_t bytes) { return checked_allocate(bytes, alignof(std::max_align_t)); }
void* operator new(std::size_t bytes, std::align_val_t a) { return checked_allocate(bytes, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t bytes, std::align_val_t a) { return checked_allocate(bytes, static_cast<std::size_t>(a)); }
// The nothrow forms too (std::stable_sort's buffer uses them): every form must pair with free().
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return checked_allocate(bytes, alignof(std::max_align_t));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept { return operator new(bytes, tag); }
void* operator new(std::size_t bytes, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return checked_allocate(bytes, static_cast<std::size_t>(a));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, std::align_val_t a, const std::nothrow_t& tag) noexcept {
  return operator new(bytes, a, tag);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

using namespace kvmosaic;

namespace {

/// Arms the allocation countdown for the scope (and disarms it on exit, also by exception).
struct fail_allocation {
  explicit fail_allocation(long n) {
    allocations_seen.store(0);
    allocation_countdown.store(n);
  }
  ~fail_allocation() { allocation_countdown.store(-1); }
};

cache_config small_config(int page = 16) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = page;
  c.max_pages = 48;
  c.max_sequences = 6;
  return c;
}

/// Tokens [first, first + n) of synthetic stream `stream`, with ids cycling through sentence
/// boundaries (for select::sentence_chunks): `Rows` of test/support/feed.hpp.
struct rows {
  synthetic::kv_data kv;
  std::vector<std::int32_t> ids;
  tensor_view<const float, 3> k() const { return {kv.k.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim}; }
  tensor_view<const float, 3> v() const { return {kv.v.data(), kv.num_tokens, kv.num_kv_heads, kv.head_dim}; }
  span<const std::int32_t> id_span() const { return {ids.data(), static_cast<std::int64_t>(ids.size())}; }
};
rows make_rows(const cache_config& c, std::uint64_t stream, int first, int n) {
  return rows{synthetic::generate_kv(test::generator_for(c, 7), stream, first, n), test::stream_ids(first, n)};
}
using test::append;
using test::prefill;

/// Everything a caller can observe of a set of sequences: gauge, lengths, block tables, chunk
/// cuts, and the attention outputs of fixed queries (bitwise).
template <class Cache>
struct observation {
  memory_stats memory;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<page_id>> pages;
  std::vector<std::vector<select::chunk>> chunks;
  std::vector<float> out;

  static observation of(Cache& cache, const std::vector<sequence_id>& seqs) {
    observation o;
    o.memory = cache.memory();
    const cache_config& c = cache.config();
    std::vector<sequence_id> attended;
    for (const sequence_id s : seqs) {
      o.lengths.push_back(cache.length(s));
      o.pages.emplace_back(cache.pages(s).begin(), cache.pages(s).end());
      if constexpr (selector_traits<typename Cache::selector_type>::needs_token_ids) o.chunks.push_back(cache.chunks(s));
      if (cache.length(s) > 0) attended.push_back(s);
    }
    if (attended.empty()) return o;
    const auto batch = static_cast<std::int64_t>(attended.size());
    std::vector<float> q(static_cast<std::size_t>(batch * c.num_q_heads() * c.head_dim));
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i)) * 2.0f;
    o.out.resize(q.size());
    cache.attend(span<const sequence_id>(attended.data(), batch),
                 tensor_view<const float, 3>(q.data(), batch, c.num_q_heads(), c.head_dim),
                 tensor_view<float, 3>(o.out.data(), batch, c.num_q_heads(), c.head_dim));
    return o;
  }
};

template <class Cache>
void require_same(const observation<Cache>& a, const observation<Cache>& b) {
  REQUIRE(a.memory.tokens == b.memory.tokens);
  REQUIRE(a.memory.stored_bytes == b.memory.stored_bytes);
  REQUIRE(a.memory.pages_used == b.memory.pages_used);
  REQUIRE(a.memory.pages_free == b.memory.pages_free);
  REQUIRE(a.lengths == b.lengths);
  REQUIRE(a.pages == b.pages);
  REQUIRE(a.chunks.size() == b.chunks.size());
  for (std::size_t i = 0; i < a.chunks.size(); ++i) {
    REQUIRE(a.chunks[i].size() == b.chunks[i].size());
    for (std::size_t j = 0; j < a.chunks[i].size(); ++j) {
      REQUIRE(a.chunks[i][j].begin == b.chunks[i][j].begin);
      REQUIRE(a.chunks[i][j].end == b.chunks[i][j].end);
    }
  }
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    INFO("output element " << i);
    REQUIRE(std::memcmp(&a.out[i], &b.out[i], sizeof(float)) == 0);
  }
}

/// Sequence slots still free (added, then removed again).
template <class Cache>
int free_slots(Cache& cache) {
  std::vector<sequence_id> added;
  try {
    for (;;) added.push_back(cache.add_sequence());
  } catch (const capacity_error&) {
  }
  for (const sequence_id s : added) cache.remove_sequence(s);
  return static_cast<int>(added.size());
}

/// Page size of the small test caches: the smallest each format allows.
template <class Format>
int test_page_size() {
  if (std::is_same<Format, format::bitmap_tiles>::value) return 64;  // whole 1x64 tiles
  if (std::is_same<Format, format::quant2>::value) return 32;        // whole V partitions of 32
  return 16;
}

template <class Format>
Format lossy_format();
template <>
format::dense lossy_format<format::dense>() { return {}; }
template <>
format::bitmap_tiles lossy_format<format::bitmap_tiles>() {
  format::bitmap_tiles f;
  f.s_k = 0.5;
  f.s_v = 0.7;
  return f;
}
template <>
format::quant2 lossy_format<format::quant2>() {
  format::quant2 f;
  f.partition = 32;
  f.sink_tokens = 2;
  return f;
}

template <class Selector>
Selector make_selector() { return {}; }
template <>
select::quest make_selector<select::quest>() {
  select::quest s;
  s.budget.ratio = 0.25;
  return s;
}
template <>
select::sentence_chunks make_selector<select::sentence_chunks>() {
  select::sentence_chunks s;
  s.target_length = 6;
  s.window = 3;
  s.budget.ratio = 0.5;
  return s;
}

}  // namespace

// --- Chunked prefill -------------------------------------------------------------------------------

template <class Format>
void check_chunked_prefill() {
  const cache_config c = small_config(test_page_size<Format>());
  const int p = c.page_size;
  const std::vector<std::vector<int>> patterns = {
      {1}, {p - 1}, {p}, {p + 1}, {2 * p + 3}, {1, 1, p - 1}, {p + 1, 1, 2 * p + 3}, {p - 1, p, p + 1}};
  for (int fill = 0; fill < p; ++fill) {
    for (const std::vector<int>& pattern : patterns) {
      int total = fill;
      for (const int n : pattern) total += n;
      INFO(format_traits<Format>::describe(lossy_format<Format>()) << ": tail fill " << fill << ", chunks of " << pattern.size());
      const rows all = make_rows(c, 3, 0, total);
      cache<Format> one_shot(c, lossy_format<Format>()), chunked(c, lossy_format<Format>());
      const sequence_id a = one_shot.add_sequence(), b = chunked.add_sequence();
      one_shot.prefill(a, all.k(), all.v());
      int at = 0;
      for (int step = -1; step < static_cast<int>(pattern.size()); ++step) {
        const int n = step < 0 ? fill : pattern[static_cast<std::size_t>(step)];
        if (n == 0) continue;
        const rows part = make_rows(c, 3, at, n);
        chunked.prefill(b, part.k(), part.v());
        at += n;
      }
      require_same(observation<cache<Format>>::of(one_shot, {a}), observation<cache<Format>>::of(chunked, {b}));
    }
  }
}

TEST_CASE("a prefill in chunks of any size into any tail fill equals one prefill of the same tokens",
          "[reliability][host][prefill]") {
  check_chunked_prefill<format::dense>();
  check_chunked_prefill<format::bitmap_tiles>();
  check_chunked_prefill<format::quant2>();
}

// --- All or nothing under allocation failure --------------------------------------------------------

namespace {

/// Builds the same state in two caches, then runs `op` on one with its n-th allocation failing,
/// for n = 0, 1, ... until `op` completes: after every failure the two caches must be
/// indistinguishable (gauge, lengths, block tables, chunks, bitwise outputs), and remain so when
/// the other cache's next operations run on both. Returns the number of failure points tried.
template <class Cache, class Setup, class Op>
long check_all_or_nothing(const cache_config& c, const typename Cache::format_type& format, Setup setup, Op op) {
  long n = 0;
  for (;; ++n) {
    Cache failing(c, format, make_selector<typename Cache::selector_type>()),
        reference(c, format, make_selector<typename Cache::selector_type>());
    std::vector<sequence_id> seqs = setup(failing);
    REQUIRE(setup(reference) == seqs);
    seqs.reserve(seqs.size() + 4);  // the test's own bookkeeping must not be what fails
    bool threw = false;
    {
      fail_allocation arm(n);
      try {
        op(failing, seqs);
      } catch (const std::bad_alloc&) {
        threw = true;
      } catch (const kvmosaic::error& e) {
        // Allocation failures of the library's own arenas are reported as kvmosaic errors.
        INFO(e.what());
        threw = true;
      }
    }
    INFO("allocation " << n << " failed: " << threw << "; lengths " << failing.length(seqs[0]) << " / "
                        << reference.length(seqs[0]));
    if (!threw) {
      op(reference, seqs);
      require_same(observation<Cache>::of(failing, seqs), observation<Cache>::of(reference, seqs));
      return n;
    }
    require_same(observation<Cache>::of(failing, seqs), observation<Cache>::of(reference, seqs));
    REQUIRE(free_slots(failing) == free_slots(reference));  // no sequence slot taken by the failure
    // The failed cache keeps working as the reference does.
    const rows more = make_rows(c, 11, 500, static_cast<int>(seqs.size()));
    append(failing, seqs, more);
    append(reference, seqs, more);
    require_same(observation<Cache>::of(failing, seqs), observation<Cache>::of(reference, seqs));
  }
}

template <class Format, class Selector>
void check_every_operation_all_or_nothing() {
  using Cache = cache<Format, Selector>;
  const cache_config c = small_config(test_page_size<Format>());
  const Format format = lossy_format<Format>();
  INFO(format_traits<Format>::describe(format) << " / " << selector_traits<Selector>::describe(make_selector<Selector>()));
  // Two sequences: one with pages and a part-full tail, one forked from it.
  const auto setup = [&](Cache& cache) {
    const sequence_id a = cache.add_sequence();
    prefill(cache, a, make_rows(c, 1, 0, 2 * c.page_size + 5));
    const sequence_id b = cache.fork_sequence(a);
    append(cache, {b}, make_rows(c, 2, 2 * c.page_size + 5, 1));
    return std::vector<sequence_id>{a, b};
  };
  // A prefill that seals pages and wraps the tail over its old rows.
  long points = check_all_or_nothing<Cache>(c, format, setup, [&](Cache& cache, std::vector<sequence_id>& seqs) {
    prefill(cache, seqs[0], make_rows(c, 1, 2 * c.page_size + 5, 3 * c.page_size + 2));
  });
  CHECK(points > 3);
  // An append that seals a page in one sequence of the batch and not in the other.
  check_all_or_nothing<Cache>(c, format, [&](Cache& cache) {
    std::vector<sequence_id> seqs = setup(cache);
    prefill(cache, seqs[0], make_rows(c, 1, 2 * c.page_size + 5, c.page_size - 6));
    return seqs;
  }, [&](Cache& cache, std::vector<sequence_id>& seqs) { append(cache, seqs, make_rows(c, 5, 900, 2)); });
  // A fork, and an add: the new sequence must not exist after a failure.
  check_all_or_nothing<Cache>(c, format, setup, [&](Cache& cache, std::vector<sequence_id>& seqs) {
    const sequence_id child = cache.fork_sequence(seqs[0]);
    seqs.push_back(child);
  });
  check_all_or_nothing<Cache>(c, format, setup,
                              [&](Cache& cache, std::vector<sequence_id>& seqs) { seqs.push_back(cache.add_sequence()); });
  // A removal (no allocation to fail: it must simply work).
  check_all_or_nothing<Cache>(c, format, setup, [&](Cache& cache, std::vector<sequence_id>& seqs) {
    cache.remove_sequence(seqs[1]);
    seqs.pop_back();
  });
  // An attend (selectors keep per-step state).
  check_all_or_nothing<Cache>(c, format, setup, [&](Cache& cache, std::vector<sequence_id>& seqs) {
    (void)observation<Cache>::of(cache, seqs);
  });
}

}  // namespace

TEST_CASE("every operation is all or nothing when any allocation inside it fails",
          "[reliability][host][faults]") {
  check_every_operation_all_or_nothing<format::dense, select::all>();
  check_every_operation_all_or_nothing<format::bitmap_tiles, select::all>();
  check_every_operation_all_or_nothing<format::quant2, select::all>();
  check_every_operation_all_or_nothing<format::dense, select::quest>();
  check_every_operation_all_or_nothing<format::dense, select::sentence_chunks>();
  check_every_operation_all_or_nothing<format::quant2, select::sentence_chunks>();
}

// --- Handles and per-sequence state ---------------------------------------------------------------

TEST_CASE("a removed sequence's handle is rejected, also after its slot is reused",
          "[reliability][host][handles]") {
  const cache_config c = small_config();
  cache<format::dense> cache(c);
  const sequence_id old = cache.add_sequence();
  prefill(cache, old, make_rows(c, 1, 0, 20));
  cache.remove_sequence(old);
  const sequence_id reused = cache.add_sequence();
  REQUIRE(reused != old);
  REQUIRE(cache.slot(reused) == 0);  // the slot `old` had: one slot, two generations
  const rows r = make_rows(c, 2, 0, 5);
  CHECK_THROWS_AS(cache.prefill(old, r.k(), r.v()), invalid_argument);
  CHECK_THROWS_WITH(cache.length(old), Catch::Contains("this one was removed"));
  CHECK_THROWS_AS(cache.remove_sequence(old), invalid_argument);
  CHECK_THROWS_AS(cache.fork_sequence(old), invalid_argument);
  CHECK(cache.length(reused) == 0);  // the stale calls changed nothing
  cache.prefill(reused, r.k(), r.v());
  CHECK(cache.length(reused) == 5);
  // Handles that were never handed out.
  CHECK_THROWS_AS(cache.length(-1), invalid_argument);
  CHECK_THROWS_AS(cache.length(reused + c.max_sequences * 1000), invalid_argument);
}

TEST_CASE("output-aware key weights end with their sequence", "[reliability][host][bitmap_tiles]") {
  const cache_config c = small_config(64);
  format::bitmap_tiles f;
  f.s_k = 0.7;
  f.s_v = 0.5;
  const rows r = make_rows(c, 4, 0, 3 * c.page_size + 3);
  // A fresh cache: plain magnitude pruning.
  cache<format::bitmap_tiles> fresh(c, f);
  const sequence_id expected = fresh.add_sequence();
  fresh.prefill(expected, r.k(), r.v());
  // A cache whose previous sequence in the same slot pruned with weights.
  cache<format::bitmap_tiles> reused(c, f);
  const sequence_id first = reused.add_sequence();
  std::vector<float> weights(static_cast<std::size_t>(c.num_kv_heads * c.head_dim));
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = i % 3 == 0 ? 100.0f : 0.01f;
  reused.set_key_weights(first, tensor_view<const float, 2>(weights.data(), c.num_kv_heads, c.head_dim));
  reused.remove_sequence(first);
  const sequence_id second = reused.add_sequence();
  REQUIRE(reused.slot(second) == fresh.slot(expected));
  reused.prefill(second, r.k(), r.v());
  require_same(observation<cache<format::bitmap_tiles>>::of(fresh, {expected}),
               observation<cache<format::bitmap_tiles>>::of(reused, {second}));
}

// --- Numerics and arguments ------------------------------------------------------------------------

TEST_CASE("one query head's overflowing logits leave the other heads of its group exact",
          "[reliability][host][numerics]") {
  cache_config c = small_config();
  c.group_size = 4;
  const rows r = make_rows(c, 5, 0, 2 * c.page_size + 7);
  cache<format::dense> cache(c);
  const sequence_id seq = cache.add_sequence();
  cache.prefill(seq, r.k(), r.v());
  std::vector<float> q(static_cast<std::size_t>(c.num_q_heads() * c.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  std::vector<float> normal(q.size()), extreme(q.size());
  const auto run = [&](const std::vector<float>& query, std::vector<float>& out) {
    cache.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(query.data(), 1, c.num_q_heads(), c.head_dim),
                 tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim));
  };
  run(q, normal);
  std::vector<float> q_extreme = q;
  const int odd_head = 1;  // KV head 0's second query head
  for (int ch = 0; ch < c.head_dim; ++ch) q_extreme[static_cast<std::size_t>(odd_head * c.head_dim + ch)] = -1e38f;
  run(q_extreme, extreme);
  for (int head = 0; head < c.num_q_heads(); ++head) {
    if (head == odd_head) continue;
    for (int ch = 0; ch < c.head_dim; ++ch) {
      INFO("query head " << head << ", channel " << ch);
      const std::size_t i = static_cast<std::size_t>(head * c.head_dim + ch);
      REQUIRE(std::isfinite(extreme[i]));
      REQUIRE(extreme[i] == normal[i]);
    }
  }
}

TEST_CASE("attend rejects null, negative-extent and overlapping arrays, naming them", "[reliability][host][arguments]") {
  const cache_config c = small_config();
  cache<format::dense> cache(c);
  const sequence_id seq = cache.add_sequence();
  const rows r = make_rows(c, 6, 0, 9);
  cache.prefill(seq, r.k(), r.v());
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(2 * hq * d), 0.5f), out(q.size());
  const span<const sequence_id> one(&seq, 1);
  CHECK_THROWS_WITH(cache.attend(one, tensor_view<const float, 3>(nullptr, 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d)),
                    Catch::Contains("q = null"));
  CHECK_THROWS_WITH(cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(nullptr, 1, hq, d)),
                    Catch::Contains("out = null"));
  CHECK_THROWS_WITH(cache.attend(span<const sequence_id>(nullptr, 1), tensor_view<const float, 3>(q.data(), 1, hq, d),
                                 tensor_view<float, 3>(out.data(), 1, hq, d)),
                    Catch::Contains("seqs = null"));
  // out shares elements with q: partly, and wholly.
  CHECK_THROWS_WITH(cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(q.data() + d, 1, hq, d)),
                    Catch::Contains("out = overlapping q"));
  CHECK_THROWS_AS(cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(q.data(), 1, hq, d)),
                  invalid_argument);
  // Adjacent, not overlapping: accepted.
  cache.attend(one, tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(q.data() + hq * d, 1, hq, d));
  // Appends and prefills.
  CHECK_THROWS_WITH(cache.append(span<const sequence_id>(nullptr, 1), tensor_view<const float, 3>(r.kv.k.data(), 1, c.num_kv_heads, d),
                                 tensor_view<const float, 3>(r.kv.v.data(), 1, c.num_kv_heads, d)),
                    Catch::Contains("seqs = null"));
  CHECK_THROWS_AS(cache.append(span<const sequence_id>(&seq, -1), tensor_view<const float, 3>(r.kv.k.data(), -1, c.num_kv_heads, d),
                               tensor_view<const float, 3>(r.kv.v.data(), -1, c.num_kv_heads, d)),
                  invalid_argument);
  CHECK_THROWS_WITH(cache.prefill(seq, tensor_view<const float, 3>(nullptr, 3, c.num_kv_heads, d),
                                  tensor_view<const float, 3>(r.kv.v.data(), 3, c.num_kv_heads, d)),
                    Catch::Contains("k = null"));
  CHECK(cache.length(seq) == 9);
  CHECK(cache.memory().pages_free == c.max_pages);
}

TEST_CASE("a prefill larger than the pool can ever hold is a capacity error, without overflow",
          "[reliability][host][arguments]") {
  const cache_config c = small_config();
  cache<format::dense> cache(c);
  const sequence_id seq = cache.add_sequence();
  const rows r = make_rows(c, 7, 0, 5);
  cache.prefill(seq, r.k(), r.v());
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  // The views are never read: the row count is refused first.
  CHECK_THROWS_AS(cache.prefill(seq, tensor_view<const float, 3>(r.kv.k.data(), huge, c.num_kv_heads, c.head_dim),
                                tensor_view<const float, 3>(r.kv.v.data(), huge, c.num_kv_heads, c.head_dim)),
                  capacity_error);
  CHECK(cache.length(seq) == 5);
}

TEST_CASE("configurations whose sizes would overflow are rejected by name", "[reliability][host][arguments]") {
  cache_config c = small_config();
  c.num_kv_heads = 1 << 24;
  CHECK_THROWS_WITH(cache<format::dense>(c), Catch::Contains("num_kv_heads"));
  c = small_config();
  c.max_pages = 1 << 26;
  CHECK_THROWS_WITH(cache<format::dense>(c), Catch::Contains("max_pages"));
  c = small_config();
  c.max_sequences = std::numeric_limits<std::int32_t>::max();
  CHECK_THROWS_WITH(cache<format::dense>(c), Catch::Contains("max_sequences"));
}
