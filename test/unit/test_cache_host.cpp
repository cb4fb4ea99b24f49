// SPDX-License-Identifier: Apache-2.0
// The composition on the host backend with format::dense and select::all: attention against the
// fp64 oracle, ragged batches, page boundaries, appends, forks, exhaustion and bad input.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;
using dense_cache = cache<format::dense>;

namespace {

synthetic::kv_config synthetic_for(const cache_config& c, std::uint64_t seed = 1) {
  return test::generator_for(c, seed);
}

struct batch_result {
  std::vector<float> out;  // [batch][Hq][D]
  std::vector<std::vector<float>> queries;
};

/// Attends one query per sequence (the query of position `length`) and returns the outputs.
batch_result attend_all(dense_cache& c, const std::vector<sequence_id>& seqs,
                        const synthetic::kv_config& syn, const std::vector<std::uint64_t>& streams) {
  const int hq = c.config().num_q_heads(), d = c.config().head_dim;
  const auto batch = static_cast<std::int64_t>(seqs.size());
  batch_result r;
  std::vector<float> q(static_cast<std::size_t>(batch) * hq * d);
  for (std::int64_t b = 0; b < batch; ++b) {
    r.queries.push_back(synthetic::generate_query(syn, streams[static_cast<std::size_t>(b)],
                                                  static_cast<int>(c.length(seqs[static_cast<std::size_t>(b)]))));
    std::copy(r.queries.back().begin(), r.queries.back().end(), q.begin() + b * hq * d);
  }
  r.out.resize(q.size());
  c.attend(span<const sequence_id>(seqs.data(), batch), tensor_view<const float, 3>(q.data(), batch, hq, d),
           tensor_view<float, 3>(r.out.data(), batch, hq, d));
  return r;
}

/// Checks one sequence's output against the oracle twice: against exact attention on the stored
/// (rounded) values with the fp32-only bound, and against exact attention on the original values
/// with the storage-dtype bound.
void check_against_oracle(const float* got, const std::vector<float>& q, const synthetic::kv_data& kv,
                          const cache_config& c) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const auto exact_stored = test::exact(q, stored, scale);
  const auto exact_original = test::exact(q, kv, scale);
  const auto fp32_bound = test::attention_error_bound(q, stored, c.group_size, scale, c.storage, c.page_size, true);
  const auto dtype_bound = test::attention_error_bound(q, kv, c.group_size, scale, c.storage, c.page_size);
  for (std::size_t i = 0; i < exact_stored.size(); ++i) {
    INFO("element " << i << " of " << exact_stored.size());
    REQUIRE(std::abs(got[i] - exact_stored[i]) <= fp32_bound.per_element[i]);
    REQUIRE(std::abs(got[i] - exact_original[i]) <= dtype_bound.per_element[i]);
  }
  // And the summary numbers the demo reports: far inside the bound in practice.
  const host::fidelity f = host::compare(got, exact_stored.data(), exact_stored.size());
  CHECK(f.rel_l2_error < 1e-5);
  CHECK(f.cosine > 1 - 1e-9);
}

}  // namespace

TEST_CASE("dense attention equals fp64 exact attention on ragged batches, every supported shape",
          "[cache][host][oracle]") {
  const int head_dim = GENERATE(64, 128, 256);
  const int group_size = GENERATE(1, 2, 3, 4, 8);
  const dtype storage = GENERATE(dtype::f16, dtype::bf16);
  const int page_size = GENERATE(16, 64);
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = group_size;
  c.head_dim = head_dim;
  c.page_size = page_size;
  c.storage = storage;
  c.max_pages = 256;
  c.max_sequences = 16;
  CAPTURE(head_dim, group_size, to_string(storage), page_size);

  dense_cache cache(c);
  const auto syn = synthetic_for(c);
  // ragged: one token, inside one page, exactly one page, one past, many pages
  const std::vector<int> lengths{1, 15, page_size, page_size + 1, 3 * page_size - 1, 300};
  std::vector<sequence_id> seqs;
  std::vector<std::uint64_t> streams;
  std::vector<synthetic::kv_data> data;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    data.push_back(synthetic::generate_kv(syn, i, lengths[i]));
    seqs.push_back(cache.add_sequence());
    streams.push_back(i);
    cache.prefill(seqs.back(), test::k_view(data.back()), test::v_view(data.back()));
    CHECK(cache.length(seqs.back()) == lengths[i]);
    CHECK(cache.pages(seqs.back()).size() == static_cast<std::size_t>(lengths[i] / page_size));
  }
  const batch_result r = attend_all(cache, seqs, syn, streams);
  const std::size_t per_seq = static_cast<std::size_t>(c.num_q_heads()) * head_dim;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    CAPTURE(lengths[b]);
    check_against_oracle(r.out.data() + b * per_seq, r.queries[b], data[b], c);
  }
}

