// SPDX-License-Identifier: Apache-2.0
// The public two-level step API on the host backend: plan then run, q and out in float, half or
// bfloat16 with any strides, the per-head log-sum-exp, against fp64 exact attention.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "../support/oracle.hpp"
#include "kvmosaic/kvmosaic.hpp"
#include "kvmosaic/support/synthetic.hpp"

using namespace kvmosaic;

namespace {

cache_config api_config() {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 16;
  c.max_pages = 64;
  c.max_sequences = 4;
  return c;
}

synthetic::kv_config generator_of(const cache_config& c) {
  synthetic::kv_config g;
  g.num_kv_heads = c.num_kv_heads;
  g.group_size = c.group_size;
  g.head_dim = c.head_dim;
  g.seed = 31;
  return g;
}

/// fp64 log-sum-exp of scale * q . k over the stored (rounded) keys, per query head.
std::vector<double> exact_lse(const std::vector<float>& q, const synthetic::kv_data& stored, const cache_config& c,
                              double scale) {
  std::vector<double> out;
  for (int j = 0; j < c.num_q_heads(); ++j) {
    const int h = j / c.group_size;
    std::vector<double> logits;
    double m = -INFINITY;
    for (int t = 0; t < stored.num_tokens; ++t) {
      double dot = 0;
      for (int ch = 0; ch < c.head_dim; ++ch)
        dot += static_cast<double>(q[static_cast<std::size_t>(j * c.head_dim + ch)]) * stored.k_at(t, h, ch);
      logits.push_back(scale * dot);
      m = std::max(m, logits.back());
    }
    double sum = 0;
    for (const double x : logits) sum += std::exp(x - m);
    out.push_back(m + std::log(sum));
  }
  return out;
}

template <class T>
T from(float x) {
  return T(x);
}

}  // namespace

TEMPLATE_TEST_CASE("plan and run: q and out in any 16- or 32-bit type and stride, and each head's log-sum-exp",
                   "[api][host]", float, half, bfloat16) {
  using T = TestType;
  const cache_config c = api_config();
  const int hq = c.num_q_heads(), d = c.head_dim, tokens = 3 * c.page_size + 5;
  const auto kv = synthetic::generate_kv(generator_of(c), 0, tokens);
  cache<format::dense> cache(c);
  const sequence_id seq = cache.add_sequence();
  cache.prefill(seq, test::k_view(kv), test::v_view(kv));
  const std::vector<float> query = synthetic::generate_query(generator_of(c), 0, tokens);

  // q and out interleaved with padding: strides of 2 * head_dim per head, channels reversed in out.
  std::vector<T> q(static_cast<std::size_t>(2 * hq * d)), out(q.size(), from<T>(-7.0f));
  for (int j = 0; j < hq; ++j)
    for (int ch = 0; ch < d; ++ch) q[static_cast<std::size_t>(j * 2 * d + ch)] = from<T>(query[static_cast<std::size_t>(j * d + ch)]);
  const auto q_view = tensor_view<const T, 3>::strided(q.data(), {1, hq, d}, {2 * hq * d, 2 * d, 1});
  const auto out_view = tensor_view<T, 3>::strided(out.data() + d - 1, {1, hq, d}, {2 * hq * d, 2 * d, -1});
  std::vector<float> lse(static_cast<std::size_t>(2 * hq), -1.0f);
  const auto lse_view = tensor_view<float, 2>::strided(lse.data(), {1, hq}, {2 * hq, 2});
  cache.plan(span<const sequence_id>(&seq, 1));
  cache.run(q_view, out_view, lse_view);

  // The reference reads the same (rounded) queries.
  std::vector<float> q_used(static_cast<std::size_t>(hq * d));
  for (int j = 0; j < hq; ++j)
    for (int ch = 0; ch < d; ++ch) q_used[static_cast<std::size_t>(j * d + ch)] = to_float(q_view(0, j, ch));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const synthetic::kv_data stored = test::rounded(kv, c.storage);
  const auto exact = test::exact(q_used, stored, scale);
  const auto bound = test::attention_error_bound(q_used, stored, c.group_size, scale, c.storage, c.page_size, true);
  const double out_rounding = std::is_same<T, float>::value ? 0.0 : (std::is_same<T, half>::value ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8));
  for (int j = 0; j < hq; ++j)
    for (int ch = 0; ch < d; ++ch) {
      INFO("head " << j << ", channel " << ch);
      const std::size_t i = static_cast<std::size_t>(j * d + ch);
      const double got = to_float(out_view(0, j, ch));
      REQUIRE(std::abs(got - exact[i]) <= bound.per_element[i] + out_rounding * std::abs(exact[i]));
    }
  // The padding between heads was not written.
  for (int j = 0; j < hq; ++j) REQUIRE(to_float(out[static_cast<std::size_t>(j * 2 * d + d)]) == -7.0f);
  const std::vector<double> lse_exact = exact_lse(q_used, stored, c, scale);
  for (int j = 0; j < hq; ++j) {
    INFO("head " << j);
    REQUIRE(std::abs(lse[static_cast<std::size_t>(2 * j)] - lse_exact[static_cast<std::size_t>(j)]) <= 1e-4 * (1 + std::abs(lse_exact[static_cast<std::size_t>(j)])));
    REQUIRE(lse[static_cast<std::size_t>(2 * j + 1)] == -1.0f);  // padding untouched
  }
}

TEST_CASE("run checks its arrays against the last plan", "[api][host]") {
  const cache_config c = api_config();
  cache<format::dense> cache(c);
  const sequence_id a = cache.add_sequence(), b = cache.add_sequence();
  const auto kv = synthetic::generate_kv(generator_of(c), 0, 20);
  cache.prefill(a, test::k_view(kv), test::v_view(kv));
  cache.prefill(b, test::k_view(kv), test::v_view(kv));
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(2 * hq * d), 0.25f), out(q.size()), lse(static_cast<std::size_t>(2 * hq));
  const sequence_id both[2] = {a, b};
  cache.plan(span<const sequence_id>(both, 2));
  CHECK_THROWS_WITH(cache.run(tensor_view<const float, 3>(q.data(), 1, hq, d), tensor_view<float, 3>(out.data(), 1, hq, d)),
                    Catch::Contains("q.extent(0) (batch) = 1; allowed: the batch of the last plan"));
  CHECK_THROWS_WITH(cache.run(tensor_view<const float, 3>(q.data(), 2, hq, d), tensor_view<float, 3>(out.data(), 2, hq, d),
                              tensor_view<float, 2>(lse.data(), 2, hq - 1)),
                    Catch::Contains("lse.extents"));
  CHECK_THROWS_WITH(cache.run(tensor_view<const float, 3>(q.data(), 2, hq, d), tensor_view<float, 3>(out.data(), 2, hq, d),
                              tensor_view<float, 2>(out.data(), 2, hq)),
                    Catch::Contains("lse = overlapping q or out"));
  cache.run(tensor_view<const float, 3>(q.data(), 2, hq, d), tensor_view<float, 3>(out.data(), 2, hq, d),
            tensor_view<float, 2>(lse.data(), 2, hq));
  for (const float x : out) REQUIRE(std::isfinite(x));
  // The same queries for both sequences with the same tokens: the same outputs and lse.
  for (int i = 0; i < hq * d; ++i) REQUIRE(out[static_cast<std::size_t>(i)] == out[static_cast<std::size_t>(hq * d + i)]);
  for (int j = 0; j < hq; ++j) REQUIRE(lse[static_cast<std::size_t>(j)] == lse[static_cast<std::size_t>(hq + j)]);
}
