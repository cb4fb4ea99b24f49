// SPDX-License-Identifier: Apache-2.0
// The public step API on the CUDA backend, on a cache compiled for one kernel shape
// (backend::cuda_for): plan then run with q and out in float, half or bfloat16 and any strides,
// the per-head log-sum-exp, against the host backend on the same data; configurations outside
// the compiled shapes are rejected. This unit sees the cache type's explicit instantiation
// declaration (api_cache.cuh): its kernels are compiled in api_cache.cu, so the tests here also
// check that a program built that way links and runs. Without a GPU every test says so and
// returns.

#include "api_cache.cuh"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

using host_cache = cache<format::dense>;
using test::device_cache;

cache_config api_config() {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 64;
  c.page_size = 64;
  c.max_pages = 64;
  c.max_sequences = 4;
  return c;
}

template <class T>
std::vector<T> converted(const std::vector<float>& x) {
  std::vector<T> out;
  for (const float v : x) out.push_back(T(v));
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("GPU plan and run: q and out in any type and stride, log-sum-exp, on one compiled shape",
                   "[gpu][api][sanitize]", float, kvmosaic::half, kvmosaic::bfloat16) {
  if (!gpu_available()) return;
  using T = TestType;
  const cache_config c = api_config();
  const int hq = c.num_q_heads(), d = c.head_dim;
  synthetic::kv_config g;
  g.num_kv_heads = c.num_kv_heads;
  g.group_size = c.group_size;
  g.head_dim = d;
  g.seed = 5;
  host_cache host(c);
  device_cache device(c);
  std::vector<sequence_id> seqs;
  std::vector<synthetic::kv_data> stored;
  for (int b = 0; b < 2; ++b) {
    const int tokens = b == 0 ? 3 * c.page_size + 7 : 40;
    const auto kv = synthetic::generate_kv(g, static_cast<std::uint64_t>(b), tokens);
    stored.push_back(test::rounded(kv, c.storage));
    const sequence_id h = host.add_sequence(), s = device.add_sequence();
    REQUIRE(h == s);
    host.prefill(h, test::k_view(kv), test::v_view(kv));
    device_array<float> k(kv.k), v(kv.v);
    device.prefill(s, tensor_view<const float, 3>(k.data(), tokens, c.num_kv_heads, d),
                   tensor_view<const float, 3>(v.data(), tokens, c.num_kv_heads, d));
    seqs.push_back(s);
  }
  const auto batch = static_cast<std::int64_t>(seqs.size());
  std::vector<float> q_float;
  for (int b = 0; b < 2; ++b) {
    const auto one = synthetic::generate_query(g, static_cast<std::uint64_t>(b), 100);
    q_float.insert(q_float.end(), one.begin(), one.end());
  }
  // q with every other head slot empty; out with channels reversed; lse strided.
  std::vector<float> q_padded(static_cast<std::size_t>(batch * 2 * hq * d), 0.0f);
  for (std::int64_t b = 0; b < batch; ++b)
    for (int j = 0; j < hq; ++j)
      for (int ch = 0; ch < d; ++ch)
        q_padded[static_cast<std::size_t>((b * 2 * hq + 2 * j) * d + ch)] = q_float[static_cast<std::size_t>((b * hq + j) * d + ch)];
  const std::vector<T> q_host = converted<T>(q_padded);
  device_array<T> q(q_host), out(q_host.size());
  device_array<float> lse(static_cast<std::size_t>(batch * 2 * hq));
  const auto q_view = tensor_view<const T, 3>::strided(q.data(), {batch, hq, d}, {2 * hq * d, 2 * d, 1});
  const auto out_view = tensor_view<T, 3>::strided(out.data() + d - 1, {batch, hq, d}, {2 * hq * d, 2 * d, -1});
  const auto lse_view = tensor_view<float, 2>::strided(lse.data(), {batch, hq}, {2 * hq, 2});
  device.plan(span<const sequence_id>(seqs.data(), batch));
  device.run(q_view, out_view, lse_view);
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());

  // The host backend on the same (rounded) queries, contiguous float.
  std::vector<float> q_used(static_cast<std::size_t>(batch * hq * d)), host_out(q_used.size()), host_lse(static_cast<std::size_t>(batch * hq));
  for (std::int64_t b = 0; b < batch; ++b)
    for (int j = 0; j < hq; ++j)
      for (int ch = 0; ch < d; ++ch)
        q_used[static_cast<std::size_t>((b * hq + j) * d + ch)] =
            to_float(q_host[static_cast<std::size_t>((b * 2 * hq + 2 * j) * d + ch)]);
  host.plan(span<const sequence_id>(seqs.data(), batch));
  host.run(tensor_view<const float, 3>(q_used.data(), batch, hq, d), tensor_view<float, 3>(host_out.data(), batch, hq, d),
           tensor_view<float, 2>(host_lse.data(), batch, hq));
  const std::vector<T> got = out.to_host(q_host.size());
  const std::vector<float> got_lse = lse.to_host(static_cast<std::size_t>(batch * 2 * hq));
  // Against fp64 exact attention on the stored values, within the fp32 bound with the device's
  // q and p split into two 16-bit halves (2^-16 relative each), plus out's rounding to T.
  const double split = device.engine().uses_bulk_copy() ? std::ldexp(1.0, -16) : 0.0;
  const double out_step = std::is_same<T, float>::value ? 0.0 : (std::is_same<T, kvmosaic::half>::value ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::vector<float> qb(q_used.begin() + b * hq * d, q_used.begin() + (b + 1) * hq * d);
    const auto exact = test::exact(qb, stored[static_cast<std::size_t>(b)], scale);
    const auto bound = test::attention_error_bound(qb, stored[static_cast<std::size_t>(b)], c.group_size, scale, c.storage,
                                                   c.page_size, true, split, device.engine().splits_p_on_tensor_cores() ? split : 0.0);
    for (int j = 0; j < hq; ++j) {
      for (int ch = 0; ch < d; ++ch) {
        INFO("batch " << b << ", head " << j << ", channel " << ch);
        const std::size_t i = static_cast<std::size_t>(j * d + ch);
        const double x = to_float(got[static_cast<std::size_t>((b * 2 * hq + 2 * j) * d + (d - 1 - ch))]);
        REQUIRE(std::abs(x - exact[i]) <= bound.per_element[i] + out_step * std::abs(exact[i]));
      }
      // log-sum-exp is 1-Lipschitz in the logits: its error is at most the largest logit error,
      // scale * sum |q_c k_c| times the q split's rounding and fp32 accumulation, plus the
      // host's own fp32 rounding of the same sums.
      const synthetic::kv_data& kv = stored[static_cast<std::size_t>(b)];
      double largest = 0;
      for (int t = 0; t < kv.num_tokens; ++t) {
        double magnitude = 0;
        for (int ch = 0; ch < d; ++ch) magnitude += std::abs(static_cast<double>(qb[static_cast<std::size_t>(j * d + ch)]) * kv.k_at(t, j / c.group_size, ch));
        largest = std::max(largest, scale * magnitude);
      }
      const double lse_bound = largest * (2 * split + 2 * (d + 8) * std::ldexp(1.0, -24)) + (kv.num_tokens + 64) * std::ldexp(1.0, -24) * (1 + std::abs(host_lse[static_cast<std::size_t>(b * hq + j)]));
      const float host_value = host_lse[static_cast<std::size_t>(b * hq + j)];
      REQUIRE(std::abs(got_lse[static_cast<std::size_t>(b * 2 * hq + 2 * j)] - host_value) <= lse_bound);
    }
  }
}

TEST_CASE("GPU a cache compiled for some kernel shapes rejects the others by name", "[gpu][api]") {
  if (!gpu_available()) return;
  cache_config c = api_config();
  c.head_dim = 128;
  CHECK_THROWS_WITH(device_cache(c), Catch::Contains("bf16/64/4"));
  c = api_config();
  c.storage = dtype::f16;
  CHECK_THROWS_AS(device_cache(c), invalid_argument);
}