TEST_CASE("dense attention over many pages (8K tokens) matches the oracle", "[cache][host][oracle]") {
  cache_config c;  // defaults: 8 KV heads, group 4, head_dim 128, page 64, bf16
  c.max_pages = 130;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 42);
  const auto kv = synthetic::generate_kv(syn, 0, 8192 + 37);
  const sequence_id s = cache.add_sequence();
  cache.prefill(s, test::k_view(kv), test::v_view(kv));
  CHECK(cache.pages(s).size() == 128);
  const batch_result r = attend_all(cache, {s}, syn, {0});
  check_against_oracle(r.out.data(), r.queries[0], kv, c);
}

TEST_CASE("appending token by token across page boundaries stores what one prefill stores",
          "[cache][host]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 32;
  c.max_sequences = 4;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 5);
  const int total = 3 * 16 + 5;
  const auto kv = synthetic::generate_kv(syn, 0, total);

  const sequence_id whole = cache.add_sequence();
  cache.prefill(whole, test::k_view(kv), test::v_view(kv));

  // A chunked prefill of 10 tokens, then single-token appends in batches with another sequence.
  const sequence_id stepped = cache.add_sequence();
  const sequence_id other = cache.add_sequence();
  const auto first = synthetic::generate_kv(syn, 0, 0, 10);
  cache.prefill(stepped, test::k_view(first), test::v_view(first));
  const auto other_kv = synthetic::generate_kv(syn, 1, total);
  cache.prefill(other, test::k_view(synthetic::generate_kv(syn, 1, 0, 1)),
                test::v_view(synthetic::generate_kv(syn, 1, 0, 1)));
  for (int t = 10; t < total; ++t) {
    const auto a = synthetic::generate_kv(syn, 0, t, 1);
    const auto b = synthetic::generate_kv(syn, 1, t - 9, 1);
    std::vector<float> k(a.k), v(a.v);
    k.insert(k.end(), b.k.begin(), b.k.end());
    v.insert(v.end(), b.v.begin(), b.v.end());
    const std::vector<sequence_id> batch{stepped, other};
    cache.append(span<const sequence_id>(batch.data(), 2), tensor_view<const float, 3>(k.data(), 2, 2, 64),
                 tensor_view<const float, 3>(v.data(), 2, 2, 64));
    CHECK(cache.length(stepped) == t + 1);
    CHECK(cache.pages(stepped).size() == static_cast<std::size_t>((t + 1) / 16));
  }
  const batch_result a = attend_all(cache, {whole}, syn, {0});
  const batch_result b = attend_all(cache, {stepped}, syn, {0});
  CHECK(a.out == b.out);  // bitwise: same bytes, same arithmetic
  check_against_oracle(b.out.data(), b.queries[0], kv, c);
  const batch_result o = attend_all(cache, {other}, syn, {1});
  check_against_oracle(o.out.data(), o.queries[0], synthetic::generate_kv(syn, 1, total - 9), c);
  (void)other_kv;
}

TEST_CASE("prefill accepts half and bfloat16 input and rounds float input to the storage dtype",
          "[cache][host]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.storage = dtype::f16;
  c.max_pages = 8;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 9);
  const auto kv = synthetic::generate_kv(syn, 0, 40);
  std::vector<half> kh(kv.k.size()), vh(kv.v.size());
  for (std::size_t i = 0; i < kh.size(); ++i) {
    kh[i] = half(kv.k[i]);
    vh[i] = half(kv.v[i]);
  }
  const sequence_id from_float = cache.add_sequence(), from_half = cache.add_sequence();
  cache.prefill(from_float, test::k_view(kv), test::v_view(kv));
  cache.prefill(from_half, tensor_view<const half, 3>(kh.data(), 40, 1, 64), tensor_view<const half, 3>(vh.data(), 40, 1, 64));
  CHECK(attend_all(cache, {from_float}, syn, {0}).out == attend_all(cache, {from_half}, syn, {0}).out);
}

