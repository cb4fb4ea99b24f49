// SPDX-License-Identifier: Apache-2.0
// cache::read on the host backend: format::dense reads back what was written, bit for bit;
// bitmap_tiles the independent pruning reference; quant2 its host decode with the sink rows exact;
// attention over the rows read equals the cache's within the fp32 bound (quant2: within the bound
// its 8-bit q and p steps predict); evicted and compacted sequences read slot by slot; forks read
// their parent's rows; bad views are rejected and nothing is written.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../support/feed.hpp"
#include "../support/oracle.hpp"
#include "../support/prune.hpp"
#include "../support/quant_bound.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

cache_config read_config(int page_size = 16, dtype storage = dtype::bf16) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = page_size;
  c.storage = storage;
  c.max_pages = 256;
  c.max_sequences = 8;
  return c;
}

/// Everything a sequence holds, read as float: a kv_data of stored_tokens(seq) tokens.
template <class Cache>
synthetic::kv_data read_all(const Cache& kv, sequence_id seq) {
  const cache_config& c = kv.config();
  synthetic::kv_data out;
  out.num_kv_heads = c.num_kv_heads;
  out.head_dim = c.head_dim;
  out.num_tokens = static_cast<int>(kv.stored_tokens(seq));
  out.k.assign(static_cast<std::size_t>(out.num_tokens) * c.num_kv_heads * c.head_dim, std::nanf(""));
  out.v = out.k;
  kv.read(seq, tensor_view<float, 3>(out.k.data(), out.num_tokens, c.num_kv_heads, c.head_dim),
          tensor_view<float, 3>(out.v.data(), out.num_tokens, c.num_kv_heads, c.head_dim));
  return out;
}

/// Attends one query (the generator's, at the sequence's next position) and returns the output.
template <class Cache>
std::vector<float> attend_one(Cache& kv, sequence_id seq, const std::vector<float>& q) {
  const cache_config& c = kv.config();
  std::vector<float> out(q.size());
  kv.attend(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(q.data(), 1, c.num_q_heads(), c.head_dim),
            tensor_view<float, 3>(out.data(), 1, c.num_q_heads(), c.head_dim));
  return out;
}

/// Appends the generator's tokens [from, to) of stream 0 one by one.
template <class Cache>
void append_tokens(Cache& kv, sequence_id seq, const synthetic::kv_config& g, int from, int to) {
  const cache_config& c = kv.config();
  for (int t = from; t < to; ++t) {
    const auto row = synthetic::generate_kv(g, 0, t, 1);
    kv.append(span<const sequence_id>(&seq, 1), tensor_view<const float, 3>(row.k.data(), 1, c.num_kv_heads, c.head_dim),
              tensor_view<const float, 3>(row.v.data(), 1, c.num_kv_heads, c.head_dim));
  }
}

void require_equal(const synthetic::kv_data& got, const synthetic::kv_data& want) {
  REQUIRE(got.num_tokens == want.num_tokens);
  REQUIRE(got.k.size() == want.k.size());
  for (std::size_t i = 0; i < want.k.size(); ++i) {
    INFO("element " << i << " (token " << i / (static_cast<std::size_t>(want.num_kv_heads) * want.head_dim) << ")");
    REQUIRE(got.k[i] == want.k[i]);
    REQUIRE(got.v[i] == want.v[i]);
  }
}

/// Attention over `rows` with the fp64 oracle equals `out` within the fp32 bound on those rows.
void require_oracle_match(const std::vector<float>& out, const std::vector<float>& q, const synthetic::kv_data& rows,
                          const cache_config& c) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const auto exact = test::exact(q, rows, scale);
  const auto bound = test::attention_error_bound(q, rows, c.group_size, scale, c.storage, c.page_size, /*exact_storage=*/true);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bound.per_element[i]);
  }
}

}  // namespace

