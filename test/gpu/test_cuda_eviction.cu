// SPDX-License-Identifier: Apache-2.0
// Eviction on the CUDA backend: after the same evictions, the device attends over exactly the
// host's live tokens (live-row masks staged with each step), for every format; pages freed by
// block-granular reclaim agree. Without a GPU every test says so and returns.

#include <algorithm>
#include <random>

#include "../support/feed.hpp"
#include "twin.hpp"

using namespace kvmosaic;
using test::device_array;
using test::gpu_available;

namespace {

template <class Format>
void check_eviction(const Format& format, int page_size) {
  cache_config c;
  c.num_kv_heads = 2;
  c.group_size = 4;
  c.head_dim = 128;
  c.page_size = page_size;
  c.max_pages = 128;
  c.max_sequences = 3;
  cache<Format, select::all, compact::repack> host(c, format);
  cache<Format, select::all, compact::repack, backend::cuda> device(c, format);
  std::vector<sequence_id> seqs;
  std::mt19937_64 rng(17);
  for (int b = 0; b < 3; ++b) {
    const int tokens = 9 * page_size + 5 + 7 * b;
    const auto kv = synthetic::generate_kv(test::generator_for(c, 30 + b), 0, tokens);
    const sequence_id h = host.add_sequence(), d = device.add_sequence();
    REQUIRE(h == d);
    host.prefill(h, test::k_view(kv), test::v_view(kv));
    device_array<float> k(kv.k), v(kv.v);
    device.prefill(d, tensor_view<const float, 3>(k.data(), tokens, c.num_kv_heads, c.head_dim),
                   tensor_view<const float, 3>(v.data(), tokens, c.num_kv_heads, c.head_dim));
    std::vector<std::int64_t> dead;
    const std::int64_t sealed = static_cast<std::int64_t>(host.pages(h).size()) * page_size;
    for (std::int64_t t = sink_rows(format); t < sealed; ++t)
      if (b > 0 && std::bernoulli_distribution(b == 1 ? 0.5 : 0.9)(rng)) dead.push_back(t);
    for (std::int64_t t = 2 * page_size; t < 3 * page_size && b == 2; ++t)  // and one whole page
      if (std::find(dead.begin(), dead.end(), t) == dead.end()) dead.push_back(t);
    std::sort(dead.begin(), dead.end());
    const span<const std::int64_t> positions(dead.data(), static_cast<std::int64_t>(dead.size()));
    host.evict(h, positions);
    device.evict(d, positions);
    REQUIRE(host.pages(h) == device.pages(d));
    REQUIRE(host.positions(h) == device.positions(d));
    seqs.push_back(h);
  }
  REQUIRE(host.pool().used_pages() == device.pool().used_pages());
  const int hq = c.num_q_heads(), d = c.head_dim;
  std::vector<float> q(3 * static_cast<std::size_t>(hq) * d);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.05f * static_cast<float>(i)) * 1.5f;
  std::vector<float> host_out(q.size());
  const span<const sequence_id> batch(seqs.data(), 3);
  host.attend(batch, tensor_view<const float, 3>(q.data(), 3, hq, d), tensor_view<float, 3>(host_out.data(), 3, hq, d));
  device_array<float> dq(q), dout(q.size());
  device.attend(batch, tensor_view<const float, 3>(dq.data(), 3, hq, d), tensor_view<float, 3>(dout.data(), 3, hq, d));
  KVMOSAIC_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> gpu_out = dout.to_host(q.size());
  // The host reads exactly the live tokens (test_eviction.cpp); the device must agree with it to
  // the formats' own host-device tolerance: a few fp32 ulps of the outputs' scale for dense and
  // bitmap_tiles (order of summation, q and p split in two 16-bit halves on tensor cores), one
  // 8-bit rounding step of p for quant2.
  const double tolerance = std::is_same<Format, format::quant2>::value ? 2e-2 : 2e-3;
  double worst = 0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    REQUIRE(std::isfinite(gpu_out[i]));
    worst = std::max(worst, static_cast<double>(std::abs(gpu_out[i] - host_out[i])));
  }
  INFO("largest |gpu - host| " << worst);
  CHECK(worst <= tolerance);
  // And evicted tokens are really skipped: attending with them would differ by far more.
  cache<Format, select::all, compact::repack> unevicted(c, format);
  for (int b = 0; b < 3; ++b) {
    const int tokens = 9 * page_size + 5 + 7 * b;
    const auto kv = synthetic::generate_kv(test::generator_for(c, 30 + b), 0, tokens);
    unevicted.prefill(unevicted.add_sequence(), test::k_view(kv), test::v_view(kv));
  }
  std::vector<float> all_out(q.size());
  unevicted.attend(batch, tensor_view<const float, 3>(q.data(), 3, hq, d), tensor_view<float, 3>(all_out.data(), 3, hq, d));
  double moved = 0;
  for (std::size_t i = 2 * static_cast<std::size_t>(hq) * d; i < q.size(); ++i)
    moved = std::max(moved, static_cast<double>(std::abs(all_out[i] - host_out[i])));
  CHECK(moved > 10 * worst);
}

}  // namespace

TEST_CASE("GPU eviction: the device attends over the host's live tokens, every format", "[gpu][eviction][sanitize]") {
  if (!gpu_available()) return;
  check_eviction(format::dense{}, 16);
  check_eviction(format::dense{}, 64);
  format::bitmap_tiles b;
  b.s_k = 0.5f;
  b.s_v = 0.5f;
  check_eviction(b, 64);
  format::quant2 q2;
  q2.partition = 32;
  q2.mode = format::rounding::nearest;
  check_eviction(q2, 32);
}