TEST_CASE("page pool exhaustion is a clear error and loses nothing already stored", "[cache][host][memory]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 4;
  c.max_sequences = 4;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 3);
  const auto kv = synthetic::generate_kv(syn, 0, 50);  // 3 pages + 2 tail rows
  const sequence_id s = cache.add_sequence();
  cache.prefill(s, test::k_view(kv), test::v_view(kv));
  REQUIRE(cache.memory().pages_free == 1);
  const auto before = attend_all(cache, {s}, syn, {0}).out;

  SECTION("a prefill that needs more pages than are free") {
    const auto more = synthetic::generate_kv(syn, 0, 50, 40);  // 2 + 40 rows: 2 pages needed
    try {
      cache.prefill(s, test::k_view(more), test::v_view(more));
      FAIL("no throw");
    } catch (const capacity_error& e) {
      CHECK(e.parameter() == "page_pool");
      CHECK_THAT(e.what(), Catch::Contains("page pool exhausted: 2 page(s) needed, 1 free of 4"));
    }
    CHECK(cache.length(s) == 50);
    CHECK(cache.memory().pages_free == 1);
    CHECK(attend_all(cache, {s}, syn, {0}).out == before);
  }
  SECTION("a decode batch whose appends need more pages than are free") {
    const sequence_id t = cache.add_sequence();
    const auto kv2 = synthetic::generate_kv(syn, 1, 15);
    cache.prefill(t, test::k_view(kv2), test::v_view(kv2));  // tail 15: next append seals a page
    const auto fill = synthetic::generate_kv(syn, 0, 50, 14);  // s: tail 2 + 14 = 16: takes the last page
    cache.prefill(s, test::k_view(fill), test::v_view(fill));
    REQUIRE(cache.memory().pages_free == 0);
    const auto before_t = attend_all(cache, {t}, syn, {1}).out;
    const auto before_s = attend_all(cache, {s}, syn, {0}).out;
    const auto step = synthetic::generate_kv(syn, 2, 2);  // one row for each of 2 sequences
    const std::vector<sequence_id> batch{s, t};
    CHECK_THROWS_AS(cache.append(span<const sequence_id>(batch.data(), 2), tensor_view<const float, 3>(step.k.data(), 2, 2, 64),
                                 tensor_view<const float, 3>(step.v.data(), 2, 2, 64)),
                    capacity_error);
    CHECK(cache.length(s) == 64);  // s would not have needed a page, but the batch is all-or-nothing
    CHECK(cache.length(t) == 15);
    CHECK(attend_all(cache, {t}, syn, {1}).out == before_t);
    CHECK(attend_all(cache, {s}, syn, {0}).out == before_s);
  }
}

TEST_CASE("forked sequences share pages by reference count and free them with the last holder",
          "[cache][host][memory]") {
  cache_config c;
  c.num_kv_heads = 1;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = 32;
  c.max_pages = 16;
  c.max_sequences = 4;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 8);
  const auto prefix = synthetic::generate_kv(syn, 0, 100);  // 3 pages + 4 tail rows
  const sequence_id parent = cache.add_sequence();
  cache.prefill(parent, test::k_view(prefix), test::v_view(prefix));
  const sequence_id child = cache.fork_sequence(parent);
  CHECK(cache.memory().pages_used == 3);
  for (page_id p : cache.pages(child)) CHECK(cache.pool().ref_count(p) == 2);
  CHECK(attend_all(cache, {parent}, syn, {0}).out == attend_all(cache, {child}, syn, {0}).out);

  // The child diverges; the parent is untouched.
  const auto parent_out = attend_all(cache, {parent}, syn, {0}).out;
  const auto tail = synthetic::generate_kv(syn, 1, 40);
  cache.prefill(child, test::k_view(tail), test::v_view(tail));
  CHECK(cache.memory().pages_used == 3 + 1);
  CHECK(attend_all(cache, {parent}, syn, {0}).out == parent_out);

  cache.remove_sequence(parent);
  CHECK(cache.memory().pages_used == 4);  // shared pages stay with the child
  CHECK_THROWS_AS(cache.length(parent), invalid_argument);
  cache.remove_sequence(child);
  CHECK(cache.memory().pages_used == 0);
  CHECK(cache.memory().pages_free == 16);  // the gauge: everything reclaimed
}

TEST_CASE("dense accounting: ratio 1, two 16-bit rows per token per KV head", "[cache][host][memory]") {
  cache_config c;
  c.page_size = 64;
  c.max_pages = 64;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 2);
  const auto kv = synthetic::generate_kv(syn, 0, 1000);
  const sequence_id s = cache.add_sequence();
  cache.prefill(s, test::k_view(kv), test::v_view(kv));
  const memory_stats m = cache.sequence_memory(s);
  CHECK(m.tokens == 1000);
  CHECK(m.bytes_per_token() == 8 * 128 * 2 * 2);
  CHECK(m.compression_ratio() == 1.0);
  CHECK(cache.memory().stored_bytes == m.stored_bytes);
  CHECK(cache.memory().pages_used == 15);
}