TEST_CASE("read: format::dense reads back what was written, bit for bit, in every element type and stride",
          "[read][dense]") {
  const dtype storage = GENERATE(dtype::bf16, dtype::f16);
  const int length = GENERATE(1, 15, 16, 17, 50, 64);
  const cache_config c = read_config(16, storage);
  CAPTURE(to_string(storage), length);
  const auto g = test::generator_for(c, 3);
  cache<format::dense> kv(c);
  const sequence_id seq = kv.add_sequence();
  const int prefilled = length > 8 ? length - 5 : length;  // then appends across a page boundary
  const auto data = synthetic::generate_kv(g, 0, length);
  const auto first = synthetic::generate_kv(g, 0, 0, prefilled);
  kv.prefill(seq, test::k_view(first), test::v_view(first));
  append_tokens(kv, seq, g, prefilled, length);
  REQUIRE(kv.stored_tokens(seq) == length);
  const synthetic::kv_data stored = test::rounded(data, storage);
  require_equal(read_all(kv, seq), stored);

  // In the storage type: the stored bits themselves.
  const int h = c.num_kv_heads, d = c.head_dim;
  const std::size_t n = static_cast<std::size_t>(length) * h * d;
  if (storage == dtype::bf16) {
    std::vector<bfloat16> k(n), v(n);
    kv.read(seq, tensor_view<bfloat16, 3>(k.data(), length, h, d), tensor_view<bfloat16, 3>(v.data(), length, h, d));
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(k[i].bits == bfloat16(data.k[i]).bits);
      REQUIRE(v[i].bits == bfloat16(data.v[i]).bits);
    }
  } else {
    std::vector<half> k(n), v(n);
    kv.read(seq, tensor_view<half, 3>(k.data(), length, h, d), tensor_view<half, 3>(v.data(), length, h, d));
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(k[i].bits == half(data.k[i]).bits);
      REQUIRE(v[i].bits == half(data.v[i]).bits);
    }
  }

  // A strided destination: [head][token][channel] memory seen as [token][head][channel].
  std::vector<float> k(n), v(n);
  const std::int64_t extents[3] = {length, h, d}, strides[3] = {d, static_cast<std::int64_t>(length) * d, 1};
  kv.read(seq, tensor_view<float, 3>::strided(k.data(), extents, strides), tensor_view<float, 3>::strided(v.data(), extents, strides));
  for (int t = 0; t < length; ++t)
    for (int head = 0; head < h; ++head)
      for (int ch = 0; ch < d; ++ch) {
        const std::size_t at = (static_cast<std::size_t>(head) * length + t) * d + ch;
        const std::size_t want = (static_cast<std::size_t>(t) * h + head) * d + ch;
        REQUIRE(k[at] == stored.k[want]);
        REQUIRE(v[at] == stored.v[want]);
      }
}

TEST_CASE("read: attention over the rows read equals the cache's within fp32 rounding (dense, bitmap_tiles)",
          "[read][oracle]") {
  const cache_config c = read_config(64);  // bitmap_tiles: whole 64-token tiles
  const auto g = test::generator_for(c, 5);
  const int length = 64 * 2 + 9;
  const auto data = synthetic::generate_kv(g, 0, length);
  const std::vector<float> q = synthetic::generate_query(g, 0, length);
  SECTION("dense") {
    cache<format::dense> kv(c);
    const sequence_id seq = kv.add_sequence();
    kv.prefill(seq, test::k_view(data), test::v_view(data));
    const synthetic::kv_data rows = read_all(kv, seq);
    require_oracle_match(attend_one(kv, seq, q), q, rows, c);
  }
  SECTION("bitmap_tiles: the pruned rows, zeros where pruned") {
    const format::bitmap_tiles f{0.5f, 0.7f};
    cache<format::bitmap_tiles> kv(c, f);
    const sequence_id seq = kv.add_sequence();
    kv.prefill(seq, test::k_view(data), test::v_view(data));
    const synthetic::kv_data rows = read_all(kv, seq);
    // The independent pruning reference (test/support/prune.hpp): pages pruned, the tail as stored.
    require_equal(rows, test::pruned_cache(test::rounded(data, c.storage), c.page_size, f.s_k, f.s_v));
    require_oracle_match(attend_one(kv, seq, q), q, rows, c);
  }
}

TEST_CASE("read: quant2 reads the dequantized codes (its host decode) and the sink rows exactly", "[read][quant2]") {
  const int sinks = GENERATE(0, 4);
  const cache_config c = read_config(64);
  CAPTURE(sinks);
  format::quant2 f;
  f.partition = 32;
  f.sink_tokens = sinks;
  const auto g = test::generator_for(c, 7);
  const int length = 64 * 3 + 10;
  const auto data = synthetic::generate_kv(g, 0, length);
  cache<format::quant2> kv(c, f);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  const synthetic::kv_data rows = read_all(kv, seq);
  const synthetic::kv_data decoded = test::quant_decoded(kv, seq, test::rounded(data, c.storage));
  require_equal(rows, decoded);
  // Sinks: the stored 16-bit values, not the page's copies of the token after them.
  const synthetic::kv_data stored = test::rounded(data, c.storage);
  for (std::size_t i = 0; i < static_cast<std::size_t>(sinks) * c.num_kv_heads * c.head_dim; ++i) {
    REQUIRE(rows.k[i] == stored.k[i]);
    REQUIRE(rows.v[i] == stored.v[i]);
  }
  // Attention on the codes (8-bit q and p) against exact attention on the rows read.
  const std::vector<float> q = synthetic::generate_query(g, 0, length);
  const std::vector<float> out = attend_one(kv, seq, q);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const auto exact = test::exact(q, rows, scale);
  const test::quant_bounds bounds = test::quant_attention_bounds(kv, seq, q, rows, scale);
  for (std::size_t i = 0; i < exact.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(out[i] - exact[i]) <= bounds.vs_exact[i]);
  }
}