TEST_CASE("bad configurations are rejected naming the parameter and the allowed values", "[cache][host][errors]") {
  const auto message = [](const cache_config& c) {
    try {
      dense_cache cache(c);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  cache_config c;
  c.head_dim = 96;
  CHECK(message(c) == "kvmosaic: cache_config: head_dim = 96; allowed: 64, 128 or 256");
  c = cache_config{};
  c.group_size = 9;
  CHECK(message(c) == "kvmosaic: cache_config: group_size = 9; allowed: 1 to 8");
  c.group_size = 0;
  CHECK(message(c) == "kvmosaic: cache_config: group_size = 0; allowed: 1 to 8");
  c = cache_config{};
  c.page_size = 40;
  CHECK(message(c) == "kvmosaic: cache_config: page_size = 40; allowed: a multiple of 16 from 16 to 1024");
  c.page_size = 0;
  CHECK_THAT(message(c), Catch::Contains("page_size = 0"));
  c = cache_config{};
  c.storage = dtype::f32;
  CHECK(message(c) == "kvmosaic: cache_config: storage = f32; allowed: f16 or bf16");
  c = cache_config{};
  c.num_kv_heads = 0;
  CHECK_THAT(message(c), Catch::Contains("num_kv_heads = 0; allowed: >= 1"));
  c = cache_config{};
  c.max_pages = 0;
  CHECK_THAT(message(c), Catch::Contains("max_pages = 0"));
  CHECK(message(cache_config{}) == "accepted");
}

TEST_CASE("bad calls are rejected before anything changes", "[cache][host][errors]") {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 2;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 8;
  c.max_sequences = 2;
  dense_cache cache(c);
  const auto syn = synthetic_for(c, 4);
  const sequence_id empty = cache.add_sequence();
  std::vector<float> q(4 * 64), out(q.size());
  const std::vector<sequence_id> one{empty};

  SECTION("attention over an empty sequence") {
    try {
      cache.attend(span<const sequence_id>(one.data(), 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
                   tensor_view<float, 3>(out.data(), 1, 4, 64));
      FAIL("no throw");
    } catch (const invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains("an empty sequence"));
      CHECK_THAT(e.what(), Catch::Contains("sequences holding at least one token"));
    }
  }
  SECTION("a prefill of zero tokens") {
    CHECK_THROWS_WITH(cache.prefill(empty, tensor_view<const float, 3>(q.data(), 0, 2, 64),
                                    tensor_view<const float, 3>(q.data(), 0, 2, 64)),
                      Catch::Contains("k.extent(0) (tokens) = 0; allowed: >= 1"));
  }
  SECTION("K of the wrong head_dim or head count") {
    CHECK_THROWS_WITH(cache.prefill(empty, tensor_view<const float, 3>(q.data(), 1, 2, 128),
                                    tensor_view<const float, 3>(q.data(), 1, 2, 128)),
                      Catch::Contains("k.extent(2) (head_dim) = 128"));
    CHECK_THROWS_WITH(cache.prefill(empty, tensor_view<const float, 3>(q.data(), 1, 4, 64),
                                    tensor_view<const float, 3>(q.data(), 1, 4, 64)),
                      Catch::Contains("k.extent(1) (kv heads) = 4"));
  }
  SECTION("a query with the wrong number of heads") {
    const auto kv = synthetic::generate_kv(syn, 0, 3);
    cache.prefill(empty, test::k_view(kv), test::v_view(kv));
    CHECK_THROWS_WITH(cache.attend(span<const sequence_id>(one.data(), 1), tensor_view<const float, 3>(q.data(), 1, 2, 128),
                                   tensor_view<float, 3>(out.data(), 1, 2, 128)),
                      Catch::Contains("q.extent(1) (query heads) = 2; allowed: num_kv_heads * group_size"));
  }
  SECTION("an unknown or removed sequence, and the same sequence twice in one append") {
    const std::vector<sequence_id> bogus{7};
    CHECK_THROWS_WITH(cache.attend(span<const sequence_id>(bogus.data(), 1), tensor_view<const float, 3>(q.data(), 1, 4, 64),
                                   tensor_view<float, 3>(out.data(), 1, 4, 64)),
                      Catch::Contains("seq = 7; allowed: an id returned by add_sequence or fork_sequence and not removed"));
    const std::vector<sequence_id> twice{empty, empty};
    std::vector<float> rows(2 * 2 * 64, 0.5f);
    CHECK_THROWS_WITH(cache.append(span<const sequence_id>(twice.data(), 2), tensor_view<const float, 3>(rows.data(), 2, 2, 64),
                                   tensor_view<const float, 3>(rows.data(), 2, 2, 64)),
                      Catch::Contains("distinct sequence ids"));
    CHECK(cache.length(empty) == 0);
  }
  SECTION("more sequences than slots") {
    cache.add_sequence();
    CHECK_THROWS_AS(cache.add_sequence(), capacity_error);
  }
}