TEST_CASE("read: evicted and compacted sequences read slot by slot; positions() maps them", "[read][eviction]") {
  const cache_config c = read_config(16);
  const auto g = test::generator_for(c, 9);
  const int length = 16 * 6 + 3;
  const auto data = synthetic::generate_kv(g, 0, length);
  const synthetic::kv_data stored = test::rounded(data, c.storage);
  cache<format::dense, select::all, compact::repack> kv(c);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  std::vector<std::int64_t> dead;
  for (std::int64_t t = 0; t < 16 * 6; ++t)
    if (t % 3 != 0 || (t >= 32 && t < 48)) dead.push_back(t);  // page 2 emptied: freed at once
  kv.evict(seq, span<const std::int64_t>(dead.data(), static_cast<std::int64_t>(dead.size())));
  const auto check = [&] {
    const synthetic::kv_data rows = read_all(kv, seq);
    const std::vector<std::int64_t> where = kv.positions(seq);
    REQUIRE(static_cast<std::int64_t>(where.size()) == kv.stored_tokens(seq));
    REQUIRE(rows.num_tokens == kv.stored_tokens(seq));
    const std::size_t row = static_cast<std::size_t>(c.num_kv_heads) * c.head_dim;
    std::int64_t live = 0;
    for (std::size_t slot = 0; slot < where.size(); ++slot) {
      if (where[slot] < 0) continue;  // an evicted slot: as stored, whatever it holds
      ++live;
      const std::size_t from = static_cast<std::size_t>(where[slot]) * row;
      for (std::size_t i = 0; i < row; ++i) {
        REQUIRE(rows.k[slot * row + i] == stored.k[from + i]);
        REQUIRE(rows.v[slot * row + i] == stored.v[from + i]);
      }
    }
    REQUIRE(live == length - static_cast<std::int64_t>(dead.size()));
  };
  REQUIRE(kv.stored_tokens(seq) == length - 16);  // the emptied page went back
  check();
  kv.compact(seq);
  REQUIRE(kv.stored_tokens(seq) < length - 16);
  check();
}

TEST_CASE("read: a fork reads its parent's rows, then its own", "[read][fork]") {
  const cache_config c = read_config(64);
  const auto g = test::generator_for(c, 13);
  const auto data = synthetic::generate_kv(g, 0, 100);
  const format::bitmap_tiles f;
  cache<format::bitmap_tiles> kv(c, f);
  const sequence_id parent = kv.add_sequence();
  kv.prefill(parent, test::k_view(data), test::v_view(data));
  const sequence_id child = kv.fork_sequence(parent);
  require_equal(read_all(kv, child), read_all(kv, parent));
  append_tokens(kv, child, g, 100, 131);  // seals the child's own second page from the copied tail
  REQUIRE(kv.stored_tokens(child) == 131);
  require_equal(read_all(kv, child),
                test::pruned_cache(test::rounded(synthetic::generate_kv(g, 0, 131), c.storage), c.page_size, f.s_k, f.s_v));
  require_equal(read_all(kv, parent), test::pruned_cache(test::rounded(data, c.storage), c.page_size, f.s_k, f.s_v));
}

TEST_CASE("read rejects dead handles and views of the wrong extents, writing nothing", "[read][errors]") {
  const cache_config c = read_config(16);
  const auto g = test::generator_for(c, 1);
  const auto data = synthetic::generate_kv(g, 0, 20);
  cache<format::dense> kv(c);
  const sequence_id seq = kv.add_sequence();
  kv.prefill(seq, test::k_view(data), test::v_view(data));
  const int h = c.num_kv_heads, d = c.head_dim;
  std::vector<float> k(21 * static_cast<std::size_t>(h) * d, -7.0f), v(k.size(), -7.0f);
  const auto view = [&](std::vector<float>& x, std::int64_t t, std::int64_t heads, std::int64_t dim) {
    return tensor_view<float, 3>(x.data(), t, heads, dim);
  };
  const auto rejects = [&](tensor_view<float, 3> kk, tensor_view<float, 3> vv, const char* parameter) {
    try {
      kv.read(seq, kk, vv);
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      INFO(e.what());
      REQUIRE(e.parameter() == parameter);
    }
  };
  rejects(view(k, 19, h, d), view(v, 19, h, d), "k.extent(0) (tokens)");
  rejects(view(k, 21, h, d), view(v, 21, h, d), "k.extent(0) (tokens)");
  rejects(view(k, 20, h + 1, d / 2), view(v, 20, h + 1, d / 2), "k.extent(1) (kv heads)");
  rejects(view(k, 20, 1, 2 * d), view(v, 20, 1, 2 * d), "k.extent(1) (kv heads)");
  rejects(view(k, 20, h, d), view(v, 19, h, d), "v.extents");
  rejects(view(k, 20, h, d), view(k, 20, h, d), "v");  // overlapping
  rejects(tensor_view<float, 3>(nullptr, 20, h, d), view(v, 20, h, d), "k");
  for (const float x : k) REQUIRE(x == -7.0f);
  for (const float x : v) REQUIRE(x == -7.0f);
  kv.remove_sequence(seq);
  REQUIRE_THROWS_AS(kv.read(seq, view(k, 20, h, d), view(v, 20, h, d)), invalid_argument);
  // An empty sequence reads zero rows.
  const sequence_id empty = kv.add_sequence();
  kv.read(empty, view(k, 0, h, d), view(v, 0, h, d));
}
